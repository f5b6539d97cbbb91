"""A sweep directory: its files, the names of its run directories, and where each run stands.

::

    sweep.json                      the plan: axes, labels and every run's overrides (``driftlab.experiments.sweep.planning``)
    jobs.json                       what the sweep submitted to SLURM or Ray: run directory -> job id, log paths
    halving-rungs.json              with successive halving: each rung's ranking of the tuned values
    runs/<setting>/<method>/seed-<s>/   ordinary run directories (``driftlab.experiments.run.run_directory``),
                                    plus failure.txt when the run's process failed
    runs/<setting>/<method>/<tuned value>/seed-<s>/   the same, for the runs of a tuned axis (``role = "tuned"``),
                                    plus halving.json when successive halving stopped the run early

Importing this module imports no torch: reports and ``driftlab sweep --status`` read
sweep directories with it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

# A run directory's lock and its failure.txt are the executors' (their workers write them); re-exported here.
from driftlab.executors.processes import FAILURE_FILE, run_directory_holder
from driftlab.experiments.run.run_directory import METRICS_FILE, finished, read_run_info

SWEEP_FILE = "sweep.json"
JOBS_FILE = "jobs.json"  # the sweep's record of what it submitted to SLURM or Ray: run directory -> job id, log paths
# In a run directory: {"round": r, "message": ...} when successive halving stopped the run at round r (it keeps its
# checkpoint; running the sweep again without halving extends it, and removes the file).
HALVING_FILE = "halving.json"
# In the sweep directory: each halving rung's ranking of the tuned values, reused when the sweep runs again (a run
# extended past a rung may no longer hold that rung's evaluation).
HALVING_RUNGS_FILE = "halving-rungs.json"

RunStatus = Literal["pending", "running", "complete", "interrupted", "diverged", "failed", "stopped"]

_SPELLED_OUT = {"%": "pct", "μ": "mu", "α": "alpha", "β": "beta", "γ": "gamma", "λ": "lambda", "η": "eta"}


def slug(label: str) -> str:
    """A directory name for a label: ``"Dirichlet 0.3, 10%"`` -> ``"dirichlet-0.3-10pct"``."""
    text = label.lower()
    for symbol, word in _SPELLED_OUT.items():
        text = text.replace(symbol, word)
    text = re.sub(r"[^a-z0-9.]+", "-", text).strip("-.")
    return text or "x"


def run_status(run_dir: Path, rounds: int) -> RunStatus:
    """Where a planned run stands, from the files its run directory holds."""
    if (run_dir / FAILURE_FILE).exists():
        return "failed"
    info = read_run_info(run_dir)
    if info is None:
        return "interrupted" if (run_dir / METRICS_FILE).exists() else "pending"
    status = info.get("status")
    if status == "complete" and (run_dir / HALVING_FILE).exists():
        return "stopped"  # by successive halving, at the round it finished; a sweep without halving extends it
    if finished(info, rounds):
        return "complete"  # every round done, or ended by its evaluation.stop_at
    if status == "complete":
        return "interrupted"  # finished a shorter run; `rounds` was raised since, so it resumes
    if status in ("diverged", "failed"):
        return status
    return "interrupted"  # running (killed without a chance to say so) or interrupted


__all__ = [
    "FAILURE_FILE",
    "HALVING_FILE",
    "HALVING_RUNGS_FILE",
    "JOBS_FILE",
    "SWEEP_FILE",
    "RunStatus",
    "run_directory_holder",
    "run_status",
    "slug",
]
