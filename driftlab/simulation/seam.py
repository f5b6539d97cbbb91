"""The seam between the engine (how clients run) and an algorithm (what they compute).

An algorithm is a frozen bundle of pure functions (``Algorithm`` below: a
name, five functions every algorithm gives and optional ones), built by
its module's ``build(...)``.  Each round the engine calls them in this order::

    server_state = algorithm.server_init(θ0)                       # once
    client_state = algorithm.client_state_init(θ0)                 # per client, on first use
    view         = algorithm.broadcast(server_state)               # what every selected client receives
    objective    = algorithm.client_objective(view, client_state, context)
    ... the backend runs local SGD on  f_k(θ) + the objective's terms  from view.params ...
    client_state, message = algorithm.client_finish(view, client_state, context, update)
    server_state, metrics = algorithm.server_update(server_state, messages, round_context)

An algorithm may also give its server update as a fold (``ServerFold``:
``start``, ``add`` per message in sample order, ``finish``); the engine then
folds each message in as its client finishes and lets go of it, so a round's
memory does not grow with its clients.  Its ``server_update`` is
``ServerFold.server_update``, the same fold over a list.

The client halves see the *client view* ``broadcast`` returns (a frozen
dataclass of the module, e.g. ``scaffold.ClientView(params, control)``), never
the server state: what a client may use is exactly what the server sends it,
and its size is the download traffic (``payload_bits(view)``).  Every view has
a ``params`` field, the model local training starts from.
``driftlab.simulation.round.client.run_client`` is the one client code path built on
these functions.

Every algorithm in algorithms.md changes the local objective by an affine
gradient correction ``∇ += a_k + D_k ⊙ (θ − θ_ref)`` (``GradientCorrection``,
the fast path); one whose local loss is not affine returns an
``objectives.LocalObjective`` (a loss term, a local step of its own).  What
``client_objective`` returns is the only thing an algorithm hands to a
training backend, which is why every backend (sequential, vectorized, a Flower
client) runs every algorithm and a new algorithm never touches the engine.

Personalized models (APFL, Ditto, FedAMP): an algorithm may keep a model of each
client's own in its client state and say how to read it (``Personalization``);
the evaluation then tests each client's own model on that client's own test
split beside the server model.  A client's extra local work on its own data
(Ditto's personal steps, APFL's mixed model) runs in ``client_finish`` through
``ClientUpdate.computation`` (``ClientComputation.train``, ``minibatches``), the
same code on every backend and on a deployment's node.  An algorithm may also
send each client a view of its own (``Algorithm.client_view``: FedAMP's cloud
model u_k); that client's local SGD then starts from its view's ``params``.

State is explicit: server and client states are frozen dataclasses of tensors
and numbers, returned anew, never mutated.  Client state lives in a store the
engine owns (``ClientStateStore``), never on the algorithm.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from driftlab.features import drivers
from driftlab.features.capabilities import (
    ASYNCHRONOUS_RULE,
    NO_MEMBERSHIP_HOOKS,
    ONE_PHASE,
    PERSONAL_MODELS,
    RELEASE_FORM,
    SHARED_VIEW,
    Lack,
    Reason,
    Requirements,
    algorithm_key,
    conflicts,
)


@dataclass(frozen=True)
class GradientCorrection:
    """``∇loss + linear`` is clipped (when clipping is on); then ``quadratic ⊙ (θ − reference)`` is added.

    ``linear`` and ``reference`` are flat ``[P]`` tensors; ``quadratic`` is a
    number or a ``[P]`` tensor.  ``None`` means the term is absent (not zero),
    so FedAvg's local step does no extra arithmetic.
    """

    linear: torch.Tensor | None = None
    quadratic: float | torch.Tensor | None = None
    reference: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.quadratic is None) != (self.reference is None):
            raise ValueError("a quadratic correction needs both `quadratic` and `reference`")


NO_CORRECTION = GradientCorrection()


@dataclass(frozen=True)
class ClientContext:
    """What an algorithm may know about one client in one round."""

    client_id: int
    round: int
    num_samples: int
    mean_num_samples: float  # n̄ over all registered clients (FedDyn's α_k = α n̄ / n_k)
    num_registered: int  # N = |S_t|
    planned_steps: int  # K (or E·⌈n_k/B⌉) this client was asked to do
    client_lr: float  # the round's client learning rate η_l
    multiplicity: int = 1  # times the client was drawn (sampling with replacement)
    available_steps: int | None = (
        None  # steps the client can do this round; fewer than planned for a straggler (None: all)
    )

    @property
    def is_incomplete(self) -> bool:
        """The availability model cut this client's work short (a straggler; not γ-inexact early stopping)."""
        return self.available_steps is not None and self.available_steps < self.planned_steps


