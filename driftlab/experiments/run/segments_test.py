"""Honest resume: a setting outside the run's identity changed between an interruption and its resume either leaves
every byte as an uninterrupted run's (compared here), or is warned about; run.json lists each segment's settings."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.experiments.run import segments
from driftlab.experiments.run.segments import ResumeChangeWarning, changes, kept_segments
from driftlab.experiments.run.testing import RESUMABLE_RUN, run_records, without_wall_time

# SCAFFOLD keeps a state per client, so the client-state store holds something to move between memory and disk.
TINY = [*RESUMABLE_RUN, "algorithm.name=scaffold"]


def _records(out: Path) -> list[dict]:
    return without_wall_time(run_records(out))


def _final_bytes(out: Path) -> bytes:
    return load_file(str(out / "final_model.safetensors"))["params"].numpy().tobytes()


def _segments(out: Path) -> list[dict]:
    return json.loads((out / "run.json").read_text())["segments"]


@pytest.fixture
def threads():
    """Sets torch's intra-op threads for a test, and puts them back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("uninterrupted") / "run"
        driftlab.run(None, out, overrides=TINY)
    finally:
        torch.set_num_threads(before)
    return out


def _killed_after_round_3(tmp_path: Path, overrides: list[str]) -> Path:
    """The run directory as a SIGKILL right after round 3 leaves it (checkpoint and run.json at round 2)."""
    out, killed = tmp_path / "run", tmp_path / "killed"

    def snapshot(record):
        if record["round"] == 3:
            shutil.copytree(out, killed)

    driftlab.run(None, out, overrides=overrides, progress=snapshot)
    return killed


def _resumed_without_warning(out: Path, overrides: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeChangeWarning)
        driftlab.run(None, out, resume=True, overrides=overrides)


# ------------------------------------------------------------------ proven invariant: the bytes are compared


@pytest.mark.parametrize(
    "started, resumed, store",
    [
        ([], ["state.store=disk"], "disk"),  # the checkpoint's client states go into the disk store
        (
            ["state.store=disk"],
            ["state.store=memory"],
            "disk",
        ),  # a disk checkpoint resumes on disk whatever the key says
        ([], ["checkpoint_every=1", "keep_checkpoint=true"], "memory"),
        ([], ["memory_budget=8GiB"], "memory"),  # the same 1 GiB waves as no budget: nothing that sizes work changed
    ],
)
def test_a_resume_that_changes_only_where_states_live_or_what_is_kept_is_exact(
    tmp_path, threads, uninterrupted, started, resumed, store
):
    threads(1)
    killed = _killed_after_round_3(tmp_path, [*TINY, *started])
    _resumed_without_warning(killed, [*TINY, *resumed])
    assert _records(killed) == _records(uninterrupted)
    assert _final_bytes(killed) == _final_bytes(uninterrupted)
    first, second = _segments(killed)
    assert first["rounds"] == [1, 2] and second["rounds"] == [3, 6]  # round 3 of the killed process is recomputed
    assert second["state_store"] == store and "changed" not in second


# ------------------------------------------------------------------ not invariant: warned about, named


def test_a_resume_with_other_threads_warns_naming_them_and_run_json_keeps_both_segments(tmp_path, threads):
    threads(1)
    killed = _killed_after_round_3(tmp_path, TINY)
    threads(2)
    with pytest.warns(ResumeChangeWarning) as caught:
        driftlab.run(None, killed, resume=True, overrides=TINY)
    (message,) = [str(w.message) for w in caught if w.category is ResumeChangeWarning]
    assert "at round 2 with 2 torch threads, where rounds up to it ran with 1" in message
    assert "last bits of the result may differ from an uninterrupted run" in message
    first, second = _segments(killed)
    assert (first["rounds"], first["torch_threads"], second["rounds"], second["torch_threads"]) == (
        [1, 2],
        1,
        [3, 6],
        2,
    )
    assert second["changed"] == [message]
    assert json.loads((killed / "run.json").read_text())["machine"]["torch_threads"] == 2  # the key reports read stays


