"""The local executor: up to ``jobs`` worker processes on this machine, started as earlier ones end.

Each worker is a child of the sweep and dies with it (checkpointing first); Ctrl-C
reaches the whole process group, and a SIGTERM sent to the sweep alone is passed on.

Runs started together on one GPU split its memory: each worker is told how many of the
sweep's runs share its GPU (``DRIFTLAB_GPU_SHARE``, read by the run's memory budget,
``driftlab.simulation.state.memory_budget``), so that two runs do not each plan for 80% of it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Mapping

from driftlab.errors import ConfigError
from driftlab.executors import processes
from driftlab.executors.registry import CliOption, Layout
from driftlab.executors.tasks import NO_EVENTS, Events, RunTask, TaskResult

# Named here rather than imported: the memory budget's module imports torch, which an executor does not need.
GPU_SHARE_VARIABLE = "DRIFTLAB_GPU_SHARE"


@dataclass(frozen=True)
class LocalOptions:
    jobs: int | None = None  # parallel processes (default: the cores this process may use)


CLI_OPTIONS = (CliOption("--jobs", "jobs", int, "parallel processes (default: the number of cores)"),)


def check(options: LocalOptions) -> None:
    if options.jobs is not None and options.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {options.jobs}")


def available_cores() -> int:
    """The cores this process may use (its CPU affinity, where the system says)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parallel_jobs(options: LocalOptions, pending: int) -> int:
    """How many runs go at once: ``jobs`` (default: the cores), no more than there are runs, at least one."""
    return max(1, min(options.jobs or available_cores(), max(pending, 1)))


def layout(options: LocalOptions, pending: int) -> Layout:
    """The cores split between the runs going at once (``torch.set_num_threads`` in each)."""
    jobs = parallel_jobs(options, pending)
    return Layout(max(1, available_cores() // jobs), f"in {jobs} process(es)")


def gpus_of(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The GPUs a run's config may use, as ``cuda:N`` (``cuda`` and ``auto``: the first visible one); () for a CPU."""
    device = str(config.get("device", "cpu"))
    if device == "cpu":
        return ()
    if device in ("cuda", "auto"):  # auto runs on the CPU where there is no GPU, where the share is not read
        return ("cuda:0",)
    return tuple(part.strip() for part in device.split(","))


def gpu_shares(tasks: list[RunTask], jobs: int) -> dict[str, int]:
    """For each GPU the tasks use, how many of them can run on it at once: ``min(jobs, tasks using it)``."""
    counts: dict[str, int] = {}
    for task in tasks:
        for gpu in gpus_of(task.config):
            counts[gpu] = counts.get(gpu, 0) + 1
    return {gpu: min(jobs, count) for gpu, count in counts.items()}


def gpu_environment(
    task: RunTask, shares: Mapping[str, int], inherited: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The variables a task's worker gets: the share of its most shared GPU, when it uses one and shares it.

    A share already set for this sweep (two sweeps on one GPU, each told 2) is multiplied: the runs of both split it.
    """
    share = max((shares[gpu] for gpu in gpus_of(task.config)), default=1)
    if share == 1:
        return {}
    outer = inherited.get(GPU_SHARE_VARIABLE, "").strip()
    return {GPU_SHARE_VARIABLE: str(share * (int(outer) if outer.isdigit() and int(outer) > 0 else 1))}


def execute(tasks: list[RunTask], options: LocalOptions, events: Events = NO_EVENTS) -> list[TaskResult]:
    jobs = parallel_jobs(options, len(tasks))
    shares = gpu_shares(tasks, jobs)
    results: list[TaskResult] = []
    active: dict[str, tuple[Any, RunTask, float]] = {}
    queue = list(tasks)
    previous_term = signal.getsignal(signal.SIGTERM)
    terminated: list[int] = []

    def terminate(signum, frame):  # noqa: ARG001
        terminated.append(signum)
        raise KeyboardInterrupt(f"terminated by signal {signum}")

    if processes.in_main_thread():
        signal.signal(signal.SIGTERM, terminate)
    try:
        while queue or active:
            while queue and len(active) < jobs:
                task = queue.pop(0)
                holder = processes.run_directory_holder(task.run_dir)  # looked up at call time: tests replace it
                if holder is not None:
                    results.append(TaskResult(task, None, started=False, holder=holder))
                    events.finished(results[-1])
                    continue
                (task.run_dir / processes.FAILURE_FILE).unlink(missing_ok=True)
                resume = (task.run_dir / "config.json").exists()
                environment = gpu_environment(task, shares)
                process = processes.start_worker(
                    task.run_dir, task.config, resume, task.threads, cwd=task.cwd, environment=environment
                )
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
        if processes.in_main_thread():
            signal.signal(signal.SIGTERM, previous_term)
    return results
