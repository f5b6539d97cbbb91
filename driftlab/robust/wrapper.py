"""Robust aggregation as a combinator: ``with_robust_aggregation(algorithm, settings)`` wraps any algorithm with a
release form (``seam.ReleaseForm``).

The algorithm's form says what a message releases, x_k = release(view, m_k) (FedAvg's θ_k − θ^{t−1}, SCAFFOLD's
cat(Δy_k, Δc_k), EFL's cat(Δθ, Δu_k, Δv_k)), and promises that its fold depends on the messages only through
Σ_P x_k with unit weights and divides its means by ``RoundContext.mean_denominator`` when set.  Round t, with the
n messages of the round in sample order::

    server:  a   = R(x_1, …, x_n)                  (the rule R of ``driftlab.robust``, uniform weights)
             the wrapped fold on one carrier message restore(view, None, n·a), with mean_denominator = n

so every mean over the reporting clients is a (n·a / n = a), and a sum over them (SCAFFOLD's c ← c + Σ_P Δc_k / N)
is n·a: the robust aggregate stands in for the mean wherever the algorithm uses it.  Each client's message is
tagged with its id (``driftlab.robust.tagging``) for centered clipping's momentum; nothing else of the client side
changes.  Centered clipping's last aggregate v_{t−1} and the momenta m_i are server state (``RobustServerState``),
checkpointed with it, so a resumed run aggregates as an uninterrupted one.  A round in which nobody reported leaves
the state as it is.

The wrapped algorithm keeps the tagged release form, so that ``[attack]`` (wrapped outside it: an attacker forges
before the server aggregates) forges the released vectors; its fold is no longer a sum of them, which is why
``[privacy]`` and ``[asynchronous]`` are refused with ``[robust]`` (``driftlab.robust.feature``).

With a bucket size s > 1 (``robust.bucket_size``; ``driftlab.robust.bucketing``), R runs on the means of ⌈n/s⌉
buckets of the round's vectors, shuffled by a permutation of the n sample-order positions drawn from (seed, round)
alone, so a resumed run buckets as an uninterrupted one; centered clipping's momenta are formed per client before
bucketing.  s = 1 or None is no bucketing.

Metrics of each round: ``robust_dropped`` (clients none of whose coordinates entered the aggregate: Krum's
unselected), ``robust_down_weighted`` (clients scaled below their plain weight or kept in part).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from driftlab.features.capabilities import ASYNCHRONOUS_RULE, Reason, with_lack
from driftlab.features.wrapping import Wrapping
from driftlab.robust.bucketing import bucket_permutation, bucketed_aggregate, check_bucket_size
from driftlab.robust.clipping import CenteredClipping, CenteredClippingState
from driftlab.robust.registry import Settings, aggregate
from driftlab.robust.tagging import Tagged, tagged_codec, tagged_finish, tagged_form
from driftlab.simulation.seam import Algorithm, RoundContext, ServerFold

ASYNCHRONOUS_REASON = Reason(
    "[robust] aggregates a round's messages together, and FedBuff folds buffers of stale changes as they arrive",
    "remove [robust] or [asynchronous]",
)


@dataclass(frozen=True)
class RobustServerState(Wrapping):
    """The wrapped algorithm's server state and centered clipping's: v_{t−1} (None before the first aggregate),
    the momenta m_i as rows indexed by client id and which rows hold one (None without momentum)."""

    centre: torch.Tensor | None = None
    momenta: torch.Tensor | None = None
    seen: torch.Tensor | None = None


@dataclass(frozen=True)
class RobustRound:
    """A robust round's accumulator: the view the vectors are measured from, and the vectors and senders so far."""

    view: Any
    vectors: list = field(default_factory=list)
    senders: list = field(default_factory=list)


def _momenta_of(server: RobustServerState, senders: list[int]) -> dict[int, torch.Tensor]:
    if server.momenta is None:
        return {}
    rows = server.momenta.shape[0]
    return {c: server.momenta[c] for c in senders if c < rows and bool(server.seen[c])}


