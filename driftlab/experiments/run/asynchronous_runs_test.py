"""Asynchronous FedBuff runs end to end (driftlab.run): records, exact resume with clients in flight, refusals."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import driftlab
from driftlab.errors import ConfigError
from driftlab.experiments.run.testing import FEDBUFF_RUN, run_records, without_wall_time


def _killed_after_update(tmp_path: Path, update: int, overrides: list[str]) -> tuple[Path, Path]:
    """The run to its end in tmp_path/run, and a copy of its directory as it was right after ``update``'s record."""
    out, killed = tmp_path / "run", tmp_path / "killed"

    def snapshot(record):
        if record["round"] == update:
            shutil.copytree(out, killed)

    driftlab.run(None, out, overrides=[*overrides, "keep_checkpoint=true"], progress=snapshot)
    return out, killed


def test_a_run_records_each_server_update():
    result = driftlab.run(None, overrides=FEDBUFF_RUN)
    records = result.records
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["num_reporting"] == r["num_selected"] == 2 == len(r["reporting_clients"]) for r in records)
    assert [r["time_start"] for r in records[1:]] == [r["time_end"] for r in records[:-1]] and records[0][
        "time_start"
    ] == 0.0
    assert all(r["time_end"] >= r["time_start"] for r in records)
    assert records[0]["num_dispatched"] >= 5 and records[0]["max_staleness"] == 0
    bits = records[0]["download_bits"] // records[0]["num_dispatched"]
    assert all(r["download_bits"] == r["num_dispatched"] * bits and r["upload_bits"] == 2 * bits for r in records)
    assert any(r["max_staleness"] > 0 for r in records)
    assert all(0 <= r["mean_staleness"] <= r["max_staleness"] for r in records)
    assert not {"num_inactive", "num_incomplete", "num_missed_deadline", "num_not_awaited"} & set(records[0])


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
@pytest.mark.parametrize("killed_after", [3, 4])  # between two checkpoints (round 3 is recomputed), and at one
def test_resume_with_clients_in_flight_equals_the_uninterrupted_run(tmp_path, backend, killed_after):
    overrides = [*FEDBUFF_RUN, f"backend={backend}"]
    out, killed = _killed_after_update(tmp_path, killed_after, overrides)
    with safe_open(str(killed / "checkpoint.safetensors"), framework="pt") as handle:
        assert int(handle.metadata()["round"]) == (4 if killed_after == 4 else 2)
        # four clients in flight across the checkpoint; the slot of the arrival that completed the buffer is refilled
        # when the next update starts
        assert handle.get_tensor("engine/async/clients").shape == (4, 6)
        assert handle.get_tensor("engine/async/idle_slots").item() == 1
        assert (
            handle.get_tensor("engine/clock").item()
            == run_records(out)[int(handle.metadata()["round"]) - 1]["time_end"]
        )
    driftlab.run(None, killed, resume=True, overrides=overrides)
    assert without_wall_time(run_records(killed)) == without_wall_time(run_records(out))
    assert torch.equal(
        load_file(str(killed / "final_model.safetensors"))["params"],
        load_file(str(out / "final_model.safetensors"))["params"],
    )


def test_a_checkpoint_holds_trained_and_untrained_clients_in_flight(tmp_path):
    # C = 8, B = 2: most clients in flight at a boundary were dispatched but not yet needed, some already trained
    out = tmp_path / "run"
    driftlab.run(None, out, overrides=[*FEDBUFF_RUN, "asynchronous.concurrency=8", "rounds=4", "keep_checkpoint=true"])
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as handle:
        trained = handle.get_tensor("engine/async/clients")[:, 5]
        assert 0 < int(trained.sum()) < len(trained) == 7
        names = set(handle.keys())
    assert any(name.startswith("engine/async/result/") for name in names)
    assert any(name.startswith("engine/async/view/") for name in names)


def test_fedprox_runs_asynchronously():
    overrides = [o for o in FEDBUFF_RUN if not o.startswith("algorithm.")]
    result = driftlab.run(
        None,
        overrides=[
            *overrides,
            "rounds=2",
            "algorithm.name=fedprox",
            "algorithm.mu=0.1",
            "algorithm.aggregation=uniform",
        ],
    )
    assert [r["round"] for r in result.records] == [1, 2]


@pytest.mark.parametrize("algorithm", ["scaffold", "fedavg"])  # fedavg: weighted aggregation, the default
def test_algorithms_without_an_asynchronous_rule_are_refused(algorithm):
    overrides = [o for o in FEDBUFF_RUN if not o.startswith("algorithm.")] + [f"algorithm.name={algorithm}"]
    with pytest.raises(ConfigError, match="asynchron"):
        driftlab.run(None, overrides=overrides)


def test_results_in_flight_beyond_the_memory_budget_are_refused(tmp_path):
    # the default model: 610 float32 parameters, 2440 bytes a held change; 5 in flight = 12200 bytes > 40000 / 8
    with pytest.raises(
        ConfigError, match=r"12200 bytes .* 5000 bytes .*lower asynchronous.concurrency or raise memory_budget"
    ):
        driftlab.run(None, tmp_path / "run", overrides=[*FEDBUFF_RUN, "memory_budget=40000"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
