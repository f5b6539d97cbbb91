"""What of a ``SimulationState`` a checkpoint holds, and the state a checkpoint gives back.

Besides the round and the server state, a checkpoint holds one record per client (``client/<id>/state`` and, with
``evaluation.model = "all_clients_mean"``, ``client/<id>/latest_model``) unless a disk store keeps them in its files,
and the engine section (``engine/...``): each *state extra* (``StateExtra``) of the simulation
(``Simulation.checkpointed_extras``: the running sum of the latest models, then those the optional features' entries
contribute) writes what it carries of the state there and reads it back.  An extra whose part of the state is unset
writes nothing, and one whose tensors a checkpoint lacks (an older one) restores nothing, so every checkpoint written
before keeps resuming and the files written are those of before, tensor for tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

from driftlab.simulation.round.setup import Simulation, SimulationState, disk_stores
from driftlab.simulation.state.checkpoint import LoadedCheckpoint


class StateExtra(Protocol):
    """A part of the engine's state beside the server and the client stores, saved in a checkpoint's engine section."""

    def engine_tensors(self, state: SimulationState, disk_stores: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """What this extra carries of ``state``, as engine tensors (names without ``engine/``); {} when unset.
        ``disk_stores`` are the stores that stay in their files (``setup.disk_stores``)."""
        ...

    def restored(self, sim: Simulation, state: SimulationState, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The ``SimulationState`` fields this extra restores from a checkpoint's engine ``tensors`` ({}: none), with
        ``state`` the run's fresh state, its stores already holding the checkpoint's client records."""
        ...


@dataclass(frozen=True)
class ClientRecord:
    """What a checkpoint keeps per client: the algorithm's state and, when evaluated, the latest local model."""

    state: Any
    latest_model: torch.Tensor | None = None


def client_records(state: SimulationState, disk: Mapping[str, Any]) -> dict[int, ClientRecord]:
    """Every client's record for the checkpoint file, but for the stores in ``disk`` (they stay in their files)."""
    records = {}
    if "clients" not in disk:
        records = {client_id: ClientRecord(client_state) for client_id, client_state in state.clients.items()}
    if state.latest_models is not None and "latest_models" not in disk:
        for client_id, params in state.latest_models.items():
            records[client_id] = ClientRecord(records[client_id].state if client_id in records else None, params)
    return records


def engine_tensors(sim: Simulation, state: SimulationState, disk: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's engine section: every extra's tensors."""
    tensors: dict[str, torch.Tensor] = {}
    for extra in sim.checkpointed_extras():
        tensors.update(extra.engine_tensors(state, disk))
    return tensors


def record_template(sim: Simulation, state: SimulationState) -> Callable[[], ClientRecord]:
    """A fresh client record of ``state``'s run, the template a checkpoint's records are read into."""
    client_init = sim.algorithm.client_state_init
    initial = state.server.params
    keeps_latest = state.latest_models is not None

    def template() -> ClientRecord:
        return ClientRecord(client_init(initial) if client_init else None, initial if keeps_latest else None)

    return template


def restored_state(sim: Simulation, state: SimulationState, loaded: LoadedCheckpoint) -> SimulationState:
    """The state ``loaded`` holds, from the run's fresh ``state`` (its disk stores already restored): the client
    records are staged in its stores (the caller commits them), the extras restored from the engine section."""
    for client_id, record in loaded.client_states.items():
        state.clients.put(client_id, record.state)
        if state.latest_models is not None and record.latest_model is not None:
            state.latest_models.put(client_id, record.latest_model)
    restored: dict[str, Any] = {}
    for extra in sim.checkpointed_extras():
        restored.update(extra.restored(sim, state, loaded.engine_tensors))
    return dataclasses.replace(state, round=loaded.round, server=loaded.server_state, **restored)


def checkpointed_parts(
    sim: Simulation, state: SimulationState
) -> tuple[dict[int, ClientRecord], dict[str, Any], dict[str, torch.Tensor]]:
    """What a checkpoint of ``state`` (of the run ``sim``) writes: the client records in its file, the disk stores it
    references (by name), and the engine section."""
    disk = disk_stores(state)
    return client_records(state, disk), disk, engine_tensors(sim, state, disk)


def completed_state(state: SimulationState, round_index: int, server: Any) -> SimulationState:
    """A completed run's state at ``round_index`` with ``server``: its stores, and no extra (nothing is left to run)."""
    return SimulationState(round_index, server, state.clients, state.latest_models)
