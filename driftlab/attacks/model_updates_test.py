"""Model-update attacks, by the package's public names: hand cases, ALIE's z_max against the paper's formula, IPM's
negative inner product, min-max/min-sum's γ at the constraint's boundary, seeded noise."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from driftlab import attacks
from driftlab.attacks.byzantine import noise_generator

F64 = torch.float64
# μ = 2, σ = √7 (Bessel), largest pairwise distance 5; Σ_j (x_i − x_j)² = 26, 17, 41
LINE = torch.tensor([[0.0], [1.0], [5.0]], dtype=F64)


def test_sign_flip_and_scaling_by_hand():
    x = torch.tensor([1.0, -2.0], dtype=F64)
    assert attacks.forge(attacks.SignFlip(), x).tolist() == [-1.0, 2.0]
    assert attacks.forge(attacks.SignFlip(scale=2.0), x).tolist() == [-2.0, 4.0]
    assert attacks.forge(attacks.Scaled(factor=-3.0), x).tolist() == [-3.0, 6.0]


def test_alie_z_max_for_50_clients_and_12_attackers_is_the_papers_formula():
    # s = ⌊50/2 + 1⌋ − 12 = 14 supporters; z_max = Φ⁻¹((50 − 14)/50) = Φ⁻¹(0.72)
    assert attacks.alie_z_max(50, 12) == pytest.approx(0.5828415072712162, abs=1e-15)
    assert attacks.alie_z_max(50, 12) == pytest.approx(statistics.NormalDist().inv_cdf(0.72), abs=1e-15)
    assert attacks.alie_z_max(25, 5) == pytest.approx(statistics.NormalDist().inv_cdf((25 - 8) / 25), abs=1e-15)


def test_alie_forges_mean_minus_z_std_by_hand():
    honest = torch.tensor([[1.0, 0.0], [3.0, 4.0]], dtype=F64)  # μ = (2, 2), σ = (√2, 2√2)
    forged = attacks.forge(attacks.LittleIsEnough(z=1.0), honest_updates=honest)
    torch.testing.assert_close(
        forged, torch.tensor([2 - math.sqrt(2), 2 - 2 * math.sqrt(2)], dtype=F64), rtol=0, atol=1e-15
    )
    from_paper = attacks.forge(attacks.LittleIsEnough(), honest_updates=honest, num_clients=50, num_byzantine=12)
    torch.testing.assert_close(from_paper, honest.mean(0) - attacks.alie_z_max(50, 12) * honest.std(0), rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_clients"):
        attacks.forge(attacks.LittleIsEnough(), honest_updates=honest)


def test_ipm_has_a_negative_inner_product_with_the_honest_mean():
    honest = torch.tensor([[1.0, 2.0], [3.0, 2.0]], dtype=F64)  # μ = (2, 2)
    forged = attacks.forge(attacks.InnerProduct(epsilon=0.5), honest_updates=honest)
    assert forged.tolist() == [-1.0, -1.0]
    assert torch.dot(forged, honest.mean(0)).item() == -4.0  # −ε‖μ‖²


@pytest.mark.parametrize(
    ("settings", "gamma"),
    [
        (attacks.MinMax(direction="unit"), 2.0),  # max_i |2 − γ − x_i| = 3 + γ ≤ 5
        (attacks.MinMax(direction="sign"), 2.0),
        (attacks.MinMax(direction="std"), 2 / math.sqrt(7)),  # 3 + γ√7 ≤ 5
        (attacks.MinSum(direction="unit"), 1.0),  # (2 − γ)² + (1 − γ)² + (3 + γ)² = 14 + 3γ² ≤ min 17
        (attacks.MinSum(direction="unit", bound="max"), 3.0),  # 14 + 3γ² ≤ max 41
    ],
)
def test_min_max_and_min_sum_find_the_largest_gamma_meeting_the_constraint(settings, gamma):
    found = attacks.min_max_gamma(settings, LINE)
    assert gamma - 2 * settings.tolerance <= found <= gamma
    forged = attacks.forge(settings, honest_updates=LINE)
    distances = ((LINE - forged) ** 2).sum(dim=1)
    if isinstance(settings, attacks.MinMax):
        assert distances.max().item() <= 25.0
    else:
        assert distances.sum().item() <= (17.0 if settings.bound == "min" else 41.0)


def test_the_search_never_looks_beyond_twice_gamma_init():
    found = attacks.min_max_gamma(
        attacks.MinSum(bound="max", gamma_init=1.0), LINE
    )  # feasible up to 3, searched up to 2
    assert 2.0 - 2e-5 <= found <= 2.0


def test_gaussian_noise_is_seeded_by_seed_round_and_client():
    x = torch.zeros(1000, dtype=F64)
    settings = attacks.GaussianNoise(std=2.0)
    first = attacks.forge(settings, x, generator=noise_generator(seed=5, round_index=3, client_id=4))
    again = attacks.forge(settings, x, generator=noise_generator(seed=5, round_index=3, client_id=4))
    next_round = attacks.forge(settings, x, generator=noise_generator(seed=5, round_index=4, client_id=4))
    other_client = attacks.forge(settings, x, generator=noise_generator(seed=5, round_index=3, client_id=5))
    assert torch.equal(first, again)
    assert not torch.equal(first, next_round) and not torch.equal(first, other_client)
    assert 1.8 < first.std().item() < 2.2
    around = attacks.forge(
        attacks.GaussianNoise(std=2.0, around_honest=True), x + 1, generator=noise_generator(5, 3, 4)
    )
    assert torch.equal(around, first + 1)


def test_refusals_name_what_is_missing():
    with pytest.raises(ValueError, match="omniscient"):
        attacks.forge(attacks.InnerProduct(epsilon=0.1), torch.ones(2))
    with pytest.raises(ValueError, match="seeded generator"):
        attacks.forge(attacks.GaussianNoise(std=1.0), torch.ones(2))
    with pytest.raises(ValueError, match="pass honest_update"):
        attacks.forge(attacks.SignFlip())
    with pytest.raises(ValueError, match="direction"):
        attacks.MinMax(direction="up")
    assert set(attacks.ATTACKS) == {"sign_flip", "scaled", "gaussian_noise", "alie", "ipm", "min_max", "min_sum"}
