import json
import os
import signal
import time
from pathlib import Path

import pytest

from driftlab.errors import ConfigError
from driftlab.executors import ExecutorOptions, check_options
from driftlab.executors.conftest import RUN_ENTRY, assert_same_results, check_kill_and_resume, run_dirs, sweep
from driftlab.experiments.run.run_directory import read_run_info

submitit = pytest.importorskip("submitit")

SLURM_LOCAL = ExecutorOptions("slurm", local=True)


def test_without_sbatch_the_slurm_executor_stops_with_what_to_do(monkeypatch):
    from driftlab.executors import slurm

    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs SLURM's sbatch on PATH.*add --slurm-local"):
        check_options(ExecutorOptions("slurm", partition="gpu"))
    check_options(SLURM_LOCAL)  # submitit's local executor needs no cluster


def test_slurm_options_become_the_jobs_parameters(tmp_path):
    from driftlab.executors.slurm import SlurmOptions, make_executor

    executor = make_executor(SlurmOptions(time=120, gpus=1, mem=8, local=True), tmp_path, cpus=2)
    assert (executor.parameters["timeout_min"], executor.parameters["gpus_per_node"]) == (120, 1)
    # submitit's local executor takes none of the cluster's options: they are not handed to it
    local = make_executor(
        SlurmOptions(local=True, account="proj", qos="high", setup=("module load cuda",)), tmp_path, cpus=1, gpus=0
    )
    assert not any(name in local.parameters for name in ("account", "qos", "setup", "slurm_account"))


