"""What an executor is given and what it gives back: run tasks, their results, and the sweep's callbacks.

A module of its own so that the registry, the built-in executors, plugins and the sweep all import
these types without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class RunTask:
    key: str  # the run's directory relative to the sweep: its name in outcomes
    run_dir: Path  # absolute for executors whose workers run elsewhere (``absolute``); else relative to ``cwd``
    config: dict[str, Any]  # the resolved config table (ExperimentConfig.to_dict())
    threads: int
    label: str = ""  # how logs name the run
    cwd: str | None = None  # the sweep's working directory, where relative paths of the config (data.root) start
    # What the worker runs, as a "module:function" reference (a string: it travels as JSON to the worker, pickled in
    # SLURM and Ray tasks): entry(run_dir, config_table, resume, run_info). The caller says it; executors never name it.
    entry: str = field(kw_only=True)

    def __post_init__(self) -> None:
        check_entry(self.entry)


def check_entry(entry: object) -> None:
    """Refuse a run's entry that is not a ``"module:function"`` reference (``RunTask.entry``)."""
    module, colon, name = entry.partition(":") if isinstance(entry, str) else ("", "", "")
    if not (module and colon and name.isidentifier()):
        raise ValueError(
            f"a run's entry must be a 'module:function' reference (the function the worker calls with run_dir, "
            f"config_table, resume and run_info), not {entry!r}"
        )


@dataclass(frozen=True)
class TaskResult:
    task: RunTask
    exit_code: int | None  # the worker's exit code (minus the signal's number when killed by one)
    seconds: float = 0.0
    started: bool = True  # False: not started, another live process holds its directory (``holder``)
    holder: int = 0
    job: dict[str, Any] = field(default_factory=dict)  # executor, job_id, stdout, stderr where known


def _ignore(*arguments: Any) -> None:  # noqa: ARG001 - a callback nobody listens to
    return None


@dataclass(frozen=True)
class Events:
    """Callbacks an executor calls as runs start and end (the sweep logs them and records job ids)."""

    started: Callable[[RunTask, bool, dict[str, Any]], None] = _ignore  # (task, resuming, job)
    finished: Callable[[TaskResult], None] = _ignore
    interrupted: Callable[[], None] = _ignore  # Ctrl-C or SIGTERM: called before the runs are stopped


NO_EVENTS = Events()  # nobody listens: the default of every ``execute``


def absolute(task: RunTask) -> RunTask:
    """``task`` with its run directory absolute (taken from ``task.cwd``): a worker on another node or in a
    Ray worker's own directory does not share the sweep's working directory."""
    if task.run_dir.is_absolute():
        return task
    return replace(task, run_dir=(Path(task.cwd) if task.cwd else Path.cwd()) / task.run_dir)


__all__ = ["NO_EVENTS", "Events", "RunTask", "TaskResult", "absolute", "check_entry"]
