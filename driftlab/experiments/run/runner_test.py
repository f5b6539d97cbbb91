"""driftlab.run end to end: reproducibility, exact resume (kills, torn files, interrupts), outputs, data errors."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import driftlab
from driftlab.algorithms import ALGORITHMS, fedavg
from driftlab.data.federated import DataFileError, FederatedArrays
from driftlab.experiments.config import ConfigError
from driftlab.experiments.run import lifecycle, run_directory, runner
from driftlab.experiments.run.real_data import needs_real_data
from driftlab.experiments.run.testing import RESUMABLE_RUN, run_records, without_wall_time
from driftlab.simulation.seam import GradientCorrection
from driftlab.simulation.state import checkpoint as checkpoint_module

REPO_ROOT = Path(driftlab.__file__).resolve().parents[1]

OPTIMIZERS = {"sgd": [], "adam": ["server.optimizer=adam", "server.lr=0.01"]}


def _final_params(out: Path) -> torch.Tensor:
    return load_file(str(out / "final_model.safetensors"))["params"]


def _checkpoint_round(out: Path) -> int:
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as handle:
        return int(handle.metadata()["round"])


def _assert_same_run(a: Path, b: Path) -> None:
    records_a, records_b = run_records(a), run_records(b)
    assert [r["round"] for r in records_a] == [r["round"] for r in records_b]
    assert without_wall_time(records_a) == without_wall_time(records_b)
    assert torch.equal(_final_params(a), _final_params(b))


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs to compare resumed ones with."""
    runs = {}
    for name, extra in OPTIMIZERS.items():
        out = tmp_path_factory.mktemp(f"reference-{name}") / "run"
        driftlab.run(
            None, out, overrides=[*RESUMABLE_RUN, *extra, "keep_checkpoint=true"]
        )  # tests edit its final checkpoint
        runs[name] = out
    return runs


# ------------------------------------------------------------------ reproducibility


def test_same_seed_same_metrics_different_seed_differs():
    first = driftlab.run(None, overrides=RESUMABLE_RUN)
    second = driftlab.run(None, overrides=RESUMABLE_RUN)
    assert without_wall_time(first.records) == without_wall_time(second.records)
    assert torch.equal(first.final_params, second.final_params)
    assert all(r["round_seconds"] > 0 for r in first.records)

    other = driftlab.run(None, overrides=[*RESUMABLE_RUN, "seed=2"])
    assert [r["reporting_clients"] for r in other.records] != [r["reporting_clients"] for r in first.records]
    assert [r["test_accuracy"] for r in other.records] != [r["test_accuracy"] for r in first.records]
    assert not torch.equal(other.final_params, first.final_params)


def test_outputs_of_a_run(tmp_path):
    out = tmp_path / "run"
    result = driftlab.run(None, out, overrides=RESUMABLE_RUN)
    assert {p.name for p in out.iterdir()} >= {"config.json", "metrics.jsonl", "final_model.safetensors"}
    assert run_records(out) == result.records
    assert torch.equal(_final_params(out), result.final_params)
    assert not (out / "checkpoint.safetensors").exists()  # keep_checkpoint=false: a completed run drops it
    assert json.loads((out / "config.json").read_text())["rounds"] == 6
    assert result.frame().shape[0] == 6


# ------------------------------------------------------------------ resume exactness


def _killed_after_round(tmp_path: Path, round_index: int, overrides: list[str]) -> tuple[Path, Path]:
    """Run to the end in ``tmp_path/run``, copying the output directory as it is on disk right after round
    ``round_index`` to ``tmp_path/killed``: what a SIGKILL at that moment leaves.  Returns (run, killed)."""
    out, killed = tmp_path / "run", tmp_path / "killed"

    def snapshot(record):
        if record["round"] == round_index:
            shutil.copytree(out, killed)

    driftlab.run(None, out, overrides=overrides, progress=snapshot)
    return out, killed


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_resume_after_a_kill_between_checkpoints_is_exact(tmp_path, reference_runs, optimizer):
    """The output directory as it is on disk right after round 5 (checkpoint at 4) resumes exactly."""
    _, killed = _killed_after_round(tmp_path, 5, [*RESUMABLE_RUN, *OPTIMIZERS[optimizer]])
    assert _checkpoint_round(killed) == 4 and len(run_records(killed)) == 5
    assert not (killed / "final_model.safetensors").exists()

    resumed = driftlab.run(None, killed, resume=True, overrides=[*RESUMABLE_RUN, *OPTIMIZERS[optimizer]])
    assert [r["round"] for r in resumed.records] == list(range(1, 7))
    _assert_same_run(killed, reference_runs[optimizer])