class ClientComputation(Protocol):
    """Computations on a client's own data that an algorithm may ask for after local training."""

    def diagonal_fisher(self, params: torch.Tensor, max_examples: int) -> torch.Tensor:
        """Mean over (a seeded sample of at most ``max_examples`` of) the client's examples of the
        squared per-example gradient of the log-likelihood at ``params``: the diagonal empirical Fisher."""
        ...

    def full_gradient(self, params: torch.Tensor) -> torch.Tensor:
        """``∇f_k(params)``: the mean loss gradient over all of the client's examples (unaugmented; no weight decay,
        no clipping): MimeLite's server statistic (Karimireddy et al. 2021)."""
        ...

    def train(
        self, params: torch.Tensor, correction: Any, steps: int, purpose: str = "personal"
    ) -> tuple[torch.Tensor, int]:
        """Local SGD on the client's own data from ``params``, with the round's settings (η_l, weight decay,
        clipping, augmentation, precision) and ``correction`` (a ``GradientCorrection`` or an
        ``objectives.LocalObjective``), for ``steps`` steps; returns the final model and the steps done.

        Its minibatches derive from (seed, round, client id) and ``purpose``: "personal" (a personalized model's
        own steps, Ditto's v_k, drawn apart from the global model's) or "finetune" (evaluation fine-tuning).  The
        same code as the sequential backend's client, so every backend and a deployment's node agree bit for bit."""
        ...

    def minibatches(self, steps: int, purpose: str = "local") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (inputs, targets) of ``steps`` local steps, model-ready (normalised, augmented as the round's steps
        are): "local" gives exactly the minibatches the client's global-model training read this round (APFL
        steps its personal model on them), "personal" and "finetune" as in ``train``."""
        ...

    def loss_gradient(self, params: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``∇ (1/|B|) Σ_{i∈B} loss(model(params; x_i), y_i)``: the mean loss gradient over one minibatch (no
        weight decay, no clipping: add them with ``settings``)."""
        ...

    @property
    def settings(self) -> Any:
        """The round's ``local_training.LocalSettings`` (η_l, weight decay, clip norm), for an algorithm's own loop."""
        ...


@dataclass(frozen=True)
class ClientUpdate:
    """What local training produced for one client."""

    start_params: torch.Tensor
    final_params: torch.Tensor
    steps_done: int
    computation: ClientComputation | None = None  # the client's own data, for algorithms that need more than θ_k
    # The client's own final model when final_params is what the server reconstructs from a compressed upload.
    local_params: torch.Tensor | None = None

    @property
    def trained_params(self) -> torch.Tensor:
        """The model the client actually holds after training (uncompressed)."""
        return self.local_params if self.local_params is not None else self.final_params


@dataclass(frozen=True)
class RoundContext:
    round: int
    num_registered: int
    num_selected: int
    server_learning_rate: float
    # When set, a mean over the reporting clients divides by this public number instead of its weight sum Σ_P r_k:
    # client-level DP with central noise (driftlab.privacy) sets it to the expected cohort q·N, because the number
    # of clients that reported is itself private (McMahan et al. 2018's fixed-denominator estimator).
    mean_denominator: float | None = None


