"""FedNova (Wang, Liu, Liang, Joshi and Poor, "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020, arXiv 2007.07481; the authors' code, github JYWa/FedNova).

Normalized averaging: each client's update is divided by its amount of local work before averaging, so a
client that ran more steps does not pull the model towards its own optimum (FedAvg with heterogeneous
steps minimises ``Σ p_k τ_k f_k``, not ``Σ p_k f_k``).

    client k:  θ_k = τ_k local steps from θ^{t−1}: SGD, or heavy ball (ρ > 0)  v ← ρ v + g,  θ ← θ − η_l v,  v₀ = 0
               send θ_k and τ_k (the steps it actually did: a straggler's partial work counts)
    a_k     =  τ_k                                                   (ρ = 0)
               Σ_{j=0}^{τ_k−1} (1 − ρ^{j+1}) / (1 − ρ)                 (ρ > 0; the paper's ‖a_k‖₁)
    server:    p_k = r_k / Σ_P r_j     (r_k = n_k "weighted", default, or 1 "uniform"; times multiplicity)
               d_k = (θ^{t−1} − θ_k) / a_k,   τ_eff = Σ_P p_k a_k,   q = τ_eff Σ_P p_k d_k
               θ^t = ServerOpt(θ^{t−1}, q, η_g)                       (SGD with η_g = 1 is the paper's FedNova)

The server computes the same thing as a step towards a mean of client models, so it streams like FedAvg
(one running sum) and equals it bit for bit when every client did the same work:

    θ̃ = Σ_P (r_k/a_k) θ_k / Σ_P (r_k/a_k),    λ = τ_eff Σ_P p_k / a_k,    θ^{t−1} − q = θ^{t−1} + λ (θ̃ − θ^{t−1})

The weights are taken relative to the first reporting client's ``ā`` (``r_k ā/a_k``, and
``λ = (Σ r_k a_k/ā / R)(Σ r_k ā/a_k / R)``, ``R = Σ_P r_k``): with equal ``a_k`` every ratio is exactly 1, θ̃ is
FedAvg's weighted mean and ``λ = 1``, taken as θ̃ itself.  A client that reports after 0 steps counts in ``R``
and adds 0 to ``τ_eff`` and nothing to θ̃ (it did not move); if every reporter did 0 steps θ stays.

Choices (docs/algorithms.md): ``p_k`` and ``τ_eff`` run over the reporting clients (the authors' code runs
every client every round with ``p_k = n_k/n``); the code's proximal local solver (``μ``) and Nesterov
momentum are not offered; its server momentum ``gmf`` is ``server.optimizer = "momentum"`` with
``server.lr = 1`` (equal for a constant η_l).  Metric ``effective_steps`` = τ_eff.

Partial work and dropouts: kept, that is FedNova's point; an inactive client sends nothing.  If no client
reports, the server model stays as it is.  Client-level DP and FedBuff are refused (``RELEASE_REASON``,
``ASYNCHRONOUS_REASON``).

Example:
    >>> from driftlab.algorithms import fednova
    >>> fednova.normaliser(3, 0.0), fednova.normaliser(3, 0.5)
    (3.0, 4.25)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field

from driftlab.algorithms.aggregation import RunningMean, check_aggregation, client_weight, folded, server_step
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, options
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, RELEASE_FORM, Reason, lacking, synchronous_only
from driftlab.simulation import seam
from driftlab.simulation.backends.objectives import LocalObjective, LocalStep

RELEASE_REASON = Reason(
    why=(
        "FedNova scales each client's change by τ_eff/a_k, where a_k comes from the client's own step count and "
        "τ_eff = Σ p_k a_k from every reporter's, both private, so no clip on the change bounds one client's "
        "influence (a client with few steps weighs up to τ_eff times its change)"
    ),
    fix=('use fedavg with aggregation = "uniform"'),
)
ASYNCHRONOUS_REASON = synchronous_only(
    "fednova",
    why=(
        "FedNova's server step rescales the round's changes by τ_eff = Σ p_k a_k and 1/a_k, which FedBuff's "
        "equal-weight buffer of staleness-weighted changes does not carry, and we found no published "
        "asynchronous FedNova rule"
    ),
    alternative='use fedavg with aggregation = "uniform"',
)


class Config(AlgorithmConfig):
    """``[algorithm]`` section for FedNova (the server optimizer and ``η_g`` are chosen in ``[server]``)."""

    name: Literal["fednova"] = "fednova"
    aggregation: Aggregation = Field(
        "weighted", description="weighted: p_k = n_k / Σ n_j (the paper's, default); uniform: p_k = 1/|P|"
    )
    momentum: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="local heavy-ball momentum ρ in [0, 1) (0: plain SGD, the default); a_k then sums (1 − ρ^{j+1})/(1 − ρ)",
    )


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # θ^t
    optimizer_state: Any  # the server optimizer's state


@dataclass(frozen=True)
class ClientView:
    """What the server sends a selected client: the model θ^{t−1} to start from."""

    params: torch.Tensor


@dataclass(frozen=True)
class ClientMessage:
    params: torch.Tensor  # θ_k
    local_steps: int  # τ_k, the steps the client did (a_k follows from it and ρ)
    num_samples: int
    multiplicity: int


@dataclass(frozen=True)
class NovaSums:
    """A round's running sums: ``Σ r_k (ā/a_k) θ_k`` and its weight, ``Σ r_k a_k/ā``, ``R = Σ r_k``, and ``ā``."""

    models: RunningMean  # over the clients with a_k > 0
    work: float  # Σ_P r_k a_k / ā
    weight: float  # R
    reference: float | None  # ā, the first reporting client's a_k > 0

    def add(self, params: torch.Tensor, normaliser_k: float, weight: float) -> "NovaSums":
        if normaliser_k == 0:  # no step: it adds to R and 0 to τ_eff; θ_k = θ^{t−1} has no direction to normalise
            return NovaSums(self.models, self.work, self.weight + weight, self.reference)
        reference = normaliser_k if self.reference is None else self.reference
        models = self.models.add(params, weight * (reference / normaliser_k))
        return NovaSums(models, self.work + weight * (normaliser_k / reference), self.weight + weight, reference)


