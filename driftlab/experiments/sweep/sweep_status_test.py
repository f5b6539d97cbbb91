import fcntl
import json
from pathlib import Path

import pytest

from driftlab.cli import main
from driftlab.experiments.config import ConfigError
from driftlab.experiments.sweep.sweep_status import format_status, sweep_status

RUNS = [
    "runs/done",
    "runs/running",
    "runs/queued",
    "runs/submitted",
    "runs/failed",
    "runs/diverged",
    "runs/interrupted",
]


def write_run(run_dir: Path, status: str, rounds_done: int, **extra) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "run.json").write_text(json.dumps({"status": status, "rounds": 3, "rounds_done": rounds_done, **extra}))


@pytest.fixture
def sweep_dir(tmp_path):
    """A sweep directory with one run in each state, as executors leave them."""
    (tmp_path / "sweep.json").write_text(json.dumps({"name": "s", "rounds": [3], "runs": [{"dir": d} for d in RUNS]}))
    (tmp_path / "jobs.json").write_text(
        json.dumps({"executor": "slurm", "runs": {"runs/submitted": {"job_id": "812_3"}}})
    )
    write_run(tmp_path / "runs/done", "complete", 3, executor={"executor": "slurm", "job_id": "812_0"})
    write_run(tmp_path / "runs/running", "running", 1, executor={"executor": "ray", "job_id": "c8ef45"})
    write_run(tmp_path / "runs/failed", "running", 2)
    (tmp_path / "runs/failed/failure.txt").write_text(
        "ValueError: bad\n\nTraceback (most recent call last):\n  File x\n    boom()\nValueError: bad\n"
    )
    write_run(tmp_path / "runs/diverged", "diverged", 2, message="diverged in round 3: loss is nan")
    write_run(tmp_path / "runs/interrupted", "running", 2)  # its process was killed: nobody holds the lock
    return tmp_path


def test_status_tells_each_state_with_job_ids_and_the_errors_last_lines(sweep_dir):
    with open(sweep_dir / "runs/running/.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the live run holds its directory
        lock.write("4242\n")
        lock.flush()
        states = sweep_status(sweep_dir)
    assert [(s.dir, s.state, s.job_id) for s in states] == [
        ("runs/done", "done", "812_0"),
        ("runs/running", "running", "c8ef45"),
        ("runs/queued", "queued", ""),
        ("runs/submitted", "queued", "812_3"),
        ("runs/failed", "failed", ""),
        ("runs/diverged", "diverged", ""),
        ("runs/interrupted", "interrupted", ""),
    ]
    text = format_status(states)
    lines = text.splitlines()
    assert lines[0] == "done         runs/done  3/3 rounds  job 812_0"
    assert lines[1] == "running      runs/running  1/3 rounds  job c8ef45  (pid 4242 holds its directory)"
    assert "queued       runs/submitted  0/3 rounds  job 812_3" in lines
    failed = lines.index("failed       runs/failed  2/3 rounds")
    assert lines[failed + 1 : failed + 4] == ["      File x", "        boom()", "    ValueError: bad"]
    assert "    diverged in round 3: loss is nan" in lines
    assert lines[-1] == "7 runs: 1 done, 1 running, 2 queued, 1 interrupted, 1 failed, 1 diverged"
    assert not (sweep_dir / "runs/queued").exists()  # reading only: nothing created


def test_status_on_the_command_line_needs_no_sweep_name_and_refuses_a_non_sweep(sweep_dir, tmp_path, capsys):
    assert main(["sweep", "--status", str(sweep_dir)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("done         runs/done") and "7 runs:" in out
    assert main(["sweep", "--status", str(tmp_path / "runs")]) == 2
    assert "holds no sweep.json, so it is not a sweep directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["sweep", "--out", str(tmp_path / "x")])
    assert exited.value.code == 2
    assert "needs a SWEEP and --out DIR (or --status DIR" in capsys.readouterr().err


def test_a_damaged_plan_is_named(tmp_path):
    (tmp_path / "sweep.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read .*sweep.json"):
        sweep_status(tmp_path)