class _Killed(BaseException):
    """Stands for SIGKILL: no handler runs after it (the runner's checkpoint-on-exit fails too)."""


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_kill_in_the_middle_of_a_checkpoint_write(tmp_path, monkeypatch, reference_runs, optimizer):
    out = tmp_path / "run"
    real_save_tensors = checkpoint_module.save_tensors
    calls = []

    def save_half_then_die(tensors, filename, metadata=None):
        calls.append(metadata["round"])
        real_save_tensors(tensors, filename, metadata=metadata)
        if metadata["round"] == "4":
            size = os.path.getsize(filename)
            with open(filename, "r+b") as handle:
                handle.truncate(size // 2)
            raise _Killed()

    monkeypatch.setattr(checkpoint_module, "save_tensors", save_half_then_die)
    with pytest.raises(_Killed):
        driftlab.run(None, out, overrides=[*RESUMABLE_RUN, *OPTIMIZERS[optimizer]])
    assert calls[:2] == ["2", "4"]
    # the previous checkpoint is intact and readable
    assert _checkpoint_round(out) == 2
    load_file(str(out / "checkpoint.safetensors"))

    monkeypatch.setattr(checkpoint_module, "save_tensors", real_save_tensors)
    driftlab.run(None, out, resume=True, overrides=[*RESUMABLE_RUN, *OPTIMIZERS[optimizer]])
    _assert_same_run(out, reference_runs["sgd" if optimizer == "sgd" else "adam"])


def test_kill_at_the_rename_of_a_checkpoint(tmp_path, monkeypatch, reference_runs):
    out = tmp_path / "run"
    real_replace = os.replace
    replaced = []

    def replace_or_die(source, target):
        if Path(target).name == "checkpoint.safetensors":
            replaced.append(target)
            if len(replaced) >= 2:  # the round-4 checkpoint is fully written but never renamed into place
                raise _Killed()
        return real_replace(source, target)

    monkeypatch.setattr(checkpoint_module.os, "replace", replace_or_die)
    with pytest.raises(_Killed):
        driftlab.run(None, out, overrides=RESUMABLE_RUN)
    monkeypatch.setattr(checkpoint_module.os, "replace", real_replace)
    assert _checkpoint_round(out) == 2
    driftlab.run(None, out, resume=True, overrides=RESUMABLE_RUN)
    _assert_same_run(out, reference_runs["sgd"])


def test_a_resume_removes_what_killed_writes_left_and_nothing_else_and_writes_a_new_files_mode(
    tmp_path, reference_runs
):
    """A kill in a write leaves `.NAME.tmp-PID` (write_atomically's temporary: 57 MB for a large checkpoint);
    the resume deletes those of the run's own files, exactly, and its files get 0666 less the umask (safetensors'
    own writer made the checkpoint and final model 0600)."""
    _, killed = _killed_after_round(tmp_path, 5, RESUMABLE_RUN)
    ours = [
        ".checkpoint.safetensors.tmp-4242",
        ".final_model.safetensors.tmp-4242",
        ".run.json.tmp-77",
        ".metrics.csv.tmp-9",
    ]
    users = [".tmpAbC123", ".checkpoint.safetensors.tmp-mine", "notes.txt"]  # not driftlab's pattern: kept
    for name in ours + users:
        (killed / name).write_bytes(b"\0" * 1000)
    previous = os.umask(0o022)
    try:
        driftlab.run(None, killed, resume=True, overrides=RESUMABLE_RUN)
    finally:
        os.umask(previous)
    assert [name for name in ours if (killed / name).exists()] == []
    assert [name for name in users if (killed / name).exists()] == users
    _assert_same_run(killed, reference_runs["sgd"])
    rewritten = ["final_model.safetensors", "metrics.jsonl", "metrics.csv", "run.json", "config.json"]
    assert {name: oct(os.stat(killed / name).st_mode & 0o777) for name in rewritten} == {
        name: "0o644" for name in rewritten
    }


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path, reference_runs):
    out, killed = _killed_after_round(tmp_path, 4, RESUMABLE_RUN)  # checkpoint at 4, metrics through 4
    full_line_5 = (out / "metrics.jsonl").read_text().splitlines()[4]
    with open(killed / "metrics.jsonl", "a") as handle:
        handle.write(full_line_5[: len(full_line_5) // 2])  # killed while writing round 5's line
    with pytest.raises(json.JSONDecodeError):
        run_records(killed)

    driftlab.run(None, killed, resume=True, overrides=RESUMABLE_RUN)
    _assert_same_run(killed, reference_runs["sgd"])


def test_resume_without_any_checkpoint_starts_over_exactly(tmp_path, reference_runs):
    _, killed = _killed_after_round(tmp_path, 1, RESUMABLE_RUN)  # metrics written, no checkpoint yet
    assert not (killed / "checkpoint.safetensors").exists()
    driftlab.run(None, killed, resume=True, overrides=RESUMABLE_RUN)
    _assert_same_run(killed, reference_runs["sgd"])


def test_keyboard_interrupt_leaves_a_checkpoint_of_the_last_completed_round(tmp_path, monkeypatch, reference_runs):
    overrides = [*RESUMABLE_RUN, "checkpoint_every=100"]  # no checkpoint but the one the interrupt writes
    out = tmp_path / "run"
    real_run_round = runner.run_round
    _stopped_before_round(3, KeyboardInterrupt(), monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        driftlab.run(None, out, overrides=overrides)
    assert _checkpoint_round(out) == 2
    assert [r["round"] for r in run_records(out)] == [1, 2]

    monkeypatch.setattr(runner, "run_round", real_run_round)
    driftlab.run(None, out, resume=True, overrides=overrides)
    _assert_same_run(out, reference_runs["sgd"])


def test_interrupt_while_writing_a_metrics_line_loses_no_round(tmp_path, monkeypatch, reference_runs):
    overrides = [*RESUMABLE_RUN, "checkpoint_every=100"]
    out = tmp_path / "run"
    real_append = run_directory.append_record

    def torn_append(path, record):
        if record["round"] == 3:
            with open(path, "a") as handle:
                handle.write(json.dumps(record)[:20])  # Ctrl-C lands mid-write
            raise KeyboardInterrupt
        real_append(path, record)

    monkeypatch.setattr(run_directory, "append_record", torn_append)
    with pytest.raises(KeyboardInterrupt):
        driftlab.run(None, out, overrides=overrides)
    monkeypatch.setattr(run_directory, "append_record", real_append)
    driftlab.run(None, out, resume=True, overrides=overrides)
    assert [r["round"] for r in run_records(out)] == list(range(1, 7))
    _assert_same_run(out, reference_runs["sgd"])


# A toy algorithm with per-client state (like SCAFFOLD's c_k): the state feeds the local objective.
@dataclasses.dataclass(frozen=True)
class _Drift:
    h: torch.Tensor


def _stateful_entry():
    def from_config(config, server_optimizer):
        base = fedavg.build(server_optimizer)

        def client_objective(server, client_state, context):
            return GradientCorrection(linear=client_state.h)

        def client_finish(server, client_state, context, update):
            h = client_state.h + 0.5 * (update.start_params - update.final_params)
            return _Drift(h), fedavg.ClientMessage(update.final_params, context.num_samples, context.multiplicity)

        return dataclasses.replace(
            base,
            client_state_init=lambda theta: _Drift(torch.zeros_like(theta)),
            client_objective=client_objective,
            client_finish=client_finish,
        )

    return dataclasses.replace(ALGORITHMS["fedavg"], from_config=from_config)


def test_interrupt_inside_a_round_of_a_stateful_algorithm_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "fedavg", _stateful_entry())
    overrides = [*RESUMABLE_RUN, "checkpoint_every=100", "sampling.participation=1.0"]
    reference = tmp_path / "reference"
    driftlab.run(None, reference, overrides=overrides)

    from driftlab.simulation.round import engine

    real_evaluate = engine.evaluate
    calls = []

    def evaluate_interrupted_at_round_3(sim, params):
        calls.append(1)
        if len(calls) == 3:  # evaluation.every=1: the third evaluation is round 3's
            raise KeyboardInterrupt
        return real_evaluate(sim, params)

    monkeypatch.setattr(engine, "evaluate", evaluate_interrupted_at_round_3)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        driftlab.run(None, out, overrides=overrides)
    monkeypatch.setattr(engine, "evaluate", real_evaluate)
    assert _checkpoint_round(out) == 2
    driftlab.run(None, out, resume=True, overrides=overrides)
    _assert_same_run(out, reference)


def test_stateful_toy_algorithm_resumes_exactly_between_rounds(tmp_path, monkeypatch):
    """Control for the test above: the same algorithm resumes exactly from a kill between rounds."""
    monkeypatch.setitem(ALGORITHMS, "fedavg", _stateful_entry())
    overrides = [*RESUMABLE_RUN, "sampling.participation=1.0"]
    reference = tmp_path / "reference"
    driftlab.run(None, reference, overrides=overrides)
    _, killed = _killed_after_round(tmp_path, 3, overrides)
    driftlab.run(None, killed, resume=True, overrides=overrides)
    _assert_same_run(killed, reference)
    monkeypatch.undo()
    plain = driftlab.run(None, overrides=overrides)
    assert not torch.equal(plain.final_params, _final_params(reference))  # the client state matters


def test_resume_can_extend_the_number_of_rounds(tmp_path):
    overrides = [*RESUMABLE_RUN, "checkpoint_every=3"]
    reference = tmp_path / "reference"
    driftlab.run(None, reference, overrides=overrides)
    out = tmp_path / "run"
    driftlab.run(None, out, overrides=[*overrides, "rounds=4"])
    driftlab.run(None, out, resume=True, overrides=overrides)
    _assert_same_run(out, reference)


def test_resuming_a_finished_run_changes_nothing(tmp_path, reference_runs):
    out = tmp_path / "run"
    shutil.copytree(reference_runs["sgd"], out)
    result = driftlab.run(None, out, resume=True, overrides=RESUMABLE_RUN)
    assert [r["round"] for r in result.records] == list(range(1, 7))
    _assert_same_run(out, reference_runs["sgd"])


# ------------------------------------------------------------------ refusals


def test_resuming_with_a_different_config_is_refused(tmp_path, reference_runs):
    out = tmp_path / "run"
    shutil.copytree(reference_runs["sgd"], out)
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError) as error:
        driftlab.run(None, out, resume=True, overrides=[*RESUMABLE_RUN, "client.lr=0.5"])
    message = str(error.value)
    assert "cannot resume" in message and "differs" in message and "config.json" in message
    assert (out / "metrics.jsonl").read_text() == before  # nothing touched


def test_a_checkpoint_from_another_config_is_refused_even_without_config_json(tmp_path, reference_runs):
    out = tmp_path / "run"
    shutil.copytree(reference_runs["sgd"], out)
    (out / "config.json").unlink()
    with pytest.raises(checkpoint_module.CheckpointError, match="different experiment configuration"):
        driftlab.run(None, out, resume=True, overrides=[*RESUMABLE_RUN, "client.lr=0.5"])


def test_a_new_run_in_a_directory_holding_a_run_is_refused(tmp_path, reference_runs):
    out = tmp_path / "run"
    shutil.copytree(reference_runs["sgd"], out)
    with pytest.raises(ConfigError, match="--resume"):
        driftlab.run(None, out, overrides=RESUMABLE_RUN)
    with pytest.raises(ConfigError, match="does not exist"):
        driftlab.run(None, tmp_path / "missing", resume=True, overrides=RESUMABLE_RUN)
    with pytest.raises(ConfigError, match="--out"):
        driftlab.run(None, resume=True, overrides=RESUMABLE_RUN)


# ------------------------------------------------------------------ synthetic(α,β) integration


REQUIRED = {
    "round",
    "round_seconds",
    "num_reporting",
    "reporting_clients",
    "local_steps",
    "upload_bits",
    "download_bits",
}
EVALUATED = {"test_accuracy", "test_loss", "train_loss"}


def test_synthetic_defaults_and_per_round_records(tmp_path):
    import pandas as pd

    out = tmp_path / "run"
    result = driftlab.run(None, out, overrides=["rounds=7", "evaluation.every=3", "client.steps=2"])
    sim, _ = runner.build_simulation(result.config)
    assert result.config.data.name == "synthetic"
    assert sim.data.num_clients == 30
    assert sim.data.input_shape == (60,) and sim.data.num_classes == 10
    for record in result.records:
        assert REQUIRED <= set(record)
        assert record["num_reporting"] == len(record["reporting_clients"]) == 3  # 10% of 30
        assert all(0 <= k < 30 for k in record["reporting_clients"])
        assert record["local_steps"] == 6
    assert [r["round"] for r in result.records if EVALUATED <= set(r)] == [3, 6, 7]
    assert all(not (EVALUATED & set(r)) for r in result.records if r["round"] not in (3, 6, 7))
    for record in result.records:
        if "test_accuracy" in record:
            assert 0.0 <= record["test_accuracy"] <= 1.0 and record["test_loss"] > 0 and record["train_loss"] > 0

    frame = pd.read_json(out / "metrics.jsonl", lines=True)
    assert len(frame) == 7
    assert REQUIRED | EVALUATED <= set(frame.columns)
    assert frame["round"].tolist() == list(range(1, 8))
    assert frame["test_accuracy"].notna().tolist() == [False, False, True, False, False, True, True]


def test_training_improves_the_model_on_synthetic_iid():
    result = driftlab.run(
        None,
        overrides=[
            "data.name=synthetic_iid",
            "data.num_clients=6",
            "rounds=8",
            "sampling.participation=0.5",
            "client.steps=20",
            "client.lr=0.05",
        ],
    )
    assert result.records[-1]["train_loss"] < result.records[0]["train_loss"]


# ------------------------------------------------------------------ MNIST files through driftlab.run


def _idx(dtype_code: int, shape: tuple[int, ...], payload: bytes) -> bytes:
    return bytes([0, 0, dtype_code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape) + payload


def _write_mnist(root: Path, n_train: int = 20, n_test: int = 10) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        (root / f"{prefix}-images-idx3-ubyte").write_bytes(_idx(0x08, (n, 28, 28), images.tobytes()))
        (root / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx(0x08, (n,), labels.tobytes()))


MNIST_TINY = ["data.name=mnist", "data.num_clients=4", "rounds=1", "client.steps=1", "sampling.participation=0.5"]


def test_tiny_valid_idx_files_run(tmp_path):
    _write_mnist(tmp_path / "mnist")
    result = driftlab.run(None, overrides=[*MNIST_TINY, f"data.root={tmp_path / 'mnist'}"])
    assert result.num_parameters == 784 * 10 + 10
    assert "test_accuracy" in result.records[-1]


def test_truncated_idx_file_is_named(tmp_path):
    root = tmp_path / "mnist"
    _write_mnist(root)
    path = root / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[: 16 + 5 * 784])  # header says 20 images, the data holds 5
    with pytest.raises(DataFileError) as error:
        driftlab.run(None, overrides=[*MNIST_TINY, f"data.root={root}"])
    assert "train-images-idx3-ubyte" in str(error.value)
    assert "byte" in str(error.value)


def test_truncated_gzip_file_is_named(tmp_path):
    root = tmp_path / "mnist"
    _write_mnist(root)
    plain = root / "t10k-labels-idx1-ubyte"
    compressed = gzip.compress(plain.read_bytes())
    plain.unlink()
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(DataFileError, match="t10k-labels-idx1-ubyte.gz"):
        driftlab.run(None, overrides=[*MNIST_TINY, f"data.root={root}"])


def test_swapped_image_and_label_files_are_named(tmp_path):
    root = tmp_path / "mnist"
    _write_mnist(root)
    images, labels = root / "train-images-idx3-ubyte", root / "train-labels-idx1-ubyte"
    images_bytes, labels_bytes = images.read_bytes(), labels.read_bytes()
    images.write_bytes(labels_bytes)
    labels.write_bytes(images_bytes)
    with pytest.raises(DataFileError) as error:
        driftlab.run(None, overrides=[*MNIST_TINY, f"data.root={root}"])
    message = str(error.value)
    assert "train-images-idx3-ubyte" in message and "label" in message


def test_label_file_from_the_other_split_is_named(tmp_path):
    root = tmp_path / "mnist"
    _write_mnist(root, n_train=20, n_test=10)
    shutil.copy(root / "t10k-labels-idx1-ubyte", root / "train-labels-idx1-ubyte")
    with pytest.raises(DataFileError) as error:
        driftlab.run(None, overrides=[*MNIST_TINY, f"data.root={root}"])
    assert "train-labels-idx1-ubyte" in str(error.value) and "20" in str(error.value) and "10" in str(error.value)


def test_missing_mnist_directory(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        driftlab.run(None, overrides=[*MNIST_TINY, f"data.root={tmp_path / 'nowhere'}"])


@needs_real_data("mnist")
def test_real_mnist_two_rounds(tmp_path):
    result = driftlab.run(
        None,
        tmp_path / "run",
        overrides=[
            "data.name=mnist",
            "data.num_clients=100",
            "rounds=2",
            "sampling.participation=0.05",
            "client.steps=2",
            "client.batch_size=20",
        ],
    )
    sim, _ = runner.build_simulation(result.config)
    assert len(sim.data.train_targets) == 60000 and len(sim.data.test_targets) == 10000
    assert sim.data.num_clients == 100 and sim.data.client_sizes.tolist() == [600] * 100
    assert [r["num_reporting"] for r in result.records] == [5, 5]
    assert 0.0 < result.records[-1]["test_accuracy"] <= 1.0


# ------------------------------------------------------------------ a real SIGKILL


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_of_a_real_process_then_resume_is_exact(tmp_path):
    config = tmp_path / "experiment.toml"
    config.write_text(
        "seed = 4\nrounds = 100000\ncheckpoint_every = 7\n"
        "[data]\nnum_clients = 8\n[client]\nsteps = 5\nlr = 0.05\n[sampling]\nparticipation = 0.5\n"
        '[server]\noptimizer = "adam"\nlr = 0.01\n'
    )
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, "-m", "driftlab.cli", "run", str(config), "--out", str(out), "--quiet"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"the run ended before it was killed: {process.stderr.read().decode()}")
            if metrics.exists() and metrics.read_text().count("\n") >= 10:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the run wrote no metrics within 60 s")
        process.send_signal(signal.SIGKILL)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL

    written = metrics.read_text().count("\n")
    assert (out / "checkpoint.safetensors").exists() and _checkpoint_round(out) <= written
    rounds = written + 3
    # resume with the stored config.json, asking for a few rounds past the kill (the fingerprint ignores `rounds`)
    driftlab.run(out / "config.json", out, resume=True, overrides=[f"rounds={rounds}"])
    reference = tmp_path / "reference"
    driftlab.run(config, reference, overrides=[f"rounds={rounds}"])
    _assert_same_run(out, reference)


# ------------------------------------------------------------------ your own module


def test_a_users_module_or_factory_is_trained_instead_of_the_zoo_model(tmp_path):
    from torch import nn

    def factory(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 7), nn.Tanh(), nn.Linear(7, num_classes))

    overrides = ["rounds=2", "data.num_clients=6", "sampling.participation=0.5", "client.steps=2"]
    first = driftlab.run(None, overrides=overrides, model=factory)
    assert first.num_parameters == 60 * 7 + 7 + 7 * 10 + 10
    again = driftlab.run(None, overrides=overrides, model=factory)
    assert torch.equal(first.final_params, again.final_params)  # seeded initialisation of the factory's module

    module = factory((60,), 10)
    initial = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()
    given = driftlab.run(None, overrides=[*overrides, "backend=sequential"], model=module)
    assert torch.equal(
        torch.cat([p.detach().reshape(-1) for p in module.parameters()]), initial
    )  # the caller's module is untouched
    assert not torch.equal(given.final_params, initial)

    # resuming needs the same module again and continues exactly
    driftlab.run(
        None,
        tmp_path / "run",
        overrides=[*overrides, "rounds=1", "checkpoint_every=1", "keep_checkpoint=true"],
        model=factory,
    )
    resumed = driftlab.run(None, tmp_path / "run", resume=True, overrides=overrides, model=factory)
    assert torch.equal(resumed.final_params, first.final_params)


