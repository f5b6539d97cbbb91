"""Smoothed Weiszfeld (RFA): known geometric medians, weights, the record of down-weighted clients."""

from __future__ import annotations

import math

import pytest
import torch

from driftlab.robust.geometric_median import GeometricMedian, geometric_median

F64 = torch.float64


def test_converges_to_the_fermat_point_of_an_isosceles_triangle():
    # (−1, 0), (1, 0), (0, 3): every angle < 120°, so the median is the point that sees the base at 120°: (0, 1/√3).
    # The mean is (0, 1).
    x = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, 3.0]], dtype=F64)
    result = geometric_median(GeometricMedian(iterations=300, tolerance=0.0), x)
    torch.testing.assert_close(result.aggregate, torch.tensor([0.0, 1 / math.sqrt(3)], dtype=F64), rtol=0, atol=1e-12)


def test_a_line_of_points_gives_the_median_and_down_weights_the_far_one():
    result = geometric_median(
        GeometricMedian(iterations=500, tolerance=0.0), torch.tensor([[0.0], [1.0], [10.0]], dtype=F64)
    )
    assert abs(result.aggregate.item() - 1.0) < 1e-5
    assert result.scale[2].item() < 0.01 and result.down_weighted[2].item()
    assert result.kept.tolist() == [1.0, 1.0, 1.0]


def test_weights_move_the_median_to_a_majority_point():
    weights = torch.tensor([3.0, 1.0, 1.0])  # client 0 holds 3/5 > 1/2 of the weight: the weighted median is 0
    result = geometric_median(
        GeometricMedian(iterations=500, tolerance=0.0), torch.tensor([[0.0], [1.0], [10.0]], dtype=F64), weights
    )
    assert abs(result.aggregate.item()) < 1e-5


def test_identical_updates_give_that_update():
    x = torch.tensor([[0.5, -2.0]], dtype=F64).repeat(4, 1)
    result = geometric_median(GeometricMedian(), x)
    assert torch.equal(result.aggregate, x[0])
    assert result.scale.tolist() == [1.0] * 4


def test_early_stop_and_settings_errors():
    x = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, 3.0]], dtype=F64)
    one = geometric_median(GeometricMedian(iterations=1), x).aggregate
    # one step from the mean (0, 1): distances √2, √2, 2, weights ∝ 1/√2, 1/√2, 1/2
    expected_y = 3 * 0.5 / (2 / math.sqrt(2) + 0.5)
    torch.testing.assert_close(one, torch.tensor([0.0, expected_y], dtype=F64), rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError, match="smoothing"):
        GeometricMedian(smoothing=0.0)
    with pytest.raises(ValueError, match="iterations"):
        GeometricMedian(iterations=0)
