"""The SLURM executor: one submitit array job per sweep invocation, one array task per run.

Each array task starts the run's worker process (the same entry point as the local
executor) and waits for it. Pre-emption and time limits: SLURM sends SIGTERM to every
process of the job, so the run checkpoints its last completed round and exits;
submitit's USR2 (sent ahead of the time limit) stops the run the same way and
requeues the job, which resumes from the checkpoint. A run whose job was cancelled
or never requeued resumes when the sweep runs again, on any executor. The job id
and its log paths go into the run's ``run.json`` (``executor``) and the sweep's
``jobs.json``. ``--slurm-local`` runs the same jobs through submitit's local
executor, as processes on this machine (tests, a laptop), which stop (checkpointed)
when the sweep ends, however it ends, as the local executor's runs do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from driftlab.executors import Events, ExecutorOptions, RunTask, TaskResult, run_task, set_aside_held
from driftlab.experiments.config import ConfigError

LOG_FOLDER = "slurm-logs"  # in the sweep directory: submitit's pickles and each job's stdout/stderr
POLL_SECONDS = 1.0
STOP_SECONDS = 300  # for a run to save its checkpoint once told to stop

_workers: list[Any] = []  # this job's worker process, for `checkpoint` (a Popen cannot travel in the pickled job)


def check_available(options: ExecutorOptions) -> None:
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise ConfigError("--executor slurm needs submitit: pip install 'driftlab[slurm]'") from None
    if not options.slurm_local and shutil.which("sbatch") is None:
        raise ConfigError(
            "--executor slurm needs SLURM's sbatch on PATH (run the sweep on the cluster's login node); "
            "to run the same jobs on this machine, add --slurm-local"
        )


@dataclass(frozen=True)
class SlurmRun:
    """What each array task runs: the run's worker, waited for. submitit calls ``checkpoint`` on USR2 (pre-emption, time limit).

    ``sweep_pid`` (``--slurm-local`` only): the sweep on this machine; the job stops its run (checkpointed) when that
    process ends, however it ends, as a local executor's runs do. submitit's local jobs are made to outlive the
    session that submitted them, so a SIGKILLed sweep would otherwise leave them running. Cluster jobs outlive the
    sweep as SLURM intends: the next sweep leaves them alone and says so.
    """

    sweep_pid: int = 0

    def __call__(self, task: RunTask) -> TaskResult:
        import submitit

        environment = submitit.JobEnvironment()
        paths = environment.paths
        job = {"executor": "slurm", "job_id": environment.job_id, "stdout": str(paths.stdout), "stderr": str(paths.stderr)}
        # submitit ignores SIGTERM in the job's own process; pass it on so the run checkpoints (SLURM signals
        # every process, but submitit's local executor signals only this one).
        signal.signal(signal.SIGTERM, _stop_worker)
        if self.sweep_pid:
            stop_when_gone(self.sweep_pid)
        return run_task(task, job, on_start=_workers.append)

    def checkpoint(self, task: RunTask) -> Any:
        """Stop the run at its last completed round (checkpointed), then let submitit requeue this task to resume it."""
        import submitit

        _stop_worker()
        return submitit.helpers.DelayedSubmission(self, task)


def stop_when_gone(pid: int, poll_seconds: float = 0.5) -> None:
    """Send this process SIGTERM once process ``pid`` has ended (a daemon thread watches it)."""
    import threading

    from driftlab.experiments.sweep.execution import process_gone

    def watch() -> None:
        while not process_gone(pid):
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="driftlab-sweep-watch", daemon=True).start()


def _stop_worker(signum: int | None = None, frame: Any = None) -> None:  # noqa: ARG001
    """Stop this job's run (SIGTERM: it checkpoints, then exits) and wait until it has.

    Runs in a signal handler that interrupted ``Popen.wait``, whose lock it cannot take again:
    it waits by watching the process end (a zombie has ended) instead of calling ``wait``.
    """
    from driftlab.experiments.sweep.execution import process_gone

    for process in _workers:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
    deadline = time.time() + STOP_SECONDS
    while time.time() < deadline and not all(process.returncode is not None or process_gone(process.pid) for process in _workers):
        time.sleep(0.05)


def sweep_directory(task: RunTask) -> Path:
    """The sweep directory a task's run directory sits in (``task.key`` is the run's path inside it)."""
    return task.run_dir.parents[len(Path(task.key).parts) - 1]


def make_executor(options: ExecutorOptions, folder: Path, cpus: int) -> Any:
    import submitit

    executor = submitit.AutoExecutor(folder=folder / "%j", cluster="local" if options.slurm_local else "slurm")
    parameters: dict[str, Any] = {"name": "driftlab", "timeout_min": options.slurm_time, "cpus_per_task": cpus, "gpus_per_node": options.slurm_gpus}
    if options.slurm_mem is not None:
        parameters["mem_gb"] = options.slurm_mem
    if not options.slurm_local:
        parameters["slurm_array_parallelism"] = options.slurm_array_parallelism
        if options.slurm_partition:
            parameters["slurm_partition"] = options.slurm_partition
    executor.update_parameters(**parameters)
    return executor


def execute(tasks: list[RunTask], options: ExecutorOptions, events: Events = Events()) -> list[TaskResult]:
    check_available(options)
    results, runnable = set_aside_held(tasks, events)
    if not runnable:
        return results
    executor = make_executor(options, sweep_directory(runnable[0]) / LOG_FOLDER, options.slurm_cpus or runnable[0].threads)
    jobs = executor.map_array(SlurmRun(sweep_pid=os.getpid() if options.slurm_local else 0), runnable)
    pending = {}
    submitted = time.perf_counter()
    for task, job in zip(runnable, jobs):
        info = {"executor": "slurm", "job_id": str(job.job_id), "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)}
        pending[info["job_id"]] = (job, task, info)
        events.started(task, (task.run_dir / "config.json").exists(), info)
    try:
        while pending:
            time.sleep(POLL_SECONDS)
            for job_id in [k for k, (job, _, _) in pending.items() if job.done()]:
                job, task, info = pending.pop(job_id)
                results.append(_result(job, task, info, time.perf_counter() - submitted))
                events.finished(results[-1])
    except BaseException:
        events.interrupted()
        # Cancelling sends the runs SIGTERM (a local job: SIGINT): each saves its last completed round.
        for job, _, _ in pending.values():
            job.cancel(check=False)
        deadline = time.time() + 120
        while time.time() < deadline and not all(job.done() for job, _, _ in pending.values()):
            time.sleep(POLL_SECONDS)
        raise
    return results


def _result(job: Any, task: RunTask, info: dict[str, Any], seconds: float) -> TaskResult:
    try:
        result = job.result()
    except Exception as error:  # noqa: BLE001 - the job died before its run could say why (killed, out of time, no node)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        return TaskResult(task, None, seconds, job={**info, "error": f"SLURM job {info['job_id']} ended without its run's result ({first}); see {info['stderr']}"})
    if not isinstance(result, TaskResult):
        return TaskResult(task, None, seconds, job={**info, "error": f"SLURM job {info['job_id']} returned {result!r}; see {info['stderr']}"})
    return replace(result, task=task, job={**info, **result.job})
