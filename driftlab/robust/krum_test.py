"""Krum, multi-Krum and Bulyan: hand-computed scores and selections, requirements, permutations."""

from __future__ import annotations

import pytest
import torch

from driftlab.robust.krum import Bulyan, Krum, MultiKrum, bulyan, krum, multi_krum, squared_distances

F64 = torch.float64
LINE = torch.tensor([[0.0], [1.0], [2.0], [100.0], [101.0]], dtype=F64)  # n = 5, f = 1: n − f − 2 = 2 neighbours


def test_krum_scores_and_pick_by_hand():
    result = krum(Krum(byzantine=1), LINE)
    # 0: 1 + 4; 1: 1 + 1; 2: 1 + 4; 100: 1 + 98²; 101: 1 + 99²
    assert result.scores.tolist() == [5.0, 2.0, 5.0, 9605.0, 9802.0]
    assert torch.equal(result.aggregate, torch.tensor([1.0], dtype=F64))
    assert result.kept.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert result.dropped.tolist() == [True, False, True, True, True]


def test_multi_krum_breaks_ties_by_client_order_and_uses_the_weights_of_the_selected():
    # m = 2: client 1 (score 2), then clients 0 and 2 tie at 5 and client 0 comes first.
    uniform = multi_krum(MultiKrum(byzantine=1, selected=2), LINE)
    assert uniform.kept.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert torch.equal(uniform.aggregate, torch.tensor([0.5], dtype=F64))
    weighted = multi_krum(MultiKrum(byzantine=1, selected=2), LINE, torch.tensor([1.0, 3.0, 1.0, 1.0, 1.0]))
    assert torch.equal(weighted.aggregate, torch.tensor([0.75], dtype=F64))  # (1·0 + 3·1) / 4
    with pytest.raises(ValueError, match="weight 0"):
        multi_krum(MultiKrum(byzantine=1, selected=2), LINE, torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]))
    # Krum ignores weights: the lowest score wins even at weight 0
    assert krum(Krum(byzantine=1), LINE, torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])).aggregate.item() == 1.0
    default = multi_krum(MultiKrum(byzantine=1), LINE)  # m = n − f = 4 keeps the lower of the two attackers
    assert torch.equal(default.aggregate, torch.tensor([25.75], dtype=F64))  # (0 + 1 + 2 + 100) / 4


def test_krum_picks_the_honest_cluster_against_colluding_identical_attackers():
    honest = [[1.0, 1.0], [1.0, 2.0], [2.0, 1.0], [2.0, 2.0], [1.5, 1.5]]
    x = torch.tensor(honest + [[-10.0, -10.0], [-10.0, -10.0]], dtype=F64)  # n = 7, f = 2: 3 neighbours
    result = krum(Krum(byzantine=2), x)
    # the centre is 0.5 from each corner (score 1.5); a corner scores 0.5 + 1 + 1; an attacker 0 + 2 · 11²·2 + ...
    assert result.scores[4].item() == 1.5 and result.scores[0].item() == 2.5
    assert torch.equal(result.aggregate, torch.tensor([1.5, 1.5], dtype=F64))


def test_krum_refuses_too_few_clients_and_says_what_to_change():
    with pytest.raises(ValueError, match=r"n > 2f \+ 2 = 4 .* got n = 4.*at least 5 clients"):
        krum(Krum(byzantine=1), LINE[:4])
    with pytest.raises(ValueError, match="exceeds"):
        multi_krum(MultiKrum(byzantine=1, selected=6), LINE)
    with pytest.raises(ValueError, match="non-negative integer"):
        Krum(byzantine=-1)


def test_bulyan_on_seven_clients_with_one_attacker_by_hand():
    x = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [100.0]], dtype=F64)
    result = bulyan(Bulyan(byzantine=1), x)
    # θ = 5 picks, Krum on what remains each time: 2 (ties 3), 3, 1 (ties 4), 4, 0 (ties 5) — see
    # docs/update-rules.md for the scores; then β = 3 values closest to the median 2 of {0, 1, 2, 3, 4}: 1, 2, 3.
    assert torch.equal(result.aggregate, torch.tensor([2.0], dtype=F64))
    assert result.kept.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert result.scores.tolist()[:6] == [30.0, 15.0, 10.0, 10.0, 15.0, 30.0]


def test_bulyan_is_coordinate_wise_after_selection():
    x = torch.tensor(
        [[0.0, 9.0], [1.0, 0.0], [2.0, 1.0], [3.0, 2.0], [4.0, 3.0], [5.0, 4.0], [100.0, 100.0]], dtype=F64
    )
    result = bulyan(Bulyan(byzantine=1), x)
    # picks 3, 2, 4 (ties 2), 1, then 0 over 5 (both 50 from each other); coordinate 0: {0,1,2,3,4}, median 2, keeps
    # 2, 1, 3; coordinate 1: {9,0,1,2,3}, median 2, keeps 2, 1, 3 (clients 3, 2, 4): client 0 is selected but trimmed.
    assert torch.equal(result.aggregate, torch.tensor([2.0, 2.0], dtype=F64))
    assert result.kept.tolist() == [0.0, 0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    assert result.down_weighted.tolist() == [False, True, False, False, True, False, False]


def test_bulyan_refuses_fewer_than_4f_plus_3():
    with pytest.raises(ValueError, match=r"n ≥ 4f \+ 3 = 7.*got n = 6"):
        bulyan(Bulyan(byzantine=1), torch.zeros(6, 2))


def test_squared_distances_are_exact():
    x = torch.tensor([[1e8, 1.0], [1e8, 2.0]], dtype=F64)  # the Gram form would lose the 1 to cancellation
    assert squared_distances(x).tolist() == [[0.0, 1.0], [1.0, 0.0]]


@pytest.mark.parametrize(
    ("rule", "settings"),
    [(krum, Krum(byzantine=2)), (multi_krum, MultiKrum(byzantine=2)), (bulyan, Bulyan(byzantine=2))],
)
def test_permutation_invariance_without_ties(rule, settings):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(11, 6, generator=generator, dtype=F64)
    order = torch.randperm(11, generator=generator)
    plain, permuted = rule(settings, x), rule(settings, x[order])
    torch.testing.assert_close(plain.aggregate, permuted.aggregate, rtol=1e-14, atol=1e-14)
    assert torch.equal(plain.kept[order], permuted.kept)