@dataclass(frozen=True)
class ServerFold:
    """``server_update`` as a fold over the round's messages in sample order.

    ``start(server, round_context)`` gives an accumulator (e.g. running sums),
    ``add(accumulator, message)`` a new one, and ``finish(server, accumulator,
    round_context)`` the new server state and metrics.  ``finish`` is called
    only when at least one message was added.
    """

    start: Callable[[Any, RoundContext], Any]
    add: Callable[[Any, Any], Any]
    finish: Callable[[Any, Any, RoundContext], tuple[Any, dict[str, float]]]
    # True: ``finish`` is called in a round where no client reported too (a private round releases its noise even
    # then, and its clip and accounting move on); False: such a round leaves the server state as it is.
    finishes_empty: bool = False

    def server_update(
        self, server: Any, messages: Sequence[Any], context: RoundContext
    ) -> tuple[Any, dict[str, float]]:
        accumulator = self.start(server, context)
        for message in messages:
            accumulator = self.add(accumulator, message)
        return self.finish(server, accumulator, context)


def collecting_fold(
    server_update: Callable[[Any, Sequence[Any], RoundContext], tuple[Any, dict[str, float]]],
) -> ServerFold:
    """The fold of an algorithm that gives only ``server_update``: keep the messages, update once at the end."""

    def start(server: Any, context: RoundContext) -> list:  # noqa: ARG001 - ServerFold calls start(server, context)
        return []  # whatever the server and round: the messages are folded at the end, by server_update

    def add(messages: list, message: Any) -> list:
        messages.append(message)  # the list is the fold's own, made by start()
        return messages

    return ServerFold(start, add, lambda server, messages, context: server_update(server, messages, context))


def _as_sent(message: Any) -> Any:
    return message


def _as_built(sent: Any, start_params: torch.Tensor) -> Any:  # noqa: ARG001
    return sent


@dataclass(frozen=True)
class MessageCodec:
    """How an algorithm's client message travels on a wire (a deployment); the simulator hands messages over as they are.

    ``to_wire(message)`` is what the client sends (never called with None, a
    client that sends nothing); ``from_wire(sent, start_params)`` is the message
    as its client built it, from what arrived and the round's θ_start, or a
    ValueError saying what does not fit.  ``unplanned`` names the fields
    of a message a server does not compare with the message it planned (the
    deployment's ``planned_message``): ``from_wire`` checked them itself, or
    they are data; ``"payload/bits"`` names a field of the nested message in
    field ``payload`` (a wrapper's codec over its inner algorithm's).  The default sends the message itself.  Compression
    (``driftlab.compress.error_feedback``) sends its model part compressed
    through its codec, so a transport never names a payload type.
    """

    to_wire: Callable[[Any], Any] = _as_sent
    from_wire: Callable[[Any, torch.Tensor], Any] = _as_built
    unplanned: tuple[str, ...] = ()


PLAIN_CODEC = MessageCodec()


@dataclass(frozen=True)
class ReleaseForm:
    """What a client's message releases beyond the view, as one flat vector, and how to rebuild a message from one.

    Client-level DP (``driftlab.privacy``) clips and noises this vector, robust aggregation ranks it, an attack
    forges it: each works on the vector and never names an algorithm's message type.

    ``release(view, message)`` is the flat ``[D]`` vector the message reveals
    beyond what the server sent (``view``): for a message that carries θ_k,
    ``θ_k − view.params``; for one that carries changes (SCAFFOLD's Δy_k,
    Δc_k), the changes themselves, concatenated in field order.
    ``restore(view, message, vector)`` is the message that releases exactly
    ``vector`` (its other fields as in ``message``); with ``message=None`` it
    builds one from ``vector`` alone that the fold counts once with unit
    weight (a carrier: of the server's noise, of a forged change).  ``scaled(view, message,
    scale)``, when given, is the message whose released vector is ``scale``
    times its own, built so that it still travels as the algorithm sends it
    (compression scales its ternary μ); None: ``restore`` of the scaled vector.
    ``size(view)`` is the length D of the released vector.

    An algorithm that gives a form promises that its server update depends on
    the round's messages only through ``Σ_P release(m_k)`` (each message with
    unit weight: its aggregation weighs clients alike) and public numbers, and
    that its means over reporting clients divide by
    ``RoundContext.mean_denominator`` when that is set.  Then the server update
    is a function of the released vectors' sum: one client moves it by at most the
    clip norm (client-level DP's sensitivity), a carrier message adds its vector to
    the algorithm's aggregate, scaled as the algorithm scales it.  An ``Algorithm.lacks``
    entry for the release form says why a configuration has none (its weights depend on n_k, ...), naming the fix.
    """

    release: Callable[[Any, Any], torch.Tensor]
    restore: Callable[[Any, Any, torch.Tensor], Any]
    scaled: Callable[[Any, Any, float], Any] | None = None
    # size(view): D, the length of the released vector (the server draws its noise before any client reports);
    # None: found from the message a client that did not move would send (driftlab.privacy.mechanism).
    size: Callable[[Any], int] | None = None

    def scale(self, view: Any, message: Any, factor: float) -> Any:
        """``message`` with its released vector multiplied by ``factor``."""
        if self.scaled is not None:
            return self.scaled(view, message, factor)
        return self.restore(view, message, self.release(view, message) * factor)


