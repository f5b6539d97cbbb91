"""What the sweep tests share: the ``driftlab sweep`` command line they start, and the grid of their four-run sweeps.

Nothing here is used by a sweep.
"""

from __future__ import annotations

import sys

# FedProx's mu in {0, 1} times seeds {0, 1}: the four runs of the smallest sweep with both a grid and seeds
FEDPROX_GRID = ["--grid", "algorithm.mu=[0, 1]", "--seeds", "0,1"]


def sweep_command(*arguments: str) -> list[str]:
    """``driftlab sweep ARGUMENTS`` as a subprocess runs it: through this interpreter, so the tested checkout runs."""
    return [sys.executable, "-m", "driftlab.cli", "sweep", *arguments]
