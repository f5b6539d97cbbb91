"""MimeLite with SGD and momentum (Karimireddy, Jaggi, Kale, Mohri, Reddi, Stich and Suresh, "Breaking the centralized
barrier for cross-device federated learning", NeurIPS 2021; arXiv 2008.03606, Algorithm 1), as docs/update-rules.md
"MimeLite" states it.

The server's momentum ``m`` is frozen during local steps and applied at every one of them; only the server moves it,
with the clients' full-batch gradients at the round's model ``x``::

    client k:  y ← x;  K steps of  y ← y − η_l (∇f_k(y; ζ) + β m)          → GradientCorrection(linear = β m)
               g_k = ∇f_k(x), the mean loss gradient over all of the client's examples at x
               send y_k and g_k
    server:    ȳ = Σ_P r_k y_k / Σ_P r_k,   ḡ = Σ_P r_k g_k / Σ_P r_k
               x⁺ = x − η_g (x − ȳ)           (SGD; η_g = 1 gives x⁺ = ȳ, the paper's)
               m⁺ = β m + ḡ

with ``r_k = n_k`` ("weighted", default: TFF's and FedJAX's MimeLite) or 1 ("uniform", the paper's 1/|S|), times
the client's multiplicity.  ``m`` starts at 0, so round 1 is FedAvg.

Momentum convention: the paper writes ``m ← (1 − β) g + β m`` and ``y ← y − η((1 − β) g + β m)``; this module uses
TFF's ``sgdm`` form above (PyTorch's, and driftlab's server ``momentum``), the same algorithm with
``η_l = (1 − β) η_paper``.  In this form the local step is an affine correction, so it runs on every backend's
fast path.

``β = 0``: the local step is plain SGD and ``m`` is never used, so no gradient is computed or sent and MimeLite is
FedAvg (same aggregation, incomplete = "keep") bit for bit.

Partial work and dropouts: a straggler's ``y_k`` (fewer steps) is averaged like the others, and its ``g_k`` does not
depend on its steps; a client that reported after 0 steps sends ``y_k = x`` and ``g_k``.  A dropout sends nothing.

Full-batch gradient: ``ClientUpdate.computation.full_gradient(x)`` (``seam.ClientComputation``), one more pass
over the client's data after its local steps; a caller that trains a client without its data (``computation``
None) gets ``MISSING_FULL_GRADIENT``.

Communication: up ``y_k`` and ``g_k`` (two models; one when β = 0); down ``x`` and ``m`` (two models; one when β = 0).

Under ``[privacy]`` (``aggregation = "uniform"`` only): a message reveals ``cat(y_k − x, g_k)`` (``y_k − x`` alone
when β = 0), clipped together to norm C.  The server update is linear in their sum with unit weight per message:
``ȳ = x + Σ_P (y_k − x) / M`` and ``ḡ = Σ_P g_k / M`` with the public expected cohort ``M``
(``RoundContext.mean_denominator``), so noise σ on the sum reaches ``x`` as σ/M (times η_g) and ``m`` as σ/M.

Example:
    >>> from driftlab.algorithms import mime
    >>> from driftlab.optim.server import make_server_optimizer
    >>> mime.build(make_server_optimizer("sgd"), momentum=0.9).name
    'mimelite'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from driftlab.algorithms.aggregation import (
    WEIGHTED_REFUSAL,
    ChangeSums,
    RunningMean,
    check_aggregation,
    client_weight,
)
from driftlab.optim.apply import apply_server_optimizer
from driftlab.simulation.seam import (
    NO_CORRECTION,
    Algorithm,
    ClientContext,
    ClientUpdate,
    GradientCorrection,
    PrivacyForm,
    RoundContext,
    ServerFold,
)

MISSING_FULL_GRADIENT = (
    "MimeLite with momentum > 0 needs each client's full-batch gradient at the round's model, "
    "ClientUpdate.computation.full_gradient(params), and this client update carries no computation on the client's "
    "data: train it through driftlab.simulation.round.client (every backend and deployment does), or set "
    "algorithm.momentum = 0 (FedAvg)"
)

# Why FedBuff cannot run MimeLite (Algorithm.asynchronous_refusal; docs/algorithms.md, "Asynchronous").
ASYNCHRONOUS_REFUSAL = (
    "MimeLite moves the server momentum with the clients' full-batch gradients at the model the round broadcast, "
    "and every local step applies that momentum: FedBuff's stale clients report gradients at older models and trained "
    "with an older momentum, and no asynchronous Mime rule is published (the paper's analysis is synchronous): run "
    "mimelite synchronously (remove [asynchronous]), or use fedavg or fedprox with aggregation = \"uniform\""
)


class Config(BaseModel):
    """``[algorithm]`` section for MimeLite (SGD with momentum); ``η_g`` is ``[server] lr`` (server.optimizer = "sgd")."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["mimelite"] = "mimelite"
    momentum: float = Field(
        0.9, ge=0, lt=1,
        description="β in [0, 1): m ← β m + mean ∇f_k(x), local step y ← y − η_l(∇f_k(y; ζ) + β m); 0 is FedAvg",
    )
    aggregation: Literal["weighted", "uniform"] = Field(
        "weighted", description="r_k for both means: n_k (default, TFF's and FedJAX's) or 1 (the paper's 1/|S|)"
    )


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # x
    momentum: torch.Tensor  # m, the server optimizer's statistic, frozen during local steps
    optimizer_state: Any  # the server SGD's (stateless) state, for the x-update