@dataclass(frozen=True)
class Personalization:
    """An algorithm's per-client (personalized) models: what client k itself predicts with.

    ``model(view, client_state)`` is client k's own flat model, from the view the server would send it now
    (``Algorithm.client_view`` when given, else ``broadcast``) and its state (``client_state_init(θ⁰)`` for a
    client that has not trained yet): APFL's ``v̄_k = α_k v_k + (1 − α_k) w``, Ditto's ``v_k``, FedAMP's ``w_k``.
    Evaluation (``evaluation.personal``) reports each client's own model on its own test split beside the
    server model on the global test set and on each client's split, so local and global accuracy are never
    confused.  ``description`` names the model in reports and errors ("APFL's mixed model α_k v_k + (1−α_k) w").
    """

    model: Callable[[Any, Any], torch.Tensor]
    description: str = "each client's personalized model"


@dataclass(frozen=True)
class RoundPrelude:
    """A first phase of every round, before local training (Mime's control variate, Karimireddy et al. 2021).

    Each client with work this round computes ``compute(view, context, computation)``, a flat vector, at the view
    ``broadcast`` gives (e.g. ``computation.full_gradient(view.params)``); the server takes their mean, weighted by
    ``weight(context)``, summed in sample order, and ``apply(server, mean)`` is the state whose ``broadcast`` the
    clients then train from and whose fold aggregates the round.  The vectors are an upload of their size each; the
    clients receive the second view instead of the first (the same tensors, in two messages).  A prelude's vectors
    are neither compressed nor clipped, and a deployment has one exchange per round: compression, ``[privacy]``,
    ``[system]``, ``[asynchronous]`` and deployments refuse an algorithm with a prelude.
    """

    compute: Callable[[Any, ClientContext, ClientComputation], torch.Tensor]
    weight: Callable[[ClientContext], float]
    apply: Callable[[Any, torch.Tensor], Any]