# ------------------------------------------------------------------ integrity: what a resume accepts


def _files(out: Path, hidden_lock: bool = False) -> dict[str, bytes]:
    """Every file of a directory with its bytes (the lock file, rewritten with its holder's PID, on request)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and (hidden_lock or p.name != ".lock")}


def _no_data_loading(monkeypatch):
    """Makes any data loading or model building fail loudly: the refusals below must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("build_simulation was reached")

    monkeypatch.setattr(runner, "build_simulation", refuse)


def _copy_of_finished_run(tmp_path, reference_runs) -> Path:
    out = tmp_path / "run"
    shutil.copytree(reference_runs["sgd"], out)
    return out


def _refused_resume(out: Path, error_type=ConfigError, *fragments: str) -> str:
    before = _files(out)
    with pytest.raises(error_type) as error:
        driftlab.run(None, out, resume=True, overrides=RESUMABLE_RUN)
    message = str(error.value)
    for fragment in fragments:
        assert fragment in message, message
    assert _files(out) == before  # nothing rewritten, nothing deleted
    return message


def _replace_metrics_lines(out: Path, edit) -> None:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in edit(lines)))


def test_a_garbage_middle_metrics_line_is_refused_not_dropped(tmp_path, reference_runs):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    _replace_metrics_lines(out, lambda lines: [*lines[:2], "garbage", *lines[3:]])
    _refused_resume(out, ConfigError, "metrics.jsonl line 3", "not JSON", "restore metrics.jsonl", "new --out")


