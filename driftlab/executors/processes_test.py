import json
import subprocess
from pathlib import Path

import pytest

from driftlab.executors import processes
from driftlab.executors.tasks import RunTask


class FinishedProcess:
    def wait(self) -> int:
        return processes.EXIT_COMPLETE


def test_run_task_passes_the_task_s_entry_to_its_worker(tmp_path, monkeypatch):
    # run_task is what a SLURM job and a Ray task run: the entry travels inside the (pickled) task, then as JSON.
    started: list[dict] = []

    def popen(command, cwd=None, env=None):
        started.append(json.loads(command[-1]))
        return FinishedProcess()

    monkeypatch.setattr(subprocess, "Popen", popen)
    task = RunTask("a", tmp_path / "a", {"rounds": 1}, 2, entry="plugin.runs:run_one")
    task.run_dir.mkdir()
    result = processes.run_task(task, {"executor": "ray", "job_id": "7"})
    assert result.exit_code == processes.EXIT_COMPLETE
    assert [(s["entry"], s["run_dir"], s["config"], s["threads"], s["executor"]) for s in started] == [
        ("plugin.runs:run_one", str(tmp_path / "a"), {"rounds": 1}, 2, {"executor": "ray", "job_id": "7"})
    ]


def test_start_worker_refuses_an_entry_that_is_not_a_reference_before_starting_anything(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a worker was started"))
    with pytest.raises(ValueError, match="a run's entry must be a 'module:function' reference .* not 'run_recorded'"):
        processes.start_worker(Path("r"), {}, False, 1, entry="run_recorded")
    with pytest.raises(TypeError, match="entry"):
        processes.start_worker(Path("r"), {}, False, 1)
