"""AdaBest (Varno et al., "AdaBest: Minimizing Client Drift in Federated Learning via Adaptive Bias Estimation", ECCV 2022).

Seed paper 004, Algorithm 1, as algorithms.md states it.  Client state: ``h_k``
(model-sized, starts at 0) and ``t'_k``, the last round ``k`` reported
(0 = never):

    client k:  K steps of SGD on f_k with  ∇ −= h_k        → GradientCorrection(linear = −h_k)
               h_k ← h_k / (t − t'_k) + μ (θ^{t−1} − θ_k);   t'_k ← t;   send θ_k (one model)
    server:    θ̄^t = mean_P θ_k        (or Σ_P w_k θ_k, aggregation = "weighted")
               h^t = β_t (θ̄^{t−1} − θ̄^t)
               θ^t = θ̄^t − h^t,        θ̄^0 = θ^0 (θ̄ is kept in the server state)

On first participation ``h_k = 0``, so the factor ``1/(t − t'_k)`` does not
matter.  The server needs no knowledge of N.  ``β = μ = 0`` is FedAvg with
uniform weights bit for bit: with ``μ = 0`` the clients get no correction at
all, and with ``β_t = 0`` the server returns ``θ̄^t`` itself (the same
``aggregation.RunningMean`` arithmetic FedAvg uses, and FedAvg's
SGD server at lr 1 also returns ``θ̄`` exactly, see ``optim/apply.py``).

``β`` is a number in [0, 1] or a schedule of the round (``{kind =
"exponential", initial = 0.98, decay = 0.999}`` or ``{kind = "inverse_time",
a, b}``), validated to stay in [0, 1] for every round.

Decaying β when ‖h‖ plateaus (``beta_plateau = {factor, patience, threshold}``,
off by default).  The paper (Section 3.4.3, after Theorem 3.2: "Our
algorithm enables a direct decay of h through decaying β.  We apply this decay
in our experiments when norm of h plateaus"; Theorem 3.2 needs h → 0) gives no
factor, no patience and no test of a plateau, and the authors' code (fedsim's
``AdaBest``, varnio/fedsim ``fedsim/distributed/centralized/training/adabest.py``)
keeps β constant.  Ours, in the form of the authors' library's own plateau rule
(fedsim's ``ReduceLROnPlateau``, mode "min", relative threshold, no cooldown),
applied to β with ‖h^t‖ as the metric:

    β_t = β(t) · s_t                       (β(t): the number or schedule above; s_1 = 1)
    after round t, with n_t = ‖h^t‖ (n_0 = 0, b = +∞, c = 0, the test off):
        the test turns on at the first round with n_t < n_{t−1}, and stays on
        if on:  if n_t < b · (1 − threshold):  b ← n_t;  c ← 0
                else:                          c ← c + 1
                if c > patience:               s ← factor · s;  c ← 0   (takes effect from round t + 1)

Our choices where the paper is silent: "plateaus" read as "stops decreasing"
(‖h‖ should go to 0); the test waits for ‖h‖'s first fall, because ‖h‖ grows
over the first rounds (h^1 is one round's change, later ones accumulate them)
and that growth is not a plateau (without the wait a run decays β about
patience rounds after round 1, then again and again: measured on a 60-round
synthetic run, β = 0.96 fell to 0.001); the best value b is not reset by a
decay (as in ``ReduceLROnPlateau``); the decay multiplies a scheduled β as
well; a round with β_t = 0 has n_t = 0; the defaults factor = 0.1, patience =
10, threshold = 1e-4 are fedsim's ``ReduceLROnPlateau`` defaults, not numbers
from the paper.  The state (s, b, c, n_{t−1}, on) is the server's and is
checkpointed with it.
``μ`` and ``β`` follow the paper (μ = 0.02; β = 0.96 at 10% and 0.98 at 100%
participation), not the fedsim releases' ``μ·B·E/n_k`` scaling.

Limit point on quadratics (what ``adabest_test.py`` asserts).  With full
participation ``t − t'_k = 1`` after round 1, so ``Σ_k h_k`` telescopes:

    mean_k h_k^t = μ [(θ̄^0 − θ̄^t) − β (θ̄^0 − θ̄^{t−1})]      (constant β)

At a fixed point every client returns ``θ_k = θ`` (else ``h_k`` would keep
moving), so ``∇f_k(θ) = h_k`` for each k, and averaging:

    ∇F(θ^∞) = mean_k ∇f_k(θ^∞) = μ (1 − β) (θ^0 − θ^∞)

i.e. AdaBest (full participation, constant β < 1, μ > 0) converges to the
minimiser of ``F(θ) + μ(1−β)/2 ‖θ − θ^0‖²``, a proximal point anchored at the
initial model, not to the minimiser of F.  The bias vanishes as β → 1 or
μ → 0 and is small for the paper's values (μ(1−β) = 4e-4).

Partial work and dropouts: a reporting client's θ_k is used whatever number of
steps it did; a client that does not report sends nothing, keeps ``h_k`` and
``t'_k``, and its ``h_k`` is damped by ``1/(t − t'_k)`` when it next reports.

Metric ``drift_norm`` = ``‖h^t‖``.

Under ``[privacy]``: a message reveals ``x_k = θ_k − θ^{t−1}``.  With
``aggregation = "uniform"`` (the paper's) the server update is linear in
``Σ_P x_k`` with unit weight per message: ``θ̄^t = θ^{t−1} + Σ_P x_k / m`` with
the public expected cohort m (``RoundContext.mean_denominator``), and
``h^t``, ``θ^t`` are fixed affine functions of ``θ̄^t`` given the public
``θ̄^{t−1}``.  Clipped to C, one client moves the sum by at most C; the noise
N(0, σ²) on it reaches ``θ̄^t`` as σ/m and ``θ^t`` as (1 + β_t)σ/m.  The promise
holds for multiplicity 1 (poisson or uniform sampling).  ``aggregation =
"weighted"`` has no form (its weights n_k are private and unbounded); ``h_k``
never leaves the client.

Example:
    >>> import torch
    >>> from driftlab.algorithms import adabest
    >>> algorithm = adabest.build(mu=0.02, beta=0.96)
    >>> server = algorithm.server_init(torch.ones(2))
    >>> torch.equal(server.client_average, server.params)
    True
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from driftlab.algorithms.aggregation import (
    ModelSums,
    averaging_parts,
    check_aggregation,
    model_change_form,
    model_mean_fold,
)
from driftlab.algorithms.section import AlgorithmConfig, options
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, lacking, synchronous_only
from driftlab.optim.schedules import ExponentialSchedule, InverseTimeSchedule, schedule_from_table, value_at
from driftlab.simulation import seam

BetaSchedule = float | ExponentialSchedule | InverseTimeSchedule


def beta_value(value: Any) -> BetaSchedule:
    """A β in [0, 1], or a schedule table whose values stay in [0, 1] for every round t ≥ 1."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number in [0, 1] or a schedule table, got {value!r}")
    if isinstance(value, (int, float)):
        if not 0 <= value <= 1:
            raise ValueError("must be in [0, 1]")
        return float(value)
    if isinstance(value, dict):
        value = schedule_from_table(value)
    if isinstance(value, ExponentialSchedule):
        if value.initial > 1:  # decay ≤ 1, so round 1 is the largest value
            raise ValueError(
                f"an exponential β schedule must start in [0, 1]: need initial ≤ 1, got initial = {value.initial}"
            )
        return value
    if isinstance(value, InverseTimeSchedule):
        if value.a > value.b + 1:  # a / (b + t) is largest at t = 1
            raise ValueError(
                f"an inverse_time β schedule must stay ≤ 1: need a ≤ b + 1, got a = {value.a}, b = {value.b}"
            )
        return value
    raise ValueError(
        'expected a number in [0, 1] or a schedule table such as {kind="exponential", initial=0.98, decay=0.999}'
        f", got {value!r}"
    )