def normaliser(steps: int, momentum: float) -> float:
    """``a_k``: ``τ_k`` for SGD; ``Σ_{j<τ_k} (1 − ρ^{j+1})/(1 − ρ)`` with heavy-ball momentum ρ (the code's counter)."""
    if momentum == 0:
        return float(steps)
    total, counter = 0.0, 0.0
    for _ in range(steps):
        counter = momentum * counter + 1.0  # (1 − ρ^{j+1})/(1 − ρ), by its recursion
        total += counter
    return total


def heavy_ball(momentum: float) -> Any:
    """The local step ``v ← ρ v + g,  θ ← θ − η_l v`` (the authors' code with dampening 0, v = 0 each round)."""

    def step(
        params: torch.Tensor, gradient: torch.Tensor, state: tuple[torch.Tensor, ...], learning_rate: float
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        (velocity,) = state
        velocity = momentum * velocity + gradient
        return params - learning_rate * velocity, (velocity,)

    return step


def build(server_optimizer: Any, aggregation: str = "weighted", momentum: float = 0.0) -> seam.Algorithm:
    """FedNova with ``server_optimizer`` (``driftlab.optim.server``), ``aggregation`` in {"weighted", "uniform"}
    and local momentum ``0 ≤ momentum < 1``."""
    check_aggregation(aggregation)  # before any work
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    local_step = heavy_ball(momentum)

    def server_init(initial_params: torch.Tensor) -> ServerState:
        return ServerState(params=initial_params, optimizer_state=server_optimizer.init(initial_params))

    def client_objective(
        view: ClientView, client_state: None, context: seam.ClientContext
    ) -> seam.GradientCorrection | LocalObjective:
        if momentum == 0:
            return seam.NO_CORRECTION
        return LocalObjective(local_step=LocalStep(local_step, (torch.zeros_like(view.params),)))

    def client_finish(
        view: ClientView, client_state: None, context: seam.ClientContext, update: seam.ClientUpdate
    ) -> tuple[None, ClientMessage]:
        return None, ClientMessage(update.final_params, update.steps_done, context.num_samples, context.multiplicity)

    def aggregation_start(server: ServerState, context: seam.RoundContext) -> NovaSums:
        return NovaSums(RunningMean(), 0.0, 0.0, None)

    def aggregation_add(sums: NovaSums, message: ClientMessage) -> NovaSums:
        weight = client_weight(message.num_samples, message.multiplicity, aggregation)
        return sums.add(message.params, normaliser(message.local_steps, momentum), weight)

    def aggregation_finish(
        server: ServerState, sums: NovaSums, context: seam.RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        if sums.reference is None or sums.weight <= 0:  # nobody moved: θ^t = θ^{t−1}
            return server, {"effective_steps": 0.0}
        client_mean = sums.models.value()  # θ̃
        step = (sums.work / sums.weight) * (sums.models.weight / sums.weight)  # λ = τ_eff Σ p_k / a_k
        target = client_mean if step == 1.0 else server.params + step * (client_mean - server.params)
        params, optimizer_state = server_step(server_optimizer, server, target, context)
        return ServerState(params, optimizer_state), {"effective_steps": sums.reference * sums.work / sums.weight}

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params)

    return seam.Algorithm(
        "fednova",
        server_init,
        client_objective,
        client_finish,
        broadcast=broadcast,
        **folded(aggregation_start, aggregation_add, aggregation_finish),
        lacks=lacking(RELEASE_FORM, RELEASE_REASON) + lacking(ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON),
    )


def from_config(config: Config, server_optimizer: Any) -> seam.Algorithm:
    return build(server_optimizer, **options(config))
