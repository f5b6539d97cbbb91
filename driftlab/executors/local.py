"""The local executor: up to ``jobs`` worker processes on this machine, started as earlier ones end.

Each worker is a child of the sweep and dies with it (checkpointing first); Ctrl-C
reaches the whole process group, and a SIGTERM sent to the sweep alone is passed on.

GPU runs are spread over the box's GPUs (``--gpus``, default every visible one): each is
placed before any starts (``gpus.place``: round-robin in the sweep's order, a resumed run
where it ran before, ``cuda:N`` on GPU N), and its worker sees only its own GPUs
(``CUDA_VISIBLE_DEVICES``), so the run's ``cuda`` is the GPU it was given; run.json's
``placement`` records which. Runs placed on one GPU split its memory: each worker is told
how many of the sweep's runs may share its GPU at once (``DRIFTLAB_GPU_SHARE``, read by the
run's memory budget, ``driftlab.simulation.state.memory_budget``), counted per GPU, so that
two runs on GPU 0 do not each plan for 80% of it; no GPU runs more than ``ceil(jobs / GPUs)``
at once (``gpus.gpu_slots``), however the runs' lengths interleave them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

from driftlab.errors import ConfigError
from driftlab.executors import gpus, processes
from driftlab.executors.registry import CliOption, Layout
from driftlab.executors.tasks import NO_EVENTS, Events, RunTask, TaskResult
from driftlab.run_files import read_run_info


@dataclass(frozen=True)
class LocalOptions:
    jobs: int | None = None  # parallel processes (default: the cores this process may use)
    # The GPUs runs are placed on: None (or "all") for every visible one, "none" (or ()) for none, "0,2" (or (0, 2))
    gpus: str | tuple[int, ...] | None = None


CLI_OPTIONS = (
    CliOption("--jobs", "jobs", int, "parallel processes (default: the number of cores)"),
    CliOption(
        "--gpus",
        "gpus",
        str,
        "the GPUs the local executor spreads GPU runs over, as torch numbers them: 0,2, all "
        "(the default: every visible GPU) or none (CPU only)",
        "LIST",
    ),
)


def check(options: LocalOptions, visible: Callable[[], tuple[str, ...]] | None = None) -> None:
    """Refuse a --jobs below 1, a --gpus that is not a list of GPUs, and a GPU this machine does not have.

    ``visible``: the GPUs this process sees (default ``gpus.visible_gpus``, looked up when called: tests replace it).
    """
    if options.jobs is not None and options.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {options.jobs}")
    gpus.check_gpus(options.gpus, visible or gpus.visible_gpus)


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


@dataclass(frozen=True)
class Placed:
    """A task as its worker is started: its config in the worker's GPU numbering, its variables, its placement."""

    task: RunTask
    environment: dict[str, str]
    placement: dict[str, Any] | None = None  # run.json's "placement": the sweep's GPU indices and CUDA_VISIBLE_DEVICES

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(self.placement["gpus"]) if self.placement else ()


def placed_tasks(
    tasks: list[RunTask], options: LocalOptions, jobs: int, visible: Callable[[], tuple[str, ...]] | None = None
) -> list[Placed]:
    """Each task with its GPUs (see ``gpus.place``), before any starts, so a wrong --gpus or device starts nothing.

    ``visible``: the GPUs this process sees (default ``gpus.visible_gpus``), asked only when a run can use a GPU.
    """
    requests = [gpus.gpu_request(task.config) for task in tasks]
    if not any(request.count for request in requests):
        return [Placed(task, {}) for task in tasks]  # a CPU sweep: no torch, no CUDA asked
    seen = (visible or gpus.visible_gpus)()
    usable = gpus.sweep_gpus(options.gpus, seen)
    given_none = gpus.parse_gpus(options.gpus) == ()
    why = "--gpus none gives the sweep no GPU" if given_none else "this machine shows no GPU torch can use"
    recorded = [gpus.recorded_gpus(read_run_info(task.run_dir), seen) for task in tasks]
    placements = gpus.place(requests, usable, recorded, [task.label or task.key for task in tasks], why)
    shares = gpus.gpu_shares(placements, jobs)
    placed = []
    for task, request, placement in zip(tasks, requests, placements, strict=True):
        environment = gpus.gpu_environment(placement, request, seen, shares)
        if not placement:
            placed.append(Placed(task, environment))
            continue
        record = {"gpus": list(placement), "cuda_visible_devices": environment[gpus.VISIBLE_VARIABLE]}
        placed.append(Placed(replace(task, config=gpus.renumbered(task.config, len(placement))), environment, record))
    return placed


def execute(tasks: list[RunTask], options: LocalOptions, events: Events = NO_EVENTS) -> list[TaskResult]:
    jobs = parallel_jobs(options, len(tasks))
    placed = {item.task.key: item for item in placed_tasks(tasks, options, jobs)}
    slots = gpus.gpu_slots([item.gpus for item in placed.values()], jobs)  # runs on one GPU at once
    busy: Counter[int] = Counter()  # runs going on each GPU
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
                index = gpus.next_to_start([placed[t.key].gpus for t in queue], busy, slots)
                if index is None:
                    break  # each waiting run's GPU is full: one of them frees as a run ends
                task = queue.pop(index)
                holder = processes.run_directory_holder(task.run_dir)  # looked up at call time: tests replace it
                if holder is not None:
                    results.append(TaskResult(task, None, started=False, holder=holder))
                    events.finished(results[-1])
                    continue
                (task.run_dir / processes.FAILURE_FILE).unlink(missing_ok=True)
                resume = (task.run_dir / "config.json").exists()
                item = placed[task.key]
                process = processes.start_worker(
                    task.run_dir,
                    item.task.config,
                    resume,
                    task.threads,
                    cwd=task.cwd,
                    environment=item.environment,
                    placement=item.placement,
                    entry=task.entry,
                )
                active[task.key] = (process, task, time.perf_counter())
                busy.update(item.gpus)
                events.started(task, resume, {})
            time.sleep(0.2)
            for key in [k for k, (p, _, _) in active.items() if p.poll() is not None]:
                process, task, started = active.pop(key)
                busy.subtract(placed[key].gpus)
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
