"""A run's process as every executor starts it: the worker command, its exit codes, and the run directory's lock.

Every executor runs each run in a fresh interpreter through ``start_worker`` (the entry
point is ``driftlab.executors.worker.worker_main``), so every executor gives the same
results byte for byte. Importing this module imports no torch: ``driftlab sweep --status``
reads run directories with ``run_directory_holder``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from driftlab.executors.tasks import Events, RunTask, TaskResult, check_entry
from driftlab.run_files import LOCK_FILE

FAILURE_FILE = "failure.txt"  # written into a run directory by a worker that failed: the error and its traceback

# Exit codes of a run's process; a run killed by a signal shows as minus the signal's number.
EXIT_COMPLETE, EXIT_FAILED, EXIT_DIVERGED, EXIT_BUSY, EXIT_INTERRUPTED = 0, 1, 3, 4, 130

# The worker's entry point, named (not imported: the worker imports torch and the runner, an executor need not).
WORKER_MODULE = "driftlab.executors.worker"
WORKER_ENTRY = "worker_main"


def worker_command(arguments: str) -> list[str]:
    """The command line of a run's interpreter: ``python -c "...worker_main(...)" ARGUMENTS``."""
    code = f"import sys; from {WORKER_MODULE} import {WORKER_ENTRY}; {WORKER_ENTRY}(sys.argv[1])"
    return [sys.executable, "-c", code, arguments]


def start_worker(
    run_dir: Path,
    config: dict[str, Any],
    resume: bool,
    threads: int,
    executor: dict[str, Any] | None = None,
    cwd: str | None = None,
    environment: Mapping[str, str] | None = None,
    placement: Mapping[str, Any] | None = None,
    *,
    entry: str,
) -> subprocess.Popen:
    """A fresh interpreter per run: nothing of the caller's script is re-imported (as multiprocessing's spawn would),
    and it shares the terminal's process group, so Ctrl-C reaches it and it checkpoints.

    ``config`` is the resolved config table; ``executor`` (job id, log paths) goes into the run's run.json;
    ``cwd`` is where relative paths of the config (data.root) are read from: the sweep's working directory;
    ``environment``: variables set for this run's process only, on top of this process's (its GPUs, their share);
    ``placement`` (the GPUs an executor placed the run on) goes into run.json as ``placement``;
    ``entry``: what the worker runs, the task's ``RunTask.entry`` (a ``"module:function"`` reference).
    """
    check_entry(entry)
    arguments: dict[str, Any] = {
        "entry": entry,
        "run_dir": str(run_dir),
        "config": config,
        "resume": resume,
        "threads": threads,
        "parent": os.getpid(),
    }
    if executor:
        arguments["executor"] = executor
    if placement:
        arguments["placement"] = dict(placement)
    env = {**os.environ, **environment} if environment else None
    return subprocess.Popen(worker_command(json.dumps(arguments)), cwd=cwd, env=env)


def run_directory_holder(run_dir: Path) -> int | None:
    """The process id holding ``run_dir``'s lock (0 when it does not say), or None when no live process holds it.

    Only a probe: the lock is released at once. Called under the sweep's own lock, before this sweep starts the run.
    """
    import fcntl  # POSIX only; imported here so that importing driftlab works everywhere

    try:
        handle = open(run_dir / LOCK_FILE, "rb")
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            found = re.search(rb"\d+", handle.read(64))
            return int(found.group()) if found else 0
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting to be reaped has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return Path("/proc/self").exists()  # no /proc at all (macOS): os.kill said it lives
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def in_main_thread() -> bool:
    """Whether this is the main thread (the only one that may install signal handlers)."""
    return threading.current_thread() is threading.main_thread()


def set_aside_held(tasks: list[RunTask], events: Events) -> tuple[list[TaskResult], list[RunTask]]:
    """Results for the tasks whose directory a live process holds (submitting them would only queue a job
    that exits at once), and the tasks left to submit."""
    held, runnable = [], []
    for task in tasks:
        holder = run_directory_holder(task.run_dir)
        if holder is None:
            runnable.append(task)
        else:
            held.append(TaskResult(task, None, started=False, holder=holder))
            events.finished(held[-1])
    return held, runnable


def run_task(
    task: RunTask,
    job: dict[str, Any],
    on_start: Callable[[Any], None] | None = None,
    environment: Mapping[str, str] | None = None,
) -> TaskResult:
    """Run one task in a fresh worker process started here (what a SLURM job or a Ray task does) and wait for it.

    Resume is decided now, not at submission: a requeued or retried job continues from what the
    directory holds. ``on_start`` gets the worker's Popen (to pass a pre-emption on to it); ``environment``: variables
    for the worker only (its GPU share).
    """
    holder = run_directory_holder(task.run_dir)
    if holder is not None:
        return TaskResult(task, None, started=False, holder=holder, job=job)
    (task.run_dir / FAILURE_FILE).unlink(missing_ok=True)
    resume = (task.run_dir / "config.json").exists()
    started = time.perf_counter()
    process = start_worker(
        task.run_dir,
        task.config,
        resume,
        task.threads,
        executor=job,
        cwd=task.cwd,
        environment=environment,
        entry=task.entry,
    )
    if on_start is not None:
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


__all__ = [
    "EXIT_BUSY",
    "EXIT_COMPLETE",
    "EXIT_DIVERGED",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "FAILURE_FILE",
    "WORKER_MODULE",
    "in_main_thread",
    "process_gone",
    "run_directory_holder",
    "run_task",
    "set_aside_held",
    "start_worker",
    "worker_command",
]