def _with_momenta(
    server: RobustServerState, momenta: dict[int, torch.Tensor], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The momentum rows with ``momenta`` written in (grown to the largest id)."""
    rows = max([*momenta, -1]) + 1
    table, seen = server.momenta, server.seen
    if table is None:
        table = torch.zeros(0, like.numel(), dtype=like.dtype, device=like.device)
        seen = torch.zeros(0, dtype=torch.bool, device=like.device)
    if rows > table.shape[0]:
        extra = rows - table.shape[0]
        table = torch.cat([table, table.new_zeros(extra, table.shape[1])])
        seen = torch.cat([seen, seen.new_zeros(extra)])
    table, seen = table.clone(), seen.clone()
    for client, row in momenta.items():
        table[client] = row
        seen[client] = True
    return table, seen


def with_robust_aggregation(
    algorithm: Algorithm, settings: Settings, bucket_size: int | None = None, seed: int = 0
) -> Algorithm:
    """``algorithm`` whose server aggregates the round's released vectors with the rule ``settings``, on the means of
    buckets of ``bucket_size`` of them shuffled from (``seed``, round) when it is above 1 (module docstring).
    ValueError for an algorithm without a release form."""
    bucketing = bucket_size is not None and check_bucket_size(bucket_size) > 1
    form = algorithm.release
    if form is None:
        raise ValueError(f"algorithm {algorithm.name!r} gives no release form for a robust rule to aggregate")
    inner_fold = algorithm.fold()
    clipping = isinstance(settings, CenteredClipping)
    with_ids = clipping and settings.momentum > 0

    def server_init(initial_params: torch.Tensor) -> RobustServerState:
        return RobustServerState(algorithm.server_init(initial_params))

    def start(server: RobustServerState, context: RoundContext) -> RobustRound:  # noqa: ARG001
        return RobustRound(algorithm.broadcast(server.inner))

    def add(round_: RobustRound, message: Tagged) -> RobustRound:
        round_.vectors.append(form.release(round_.view, message.payload))  # the round's own lists, made by start
        round_.senders.append(message.client_id)
        return round_

    def finish(server: RobustServerState, round_: RobustRound, context: RoundContext) -> tuple[RobustServerState, dict]:
        updates = torch.stack(round_.vectors)
        n = updates.shape[0]
        state = None
        if clipping:
            state = CenteredClippingState(server.centre, _momenta_of(server, round_.senders))
        client_ids = round_.senders if with_ids else None
        if bucketing:
            permutation = bucket_permutation(seed, context.round, n)
            result = bucketed_aggregate(settings, updates, bucket_size, permutation, state=state, client_ids=client_ids)
        else:
            result = aggregate(settings, updates, None, state=state, client_ids=client_ids)
        carrier = form.restore(round_.view, None, result.aggregate * n)
        inner_context = dataclasses.replace(context, mean_denominator=float(n))
        inner, metrics = inner_fold.finish(
            server.inner, inner_fold.add(inner_fold.start(server.inner, inner_context), carrier), inner_context
        )
        new = RobustServerState(inner)
        if clipping:
            momenta = server.momenta, server.seen
            if with_ids:
                momenta = _with_momenta(server, dict(result.state.momenta), result.aggregate)
            new = RobustServerState(inner, result.state.centre, *momenta)
        metrics = {
            **metrics,
            "robust_dropped": float(result.dropped.sum()),
            "robust_down_weighted": float(result.down_weighted.sum()),
        }
        return new, metrics

    def membership_hook(hook: Any) -> Any:
        if hook is None:
            return None
        return lambda server, client: dataclasses.replace(server, inner=hook(server.inner, client))

    fold = ServerFold(start, add, finish)
    return dataclasses.replace(
        algorithm,
        server_init=server_init,
        client_finish=tagged_finish(algorithm.client_finish),
        server_update=fold.server_update,
        broadcast=lambda server: algorithm.broadcast(server.inner),
        client_joined=membership_hook(algorithm.client_joined),
        client_left=membership_hook(algorithm.client_left),
        server_fold=fold,
        codec=tagged_codec(algorithm.codec),
        release=tagged_form(form),
        asynchronous=False,
        lacks=with_lack(algorithm.lacks, ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON),
    )
