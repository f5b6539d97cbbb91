"""Weighted means of client vectors: the only arithmetic every algorithm shares.

No paper owns these, so they live here; everything paper-specific stays in the
algorithm's own module.

A private round (``RoundContext.mean_denominator`` set) sums the changes
``θ_k − θ^{t−1}`` instead (``ChangeSums``), and the algorithms that upload one
model share their ``ReleaseForm`` (``model_change_form``).

A mean is kept as a running sum, ``Σ_k r_k v_k`` and ``Σ_k r_k``, divided once
at the end (``RunningMean``): the server can fold each message in as it
arrives, in sample order, and a round never holds its messages together.  The
list form (``weighted_mean``) is the same fold, so both give the same bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from driftlab.features.capabilities import RELEASE_FORM, Lack, Reason, lacking
from driftlab.optim.apply import apply_server_optimizer
from driftlab.simulation.seam import ReleaseForm, ServerFold

AGGREGATIONS = ("weighted", "uniform")

WEIGHTED_REASON = Reason(
    why=(
        'aggregation = "weighted" weighs each client by its sample count n_k, so the server update is not the '
        "sum of the released vectors with unit weight each that a release form promises (and n_k is private and "
        "unbounded: no clip would bound one client's influence)"
    ),
    fix=('set algorithm.aggregation = "uniform"'),
)
WEIGHTED_REFUSAL = WEIGHTED_REASON.text  # the prose, for code that reads it


def check_aggregation(mode: str) -> str:
    """``mode`` if it names an aggregation, else a ``ValueError`` listing the valid ones."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    return mode


def client_weight(num_samples: int, multiplicity: int, mode: str) -> float:
    """``r_k``: ``n_k`` ("weighted") or 1 ("uniform"), times ``multiplicity``; the mean weighs by ``r_k / Σ_P r_j``.

    A client drawn twice by with-replacement sampling (FedProx Algorithm 2)
    weighs twice, as if it were two draws.
    """
    if check_aggregation(mode) == "weighted":
        return float(num_samples) * multiplicity
    return float(multiplicity)


