"""An asynchronous run's engine state between two server updates (``SimulationState.in_flight``).

At an update boundary the buffer is empty (a checkpoint is written only there), but clients are in flight: each was
dispatched from some model version and arrives later.  A client is trained lazily, when the result of some client of
its version is first needed (``engine``), so an in-flight client is either untrained (its version's view is kept to
train it from) or holds its result until its arrival is processed.  Everything here is a frozen dataclass of numbers
and tensors, checkpointed as it is (``checkpointing``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)  # tensors have no truth value: results compare by identity
class HeldResult:
    """What a trained in-flight client will deliver at its arrival.

    ``change`` is ``Δ_k = release.release(view_{v_k}, m_k)`` as one flat vector (None: the client sent nothing),
    ``upload_bits`` the size of its message, ``steps_done`` the local steps it did and ``client_state`` its new state
    (staged in the store only at its arrival: a checkpoint before that still holds the pre-dispatch state).
    """

    change: torch.Tensor | None
    upload_bits: int
    steps_done: int
    client_state: Any = None


@dataclass(frozen=True)
class InFlightClient:
    """Dispatch ``dispatch`` of client ``client_id``: from model version ``version`` at ``dispatched_at`` seconds,
    arriving at ``arrives_at`` (its download, ``steps`` local steps and its upload: ``driftlab.simulation.time``).

    ``left``: its availability window ends before it would arrive, so its work is discarded at ``arrives_at``
    (never trained).  ``result``: None until it is trained."""

    client_id: int
    dispatch: int
    version: int
    dispatched_at: float
    arrives_at: float
    steps: int
    left: bool = False
    result: HeldResult | None = None

    @property
    def order(self) -> tuple[float, int, int]:
        """Arrivals are processed by (time, client id, dispatch number): never by when a thread finished."""
        return (self.arrives_at, self.client_id, self.dispatch)

    @property
    def needs_training(self) -> bool:
        return self.result is None and not self.left


@dataclass(frozen=True)
class AsynchronousState:
    """The engine between server updates: the clock, the model version, the clients in flight.

    ``clock`` is the simulated time of the last server update (0 before the first), ``version`` the number of server
    updates so far, ``next_dispatch`` the number the next dispatch gets, ``idle_slots`` the slots that are to be filled
    at ``clock`` (freed by the arrival that completed the last buffer, or found no eligible client).  ``in_flight`` is
    in arrival order (``InFlightClient.order``); ``views`` holds, by version, the views untrained clients start from.
    """

    clock: float
    version: int
    next_dispatch: int
    idle_slots: int
    in_flight: tuple[InFlightClient, ...] = ()
    views: tuple[tuple[int, Any], ...] = ()  # (version, the algorithm's client view of that version), by version

    def view_of(self, version: int) -> Any:
        for held_version, view in self.views:
            if held_version == version:
                return view
        raise KeyError(f"no view of model version {version} is held")


def starting_state(concurrency: int, clock: float = 0.0, version: int = 0) -> AsynchronousState:
    """Before the first update: nobody in flight, every one of the ``concurrency`` slots to be filled at ``clock``."""
    return AsynchronousState(clock=clock, version=version, next_dispatch=0, idle_slots=concurrency)