def test_a_deleted_metrics_file_is_refused_when_the_checkpoint_covers_rounds(tmp_path, reference_runs):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    (out / "metrics.jsonl").unlink()
    _refused_resume(out, ConfigError, "metrics.jsonl is missing", "round 6")
    assert not (out / "metrics.jsonl").exists()


def test_missing_rounds_before_the_checkpoint_are_refused(tmp_path, reference_runs):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    _replace_metrics_lines(out, lambda lines: lines[:4])  # checkpoint at round 6, records 1-4
    _refused_resume(
        out, ConfigError, "holds rounds 1-4", "checkpoint beside it is at round 6", "rounds 5-6 are missing"
    )


@pytest.mark.parametrize(
    "last_line, fragment",
    [
        ("null", "line 7 is null, not a round's record"),
        ("{}", "line 7 has no round number"),
        ('{"round": "7"}', "line 7 has no round number"),
    ],
)
def test_a_last_line_that_is_json_but_no_record_is_refused(tmp_path, reference_runs, last_line, fragment):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    _replace_metrics_lines(out, lambda lines: [*lines, last_line])
    _refused_resume(out, ConfigError, fragment)


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda lines: [lines[0], lines[1], lines[1], *lines[2:]], "line 3 holds round 2 where round 3 belongs"),
        (lambda lines: [lines[0], lines[2], lines[1], *lines[3:]], "line 2 holds round 3 where round 2 belongs"),
        (lambda lines: [lines[0], *lines[2:]], "line 2 holds round 3 where round 2 belongs"),
        (lambda lines: [*lines[:3], "", *lines[3:]], "line 4 is not JSON"),
    ],
    ids=["duplicate", "out-of-order", "gap", "blank-line"],
)
def test_duplicate_out_of_order_or_missing_records_are_refused(tmp_path, reference_runs, edit, fragment):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    _replace_metrics_lines(out, edit)
    _refused_resume(out, ConfigError, fragment, str(out / "metrics.jsonl"))


