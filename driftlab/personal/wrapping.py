"""Partial-model personalization: any algorithm with a release form, with some of the model's parameters personal.

FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", 2019): the base is shared, the head
(personalization layers) stays on each client.  LG-FedAvg (Liang et al., "Think Locally, Act Globally: Federated
Learning with Local and Global Representations", 2020): the representation (body) stays on each client, the head is
shared.  FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated Learning", ICML 2021):
FedPer's split, and each round a client trains its head first (body fixed), then its body (head fixed).

With Π the personal coordinates of the flat vector (``selection.PersonalPart``), S the others, and p_k client k's
own values on Π (its client state, p_k = θ⁰_Π before it first trains)::

    start_k = (θ^{t−1}_S, p_k)                                       its own view (Algorithm.client_view)
    θ_k     = the inner algorithm's local SGD from start_k           (FedRep: steps 1..s move Π only, the rest S only)
    p_k    ← (θ_k)_Π                                                 kept, never sent
    x_k     = the inner message's released vector, set to 0 on Π (in every [P] block: SCAFFOLD's Δy_k and Δc_k)
    θ^t     = the inner server update of those messages on S;  θ^t_Π = θ^{t−1}_Π = θ⁰_Π  (put back exactly)

The inner algorithm's release form (``seam.ReleaseForm``) is what makes the last two lines generic: the message is
rebuilt (``restore``) from its released vector with Π zeroed, against the broadcast view, so a message that carries
θ_k carries θ^{t−1} on Π and one that carries changes carries 0 there.  Client k's personal model (evaluated on its
own test split) is (θ^t_S, p_k).

The wrapped algorithm sends each client a view of its own, so what needs one shared view (``[privacy]``,
compression, FedBuff, a deployment) refuses it; ``keep = []`` is the inner algorithm bit for bit (the message is
then passed on as it is: the release/restore round trip rounds).

Example (FedAvg with the last layer personal; ``driftlab.personal.wrapping_test`` computes rounds by hand):
    >>> import torch
    >>> from driftlab.algorithms import fedavg
    >>> from driftlab.optim.server import make_server_optimizer
    >>> from driftlab.personal.selection import select
    >>> part = select(("fc1.weight", "fc2.weight"), (2, 2), ("head",))
    >>> algorithm = with_personal_layers(fedavg.build(make_server_optimizer("sgd"), aggregation="uniform"), part)
    >>> state = algorithm.client_state_init(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    >>> state.personal
    tensor([3., 4.])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from driftlab.features.capabilities import ONE_PHASE, RELEASE_FORM, SHARED_VIEW, Lack, Reason, Requirements
from driftlab.metrics.communication import payload_bits
from driftlab.personal.selection import PersonalPart
from driftlab.simulation.backends.objectives import LocalObjective, LocalStep, as_local_objective
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate, Personalization, RoundContext, ServerFold

KEY = "[personal_layers]"

# What the wrapper needs of the algorithm it wraps (an algorithm's own Lack reason, e.g. weighted FedAvg's, wins).
REQUIREMENTS = Requirements(
    KEY,
    needs=(
        (
            RELEASE_FORM,
            Reason(
                "it gives no release form (seam.ReleaseForm: its message as one vector), through which each client's "
                "message is made to release no change on the personal parameters",
                "give Algorithm(release=ReleaseForm(...)), or remove [personal_layers]",
                "; ",
            ),
        ),
        (
            SHARED_VIEW,
            Reason(
                "it sends each client a view of its own (Algorithm.client_view), and [personal_layers] substitutes "
                "each client's personal parameters into the one broadcast view",
                "remove [personal_layers]",
            ),
        ),
        (
            ONE_PHASE,
            Reason(
                "its first phase (Algorithm.prelude) is computed at the broadcast model, not at each client's own "
                "model with its personal parameters",
                "remove [personal_layers]",
            ),
        ),
    ),
)

# Why the wrapped algorithm has no shared view and no release form (what [privacy], compression, FedBuff and a
# deployment need): each client starts from its own model.  The seam that would lift this: a client's start model
# from its own state (client_start) with the view shared, then the release form of the shared part.
_OWN_START = Reason(
    "with [personal_layers] each client starts from its own model (the broadcast with its personal parameters), sent "
    "as a view of its own (Algorithm.client_view)",
    "remove [personal_layers], or the other feature",
)


@dataclass(frozen=True)
class PersonalView:
    """What client k trains from: ``params`` = (θ^{t−1}_S, p_k); ``shared`` the inner algorithm's broadcast view.

    Its download (``bits``) is the broadcast's: the client's own coordinates are already on the client."""

    params: torch.Tensor
    shared: Any

    @property
    def bits(self) -> int:
        return payload_bits(self.shared)


@dataclass(frozen=True)
class PersonalState:
    """Client k's state: ``personal`` = p_k, its own values of the personal coordinates (flat order), and the inner
    algorithm's client state (None: it keeps none)."""

    personal: torch.Tensor
    inner: Any = None


