"""EFL: Elastic Federated Learning (Ma et al., "Towards Heterogeneous Clients with Elastic
Federated Learning", Algorithms 1 and 2), as docs/update-rules.md states it.

Elastic term over the clients ``i`` that have reported so far, with their latest
local model ``θ_i`` and diagonal empirical Fisher ``I_i``:

    λ/2 Σ_i (θ − θ_i)ᵀ diag(I_i) (θ − θ_i),    u_i = diag(I_i),  v_i = diag(I_i) ⊙ θ_i,
    U = Σ_i u_i,  V = Σ_i v_i    ⇒    local gradient adds  λ (U ⊙ θ − V) = λU ⊙ (θ − V/U)

It is handed to the trainer as a ``GradientCorrection`` with ``quadratic = λU``
and ``reference = V/U`` (0 where U = 0, where V = 0 too), not as
``linear = −λV, quadratic = λU, reference = 0`` (architecture.md's sketch):
the two are equal in exact arithmetic, but only the first keeps the whole
elastic term out of gradient clipping, as algorithms.md requires of
quadratic terms.  ``V/U`` is the Fisher-weighted mean of the reported models.
The sum runs over every client that has reported, the training client
included, as the paper's Equation (2) and the sheet write it; clients that have
not reported again keep their stale ``u_i, v_i``.

    client k:  θ_k = s_k local SGD steps from θ;  u_k = diag Fisher at θ_k over at most
               ``fisher_examples`` of its examples (seeded);  v_k = u_k ⊙ θ_k
    server:    p_k = w_k · E/s_k  ("adaptive", the paper's),  w_k ("plain"),
               or incomplete clients dropped ("drop");  w_k = n_k / Σ_P n_j
               θ⁺ = θ + Σ_P p_k (θ_k − θ)              (then the server optimizer; SGD at η_g = 1 by default)
               U += Σ_P (u_k − u_k^old),  V += Σ_P (v_k − v_k^old)

``E`` is the client's planned steps and ``s_k`` the steps the availability
model let it do; an inactive client (``s_k = 0``) contributes nothing.  The
server step is written as ``Σ_P w_k θ_k + Σ_{incomplete} (p_k − w_k)(θ_k − θ)``,
equal to the line above because ``Σ w_k = 1``, so that with every client
complete it is FedAvg's average exactly.

Compression (ST with error feedback both ways) is the reusable
``driftlab.compress.with_compression`` around this module; EFL's config turns
it on by default (``compression.ratio``).  The paper does not state its
sparsity q; the default 0.01 is ours.  ``λ = 0`` switches off the elastic
term, the Fisher pass and the u/v traffic; with ``λ = 0``, no compression and
every client complete, EFL is FedAvg bit for bit.

Under ``[privacy]``: a message reveals ``x_k = cat(θ_k − θ, u_k − u_k^old,
v_k − v_k^old)`` (``θ_k − θ`` alone when λ = 0), clipped as one vector to norm
C.  With ``aggregation = "uniform"`` and ``incomplete`` "plain" or "drop" the
server update is linear in ``Σ_P x_k`` with unit weight per message:
``θ⁺ = θ + Σ_P (θ_k − θ) / m`` with the public expected cohort m
(``RoundContext.mean_denominator``), and U, V gain the Fisher parts of the sum
undivided.  One client moves the sum by at most C; the noise N(0, σ²) on it
reaches θ as σ/m and U, V as σ, accumulating over rounds (a noisy U can lose
its positivity: the elastic term is then noise-dominated; prefer λ = 0 or small
noise).  The promise holds for multiplicity 1.  ``aggregation = "weighted"``
(private, unbounded n_k) and ``incomplete = "adaptive"`` (a straggler's
weight E/s_k, up to E at s_k = 1) have no form.

Traffic: up θ_k (compressed Δ_k) plus u_k, v_k; down θ (compressed Δ) plus U, V,
all u/v/U/V at 32 bits per entry.

Example:
    >>> from driftlab.algorithms import efl
    >>> from driftlab.optim.server import make_server_optimizer
    >>> efl.build(make_server_optimizer("sgd"), elastic=0.5).name
    'efl'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field

from driftlab.algorithms.aggregation import WEIGHTED_REASON, RunningMean, check_aggregation, client_weight, server_step
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, options
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, RELEASE_FORM, Reason, lacking, synchronous_only
from driftlab.simulation import seam

DEFAULT_COMPRESSION_RATIO = 0.01
ADAPTIVE_REASON = Reason(
    why=(
        "incomplete = \"adaptive\" weighs a straggler's change by E/s_k (up to E times a complete client's), so the "
        "server update is not the sum of the released vectors with unit weight each that a release form promises"
    ),
    fix=('set algorithm.incomplete = "drop" or "plain", or remove the feature'),
)

# Why FedBuff cannot run EFL as it stands (Algorithm.asynchronous_refusal; docs/algorithms.md, "Asynchronous").
ASYNCHRONOUS_REASON = synchronous_only(
    "efl",
    why=(
        "EFL's server keeps U = Σ_i u_i and V = Σ_i u_i ⊙ θ_i by adding the changes the clients made to their "
        "own u_k, v_k, and weighs a straggler by E/s_k: FedBuff weights a stale message by s(τ), so U and V "
        "would gain s(τ) times changes the clients made whole, and its buffer mean has equal weights (no "
        'published asynchronous EFL rule was found; EFL with elastic = 0, incomplete = "plain", aggregation = '
        '"uniform" and compression.ratio = 1 is FedAvg)'
    ),
)


class Config(AlgorithmConfig):
    """``[algorithm]`` section for EFL (compression is ``[compression] ratio``, default 0.01 for EFL)."""

    name: Literal["efl"] = "efl"
    elastic: float = Field(0.5, ge=0, description="λ, weight of the Fisher-weighted elastic term; 0 turns it off")
    fisher_examples: int = Field(
        128, ge=1, description="at most this many of a client's examples (seeded sample) estimate its diagonal Fisher"
    )
    incomplete: Literal["adaptive", "plain", "drop"] = Field(
        "adaptive",
        description="weight of an incomplete client: adaptive w_k·E/s_k (the paper's), plain w_k, or drop it",
    )
    aggregation: Aggregation = Field(
        "weighted", description="w_k: n_k-weighted (default) or uniform over reporting clients"
    )


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # θ, the model every client holds
    optimizer_state: Any
    fisher_sum: torch.Tensor  # U = Σ_i u_i over clients that have reported
    weighted_model_sum: torch.Tensor  # V = Σ_i u_i ⊙ θ_i


@dataclass(frozen=True)
class ClientView:
    """What the server sends a selected client: θ, and U, V for the elastic term (None when λ = 0: not sent)."""

    params: torch.Tensor
    fisher_sum: torch.Tensor | None  # U
    weighted_model_sum: torch.Tensor | None  # V


@dataclass(frozen=True)
class ClientState:
    fisher: torch.Tensor  # u_k last reported (0 before the first report)
    weighted_model: torch.Tensor  # v_k last reported


@dataclass(frozen=True)
class ClientMessage:
    """θ_k, and u_k, v_k as changes to the server's sums (the same size on the wire as u_k, v_k)."""

    params: torch.Tensor  # θ_k
    fisher_change: torch.Tensor | None  # u_k − u_k^old (None when λ = 0: nothing sent)
    weighted_model_change: torch.Tensor | None  # v_k − v_k^old
    num_samples: int
    multiplicity: int
    completed_fraction: float  # s_k / E