def test_a_last_line_without_its_newline_is_kept_when_complete(tmp_path, reference_runs):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    path = out / "metrics.jsonl"
    path.write_text(path.read_text().rstrip("\n"))
    driftlab.run(None, out, resume=True, overrides=RESUMABLE_RUN)
    _assert_same_run(out, reference_runs["sgd"])


def _resave_checkpoint(out: Path, **metadata_changes) -> None:
    from safetensors.torch import save_file

    path = out / "checkpoint.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        metadata = {**handle.metadata(), **metadata_changes}
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("value", ["-3", "x", "2"])
def test_an_edited_checkpoint_round_is_refused_and_no_record_is_lost(tmp_path, reference_runs, value):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    _resave_checkpoint(out, round=value)
    _refused_resume(out, checkpoint_module.CheckpointError, "corrupt or was edited", "checkpoint.safetensors")
    assert [r["round"] for r in run_records(out)] == list(range(1, 7))


def test_a_flipped_bit_in_the_checkpoint_is_refused(tmp_path, reference_runs):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    path = out / "checkpoint.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 10] ^= 0x10
    path.write_bytes(bytes(raw))
    _refused_resume(out, checkpoint_module.CheckpointError, "corrupt or was edited", "checksum")


# ------------------------------------------------------------------ integrity: which folders a run writes into


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_with_the_users_own_files_is_never_written(tmp_path, monkeypatch, resume):
    _no_data_loading(monkeypatch)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"rounds": 3}\n')  # the user's own config, not a run's
    (out / "notes.txt").write_text("keep me\n")
    before = _files(out, hidden_lock=True)
    with pytest.raises(ConfigError) as error:
        driftlab.run(None, out, resume=resume, overrides=RESUMABLE_RUN)
    message = str(error.value)
    if resume:
        assert "nothing to resume" in message and "config.json was not written by a driftlab run" in message
    else:
        assert "not empty and holds no driftlab run" in message and "config.json" in message and "notes.txt" in message
    assert _files(out, hidden_lock=True) == before  # not even a lock file


def test_out_naming_a_file_a_device_or_nothing_is_refused_before_any_work(tmp_path, monkeypatch):
    _no_data_loading(monkeypatch)
    a_file = tmp_path / "results.csv"
    a_file.write_text("a,b\n")
    with pytest.raises(ConfigError, match="is a file"):
        driftlab.run(None, a_file, overrides=RESUMABLE_RUN)
    with pytest.raises(ConfigError, match="is a file"):
        driftlab.run(None, str(a_file), resume=True, overrides=RESUMABLE_RUN)
    assert a_file.read_text() == "a,b\n"
    if Path("/dev/null").exists():
        with pytest.raises(ConfigError, match="not a directory"):
            driftlab.run(None, "/dev/null", overrides=RESUMABLE_RUN)
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match=r"output directory \(--out\) is empty"):
            driftlab.run(None, empty, overrides=RESUMABLE_RUN)
    with pytest.raises(ConfigError, match="cannot create the output directory"):
        driftlab.run(None, a_file / "run", overrides=RESUMABLE_RUN)


def test_resume_with_nothing_to_resume_is_refused(tmp_path, monkeypatch):
    _no_data_loading(monkeypatch)
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match="nothing to resume in .*missing: it does not exist; run without --resume"):
        driftlab.run(None, missing, resume=True, overrides=RESUMABLE_RUN)
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="nothing to resume in .*empty: it is empty; run without --resume"):
        driftlab.run(None, empty, resume=True, overrides=RESUMABLE_RUN)
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize(
    "content",
    [
        b"garbage",
        b"\xff\xfe\x00not utf-8",
        b"[1, 2]",
        b'{"name": "model", "layers": [3, 4], "dropout": 0.5}',
        b'{"rounds": "many"}',
    ],
    ids=["not-json", "not-utf8", "a-list", "a-foreign-dump", "invalid-values"],
)
def test_resume_with_a_garbage_or_foreign_config_json_is_refused(tmp_path, monkeypatch, reference_runs, content):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    (out / "config.json").write_bytes(content)
    _no_data_loading(monkeypatch)
    message = _refused_resume(out, ConfigError, str(out / "config.json"), "is not the configuration of a driftlab run")
    assert "Traceback" not in message


def test_a_new_run_into_a_finished_run_is_refused_and_nothing_changes(tmp_path, monkeypatch, reference_runs):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    _no_data_loading(monkeypatch)
    before = _files(out)
    with pytest.raises(ConfigError, match="already holds a run; pass --resume"):
        driftlab.run(None, out, overrides=RESUMABLE_RUN)
    assert _files(out) == before


# ------------------------------------------------------------------ integrity: killed before the first round


