import json
import subprocess
from pathlib import Path

import pytest

from driftlab.errors import ConfigError
from driftlab.executors import ExecutorOptions, RunTask, check_options, execute, local, processes
from driftlab.executors.conftest import assert_same_results, check_kill_and_resume, run_dirs, sweep
from driftlab.executors.local import GPU_SHARE_VARIABLE, LocalOptions, gpu_environment, gpu_shares, gpus_of
from driftlab.executors.registry import Layout
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
    with pytest.raises(ConfigError, match=r"--executor: unknown executor 'lsf'; valid: local, slurm, ray"):
        execute([], ExecutorOptions("lsf"))
    with pytest.raises(ConfigError, match="--slurm-time must be at least 1, got 0"):
        check_options(ExecutorOptions("slurm", time=0, local=True))
    with pytest.raises(ConfigError, match="--slurm-gpus must be 0 or more"):
        check_options(ExecutorOptions("slurm", gpus=-1, local=True))
    with pytest.raises(ConfigError, match="--jobs must be at least 1, got 0"):
        check_options(ExecutorOptions("local", jobs=0))
    with pytest.raises(ConfigError, match="'slurm_gpus' is not an option of executor 'local'; its options: jobs"):
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


def test_the_gpu_share_variable_is_the_one_the_memory_budget_reads():
    from driftlab.simulation.state.memory_budget import GPU_SHARE_VARIABLE as READ, gpu_share

    assert GPU_SHARE_VARIABLE == READ
    assert gpu_share({GPU_SHARE_VARIABLE: "3"}) == 3


def test_a_run_s_gpus_are_those_its_device_names():
    assert gpus_of({"device": "cpu"}) == ()
    assert gpus_of({}) == ()
    assert gpus_of({"device": "cuda"}) == gpus_of({"device": "auto"}) == ("cuda:0",)
    assert gpus_of({"device": "cuda:1"}) == ("cuda:1",)
    assert gpus_of({"device": "cuda:0,cuda:1"}) == ("cuda:0", "cuda:1")


def task(key: str, device: str) -> RunTask:
    return RunTask(key, Path(key), {"device": device}, 1)


def test_runs_started_together_on_a_gpu_are_told_how_many_share_it():
    tasks = [task("a", "cuda:0"), task("b", "cuda:0"), task("c", "cuda:0"), task("d", "cuda:1"), task("e", "cpu")]
    shares = gpu_shares(tasks, jobs=2)
    assert shares == {"cuda:0": 2, "cuda:1": 1}  # at most 2 at once; only one run ever on cuda:1
    assert gpu_environment(tasks[0], shares, {}) == {GPU_SHARE_VARIABLE: "2"}
    assert gpu_environment(tasks[3], shares, {}) == {} == gpu_environment(tasks[4], shares, {})
    # a run on both GPUs plans for the more shared one
    both = task("f", "cuda:0,cuda:1")
    assert gpu_environment(both, gpu_shares([*tasks, both], jobs=4), {}) == {GPU_SHARE_VARIABLE: "4"}
    # a share given to the whole sweep (two sweeps on one GPU) is split further between its runs
    assert gpu_environment(tasks[0], shares, {GPU_SHARE_VARIABLE: "2"}) == {GPU_SHARE_VARIABLE: "4"}
    assert gpu_shares(tasks, jobs=1) == {"cuda:0": 1, "cuda:1": 1}


class FinishedProcess:
    returncode = 0

    def poll(self) -> int:
        return 0


def test_each_local_worker_is_started_with_its_gpu_share(tmp_path, monkeypatch):
    started = []

    def popen(command, cwd=None, env=None):
        started.append((json.loads(command[-1])["run_dir"], (env or {}).get(GPU_SHARE_VARIABLE)))
        return FinishedProcess()

    monkeypatch.setattr(subprocess, "Popen", popen)
    tasks = [RunTask(name, tmp_path / name, {"device": device}, 1) for name, device in (("a", "cuda"), ("b", "cuda"), ("c", "cpu"))]
    for t in tasks:
        t.run_dir.mkdir()
    results = local.execute(tasks, LocalOptions(jobs=3))
    assert [r.exit_code for r in results] == [0, 0, 0]
    assert started == [(str(tmp_path / "a"), "2"), (str(tmp_path / "b"), "2"), (str(tmp_path / "c"), None)]
    assert processes.worker_command("{}")[2].endswith("from driftlab.executors.worker import worker_main; worker_main(sys.argv[1])")


def test_the_cores_are_split_between_the_runs_going_at_once(monkeypatch):
    monkeypatch.setattr(local, "available_cores", lambda: 8)
    assert local.layout(LocalOptions(), pending=2) == Layout(4, "in 2 process(es)")
    assert local.layout(LocalOptions(jobs=3), pending=10) == Layout(2, "in 3 process(es)")
    assert local.layout(LocalOptions(), pending=0) == Layout(8, "in 1 process(es)")