@dataclass(frozen=True)
class RoundSums:
    """The server's running sums over a round's messages: ``Σ_P r_k θ_k``, the adaptive weights' extra
    ``Σ_{incomplete} r_k (E/s_k − 1)(θ_k − θ)`` (None while no incomplete client reported), and U, V so far."""

    client_models: RunningMean  # Σ_P r_k θ_k, or Σ_P r_k (θ_k − θ) when relative
    incomplete_extra: torch.Tensor | None
    start_params: torch.Tensor  # θ^{t−1}
    fisher_sum: torch.Tensor
    weighted_model_sum: torch.Tensor
    # A private round (RoundContext.mean_denominator set) sums the changes θ_k − θ, so that its mean
    # θ + Σ_P r_k (θ_k − θ) / m depends on the released changes only (not on the private |P|).
    relative: bool = False


def release_reason(incomplete: str, aggregation: str) -> Reason | None:
    """Why EFL with these options has no ``ReleaseForm`` (naming each fix), or None when it has one."""
    reasons = ([WEIGHTED_REASON] if aggregation == "weighted" else []) + (
        [ADAPTIVE_REASON] if incomplete == "adaptive" else []
    )
    if not reasons:
        return None
    first, *rest = reasons
    return Reason(first.why, "; ".join([first.fix, *(reason.text for reason in rest)]), first.joint)