def test_a_run_killed_before_its_first_round_resumes_with_the_documented_command(tmp_path, monkeypatch, reference_runs):
    out = tmp_path / "run"

    def killed_while_loading_data(*args, **kwargs):
        raise _Killed()

    monkeypatch.setattr(runner, "build_simulation", killed_while_loading_data)
    with pytest.raises(_Killed):
        driftlab.run(None, out, overrides=RESUMABLE_RUN)
    assert _files(out).keys() == {"config.json"}  # written before any data loading
    monkeypatch.undo()

    # `driftlab run DIR/config.json --out DIR --resume`
    result = driftlab.run(out / "config.json", out, resume=True)
    assert [r["round"] for r in result.records] == list(range(1, 7))
    _assert_same_run(out, reference_runs["sgd"])


def test_a_folder_holding_only_a_runs_config_json_may_be_started_again(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(
        runner, "build_simulation", lambda *a, **k: (_ for _ in ()).throw(ConfigError("data.root: no such folder"))
    )
    with pytest.raises(ConfigError, match="data.root"):
        driftlab.run(None, out, overrides=RESUMABLE_RUN)
    assert _files(out).keys() == {"config.json"}
    monkeypatch.undo()
    # the user fixed the config and starts again into the same folder: nothing was recorded, nothing is lost
    result = driftlab.run(None, out, overrides=[*RESUMABLE_RUN, "rounds=2"])
    assert [r["round"] for r in run_records(out)] == [1, 2] == [r["round"] for r in result.records]
    assert json.loads((out / "config.json").read_text())["rounds"] == 2


# ------------------------------------------------------------------ integrity: leftovers of interrupted writes


def test_temporary_files_of_interrupted_writes_are_removed_on_the_next_start(tmp_path, reference_runs):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    leftovers = [".checkpoint.safetensors.tmp-99999999", ".metrics.jsonl.tmp-12", f".run.json.tmp-{os.getpid()}"]
    for name in leftovers:
        (out / name).write_bytes(b"\0" * 1000)
    (out / ".notes.txt.tmp-5").write_text("not ours")  # not a file driftlab writes: left alone
    driftlab.run(None, out, resume=True, overrides=RESUMABLE_RUN)
    assert not any((out / name).exists() for name in leftovers)
    assert (out / ".notes.txt.tmp-5").read_text() == "not ours"
    _assert_same_run(out, reference_runs["sgd"])

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ".config.json.tmp-77").write_text("{")
    driftlab.run(None, fresh, overrides=[*RESUMABLE_RUN, "rounds=1"])
    assert not (fresh / ".config.json.tmp-77").exists()


# ------------------------------------------------------------------ integrity: one writer per run directory


_HOLD_LOCK = """
import fcntl, os, sys, time
handles = [open(path, "a+") for path in sys.argv[1:]]
for handle in handles:
    fcntl.flock(handle, fcntl.LOCK_EX)
    handle.seek(0); handle.truncate(); handle.write(str(os.getpid())); handle.flush()
print("locked", flush=True)
time.sleep(120)
"""

_TRY_LOCK = """
import fcntl, sys
handle = open(sys.argv[1], "a+")
try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(3)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_a_second_process_on_a_run_directory_gets_run_directory_busy(tmp_path, reference_runs):
    out = _copy_of_finished_run(tmp_path, reference_runs)
    new = tmp_path / "new"  # a new run killed right after taking its lock, its process still alive
    new.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(out / ".lock"), str(new / ".lock")], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        before = _files(out, hidden_lock=True)
        with pytest.raises(runner.RunDirectoryBusy) as error:
            driftlab.run(None, out, resume=True, overrides=RESUMABLE_RUN)
        assert isinstance(error.value, ConfigError)  # the CLI reports it like any other refusal, exit code 2
        message = str(error.value)
        assert str(out) in message and f"PID {holder.pid}" in message and "wait for it to finish" in message
        assert _files(out, hidden_lock=True) == before
        with pytest.raises(
            runner.RunDirectoryBusy, match=f"new is being written by another driftlab process \\(PID {holder.pid}\\)"
        ):
            driftlab.run(None, new, overrides=RESUMABLE_RUN)
        assert [p.name for p in new.iterdir()] == [".lock"]
    finally:
        holder.kill()
        holder.wait(timeout=30)
    driftlab.run(None, out, resume=True, overrides=RESUMABLE_RUN)  # the holder is gone: the lock is free again


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_a_run_holds_its_directory_lock_for_the_whole_run_and_releases_it(tmp_path):
    out = tmp_path / "run"
    lock_is_taken = []

    def probe(record):
        probe_process = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(out / ".lock")], timeout=60)
        lock_is_taken.append(probe_process.returncode == 3)

    driftlab.run(None, out, overrides=[*RESUMABLE_RUN, "rounds=2"], progress=probe)
    assert lock_is_taken == [True, True]
    assert (out / ".lock").read_text().strip() == str(os.getpid())
    assert subprocess.run([sys.executable, "-c", _TRY_LOCK, str(out / ".lock")], timeout=60).returncode == 0


# ------------------------------------------------------------------ your own data


def _own_arrays(seed: int = 0, clients: int = 4) -> FederatedArrays:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(12 * clients, 5)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 0.5)
    return FederatedArrays(x, y, np.arange(len(y)) % clients, x[:10], y[:10])


OWN = {
    "rounds": 6,
    "seed": 1,
    "checkpoint_every": 2,
    "sampling": {"participation": 0.5},
    "client": {"steps": 3, "batch_size": 4},
}


def _interrupted_at_round(out: Path, round_index: int, monkeypatch, **given) -> None:
    real_run_round = runner.run_round
    _stopped_before_round(round_index, KeyboardInterrupt(), monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        driftlab.run(OWN, out, **given)
    monkeypatch.setattr(runner, "run_round", real_run_round)


def test_own_arrays_run_and_resume_bit_identically(tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    result = driftlab.run(OWN, reference, data=_own_arrays())
    stored = json.loads((reference / "config.json").read_text())
    assert stored["data"]["name"] == "custom" and len(stored["data"]["digest"]) == 64
    assert "test_accuracy" in result.records[-1]

    out = tmp_path / "run"
    _interrupted_at_round(out, 4, monkeypatch, data=_own_arrays())
    assert [r["round"] for r in run_records(out)] == [1, 2, 3]
    driftlab.run(OWN, out, resume=True, data=_own_arrays())
    _assert_same_run(out, reference)


def test_resume_with_other_data_or_none_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _interrupted_at_round(out, 3, monkeypatch, data=_own_arrays())
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(
        ConfigError,
        match=r"cannot resume: the run in .* was started on data with digest [0-9a-f]{12}\.\.\. .*, but this run was given data with digest",
    ):
        driftlab.run(OWN, out, resume=True, data=_own_arrays(seed=1))
    stored = out / "config.json"
    with pytest.raises(
        ConfigError,
        match=r'data.name = "custom" is your own data, and this run was given none: pass it to driftlab.run\(config, data=...\)',
    ):
        driftlab.run(stored, out, resume=True)
    with pytest.raises(ConfigError, match=r"is not the data this configuration records"):
        driftlab.run(stored, out, resume=True, data=_own_arrays(seed=1))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_a_torch_dataset_with_client_ids_runs_like_the_same_arrays():
    from torch.utils.data import Dataset

    arrays = _own_arrays()

    class Pairs(Dataset):
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __len__(self):
            return len(self.y)

        def __getitem__(self, index):
            return torch.from_numpy(self.x[index]), int(self.y[index])

    from_datasets = FederatedArrays.from_datasets(
        Pairs(arrays.train_inputs, arrays.train_targets),
        arrays.train_client_ids.tolist(),
        Pairs(arrays.test_inputs, arrays.test_targets),
    )
    config = {**OWN, "rounds": 2}
    assert torch.equal(
        driftlab.run(config, data=from_datasets).final_params, driftlab.run(config, data=arrays).final_params
    )


LOADER = """
import numpy as np
from pathlib import Path
from driftlab.data.federated import FederatedArrays