def test_account_qos_constraint_time_gpus_and_setup_lines_reach_the_sbatch_script(tmp_path, monkeypatch):
    from submitit.slurm import slurm as submitit_slurm

    from driftlab.executors.slurm import SlurmOptions, make_executor

    monkeypatch.setattr(submitit_slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # as on a node with srun
    options = SlurmOptions(
        partition="gpu",
        time=90,
        account="proj-7",
        qos="high",
        constraint="a100|h100",
        setup=("module load cuda/12.4", "source .venv/bin/activate"),
    )
    executor = make_executor(options, tmp_path, cpus=4, gpus=2)
    parameters = executor._executor.parameters
    assert {
        k: parameters[k]
        for k in ("time", "gpus_per_node", "cpus_per_task", "partition", "account", "qos", "constraint", "setup")
    } == {
        "time": 90,
        "gpus_per_node": 2,
        "cpus_per_task": 4,
        "partition": "gpu",
        "account": "proj-7",
        "qos": "high",
        "constraint": "a100|h100",
        "setup": ["module load cuda/12.4", "source .venv/bin/activate"],
    }
    script = submitit_slurm._make_sbatch_string(command="python run.py", folder=tmp_path, **parameters).splitlines()
    for line in (
        "#SBATCH --account=proj-7",
        "#SBATCH --qos=high",
        "#SBATCH --constraint='a100|h100'",
        "#SBATCH --time=90",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --partition=gpu",
    ):
        assert line in script
    setup = script.index("# setup")
    assert script[setup + 1 : setup + 3] == ["module load cuda/12.4", "source .venv/bin/activate"]
    assert setup < script.index("# command")  # before the run


def test_each_job_gets_the_gpus_its_runs_use_and_each_run_its_device_numbered_from_0(tmp_path, monkeypatch):
    from driftlab.executors import slurm
    from driftlab.executors.slurm import SlurmOptions
    from driftlab.executors.tasks import RunTask, TaskResult

    made, submitted = [], []

    class Job:
        def __init__(self, number, task):
            self.job_id, self.task = f"100_{number}", task
            self.paths = type("Paths", (), {"stdout": tmp_path / "out", "stderr": tmp_path / "err"})()

        def done(self):
            return True

        def result(self):
            return TaskResult(self.task, 0, 0.1)

    class Executor:
        def map_array(self, function, tasks):
            submitted.extend(task.config["device"] for task in tasks)
            return [Job(number, task) for number, task in enumerate(tasks)]

    def make_executor(options, folder, cpus, gpus=None):
        made.append(gpus)
        return Executor()

    monkeypatch.setattr(slurm, "make_executor", make_executor)
    monkeypatch.setattr(slurm, "POLL_SECONDS", 0)
    monkeypatch.setattr(slurm.shutil, "which", lambda name: "/usr/bin/sbatch")
    tasks = [
        RunTask(f"r{i}", tmp_path / f"r{i}", {"device": d}, 1, label=f"r{i}", entry=RUN_ENTRY)
        for i, d in enumerate(["cuda:3", "cuda:2,cuda:5", "cpu"])
    ]
    for task in tasks:
        task.run_dir.mkdir()
    results = slurm.execute(tasks, SlurmOptions())
    assert [r.exit_code for r in results] == [0, 0, 0] and [r.task.config["device"] for r in results] == [
        "cuda:3",
        "cuda:2,cuda:5",
        "cpu",
    ]
    assert made == [2] and submitted == ["cuda:0", "cuda:0,cuda:1", "cpu"]  # every job gets the most any run uses
    assert slurm.job_gpus(SlurmOptions(gpus=4), tasks) == 4
    assert (
        slurm.job_gpus(SlurmOptions(), [RunTask("a", tmp_path, {"device": "auto"}, 1, entry=RUN_ENTRY)]) == 0
    )  # auto asks for none
    assert slurm.job_gpus(SlurmOptions(gpus=0), [RunTask("a", tmp_path, {"device": "auto"}, 1, entry=RUN_ENTRY)]) == 0
    with pytest.raises(
        ConfigError,
        match=r"^r1 uses 2 GPU\(s\) \(device=cuda:0,cuda:1\), but --slurm-gpus 1 gives each job 1; give --slurm-gpus 2, or leave it out",
    ):
        slurm.execute(tasks, SlurmOptions(gpus=1))


def test_impossible_cluster_options_are_refused_by_name():
    for options, message in (
        (
            ExecutorOptions("slurm", local=True, account="my project"),
            r"^--slurm-account must be one word, as sbatch --account takes it, got 'my project'$",
        ),
        (ExecutorOptions("slurm", local=True, qos=""), r"^--slurm-qos must be one word"),
        (
            ExecutorOptions("slurm", local=True, setup=("module load a\nmodule load b",)),
            r"^--slurm-setup takes one shell line each time it is given",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            check_options(options)
    check_options(
        ExecutorOptions(
            "slurm", local=True, account="p1", qos="high", constraint="a100&ib", setup=("module load cuda",)
        )
    )


@pytest.mark.slow
def test_slurm_local_sweep_equals_the_local_one_and_records_its_jobs(tmp_path, local_reference):
    logged: list[str] = []
    outcomes = sweep(tmp_path, SLURM_LOCAL, logged=logged)
    assert [o.status for o in outcomes] == ["complete"] * 4, logged
    assert_same_results(tmp_path, local_reference)
    jobs = json.loads((tmp_path / "jobs.json").read_text())
    for run_dir in run_dirs(tmp_path):
        recorded = read_run_info(run_dir)["executor"]
        key = str(run_dir.relative_to(tmp_path))
        assert recorded["executor"] == "slurm" and recorded["job_id"] == jobs["runs"][key]["job_id"]
        assert recorded["stdout"].endswith("_log.out") and recorded["stderr"].endswith("_log.err")
        assert f"(job {recorded['job_id']})" in "\n".join(logged)
    logged.clear()
    assert [o.status for o in sweep(tmp_path, SLURM_LOCAL, logged=logged)] == ["complete"] * 4
    assert "4 runs, 4 already finished, 0 to run" in logged[0] and not any("submit" in line for line in logged)


@pytest.mark.slow
def test_a_killed_slurm_worker_is_resumed_from_its_checkpoint_by_the_next_sweep(tmp_path, long_reference):
    check_kill_and_resume(tmp_path, SLURM_LOCAL, long_reference)


@pytest.mark.slow
def test_a_run_killed_under_the_local_executor_is_resumed_by_a_slurm_job(tmp_path, long_reference):
    # the run directory is the only state: any executor continues what another started
    check_kill_and_resume(tmp_path, ExecutorOptions("local", jobs=1), long_reference, resume_with=SLURM_LOCAL)


@pytest.mark.slow
def test_preemption_checkpoints_the_run_and_the_requeued_job_resumes_it(tmp_path, long_reference):
    # SLURM warns of pre-emption or the time limit with USR2 (submitit's --signal): the job stops its run at the last
    # completed round, checkpointed, and requeues itself; the requeued job resumes the run.
    import os
    import signal
    import threading
    import time

    from driftlab.executors.conftest import LONG_RUN, long_spec, worker_pids

    out = tmp_path / "preempted"
    run_dir = run_dirs(out, long_spec(), LONG_RUN)[0]
    signalled: list[int] = []

    def preempt() -> None:
        deadline = time.time() + 240
        while time.time() < deadline:
            metrics_file = run_dir / "metrics.jsonl"
            if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 5:
                for pid in worker_pids(run_dir):
                    job_process = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                    os.kill(job_process, signal.SIGUSR2)
                    signalled.append(job_process)
                    return
            time.sleep(0.02)

    watcher = threading.Thread(target=preempt, daemon=True)
    watcher.start()
    logged: list[str] = []
    outcomes = sweep(out, SLURM_LOCAL, long_spec(), LONG_RUN, logged)
    watcher.join(timeout=30)
    assert signalled, "the run finished before it could be pre-empted"
    assert [o.status for o in outcomes] == ["complete"], logged
    info = read_run_info(run_dir)
    assert info["resumed_from_round"] is not None and info["resumed_from_round"] >= 5, (
        info
    )  # requeued and resumed, not restarted
    assert "this job is preempted" in Path(info["executor"]["stderr"]).read_text()  # the same job, requeued
    assert_same_results(out, long_reference, long_spec(), LONG_RUN)


@pytest.mark.slow
def test_cli_sweep_through_slurm_local_then_status_shows_each_run_done_with_its_job(tmp_path):
    import subprocess

    from driftlab.executors.conftest import FOUR_RUNS
    from driftlab.experiments.sweep.testing import FEDPROX_GRID, sweep_command

    out = tmp_path / "cli"
    command = sweep_command("synthetic-fedprox", *FOUR_RUNS, *FEDPROX_GRID)
    options = ["--executor", "slurm", "--slurm-local", "--threads", "1", "--no-report", "--out", str(out)]
    result = subprocess.run([*command, *options], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("  submit  ") == 4 and "sweep finished: 4 complete" in result.stdout
    status = subprocess.run(
        sweep_command("--status", str(out)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    jobs = json.loads((out / "jobs.json").read_text())["runs"]
    for name, job in jobs.items():
        assert f"done         {name}  3/3 rounds  job {job['job_id']}" in lines
    assert lines[-1] == "4 runs: 4 done"


def test_stop_when_gone_sends_sigterm_once_the_watched_process_has_ended():
    import subprocess
    import sys

    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = (
        "import signal, sys, time\nfrom driftlab.executors.slurm import stop_when_gone\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('terminated', flush=True), sys.exit(0)))\n"
        f"stop_when_gone({watched.pid}, poll_seconds=0.05)\nprint('watching', flush=True)\ntime.sleep(60)\nprint('not stopped')"
    )
    watcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline() == "watching\n"
        time.sleep(0.3)
        assert watcher.poll() is None  # the watched process lives: nothing happens
        os.kill(watched.pid, signal.SIGKILL)
        watched.wait()
        assert watcher.stdout.readline() == "terminated\n"
        assert watcher.wait(timeout=30) == 0
    finally:
        for process in (watched, watcher):
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()


def _sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits for stopped process ``pid`` (its /proc status's pending-signal masks)."""
    bit = 1 << (signal.SIGTERM - 1)
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return True  # gone: nothing left to stop
    return any(line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit for line in lines)


@pytest.mark.slow
def test_a_sigkilled_slurm_local_sweep_stops_its_jobs_and_the_rerun_finishes_them_exactly(tmp_path, long_reference):
    # Before: the jobs ran on without the sweep, and the rerun printed "sweep finished: 1 running" with exit 0.
    import subprocess

    from driftlab.executors.conftest import LONG_RUN, long_spec, worker_pids
    from driftlab.experiments.sweep.testing import sweep_command

    out = tmp_path / "long"  # a --grid sweep is named after its directory: the name of long_spec()
    run_dir = run_dirs(out, long_spec(), LONG_RUN)[0]
    command = sweep_command("synthetic-fedprox", *LONG_RUN, "--grid", "algorithm.mu=[1]", "--seeds", "0")
    swept = subprocess.Popen(
        [*command, "--executor", "slurm", "--slurm-local", "--threads", "1", "--no-report", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (
            (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 5
        ):
            time.sleep(0.05)
        workers = worker_pids(run_dir.absolute())
        assert workers, "the run finished before the sweep could be killed"
        # The worker is held (SIGSTOP) until its job has told it to stop, so however loaded the machine, it cannot
        # finish its last rounds in the time the job takes to see the sweep gone: the test sees the stop, not a race.
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        os.kill(swept.pid, signal.SIGKILL)
        swept.wait()
        deadline = time.time() + 60
        while time.time() < deadline and not all(_sigterm_pending(pid) for pid in workers):
            time.sleep(0.05)
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        deadline = time.time() + 60  # it stops within a second or two; left alone it would finish its 40 rounds
        while time.time() < deadline and worker_pids(run_dir.absolute()):
            time.sleep(0.1)
        assert not worker_pids(run_dir.absolute()), "the run went on without its sweep"
    finally:
        if swept.poll() is None:
            swept.kill()
            swept.wait()
    assert json.loads((run_dir / "run.json").read_text())["rounds_done"] < 40, (
        "the run went on to the end without its sweep"
    )
    outcomes = sweep(out, SLURM_LOCAL, long_spec(), LONG_RUN)
    assert [o.status for o in outcomes] == ["complete"]
    assert_same_results(out, long_reference, long_spec(), LONG_RUN)
