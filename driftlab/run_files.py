"""What every layer may know of a run's output directory: its run.json and lock file, and that it is busy.

Low in the package (standard library and ``driftlab.errors`` only), so that the executors, which start and
watch runs, read a run directory without importing ``driftlab.experiments``, which writes it
(``driftlab.experiments.run.run_directory`` re-exports these names beside the rest of the directory's layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from driftlab.errors import ConfigError

RUN_INFO_FILE = "run.json"
LOCK_FILE = ".lock"  # flock'ed by the process writing the directory; holds its PID


class RunDirectoryBusy(ConfigError):
    """Another process is writing the run directory (it holds ``DIR/.lock``)."""


def read_run_info(out: str | Path) -> dict[str, Any] | None:
    """The ``run.json`` of a run directory, or None when absent or unreadable."""
    path = Path(out) / RUN_INFO_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


__all__ = ["LOCK_FILE", "RUN_INFO_FILE", "RunDirectoryBusy", "read_run_info"]
