"""Where a sweep's runs execute: local processes, SLURM jobs (submitit), Ray tasks, or an executor of your own.

Every executor does one thing: given run tasks (a run directory, its resolved
config and the threads it may use), run each through the same worker entry point
(``driftlab.executors.worker.worker_main``, a fresh interpreter per run, started by
``processes.start_worker``) and report each run's exit code. The run directory is
the only state, so any executor resumes, skips or retries what another one started,
and every executor gives the same final models and metrics byte for byte (same
threads per run).

Each executor is an ``ExecutorEntry`` of the registry (``driftlab.executors.registry``):
its options, ``execute(tasks, options, events) -> list[TaskResult]``, its check and its
command-line flags. The built-ins below register through the same ``register`` a
plugin calls (docs/design.md, "An executor of your own").

The modules, one job each::

    tasks       RunTask, TaskResult, Events: what executors are given and give back
    registry    ExecutorEntry, the registry, ExecutorOptions and their command-line flags
    processes   the worker's command, its exit codes, the run directory's lock (no torch)
    gpus        how many GPUs a run's device asks for, the local executor's placement, each GPU's share
    worker      the worker's entry point (the run's interpreter)
    local, slurm, ray_executor    the built-in executors
"""

from __future__ import annotations

from driftlab.executors import local, ray_executor, registry, slurm
from driftlab.executors.processes import run_task, set_aside_held, start_worker
from driftlab.executors.registry import (
    CliOption,
    ExecutorEntry,
    ExecutorOptions,
    Layout,
    check_options,
    execute,
    lookup,
    names,
    register,
    resolve,
)
from driftlab.executors.tasks import Events, RunTask, TaskResult

# name, module (its execute, check, CLI_OPTIONS and, where it has one, layout), options type, description
_BUILT_INS = (
    (
        "local",
        local,
        local.LocalOptions,
        "worker processes on this machine, up to --jobs at once, GPU runs spread over --gpus",
    ),
    ("slurm", slurm, slurm.SlurmOptions, "one SLURM array job per sweep, one array task per run (submitit)"),
    (
        "ray",
        ray_executor,
        ray_executor.RayOptions,
        "one Ray task per run on a running cluster (or a local Ray started for the sweep)",
    ),
)
for _name, _module, _options, _description in _BUILT_INS:
    register(
        ExecutorEntry(
            _name,
            _options,
            _module.execute,
            _module.check,
            _module.CLI_OPTIONS,
            description=_description,
            layout=getattr(_module, "layout", None),
        )
    )
registry.REGISTRY.finish_built_ins()

EXECUTORS: tuple[str, ...] = tuple(registry.REGISTRY.built_in)  # the built-in executors' names

__all__ = [
    "EXECUTORS",
    "CliOption",
    "Events",
    "ExecutorEntry",
    "ExecutorOptions",
    "Layout",
    "RunTask",
    "TaskResult",
    "check_options",
    "execute",
    "lookup",
    "names",
    "register",
    "resolve",
    "run_task",
    "set_aside_held",
    "start_worker",
]
