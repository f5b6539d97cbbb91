from pathlib import Path

from driftlab.executors.tasks import RunTask, absolute


def test_a_task_s_run_directory_is_made_absolute_from_the_sweep_s_working_directory():
    relative = RunTask("runs/a", Path("out/runs/a"), {}, 1, cwd="/work/sweeps")
    assert absolute(relative).run_dir == Path("/work/sweeps/out/runs/a")
    assert absolute(RunTask("runs/a", Path("out/runs/a"), {}, 1)).run_dir == Path.cwd() / "out/runs/a"
    already = RunTask("runs/a", Path("/data/out/runs/a"), {}, 1, cwd="/work/sweeps")
    assert absolute(already) is already
