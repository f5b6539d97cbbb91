"""Where a sweep's runs execute: local processes, SLURM jobs (submitit) or Ray tasks.

Every executor does one thing: given run tasks (a run directory, its resolved
config and the threads it may use), run each through the same worker entry point
(``driftlab.experiments.sweep.execution.worker_main``, a fresh interpreter per run) and
report each run's exit code. The run directory is the only state, so any
executor resumes, skips or retries what another one started, and every executor
gives the same final models and metrics byte for byte (same threads per run).

An executor module has ``execute(tasks, options, events) -> list[TaskResult]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from driftlab.experiments.config import ConfigError

ExecutorName = Literal["local", "slurm", "ray"]
EXECUTORS: tuple[ExecutorName, ...] = ("local", "slurm", "ray")


@dataclass(frozen=True)
class RunTask:
    key: str  # the run's directory relative to the sweep: its name in outcomes
    run_dir: Path  # absolute: remote workers do not share the sweep's working directory
    config: dict[str, Any]  # the resolved config table (ExperimentConfig.to_dict())
    threads: int
    label: str = ""  # how logs name the run
    cwd: str | None = None  # the sweep's working directory, where relative paths of the config (data.root) start


@dataclass(frozen=True)
class ExecutorOptions:
    name: ExecutorName = "local"
    jobs: int | None = None  # local: parallel processes (default: the core count)
    slurm_partition: str | None = None
    slurm_time: int = 60  # minutes per job
    slurm_cpus: int | None = None  # CPUs per job (default: the run's threads)
    slurm_gpus: int = 0  # GPUs per job
    slurm_mem: int | None = None  # GB per job (default: the cluster's)
    slurm_array_parallelism: int = 256  # jobs of the array running at once
    slurm_local: bool = False  # submitit's LocalExecutor: the same jobs as processes on this machine
    ray_address: str = "auto"


@dataclass(frozen=True)
class TaskResult:
    task: RunTask
    exit_code: int | None  # the worker's exit code (minus the signal's number when killed by one)
    seconds: float = 0.0
    started: bool = True  # False: not started, another live process holds its directory (``holder``)
    holder: int = 0
    job: dict[str, Any] = field(default_factory=dict)  # executor, job_id, stdout, stderr where known


@dataclass(frozen=True)
class Events:
    """Callbacks an executor calls as runs start and end (the sweep logs them and records job ids)."""

    started: Callable[[RunTask, bool, dict[str, Any]], None] = lambda task, resume, job: None
    finished: Callable[[TaskResult], None] = lambda result: None
    interrupted: Callable[[], None] = lambda: None  # Ctrl-C or SIGTERM: called before the runs are stopped


def execute(tasks: list[RunTask], options: ExecutorOptions, events: Events = Events()) -> list[TaskResult]:
    """Run ``tasks`` on the executor ``options.name``; returns one result per task (fewer when interrupted)."""
    if options.name == "local":
        from driftlab.executors import local as module
    elif options.name == "slurm":
        from driftlab.executors import slurm as module  # type: ignore[no-redef]
    elif options.name == "ray":
        from driftlab.executors import ray_executor as module  # type: ignore[no-redef]
    else:
        raise ConfigError(f"--executor must be one of {', '.join(EXECUTORS)}, got {options.name!r}")
    return module.execute(tasks, options, events)


def check_options(options: ExecutorOptions) -> None:
    """Refuse impossible executor options before anything is planned or written."""
    for name in ("slurm_time", "slurm_cpus", "slurm_mem", "slurm_array_parallelism", "jobs"):
        value = getattr(options, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if options.slurm_gpus < 0:
        raise ConfigError(f"--slurm-gpus must be 0 or more, got {options.slurm_gpus}")
    if options.name == "slurm":
        from driftlab.executors.slurm import check_available

        check_available(options)
    elif options.name == "ray":
        from driftlab.executors.ray_executor import check_available

        check_available()


def set_aside_held(tasks: list[RunTask], events: Events) -> tuple[list[TaskResult], list[RunTask]]:
    """Results for the tasks whose directory a live process holds (submitting them would only queue a job
    that exits at once), and the tasks left to submit."""
    from driftlab.experiments.sweep import directory  # looked up at call time: tests replace directory.run_directory_holder

    held, runnable = [], []
    for task in tasks:
        holder = directory.run_directory_holder(task.run_dir)
        if holder is None:
            runnable.append(task)
        else:
            held.append(TaskResult(task, None, started=False, holder=holder))
            events.finished(held[-1])
    return held, runnable


def run_task(task: RunTask, job: dict[str, Any], on_start: Callable[[Any], None] = lambda process: None) -> TaskResult:
    """Run one task in a fresh worker process started here (what a SLURM job or a Ray task does) and wait for it.

    Resume is decided now, not at submission: a requeued or retried job continues from what the
    directory holds. ``on_start`` gets the worker's Popen (to pass a pre-emption on to it).
    """
    from driftlab.experiments.sweep.directory import FAILURE_FILE, run_directory_holder
    from driftlab.experiments.sweep.execution import start_worker

    holder = run_directory_holder(task.run_dir)
    if holder is not None:
        return TaskResult(task, None, started=False, holder=holder, job=job)
    (task.run_dir / FAILURE_FILE).unlink(missing_ok=True)
    resume = (task.run_dir / "config.json").exists()
    started = time.perf_counter()
    process = start_worker(task.run_dir, task.config, resume, task.threads, executor=job, cwd=task.cwd)
    on_start(process)
    try:
        code = process.wait()
    except BaseException:
        # The job itself is being stopped: the run checkpoints its last completed round, then exits.
        if process.poll() is None:
            process.terminate()
        process.wait()
        raise
    return TaskResult(task, code, time.perf_counter() - started, job=job)


__all__ = ["EXECUTORS", "Events", "ExecutorOptions", "RunTask", "TaskResult", "check_options", "execute", "run_task", "set_aside_held"]