Beta = Annotated[Any, BeforeValidator(beta_value)]


class BetaPlateau(BaseModel):
    """``beta_plateau``: multiply β by ``factor`` when ‖h^t‖ has not fallen below (1 − threshold)·best for more than
    ``patience`` rounds (the paper's decay of β when ‖h‖ plateaus; its numbers are not in the paper)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    factor: float = Field(0.1, gt=0, lt=1, description="β ← factor·β at a plateau (fedsim ReduceLROnPlateau's 0.1)")
    patience: int = Field(10, ge=0, description="rounds without improvement tolerated before a decay (fedsim: 10)")
    threshold: float = Field(
        1e-4, ge=0, lt=1, description="an improvement is ‖h^t‖ < (1 − threshold)·best (relative; fedsim: 1e-4)"
    )


@dataclass(frozen=True)
class PlateauState:
    """The plateau rule's server state: β's multiplier s, the lowest ‖h‖ b since the test turned on, rounds c since
    b last improved, the last round's ‖h‖, and whether ‖h‖ has fallen yet (the test is on)."""

    scale: float = 1.0
    best: float = math.inf
    bad_rounds: int = 0
    previous: float = 0.0
    falling: bool = False


def plateau_step(state: PlateauState, rule: BetaPlateau, drift_norm: float) -> PlateauState:
    """The state after a round whose server drift had norm ``drift_norm`` (see the module docstring)."""
    if not (state.falling or drift_norm < state.previous):
        return dataclasses.replace(state, previous=drift_norm)  # ‖h‖ still growing from round 1: no plateau yet
    if drift_norm < state.best * (1 - rule.threshold):
        return PlateauState(state.scale, drift_norm, 0, drift_norm, True)
    if state.bad_rounds + 1 > rule.patience:
        return PlateauState(state.scale * rule.factor, state.best, 0, drift_norm, True)
    return PlateauState(state.scale, state.best, state.bad_rounds + 1, drift_norm, True)


