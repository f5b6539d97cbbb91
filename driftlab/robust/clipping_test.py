"""Norm bounding and centered clipping: hand cases, the mean at large τ, bounded moves at small τ, state, momentum."""

from __future__ import annotations

import math

import pytest
import torch

from driftlab.robust.clipping import (
    CenteredClipping,
    CenteredClippingState,
    NormBound,
    centered_clipping,
    norm_bound,
)

F64 = torch.float64


def test_norm_bound_by_hand():
    result = norm_bound(NormBound(max_norm=1.0), torch.tensor([[3.0, 4.0], [0.0, 1.0]], dtype=F64))
    torch.testing.assert_close(result.aggregate, torch.tensor([0.3, 0.9], dtype=F64), rtol=0, atol=1e-15)
    assert result.scale.tolist() == [0.2, 1.0]
    assert result.down_weighted.tolist() == [True, False]


def test_centered_clipping_with_a_large_radius_is_the_weighted_mean():
    x = torch.tensor([[1.0, 2.0], [3.0, 6.0]], dtype=F64)
    assert torch.equal(
        centered_clipping(CenteredClipping(radius=math.inf), x).aggregate, torch.tensor([2.0, 4.0], dtype=F64)
    )
    weighted = centered_clipping(CenteredClipping(radius=100.0), x, torch.tensor([3.0, 1.0]))
    assert torch.equal(weighted.aggregate, torch.tensor([1.5, 3.0], dtype=F64))


def test_centered_clipping_with_a_small_radius_moves_at_most_tau_per_iteration():
    x = torch.tensor([[3.0, 4.0], [6.0, 8.0]], dtype=F64)  # ‖x_i − 0‖ = 5, 10
    one = centered_clipping(CenteredClipping(radius=1.0), x)
    torch.testing.assert_close(one.aggregate, torch.tensor([0.6, 0.8], dtype=F64), rtol=0, atol=1e-15)
    assert one.scale.tolist() == [0.2, 0.1]
    two = centered_clipping(CenteredClipping(radius=1.0, iterations=2), x)  # ‖x_i − v¹‖ = 4, 9: another unit step
    torch.testing.assert_close(two.aggregate, torch.tensor([1.2, 1.6], dtype=F64), rtol=0, atol=1e-15)
    generator = torch.Generator().manual_seed(0)
    attacked = torch.cat([torch.randn(5, 4, generator=generator, dtype=F64), torch.full((2, 4), 1e4, dtype=F64)])
    for iterations in (1, 3):
        moved = centered_clipping(CenteredClipping(radius=0.5, iterations=iterations), attacked).aggregate
        assert torch.linalg.vector_norm(moved).item() <= 0.5 * iterations + 1e-12


def test_the_centre_is_the_last_aggregate():
    first = centered_clipping(CenteredClipping(radius=1.0), torch.tensor([[3.0, 4.0]], dtype=F64))
    assert torch.equal(first.state.centre, first.aggregate)
    again = centered_clipping(CenteredClipping(radius=1.0), torch.tensor([[3.0, 4.0]], dtype=F64), state=first.state)
    torch.testing.assert_close(again.aggregate, torch.tensor([1.2, 1.6], dtype=F64), rtol=0, atol=1e-15)
    still = centered_clipping(
        CenteredClipping(radius=1e-9),
        torch.tensor([[3.0, 4.0]] * 2, dtype=F64),
        state=CenteredClippingState(torch.tensor([3.0, 4.0], dtype=F64)),
    )
    assert torch.equal(still.aggregate, torch.tensor([3.0, 4.0], dtype=F64))


def test_momentum_starts_at_the_first_report_and_is_kept_per_client():
    settings = CenteredClipping(radius=math.inf, momentum=0.5)
    first = centered_clipping(settings, torch.tensor([[2.0], [4.0]], dtype=F64), client_ids=[7, 9])
    assert torch.equal(first.aggregate, torch.tensor([3.0], dtype=F64))
    # round 2: client 9 reports 0 (momentum 0.5·0 + 0.5·4 = 2), client 3 is new (momentum = its report, 10)
    second = centered_clipping(settings, torch.tensor([[0.0], [10.0]], dtype=F64), state=first.state, client_ids=[9, 3])
    assert torch.equal(second.aggregate, torch.tensor([6.0], dtype=F64))
    assert sorted(second.state.momenta) == [3, 7, 9]
    assert second.state.momenta[7].item() == 2.0 and second.state.momenta[9].item() == 2.0


def test_errors_say_what_to_change():
    with pytest.raises(ValueError, match="needs client_ids"):
        centered_clipping(CenteredClipping(radius=1.0, momentum=0.9), torch.ones(2, 2))
    with pytest.raises(ValueError, match="radius"):
        CenteredClipping(radius=0.0)
    with pytest.raises(ValueError, match="momentum"):
        CenteredClipping(radius=1.0, momentum=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        NormBound(max_norm=-1.0)
