"""Client-level differential privacy as a combinator: ``with_privacy(algorithm, settings)`` wraps any algorithm.

DP-FedAvg (McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private
Recurrent Language Models", ICLR 2018) generalised through the seam: an
algorithm says what a message reveals (``seam.ReleaseForm``: the flat vector
``x_k = release(view, m_k)``, e.g. FedAvg's ``θ_k − θ^{t−1}``, SCAFFOLD's
``cat(Δy_k, Δc_k)`` as DP-SCAFFOLD clips it: Noble, Bellet and Dieuleveut,
"Differentially Private Federated Learning on Heterogeneous Data", AISTATS
2022), and promises that its fold is linear in the released vectors with unit
weight per message.  Round t, clip norm C_t, noise multiplier z::

    client k:  x_k = release(view, m_k)
               x̂_k = x_k · min(1, C_t / ‖x_k‖)                       (clipping: ‖x̂_k‖ ≤ C_t)
               x̂_k ← x̂_k + N(0, (z C_t)² I)                          (local noise only, from (seed, t, k))
    server:    x̂_k ← x̂_k · min(1, C_t / ‖x̂_k‖)   when ‖x̂_k‖ > C_t (1 + 1e-5)   (the server enforces the bound)
               S   = ξ + Σ_P x̂_k,   ξ ~ N(0, σ² I),  σ = z C_t · m / M     (central noise, from (seed, t))
               the wrapped algorithm's update from S, its means over P divided by m = qN

``ξ`` reaches the algorithm's fold as a carrier message (``restore(view,
None, ξ)``) folded before any client's, and ``RoundContext.mean_denominator``
= m (the expected cohort, public) replaces the private |P| in its means, so
the sensitivity of the whole server update to one client's data is C_t and
the noise is scaled as the algorithm scales its aggregate (FedAvg's θ by
σ/m, SCAFFOLD's c by σ/N).  ``M`` is ``noise_cohort_size`` (pfl-research's:
noise calibrated as if the cohort were M; M = m without it).  A round in
which nobody reported still releases ξ (``ServerFold.finishes_empty``): the
model moves by the noise alone, so whether anyone took part is not revealed.
The noise is drawn on the CPU in the model's dtype from (seed, stream, round
[, client id]) only, then moved to the model's device, so runs repeat bit for
bit on every backend and a resumed run draws what an uninterrupted one does.

Adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy, "Differentially
Private Learning with Adaptive Clipping", NeurIPS 2021), geometric update::

    b_k = 1[‖x_k‖ ≤ C_t],   b̃ = clamp((Σ_P (b_k − ½) + N(0, σ_b²)) / m + ½, 0, 1),
    C_{t+1} = C_t · exp(−η_C (b̃ − γ))

(the count centred on ½, as their Algorithm 1 and tensorflow_privacy's
quantile estimator do, so that one client moves it by at most ½), with the update's multiplier z_Δ = (z^−2 − (2σ_b)^−2)^−1/2 in σ above
(``PrivacySettings.update_noise_multiplier``), so that the round is a
Gaussian mechanism of multiplier z.  C_t travels with the broadcast
(``PrivateClientView``) and b_k with the message (``PrivateMessage``); without
adaptive clipping neither is wrapped, so the download bits and the wire codec
are the wrapped algorithm's own.

Local noise (``settings.noise = "local"``) protects each message from the
server itself: the server cannot clip a noised vector back without undoing
its noise, so it enforces no bound then (a forged node only spends its own
privacy), and it adds no central noise.  With ``clip = inf`` and ``z = 0`` the
wrapper computes nothing on the messages: a run is bit for bit the same as
without it.

Metrics of each round: ``privacy_clip`` (C_t; absent when C = ∞),
``privacy_noise_std`` (σ on the sum; with local noise, on each message),
``privacy_clipped_fraction`` (reporting clients whose vector was clipped,
their own bit with adaptive clipping, else those the server finds at the
bound; 0 in a round where nobody reported; absent with local noise, where the
server cannot tell; a diagnostic outside the guarantee) and, when
``settings.delta`` is set, ``privacy_epsilon`` (ε after t rounds from
``driftlab.privacy.accounting.run_epsilon``; absent while it is infinite,
z = 0: a report reads ∞ from ``privacy_noise_std`` = 0).  Opacus is imported
only then, so a run that accounts nothing needs no Opacus.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from driftlab.errors import ConfigError
from driftlab.features import drivers
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, RELEASE_FORM, Lack, Reason, algorithm_key, refusal
from driftlab.features.wrapping import Wrapping
from driftlab.privacy.settings import PrivacySettings
from driftlab.randomness import Stream, generator, seeded_torch_generator
from driftlab.simulation.seam import (
    Algorithm,
    ClientContext,
    ClientUpdate,
    MessageCodec,
    Personalization,
    ReleaseForm,
    RoundContext,
    ServerFold,
)

# The server rescales a vector only beyond C (1 + 1e-5): a vector its client clipped to C has a norm of C up to
# rounding (its release recomputed from the view, the norm in the model's dtype), and rescaling it again would
# change an honest message for nothing.
SERVER_TOLERANCE = 1e-5

PRIVATE_ALREADY = "the algorithm is private already"
PRIVATE_ALREADY_LACK = Lack(RELEASE_FORM, Reason(PRIVATE_ALREADY))

# Why FedBuff refuses a private algorithm (its asynchronous rule's Lack), whatever the wrapped one declares.
ASYNCHRONOUS_REASON = Reason(
    why=(
        "client-level DP's accounting composes rounds in which every registered client takes part independently "
        "with probability q, with means over the expected cohort qN; FedBuff dispatches clients one at a time "
        "from the idle ones and averages buffers of B arrivals, which that accounting does not cover"
    ),
    fix=("remove [privacy] or [asynchronous]"),
)


def no_form_refusal(name: str) -> str:
    """The refusal of an algorithm (a plugin's, typically) that gives neither a form nor a reason of its own."""
    return refusal(drivers.PRIVACY.key, algorithm_key(name), dict(drivers.PRIVACY.needs)[RELEASE_FORM])


def asynchronous_lack(algorithm: Algorithm) -> Lack:
    """The private ``algorithm``'s lack of an asynchronous rule: privacy's reason, then the wrapped algorithm's own."""
    return Lack(ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON.then(algorithm.refusal_reason(drivers.ASYNCHRONOUS)))


@dataclass(frozen=True)
class PrivateServerState(Wrapping):
    """The wrapped algorithm's server state, the clip norm C_t of the coming round and the length D of a released
    vector (the size of the central noise; 0 when the run adds none)."""

    clip: float
    dimension: int


@dataclass(frozen=True)
class PrivateClientView(Wrapping):
    """With adaptive clipping: the wrapped algorithm's view and the round's clip norm C_t (a number: no bits)."""

    clip: float


@dataclass(frozen=True)
class PrivateMessage:
    """With adaptive clipping: the wrapped algorithm's message (clipped) and b_k = 1[‖x_k‖ ≤ C_t] before clipping."""

    payload: Any
    within_clip: bool


@dataclass(frozen=True)
class PrivateSums:
    """A private round's accumulator: the wrapped fold's, and what the privacy metrics and the clip update need."""

    inner: Any
    view: Any  # the wrapped algorithm's view of the round: what released vectors are measured from
    clip: float  # C_t
    reporting: int = 0
    within: int = 0  # Σ_P b_k
    carried: bool = False  # the noise carrier was folded


class _NoComputation:
    """``seam.ClientComputation`` of a client without data (``released_dimension``'s): a zero Fisher."""

    def diagonal_fisher(self, params: torch.Tensor, max_examples: int) -> torch.Tensor:  # noqa: ARG002
        return torch.zeros_like(params)

    def full_gradient(self, params: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(params)


def released_dimension(algorithm: Algorithm, form: ReleaseForm, view: Any) -> int:
    """D, the length of what a message of ``algorithm`` reveals: the form's ``size(view)``, or else its release of the
    message a client that did not move would send (as the deployment plans messages).  The central noise needs it
    before any client reports."""
    if form.size is not None:
        return int(form.size(view))
    params = view.params
    state = algorithm.client_state_init(params) if algorithm.client_state_init is not None else None
    context = ClientContext(
        client_id=0, round=1, num_samples=1, mean_num_samples=1.0, num_registered=1, planned_steps=1, client_lr=1.0
    )
    _, message = algorithm.client_finish(view, state, context, ClientUpdate(params, params, 1, _NoComputation()))
    if message is None:
        raise ConfigError(
            f"algorithm {algorithm.name!r} sends no message for a client that did one local step, so the length of "
            "its released vector (the size of the central noise) is unknown; its client_finish must send one"
        )
    return int(form.release(view, message).numel())


def norm(vector: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(vector))


def clipped(form: ReleaseForm, view: Any, message: Any, clip: float) -> tuple[Any, float]:
    """``message`` with its released vector clipped to norm ``clip`` (the same object when it is within), and the
    vector's norm before."""
    size = norm(form.release(view, message))
    if size > clip:
        return form.scale(view, message, clip / size), size
    return message, size


def noise(
    std: float, size: int, like: torch.Tensor, stream: Stream, seed: int, round_index: int, client_id: int = -1
) -> torch.Tensor:
    """N(0, std² I) of length ``size`` from (seed, stream, round, client id), drawn on the CPU in ``like``'s dtype
    (the same numbers whatever the device), then moved to ``like``'s device."""
    draws = torch.randn(size, generator=seeded_torch_generator(seed, stream, round_index, client_id), dtype=like.dtype)
    return (draws * std).to(like.device)


def count_noise(settings: PrivacySettings, round_index: int) -> float:
    """The noise N(0, σ_b²) on round ``round_index``'s count Σ_P b_k (adaptive clipping), from (seed, round)."""
    adaptive = settings.adaptive
    return (
        float(generator(settings.seed, Stream.PRIVACY_CLIP_COUNT, round_index).standard_normal()) * adaptive.count_noise
    )


def next_clip(settings: PrivacySettings, clip: float, within: int, reporting: int, round_index: int) -> float:
    """C_{t+1} = C_t exp(−η_C (b̃ − γ)), b̃ = clamp((Σ_P (b_k − ½) + N(0, σ_b²)) / m + ½, 0, 1) (Andrew et al. 2021,
    geometric update).  Each term b_k − ½ is ±½, so adding or removing a client moves the sum by at most ½: the
    count's multiplier is 2σ_b, which ``PrivacySettings.update_noise_multiplier`` composes with the update's."""
    adaptive = settings.adaptive
    centred = within - reporting / 2 + count_noise(settings, round_index)
    fraction = min(1.0, max(0.0, centred / settings.expected_cohort + 0.5))
    return clip * math.exp(-adaptive.learning_rate * (fraction - adaptive.target_quantile))


def check_private(algorithm: Algorithm, settings: PrivacySettings) -> ReleaseForm:
    """The algorithm's form, or a ConfigError saying why it has none and what to change."""
    if algorithm.release is None:
        raise ConfigError(algorithm.refusal(drivers.PRIVACY) or no_form_refusal(algorithm.name))
    if settings.noised and not math.isfinite(settings.clip):
        raise ConfigError(
            f"privacy noise (noise_multiplier {settings.noise_multiplier}) is calibrated to the clip norm, and the "
            "clip is infinite: set privacy.clip to a finite norm, or privacy.noise_multiplier = 0"
        )
    try:
        settings.update_noise_multiplier  # noqa: B018 - raises when adaptive clipping's count noise leaves none
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if settings.adaptive is not None and settings.noise == "local":
        raise ConfigError(
            "adaptive clipping noises the count of unclipped clients at the server, which local noise does not trust: "
            'set privacy.noise = "central", or privacy.adaptive = false'
        )
    return algorithm.release


def with_privacy(algorithm: Algorithm, settings: PrivacySettings) -> Algorithm:
    """``algorithm`` with client-level DP (module docstring): clipped messages, seeded noise, ε in its metrics.

    Wrap compression inside: ``with_privacy(with_compression(algorithm, ...), settings)``.  ConfigError, before
    any work, for an algorithm (or configuration) without a ``ReleaseForm``, naming the fix.
    """
    problem = algorithm.refusal(drivers.PRIVACY)  # a first phase, no form, or a view per client
    if problem is not None:
        raise ConfigError(problem)
    form = check_private(algorithm, settings)
    adaptive = settings.adaptive is not None
    local = settings.noise == "local" and settings.noised
    central = settings.noise == "central" and settings.noised
    inner_fold = algorithm.fold()
    seed = settings.seed

    def server_init(initial_params: torch.Tensor) -> PrivateServerState:
        inner = algorithm.server_init(initial_params)
        dimension = released_dimension(algorithm, form, algorithm.broadcast(inner)) if central else 0
        return PrivateServerState(inner, float(settings.clip), dimension)

    def broadcast(server: PrivateServerState) -> Any:
        inner = algorithm.broadcast(server.inner)
        return PrivateClientView(inner, server.clip) if adaptive else inner

    def client_objective(view: Any, client: Any, context: ClientContext) -> Any:
        return algorithm.client_objective(view.inner if adaptive else view, client, context)

    def client_finish(view: Any, client: Any, context: ClientContext, update: ClientUpdate) -> tuple[Any, Any]:
        inner_view, clip = (view.inner, view.clip) if adaptive else (view, settings.clip)
        state, message = algorithm.client_finish(inner_view, client, context, update)
        if message is None:
            return state, None
        size = 0.0
        if math.isfinite(clip):
            message, size = clipped(form, inner_view, message, clip)
        if local:
            released = form.release(inner_view, message)
            std = settings.update_noise_multiplier * clip
            draws = noise(
                std, released.numel(), released, Stream.PRIVACY_LOCAL_NOISE, seed, context.round, context.client_id
            )
            message = form.restore(inner_view, message, released + draws)
        return state, PrivateMessage(message, size <= clip) if adaptive else message

    def start(server: PrivateServerState, context: RoundContext) -> PrivateSums:
        inner_context = private_context(context)
        view = algorithm.broadcast(server.inner)
        sums = PrivateSums(inner_fold.start(server.inner, inner_context), view, server.clip)
        if not central:
            return sums
        xi = noise(
            settings.sum_noise_std(server.clip),
            server.dimension,
            server.params,
            Stream.PRIVACY_NOISE,
            seed,
            context.round,
        )
        return dataclasses.replace(sums, inner=inner_fold.add(sums.inner, form.restore(view, None, xi)), carried=True)

    def add(sums: PrivateSums, message: Any) -> PrivateSums:
        payload, within = (message.payload, bool(message.within_clip)) if adaptive else (message, True)
        if math.isfinite(sums.clip) and not local:
            size = norm(form.release(sums.view, payload))
            if size > sums.clip * (1 + SERVER_TOLERANCE):  # what arrives is bounded whatever its node did
                payload = form.scale(sums.view, payload, sums.clip / size)
            if not adaptive:
                within = size < sums.clip * (1 - SERVER_TOLERANCE)  # at the bound: clipped, by its client or here
        return dataclasses.replace(
            sums,
            inner=inner_fold.add(sums.inner, payload),
            reporting=sums.reporting + 1,
            within=sums.within + int(within),
        )

    def finish(server: PrivateServerState, sums: PrivateSums, context: RoundContext) -> tuple[PrivateServerState, dict]:
        if sums.reporting or sums.carried:
            inner, metrics = inner_fold.finish(server.inner, sums.inner, private_context(context))
        else:
            inner, metrics = server.inner, {}
        clip = next_clip(settings, server.clip, sums.within, sums.reporting, context.round) if adaptive else server.clip
        metrics = {**metrics, **privacy_metrics(settings, sums, context.round, local)}
        return PrivateServerState(inner, clip, server.dimension), metrics

    def private_context(context: RoundContext) -> RoundContext:
        # Central noise: the number that reported is private, so means divide by the public expected cohort m.
        return dataclasses.replace(context, mean_denominator=settings.expected_cohort) if central else context

    def membership_hook(hook: Any) -> Any:
        if hook is None:
            return None
        return lambda server, client: dataclasses.replace(server, inner=hook(server.inner, client))

    fold = ServerFold(start, add, finish, finishes_empty=True)
    # Every field not named here (the name, the client state, the plugin, fields added later) is the wrapped one's.
    return dataclasses.replace(
        algorithm,
        server_init=server_init,
        client_objective=client_objective,
        client_finish=client_finish,
        server_update=fold.server_update,
        broadcast=broadcast,
        client_joined=membership_hook(algorithm.client_joined),
        client_left=membership_hook(algorithm.client_left),
        server_fold=fold,
        codec=private_codec(algorithm.codec) if adaptive else algorithm.codec,
        release=None,
        asynchronous=False,
        lacks=(PRIVATE_ALREADY_LACK, asynchronous_lack(algorithm)),
        personalization=private_personalization(algorithm.personalization, adaptive),
    )


def private_personalization(inner: Personalization | None, adaptive: bool) -> Personalization | None:
    """The wrapped algorithm's personal models (they never leave the client, so privacy leaves them as they are), read
    through the adaptive clip's view."""
    if inner is None or not adaptive:
        return inner
    return Personalization(lambda view, client: inner.model(view.inner, client), inner.description)


def privacy_metrics(settings: PrivacySettings, sums: PrivateSums, round_index: int, local: bool) -> dict[str, float]:
    """A round's ``privacy_*`` metrics (module docstring); every value finite."""
    metrics: dict[str, float] = {}
    if math.isfinite(sums.clip):
        metrics["privacy_clip"] = float(sums.clip)
    if not settings.noised:
        metrics["privacy_noise_std"] = 0.0
    elif local:
        metrics["privacy_noise_std"] = float(settings.update_noise_multiplier * sums.clip)
    else:
        metrics["privacy_noise_std"] = float(settings.sum_noise_std(sums.clip))
    if not local:
        metrics["privacy_clipped_fraction"] = (sums.reporting - sums.within) / sums.reporting if sums.reporting else 0.0
    if settings.delta is not None:
        from driftlab.privacy.accounting import run_epsilon  # here: only an accounted run needs Opacus

        epsilon = run_epsilon(settings, round_index)
        if epsilon is not None and math.isfinite(epsilon):
            metrics["privacy_epsilon"] = float(epsilon)
    return metrics


def private_codec(inner: MessageCodec) -> MessageCodec:
    """How a ``PrivateMessage`` travels: its payload through the wrapped algorithm's codec, its bit b_k beside it.

    b_k is not compared with the planned message (a client that did not move is within any clip): it is a bit,
    its weight in the count is at most 1 whatever its node says, and the count is noised.  The wrapped codec's
    unplanned fields sit under ``payload/``.
    """

    def to_wire(message: PrivateMessage) -> PrivateMessage:
        return PrivateMessage(inner.to_wire(message.payload), message.within_clip)

    def from_wire(sent: Any, start_params: torch.Tensor) -> PrivateMessage:
        if not isinstance(sent, PrivateMessage):
            raise ValueError(
                f"private message does not fit: a {type(sent).__name__} arrived, a PrivateMessage was expected"
            )
        if type(sent.within_clip) is not bool:
            raise ValueError(f"private message does not fit: its within_clip is {sent.within_clip!r}, not a bool")
        return PrivateMessage(inner.from_wire(sent.payload, start_params), sent.within_clip)

    return MessageCodec(to_wire, from_wire, ("within_clip", *(f"payload/{name}" for name in inner.unplanned)))
