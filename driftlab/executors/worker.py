"""The entry point of a run's interpreter, started by every executor through ``processes.start_worker``.

One run per process: it claims the run directory, runs (or resumes) the config it was
given, and says how it ended by its exit code (``processes.EXIT_*``); a failure leaves
``failure.txt`` in the run directory. The GPUs an executor placed it on (``placement``:
the sweep's indices, ``CUDA_VISIBLE_DEVICES``, and here their names) go into its run.json. It stops, checkpointed, when the process that
started it (the sweep, a SLURM job, a Ray task) dies, however it dies.

What it runs is the caller's to say: the task's ``entry`` (``RunTask.entry``, a ``"module:function"``
reference, called as ``entry(run_dir, config_table, resume, run_info)``) comes in its arguments. The executors
sit below the layer that runs experiments (``imports_test``) and name nothing of it; this interpreter imports
the entry's module only because it was started to run it.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from driftlab.errors import ConfigError
from driftlab.executors.gpus import PLACEMENT_KEY
from driftlab.executors.processes import (
    EXIT_BUSY,
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    FAILURE_FILE,
    process_gone,
)
from driftlab.executors.tasks import check_entry
from driftlab.run_files import RunDirectoryBusy

NO_ENTRY = (
    "this worker was started without an entry (what it runs): the executor that started it must pass the task's "
    "RunTask.entry on, as processes.start_worker(..., entry=task.entry) or processes.run_task(task, job) do"
)


def named(reference: str) -> Any:
    """The function a ``"module:function"`` reference names, its module imported."""
    check_entry(reference)
    module, _, name = reference.partition(":")
    found = getattr(importlib.import_module(module), name, None)
    if not callable(found):
        raise ConfigError(f"a run's entry {reference!r} names nothing callable: module {module} has no function {name}")
    return found


def _worker(
    entry: str | None, run_dir: str, config_table: dict[str, Any], resume: bool, threads: int, run_info: dict[str, Any]
) -> None:
    """Child process: one run, ``entry(run_dir, config_table, resume, run_info)``; exits with EXIT_COMPLETE,
    EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_BUSY (another process holds the run directory: nothing written) or
    EXIT_FAILED (see failure.txt)."""
    import torch

    torch.set_num_threads(threads)
    signal.signal(signal.SIGTERM, _stop_at_first_termination)
    out = Path(run_dir)
    try:
        if not entry:
            raise ConfigError(NO_ENTRY)
        # The entry's module, and the plugins the config records, are imported here: this is a fresh interpreter.
        named(entry)(run_dir, config_table, resume, run_info)
    except FloatingPointError:
        sys.exit(EXIT_DIVERGED)  # run.json holds the message
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except RunDirectoryBusy as error:
        print(f"driftlab: {error}", file=sys.stderr)
        sys.exit(EXIT_BUSY)  # the directory is another process's: write nothing into it
    except BaseException as error:  # noqa: BLE001 - any failure is recorded for the sweep and the user
        out.mkdir(parents=True, exist_ok=True)
        detail = str(error) if isinstance(error, ConfigError) else traceback.format_exc()
        (out / FAILURE_FILE).write_text(f"{type(error).__name__}: {error}\n\n{detail}")
        sys.exit(EXIT_FAILED)


def _stop_at_first_termination(signum, frame):  # noqa: ARG001
    """SIGTERM: stop the run (it checkpoints, then exits); later ones are ignored, so they cannot cut the checkpoint
    short.

    A sweep killed outright sends several: the parent-death signal comes again as each of the
    sweep's threads in turn exits and the run is handed to the next.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"terminated by signal {signum}")


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Make this run's process stop (SIGTERM: checkpoint, then exit) when the sweep that started it dies.

    Without this, a sweep killed with SIGKILL leaves its runs going, and the next sweep on the directory
    would start a second writer on each. Linux delivers SIGTERM on the parent's death (prctl); elsewhere
    a daemon thread watches for this process being handed to another parent.
    """
    first_parent = os.getppid()  # `parent`, unless sys.executable is a wrapper that forks
    if not _ask_for_parent_death_signal():
        import threading

        def watch() -> None:
            while os.getppid() == first_parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="driftlab-parent-watch", daemon=True).start()
    if first_parent != parent and process_gone(parent):  # the sweep died before the request above took effect
        sys.exit(EXIT_INTERRUPTED)


def _ask_for_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def gpu_names() -> list[str]:
    """The names of the GPUs this process sees (its own, set by the executor), [] where torch cannot say.

    Asked before the run starts: it initialises CUDA, which a run on these GPUs does first anyway.
    """
    import torch

    try:
        return [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    except (RuntimeError, AssertionError, OSError):  # no driver, a GPU gone since the executor counted it
        return []


def worker_main(arguments: str) -> None:
    """Entry point of a run's interpreter (see ``processes.start_worker``): ``arguments`` is its JSON."""
    parsed = json.loads(arguments)
    die_with_parent(parsed["parent"])
    if parsed.get("executor"):
        if parsed["executor"].get("executor") == "slurm" and hasattr(signal, "SIGUSR2"):
            # SLURM's pre-emption warning (submitit's USR2) may reach every process of the job, and would kill
            # this one outright; the job's own process handles it by stopping this run (SIGTERM: checkpoint, exit).
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    run_info = {"executor": parsed["executor"]} if parsed.get("executor") else {}
    if parsed.get("placement"):
        run_info[PLACEMENT_KEY] = {**parsed["placement"], "gpu_names": gpu_names()}
    _worker(parsed.get("entry"), parsed["run_dir"], parsed["config"], parsed["resume"], parsed["threads"], run_info)


__all__ = ["die_with_parent", "worker_main"]
