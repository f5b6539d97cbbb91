"""Bucketing: hand-computed bucket means and aggregates, s = 1 as no bucketing, the seeded permutation, Krum's f
counted in buckets, centered clipping's momenta formed before bucketing, and the per-client record."""

from __future__ import annotations

import pytest
import torch

from driftlab.randomness import Stream, generator
from driftlab.robust import (
    Bulyan,
    CenteredClipping,
    CenteredClippingState,
    GeometricMedian,
    Krum,
    Median,
    MultiKrum,
    NormBound,
    TrimmedMean,
    aggregate,
    bucket_means,
    bucket_permutation,
    bucketed_aggregate,
)
from driftlab.robust.bucketing import bucket_count, buckets

# Five clients' updates (rows) and a permutation: buckets {3, 0}, {4, 1}, {2}.
UPDATES = torch.tensor([[1.0, 0.0], [2.0, 1.0], [3.0, 0.0], [4.0, 2.0], [5.0, 1.0]], dtype=torch.float64)
PERMUTATION = [3, 0, 4, 1, 2]


def test_five_updates_in_buckets_of_two_by_hand():
    assert buckets(PERMUTATION, 2) == [[3, 0], [4, 1], [2]] and bucket_count(5, 2) == 3
    means = bucket_means(UPDATES, PERMUTATION, 2)
    # ((4,2) + (1,0))/2, ((5,1) + (2,1))/2, and the last bucket alone: (3,0)
    assert torch.equal(means, torch.tensor([[2.5, 1.0], [3.5, 1.0], [3.0, 0.0]], dtype=torch.float64))
    # the rule on the three means, each weighed equally (the smaller last bucket too, as the authors' code does):
    # the mean of the means is (3, 2/3), not the mean of the five updates (3, 0.8)
    plain = bucketed_aggregate(NormBound(max_norm=1e9), UPDATES, 2, PERMUTATION)
    assert torch.allclose(plain.aggregate, torch.tensor([3.0, 2.0 / 3.0], dtype=torch.float64), rtol=0, atol=1e-15)
    median = bucketed_aggregate(Median(), UPDATES, 2, PERMUTATION)
    assert torch.equal(median.aggregate, torch.tensor([3.0, 1.0], dtype=torch.float64))


def test_equal_buckets_under_a_mean_give_the_mean_of_the_updates():
    updates = torch.arange(12, dtype=torch.float64).reshape(6, 2) ** 2
    result = bucketed_aggregate(NormBound(max_norm=1e9), updates, 3, [5, 1, 3, 0, 4, 2])
    assert torch.allclose(result.aggregate, updates.mean(dim=0), rtol=1e-15, atol=0)