def release_form(uses_fisher: bool) -> seam.ReleaseForm:
    """EFL's ``ReleaseForm``: a message releases ``cat(θ_k − θ, u_k − u_k^old, v_k − v_k^old)`` (``θ_k − θ`` alone
    without the Fisher); the carrier counts once with unit weight (multiplicity 1, complete)."""

    def release(view: ClientView, message: ClientMessage) -> torch.Tensor:
        change = message.params - view.params
        if not uses_fisher:
            return change
        return torch.cat((change, message.fisher_change, message.weighted_model_change))

    def restore(view: ClientView, message: ClientMessage | None, vector: torch.Tensor) -> ClientMessage:
        if uses_fisher:
            change, fisher_change, weighted_model_change = vector.split(view.params.numel())
        else:
            change, fisher_change, weighted_model_change = vector, None, None
        params = view.params + change
        if message is None:
            return ClientMessage(
                params, fisher_change, weighted_model_change, num_samples=1, multiplicity=1, completed_fraction=1.0
            )
        return dataclasses.replace(
            message, params=params, fisher_change=fisher_change, weighted_model_change=weighted_model_change
        )

    def size(view: ClientView) -> int:
        return (3 if uses_fisher else 1) * view.params.numel()

    return seam.ReleaseForm(release, restore, size=size)


