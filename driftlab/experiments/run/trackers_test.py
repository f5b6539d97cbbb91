from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import driftlab
from driftlab.experiments.cli_test import REPO_ROOT, _assert_clean_error, driftlab_cli
from driftlab.experiments.config import ConfigError, load_config
from driftlab.experiments.run import trackers
from driftlab.extras import install_hint

TINY = {
    "rounds": 6,
    "checkpoint_every": 2,
    "data": {"num_clients": 5},
    "client": {"steps": 2},
    "sampling": {"participation": 0.4},
    "evaluation": {"every": 2},
}


def _config(**changes) -> dict:
    return {**TINY, **changes}


@pytest.fixture(autouse=True)
def _trackers_use_their_defaults(monkeypatch):
    """No setting of the developer's reaches the tests: stores go into the run directory, and W&B stays offline."""
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "WANDB_DIR",
        "WANDB_PROJECT",
        "WANDB_API_KEY",
        "WANDB_BASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # records the caller's value, restored after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # driftlab sets it for its file store
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _expected(out: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as a tracker should show it: key -> [(round, value), ...]."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in _records(out):
        for key, value in trackers.scalars(record).items():
            series.setdefault(key, []).append((record["round"], value))
    return series


def _tensorboard_series(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _mlflow_run(out: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("driftlab").experiment_id])
    assert len(runs) == 1, "a resumed run continues its MLflow run"
    run = runs[0]
    series = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }
    return run, series


def _assert_same_series(shown: dict, expected: dict, timing_may_differ: bool = False) -> None:
    """Every round exactly once, with metrics.jsonl's value (TensorBoard stores float32)."""
    assert sorted(shown) == sorted(expected)
    for key, points in expected.items():
        assert [step for step, _ in shown[key]] == [step for step, _ in points], key
        if not (timing_may_differ and key == "round_seconds"):
            assert [value for _, value in shown[key]] == pytest.approx([value for _, value in points], rel=1e-6), key


@pytest.mark.slow
def test_every_round_reaches_tensorboard_and_mlflow_once_after_a_kill_past_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    out, snapshot = tmp_path / "run", tmp_path / "snapshot"

    def snapshot_after_round_5(record):
        if record["round"] == 5:
            shutil.copytree(out, snapshot)

    config = _config(log=["tensorboard", "mlflow"])
    driftlab.run(config, out, progress=snapshot_after_round_5)
    # What a kill right after round 5 leaves: the checkpoint of round 4, but metrics.jsonl and the trackers at round 5.
    shutil.rmtree(out)
    snapshot.rename(out)
    assert len(_records(out)) == 5 and json.loads((out / "run.json").read_text())["rounds_done"] == 4
    assert [step for step, _ in _tensorboard_series(out)["model_norm"]] == [1, 2, 3, 4, 5]

    driftlab.run(config, out, resume=True)

    assert [r["round"] for r in _records(out)] == [1, 2, 3, 4, 5, 6]
    _assert_same_series(_tensorboard_series(out), _expected(out))
    run, series = _mlflow_run(out)
    # round 5 keeps its first logging: recomputed identically, but for its wall-clock time
    _assert_same_series(series, _expected(out), timing_may_differ=True)
    assert run.info.status == "FINISHED"


_SLOW_RUN = """
import json, sys, time
import driftlab
driftlab.run(json.loads(sys.argv[1]), sys.argv[2], progress=lambda record: time.sleep(0.15))
"""


