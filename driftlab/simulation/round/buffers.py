"""A round's buffers (BatchNorm's running statistics, ``backends.buffers``) as a round observer, beside the one of the
latest models (``latest_models.observe_round``): built only for a model with buffers (``observe_buffers``), the null
``NO_BUFFERS`` otherwise, so the round (``round.engine``) never asks whether the model has any.

The server's buffers are the shared module's.  Every client of the round trains from them: the observer hands the
backend a ``RoundBuffers`` for each wave (its ``buffers`` argument; without buffers no argument at all, so a backend of
its own, a deployment's, keeps its signature), the backend records each client's final ones, and once the round's
messages are folded the module takes the mean of the reporting clients' (``average_buffers``: weighted by ``n_k``
times the client's multiplicity, as FedAvg weights models), before the round is evaluated.  The algorithm never sees
them.  A late client (simulated time) is never shown to the observer: its final buffers go with its wave.

With FedBN (``[personal_layers]`` keeping BatchNorm layers: ``personal.buffers.ClientBuffers``, found by
``backends.buffers.own_buffers_record``) a client starts from its own buffers of those layers and keeps its final ones,
which the server's mean leaves out; without it the null record ``ALL_SHARED`` stands in.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from driftlab.simulation.backends.buffers import (
    RoundBuffers,
    average_buffers,
    has_buffers,
    load_buffers,
    module_buffers,
    own_buffers_record,
)
from driftlab.simulation.seam import ClientContext


class AllShared:
    """The null record of clients' own buffers: no client keeps any, so every buffer is the server's mean."""

    def starts(self, client_ids: Sequence[int]) -> None:  # noqa: ARG002
        return None

    def keep(self, client_id: int, buffers: Mapping[str, torch.Tensor]) -> None:
        pass

    def shared(self, averaged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return averaged


ALL_SHARED = AllShared()


class BuffersRound:
    """One round's observer of a model's buffers (module docstring): the clients ``contexts`` (in sample order) train
    from the module's buffers, those in ``own`` (``ClientBuffers`` or ``ALL_SHARED``) from their own."""

    def __init__(self, module: nn.Module, contexts: Sequence[ClientContext], own: Any) -> None:
        self.module = module
        self.contexts = contexts
        self.own = own
        self.start = module_buffers(module)  # the server's, as the round starts training
        self.reported: dict[int, dict[str, torch.Tensor]] = {}  # the reporting clients' final buffers, by client id
        self.wave: RoundBuffers | None = None

    def backend_arguments(self, wave: Sequence[ClientContext]) -> dict[str, RoundBuffers]:
        """The backend's ``buffers`` argument for the clients of ``wave`` (task positions in its order)."""
        self.wave = RoundBuffers(self.start, self.own.starts([context.client_id for context in wave]))
        return {"buffers": self.wave}

    def client_trained(self, position: int, client_id: int, message: Any) -> None:
        """The wave's task ``position`` (client ``client_id``) finished on time and sent ``message`` (None: nothing,
        so its buffers stay out of the mean; its own are kept as its state is)."""
        final = self.wave.final.pop(position)
        self.own.keep(client_id, final)
        if message is not None:
            self.reported[client_id] = final

    def finish(self) -> None:
        """The server's buffers after the round: the mean of the reported ones in sample order, weighted by ``n_k``
        times the client's multiplicity; clients' own buffers are left out (they stay the server's initial ones, never
        used by a client)."""
        contexts = [context for context in self.contexts if context.client_id in self.reported]
        averaged = average_buffers(
            module_buffers(self.module),
            [self.reported[context.client_id] for context in contexts],
            [float(context.num_samples * context.multiplicity) for context in contexts],
        )
        load_buffers(self.module, self.own.shared(averaged))


class NoBuffers:
    """The null observer of a model without buffers: the backend gets no ``buffers`` argument, nothing is averaged."""

    def backend_arguments(self, wave: Sequence[ClientContext]) -> dict[str, RoundBuffers]:  # noqa: ARG002
        return {}

    def client_trained(self, position: int, client_id: int, message: Any) -> None:
        pass

    def finish(self) -> None:
        pass


NO_BUFFERS = NoBuffers()


def observe_buffers(sim: Any, contexts: Sequence[ClientContext]) -> BuffersRound | NoBuffers:
    """The buffers' observer of a round of ``sim`` (a ``Simulation``) training ``contexts``: ``NO_BUFFERS`` for a model
    without buffers, else one over the shared module's, with FedBN's record of clients' own when the run keeps one."""
    module = sim.model.module
    if not has_buffers(module):
        return NO_BUFFERS
    own = own_buffers_record(sim)
    return BuffersRound(module, contexts, ALL_SHARED if own is None else own)