RULES = [
    Median(),
    TrimmedMean(beta=0.2),
    Krum(byzantine=1),
    MultiKrum(byzantine=1),
    Bulyan(byzantine=1),
    GeometricMedian(),
    CenteredClipping(radius=0.5, iterations=2, momentum=0.5),
    NormBound(max_norm=1.0),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_buckets_of_one_are_no_bucketing_bit_for_bit(rule):
    updates = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ids = [9, 2, 4, 0, 7, 1, 5]
    state = None
    if isinstance(rule, CenteredClipping):
        state = CenteredClippingState(
            torch.full((3,), 0.1, dtype=torch.float64), {2: torch.ones(3, dtype=torch.float64)}
        )
    senders = ids if state is not None else None
    plain = aggregate(rule, updates, state=state, client_ids=senders)
    bucketed = bucketed_aggregate(rule, updates, 1, [6, 5, 4, 3, 2, 1, 0], state=state, client_ids=senders)
    assert torch.equal(bucketed.aggregate, plain.aggregate)
    assert torch.equal(bucketed.kept, plain.kept) and torch.equal(bucketed.scale, plain.scale)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_every_rule_runs_on_buckets_and_each_client_carries_its_buckets_record(rule):
    updates = torch.randn(15, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    permutation = bucket_permutation(seed=1, round_index=2, n=15)
    ids = list(range(15)) if isinstance(rule, CenteredClipping) else None
    result = bucketed_aggregate(rule, updates, 2, permutation, client_ids=ids)  # 8 buckets: Bulyan's 4f + 3 = 7
    assert result.aggregate.shape == (3,) and result.kept.shape == result.scale.shape == (15,)
    for members in buckets(permutation, 2):
        assert len({float(result.kept[i]) for i in members}) == 1
        assert len({float(result.scale[i]) for i in members}) == 1


def test_krum_keeps_the_members_of_its_bucket_and_drops_the_others():
    values = [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 100.0, 100.0]
    updates = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
    # buckets {2,3}, {0,1}, {4,5}, {6,7}, {8,9}: means 1, 0, 2, 3, 100; n − f − 2 = 2 neighbours
    # scores 1+1, 1+4, 1+1, 1+4, 97²+98²: buckets 0 and 2 tie, the earlier wins: aggregate 1 from clients 2 and 3
    result = bucketed_aggregate(Krum(byzantine=1), updates, 2, [2, 3, 0, 1, 4, 5, 6, 7, 8, 9])
    assert torch.equal(result.aggregate, torch.tensor([1.0], dtype=torch.float64))
    assert result.kept.tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0] and int(result.dropped.sum()) == 8
    assert result.scores.tolist() == [5.0, 5.0, 2.0, 2.0, 2.0, 2.0, 5.0, 5.0, 97.0**2 + 98.0**2, 97.0**2 + 98.0**2]


def test_krums_f_counts_buckets_and_the_error_says_what_to_change():
    updates = torch.zeros(24, 1, dtype=torch.float64)
    with pytest.raises(ValueError) as raised:
        bucketed_aggregate(Krum(byzantine=5), updates, 2, list(range(24)))
    message = str(raised.value)
    assert "krum with f = 5 counts Byzantine buckets" in message and "T > 2f + 2 = 12" in message
    assert "T = ⌈24/2⌉ = 12 buckets" in message and "lower robust.bucket_size to at most 1" in message
    assert "sample at least 25 clients per round" in message and "lower robust.byzantine to at most 4" in message
    bucketed_aggregate(Krum(byzantine=5), torch.zeros(25, 1, dtype=torch.float64), 2, list(range(25)))  # the paper's
    with pytest.raises(ValueError, match=r"bulyan .* needs T ≥ 4f \+ 3 = 7 buckets.*at most 2"):
        bucketed_aggregate(Bulyan(byzantine=1), torch.zeros(13, 1, dtype=torch.float64), 3, list(range(13)))
    with pytest.raises(ValueError, match=r"on the 3 bucket means of the round's 5 updates .* selected m = 4 exceeds"):
        bucketed_aggregate(MultiKrum(byzantine=0, selected=4), UPDATES, 2, PERMUTATION)


def test_centered_clipping_forms_each_clients_momentum_before_bucketing():
    rule = CenteredClipping(radius=1.0, momentum=0.5)
    state = CenteredClippingState(None, {0: torch.tensor([2.0, 0.0], dtype=torch.float64)})
    updates = torch.tensor([[4.0, 0.0], [0.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    result = bucketed_aggregate(rule, updates, 2, [1, 0, 2], state=state, client_ids=[0, 1, 2])
    # m_0 = ½(4,0) + ½(2,0) = (3,0), m_1 = (0,0), m_2 = (0,2) (first reports); buckets {1,0}: (1.5,0), {2}: (0,2)
    # around v⁰ = 0 with τ = 1: clip factors 2/3 and 1/2, v¹ = ½((1,0) + (0,1))
    assert torch.allclose(result.aggregate, torch.tensor([0.5, 0.5], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(result.scale, torch.tensor([2 / 3, 2 / 3, 0.5], dtype=torch.float64), rtol=1e-15, atol=0)
    assert torch.equal(result.state.centre, result.aggregate)
    assert sorted(result.state.momenta) == [0, 1, 2]
    assert torch.equal(result.state.momenta[0], torch.tensor([3.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="needs client_ids"):
        bucketed_aggregate(rule, updates, 2, [1, 0, 2])


def test_the_permutation_is_a_function_of_seed_and_round_alone():
    first = bucket_permutation(seed=3, round_index=5, n=25)
    assert first == bucket_permutation(seed=3, round_index=5, n=25) and sorted(first) == list(range(25))
    assert first == generator(3, Stream.ROBUST_BUCKETING, 5).permutation(25).tolist()
    assert first != bucket_permutation(seed=3, round_index=6, n=25) != bucket_permutation(seed=4, round_index=6, n=25)
    # the stream is new, after every other one: no other stream's draws move
    assert Stream.ROBUST_BUCKETING == max(Stream) and list(Stream).count(Stream.ROBUST_BUCKETING) == 1


def test_the_inputs_are_checked():
    with pytest.raises(ValueError, match="bucket_size s must be a positive integer"):
        bucketed_aggregate(Median(), UPDATES, 0, PERMUTATION)
    with pytest.raises(ValueError, match=r"a permutation of 0 … n − 1 \(n = 5\)"):
        bucketed_aggregate(Median(), UPDATES, 2, [0, 0, 1, 2, 3])
    with pytest.raises(ValueError, match="5 updates but a permutation of 4 positions"):
        bucket_means(UPDATES, [0, 1, 2, 3], 2)
