"""Bucketing (Karimireddy, He and Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via Bucketing", ICLR
2022, arXiv 2006.09365, Algorithm 1): average the round's inputs in small random groups, then aggregate the groups.

With the round's n inputs x_1 … x_n (in sample order), a permutation π of {1 … n} drawn for the round, and the
bucket size s::

    T   = ⌈n/s⌉,      B_t = {π((t−1)s + 1), …, π(min(ts, n))},      t = 1 … T
    y_t = (1/|B_t|) Σ_{i∈B_t} x_i                                      (the last bucket may be smaller)
    aggregate = R(y_1, …, y_T)                                         (the robust rule R, uniform weights)

Averaging s inputs shrinks the spread that non-IID honest clients show, so a rule built for IID inputs stops
mistaking heterogeneity for attack, while each Byzantine input still spoils at most its own bucket.  As in the
authors' code (epfml/byzantine-robust-noniid-optimizer, utils.py, ``bucketing_wrapper``): a uniform shuffle of the
round's inputs, buckets of s consecutive shuffled inputs, each averaged over its own size (the last one, when s does
not divide n, over fewer), and the rule applied to the T bucket means with equal weights, the smaller last bucket
included.  Krum's and Bulyan's f keeps its meaning as the number of Byzantine clients, each of which may sit in a
bucket of its own, so their requirements (T > 2f + 2, T ≥ 4f + 3) count buckets: the code builds its Krum with n =
T and the same f.

Our choices:
- the permutation is ``generator(seed, ROBUST_BUCKETING, round, −1).permutation(n)`` (``driftlab.randomness``), a
  function of the run's seed and the round, so a resumed run buckets as an uninterrupted one.
- s = 1 is no bucketing: the rule sees the inputs in sample order, bit for bit as without ``bucket_size`` (a
  shuffle of singletons changes nothing but the order, and order moves ties and floating-point sums).
- centered clipping with momentum β > 0: each client's momentum m_i is formed first, from its own update (per
  client id, as ``driftlab.robust.clipping``), and the momenta are bucketed; the clipping then runs on the bucket
  means around the last aggregate with no momentum of its own.  This is the paper's order (its workers apply
  momentum, the server buckets what they send); bucket means have no identity from round to round to keep a
  momentum for.
- the per-client record: client i's ``kept`` and ``scale`` (and Krum's ``scores``) are those of its bucket, so a
  bucket Krum drops counts each of its clients as dropped.
- weights: none.  Bucketing counts clients (the inputs of a bucket are averaged uniformly, the buckets weighed
  equally), as the paper and its code do; the robust wrapper passes uniform weights in any case.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from driftlab.randomness import NO_CLIENT, Stream, generator
from driftlab.robust.clipping import CenteredClipping, CenteredClippingState, client_momenta
from driftlab.robust.krum import Bulyan, Krum, MultiKrum
from driftlab.robust.registry import Settings, aggregate
from driftlab.robust.result import RobustResult, check_positive_integer, check_updates


def check_bucket_size(bucket_size: int) -> int:
    """``bucket_size`` if it is an integer s ≥ 1, else a ValueError naming the fix."""
    if isinstance(bucket_size, bool):
        raise ValueError(f"bucketing: bucket_size s must be a positive integer, got {bucket_size!r}")
    check_positive_integer(bucket_size, "bucketing", "bucket_size s")
    return bucket_size


def bucket_count(n: int, bucket_size: int) -> int:
    """T = ⌈n/s⌉, the number of buckets of n inputs."""
    return math.ceil(n / check_bucket_size(bucket_size))


def bucket_permutation(seed: int, round_index: int, n: int) -> list[int]:
    """The round's shuffle of its n inputs' positions, from ``(seed, ROBUST_BUCKETING, round)`` alone."""
    return [int(i) for i in generator(seed, Stream.ROBUST_BUCKETING, round_index, NO_CLIENT).permutation(n)]


def buckets(permutation: Sequence[int], bucket_size: int) -> list[list[int]]:
    """The positions in each bucket: s consecutive entries of ``permutation``, the last bucket what remains."""
    check_bucket_size(bucket_size)
    order = [int(i) for i in permutation]
    if sorted(order) != list(range(len(order))):
        raise ValueError(f"bucketing needs a permutation of 0 … n − 1 (n = {len(order)}), got {list(permutation)}")
    return [order[start : start + bucket_size] for start in range(0, len(order), bucket_size)]


def bucket_means(updates: torch.Tensor, permutation: Sequence[int], bucket_size: int) -> torch.Tensor:
    """``[T, d]``: row t the mean of the updates in bucket t (``buckets``), each over its own size."""
    check_updates(updates, None)
    if len(permutation) != updates.shape[0]:
        raise ValueError(f"bucketing: {updates.shape[0]} updates but a permutation of {len(permutation)} positions")
    groups = buckets(permutation, bucket_size)
    return torch.stack([updates[torch.tensor(members, device=updates.device)].mean(dim=0) for members in groups])


def _largest_bucket_size(n: int, need: int) -> int:
    """The largest s with ⌈n/s⌉ ≥ ``need`` (0 when even s = 1 gives too few)."""
    return next((s for s in range(n, 0, -1) if math.ceil(n / s) >= need), 0)


def check_bucket_count(settings: Settings, n: int, bucket_size: int) -> None:
    """Krum's, multi-Krum's and Bulyan's requirement on the T = ⌈n/s⌉ buckets of n updates, with what to change."""
    if not isinstance(settings, Krum | MultiKrum | Bulyan):
        return
    f, t = settings.byzantine, bucket_count(n, bucket_size)
    bulyan = isinstance(settings, Bulyan)
    need = 4 * f + 3 if bulyan else 2 * f + 3
    if t >= need:
        return
    condition = f"T ≥ 4f + 3 = {need}" if bulyan else f"T > 2f + 2 = {need - 1}"
    largest_f = max((t - 3) // 4 if bulyan else (t - 3) // 2, 0)
    size = _largest_bucket_size(n, need)
    fixes = [f"lower robust.bucket_size to at most {size}"] if size > 0 else []
    fixes += [f"sample at least {need * bucket_size - bucket_size + 1} clients per round"]
    fixes += [f"lower robust.byzantine to at most {largest_f}"] if t >= 3 else []
    raise ValueError(
        f"{settings.name} with f = {f} counts Byzantine buckets (an attacker may spoil a bucket of its own), so it "
        f"needs {condition} buckets; bucket_size s = {bucket_size} makes T = ⌈{n}/{bucket_size}⌉ = {t} buckets of the "
        f"round's {n} updates: " + ", or ".join(fixes)
    )


def bucketed_aggregate(
    settings: Settings,
    updates: torch.Tensor,
    bucket_size: int,
    permutation: Sequence[int],
    *,
    state: CenteredClippingState | None = None,
    client_ids: Sequence[int] | None = None,
) -> RobustResult:
    """The rule ``settings`` on the bucket means of the ``[n, d]`` updates (module docstring), as a per-client
    ``RobustResult``.  ``permutation`` is the round's shuffle of the positions 0 … n − 1 (``bucket_permutation``);
    s = 1 is ``aggregate(settings, updates, state=state, client_ids=client_ids)`` itself, the permutation unused.

    Example (n = 5, s = 2, π = (3, 0, 4, 1, 2): buckets {3, 0}, {4, 1}, {2}):
        >>> import torch
        >>> from driftlab.robust import Median
        >>> x = torch.tensor([[1.0], [2.0], [4.0], [7.0], [20.0]])
        >>> bucketed_aggregate(Median(), x, 2, [3, 0, 4, 1, 2]).aggregate  # median of 4, 11, 4
        tensor([4.])
    """
    if check_bucket_size(bucket_size) == 1:
        return aggregate(settings, updates, None, state=state, client_ids=client_ids)
    check_updates(updates, None)
    n = updates.shape[0]
    check_bucket_count(settings, n, bucket_size)
    inputs, inner, inner_state, momenta = updates, settings, state, None
    if isinstance(settings, CenteredClipping) and settings.momentum > 0:
        state = CenteredClippingState() if state is None else state
        inputs, momenta = client_momenta(settings.momentum, updates, client_ids, state.momenta)
        inner, inner_state = dataclasses.replace(settings, momentum=0.0), CenteredClippingState(state.centre)
    members = buckets(permutation, bucket_size)
    means = bucket_means(inputs, permutation, bucket_size)
    try:
        result = aggregate(inner, means, None, state=inner_state)
    except ValueError as error:
        raise ValueError(
            f"on the {len(members)} bucket means of the round's {n} updates (bucket_size s = {bucket_size}): {error}"
        ) from None
    owner = torch.empty(n, dtype=torch.long, device=result.kept.device)
    for bucket, positions in enumerate(members):
        owner[positions] = bucket
    result_state = result.state
    if momenta is not None:
        result_state = CenteredClippingState(result.state.centre, momenta)
    return RobustResult(
        aggregate=result.aggregate,
        kept=result.kept[owner],
        scale=result.scale[owner],
        state=result_state,
        scores=None if result.scores is None else result.scores[owner],
    )