def running_sum(total: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    """``total + term``, or ``term`` itself when nothing was summed yet (None): a sum over a round's messages in the
    order they were added, whose first term is not added to a zero (so one message gives its own bits)."""
    return term if total is None else total + term


def registered_mean_step(
    vector: torch.Tensor, change_sum: torch.Tensor, num_registered: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """``c + (1/N) Σ_P Δ_k`` and its ``drift_norm`` metric ``‖c‖``: a server vector kept as the mean over all N
    registered clients of theirs (SCAFFOLD's c, Karimireddy et al. 2020; VRL-SGD's c, Liang et al. 2019), moved by
    the changes ``Δ_k`` the reporting clients made to their own (clients that did not report keep theirs)."""
    moved = vector + change_sum / num_registered
    return moved, {"drift_norm": float(torch.linalg.vector_norm(moved))}


@dataclass(frozen=True)
class RunningMean:
    """``Σ_k r_k v_k`` and ``Σ_k r_k`` over the vectors added so far, accumulated in the order they were added."""

    total: torch.Tensor | None = None
    weight: float = 0.0

    def add(self, vector: torch.Tensor, weight: float) -> "RunningMean":
        term = vector * weight
        return RunningMean(running_sum(self.total, term), self.weight + weight)

    def value(self, denominator: float | None = None) -> torch.Tensor:
        """``Σ_k r_k v_k / Σ_k r_k``, or ``Σ_k r_k v_k / denominator`` when a public denominator is given
        (``RoundContext.mean_denominator``: the expected cohort of a private round)."""
        if self.total is None:
            raise ValueError("cannot average zero vectors")
        if denominator is not None:
            if not denominator > 0:
                raise ValueError(f"a mean's denominator must be positive, got {denominator}")
            return self.total / denominator
        if self.weight <= 0:
            raise ValueError("aggregation weights sum to zero: no client reported any work")
        return self.total / self.weight


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``Σ_k r_k v_k / Σ_k r_k`` for unnormalised weights ``r_k``, summed in the given order (the order fixes the rounding)."""
    mean = RunningMean()
    for vector, weight in zip(vectors, weights, strict=True):
        mean = mean.add(vector, weight)
    return mean.value()


@dataclass(frozen=True)
class ChangeSums:
    """A private round's running sum ``Σ_P r_k (θ_k − θ^{t−1})``, kept when ``RoundContext.mean_denominator`` is set:
    the mean is then ``θ^{t−1} + Σ_P r_k (θ_k − θ^{t−1}) / m``, a function of the released changes alone
    (``Σ_P r_k θ_k / m`` would carry ``|P| θ^{t−1} / m``, and ``|P|`` is private)."""

    start_params: torch.Tensor  # θ^{t−1}
    changes: RunningMean

    def add(self, params: torch.Tensor, weight: float) -> "ChangeSums":
        return ChangeSums(self.start_params, self.changes.add(params - self.start_params, weight))

    def value(self, denominator: float) -> torch.Tensor:
        return self.start_params + self.changes.value(denominator)


ModelSums = RunningMean | ChangeSums


def model_sums(start_params: torch.Tensor, context: Any) -> ModelSums:
    """The empty running sum of a round's client models: ``Σ_P r_k θ_k``, or in a private round
    (``context.mean_denominator`` set) ``Σ_P r_k (θ_k − θ^{t−1})`` from ``start_params`` = ``θ^{t−1}``.

    Either way ``.add(θ_k, r_k)`` folds a model in and ``.value(context.mean_denominator)`` is the round's mean,
    so an algorithm that averages models never branches on whether the round is private.
    """
    return ChangeSums(start_params, RunningMean()) if context.mean_denominator is not None else RunningMean()


def model_mean_fold(aggregation: str, finish: Any) -> ServerFold:
    """The fold of a server that averages the messages' models: ``model_sums`` from the server's ``params``
    (θ^{t−1}), each message's ``params`` (θ_k) added at ``r_k = client_weight(num_samples, multiplicity,
    aggregation)``, then ``finish(server, client_models, context)`` with ``client_models.value(mean_denominator)``
    the round's mean; under "uniform" ``r_k`` is the multiplicity alone, so a message needs no ``num_samples``
    field (FedGATE's has none).  Shared by FedAvg, AdaBest and FedGATE."""
    uniform = check_aggregation(aggregation) == "uniform"

    def start(server: Any, context: Any) -> ModelSums:
        return model_sums(server.params, context)

    def add(client_models: ModelSums, message: Any) -> ModelSums:
        weight = (
            float(message.multiplicity)
            if uniform
            else client_weight(message.num_samples, message.multiplicity, aggregation)
        )
        return client_models.add(message.params, weight)

    return ServerFold(start, add, finish)


def model_change_form(make_carrier: Any) -> ReleaseForm:
    """The ``ReleaseForm`` of a message whose ``params`` field is θ_k: it releases ``θ_k − view.params``.

    ``make_carrier(params)`` builds the message the fold counts once with unit weight (the server's noise);
    a message's other fields are kept as they are.  Shared by the algorithms that upload one model
    (FedAvg, FedProx, FedDyn, AdaBest).
    """

    def release(view: Any, message: Any) -> torch.Tensor:
        return message.params - view.params

    def size(view: Any) -> int:
        return view.params.numel()

    def restore(view: Any, message: Any, vector: torch.Tensor) -> Any:
        params = view.params + vector
        return make_carrier(params) if message is None else dataclasses.replace(message, params=params)

    return ReleaseForm(release, restore, size=size)


def server_step(
    server_optimizer: Any, server: Any, client_average: torch.Tensor, context: Any
) -> tuple[torch.Tensor, Any]:
    """θ^t and the optimizer's new state: ``server_optimizer``'s step from the server's θ^{t−1} (``server.params``,
    with ``server.optimizer_state``) on ``q = θ^{t−1} − client_average`` at the round's η_g
    (``context.server_learning_rate``; ``apply_server_optimizer``)."""
    return apply_server_optimizer(
        server_optimizer, server.optimizer_state, server.params, client_average, context.server_learning_rate
    )


def folded(start: Any, add: Any, finish: Any) -> dict[str, Any]:
    """The ``Algorithm`` fields of a server update given as the fold ``start``, ``add``, ``finish`` (``ServerFold``):
    ``server_fold``, which the engine streams each message into, and ``server_update``, the same fold over a list."""
    fold = ServerFold(start, add, finish)
    return {"server_update": fold.server_update, "server_fold": fold}


def averaging_parts(aggregation: str, fold: ServerFold, form: ReleaseForm, *lacks: Lack) -> dict[str, Any]:
    """The ``Algorithm`` fields of an algorithm whose server means weigh clients by ``r_k`` (``client_weight``):
    ``fold`` as its server update, ``form`` as its release form under uniform aggregation (else none, for
    ``WEIGHTED_REASON``), and its other ``lacks``.  FedAvg, AdaBest, FedGATE (always uniform), MimeLite and Mime."""
    releasable = check_aggregation(aggregation) == "uniform"
    return {
        "server_update": fold.server_update,
        "server_fold": fold,
        "release": form if releasable else None,
        "lacks": lacking(RELEASE_FORM, None if releasable else WEIGHTED_REASON) + lacks,
    }
