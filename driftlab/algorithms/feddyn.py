"""FedDyn (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021).

Seed paper 000, Algorithm 1, in the λ form of the authors' code, as
algorithms.md states it.  Client state ``λ_k`` (model-sized, starts at 0; the
paper's ``∇L_k(θ_k^{t−1}) = −α λ_k``):

    client k:  local objective  f_k(θ) + α_k ⟨θ, λ_k⟩ + α_k/2 ‖θ − θ^{t−1}‖²
               ∇ += α_k λ_k + α_k (θ − θ^{t−1})
               → GradientCorrection(linear = α_k λ_k, quadratic = α_k, reference = θ^{t−1})
               λ_k ← λ_k + (θ_k − θ^{t−1});   send θ_k (one model)
    server:    θ^t = mean_P θ_k + mean_{k∈S} λ_k      (unweighted; S = all N registered clients)

``α_k = α · n̄ / n_k`` with ``n̄`` the mean client size (``balance = "by_size"``,
the authors' code; balanced data gives ``α_k = α``), or ``α_k = α``
(``balance = "none"``).

The second mean runs over ALL registered clients, non-reporting ones with
their old ``λ``.  The server never scans the client store: it keeps
``Σ_{k∈S} λ_k`` in its state and adds each reporting client's increment
``θ_k − θ^{t−1}`` (which it can compute from the uploaded θ_k, so FedDyn costs
one model each way), then divides by ``N = RoundContext.num_registered``.
This is the paper's form with ``h = −α mean_S λ_k`` (balanced data):

    h^t = h^{t−1} − α/N Σ_P (θ_k − θ^{t−1}),    θ^t = mean_P θ_k − h^t / α

Metric ``drift_norm`` = ``‖mean_S λ_k‖`` = ``‖h‖ / α`` in the paper's terms
(AdaBest's Figure 1 claims it grows without bound at low participation).

Choices where the sheet is silent:
  * ``α > 0`` is required: at ``α = 0`` the paper's ``θ^t = mean_P θ_k − h^t/α``
    is undefined and the λ form is not FedAvg (the server would still add the
    accumulated drift ``mean_S λ_k``), so it is rejected rather than given a
    meaning.
  * The server step is FedDyn's own: ``server.optimizer`` must be ``sgd`` and
    ``server.lr`` 1 (config validation refuses anything else, through the
    registry entry's ``owns_server_step``, rather than ignoring it).
  * Sampling with replacement: a client drawn twice counts twice in
    ``mean_P θ_k`` but updates its ``λ_k`` (and ``Σ λ``) once.
  * Clipping: this module clips ``∇loss + α_k λ_k`` and adds ``α_k (θ − θ^{t−1})``
    after clipping, as the sheet states.  The authors' code clips
    ``∇loss + α_k(λ_k − θ^{t−1})`` and adds ``α_k θ`` (through
    ``weight_decay``) afterwards; the two agree exactly when clipping is off.
  * Clients that leave the registered set take their ``λ_k`` out of ``Σ λ``
    (``client_left``) and bring it back if they return (``client_joined``), so
    the second mean is always over the current ``S_t``.

Partial work and dropouts: a reporting client's ``θ_k`` is used whatever
number of steps it did (its ``λ_k`` moves by what it did); a client that does
not report sends nothing and keeps its ``λ_k``, which still counts in
``mean_S λ_k``.

Under ``[privacy]``: a message reveals ``x_k = θ_k − θ^{t−1}``, the increment
the server adds to ``Σ_S λ_k`` too.  The server update is linear in ``Σ_P x_k``
with unit weight per message: ``mean_P θ_k = θ^{t−1} + Σ_P x_k / m`` with the
public expected cohort m (``RoundContext.mean_denominator``), and ``Σ_S λ_k``
gains ``Σ_P x_k`` (divided by the public N in ``mean_S λ_k``).  Clipped to C,
one client moves ``Σ_P x_k`` by at most C; the server's noise N(0, σ²) on that
sum reaches ``mean_P θ_k`` as σ/m and stays in ``Σ_S λ_k`` (σ/N in θ, summed over
rounds: the server's λ-sum is a released aggregate).  The promise holds for
multiplicity 1 (a client drawn twice counts twice in the mean, once in the
λ-sum).  ``λ_k`` itself never leaves the client.

Example:
    >>> import torch
    >>> from driftlab.algorithms import feddyn
    >>> algorithm = feddyn.build(alpha=0.1)
    >>> server = algorithm.server_init(torch.zeros(2))
    >>> server.dual_sum
    tensor([0., 0.])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field

from driftlab.algorithms.aggregation import RunningMean, folded, model_change_form
from driftlab.algorithms.section import AlgorithmConfig, options
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, lacking, synchronous_only
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate, GradientCorrection, RoundContext

BALANCES = ("by_size", "none")

# Why FedBuff cannot run FedDyn as it stands (Algorithm.asynchronous_refusal; docs/algorithms.md, "Asynchronous").
ASYNCHRONOUS_REASON = synchronous_only(
    "feddyn",
    why=(
        "FedDyn's server adds each client's λ-increment θ_k − θ^{t−1} to Σ_S λ_k and its dynamic regulariser "
        "pulls every client of a round towards that round's θ^{t−1}: FedBuff weights a stale change by s(τ), so "
        "Σ_S λ_k would gain s(τ)(θ_k − θ^{v_k}) where λ_k gained the whole change, and a stale client's "
        "regulariser is centred on an old model (no published asynchronous FedDyn rule was found)"
    ),
)


class Config(AlgorithmConfig):
    """``[algorithm]`` section for FedDyn (it has its own server step: keep ``server.optimizer = "sgd"``, ``server.lr = 1``)."""

    name: Literal["feddyn"] = "feddyn"
    alpha: float = Field(
        0.01,
        gt=0,
        description="regularization α > 0: the local gradient adds α_k λ_k + α_k(θ − θ^{t−1}) (paper: 0.1, 0.01, 0.001)",
    )
    balance: Literal["by_size", "none"] = Field(
        "by_size",
        description="by_size: α_k = α·n̄/n_k for unbalanced data (authors' code); none: α_k = α for every client",
    )


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # θ^t
    dual_sum: torch.Tensor  # Σ_{k∈S} λ_k over every registered client


@dataclass(frozen=True)
class ClientView:
    """What the server sends a selected client: θ^{t−1}, the start and the proximal reference."""

    params: torch.Tensor


@dataclass(frozen=True)
class ClientState:
    dual: torch.Tensor  # λ_k (the paper's ∇L_k(θ_k) = −α λ_k)


@dataclass(frozen=True)
class ClientMessage:
    params: torch.Tensor  # θ_k, one model up
    multiplicity: int


@dataclass(frozen=True)
class RoundSums:
    """The server's running sums over a round's messages: ``Σ_P θ_k`` (by multiplicity) and ``Σ_S λ_k`` so far."""

    client_models: RunningMean  # Σ_P θ_k, or Σ_P (θ_k − θ^{t−1}) when relative
    start_params: torch.Tensor  # θ^{t−1}
    dual_sum: torch.Tensor
    # A private round (RoundContext.mean_denominator set) sums the changes θ_k − θ^{t−1}, so that its mean
    # θ^{t−1} + Σ_P (θ_k − θ^{t−1}) / m depends on the released changes only (not on the private |P|).
    relative: bool = False


def client_alpha(alpha: float, balance: str, context: ClientContext) -> float:
    """``α_k``: ``α · n̄ / n_k`` ("by_size") or ``α`` ("none")."""
    if balance == "by_size":
        return alpha * (context.mean_num_samples / context.num_samples)
    return alpha


def build(alpha: float = 0.01, balance: str = "by_size") -> Algorithm:
    """FedDyn with regularization ``alpha`` > 0 and ``balance`` in {"by_size", "none"}."""
    if not alpha > 0:
        raise ValueError(f"feddyn needs alpha > 0, got {alpha}")
    if balance not in BALANCES:
        raise ValueError(f"unknown balance {balance!r}; valid: {', '.join(BALANCES)}")

    def server_init(initial_params: torch.Tensor) -> ServerState:
        return ServerState(params=initial_params, dual_sum=torch.zeros_like(initial_params))

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        return ClientState(dual=torch.zeros_like(initial_params))

    def client_objective(view: ClientView, client: ClientState, context: ClientContext) -> GradientCorrection:
        alpha_k = client_alpha(alpha, balance, context)
        return GradientCorrection(linear=alpha_k * client.dual, quadratic=alpha_k, reference=view.params)

    def client_finish(
        view: ClientView, client: ClientState, context: ClientContext, update: ClientUpdate
    ) -> tuple[ClientState, ClientMessage]:
        dual = client.dual + (update.final_params - view.params)
        return ClientState(dual), ClientMessage(update.final_params, context.multiplicity)

    def aggregation_start(server: ServerState, context: RoundContext) -> RoundSums:
        return RoundSums(RunningMean(), server.params, server.dual_sum, relative=context.mean_denominator is not None)

    def aggregation_add(sums: RoundSums, message: ClientMessage) -> RoundSums:
        # Σ_S λ_k gains each reporting client once, with the increment it added to its own λ_k.
        change = message.params - sums.start_params
        return RoundSums(
            sums.client_models.add(change if sums.relative else message.params, float(message.multiplicity)),
            sums.start_params,
            sums.dual_sum + change,
            sums.relative,
        )

    def aggregation_finish(
        server: ServerState, sums: RoundSums, context: RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        dual_mean = sums.dual_sum / context.num_registered
        if sums.relative:
            client_mean = sums.start_params + sums.client_models.value(context.mean_denominator)
        else:
            client_mean = sums.client_models.value()
        params = client_mean + dual_mean
        return ServerState(params, sums.dual_sum), {"drift_norm": float(torch.linalg.vector_norm(dual_mean))}

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params)

    def client_joined(server: ServerState, client: ClientState) -> ServerState:
        # A returning client's λ_k counts in mean_S λ_k again (a new one's is 0).
        return ServerState(server.params, server.dual_sum + client.dual)

    def client_left(server: ServerState, client: ClientState) -> ServerState:
        return ServerState(server.params, server.dual_sum - client.dual)

    return Algorithm(
        "feddyn",
        server_init,
        client_objective,
        client_finish,
        broadcast=broadcast,
        client_state_init=client_state_init,
        client_joined=client_joined,
        client_left=client_left,
        **folded(aggregation_start, aggregation_add, aggregation_finish),
        release=model_change_form(lambda params: ClientMessage(params, multiplicity=1)),
        lacks=lacking(ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON),
    )


def from_config(config: Config, server_optimizer: Any) -> Algorithm:
    """Build from ``config``.  FedDyn's server step is its own: ``server_optimizer`` is not used, and the
    registry entry's ``owns_server_step`` makes config validation refuse any but plain SGD."""
    return build(**options(config))
