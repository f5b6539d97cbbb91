from pathlib import Path

import pytest

from driftlab.executors.conftest import RUN_ENTRY
from driftlab.executors.tasks import RunTask, absolute


def test_a_task_s_run_directory_is_made_absolute_from_the_sweep_s_working_directory():
    relative = RunTask("runs/a", Path("out/runs/a"), {}, 1, cwd="/work/sweeps", entry=RUN_ENTRY)
    assert absolute(relative).run_dir == Path("/work/sweeps/out/runs/a")
    assert absolute(RunTask("runs/a", Path("out/runs/a"), {}, 1, entry=RUN_ENTRY)).run_dir == Path.cwd() / "out/runs/a"
    already = RunTask("runs/a", Path("/data/out/runs/a"), {}, 1, cwd="/work/sweeps", entry=RUN_ENTRY)
    assert absolute(already) is already


def test_a_task_s_entry_must_be_a_module_function_reference():
    for entry in ("run_recorded", "driftlab.experiments.run.runner:", ":run_recorded", "a.b:c.d", None):
        with pytest.raises(ValueError, match="a run's entry must be a 'module:function' reference"):
            RunTask("runs/a", Path("out/runs/a"), {}, 1, entry=entry)
    with pytest.raises(TypeError, match="entry"):  # no default: the caller always says what its workers run
        RunTask("runs/a", Path("out/runs/a"), {}, 1)
