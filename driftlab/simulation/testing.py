"""What the simulation's tests share: the round plan and the seeded model of their small hand-built simulations.

The engine, client, personal-evaluation and backend tests each build a Simulation by hand over a few toy clients; the
plan they run and the way they draw the model's first weights stand here once, so a test names only what it changes.
Nothing here is used by a run.
"""

from __future__ import annotations

from typing import Any

import torch

from driftlab.models import build_model
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.round.setup import RoundPlan

# Seed 3, half the clients a round drawn uniformly, one epoch of batches of 4 at client rate 0.1, plain server steps.
SMALL_PLAN: dict[str, Any] = {
    "seed": 3,
    "participation": 0.5,
    "sampling": "uniform",
    "batch_size": 4,
    "client_lr": 0.1,
    "server_lr": 1.0,
    "local_epochs": 1,
    "steps": None,
}


def small_plan(**changes: Any) -> RoundPlan:
    """The small tests' RoundPlan, with ``changes`` to any of its fields (``small_plan(client_lr=0.2)``)."""
    return RoundPlan(**(SMALL_PLAN | changes))


def seeded_model(
    name: str, input_shape: tuple[int, ...], hidden: tuple[int, ...], dtype: torch.dtype = torch.float64
) -> FlatModel:
    """``name`` (a model of driftlab.models, 3 classes) drawn after ``torch.manual_seed(0)``, flat, on the CPU."""
    torch.manual_seed(0)
    return FlatModel.wrap(build_model(name, tuple(input_shape), 3, hidden=hidden)).to("cpu", dtype)
