"""Coordinate-wise median and trimmed mean: hand cases, ties, the honest hull under attack, permutations."""

from __future__ import annotations

import pytest
import torch

from driftlab.robust.coordinatewise import Median, TrimmedMean, median, trim_count, trimmed_mean

F64 = torch.float64


def test_median_of_three_vectors_by_hand():
    x = torch.tensor([[1.0, 5.0, -1.0], [3.0, 2.0, 0.0], [2.0, 9.0, 4.0]], dtype=F64)
    result = median(Median(), x)
    assert torch.equal(result.aggregate, torch.tensor([2.0, 5.0, 0.0], dtype=F64))
    # client 0 is the middle value in coordinate 1, client 1 in coordinate 2, client 2 in coordinate 0
    assert torch.equal(result.kept, torch.tensor([1 / 3, 1 / 3, 1 / 3], dtype=F64))
    assert not bool(result.dropped.any())


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values():
    result = median(Median(), torch.tensor([[1.0], [2.0], [3.0], [10.0]], dtype=F64))
    assert torch.equal(result.aggregate, torch.tensor([2.5], dtype=F64))
    assert result.kept.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert result.dropped.tolist() == [True, False, False, True]


def test_ties_go_to_client_order():
    result = median(Median(), torch.tensor([[1.0], [1.0], [1.0]], dtype=F64))
    assert result.kept.tolist() == [0.0, 1.0, 0.0]  # the stable sort keeps 0, 1, 2: the middle one is client 1


def test_trimmed_mean_by_hand():
    # β = 0.2 of n = 5 trims k = 1 value from each side of each coordinate.
    x = torch.tensor([[1.0, -50.0], [2.0, 0.0], [3.0, 1.0], [4.0, 2.0], [100.0, 3.0]], dtype=F64)
    result = trimmed_mean(TrimmedMean(beta=0.2), x)
    assert torch.equal(result.aggregate, torch.tensor([3.0, 1.0], dtype=F64))  # (2+3+4)/3, (0+1+2)/3
    assert result.kept.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_trimmed_mean_with_beta_zero_is_the_mean():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [8.0, -6.0], [0.0, 0.0]], dtype=F64)
    assert torch.equal(trimmed_mean(TrimmedMean(beta=0.0), x).aggregate, torch.tensor([3.0, 0.0], dtype=F64))


def test_trim_count_survives_floating_point():
    assert trim_count(0.29, 100) == 29  # 0.29 * 100 = 28.999999999999996
    assert trim_count(0.2, 5) == 1 and trim_count(0.19, 5) == 0


def test_beta_of_one_half_is_refused_with_the_range():
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        TrimmedMean(beta=0.5)


def test_non_finite_updates_and_bad_weights_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        median(Median(), torch.tensor([[1.0], [float("nan")]]))
    with pytest.raises(ValueError, match="one weight per update"):
        median(Median(), torch.ones(3, 2), torch.ones(2))
    with pytest.raises(ValueError, match=r"\[n, d\]"):
        median(Median(), torch.ones(3))


@pytest.mark.parametrize(("rule", "settings"), [(median, Median()), (trimmed_mean, TrimmedMean(beta=0.3))])
def test_under_f_attackers_the_result_stays_in_the_honest_hull(rule, settings):
    generator = torch.Generator().manual_seed(4)
    honest = torch.randn(7, 20, generator=generator, dtype=F64)
    attackers = torch.tensor([1e6, -1e6, 1e6], dtype=F64).unsqueeze(1) * torch.ones(3, 20, dtype=F64)
    result = rule(settings, torch.cat([honest, attackers]))  # n = 10, f = 3 < n/2, and f ≤ ⌊0.3·10⌋
    assert bool((result.aggregate >= honest.min(dim=0).values).all())
    assert bool((result.aggregate <= honest.max(dim=0).values).all())


@pytest.mark.parametrize(("rule", "settings"), [(median, Median()), (trimmed_mean, TrimmedMean(beta=0.25))])
def test_permuting_the_clients_permutes_the_record_and_keeps_the_aggregate(rule, settings):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, generator=generator, dtype=F64)
    order = torch.randperm(8, generator=generator)
    plain, permuted = rule(settings, x), rule(settings, x[order])
    assert torch.equal(plain.aggregate, permuted.aggregate)
    assert torch.equal(plain.kept[order], permuted.kept)
