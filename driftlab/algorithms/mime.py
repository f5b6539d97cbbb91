"""MimeLite and Mime with SGD and momentum (Karimireddy, Jaggi, Kale, Mohri, Reddi, Stich and Suresh, "Breaking the
centralized barrier for cross-device federated learning", NeurIPS 2021; arXiv 2008.03606, Algorithm 1), as
docs/update-rules.md "MimeLite" and "Mime" state them.

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

Mime (``algorithm.name = "mime"``, the same paper's Algorithm 1 with its control variate) adds an SVRG correction on
the step's own minibatch ζ, in the same ``sgdm`` form::

    client k:  K steps of  y ← y − η_l (∇f_k(y; ζ) − ∇f_k(x̃; ζ) + c + β m)
               → LocalObjective(GradientCorrection(linear = c + β m), LossTerm(−⟨θ, ∇f_k(x̃; ζ)⟩))
    server:    as MimeLite, and then  c ← ḡ,  x̃ ← x  (the model the round's gradients ḡ were taken at)

The paper's control variate (``control_variate = "current"``, the default) is ``c = (1/|S|) Σ_{j∈S} ∇f_j(x)``, the
mean full-batch gradient of this round's cohort at this round's ``x``, with the SVRG snapshot ``x̃ = x``; it is known
before local training only through a first communication phase inside the round (FedJAX's ``mime`` computes it in a
first pass over the cohort).  The engine runs that phase (``seam.RoundPrelude``): every client with work computes
``∇f_k(x)``, the server applies ``c = Σ r_k ∇f_k(x) / Σ r_k`` (r_k as for ȳ) and broadcasts ``x`` and ``c + β m``;
the clients step ``y ← y − η_l (∇f_k(y; ζ) − ∇f_k(x; ζ) + c + β m)`` and send ``y_k``; the server averages them and
moves ``m⁺ = β m + c`` with the same ``c``.  Up: ``∇f_k(x)`` in the first phase and ``y_k`` (two models); down ``x``
and ``c + β m`` (two models).  The first phase is a synchronisation the simulator has and a deployment does not, its
uploads are neither compressed nor clipped: compression, ``[privacy]``, ``[system]`` and deployments refuse it.

``control_variate = "previous"`` runs everywhere with one phase: the snapshot is the previous reporting round's model ``x̃ = x_{t−1}`` and
``c = ḡ_{t−1}`` its clients' mean full-batch gradient there: the statistic MimeLite already collects, a deviation like
SCAFFOLD's control variate from the previous visit.  Snapshot and ``c`` are taken at the same model, so the step is
still an unbiased estimate of the population gradient at ``y`` (over clients and minibatches), as the paper's;
its variance grows with ``‖y − x_{t−1}‖`` instead of ``‖y − x_t‖``.  (``c`` from ``x_{t−1}`` with the snapshot at
``x_t`` would be biased by ``∇F(x_{t−1}) − ∇F(x_t)``, which blew up the MLP in round 2 of vectorized_test's run.)
The momentum rule is the paper's exactly: ``m`` moves with ``ḡ_t`` at ``x_t``.  With one local step and every client
(full-batch gradients) the round is the centralized heavy ball, ``x⁺ = x − η (∇F(x) + β m)``, as the paper's Mime.
Before a snapshot exists (round 1, or until some client reports) the step has no control variate and Mime is
MimeLite (``m = 0``: FedAvg).  The client uses ``c`` and ``m`` only as ``c + β m``, so the server sends that sum.  The
term ``−⟨θ, ∇f_k(x̃; ζ)⟩`` has gradient ``−∇f_k(x̃; ζ)`` (``x̃`` is a constant of the step), a second gradient per
local step, as the paper's Mime.

Mime's communication: down ``x``, ``x̃`` and ``c + β m`` (three models, as the paper's ``x``, ``m``, ``c``; in round 1
``x̃ = x`` and ``β m = 0`` travel unused, so the view keeps one shape), up ``y_k`` and ``g_k`` (two models, also when
β = 0: ``g_k`` is ``c``'s input); the paper's in-round gradient phase (one more upload and download of a model's
size, and a synchronisation) is not there.

Example:
    >>> from driftlab.algorithms import mime
    >>> from driftlab.optim.server import make_server_optimizer
    >>> mime.build(make_server_optimizer("sgd"), momentum=0.9).name
    'mimelite'
    >>> mime.build(make_server_optimizer("sgd"), momentum=0.9, control_variate=True).name
    'mime'
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from pydantic import Field

from driftlab.algorithms.aggregation import (
    ModelSums,
    RunningMean,
    averaging_parts,
    check_aggregation,
    client_weight,
    model_sums,
    server_step,
)
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, options
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, RELEASE_FORM, Reason, lacking, synchronous_only
from driftlab.simulation import seam
from driftlab.simulation.backends.objectives import LocalBatch, LocalObjective, LossTerm

MISSING_FULL_GRADIENT = (
    "MimeLite with momentum > 0 needs each client's full-batch gradient at the round's model, "
    "ClientUpdate.computation.full_gradient(params), and this client update carries no computation on the client's "
    "data: train it through driftlab.simulation.round.client (every backend and deployment does), or set "
    "algorithm.momentum = 0 (FedAvg)"
)
MIME_MISSING_FULL_GRADIENT = (
    "Mime needs each client's full-batch gradient at the round's model (the next round's control variate c), "
    "ClientUpdate.computation.full_gradient(params), and this client update carries no computation on the client's "
    "data: train it through driftlab.simulation.round.client (every backend and deployment does)"
)

# Why FedBuff cannot run MimeLite (Algorithm.asynchronous_refusal; docs/algorithms.md, "Asynchronous").
ASYNCHRONOUS_REASON = synchronous_only(
    "mimelite",
    why=(
        "MimeLite moves the server momentum with the clients' full-batch gradients at the model the round "
        "broadcast, and every local step applies that momentum: FedBuff's stale clients report gradients at "
        "older models and trained with an older momentum, and no asynchronous Mime rule is published (the "
        "paper's analysis is synchronous)"
    ),
)


CURRENT_RELEASE_REASON = Reason(
    why=(
        "Mime with the paper's control variate uploads each client's full-batch gradient in a first phase of the "
        "round (Algorithm.prelude), outside the round's one message whose vector a release form names, so a feature "
        "that works on the released vectors would leave that upload as it is (client-level DP unclipped and "
        "unnoised, a robust rule or an attack untouched)"
    ),
    fix=(
        'set algorithm.control_variate = "previous" (one phase: its messages carry the gradients in their released '
        'vector; aggregation = "uniform"), or remove the feature'
    ),
)
MIME_ASYNCHRONOUS_REASON = synchronous_only(
    "mime",
    why=(
        "Mime corrects every local step with the control variate c and the gradient at the model the round "
        "broadcast, and moves c and the server momentum with the clients' full-batch gradients at that model: "
        "FedBuff's stale clients report gradients at older models, and no asynchronous Mime rule is published "
        "(the paper's analysis is synchronous)"
    ),
)


def momentum_field(local_step: str) -> Any:
    """Both variants' ``momentum`` key: β in [0, 1), 0.9 unless set, described with the variant's ``local_step``."""
    return Field(0.9, ge=0, lt=1, description=f"β in [0, 1): m ← β m + mean ∇f_k(x), local step {local_step}")


class Config(AlgorithmConfig):
    """``[algorithm]`` section for MimeLite (SGD with momentum); ``η_g`` is ``[server] lr`` (server.optimizer = "sgd")."""

    name: Literal["mimelite"] = "mimelite"
    momentum: float = momentum_field("y ← y − η_l(∇f_k(y; ζ) + β m); 0 is FedAvg")
    aggregation: Aggregation = Field(
        "weighted", description="r_k for both means: n_k (default, TFF's and FedJAX's) or 1 (the paper's 1/|S|)"
    )


class MimeConfig(AlgorithmConfig):
    """``[algorithm]`` section for Mime (SGD with momentum and the control variate c); ``η_g`` is ``[server] lr``."""

    name: Literal["mime"] = "mime"
    control_variate: Literal["current", "previous"] = Field(
        "current",
        description="c and the snapshot x̃: 'current' (the paper's) = this round's clients' mean full-batch gradient at this "
        "round's x, gathered in a first phase of the round before local training (simulation only: no compression, "
        "privacy, [system] or deployment); 'previous' = the last reporting round's, at its model (one phase, runs everywhere)",
    )
    momentum: float = momentum_field("y ← y − η_l(∇f_k(y; ζ) − ∇f_k(x; ζ) + c + β m)")
    aggregation: Aggregation = Field(
        "weighted",
        description="r_k for the means of y_k and ∇f_k(x): n_k (default, FedJAX's mime) or 1 (the paper's 1/|S|)",
    )


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # x
    momentum: torch.Tensor  # m, the server optimizer's statistic, frozen during local steps
    optimizer_state: Any  # the server SGD's (stateless) state, for the x-update
    # Mime's control variate c and SVRG snapshot x̃: the last reporting round's mean full-batch gradient and the model it
    # was taken at; None before such a round (and always in MimeLite).
    control_variate: torch.Tensor | None = None
    snapshot: torch.Tensor | None = None


@dataclass(frozen=True)
class ClientView:
    """What the server sends a selected client: x, and m (None when β = 0: not sent)."""

    params: torch.Tensor
    momentum: torch.Tensor | None


@dataclass(frozen=True)
class MimeView:
    """What Mime's server sends a selected client: x, the snapshot x̃ and the constant of every local step ``c + β m``.

    ``controlled`` is False before a snapshot exists (round 1): then ``snapshot`` is x and ``correction`` is ``β m = 0``,
    sent but unused, so that the view has the same shape every round (a deployment's wire decodes it against round
    1's view)."""

    params: torch.Tensor
    snapshot: torch.Tensor
    correction: torch.Tensor
    controlled: bool


@dataclass(frozen=True)
class ClientMessage:
    params: torch.Tensor  # y_k
    gradient: torch.Tensor | None  # g_k = ∇f_k(x) (None when β = 0: not sent)
    num_samples: int
    multiplicity: int


@dataclass(frozen=True)
class RoundSums:
    """``Σ_P r_k y_k`` (or ``Σ_P r_k (y_k − x)`` in a private round) and ``Σ_P r_k g_k``, with the same weights."""

    models: ModelSums
    gradients: RunningMean


def start_round_sums(server: ServerState, context: seam.RoundContext) -> RoundSums:
    """The empty sums of a MimeLite (or one-phase Mime) round: of the y_k (of y_k − x in a private round) and the g_k."""
    return RoundSums(model_sums(server.params, context), RunningMean())


def add_to_round_sums(sums: RoundSums, message: ClientMessage, aggregation: str) -> RoundSums:
    """``sums`` with ``message``'s y_k and g_k (when sent: MimeLite at β = 0 sends none) at weight r_k."""
    weight = client_weight(message.num_samples, message.multiplicity, aggregation)
    gradients = sums.gradients.add(message.gradient, weight) if message.gradient is not None else sums.gradients
    return RoundSums(sums.models.add(message.params, weight), gradients)


def full_batch_gradient(update: seam.ClientUpdate, missing: str = MISSING_FULL_GRADIENT) -> torch.Tensor:
    """``∇f_k(x)`` at the round's start model, from the client's own data (``missing`` if no hook)."""
    if update.computation is None:
        raise RuntimeError(missing)
    return update.computation.full_gradient(update.start_params)


def minus_snapshot_gradient(batch: LocalBatch, snapshot: torch.Tensor) -> torch.Tensor:
    """Mime's control-variate term ``−⟨θ, ∇f_k(x̃; ζ)⟩`` with ``∇f_k(x̃; ζ) = ∇ Σ_i w_i ℓ(model(x̃; ξ_i), y_i)``, the
    step's own minibatch ζ (its weights, so padding counts for nothing) at the snapshot ``x̃``.

    ``x̃`` does not depend on θ, so the term's gradient is exactly ``−∇f_k(x̃; ζ)``: added to the loss gradient it gives
    Mime's ``∇f_k(y; ζ) − ∇f_k(x̃; ζ)``.  A nested ``torch.func.grad``, so both backends (``vmap`` over clients)
    differentiate it alike.  Its value is a weighted batch mean, so it also has an exact full-data value."""
    if batch.example_loss is None:
        raise ValueError("Mime's control-variate term needs the model's loss: LocalBatch.example_loss is None")

    def snapshot_loss(point: torch.Tensor) -> torch.Tensor:
        losses = batch.example_loss(batch.forward(point, batch.inputs), batch.targets)
        return (losses.to(batch.weights.dtype) * batch.weights).sum()

    return -(batch.params * torch.func.grad(snapshot_loss)(snapshot)).sum()


def server_init_of(server_optimizer: Any) -> Callable[[torch.Tensor], ServerState]:
    """Every variant's ``server_init``: x⁰, m = 0 and ``server_optimizer``'s initial state (no c, no snapshot)."""

    def server_init(initial_params: torch.Tensor) -> ServerState:
        return ServerState(initial_params, torch.zeros_like(initial_params), server_optimizer.init(initial_params))

    return server_init


def one_phase_parts(
    aggregation: str, finish: Callable[..., Any], form: seam.ReleaseForm, asynchronous_reason: Reason
) -> dict[str, Any]:
    """The ``Algorithm`` fields MimeLite and Mime with the previous round's c share: the fold of their messages' y_k and
    g_k at weights r_k into ``finish`` (``averaging_parts``: their form under uniform aggregation) and their
    asynchronous lack."""
    fold = seam.ServerFold(start_round_sums, functools.partial(add_to_round_sums, aggregation=aggregation), finish)
    return averaging_parts(aggregation, fold, form, *lacking(ASYNCHRONOUS_RULE, asynchronous_reason))


def release_form(uses_momentum: bool) -> seam.ReleaseForm:
    """MimeLite's ``ReleaseForm``: a message releases ``cat(y_k − x, g_k)`` (``y_k − x`` alone when β = 0); the
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

    return seam.ReleaseForm(release, restore, size=size)


def build(
    server_optimizer: Any, momentum: float = 0.9, aggregation: str = "weighted", control_variate: bool | str = False
) -> seam.Algorithm:
    """MimeLite (``control_variate=False``) or Mime (named "mime") with momentum β = ``momentum``, whose x-update
    applies ``server_optimizer`` (SGD) to ``x − ȳ``: ``control_variate="current"`` the paper's in-round c
    (``RoundPrelude``), ``"previous"`` (or True) c and x̃ of the last reporting round."""
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum (β) must be in [0, 1), got {momentum}")
    check_aggregation(aggregation)
    if control_variate == "current":
        return _build_mime_current(server_optimizer, momentum, aggregation)
    if control_variate not in (False, True, "previous"):
        raise ValueError(
            f'control_variate must be False (MimeLite), "current" or "previous" (Mime), got {control_variate!r}'
        )
    if control_variate:
        return _build_mime(server_optimizer, momentum, aggregation)
    uses_momentum = momentum > 0

    def client_objective(view: ClientView, client_state: None, context: seam.ClientContext) -> seam.GradientCorrection:
        if not uses_momentum:
            return seam.NO_CORRECTION
        return seam.GradientCorrection(linear=momentum * view.momentum)

    def client_finish(
        view: ClientView, client_state: None, context: seam.ClientContext, update: seam.ClientUpdate
    ) -> tuple[None, ClientMessage]:
        gradient = full_batch_gradient(update) if uses_momentum else None
        return None, ClientMessage(update.final_params, gradient, context.num_samples, context.multiplicity)

    def aggregation_finish(
        server: ServerState, sums: RoundSums, context: seam.RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        client_average = sums.models.value(context.mean_denominator)
        params, optimizer_state = server_step(server_optimizer, server, client_average, context)
        if not uses_momentum:
            return ServerState(params, server.momentum, optimizer_state), {}
        # The statistic moves with the full-batch gradients at x, never with the model change x − ȳ.
        new_momentum = momentum * server.momentum + sums.gradients.value(context.mean_denominator)
        return ServerState(params, new_momentum, optimizer_state), {
            "momentum_norm": float(torch.linalg.vector_norm(new_momentum))
        }

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params, server.momentum if uses_momentum else None)

    parts = one_phase_parts(aggregation, aggregation_finish, release_form(uses_momentum), ASYNCHRONOUS_REASON)
    server_init = server_init_of(server_optimizer)
    return seam.Algorithm("mimelite", server_init, client_objective, client_finish, broadcast=broadcast, **parts)


def _build_mime(server_optimizer: Any, momentum: float, aggregation: str) -> seam.Algorithm:
    """Mime (module docstring): MimeLite's server and messages, plus c and the snapshot x̃ of the last reporting round."""
    uses_momentum = momentum > 0

    def broadcast(server: ServerState) -> MimeView:
        if server.snapshot is None:
            return MimeView(server.params, server.params, momentum * server.momentum, controlled=False)
        correction = server.control_variate + momentum * server.momentum if uses_momentum else server.control_variate
        return MimeView(server.params, server.snapshot, correction, controlled=True)

    def client_objective(
        view: MimeView, client_state: None, context: seam.ClientContext
    ) -> seam.GradientCorrection | LocalObjective:
        if not view.controlled:  # round 1: MimeLite's step (m = 0; β = 0: FedAvg's, without even adding the zeros)
            return seam.GradientCorrection(linear=view.correction) if uses_momentum else seam.NO_CORRECTION
        correction = seam.GradientCorrection(linear=view.correction)
        return LocalObjective(correction=correction, loss_term=LossTerm(minus_snapshot_gradient, (view.snapshot,)))

    def client_finish(
        view: MimeView, client_state: None, context: seam.ClientContext, update: seam.ClientUpdate
    ) -> tuple[None, ClientMessage]:
        gradient = full_batch_gradient(update, MIME_MISSING_FULL_GRADIENT)
        return None, ClientMessage(update.final_params, gradient, context.num_samples, context.multiplicity)

    def aggregation_finish(
        server: ServerState, sums: RoundSums, context: seam.RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        params, optimizer_state = server_step(
            server_optimizer, server, sums.models.value(context.mean_denominator), context
        )
        mean_gradient = sums.gradients.value(
            context.mean_denominator
        )  # ḡ at x: the momentum's input, and c at snapshot x
        metrics = {"control_variate_norm": float(torch.linalg.vector_norm(mean_gradient))}
        new_momentum = server.momentum
        if uses_momentum:
            new_momentum = momentum * server.momentum + mean_gradient
            metrics["momentum_norm"] = float(torch.linalg.vector_norm(new_momentum))
        return ServerState(params, new_momentum, optimizer_state, mean_gradient, server.params), metrics

    parts = one_phase_parts(aggregation, aggregation_finish, release_form(True), MIME_ASYNCHRONOUS_REASON)
    server_init = server_init_of(server_optimizer)
    return seam.Algorithm("mime", server_init, client_objective, client_finish, broadcast=broadcast, **parts)


@dataclass(frozen=True)
class MimeRoundView:
    """What the paper's Mime sends a selected client once the round's first phase is done: x (received in the first
    phase, to compute ∇f_k(x)) and ``c + β m`` (the second phase); the snapshot is x itself."""

    params: torch.Tensor
    correction: torch.Tensor


def _build_mime_current(server_optimizer: Any, momentum: float, aggregation: str) -> seam.Algorithm:
    """The paper's Mime (module docstring, "The paper's control variate"): a first phase gathers
    ``c = Σ r_k ∇f_k(x) / Σ r_k`` over the round's clients (``RoundPrelude``), who then train with the SVRG term at the
    snapshot ``x`` and ``c + β m``; the server averages the ``y_k`` and moves ``m`` with the same ``c``."""

    def broadcast(server: ServerState) -> MimeRoundView:
        # Before the first phase (its view is read for x only) c is the last round's, or absent in round 1.
        control = server.control_variate if server.control_variate is not None else torch.zeros_like(server.params)
        return MimeRoundView(server.params, control + momentum * server.momentum if momentum > 0 else control)

    def gradient_at_x(view: MimeRoundView, context: seam.ClientContext, computation: Any) -> torch.Tensor:
        if computation is None:
            raise RuntimeError(MIME_MISSING_FULL_GRADIENT)
        return computation.full_gradient(view.params)

    def weight(context: seam.ClientContext) -> float:
        return client_weight(context.num_samples, context.multiplicity, aggregation)

    def with_control_variate(server: ServerState, mean_gradient: torch.Tensor) -> ServerState:
        return ServerState(server.params, server.momentum, server.optimizer_state, mean_gradient, None)

    def client_objective(view: MimeRoundView, client_state: None, context: seam.ClientContext) -> LocalObjective:
        return LocalObjective(
            correction=seam.GradientCorrection(linear=view.correction),
            loss_term=LossTerm(minus_snapshot_gradient, (view.params,)),
        )

    def client_finish(
        view: MimeRoundView, client_state: None, context: seam.ClientContext, update: seam.ClientUpdate
    ) -> tuple[None, ClientMessage]:
        return None, ClientMessage(update.final_params, None, context.num_samples, context.multiplicity)

    def aggregation_start(server: ServerState, context: seam.RoundContext) -> RunningMean:
        return RunningMean()

    def aggregation_add(models: RunningMean, message: ClientMessage) -> RunningMean:
        return models.add(message.params, client_weight(message.num_samples, message.multiplicity, aggregation))

    def aggregation_finish(
        server: ServerState, models: RunningMean, context: seam.RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        params, optimizer_state = server_step(server_optimizer, server, models.value(), context)
        control = server.control_variate  # this round's c, at x: the momentum's input too
        metrics = {"control_variate_norm": float(torch.linalg.vector_norm(control))}
        new_momentum = server.momentum
        if momentum > 0:
            new_momentum = momentum * server.momentum + control
            metrics["momentum_norm"] = float(torch.linalg.vector_norm(new_momentum))
        return ServerState(params, new_momentum, optimizer_state, control, None), metrics

    fold = seam.ServerFold(aggregation_start, aggregation_add, aggregation_finish)
    return seam.Algorithm(
        "mime",
        server_init_of(server_optimizer),
        client_objective,
        client_finish,
        fold.server_update,
        broadcast,
        server_fold=fold,
        lacks=lacking(RELEASE_FORM, CURRENT_RELEASE_REASON) + lacking(ASYNCHRONOUS_RULE, MIME_ASYNCHRONOUS_REASON),
        prelude=seam.RoundPrelude(gradient_at_x, weight, with_control_variate),
    )


def from_config(config: Config, server_optimizer: Any) -> seam.Algorithm:
    return build(server_optimizer, **options(config))


def from_mime_config(config: MimeConfig, server_optimizer: Any) -> seam.Algorithm:
    return build(server_optimizer, **options(config))