def load():
    saved = np.load(Path(__file__).with_name("data.npz"))
    return FederatedArrays(saved["x"], saved["y"], saved["ids"], saved["x"][:10], saved["y"][:10])

def not_arrays():
    return {"train_inputs": 1}
"""


def _loader_project(folder: Path, seed: int = 0) -> Path:
    """A config file naming a loader beside it, and the data that loader reads."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = _own_arrays(seed)
    np.savez(folder / "data.npz", x=arrays.train_inputs, y=arrays.train_targets, ids=arrays.train_client_ids)
    (folder / "my_data.py").write_text(LOADER)
    config = folder / "own.toml"
    config.write_text(
        'rounds = 4\nseed = 1\ncheckpoint_every = 2\n[data]\nname = "custom"\nloader = "my_data.py:load"\n'
        "[sampling]\nparticipation = 0.5\n[client]\nsteps = 3\nbatch_size = 4\n"
    )
    return config


def test_a_data_loader_runs_resumes_and_reports_through_the_cli(tmp_path, monkeypatch):
    from driftlab import cli

    config = _loader_project(tmp_path / "project")
    monkeypatch.chdir(tmp_path)  # the loader is found from the config file's folder, not the working directory
    out = tmp_path / "run"
    assert cli.main(["run", str(config), "--out", str(out), "--quiet", "rounds=2"]) == 0
    stored = json.loads((out / "config.json").read_text())
    assert stored["data"]["loader"] == f"{(tmp_path / 'project' / 'my_data.py').resolve()}:load"
    assert len(stored["data"]["digest"]) == 64
    assert cli.main(["run", str(out / "config.json"), "--out", str(out), "--resume", "--quiet", "rounds=4"]) == 0
    assert [r["round"] for r in run_records(out)] == [1, 2, 3, 4]
    same = driftlab.run(config, tmp_path / "in-process")
    assert torch.equal(same.final_params, _final_params(out))
    assert cli.main(["report", str(out), "--out", str(tmp_path / "report"), "--no-plots"]) == 0
    assert (tmp_path / "report" / "report.md").is_file()


def test_a_data_loader_whose_data_changed_refuses_to_resume(tmp_path, capsys):
    from driftlab import cli

    config = _loader_project(tmp_path / "project")
    out = tmp_path / "run"
    driftlab.run(config, out, overrides=["rounds=1"])
    _loader_project(tmp_path / "project", seed=5)  # the file the loader reads now holds other data
    assert cli.main(["run", str(out / "config.json"), "--out", str(out), "--resume", "--quiet", "rounds=2"]) == 2
    error = capsys.readouterr().err
    assert (
        "driftlab: error: the data given (data.loader" in error
        and "is not the data this configuration records" in error
    )


@pytest.mark.parametrize(
    "loader, fragments",
    [
        (
            "missing.py:load",
            [
                "data.loader = ",
                "cannot import",
                "FileNotFoundError",
                "relative path is taken from the config file's folder",
            ],
        ),
        (
            "no_such_module_anywhere:load",
            ["cannot import 'no_such_module_anywhere'", "ModuleNotFoundError", "name its file"],
        ),
        ("my_data.py:absent", ["my_data.py' has no function 'absent'; name a function defined in that module"]),
        ("my_data.py:not_arrays", ["expected driftlab.FederatedArrays", "got dict", "driftlab.FederatedArrays(...)"]),
    ],
)
def test_a_bad_data_loader_is_a_clear_config_error(tmp_path, loader, fragments):
    config = _loader_project(tmp_path)
    with pytest.raises(ConfigError) as error:
        driftlab.run(config, overrides=[f"data.loader={tmp_path / loader if '.py' in loader else loader}"])
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)


@pytest.mark.slow
def test_a_sweep_runs_a_data_loader_in_its_processes_and_resumes(tmp_path, capsys):
    from driftlab import cli

    config = _loader_project(tmp_path / "project")
    sweep = tmp_path / "project" / "sweep.toml"
    sweep.write_text(
        f'base = "{config.name}"\nseeds = [0]\n[[axes]]\nname = "method"\nrole = "method"\n'
        'values = [{ label = "FedAvg", set = ["algorithm.name=fedavg"] }, { label = "SCAFFOLD", set = ["algorithm.name=scaffold"] }]\n'
    )
    out = tmp_path / "sweep"
    assert cli.main(["sweep", str(sweep), "--out", str(out), "--jobs", "1", "--no-report", "rounds=2"]) == 0
    stored = [json.loads(path.read_text()) for path in sorted(out.rglob("config.json"))]
    assert len(stored) == 2 and {c["data"]["digest"] for c in stored} == {
        driftlab.run(config, overrides=["rounds=1"]).config.data.digest
    }
    capsys.readouterr()
    assert (
        cli.main(["sweep", str(sweep), "--out", str(out), "--jobs", "1", "--no-report", "rounds=2"]) == 0
    )  # finished runs are kept
    assert "2 already finished" in capsys.readouterr().out


# ------------------------------------------------------------------ what an interrupted, failed or refused run says and leaves


def _stopped_before_round(round_index: int, error: BaseException, monkeypatch) -> None:
    """Make the run raise ``error`` where round ``round_index`` would start (rounds before it complete)."""
    real_run_round = runner.run_round

    def stopping(sim, state, *args, **kwargs):
        if state.round + 1 == round_index:
            raise error
        return real_run_round(sim, state, *args, **kwargs)

    monkeypatch.setattr(runner, "run_round", stopping)


