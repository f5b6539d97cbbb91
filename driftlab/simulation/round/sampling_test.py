"""Seeded client sampling: uniform without replacement, n_k/n-weighted draws with multiplicity, and poisson."""

from __future__ import annotations

import numpy as np
import pytest

from driftlab.randomness import Stream
from driftlab.simulation.round.sampling import clients_per_round, over_selected, sample_clients


def test_clients_per_round_is_max_one_round_pn():
    assert clients_per_round(0.1, 30) == 3
    assert clients_per_round(0.2, 30) == 6
    assert clients_per_round(1.0, 7) == 7
    assert clients_per_round(0.01, 30) == 1  # round(0.3) = 0 -> at least one
    assert clients_per_round(0.26, 10) == 3


def test_uniform_without_replacement():
    registered = np.arange(20)
    sizes = np.arange(1, 21)
    for t in range(1, 30):
        sample = sample_clients(5, t, registered, sizes, 0.25, "uniform")
        ids = sample.client_ids
        assert len(ids) == 5
        assert len(np.unique(ids)) == 5
        assert np.all(np.diff(ids) > 0)  # sorted, unique
        assert set(ids.tolist()) <= set(registered.tolist())
        assert sample.multiplicity.tolist() == [1] * 5
        assert ids.dtype == np.int64


def test_uniform_samples_from_the_registered_ids_not_positions():
    registered = np.array([3, 7, 10, 12, 40])
    sample = sample_clients(0, 1, registered, np.ones(5), 0.6, "uniform")
    assert len(sample.client_ids) == 3
    assert set(sample.client_ids.tolist()) <= {3, 7, 10, 12, 40}


def test_sampling_is_a_function_of_seed_and_round():
    registered, sizes = np.arange(30), np.full(30, 10)
    for mode in ("uniform", "weighted", "poisson"):
        a = sample_clients(1, 4, registered, sizes, 0.2, mode)
        b = sample_clients(1, 4, registered, sizes, 0.2, mode)
        assert np.array_equal(a.client_ids, b.client_ids) and np.array_equal(a.multiplicity, b.multiplicity)
        by_round = {tuple(sample_clients(1, t, registered, sizes, 0.2, mode).client_ids) for t in range(1, 11)}
        assert len(by_round) > 5  # different rounds draw different clients
        by_seed = {tuple(sample_clients(s, 4, registered, sizes, 0.2, mode).client_ids) for s in range(10)}
        assert len(by_seed) > 5


def test_uniform_inclusion_frequency_is_m_over_n():
    registered, sizes = np.arange(10), np.arange(1, 11)
    counts = np.zeros(10)
    rounds = 3000
    for t in range(1, rounds + 1):
        counts[sample_clients(11, t, registered, sizes, 0.3, "uniform").client_ids] += 1
    # each client is in a round's sample with probability 3/10, whatever its size
    assert np.allclose(counts / rounds, 0.3, atol=0.04)


def test_weighted_draws_have_frequency_n_k_over_n():
    registered = np.arange(6)
    sizes = np.array([1, 2, 3, 4, 10, 30])
    draws = np.zeros(6)
    rounds = 2000
    for t in range(1, rounds + 1):
        sample = sample_clients(7, t, registered, sizes, 0.5, "weighted")
        assert sample.multiplicity.sum() == 3  # K = round(0.5·6) draws with replacement
        assert np.all(np.diff(sample.client_ids) > 0)
        assert np.all(sample.multiplicity >= 1)
        draws[sample.client_ids] += sample.multiplicity
    frequency = draws / draws.sum()
    assert np.allclose(frequency, sizes / sizes.sum(), atol=0.02)


def test_weighted_mode_counts_repeated_draws():
    # one dominant client: it is drawn several times in a round and reported once with its multiplicity
    registered, sizes = np.arange(4), np.array([1000, 1, 1, 1])
    sample = sample_clients(0, 1, registered, sizes, 1.0, "weighted")
    assert sample.multiplicity.sum() == 4
    assert 0 in sample.client_ids.tolist()
    assert sample.multiplicity[sample.client_ids.tolist().index(0)] >= 2
    assert len(sample.client_ids) < 4


def test_sampling_errors():
    with pytest.raises(ValueError, match="uniform, weighted, poisson"):
        sample_clients(0, 1, np.arange(3), np.ones(3), 0.5, "stratified")
    with pytest.raises(ValueError, match="no registered clients"):
        sample_clients(0, 1, np.array([], dtype=np.int64), np.array([]), 0.5, "uniform")


# ------------------------------------------------------------------ poisson


def _uniform_draws(seed: int, round_index: int, count: int) -> np.ndarray:
    """The round's draws written out from the generator's definition: (seed, stream, round, client id + 1)."""
    entropy = (seed, int(Stream.CLIENT_SAMPLING), round_index, 0)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy))).random(count)


def test_poisson_takes_the_clients_whose_own_draw_is_below_q():
    draws = _uniform_draws(5, 3, 8)
    # by hand: the draws are 0.767 0.778 0.476 0.171 0.592 0.383 0.785 0.852, so q = 0.4 takes clients 3 and 5
    assert np.round(draws, 3).tolist() == [0.767, 0.778, 0.476, 0.171, 0.592, 0.383, 0.785, 0.852]
    sample = sample_clients(5, 3, np.arange(8), np.ones(8), 0.4, "poisson")
    assert sample.client_ids.tolist() == [3, 5]
    assert sample.multiplicity.tolist() == [1, 1]
    assert sample.client_ids.dtype == np.int64 and sample.multiplicity.dtype == np.int64


