"""Attack simulation as a combinator: ``with_attack(algorithm, settings, attackers, start_round, seed)`` has the
Byzantine clients' messages forged, for any algorithm with a release form (``seam.ReleaseForm``).

Every client trains honestly and its message is tagged with its id (``driftlab.robust.tagging``).  Round t ≥
``start_round``, with the round's messages m_1 … m_n in sample order, their released vectors x_i = release(view, m_i),
B the reporting Byzantine clients (f = |B|) and H the honest ones::

    x̃_i = forge(x_i; X_H)  for i ∈ B            (``driftlab.attacks.model_updates.forge``; X_H = [x_h]_{h∈H})
    m̃_i = restore(view, m_i, x̃_i)              (its other fields as the client built them)
    the wrapped fold on m̃_1 … m̃_n, in sample order

Sign flipping, scaling and Gaussian noise read the client's own x_i (noise from (seed, t, client id):
``byzantine.noise_generator``, the same on every backend and after a resume); ALIE, IPM, min-max and min-sum are
omniscient: they read the round's honest vectors X_H, as their papers assume, with ALIE's n and f the round's, and
every attacker of the round sends the same x̃.  A round with too few honest vectors to imitate (ALIE: 2, the other
omniscient attacks: 1) has its attackers send their honest messages.  The forging is the server's first step, before
``[robust]`` (wrapped inside) aggregates: an attacker is a client, the defence is the server.

The metric ``attack_byzantine_messages`` is the number of forged messages of the round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from driftlab.attacks.byzantine import noise_generator
from driftlab.attacks.model_updates import Attack, GaussianNoise, LittleIsEnough, forge
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, RELEASE_FORM, Reason, with_lack
from driftlab.robust.tagging import Tagged, tagged_codec, tagged_finish
from driftlab.simulation.seam import Algorithm, ReleaseForm, RoundContext, ServerFold

ASYNCHRONOUS_REASON = Reason(
    "the omniscient attacks forge from a round's honest messages together, and FedBuff folds stale changes as they "
    "arrive",
    "remove [attack] or [asynchronous]",
)
FORGED_REASON = Reason(
    "its messages are forged at the server from the round's released vectors, so no feature can wrap it after [attack]"
)


@dataclass(frozen=True)
class AttackRound:
    """An attacked round's accumulator: the view the vectors are measured from, and the round's tagged messages."""

    view: Any
    messages: list = field(default_factory=list)


def honest_needed(settings: Attack) -> int:
    """How many honest vectors an attack needs in a round: ALIE's σ needs 2, the other omniscient ones 1."""
    if isinstance(settings, LittleIsEnough):
        return 2
    return 1 if settings.omniscient else 0


def forged_round(
    settings: Attack,
    form: ReleaseForm,
    view: Any,
    messages: list[Tagged],
    attackers: frozenset[int],
    round_index: int,
    seed: int,
) -> tuple[list[Any], int]:
    """The round's messages (payloads, in sample order) with the attackers' forged, and how many were."""
    payloads = [message.payload for message in messages]
    byzantine = [i for i, message in enumerate(messages) if message.client_id in attackers]
    if not byzantine:
        return payloads, 0
    vectors = [form.release(view, payload) for payload in payloads]
    honest = [vector for i, vector in enumerate(vectors) if i not in set(byzantine)]
    if len(honest) < honest_needed(settings):
        return payloads, 0
    honest_updates = torch.stack(honest) if honest else None
    shared = None
    if settings.omniscient:  # every attacker of the round sends the same vector: compute it once
        shared = forge(settings, honest_updates=honest_updates, num_clients=len(messages), num_byzantine=len(byzantine))
    for i in byzantine:
        client = messages[i].client_id
        generator = noise_generator(seed, round_index, client) if isinstance(settings, GaussianNoise) else None
        forged = shared if shared is not None else forge(settings, vectors[i], generator=generator)
        payloads[i] = form.restore(view, payloads[i], forged)
    return payloads, len(byzantine)


def with_attack(
    algorithm: Algorithm, settings: Attack, attackers: frozenset[int], start_round: int, seed: int
) -> Algorithm:
    """``algorithm`` whose Byzantine clients ``attackers`` forge their messages from round ``start_round`` on
    (module docstring).  ValueError for an algorithm without a release form."""
    form = algorithm.release
    if form is None:
        raise ValueError(f"algorithm {algorithm.name!r} gives no release form whose vector an attacker could forge")
    inner_fold = algorithm.fold()

    def start(server: Any, context: RoundContext) -> AttackRound:  # noqa: ARG001
        return AttackRound(algorithm.broadcast(server))

    def add(round_: AttackRound, message: Tagged) -> AttackRound:
        round_.messages.append(message)  # the round's own list, made by start
        return round_

    def finish(server: Any, round_: AttackRound, context: RoundContext) -> tuple[Any, dict]:
        payloads, count = [message.payload for message in round_.messages], 0
        if context.round >= start_round:
            payloads, count = forged_round(settings, form, round_.view, round_.messages, attackers, context.round, seed)
        accumulator = inner_fold.start(server, context)
        for payload in payloads:
            accumulator = inner_fold.add(accumulator, payload)
        server, metrics = inner_fold.finish(server, accumulator, context)
        return server, {**metrics, "attack_byzantine_messages": float(count)}

    fold = ServerFold(start, add, finish, finishes_empty=inner_fold.finishes_empty)
    return dataclasses.replace(
        algorithm,
        client_finish=tagged_finish(algorithm.client_finish),
        server_update=fold.server_update,
        server_fold=fold,
        codec=tagged_codec(algorithm.codec),
        release=None,
        asynchronous=False,
        lacks=with_lack(
            with_lack(algorithm.lacks, ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON), RELEASE_FORM, FORGED_REASON
        ),
    )
