"""An asynchronous run's in-flight state as checkpoint tensors, and back (engine tensors "async/...").

Written at an update boundary, where the buffer is empty: the clock, the model version, the next dispatch number,
the idle slots, one row per in-flight client (``async/clients``: client id, dispatch, version, steps, left, trained;
``async/times``: dispatched at, arrives at, float64), the held results of trained ones (``async/results``: upload
bits, steps done; ``async/result/<dispatch>/change`` and ``.../client_state``) and the views untrained clients start
from (``async/view/<version>/...``).  Every number is stored exactly (times as float64), so a resumed run replays
the same events and trains the same clients from the same models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from driftlab.simulation.asynchronous.state import AsynchronousState, HeldResult, InFlightClient
from driftlab.simulation.state.checkpoint import CheckpointError, state_from_tensors, state_to_tensors

PREFIX = "async/"


def in_flight_tensors(in_flight: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's ``engine/async/...`` tensors of ``in_flight`` (an ``AsynchronousState``)."""
    flight: AsynchronousState = in_flight
    clients = flight.in_flight
    tensors = {
        f"{PREFIX}clock": torch.tensor(flight.clock, dtype=torch.float64),
        f"{PREFIX}version": torch.tensor(flight.version, dtype=torch.int64),
        f"{PREFIX}next_dispatch": torch.tensor(flight.next_dispatch, dtype=torch.int64),
        f"{PREFIX}idle_slots": torch.tensor(flight.idle_slots, dtype=torch.int64),
        f"{PREFIX}clients": torch.tensor(
            [[c.client_id, c.dispatch, c.version, c.steps, int(c.left), int(c.result is not None)] for c in clients],
            dtype=torch.int64,
        ).reshape(len(clients), 6),
        f"{PREFIX}times": torch.tensor([[c.dispatched_at, c.arrives_at] for c in clients], dtype=torch.float64).reshape(
            len(clients), 2
        ),
        f"{PREFIX}results": torch.tensor(
            [[c.result.upload_bits, c.result.steps_done] if c.result is not None else [0, 0] for c in clients],
            dtype=torch.int64,
        ).reshape(len(clients), 2),
        f"{PREFIX}view_versions": torch.tensor([version for version, _ in flight.views], dtype=torch.int64),
    }
    for client in clients:
        if client.result is not None:
            where = f"{PREFIX}result/{client.dispatch}"
            tensors.update(state_to_tensors(client.result.change, f"{where}/change"))
            tensors.update(state_to_tensors(client.result.client_state, f"{where}/client_state"))
    for version, view in flight.views:
        tensors.update(state_to_tensors(view, f"{PREFIX}view/{version}"))
    return tensors


def restore_in_flight(sim: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The in-flight state a checkpoint's engine tensors hold (None: the run had not started its first update)."""
    if f"{PREFIX}version" not in tensors:
        return None
    try:
        rows = tensors[f"{PREFIX}clients"].tolist()
        times = tensors[f"{PREFIX}times"].tolist()
        results = tensors[f"{PREFIX}results"].tolist()
        view_versions = tensors[f"{PREFIX}view_versions"].tolist()
    except KeyError as missing:
        raise CheckpointError(
            f"the checkpoint's asynchronous state lacks {missing}; it was written by another version of driftlab"
        ) from None
    algorithm = sim.algorithm
    view_template = algorithm.broadcast(algorithm.server_init(sim.initial_params))
    state_template = (
        algorithm.client_state_init(sim.initial_params) if algorithm.client_state_init is not None else None
    )
    clients = []
    for (client_id, dispatch, version, steps, left, trained), (dispatched_at, arrives_at), (
        upload_bits,
        steps_done,
    ) in zip(rows, times, results, strict=True):
        result = None
        if trained:
            where = f"{PREFIX}result/{dispatch}"
            change = tensors.get(f"{where}/change")
            client_state = state_from_tensors(state_template, tensors, f"{where}/client_state", sim.device)
            result = HeldResult(
                None if change is None else change.to(sim.device), int(upload_bits), int(steps_done), client_state
            )
        clients.append(
            InFlightClient(client_id, dispatch, version, dispatched_at, arrives_at, steps, bool(left), result)
        )
    views = tuple(
        (version, state_from_tensors(view_template, tensors, f"{PREFIX}view/{version}", sim.device))
        for version in view_versions
    )
    return AsynchronousState(
        clock=float(tensors[f"{PREFIX}clock"].item()),
        version=int(tensors[f"{PREFIX}version"].item()),
        next_dispatch=int(tensors[f"{PREFIX}next_dispatch"].item()),
        idle_slots=int(tensors[f"{PREFIX}idle_slots"].item()),
        in_flight=tuple(clients),
        views=views,
    )


@dataclass(frozen=True)
class InFlightExtra:
    """``SimulationState.in_flight`` in a checkpoint's engine section (``engine/async/...``) and back: an asynchronous
    run resumes with the same clients in flight, their held results and the views they start from."""

    def engine_tensors(self, state: Any, disk_stores: Mapping[str, Any]) -> dict[str, torch.Tensor]:  # noqa: ARG002
        return {} if state.in_flight is None else in_flight_tensors(state.in_flight)

    def restored(self, sim: Any, state: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:  # noqa: ARG002
        return {"in_flight": restore_in_flight(sim, dict(tensors))} if sim.asynchronous is not None else {}