def test_an_interrupt_prints_what_was_saved_and_the_exact_command_that_continues_the_run(tmp_path, monkeypatch, capsys):
    from driftlab.cli import main

    monkeypatch.chdir(tmp_path)
    out = Path("runs") / "tiny"  # relative, as given: the command to continue is the same, from the same folder
    Path("defaults.toml").write_text("")  # the defaults, as driftlab.run(None) has them
    _stopped_before_round(4, KeyboardInterrupt(), monkeypatch)
    assert main(["run", "defaults.toml", *RESUMABLE_RUN, "--out", str(out), "--quiet"]) == 130
    command = "driftlab run runs/tiny/config.json --out runs/tiny --resume"
    assert (
        capsys.readouterr().err
        == f"driftlab: interrupted; round 3 is checkpointed in runs/tiny; continue with `{command}`\n"
    )
    info = run_directory.read_run_info(out)
    assert (info["status"], info["rounds_done"]) == ("interrupted", 3) and command in info["message"]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(command.split()[1:] + ["--quiet"]) == 0
    assert [r["round"] for r in run_records(out)] == list(range(1, 7)) and run_directory.read_run_info(out)[
        "status"
    ] == "complete"


def test_an_interrupt_before_any_checkpoint_says_so(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _stopped_before_round(1, KeyboardInterrupt("terminated by signal 15"), monkeypatch)
    with pytest.raises(runner.RunInterrupted) as caught:
        driftlab.run(None, out, overrides=RESUMABLE_RUN)
    assert str(caught.value) == (
        f"terminated by signal 15: no round was completed, so {out} holds no checkpoint, only the run's config.json; "
        f"start it again with `driftlab run {out}/config.json --out {out} --resume`"
    )
    with pytest.raises(
        runner.RunInterrupted,
        match=r"^terminated by signal 15: nothing was saved: the run has no output directory \(--out\)$",
    ):
        driftlab.run(None, overrides=RESUMABLE_RUN)


def test_an_interrupt_before_the_run_starts_does_not_claim_a_checkpoint(tmp_path, monkeypatch, capsys):
    from driftlab.cli import main
    from driftlab.experiments import config as config_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as Ctrl-C while a plugin is imported

    monkeypatch.setattr(config_module, "load_config", interrupted)
    assert main(["run", "synthetic-fedavg", "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err == "driftlab: interrupted before the run started; nothing was saved\n"
    assert not (tmp_path / "run").exists()


def test_a_failure_while_stopping_never_leaves_run_json_running_nor_hides_the_error(tmp_path, monkeypatch):
    def unsavable(out, config, sim, state):
        raise TypeError("a list is no tensor")  # as a client state no checkpoint can hold

    monkeypatch.setattr(lifecycle, "write_checkpoint", unsavable)
    note = "While stopping, writing the checkpoint of round 2 failed (TypeError: a list is no tensor)"
    out = tmp_path / "failed"
    _stopped_before_round(3, RuntimeError("boom"), monkeypatch)
    with pytest.raises(RuntimeError) as caught:
        driftlab.run(None, out, overrides=[*RESUMABLE_RUN, "checkpoint_every=100"])
    assert caught.value.args == ("boom",) and caught.value.__notes__ == [note]  # the original error, with a note
    info = run_directory.read_run_info(out)
    assert (info["status"], info["rounds_done"], info["message"]) == ("failed", 2, f"boom. {note}")

    out = tmp_path / "interrupted"
    _stopped_before_round(3, KeyboardInterrupt(), monkeypatch)
    with pytest.raises(runner.RunInterrupted) as caught:
        driftlab.run(None, out, overrides=[*RESUMABLE_RUN, "checkpoint_every=100"])
    assert str(caught.value) == (
        f"no checkpoint could be written for rounds 1-2, so {out} holds no checkpoint, only the run's config.json; "
        f"start it again with `driftlab run {out}/config.json --out {out} --resume`. {note}"
    )
    info = run_directory.read_run_info(out)
    assert (info["status"], info["rounds_done"], info["message"]) == ("interrupted", 2, str(caught.value))


def test_a_divergence_message_says_which_checkpoint_was_kept_when_the_last_could_not_be_written(tmp_path):
    error = FloatingPointError("the run diverged in round 5: model_norm is 1e+09")
    assert str(lifecycle._divergence_error(error, tmp_path, 4, 2)) == (
        f"the run diverged in round 5: model_norm is 1e+09. The checkpoint of round 2 is kept in {tmp_path / 'checkpoint.safetensors'} "
        f"(round 4's could not be written); {tmp_path / 'metrics.jsonl'} and metrics.csv hold rounds 1-4"
    )
    assert str(lifecycle._divergence_error(error, tmp_path, 4, 0)).endswith(
        f"No checkpoint exists (round 4's could not be written); {tmp_path / 'metrics.jsonl'} and metrics.csv hold rounds 1-4"
    )


def test_a_run_refused_for_a_wrong_data_path_leaves_nothing_in_its_output_directory(tmp_path, capsys):
    from driftlab.cli import main

    wrong = ["run", "mnist-fedavg", f"data.root={tmp_path / 'absent'}", "--quiet", "--out"]
    assert main([*wrong, str(tmp_path / "new" / "run")]) == 2
    assert "data.root" in capsys.readouterr().err and not (tmp_path / "new").exists()  # the folders it created are gone
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*wrong, str(empty)]) == 2 and list(empty.iterdir()) == []
    # A folder an earlier run started in (its config.json, no round yet) is not the refused run's to empty.
    earlier = tmp_path / "earlier"
    run_directory.claim_run_directory(earlier, driftlab.load_config(None), resume=False).close()
    assert main([*wrong, str(earlier)]) == 2 and (earlier / "config.json").exists()
    # The library keeps the config.json: a sweep resumes its failed runs from it.
    with pytest.raises(DataFileError):
        driftlab.run("mnist-fedavg", tmp_path / "library", overrides=[f"data.root={tmp_path / 'absent'}"])
    assert (tmp_path / "library" / "config.json").exists()


def test_run_json_records_the_initial_models_evaluation_for_the_reports_round_0(tmp_path):
    from driftlab.simulation.evaluation import evaluate

    result = driftlab.run(None, tmp_path / "run", overrides=RESUMABLE_RUN)
    initial = json.loads((tmp_path / "run" / "run.json").read_text())["initial"]
    sim, _ = runner.build_simulation(result.config)
    expected = evaluate(sim, sim.initial_params)  # the same model, evaluated as a round's record evaluates it
    assert initial == {key: expected[key] for key in ("train_loss", "test_loss", "test_accuracy")}
