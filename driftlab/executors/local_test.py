import pytest

from driftlab.executors import ExecutorOptions, RunTask, check_options, execute
from driftlab.executors.conftest import assert_same_results, check_kill_and_resume, run_dirs, sweep
from driftlab.experiments.config import ConfigError
from driftlab.experiments.run_directory import read_run_info


@pytest.mark.slow
def test_local_sweep_is_repeatable_records_no_executor_and_a_rerun_skips_finished_runs(tmp_path, local_reference):
    logged: list[str] = []
    outcomes = sweep(tmp_path, ExecutorOptions("local", jobs=2), logged=logged)
    assert [o.status for o in outcomes] == ["complete"] * 4
    assert "to run in 2 process(es) x 1 thread(s)" in logged[0]
    assert_same_results(tmp_path, local_reference)
    assert all("executor" not in read_run_info(d) for d in run_dirs(tmp_path))
    assert not (tmp_path / "jobs.json").exists()  # nothing was submitted anywhere
    logged.clear()
    assert [o.status for o in sweep(tmp_path, ExecutorOptions("local", jobs=2), logged=logged)] == ["complete"] * 4
    assert "4 runs, 4 already finished, 0 to run" in logged[0] and not any("start" in line for line in logged)


@pytest.mark.slow
def test_a_killed_local_worker_is_resumed_from_its_checkpoint_by_the_next_sweep(tmp_path, long_reference):
    check_kill_and_resume(tmp_path, ExecutorOptions("local", jobs=1), long_reference)


def test_an_unknown_executor_and_impossible_options_are_refused_by_name():
    with pytest.raises(ConfigError, match="--executor must be one of local, slurm, ray, got 'lsf'"):
        execute([], ExecutorOptions("lsf"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--slurm-time must be at least 1, got 0"):
        check_options(ExecutorOptions("slurm", slurm_time=0, slurm_local=True))
    with pytest.raises(ConfigError, match="--slurm-gpus must be 0 or more"):
        check_options(ExecutorOptions("local", slurm_gpus=-1))


def test_a_run_held_by_a_live_process_is_not_started(tmp_path):
    import fcntl

    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    with open(run_dir / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242\n")
        lock.flush()
        results = execute([RunTask("runs/a", run_dir, {}, 1)], ExecutorOptions("local", jobs=1))
    assert [(r.started, r.holder) for r in results] == [(False, 4242)]
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]
