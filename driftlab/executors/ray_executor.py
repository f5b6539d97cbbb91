"""The Ray executor: one Ray task per run on a running cluster (``--ray-address``, default ``auto``).

Each task asks for ``num_cpus`` = the run's threads and as many GPUs as the config's
device uses (``gpus.gpu_request``: one for ``cuda``/``cuda:N``, k for a list of k; ``auto``
asks for none, so it runs on the CPU), starts the run's worker process (the same entry
point as the local executor) and waits for it. Ray shows the task only its own GPUs, so
the worker gets the device numbered from 0 (``gpus.renumbered``). ``--ray-runs-per-gpu N``
lets N single-GPU runs share a GPU: each asks for 1/N of one and is told to plan for 1/N of
its memory (``DRIFTLAB_GPU_SHARE``); a run on several GPUs asks for whole ones (Ray refuses
a fraction above one) and has them alone. With no cluster at ``auto``, the sweep starts one local Ray for all its runs and
says so; Ray is never started per run. Named so that it does not shadow ``ray``.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from driftlab.errors import ConfigError
from driftlab.executors.gpus import gpu_request, renumbered, share_environment
from driftlab.executors.processes import run_task, set_aside_held
from driftlab.executors.registry import CliOption
from driftlab.executors.tasks import NO_EVENTS, Events, RunTask, TaskResult, absolute

POLL_SECONDS = 0.5


@dataclass(frozen=True)
class RayOptions:
    address: str = "auto"  # the cluster to join; auto: a running one, else a local Ray started for the sweep
    runs_per_gpu: int = 1  # single-GPU runs sharing one GPU (each asks Ray for 1/runs_per_gpu of it)


CLI_OPTIONS = (
    CliOption(
        "--ray-address",
        "address",
        str,
        "the Ray cluster to run on (default: auto, a running cluster, else a local Ray)",
    ),
    CliOption(
        "--ray-runs-per-gpu",
        "runs_per_gpu",
        int,
        "single-GPU runs sharing each GPU, each asking Ray for that fraction of it and planning for that share of its memory (default: 1)",
    ),
)


def check(options: RayOptions) -> None:
    """Refuse a --ray-runs-per-gpu below 1, and a machine without Ray (every address is tried when the sweep starts)."""
    if options.runs_per_gpu < 1:
        raise ConfigError(f"--ray-runs-per-gpu must be at least 1, got {options.runs_per_gpu}")
    check_available()


def check_available() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        from driftlab.extras import install_hint

        raise ConfigError(f"--executor ray needs Ray: {install_hint('ray')}") from None


def connect(address: str) -> bool:
    """Join the Ray cluster at ``address``; with none at ``auto``, start a local one. Returns whether this call started Ray."""
    import ray

    if ray.is_initialized():
        return False  # the caller's own Ray (a notebook, a test): use it, and leave it running
    try:
        ray.init(address=address, log_to_driver=False)
        return False
    except ConnectionError as error:
        if address != "auto":
            raise ConfigError(
                f"cannot reach the Ray cluster at --ray-address {address} ({error}); "
                "start it with `ray start --head`, or give its address"
            ) from None
    print(
        "driftlab: no running Ray cluster found (--ray-address auto); starting a local Ray on this machine for this sweep, "
        "stopped when the sweep ends",
        file=sys.stderr,
    )
    ray.init(include_dashboard=False, log_to_driver=False)
    return True


def gpus_for(config: dict[str, Any], runs_per_gpu: int = 1) -> float:
    """The GPUs a run's task asks Ray for: as many as its device uses, ``auto`` none; one GPU's ``1/runs_per_gpu``."""
    request = gpu_request(config)
    if request.optional or request.count == 0:
        return 0
    return 1 / runs_per_gpu if request.count == 1 and runs_per_gpu > 1 else request.count


def task_environment(config: dict[str, Any], runs_per_gpu: int) -> dict[str, str]:
    """The worker's variables: the share of its GPU when it asks for a fraction of one (``gpus_for``)."""
    return share_environment(runs_per_gpu, {}) if 0 < gpus_for(config, runs_per_gpu) < 1 else {}


def _ray_run(task: RunTask, environment: dict[str, str] | None = None) -> TaskResult:
    """What each Ray task runs: the run's worker, waited for (cancelling the task stops the run, checkpointed)."""
    import ray

    context = ray.get_runtime_context()
    job = {"executor": "ray", "job_id": context.get_task_id(), "node": context.get_node_id()}
    gpu_ids = ray.get_gpu_ids()  # the node's GPUs Ray gave this task (its CUDA_VISIBLE_DEVICES)
    if gpu_ids:
        job["gpu_ids"] = [str(gpu) for gpu in gpu_ids]
    return run_task(task, job, environment=environment)


def execute(tasks: list[RunTask], options: RayOptions, events: Events = NO_EVENTS) -> list[TaskResult]:
    import ray

    results, runnable = set_aside_held([absolute(task) for task in tasks], events)
    if not runnable:
        return results
    started_ray = connect(options.address)
    pending: dict[Any, tuple[RunTask, dict[str, Any], float]] = {}
    try:
        remote = ray.remote(max_retries=0)(_ray_run)  # a lost task is resumed by running the sweep again
        for task in runnable:
            gpus = gpus_for(task.config, options.runs_per_gpu)
            environment = task_environment(task.config, options.runs_per_gpu)
            # the worker sees only the GPUs Ray gives the task: its device, numbered from 0
            own = replace(task, config=renumbered(task.config, math.ceil(gpus)))
            ref = remote.options(num_cpus=task.threads, num_gpus=gpus).remote(own, environment)
            info = {"executor": "ray", "job_id": ref.task_id().hex()}
            pending[ref] = (task, info, time.perf_counter())
            events.started(task, (task.run_dir / "config.json").exists(), info)
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
                for ref in ready:
                    task, info, started = pending.pop(ref)
                    results.append(_result(ref, task, info, time.perf_counter() - started))
                    events.finished(results[-1])
        except BaseException:
            events.interrupted()
            for ref in pending:
                ray.cancel(ref)  # raises KeyboardInterrupt in the task: it stops its run, which checkpoints
            ray.wait(list(pending), num_returns=len(pending), timeout=120)
            raise
    finally:
        if started_ray:
            ray.shutdown()
    return results


def _result(ref: Any, task: RunTask, info: dict[str, Any], seconds: float) -> TaskResult:
    import ray

    try:
        result = ray.get(ref)
    except ray.exceptions.RayError as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        return TaskResult(
            task,
            None,
            seconds,
            job={**info, "error": f"Ray task {info['job_id']} ended without its run's result ({first})"},
        )
    return TaskResult(task, result.exit_code, result.seconds, result.started, result.holder, {**info, **result.job})
