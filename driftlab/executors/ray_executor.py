"""The Ray executor: one Ray task per run on a running cluster (``--ray-address``, default ``auto``).

Each task asks for ``num_cpus`` = the run's threads and one GPU when the config's
device is ``cuda``/``cuda:N`` (``auto`` asks for none, so it runs on the CPU), starts
the run's worker process (the same entry point as the local executor) and waits for
it. With no cluster at ``auto``, the sweep starts one local Ray for all its runs and
says so; Ray is never started per run. Named so that it does not shadow ``ray``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from driftlab.errors import ConfigError
from driftlab.executors.processes import run_task, set_aside_held
from driftlab.executors.registry import CliOption
from driftlab.executors.tasks import NO_EVENTS, Events, RunTask, TaskResult, absolute

POLL_SECONDS = 0.5


@dataclass(frozen=True)
class RayOptions:
    address: str = "auto"  # the cluster to join; auto: a running one, else a local Ray started for the sweep


CLI_OPTIONS = (CliOption("--ray-address", "address", str, "the Ray cluster to run on (default: auto, a running cluster, else a local Ray)"),)


def check(options: RayOptions) -> None:  # noqa: ARG001 - every address is tried when the sweep starts
    check_available()


def check_available() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install 'driftlab[ray]'") from None


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


def gpus_for(config: dict[str, Any]) -> int:
    return 1 if str(config.get("device", "cpu")).startswith("cuda") else 0


def _ray_run(task: RunTask) -> TaskResult:
    """What each Ray task runs: the run's worker, waited for (cancelling the task stops the run, checkpointed)."""
    import ray

    context = ray.get_runtime_context()
    job = {"executor": "ray", "job_id": context.get_task_id(), "node": context.get_node_id()}
    return run_task(task, job)


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
            ref = remote.options(num_cpus=task.threads, num_gpus=gpus_for(task.config)).remote(task)
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
        return TaskResult(task, None, seconds, job={**info, "error": f"Ray task {info['job_id']} ended without its run's result ({first})"})
    return TaskResult(task, result.exit_code, result.seconds, result.started, result.holder, {**info, **result.job})