@dataclass(frozen=True)
class Algorithm:
    """The functions that are the whole of an algorithm (see the module docstring).

    ``server_init`` must return a state with a ``params`` field: the model the
    clients start from and the one evaluated.  ``broadcast`` returns the client
    view: what the server sends each selected client, a frozen dataclass with a
    ``params`` field whose ``payload_bits`` is the download traffic.
    ``client_objective`` and ``client_finish`` take that view, never the server
    state.  ``client_state_init`` is ``None`` for algorithms without
    per-client state.  ``client_joined``/``client_left``, when given, update
    the server state as a client enters or leaves the registered set.
    ``server_fold``, when given, is ``server_update`` as a fold (its
    ``server_update`` must be ``server_fold.server_update``).  ``plugin``
    names the plugin that provides the algorithm ("algorithm plugin 'moon'
    (/path/moon.py)"; None for a built-in): messages about what its numbers
    did (a divergence) name it as a possible cause (``plugin_note``).
    ``codec`` says how its messages travel on a wire (``MessageCodec``).
    """

    name: str
    server_init: Callable[[torch.Tensor], Any]
    # (client view, client state, context) -> a GradientCorrection or an objectives.LocalObjective
    client_objective: Callable[[Any, Any, ClientContext], Any]
    # (client view, client state, context, update) -> (new client state, message or None)
    client_finish: Callable[[Any, Any, ClientContext, ClientUpdate], tuple[Any, Any]]
    server_update: Callable[[Any, Sequence[Any], RoundContext], tuple[Any, dict[str, float]]]
    broadcast: Callable[[Any], Any]  # server state -> client view
    client_state_init: Callable[[torch.Tensor], Any] | None = None
    # Registered-set changes (clients joining or leaving S_t), for algorithms whose server state
    # sums over all registered clients (FedDyn's Σ_S λ_k): (server, the client's state) -> server.
    client_joined: Callable[[Any, Any], Any] | None = None
    client_left: Callable[[Any, Any], Any] | None = None
    # The server update as a fold (``ServerFold``), so the engine can stream messages into it; None: only server_update.
    server_fold: ServerFold | None = None
    plugin: str | None = None  # set by driftlab.algorithms.plugin_guard, which also wraps the functions of a plugin
    codec: MessageCodec = PLAIN_CODEC  # how its messages travel on a wire (a deployment)
    # What a message releases as one flat vector (ReleaseForm), for client-level DP, robust aggregation and attacks;
    # None: this configuration has none (``lacks`` says why).  ``privacy=`` is its old name (``_accept_old_names``).
    release: ReleaseForm | None = None
    # Asynchronous training (FedBuff, driftlab.simulation.asynchronous): True declares that the server update, fed
    # staleness-weighted changes of clients that started from older models (each stale message's ``release.release``
    # moved onto the current model with ``release.restore``, unit weight, means over the buffer), is a stated
    # asynchronous rule of this algorithm; it needs ``release`` (the form).
    asynchronous: bool = False
    # The capabilities this algorithm lacks for a reason of its own (driftlab.features.capabilities.Lack: FedNova's
    # τ_eff has no release form, SCAFFOLD's c no asynchronous rule), each with why and the fix; a missing capability
    # without one is refused with the generic reason of what needs it (driftlab.features.drivers).
    lacks: tuple[Lack, ...] = ()
    # Per-client models (APFL, Ditto, FedAMP): Personalization; None: every client predicts with the server's model.
    personalization: Personalization | None = None
    # (server state, client id, client states) -> the view the server sends that client (FedAMP's own cloud model
    # u_k), whose ``params`` that client's local SGD starts from; ``client states`` is a function giving an iterator of
    # (client id, state) over every client that has a state, in client-id order (the store's committed states, read
    # from disk with the disk store: FedAMP's latest models w_j are client states); None: every selected client
    # receives ``broadcast(server)``.
    client_view: Callable[[Any, int, Callable[[], Any]], Any] | None = None
    # A first phase of each round before local training (RoundPrelude: Mime's in-round control variate); None: one phase.
    prelude: RoundPrelude | None = None

    def __post_init__(self) -> None:
        if self.server_fold is not None and self.server_update != self.server_fold.server_update:
            raise ValueError(
                f"algorithm {self.name!r}: server_update is not server_fold.server_update, so the engine (which folds) and a "
                "caller of server_update would compute different things; give server_update=fold.server_update, or "
                "server_fold=None to have the engine call server_update on the collected messages"
            )

    @property
    def capabilities(self) -> frozenset[str]:
        """What this algorithm provides (``driftlab.features.capabilities``), read from its fields."""
        provided = {
            RELEASE_FORM: self.release is not None,
            ASYNCHRONOUS_RULE: self.asynchronous and self.release is not None,
            ONE_PHASE: self.prelude is None,
            SHARED_VIEW: self.client_view is None,
            NO_MEMBERSHIP_HOOKS: self.client_joined is None and self.client_left is None,
            PERSONAL_MODELS: self.personalization is not None,
        }
        return frozenset(name for name, given in provided.items() if given)

    @property
    def lack_reasons(self) -> dict[str, Reason]:
        """Each lacking capability's own reason: the declared ``lacks``, and an asynchronous rule without its form."""
        reasons = {lack.capability: lack.reason for lack in self.lacks}
        if self.asynchronous and self.release is None:
            reasons[ASYNCHRONOUS_RULE] = drivers.RULE_WITHOUT_FORM
        return reasons

    def refusal_reason(self, requirements: Requirements) -> Reason | None:
        """The reason of the first thing ``requirements`` needs that this algorithm lacks (None: none)."""
        found = conflicts(requirements, algorithm_key(self.name), self.capabilities, self.lack_reasons)
        return found[0].reason if found else None

    def refusal(self, requirements: Requirements) -> str | None:
        """The refusal message of the first thing ``requirements`` needs that this algorithm lacks (None: none)."""
        found = conflicts(requirements, algorithm_key(self.name), self.capabilities, self.lack_reasons)
        return found[0].message if found else None

    @property
    def release_refusal(self) -> str | None:
        """Why this configuration gives no release form and what to change (the declared lack's text); None: none declared."""
        reason = None if self.release is not None else self.lack_reasons.get(RELEASE_FORM)
        return None if reason is None else reason.text

    # The old names of ``release`` and ``release_refusal`` (plugins written before the rename read them).
    privacy = property(lambda self: self.release, doc="The release form (``release``'s old name).")
    privacy_refusal = property(lambda self: self.release_refusal, doc="``release_refusal``'s old name.")

    @property
    def asynchronous_refusal(self) -> str | None:
        """Why this algorithm declares no asynchronous rule and what to run instead; None: none declared."""
        reason = {lack.capability: lack.reason for lack in self.lacks}.get(ASYNCHRONOUS_RULE)
        return None if reason is None else reason.text

    def asynchronous_problem(self) -> str | None:
        """Why this algorithm cannot run asynchronously (FedBuff), naming ``[asynchronous]``, it and the fix (None: it can)."""
        return self.refusal(drivers.ASYNCHRONOUS)

    def view_for(self, server: Any, client_id: int, shared: Any, states: Callable[[], Any] = lambda: iter(())) -> Any:
        """The view client ``client_id`` receives: ``client_view(server, client_id, states)``, or ``shared``
        (``broadcast(server)``, computed once per round) when the algorithm sends every client the same."""
        return shared if self.client_view is None else self.client_view(server, client_id, states)

    def fold(self) -> ServerFold:
        """How the engine aggregates a round: ``server_fold``, or ``server_update`` over the collected messages."""
        return self.server_fold if self.server_fold is not None else collecting_fold(self.server_update)


def _accept_old_names(init: Callable[..., None]) -> Callable[..., None]:
    """``Algorithm.__init__`` that also takes ``privacy=form``, the old name of ``release=form`` (plugins written
    before the rename call the constructor with it, and ``dataclasses.replace(algorithm, privacy=None)``); given, it wins
    over ``release`` (which ``replace`` always passes)."""

    @functools.wraps(init)
    def accepting_privacy(self: Algorithm, *args: Any, **kwargs: Any) -> None:
        if "privacy" in kwargs:
            kwargs["release"] = kwargs.pop("privacy")
        init(self, *args, **kwargs)

    return accepting_privacy


Algorithm.__init__ = _accept_old_names(Algorithm.__init__)  # type: ignore[method-assign]
PrivacyForm = ReleaseForm  # the old name, for plugins and code written before the rename


def plugin_note(algorithm: Algorithm) -> str:
    """For a message about a run's numbers: "" for a built-in algorithm, else a clause naming the plugin as a possible cause."""
    if algorithm.plugin is None:
        return ""
    return (
        f"; the algorithm is {algorithm.plugin}, whose functions compute the server model and the messages, "
        "so the plugin could be at fault rather than the learning rate"
    )