def _inner_view(view: PersonalView) -> Any:
    """The inner algorithm's view with the client's own start model: what its client functions see."""
    return dataclasses.replace(view.shared, params=view.params)


def alternating_step(
    params: torch.Tensor, gradient: torch.Tensor, state: tuple[torch.Tensor, ...], learning_rate: float
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """FedRep's local step: while ``step < first`` only the personal coordinates move (``personal`` is 1 there),
    afterwards only the shared ones; the frozen coordinates get no step at all (no weight decay either)."""
    step, first, personal = state
    moving = torch.where(step < first, personal, 1 - personal)
    return params - learning_rate * (moving * gradient), (step + 1, first, personal)


def _with_alternating_step(objective: Any, start: torch.Tensor, mask: torch.Tensor, first: int, name: str) -> Any:
    objective = as_local_objective(objective)
    if objective.local_step is not None:
        raise ValueError(
            f"personal_layers.personal_first_steps = {first} replaces each local step with FedRep's alternating one, "
            f"and algorithm {name!r} has a local step of its own (LocalObjective.local_step); set "
            "personal_layers.personal_first_steps = 0, or use an algorithm without one (fedavg, fedprox, scaffold)"
        )
    state = (start.new_zeros(()), start.new_tensor(float(first)), mask.to(start.dtype))
    return LocalObjective(objective.correction, objective.loss_term, LocalStep(alternating_step, state))


def _blocks_mask(mask: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """The personal mask over a released vector of ``size`` = m·P entries (m parameter-shaped fields in a row)."""
    total = mask.numel()
    if size % total:
        raise ValueError(
            f"[personal_layers] zeroes the personal parameters of what algorithm {name!r} releases, read as fields of "
            f"the model's {total} parameters each, and its release form gives {size} entries; remove "
            "[personal_layers] for this algorithm"
        )
    return mask.repeat(size // total)


def with_personal_layers(algorithm: Algorithm, part: PersonalPart, personal_first_steps: int = 0) -> Algorithm:
    """``algorithm`` with the coordinates of ``part`` kept on each client (module docstring); ``personal_first_steps``
    > 0 gives FedRep's alternating local steps.  ValueError when the algorithm cannot be wrapped, saying why."""
    if algorithm.personalization is not None:
        raise ValueError(
            f"[personal_layers] gives each client a model of its own, and algorithm {algorithm.name!r} already keeps "
            f"one ({algorithm.personalization.description}); remove [personal_layers], or use fedavg, fedprox or "
            "scaffold"
        )
    problem = algorithm.refusal(REQUIREMENTS)
    if problem is not None:
        raise ValueError(problem)
    if personal_first_steps < 0:
        raise ValueError(f"personal_first_steps must be at least 0, got {personal_first_steps}")
    inner = algorithm
    form = inner.release
    has_personal = bool(part.spans)
    masks: dict[tuple[torch.device, int], torch.Tensor] = {}  # by (device, size): built once, read only

    def blocks_mask(like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.numel())
        if key not in masks:
            masks[key] = _blocks_mask(part.mask(like.device), like.numel(), inner.name)
        return masks[key]

    def own_view(shared: Any, personal: torch.Tensor | None) -> PersonalView:
        params = shared.params if personal is None or not has_personal else part.substitute(shared.params, personal)
        return PersonalView(params, shared)

    def client_view(server: Any, client_id: int, states: Callable[[], Any]) -> PersonalView:
        personal = None  # a client without a state yet starts from θ⁰_Π, which the server's Π still holds
        for stored_id, state in states():  # in client-id order
            if stored_id >= client_id:
                if stored_id == client_id:
                    personal = state.personal
                break
        return own_view(inner.broadcast(server), personal)

    def client_state_init(initial: torch.Tensor) -> PersonalState:
        state = inner.client_state_init(initial) if inner.client_state_init is not None else None
        return PersonalState(part.values(initial), state)

    def client_objective(view: PersonalView, state: PersonalState, context: ClientContext) -> Any:
        objective = inner.client_objective(_inner_view(view), state.inner, context)
        if personal_first_steps == 0:
            return objective
        return _with_alternating_step(
            objective, view.params, part.mask(view.params.device), personal_first_steps, inner.name
        )

    def client_finish(
        view: PersonalView, state: PersonalState, context: ClientContext, update: ClientUpdate
    ) -> tuple[PersonalState, Any]:
        inner_state, message = inner.client_finish(_inner_view(view), state.inner, context, update)
        new_state = PersonalState(part.values(update.trained_params), inner_state)
        if message is None or not has_personal:
            return new_state, message
        released = form.release(_inner_view(view), message)
        kept = released.masked_fill(blocks_mask(released), 0.0)
        return new_state, form.restore(view.shared, message, kept)

    def personal_model(view: Any, state: PersonalState) -> torch.Tensor:
        shared = view.shared if isinstance(view, PersonalView) else view
        return part.substitute(shared.params, state.personal)

    def member_hook(hook: Callable[[Any, Any], Any] | None) -> Callable[[Any, Any], Any] | None:
        return None if hook is None else (lambda server, state: hook(server, state.inner))

    fold = inner.fold()

    def finish(server: Any, accumulator: Any, context: RoundContext) -> tuple[Any, dict[str, float]]:
        # A message releases 0 on Π, yet a mean of the clients' models is not θ^{t−1} to the last bit there ((θ+θ+θ)/3
        # rounds): the server's Π is put back as it was, so it never moves.
        updated, metrics = fold.finish(server, accumulator, context)
        kept = part.substitute(updated.params, part.values(server.params))
        return dataclasses.replace(updated, params=kept), metrics

    server_fold = ServerFold(fold.start, fold.add, finish, fold.finishes_empty) if has_personal else inner.server_fold
    description = (
        f"[personal_layers]: each client's own {', '.join(part.personal)} with the server's other parameters"
        if has_personal
        else "[personal_layers] with nothing personal: the server model"
    )
    return dataclasses.replace(
        inner,
        client_objective=client_objective,
        client_finish=client_finish,
        server_fold=server_fold,
        server_update=server_fold.server_update if server_fold is not None else inner.server_update,
        client_state_init=client_state_init,
        client_joined=member_hook(inner.client_joined),
        client_left=member_hook(inner.client_left),
        client_view=client_view,
        release=None,
        asynchronous=False,
        lacks=(*inner.lacks, Lack(SHARED_VIEW, _OWN_START), Lack(RELEASE_FORM, _OWN_START)),
        personalization=Personalization(personal_model, description),
    )


__all__ = [
    "KEY",
    "REQUIREMENTS",
    "PersonalState",
    "PersonalView",
    "alternating_step",
    "with_personal_layers",
]
