"""The mean of every client's latest local model (``evaluation.model = "all_clients_mean"``, FedDyn's reporting).

FedDyn reports the mean over all registered clients of the model each one
trained last (clients that never trained count with θ⁰).  Reading every
latest model on each evaluation is a pass over the whole store (26 GB at
33,000 MLP clients), so the engine keeps their sum instead:

    Σ = Σ_{k trained} θ_k^latest          (float64, ``LatestModelsSum``)

and a client that trains adds ``θ_k^new − θ_k^old`` to it, in sample order,
so the rounding never depends on which client finished first.  The sum is
part of the run's checkpoint, so a resumed run continues with the same bits; a
state without one (an older checkpoint) gets it from one pass over the store.
When the latest models go into the checkpoint file themselves (the in-memory
store), the sum is stored as the few entries where it differs from a fresh sum
over them (``checkpoint_tensors``): float32 models summed in float64 are
almost always exact, so a 20-client run's checkpoint does not carry a float64
copy of the model (twice the model's bytes) for a handful of rounding
differences; with the disk store (no pass over every client at each
checkpoint) or dense differences it is stored whole.  The mean over the
registered set ``S_t`` is

    (Σ − Σ_{k trained, k ∉ S_t} θ_k + (|S_t| − #{k trained, k ∈ S_t}) θ⁰) / |S_t|

which reads only the models of clients outside ``S_t`` (none without
membership changes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from driftlab.simulation.round.ordered_fold import SampleOrder

OUTSIDE_BATCH = 64  # models of clients outside S_t read at a time
# A checkpoint's engine/ tensors: the count, and either the whole sum or the entries where it differs from a fresh one.
SUM, COUNT, FIX_INDEX, FIX_VALUE = "latest_models_sum", "latest_models_count", "latest_models_sum_fix_index", "latest_models_sum_fix_value"

@dataclass(frozen=True)
class LatestModels:
    """Σ_k θ_k^latest over the clients in the store (float64), and how many there are."""

    total: torch.Tensor
    count: int


def summed_store(store: Any, like: torch.Tensor, include_staged: bool = False) -> LatestModels:
    """The sum of every latest model in ``store`` (committed ones; staged too if asked), in client-id order:
    one pass over the store."""
    total = torch.zeros_like(like, dtype=torch.float64)
    count = 0
    for _, params in store.items(include_staged=include_staged):
        total += params.to(torch.float64)
        count += 1
    return LatestModels(total, count)


def checkpoint_tensors(latest: LatestModels, store: Any | None) -> dict[str, torch.Tensor]:
    """``latest`` as a checkpoint's engine/ tensors (names without the prefix).

    ``store`` holds the committed latest models when the checkpoint file carries them
    too: the sum is then written as the entries where it differs, bit for bit, from
    ``summed_store(store)`` (their indices and values), unless those are as large as
    the sum itself.  ``store`` None (the models stay in a disk store's files): the whole sum.
    """
    count = torch.tensor(latest.count, dtype=torch.int64)
    total = latest.total.reshape(-1)
    if store is not None:
        fresh = summed_store(store, total).total
        differs = torch.nonzero(fresh.view(torch.int64) != total.view(torch.int64)).reshape(-1)
        if 2 * differs.numel() < total.numel():  # an int64 index and a float64 value per entry
            return {COUNT: count, FIX_INDEX: differs, FIX_VALUE: total[differs]}
    return {SUM: latest.total, COUNT: count}


def from_checkpoint_tensors(tensors: dict[str, torch.Tensor], store: Any, like: torch.Tensor) -> LatestModels | None:
    """The ``LatestModels`` that ``checkpoint_tensors`` wrote, bit for bit; None when ``tensors`` hold none (an older checkpoint).

    ``store`` holds the checkpoint's latest models, staged or committed (they are read with ``include_staged``).
    """
    if COUNT not in tensors:
        return None
    count = int(tensors[COUNT])
    if SUM in tensors:
        return LatestModels(tensors[SUM], count)
    if FIX_INDEX not in tensors or FIX_VALUE not in tensors:
        return None
    total = summed_store(store, like.reshape(-1), include_staged=True).total
    total[tensors[FIX_INDEX].to(total.device)] = tensors[FIX_VALUE].to(total.device)
    return LatestModels(total.reshape(like.shape), count)


@dataclass
class LatestModelsUpdate:
    """A round's changes to ``LatestModels``, applied in sample order (``order``) whatever order clients finish in."""

    start: LatestModels
    order: Sequence[int]
    _total: torch.Tensor = field(init=False)
    _count: int = field(init=False)
    _queue: SampleOrder = field(init=False)

    def __post_init__(self) -> None:
        self._total = self.start.total.clone()  # the round's state is new; the old one stays valid if the round is dropped
        self._count = self.start.count
        self._queue = SampleOrder(self.order)

    def add(self, client_id: int, new_model: torch.Tensor, old_model: torch.Tensor | None) -> None:
        """Client ``client_id`` trained ``new_model``; ``old_model`` is its previous latest model (None: its first)."""
        change = new_model.to(torch.float64) if old_model is None else new_model.to(torch.float64) - old_model.to(torch.float64)
        for _, (ready, first) in self._queue.put(client_id, (change, old_model is None)):
            self._take(ready, first)

    def result(self) -> LatestModels:
        for _, (ready, first) in self._queue.rest():
            self._take(ready, first)
        return LatestModels(self._total, self._count)

    def _take(self, change: torch.Tensor, first: bool) -> None:
        self._total += change
        self._count += int(first)


def all_clients_mean(latest: LatestModels, store: Any, registered: np.ndarray, num_clients: int, initial_params: torch.Tensor) -> torch.Tensor:
    """Mean over ``registered`` of every client's latest model (θ⁰ for clients that never trained), from the sum.

    ``store`` is read only for clients outside ``registered`` (their models leave the sum).
    """
    total = latest.total.clone()
    trained = latest.count
    outside = np.setdiff1d(np.arange(num_clients), registered, assume_unique=True).tolist()
    for start in range(0, len(outside), OUTSIDE_BATCH):
        batch = outside[start : start + OUTSIDE_BATCH]
        store.prefetch(batch)  # a bounded batch: thousands of clients may have left
        for client_id in batch:
            params = store.get(client_id)  # never staged: a client outside S_t does not train
            if params is not None:
                total -= params.to(torch.float64)
                trained -= 1
    total += (len(registered) - trained) * initial_params.to(torch.float64)
    return (total / len(registered)).to(initial_params.dtype)