def build(
    server_optimizer: Any,
    elastic: float = 0.5,
    fisher_examples: int = 128,
    incomplete: str = "adaptive",
    aggregation: str = "weighted",
) -> seam.Algorithm:
    """EFL with elastic weight λ = ``elastic`` (module docstring); compression is applied around it."""
    if elastic < 0:
        raise ValueError(f"elastic (λ) must be >= 0, got {elastic}")
    if fisher_examples < 1:
        raise ValueError(f"fisher_examples must be >= 1, got {fisher_examples}")
    if incomplete not in ("adaptive", "plain", "drop"):
        raise ValueError(f"incomplete must be adaptive, plain or drop; got {incomplete!r}")
    check_aggregation(aggregation)
    uses_fisher = elastic > 0

    def server_init(initial_params: torch.Tensor) -> ServerState:
        zeros = torch.zeros_like(initial_params)
        return ServerState(initial_params, server_optimizer.init(initial_params), zeros, zeros)

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        zeros = torch.zeros_like(initial_params)
        return ClientState(zeros, zeros)

    def client_objective(view: ClientView, client: ClientState, context: seam.ClientContext) -> seam.GradientCorrection:
        if not uses_fisher:
            return seam.NO_CORRECTION
        # λ(U⊙θ − V) = λU ⊙ (θ − V/U): the whole elastic term is a quadratic pull towards the
        # Fisher-weighted mean of the reported models, so clipping leaves it alone (algorithms.md).
        # Where U = 0 every u_i is 0, so V = 0 too and the coordinate has no pull.
        fisher_sum = view.fisher_sum
        reference = torch.where(
            fisher_sum > 0, view.weighted_model_sum / torch.where(fisher_sum > 0, fisher_sum, 1.0), 0.0
        )
        return seam.GradientCorrection(quadratic=elastic * fisher_sum, reference=reference)

    def client_finish(view: ClientView, client: ClientState, context: seam.ClientContext, update: seam.ClientUpdate):
        if context.is_incomplete and incomplete == "drop":
            return client, None
        completed = update.steps_done / context.planned_steps
        if not uses_fisher:
            return client, ClientMessage(
                update.final_params, None, None, context.num_samples, context.multiplicity, completed
            )
        if update.computation is None:
            raise RuntimeError(
                "EFL needs the client's data for its Fisher pass; the training backend gave no ClientComputation"
            )
        local_model = update.trained_params
        fisher = update.computation.diagonal_fisher(local_model, fisher_examples)
        new_state = ClientState(fisher, fisher * local_model)
        message = ClientMessage(
            update.final_params,
            new_state.fisher - client.fisher,
            new_state.weighted_model - client.weighted_model,
            context.num_samples,
            context.multiplicity,
            completed,
        )
        return new_state, message

    def aggregation_start(server: ServerState, context: seam.RoundContext) -> RoundSums:
        relative = context.mean_denominator is not None
        return RoundSums(RunningMean(), None, server.params, server.fisher_sum, server.weighted_model_sum, relative)

    def aggregation_add(sums: RoundSums, message: ClientMessage) -> RoundSums:
        weight = client_weight(message.num_samples, message.multiplicity, aggregation)
        extra = sums.incomplete_extra
        if incomplete == "adaptive" and message.completed_fraction < 1.0:
            # p_k − w_k = w_k (E/s_k − 1) for incomplete clients; zero (and skipped) for complete ones
            term = weight * (1.0 / message.completed_fraction - 1.0) * (message.params - sums.start_params)
            extra = term if extra is None else extra + term
        fisher_sum, weighted_model_sum = sums.fisher_sum, sums.weighted_model_sum
        if uses_fisher:
            fisher_sum = fisher_sum + message.fisher_change
            weighted_model_sum = weighted_model_sum + message.weighted_model_change
        model = message.params - sums.start_params if sums.relative else message.params
        client_models = sums.client_models.add(model, weight)
        return RoundSums(client_models, extra, sums.start_params, fisher_sum, weighted_model_sum, sums.relative)

    def aggregation_finish(server: ServerState, sums: RoundSums, context: seam.RoundContext):
        denominator = context.mean_denominator
        client_average = sums.client_models.value(denominator)
        if sums.relative:
            client_average = sums.start_params + client_average
        if sums.incomplete_extra is not None:
            weight = sums.client_models.weight if denominator is None else denominator
            client_average = client_average + sums.incomplete_extra / weight
        params, optimizer_state = server_step(server_optimizer, server, client_average, context)
        metrics = {"fisher_sum_norm": float(torch.linalg.vector_norm(sums.fisher_sum))} if uses_fisher else {}
        return ServerState(params, optimizer_state, sums.fisher_sum, sums.weighted_model_sum), metrics

    def broadcast(server: ServerState) -> ClientView:
        if not uses_fisher:
            return ClientView(server.params, None, None)
        return ClientView(server.params, server.fisher_sum, server.weighted_model_sum)

    refusal = release_reason(incomplete, aggregation)
    fold = seam.ServerFold(aggregation_start, aggregation_add, aggregation_finish)
    return seam.Algorithm(
        "efl",
        server_init,
        client_objective,
        client_finish,
        fold.server_update,
        broadcast,
        client_state_init=client_state_init,
        server_fold=fold,
        release=release_form(uses_fisher) if refusal is None else None,
        lacks=lacking(RELEASE_FORM, refusal) + lacking(ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON),
    )


def from_config(config: Config, server_optimizer: Any) -> seam.Algorithm:
    return build(server_optimizer, **options(config))