def test_poisson_gives_the_kth_registered_client_the_kth_draw_whatever_the_others_do():
    registered = np.array([3, 7, 10, 12, 40, 41])
    draws = _uniform_draws(2, 9, len(registered))
    for q in (0.1, 0.3, 0.5, 0.7, 0.9):
        sample = sample_clients(2, 9, registered, np.ones(6), q, "poisson")
        assert sample.client_ids.tolist() == registered[draws < q].tolist()
    # so a larger q keeps every client a smaller one took (each client's coin is its own draw)
    small = set(sample_clients(2, 9, registered, np.ones(6), 0.2, "poisson").client_ids.tolist())
    large = set(sample_clients(2, 9, registered, np.ones(6), 0.6, "poisson").client_ids.tolist())
    assert small <= large


def test_poisson_may_select_nobody_and_q_one_selects_everybody():
    registered, sizes = np.arange(20), np.ones(20)
    samples = [sample_clients(0, t, registered, sizes, 0.05, "poisson") for t in range(1, 30)]
    empty = [sample for sample in samples if len(sample.client_ids) == 0]
    assert len(empty) >= 5  # (0.95)^20 = 0.36 of the rounds
    assert all(sample.client_ids.shape == (0,) and sample.multiplicity.shape == (0,) for sample in empty)
    assert all(sample.client_ids.dtype == np.int64 for sample in empty)
    assert {len(sample.client_ids) for sample in samples} >= {0, 1, 2}  # the cohort's size varies
    everybody = sample_clients(0, 1, np.array([4, 9, 11]), np.ones(3), 1.0, "poisson")
    assert everybody.client_ids.tolist() == [4, 9, 11]


def test_poisson_counts_are_binomial_n_q():
    n, q, rounds = 40, 0.1, 3000
    registered, sizes = np.arange(n), np.arange(1, n + 1)
    counts = np.array(
        [len(sample_clients(13, t, registered, sizes, q, "poisson").client_ids) for t in range(1, rounds + 1)]
    )
    variance = n * q * (1 - q)  # 3.6
    # the mean of 3000 Binomial(40, 0.1) counts is 4 with standard error √(3.6/3000) = 0.035: 4 standard errors
    assert abs(counts.mean() - n * q) < 4 * np.sqrt(variance / rounds)
    assert counts.var() == pytest.approx(variance, rel=0.1)  # a fixed-size cohort would have no variance
    # P(nobody) = 0.9^40 = 0.0148: about 44 of 3000 rounds, standard deviation 6.6
    assert abs((counts == 0).sum() - rounds * (1 - q) ** n) < 4 * np.sqrt(rounds * (1 - q) ** n)
    inclusion = np.zeros(n)
    for t in range(1, 1001):
        inclusion[sample_clients(13, t, registered, sizes, q, "poisson").client_ids] += 1
    assert np.allclose(inclusion / 1000, q, atol=4 * np.sqrt(q * (1 - q) / 1000))  # whatever n_k


# ------------------------------------------------------------------ over-selection (count)


def test_a_count_of_m_draws_exactly_the_default_sample():
    registered, sizes = np.arange(3, 40, 2), np.arange(1, 20)
    for mode in ("uniform", "weighted"):
        for t in range(1, 6):
            default = sample_clients(2, t, registered, sizes, 0.3, mode)
            counted = sample_clients(2, t, registered, sizes, 0.3, mode, count=clients_per_round(0.3, len(registered)))
            assert np.array_equal(default.client_ids, counted.client_ids)
            assert np.array_equal(default.multiplicity, counted.multiplicity)


def test_a_larger_count_draws_more_clients_or_draws():
    registered, sizes = np.arange(20), np.arange(1, 21)
    uniform = sample_clients(4, 1, registered, sizes, 0.25, "uniform", count=8)
    assert len(uniform.client_ids) == 8 and uniform.multiplicity.tolist() == [1] * 8
    weighted = sample_clients(4, 1, registered, sizes, 0.25, "weighted", count=8)
    assert int(weighted.multiplicity.sum()) == 8


def test_over_selected_is_the_ceiling_of_one_plus_f_times_m():
    assert over_selected(10, 0.0, 100, "uniform") == 10
    assert over_selected(10, 0.1, 100, "uniform") == 11  # 1.1 · 10 is 11.000000000000002 in floating point
    assert over_selected(10, 0.25, 100, "uniform") == 13  # ⌈12.5⌉
    assert over_selected(3, 1 / 3, 100, "weighted") == 4
    assert over_selected(10, 0.5, 12, "uniform") == 12  # at most every registered client
    assert over_selected(10, 0.5, 12, "weighted") == 15  # draws with replacement are not capped
    assert over_selected(1, 0.0, 5, "poisson") == 1


def test_count_and_over_selection_errors():
    with pytest.raises(ValueError, match="poisson cohort has no fixed size"):
        over_selected(4, 0.5, 10, "poisson")
    with pytest.raises(ValueError, match="at least 0"):
        over_selected(4, -0.5, 10, "uniform")
    with pytest.raises(ValueError, match="a poisson sample has no count"):
        sample_clients(0, 1, np.arange(5), np.ones(5), 0.5, "poisson", count=2)
    with pytest.raises(ValueError, match="cannot draw 6 clients from 5"):
        sample_clients(0, 1, np.arange(5), np.ones(5), 0.5, "uniform", count=6)
    with pytest.raises(ValueError, match="cannot draw 0 clients"):
        sample_clients(0, 1, np.arange(5), np.ones(5), 0.5, "weighted", count=0)