@dataclass(frozen=True)
class ClientView:
    """What the server sends a selected client: x, and m (None when β = 0: not sent)."""

    params: torch.Tensor
    momentum: torch.Tensor | None


@dataclass(frozen=True)
class ClientMessage:
    params: torch.Tensor  # y_k
    gradient: torch.Tensor | None  # g_k = ∇f_k(x) (None when β = 0: not sent)
    num_samples: int
    multiplicity: int


@dataclass(frozen=True)
class RoundSums:
    """``Σ_P r_k y_k`` (or ``Σ_P r_k (y_k − x)`` in a private round) and ``Σ_P r_k g_k``, with the same weights."""

    models: RunningMean | ChangeSums
    gradients: RunningMean


def full_batch_gradient(update: ClientUpdate) -> torch.Tensor:
    """``∇f_k(x)`` at the round's start model, from the client's own data (``MISSING_FULL_GRADIENT`` if no hook)."""
    if update.computation is None:
        raise RuntimeError(MISSING_FULL_GRADIENT)
    return update.computation.full_gradient(update.start_params)


def privacy_form(uses_momentum: bool) -> PrivacyForm:
    """MimeLite's ``PrivacyForm``: a message releases ``cat(y_k − x, g_k)`` (``y_k − x`` alone when β = 0); the
    carrier counts once with unit weight (multiplicity 1)."""

    def release(view: ClientView, message: ClientMessage) -> torch.Tensor:
        change = message.params - view.params
        return torch.cat((change, message.gradient)) if uses_momentum else change

    def restore(view: ClientView, message: ClientMessage | None, vector: torch.Tensor) -> ClientMessage:
        change, gradient = vector.split(view.params.numel()) if uses_momentum else (vector, None)
        if message is None:
            return ClientMessage(view.params + change, gradient, num_samples=1, multiplicity=1)
        return ClientMessage(view.params + change, gradient, message.num_samples, message.multiplicity)

    def size(view: ClientView) -> int:
        return (2 if uses_momentum else 1) * view.params.numel()

    return PrivacyForm(release, restore, size=size)


def build(server_optimizer: Any, momentum: float = 0.9, aggregation: str = "weighted") -> Algorithm:
    """MimeLite with momentum β = ``momentum`` whose x-update applies ``server_optimizer`` (SGD) to ``x − ȳ``."""
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum (β) must be in [0, 1), got {momentum}")
    check_aggregation(aggregation)
    uses_momentum = momentum > 0

    def server_init(initial_params: torch.Tensor) -> ServerState:
        return ServerState(initial_params, torch.zeros_like(initial_params), server_optimizer.init(initial_params))

    def client_objective(view: ClientView, client_state: None, context: ClientContext) -> GradientCorrection:
        if not uses_momentum:
            return NO_CORRECTION
        return GradientCorrection(linear=momentum * view.momentum)

    def client_finish(view: ClientView, client_state: None, context: ClientContext, update: ClientUpdate) -> tuple[None, ClientMessage]:
        gradient = full_batch_gradient(update) if uses_momentum else None
        return None, ClientMessage(update.final_params, gradient, context.num_samples, context.multiplicity)

    def aggregation_start(server: ServerState, context: RoundContext) -> RoundSums:
        models = ChangeSums(server.params, RunningMean()) if context.mean_denominator is not None else RunningMean()
        return RoundSums(models, RunningMean())

    def aggregation_add(sums: RoundSums, message: ClientMessage) -> RoundSums:
        weight = client_weight(message.num_samples, message.multiplicity, aggregation)
        gradients = sums.gradients.add(message.gradient, weight) if uses_momentum else sums.gradients
        return RoundSums(sums.models.add(message.params, weight), gradients)

    def aggregation_finish(server: ServerState, sums: RoundSums, context: RoundContext) -> tuple[ServerState, dict[str, float]]:
        client_average = sums.models.value(context.mean_denominator)
        params, optimizer_state = apply_server_optimizer(
            server_optimizer, server.optimizer_state, server.params, client_average, context.server_learning_rate
        )
        if not uses_momentum:
            return ServerState(params, server.momentum, optimizer_state), {}
        # The statistic moves with the full-batch gradients at x, never with the model change x − ȳ.
        new_momentum = momentum * server.momentum + sums.gradients.value(context.mean_denominator)
        return ServerState(params, new_momentum, optimizer_state), {"momentum_norm": float(torch.linalg.vector_norm(new_momentum))}

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params, server.momentum if uses_momentum else None)

    private = aggregation == "uniform"
    fold = ServerFold(aggregation_start, aggregation_add, aggregation_finish)
    return Algorithm("mimelite", server_init, client_objective, client_finish, fold.server_update, broadcast,
                     server_fold=fold, privacy=privacy_form(uses_momentum) if private else None,
                     privacy_refusal=None if private else WEIGHTED_REFUSAL, asynchronous_refusal=ASYNCHRONOUS_REFUSAL)


def from_config(config: Config, server_optimizer: Any) -> Algorithm:
    return build(server_optimizer, momentum=config.momentum, aggregation=config.aggregation)