def test_a_resume_whose_memory_budget_sizes_waves_otherwise_warns_naming_the_key_and_both_values(tmp_path, threads):
    threads(1)
    killed = _killed_after_round_3(tmp_path, TINY)
    with pytest.warns(ResumeChangeWarning) as caught:
        driftlab.run(None, killed, resume=True, overrides=[*TINY, "memory_budget=1MB"])
    (message,) = [str(w.message) for w in caught if w.category is ResumeChangeWarning]
    # 1 MB / ROUND_SHARE = 125000 bytes of waves, against the unconfigured budget's 1 GiB
    assert 'memory_budget="1MB", where rounds up to it ran with memory_budget=none' in message
    assert "waves and CPU chunks fit 125000 bytes, not 1073741824 bytes" in message
    first, second = _segments(killed)
    assert (first["round_bytes"], first["memory_budget"], second["round_bytes"], second["memory_budget"]) == (
        1 << 30,
        None,
        125000,
        "1MB",
    )
    # Per client (setup.wave_size): its SCAFFOLD state c_k twice and five model-sized vectors, the logistic
    # regression's 60 x 10 + 10 = 610 float32 parameters each: 7 x 2440 = 17080 bytes.
    assert (first["wave_size"], second["wave_size"]) == ((1 << 30) // 17080, 125000 // 17080) == (62865, 7)


def test_a_run_json_written_before_segments_gives_its_one_segment_from_its_machine_entry(tmp_path, threads):
    threads(1)
    killed = _killed_after_round_3(tmp_path, [*TINY, "memory_budget=1MB"])
    info = json.loads((killed / "run.json").read_text())
    del info["segments"]
    (killed / "run.json").write_text(json.dumps(info))
    threads(2)
    with pytest.warns(ResumeChangeWarning, match="with 2 torch threads, where rounds up to it ran with 1"):
        driftlab.run(None, killed, resume=True, overrides=[*TINY, "memory_budget=1MB"])
    first, second = _segments(killed)
    assert first == {
        "rounds": [1, 2],
        "torch_threads": 1,
        "device": "cpu",
        "backend": "vectorized",
        "round_bytes": 125000,
        "memory_budget": "1MB",
    }
    assert second["rounds"] == [3, 6]


def test_resuming_a_completed_run_runs_nothing_so_warns_about_nothing(tmp_path, threads):
    threads(1)
    out = tmp_path / "run"
    driftlab.run(None, out, overrides=TINY)
    threads(2)
    _resumed_without_warning(out, TINY)
    (only,) = _segments(out)
    assert only["rounds"] == [1, 6] and only["torch_threads"] == 1


# ------------------------------------------------------------------ the comparison itself


CPU = {
    "rounds": [1, 4],
    "torch_threads": 4,
    "device": "cpu",
    "backend": "vectorized",
    "memory_budget": None,
    "round_bytes": 1 << 30,
}
GPU = {**CPU, "device": "cuda:0", "chunk_bytes": {"cuda:0": 60_000_000_000}}


def test_another_device_is_named_once_and_a_gpus_thread_count_is_not_warned_about():
    (message,) = changes(CPU, {**GPU, "rounds": [5, 4], "torch_threads": 8}, Path("runs/a"))
    assert message.startswith("resuming runs/a at round 4 with device=cuda:0, where rounds up to it ran on cpu")
    assert changes(GPU, {**GPU, "rounds": [5, 4], "torch_threads": 8}, Path("runs/a")) == []


def test_a_gpus_chunks_sized_otherwise_name_memory_budget_though_the_key_is_unchanged():
    (message,) = changes(GPU, {**GPU, "rounds": [5, 4], "chunk_bytes": {"cuda:0": 30_000_000_000}}, Path("runs/a"))
    assert "memory_budget=none, where rounds up to it ran with memory_budget=none" in message
    assert "GPU chunks fit cuda:0 30000000000 bytes, not cuda:0 60000000000 bytes" in message


def test_another_backend_on_the_same_device_is_named():
    (message,) = changes(CPU, {**CPU, "rounds": [5, 4], "backend": "sequential"}, Path("runs/a"))
    assert "on the sequential backend, where rounds up to it ran on the vectorized backend" in message


def test_kept_segments_are_cut_at_the_checkpoint_and_those_recomputed_entirely_dropped():
    info = {"segments": [{**CPU, "rounds": [1, 4]}, {**CPU, "rounds": [5, 9]}, {**CPU, "rounds": [10, 11]}]}
    kept = kept_segments({"info": info, "memory_budget": None}, 8)
    assert [s["rounds"] for s in kept] == [[1, 4], [5, 8]]
    # Killed after writing its checkpoint of round 8 but before run.json said so (it says 6): it wrote round 8.
    info = {"segments": [{**CPU, "rounds": [1, 4]}, {**CPU, "rounds": [5, 6]}, {**CPU, "rounds": [9, 8]}]}
    assert [s["rounds"] for s in kept_segments({"info": info, "memory_budget": None}, 8)] == [[1, 4], [5, 8]]
    assert kept_segments({"info": info, "memory_budget": None}, 0) == []  # started again from round 0
    assert segments.SEGMENTS_KEY == "segments"
