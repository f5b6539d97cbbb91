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
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from driftlab.simulation.round.ordered_fold import SampleOrder

OUTSIDE_BATCH = 64  # models of clients outside S_t read at a time
# A checkpoint's engine/ tensors: the count, and either the whole sum or the entries where it differs from a fresh one.
SUM, COUNT, FIX_INDEX, FIX_VALUE = (
    "latest_models_sum",
    "latest_models_count",
    "latest_models_sum_fix_index",
    "latest_models_sum_fix_value",
)
STORE_NAME = "latest_models"  # the store's name in a checkpoint (store/latest_models/...) and on disk


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
        self._total = (
            self.start.total.clone()
        )  # the round's state is new; the old one stays valid if the round is dropped
        self._count = self.start.count
        self._queue = SampleOrder(self.order)

    def add(self, client_id: int, new_model: torch.Tensor, old_model: torch.Tensor | None) -> None:
        """Client ``client_id`` trained ``new_model``; ``old_model`` is its previous latest model (None: its first)."""
        change = (
            new_model.to(torch.float64)
            if old_model is None
            else new_model.to(torch.float64) - old_model.to(torch.float64)
        )
        for _, (ready, first) in self._queue.put(client_id, (change, old_model is None)):
            self._take(ready, first)

    def result(self) -> LatestModels:
        for _, (ready, first) in self._queue.rest():
            self._take(ready, first)
        return LatestModels(self._total, self._count)

    def _take(self, change: torch.Tensor, first: bool) -> None:
        self._total += change
        self._count += int(first)


def all_clients_mean(
    latest: LatestModels, store: Any, registered: np.ndarray, num_clients: int, initial_params: torch.Tensor
) -> torch.Tensor:
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


def mean_of_latest(
    store: Any | None,
    latest: LatestModels | None,
    registered: np.ndarray,
    num_clients: int,
    initial_params: torch.Tensor,
) -> torch.Tensor:
    """The evaluated "all_clients_mean" model: ``all_clients_mean`` of ``latest``, the running sum after the round
    (None: summed from ``store``, staged models included, as a deployment's round needs)."""
    if store is None:
        raise ValueError(
            'evaluation.model "all_clients_mean" needs the store of every client\'s latest model (latest_models)'
        )
    if latest is None:
        latest = summed_store(store, initial_params, include_staged=True)
    return all_clients_mean(latest, store, registered, num_clients, initial_params)


@dataclass
class LatestModelsRound:
    """One round's observer of the finished clients (``observe_round``): each one's final model becomes its latest
    model in the store (staged until the round commits) and its change goes into the running sum, in sample order."""

    store: Any
    update: LatestModelsUpdate

    def prefetch(self, client_ids: list[int]) -> None:
        self.store.prefetch(client_ids)  # one batched read of a wave's previous models

    def client_trained(self, client_id: int, final_params: torch.Tensor) -> None:
        self.update.add(client_id, final_params, self.store.get(client_id))
        self.store.put(client_id, final_params)

    def result(self) -> LatestModels:
        return self.update.result()


@dataclass(frozen=True)
class NotKept:
    """The null observer of a run that keeps no latest models (any evaluated model but "all_clients_mean")."""

    def prefetch(self, client_ids: list[int]) -> None:
        pass

    def client_trained(self, client_id: int, final_params: torch.Tensor) -> None:
        pass

    def result(self) -> None:
        return None


NOT_KEPT = NotKept()


def observe_round(
    store: Any | None, latest: LatestModels | None, initial_params: torch.Tensor, order: Sequence[int]
) -> LatestModelsRound | NotKept:
    """The observer of a round whose clients train in sample order ``order``: ``NOT_KEPT`` without a store of latest
    models (kept only for ``evaluation.model = "all_clients_mean"``), else one that updates the store and ``latest``,
    their sum (None: summed from the store first, as after an older checkpoint)."""
    if store is None:
        return NOT_KEPT
    start = latest if latest is not None else summed_store(store, initial_params)
    return LatestModelsRound(store, LatestModelsUpdate(start, order))


@dataclass(frozen=True)
class LatestModelsExtra:
    """``SimulationState.latest_sum`` in a checkpoint's engine section (``checkpoint_tensors``: compact beside the
    latest models when the file carries them, whole when a disk store keeps them).  The models themselves are
    per-client records (``SimulationState.record_stores``)."""

    def engine_tensors(self, state: Any, disk_stores: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if state.latest_sum is None:
            return {}
        in_file = state.latest_models if STORE_NAME not in disk_stores else None
        return checkpoint_tensors(state.latest_sum, in_file)

    def restored(self, sim: Any, state: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:  # noqa: ARG002
        """The running sum as written, bit for bit (None: an older checkpoint, summed from the store at the next
        round); ``state`` holds the checkpoint's latest models, staged."""
        if state.latest_models is None:
            return {}
        return {"latest_sum": from_checkpoint_tensors(dict(tensors), state.latest_models, state.server.params)}