@pytest.mark.slow
def test_every_round_reaches_tensorboard_and_mlflow_once_after_sigkill(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    config = _config(rounds=12, checkpoint_every=4, log=["tensorboard", "mlflow"])
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_RUN, json.dumps(config), str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and len(_records(out)) >= 6):
            assert child.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)  # no checkpoint, no flush, no closing: wherever it is
    finally:
        child.wait(timeout=60)
    assert json.loads((out / "run.json").read_text())["rounds_done"] == 4

    driftlab.run(config, out, resume=True)

    assert [r["round"] for r in _records(out)] == list(range(1, 13))
    _assert_same_series(_tensorboard_series(out), _expected(out))
    run, series = _mlflow_run(out)
    _assert_same_series(series, _expected(out), timing_may_differ=True)
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_an_interrupted_run_resumed_logs_each_round_once_and_keeps_its_tracker_run(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    out = tmp_path / "run"

    def interrupt_after_round_3(record):
        if record["round"] == 3:
            raise KeyboardInterrupt

    config = _config(log=["tensorboard", "mlflow"])
    with pytest.raises(KeyboardInterrupt):
        driftlab.run(config, out, progress=interrupt_after_round_3)
    run, series = _mlflow_run(out)
    assert run.info.status == "KILLED" and [step for step, _ in series["model_norm"]] == [1, 2, 3]

    driftlab.run(config, out, resume=True)
    driftlab.run(config, out, resume=True)  # a complete run resumed again logs nothing twice

    _assert_same_series(_tensorboard_series(out), _expected(out))
    run, series = _mlflow_run(out)
    _assert_same_series(series, _expected(out))
    assert run.info.status == "FINISHED"
    assert run.data.tags["driftlab_run_key"] == trackers.run_key(out, load_config(config))


@pytest.mark.slow
def test_logging_turned_on_when_resuming_replays_the_recorded_rounds(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    driftlab.run(_config(rounds=4), out)
    assert not (out / "tensorboard").exists()

    # `log` is not part of the run's identity: the same run, now logged and two rounds longer
    driftlab.run(_config(log=["tensorboard", "mlflow"]), out, resume=True)

    assert [r["round"] for r in _records(out)] == [1, 2, 3, 4, 5, 6]
    _assert_same_series(_tensorboard_series(out), _expected(out))
    run, series = _mlflow_run(out)
    _assert_same_series(series, _expected(out))
    assert run.data.params["client.lr"] == "0.01" and "rounds" not in run.data.params
    assert run.data.tags["driftlab.rounds"] == "6"
    assert json.loads((out / "config.json").read_text())["log"] == ["tensorboard", "mlflow"]


@pytest.fixture
def no_network(monkeypatch):
    """Any connection from this process to a non-local address fails the test."""
    real_connect, real_create_connection = socket.socket.connect, socket.create_connection

    def check(address):
        host = address[0] if isinstance(address, tuple) else None  # a str is a Unix socket
        if host is not None and host not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"a test tried to reach the network: {address}")

    def guarded_connect(self, address):
        check(address)
        return real_connect(self, address)

    def guarded_create_connection(address, *args, **kwargs):
        check(address)
        return real_create_connection(address, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "create_connection", guarded_create_connection)


@pytest.mark.slow
def test_wandb_offline_run_holds_every_round_once_after_an_interruption(tmp_path, no_network):
    pytest.importorskip("wandb")
    out = tmp_path / "run"

    def interrupt_after_round_3(record):
        if record["round"] == 3:
            raise KeyboardInterrupt

    config = _config(log=["wandb"])
    with pytest.raises(KeyboardInterrupt):
        driftlab.run(config, out, progress=interrupt_after_round_3)
    driftlab.run(config, out, resume=True)

    key = trackers.run_key(out, load_config(config))
    folders = sorted((out / "wandb").glob(f"offline-run-*-{key}*"))
    assert len(folders) == 2  # one per process, both the same W&B run (synced together by `wandb sync`)
    assert sorted(trackers.wandb_logged_steps(out / "wandb", key)) == [1, 2, 3, 4, 5, 6]


def _chunk(kind: int, body: bytes) -> bytes:
    return b"\0\0\0\0" + len(body).to_bytes(2, "little") + bytes([kind]) + body


def test_wandb_log_records_joins_chunks_skips_block_padding_and_stops_at_a_torn_chunk():
    header = b":W&B\xe1\xbe\x00"
    filler = _chunk(1, b"x" * (trackers._WANDB_BLOCK - len(header) - 7 - 3))  # leaves 3 bytes: padding
    data = (
        header
        + filler
        + b"\0\0\0"
        + _chunk(1, b"a")
        + _chunk(2, b"bc")
        + _chunk(3, b"d")
        + _chunk(4, b"e")
        + _chunk(1, b"torn")[:-2]
    )
    assert [len(r) for r in trackers._wandb_log_records(data)][1:] == [1, 4]
    assert list(trackers._wandb_log_records(data))[1:] == [b"a", b"bcde"]
    assert list(trackers._wandb_log_records(b"not a wandb file")) == []


def test_scalars_are_the_finite_numbers_of_a_record_except_the_round():
    record = {
        "round": 3,
        "num_reporting": 2,
        "reporting_clients": [0, 4],
        "test_accuracy": 0.5,
        "flag": True,
        "note": "x",
        "bad": float("nan"),
    }
    assert trackers.scalars(record) == {"num_reporting": 2.0, "test_accuracy": 0.5}


def test_log_is_not_part_of_the_run_identity():
    plain, logged = load_config(TINY), load_config(_config(log=["tensorboard", "wandb"]))
    assert plain.fingerprint() == logged.fingerprint()
    with pytest.raises(ConfigError, match="log: Input should be 'tensorboard', 'wandb' or 'mlflow'"):
        load_config(_config(log=["tensorbord"]))


def test_parse_tracker_list():
    assert trackers.parse_tracker_list("tensorboard, mlflow,tensorboard") == ("tensorboard", "mlflow")
    assert trackers.parse_tracker_list("none") == () == trackers.parse_tracker_list("")
    with pytest.raises(ConfigError, match="--log takes a comma-separated list of tensorboard, wandb, mlflow"):
        trackers.parse_tracker_list("tensorboard,tb")


def test_a_missing_tracker_package_stops_the_run_before_any_work(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=f"wandb is not installed; {re.escape(install_hint('wandb'))}"):
        driftlab.run(_config(log=["wandb"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    result = driftlab_cli(
        "sweep", "synthetic-fedavg", "--grid", "client.lr=0.01,0.02", "--out", tmp_path / "sweep", "--log", "wandb"
    )
    _assert_clean_error(result, install_hint("wandb"))
    assert not (tmp_path / "sweep").exists()


def test_log_needs_an_output_directory():
    with pytest.raises(ConfigError, match="needs an output directory"):
        driftlab.run(_config(log=["tensorboard"]))


def test_log_option_refuses_an_unknown_tracker(tmp_path):
    result = driftlab_cli("run", "synthetic-fedavg", "--out", tmp_path / "run", "--log", "tensorbord")
    _assert_clean_error(result, "--log takes a comma-separated list", "'tensorbord'")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_run_and_sweep_log_option(tmp_path):
    pytest.importorskip("tensorboard")
    tiny = ["rounds=2", "client.epochs=none", "client.steps=2", "data.num_clients=5", "sampling.participation=0.4"]
    out = tmp_path / "run"
    result = driftlab_cli("run", "synthetic-fedavg", *tiny, "--out", out, "--quiet", "--log", "tensorboard")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["log"] == ["tensorboard"]
    assert [step for step, _ in _tensorboard_series(out)["model_norm"]] == [1, 2]

    sweep = tmp_path / "sweep"
    args = [
        "sweep",
        "synthetic-fedavg",
        *tiny,
        "--grid",
        "client.lr=0.01,0.02",
        "--out",
        sweep,
        "--jobs",
        "2",
        "--no-report",
    ]
    result = driftlab_cli(*args, "--log", "tensorboard")
    assert result.returncode == 0, result.stderr
    run_dirs = sorted(path.parent for path in sweep.glob("runs/**/metrics.jsonl"))
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        assert [step for step, _ in _tensorboard_series(run_dir)["model_norm"]] == [1, 2]
    # the same sweep without --log: its runs are the same runs (finished, skipped)
    again = driftlab_cli(*args)
    assert again.returncode == 0 and "2 complete" in again.stdout, again.stderr


def test_a_report_puts_logged_and_unlogged_seeds_of_one_config_in_one_row():
    from driftlab.experiments.report import RunData, label_standalone

    runs = [
        RunData(Path("a"), load_config(_config(seed=0)).to_dict(), [], None, seed=0),
        RunData(Path("b"), load_config(_config(seed=1, log=["tensorboard"])).to_dict(), [], None, seed=1),
    ]
    label_standalone(runs)
    assert (runs[0].setting, runs[0].method) == (runs[1].setting, runs[1].method)
    assert "log" not in runs[0].method
