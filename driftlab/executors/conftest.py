"""What the executor tests share: a tiny 4-run sweep, its local reference, and a way to kill a run's worker mid-run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from driftlab.executors import ExecutorOptions
from driftlab.experiments.sweep import execution, plan, run_sweep, sweep_from_config

TINY = ["data.num_clients=6", "client.epochs=1", "sampling.participation=0.5", "evaluation.every=1"]
FOUR_RUNS = [*TINY, "rounds=3"]  # mu 0/1 x seeds 0/1
LONG_RUN = [*TINY, "rounds=40", "checkpoint_every=3"]  # one run, long enough to be killed half way
RUN_ENTRY = execution.RUN_ENTRY  # what a sweep's tasks run: the tests' tasks run it too


def four_run_spec():
    return sweep_from_config("synthetic-fedprox", ["algorithm.mu=[0, 1]"], [0, 1], name="four")


def long_spec():
    return sweep_from_config("synthetic-fedprox", ["algorithm.mu=[1]"], [0], name="long")


def sweep(out: Path, options: ExecutorOptions, spec=None, overrides=FOUR_RUNS, logged: list[str] | None = None):
    lines = logged if logged is not None else []
    return run_sweep(
        spec or four_run_spec(), out, extra_overrides=overrides, executor=options, threads=1, log=lines.append
    )


def run_dirs(out: Path, spec=None, overrides=FOUR_RUNS) -> list[Path]:
    return [out / r.dir for r in plan(spec or four_run_spec(), extra_overrides=overrides)]


def metrics(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("round_seconds")
    return records


def assert_same_results(out: Path, reference: Path, spec=None, overrides=FOUR_RUNS) -> None:
    for run_dir, expected in zip(run_dirs(out, spec, overrides), run_dirs(reference, spec, overrides), strict=True):
        assert (run_dir / "final_model.safetensors").read_bytes() == (
            expected / "final_model.safetensors"
        ).read_bytes(), run_dir
        assert metrics(run_dir) == metrics(expected), run_dir


@pytest.fixture(scope="session")
def local_reference(tmp_path_factory) -> Path:
    """The 4-run sweep through local processes, one thread per run: what every executor must reproduce byte for byte."""
    out = tmp_path_factory.mktemp("local-reference")
    outcomes = sweep(out, ExecutorOptions("local", jobs=2))
    assert [o.status for o in outcomes] == ["complete"] * 4
    return out


@pytest.fixture(scope="session")
def long_reference(tmp_path_factory) -> Path:
    """The long run, uninterrupted (local): what a killed-and-resumed run must equal."""
    out = tmp_path_factory.mktemp("long-reference")
    assert [o.status for o in sweep(out, ExecutorOptions("local", jobs=1), long_spec(), LONG_RUN)] == ["complete"]
    return out


def worker_pids(run_dir: Path) -> list[int]:
    """The worker processes writing ``run_dir`` (found by their command line, which names it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                words = (entry / "cmdline").read_bytes().split(b"\0")
                if any(b"worker_main" in w for w in words) and any(str(run_dir).encode() in w for w in words):
                    found.append(int(entry.name))
    return found


@contextlib.contextmanager
def worker_killed_after(run_dir: Path, rounds: int = 5):
    """While the block runs, SIGKILL the worker of ``run_dir`` once it has recorded ``rounds`` rounds (no chance to checkpoint)."""
    killed: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        deadline = time.time() + 240
        while not stop.is_set() and time.time() < deadline:
            metrics_file = run_dir / "metrics.jsonl"
            if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= rounds:
                for pid in worker_pids(run_dir.absolute()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                if killed:
                    return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        stop.set()
        thread.join(timeout=30)


def check_kill_and_resume(
    tmp_path: Path, options: ExecutorOptions, long_reference: Path, resume_with: ExecutorOptions | None = None
) -> None:
    """A worker SIGKILLed half way fails its run; the next sweep (on ``resume_with``, default the same executor) resumes
    it from its checkpoint, equal to an uninterrupted run."""
    out = tmp_path / "killed"
    run_dir = run_dirs(out, long_spec(), LONG_RUN)[0]
    with worker_killed_after(run_dir) as killed:
        outcomes = sweep(out, options, long_spec(), LONG_RUN)
    assert killed, "the run finished before it could be killed"
    assert outcomes[0].status == "failed" and "SIGKILL" in outcomes[0].message, outcomes[0]
    assert (run_dir / "checkpoint.safetensors").exists()
    assert 3 <= json.loads((run_dir / "run.json").read_text())["rounds_done"] < 40
    options = resume_with or options
    logged: list[str] = []
    outcomes = sweep(out, options, long_spec(), LONG_RUN, logged)
    assert [o.status for o in outcomes] == ["complete"], logged
    assert any("(resuming)" in line for line in logged), logged
    assert_same_results(out, long_reference, long_spec(), LONG_RUN)
    # a third invocation finds nothing left to do
    logged.clear()
    sweep(out, options, long_spec(), LONG_RUN, logged)
    assert "1 runs, 1 already finished, 0 to run" in logged[0]
