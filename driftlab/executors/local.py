"""The local executor: up to ``jobs`` worker processes on this machine, started as earlier ones end.

Each worker is a child of the sweep and dies with it (checkpointing first); Ctrl-C
reaches the whole process group, and a SIGTERM sent to the sweep alone is passed on.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from typing import Any

from driftlab.executors import Events, ExecutorOptions, RunTask, TaskResult


def execute(tasks: list[RunTask], options: ExecutorOptions, events: Events = Events()) -> list[TaskResult]:
    from driftlab.experiments.sweep import directory, execution  # looked up at call time: tests replace directory.run_directory_holder

    jobs = max(1, min(options.jobs or 1, max(len(tasks), 1)))
    results: list[TaskResult] = []
    active: dict[str, tuple[Any, RunTask, float]] = {}
    queue = list(tasks)
    previous_term = signal.getsignal(signal.SIGTERM)
    terminated: list[int] = []

    def terminate(signum, frame):  # noqa: ARG001
        terminated.append(signum)
        raise KeyboardInterrupt(f"terminated by signal {signum}")

    if execution.in_main_thread():
        signal.signal(signal.SIGTERM, terminate)
    try:
        while queue or active:
            while queue and len(active) < jobs:
                task = queue.pop(0)
                holder = directory.run_directory_holder(task.run_dir)
                if holder is not None:
                    results.append(TaskResult(task, None, started=False, holder=holder))
                    events.finished(results[-1])
                    continue
                (task.run_dir / directory.FAILURE_FILE).unlink(missing_ok=True)
                resume = (task.run_dir / "config.json").exists()
                process = execution.start_worker(task.run_dir, task.config, resume, task.threads)
                active[task.key] = (process, task, time.perf_counter())
                events.started(task, resume, {})
            time.sleep(0.2)
            for key in [k for k, (p, _, _) in active.items() if p.poll() is not None]:
                process, task, started = active.pop(key)
                results.append(TaskResult(task, process.returncode, time.perf_counter() - started))
                events.finished(results[-1])
    except KeyboardInterrupt:
        events.interrupted()
        # Ctrl-C reaches the whole process group, so the runs are already checkpointing; a SIGTERM sent to
        # the sweep alone is passed on. Either way each run saves its last completed round before exiting.
        if not terminated:
            for process, _, _ in active.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=60)
        for process, _, _ in active.values():
            if process.poll() is None:
                process.terminate()
        for process, _, _ in active.values():
            process.wait()
        raise
    except BaseException:
        # The sweep itself failed (a `log` callback raised, say): its runs must not go on without it.
        for process, _, _ in active.values():
            if process.poll() is None:
                process.terminate()
        for process, _, _ in active.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=60)
        raise
    finally:
        if execution.in_main_thread():
            signal.signal(signal.SIGTERM, previous_term)
    return results
