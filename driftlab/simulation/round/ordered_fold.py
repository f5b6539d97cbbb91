"""A round's messages folded into the server update in sample order, as clients finish.

Clients finish in any order (chunks, threads, a deployment's nodes); the
algorithm's ``ServerFold`` must see them in sample order, or the rounding of
its sums would depend on timing.  ``OrderedFold`` adds each message the
moment every client before it in the sample has finished, holding only the
ones that finished early, and then lets go of it: a round whose clients
finish in order keeps one accumulator, not a list of models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from driftlab.metrics.communication import payload_bits
from driftlab.simulation.seam import RoundContext, ServerFold


@dataclass(frozen=True)
class FoldedRound:
    """What the server update of a round produced, and what the round's record needs of the messages."""

    server: Any  # the new server state (the old one when nobody reported)
    metrics: dict[str, float]  # the algorithm's
    reporting_clients: list[int]  # in sample order
    upload_bits: int
    reporting_mean: torch.Tensor | None  # mean of the reporting clients' final models, when they were kept


@dataclass
class SampleOrder:
    """Values handed in by client id in any order, released in ``order`` (the round's sample order).

    ``put`` returns the values that are now next in line; ``rest`` those still
    waiting, in order, skipping clients that never came.
    """

    order: Sequence[int]
    _position: dict[int, int] = field(init=False)
    _next: int = field(init=False, default=0)
    _waiting: dict[int, Any] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._position = {client_id: index for index, client_id in enumerate(self.order)}

    def put(self, client_id: int, value: Any) -> list[tuple[int, Any]]:
        position = self._position.get(client_id)
        if position is None:
            raise ValueError(f"client {client_id} is not one of the round's active clients")
        if position < self._next or position in self._waiting:
            raise ValueError(f"client {client_id} finished twice in one round")
        self._waiting[position] = value
        ready = []
        while self._next in self._waiting:
            ready.append((self.order[self._next], self._waiting.pop(self._next)))
            self._next += 1
        return ready

    def rest(self) -> list[tuple[int, Any]]:
        ready = [(self.order[position], self._waiting.pop(position)) for position in sorted(self._waiting)]
        self._next = len(self.order)
        return ready


@dataclass
class OrderedFold:
    """Feeds ``fold`` the messages of the clients in ``order`` (sample order), in that order, as they arrive.

    ``add`` takes a client's message (None: it sent nothing) in any order;
    ``result`` folds what is still waiting, skipping clients that never
    arrived, and finishes the server update.  With ``keep_models`` the
    reporting clients' final models are summed the same way, for the
    "reporting_mean" evaluation.
    """

    fold: ServerFold
    server: Any
    context: RoundContext
    order: Sequence[int]
    keep_models: bool = False
    _queue: SampleOrder = field(init=False)
    _accumulator: Any = field(init=False, default=None)
    _reporting: list[int] = field(init=False, default_factory=list)
    _upload_bits: int = field(init=False, default=0)
    _model_sum: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._queue = SampleOrder(self.order)
        self._accumulator = self.fold.start(self.server, self.context)

    def add(self, client_id: int, message: Any, final_model: torch.Tensor | None = None) -> None:
        for ready_id, (ready_message, ready_model) in self._queue.put(
            client_id, (message, final_model if self.keep_models else None)
        ):
            self._take(ready_id, ready_message, ready_model)

    def result(self) -> FoldedRound:
        for ready_id, (ready_message, ready_model) in self._queue.rest():
            self._take(ready_id, ready_message, ready_model)
        if self._reporting or self.fold.finishes_empty:
            server, metrics = self.fold.finish(self.server, self._accumulator, self.context)
        else:
            server, metrics = self.server, {}
        mean = self._model_sum / len(self._reporting) if self._model_sum is not None else None
        return FoldedRound(server, metrics, list(self._reporting), self._upload_bits, mean)

    def _take(self, client_id: int, message: Any, final_model: torch.Tensor | None) -> None:
        if message is None:
            return
        self._accumulator = self.fold.add(self._accumulator, message)
        self._reporting.append(client_id)
        self._upload_bits += payload_bits(message)
        if final_model is not None:
            self._model_sum = final_model.clone() if self._model_sum is None else self._model_sum.add_(final_model)