# Why FedBuff cannot run AdaBest as it stands (Algorithm.asynchronous_refusal; docs/algorithms.md, "Asynchronous").
ASYNCHRONOUS_REASON = synchronous_only(
    "adabest",
    why=(
        "AdaBest's client divides h_k by t − t'_k, the rounds since it last reported, which is 0 when FedBuff "
        "dispatches a client again at the same model version, and its server's h = β(θ̄^{t−1} − θ̄^t) reads the "
        "difference of consecutive averages as client drift, where FedBuff's consecutive buffers hold changes "
        "from different model versions (no published asynchronous AdaBest rule was found)"
    ),
)


class Config(AlgorithmConfig):
    """``[algorithm]`` section for AdaBest (it has its own server step: keep ``server.optimizer = "sgd"``, ``server.lr = 1``)."""

    name: Literal["adabest"] = "adabest"
    mu: float = Field(
        0.02, ge=0, description="μ ≥ 0: client drift estimate h_k ← h_k/(t − t'_k) + μ(θ^{t−1} − θ_k) (paper: 0.02)"
    )
    beta: Beta = Field(
        0.96,
        description="β in [0, 1] or a schedule table: server h^t = β(θ̄^{t−1} − θ̄^t) (paper: 0.96 at 10%, 0.98 at 100% participation)",
    )
    aggregation: Literal["uniform", "weighted"] = Field(
        "uniform", description="uniform: θ̄ = mean of reporting clients (paper); weighted: w_k = n_k / Σ n_j"
    )
    beta_plateau: BetaPlateau | None = Field(
        None,
        description="decay β by factor when ‖h‖ plateaus (the paper's practice, numbers ours); unset: β as given",
    )


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # θ^t = θ̄^t − h^t, sent to clients
    client_average: torch.Tensor  # θ̄^t, kept for h^{t+1}; θ̄^0 = θ^0
    plateau: PlateauState | None = None  # beta_plateau's state; None without it (and in older checkpoints)


@dataclass(frozen=True)
class ClientView:
    """What the server sends a selected client: θ^{t−1} (the server's θ̄ and h stay on the server)."""

    params: torch.Tensor


@dataclass(frozen=True)
class ClientState:
    drift: torch.Tensor  # h_k
    last_round: int  # t'_k, the last round k reported (0 = never)


@dataclass(frozen=True)
class ClientMessage:
    params: torch.Tensor  # θ_k, one model up
    num_samples: int
    multiplicity: int


def build(
    mu: float = 0.02,
    beta: BetaSchedule = 0.96,
    aggregation: str = "uniform",
    beta_plateau: BetaPlateau | dict | None = None,
) -> seam.Algorithm:
    """AdaBest with client coefficient ``mu`` ≥ 0, server ``beta`` (a number in [0, 1] or a schedule),
    ``aggregation``, and optionally β's decay when ‖h‖ plateaus (``beta_plateau``)."""
    if mu < 0:
        raise ValueError(f"adabest needs mu >= 0, got {mu}")
    beta = beta_value(beta)
    check_aggregation(aggregation)  # before any work
    plateau = BetaPlateau.model_validate(beta_plateau) if isinstance(beta_plateau, dict) else beta_plateau

    def server_init(initial_params: torch.Tensor) -> ServerState:
        state = None if plateau is None else PlateauState()
        return ServerState(params=initial_params, client_average=initial_params, plateau=state)

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        return ClientState(drift=torch.zeros_like(initial_params), last_round=0)

    def client_objective(view: ClientView, client: ClientState, context: seam.ClientContext) -> seam.GradientCorrection:
        if mu == 0:
            return seam.NO_CORRECTION  # h_k stays 0 forever: no term at all, so the step is FedAvg's to the bit
        return seam.GradientCorrection(linear=-client.drift)

    def client_finish(
        view: ClientView, client: ClientState, context: seam.ClientContext, update: seam.ClientUpdate
    ) -> tuple[ClientState, ClientMessage]:
        rounds_since = context.round - client.last_round  # t − t'_k ≥ 1; h_k = 0 on first participation
        drift = client.drift / rounds_since + mu * (view.params - update.final_params)
        message = ClientMessage(update.final_params, context.num_samples, context.multiplicity)
        return ClientState(drift, context.round), message

    def aggregation_finish(
        server: ServerState, client_models: ModelSums, context: seam.RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        client_average = client_models.value(context.mean_denominator)
        beta_t = value_at(beta, context.round)
        if server.plateau is not None:
            beta_t = beta_t * server.plateau.scale
        if beta_t == 0:
            # h^t = 0: return θ̄^t itself so β = μ = 0 is FedAvg to the bit (no −0.0 subtraction).
            params, drift_norm = client_average, 0.0
        else:
            server_drift = beta_t * (server.client_average - client_average)
            params = client_average - server_drift
            drift_norm = float(torch.linalg.vector_norm(server_drift))
        metrics = {"drift_norm": drift_norm}
        if plateau is None or server.plateau is None:
            return ServerState(params, client_average), metrics
        metrics["beta"] = beta_t  # the β this round used
        return ServerState(params, client_average, plateau_step(server.plateau, plateau, drift_norm)), metrics

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params)

    # Unit weight: uniform aggregation counts a message by its multiplicity, 1 under poisson or uniform sampling.
    form = model_change_form(lambda params: ClientMessage(params, num_samples=1, multiplicity=1))
    # A private round: θ̄^t = θ^{t−1} + Σ_P (θ_k − θ^{t−1}) / m depends on the released changes only.
    fold = model_mean_fold(aggregation, aggregation_finish)
    parts = averaging_parts(aggregation, fold, form, *lacking(ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON))
    return seam.Algorithm(
        "adabest",
        server_init,
        client_objective,
        client_finish,
        broadcast=broadcast,
        **parts,
        client_state_init=client_state_init,
    )


def from_config(config: Config, server_optimizer: Any) -> seam.Algorithm:
    """Build from ``config``.  AdaBest's server step is its own: ``server_optimizer`` is not used, and the
    registry entry's ``owns_server_step`` makes config validation refuse any but plain SGD."""
    return build(**options(config))
