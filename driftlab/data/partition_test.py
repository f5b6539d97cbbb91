"""Tests for quota rules and partitions (benchmarks.md, "Partitions")."""

import numpy as np
import pytest

from driftlab.data.federated import classes_covering_fraction
from driftlab.data.partition import (
    _raise_empty_clients,
    balanced_quotas,
    dirichlet_client_prior_partition,
    iid_partition,
    lognormal_quotas,
)


def _assert_partition(parts, quotas, num_samples, *, covers_all=True):
    """Disjoint, sorted int64 arrays of exactly the quota sizes (covering all samples if asked)."""
    assert [len(p) for p in parts] == list(quotas)
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    used = np.concatenate(parts)
    assert len(np.unique(used)) == len(used), "a sample is given to two clients"
    assert used.min() >= 0 and used.max() < num_samples
    if covers_all:
        assert len(used) == num_samples


def _balanced_labels(num_classes, per_class):
    return np.repeat(np.arange(num_classes), per_class)


# --- quotas ---------------------------------------------------------------


@pytest.mark.parametrize(
    "num_samples, num_clients, expected",
    [(10, 4, [3, 3, 2, 2]), (12, 4, [3, 3, 3, 3]), (5, 5, [1, 1, 1, 1, 1]), (7, 1, [7])],
)
def test_balanced_quotas(num_samples, num_clients, expected):
    quotas = balanced_quotas(num_samples, num_clients)
    assert quotas.dtype == np.int64
    assert quotas.tolist() == expected


def test_lognormal_sigma_zero_is_balanced_with_remainder_on_client_zero():
    # Equal draws: floor(10 / 4) = 2 each, the remainder 2 goes to client 0 (authors' code).
    quotas = lognormal_quotas(10, 4, sigma=0.0, rng=np.random.default_rng(0))
    assert quotas.tolist() == [4, 2, 2, 2]
    assert lognormal_quotas(60000, 100, 0.0, np.random.default_rng(0)).tolist() == [600] * 100


def test_lognormal_quotas_sum_exactly_and_spread_like_sigma():
    quotas = lognormal_quotas(50000, 1000, sigma=0.3, rng=np.random.default_rng(1))
    assert quotas.dtype == np.int64
    assert quotas.sum() == 50000
    assert quotas.min() >= 1
    # The coefficient of variation of LogNormal(., 0.3) is sqrt(exp(0.09) - 1) = 0.307,
    # FedDyn's "standard deviation of device sample size of 0.3".
    others = quotas[1:]
    assert 0.27 < others.std() / others.mean() < 0.34
    # The authors' remainder rule: flooring 1000 shares loses about 500
    # samples, all of which go to client 0 (mean size 50).
    assert quotas[0] > 400


def test_lognormal_quotas_deterministic_given_rng():
    first = lognormal_quotas(1000, 17, 0.5, np.random.default_rng(3))
    second = lognormal_quotas(1000, 17, 0.5, np.random.default_rng(3))
    np.testing.assert_array_equal(first, second)


def test_lognormal_quotas_never_leave_a_client_empty():
    # sigma = 5 over 20 samples and 10 clients: most clients round down to 0.
    quotas = lognormal_quotas(20, 10, sigma=5.0, rng=np.random.default_rng(0))
    assert quotas.sum() == 20
    assert quotas.min() >= 1
    assert lognormal_quotas(10, 10, sigma=5.0, rng=np.random.default_rng(0)).tolist() == [1] * 10


def test_raise_empty_clients_takes_from_the_largest():
    # client 1 takes one from client 0 (5 -> 4), client 3 takes another (4 -> 3).
    assert _raise_empty_clients(np.array([5, 0, 1, 0])).tolist() == [3, 1, 1, 1]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: balanced_quotas(3, 5), "5 clients at least one sample from only 3"),
        (lambda: balanced_quotas(3, 0), "num_clients must be at least 1"),
        (lambda: lognormal_quotas(3, 5, 0.3, np.random.default_rng(0)), "from only 3"),
        (lambda: lognormal_quotas(30, 5, -0.1, np.random.default_rng(0)), "sigma must be a finite number >= 0"),
        (lambda: lognormal_quotas(30, 5, float("nan"), np.random.default_rng(0)), "sigma must be"),
        (lambda: lognormal_quotas(30, 5, 1e6, np.random.default_rng(0)), "too large"),
    ],
)
def test_quota_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- IID ------------------------------------------------------------------


def test_iid_partition_is_a_partition_of_the_quotas():
    quotas = np.array([5, 3, 2])
    parts = iid_partition(10, quotas, np.random.default_rng(0))
    _assert_partition(parts, quotas, 10)


def test_iid_partition_with_smaller_total_leaves_samples_unassigned():
    parts = iid_partition(10, np.array([2, 2]), np.random.default_rng(0))
    _assert_partition(parts, [2, 2], 10, covers_all=False)


def test_iid_partition_deterministic_and_seed_dependent():
    quotas = balanced_quotas(1000, 10)
    a = iid_partition(1000, quotas, np.random.default_rng(5))
    b = iid_partition(1000, quotas, np.random.default_rng(5))
    c = iid_partition(1000, quotas, np.random.default_rng(6))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_partition_mixes_classes_like_the_whole_set():
    labels = _balanced_labels(10, 600)
    parts = iid_partition(len(labels), balanced_quotas(len(labels), 10), np.random.default_rng(0))
    for part in parts:  # 600 samples per client: each class share within 0.1 +- 0.045 (about 3.7 SE)
        shares = np.bincount(labels[part], minlength=10) / len(part)
        assert np.all(np.abs(shares - 0.1) < 0.045)


@pytest.mark.parametrize(
    "quotas, message",
    [
        (np.array([6, 5]), "sum to 11 but there are only 10"),
        (np.array([5, 0]), "client 1 has 0"),
        (np.array([2.0, 3.0]), "integer array"),
        (np.array([], dtype=np.int64), "non-empty"),
    ],
)
def test_iid_partition_rejects_bad_quotas(quotas, message):
    with pytest.raises(ValueError, match=message):
        iid_partition(10, quotas, np.random.default_rng(0))


# --- Dirichlet, client-prior form -----------------------------------------


def _sequential_reference(labels, quotas, alpha, rng, num_classes):
    """The paper's procedure step by step (slow; for comparing distributions)."""
    priors = rng.dirichlet(np.full(num_classes, alpha), size=len(quotas))
    remaining = quotas.copy()
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    parts = [[] for _ in quotas]
    while remaining.sum():
        client = rng.choice(np.flatnonzero(remaining > 0))
        prior = priors[client] * np.array([len(pool) > 0 for pool in pools])
        cls = rng.choice(num_classes, p=prior / prior.sum())
        parts[client].append(pools[cls].pop())
        remaining[client] -= 1
    return parts


def test_dirichlet_matches_the_sequential_procedure_in_distribution():
    # Scarce classes (30/12/6 samples) and unequal quotas make the exhaustion
    # order matter: a variant that picks clients in proportion to their
    # remaining quota instead of uniformly misses these means by 5-20 SE.
    labels = np.repeat([0, 1, 2], [30, 12, 6])
    quotas = np.array([20, 12, 10, 6])
    runs = 1000

    def class_counts(parts):  # [client, class] counts, flattened
        return np.array([np.bincount(labels[np.asarray(p, dtype=np.int64)], minlength=3) for p in parts]).ravel()

    fast = np.array(
        [class_counts(dirichlet_client_prior_partition(labels, quotas, 0.5, np.random.default_rng(s))) for s in range(runs)]
    )
    slow = np.array(
        [class_counts(_sequential_reference(labels, quotas, 0.5, np.random.default_rng(10**6 + s), 3)) for s in range(runs)]
    )
    standard_error = np.sqrt(fast.var(axis=0) / runs + slow.var(axis=0) / runs)
    z = (fast.mean(axis=0) - slow.mean(axis=0)) / standard_error
    assert np.all(np.abs(z) < 4), z


@pytest.mark.parametrize("quota_rule", ["balanced", "lognormal"])
def test_dirichlet_is_an_exact_partition(quota_rule):
    labels = np.random.default_rng(0).integers(10, size=5000)
    rng = np.random.default_rng(1)
    quotas = balanced_quotas(5000, 64) if quota_rule == "balanced" else lognormal_quotas(5000, 64, 0.3, rng)
    parts = dirichlet_client_prior_partition(labels, quotas, 0.3, rng)
    _assert_partition(parts, quotas, 5000)


def test_dirichlet_with_smaller_total_uses_a_subset():
    labels = _balanced_labels(4, 25)
    parts = dirichlet_client_prior_partition(labels, np.array([10, 20]), 1.0, np.random.default_rng(0))
    _assert_partition(parts, [10, 20], 100, covers_all=False)


def test_dirichlet_deterministic_and_seed_dependent():
    labels = _balanced_labels(10, 100)
    quotas = balanced_quotas(1000, 20)
    a = dirichlet_client_prior_partition(labels, quotas, 0.3, np.random.default_rng(7))
    b = dirichlet_client_prior_partition(labels, quotas, 0.3, np.random.default_rng(7))
    c = dirichlet_client_prior_partition(labels, quotas, 0.3, np.random.default_rng(8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def _median_classes_for_80_percent(labels, parts, num_classes=10):
    return np.median([classes_covering_fraction(labels[p], num_classes, 0.8) for p in parts])


@pytest.mark.parametrize("alpha, low, high", [(0.03, 1, 2), (0.3, 2.5, 3.5), (0.6, 3.5, 5), (100.0, 8, 8)])
def test_dirichlet_heterogeneity_matches_feddyn(alpha, low, high):
    # FedDyn (Section 5 and Appendix A.1), MNIST-sized, 100 devices of 600:
    # 80% of a device's data lies in about 3 classes at alpha 0.3, 4 or 5 at
    # 0.6, and 8 classes for an IID split of 10 balanced classes.
    labels = _balanced_labels(10, 6000)
    medians = [
        _median_classes_for_80_percent(
            labels, dirichlet_client_prior_partition(labels, balanced_quotas(60000, 100), alpha, np.random.default_rng(s))
        )
        for s in range(3)
    ]
    assert low <= np.mean(medians) <= high, medians


def test_dirichlet_large_alpha_gives_near_global_mixtures():
    labels = _balanced_labels(10, 6000)
    parts = dirichlet_client_prior_partition(labels, balanced_quotas(60000, 100), 1000.0, np.random.default_rng(0))
    shares = np.array([np.bincount(labels[p], minlength=10) / len(p) for p in parts])
    total_variation = 0.5 * np.abs(shares - 0.1).sum(axis=1)
    assert total_variation.max() < 0.15


def test_dirichlet_small_alpha_gives_few_classes_per_client():
    labels = _balanced_labels(10, 6000)
    parts = dirichlet_client_prior_partition(labels, balanced_quotas(60000, 100), 0.01, np.random.default_rng(0))
    dominant_share = np.array([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])
    # Priors at alpha 0.01 put nearly all mass on one class; only class
    # exhaustion late in the procedure forces some mixing.
    assert np.mean(dominant_share > 0.5) > 0.9


def test_dirichlet_never_draws_a_class_without_samples():
    # Class 1 has no samples; num_classes=3 still gives it prior mass.
    labels = np.array([0, 0, 0, 2, 2, 2])
    parts = dirichlet_client_prior_partition(labels, np.array([3, 3]), 0.5, np.random.default_rng(0), num_classes=3)
    _assert_partition(parts, [3, 3], 6)


def test_dirichlet_large_scale_case_completes():
    # 50,000 samples, 1,000 clients, alpha 0.03: the case where redrawing
    # rejected classes one at a time (the authors' code, several libraries)
    # effectively hangs once most classes are exhausted.
    labels = np.random.default_rng(0).integers(10, size=50000)
    rng = np.random.default_rng(1)
    quotas = lognormal_quotas(50000, 1000, 0.3, rng)
    parts = dirichlet_client_prior_partition(labels, quotas, 0.03, rng)
    _assert_partition(parts, quotas, 50000)


@pytest.mark.parametrize(
    "labels, quotas, alpha, num_classes, message",
    [
        (np.array([0, 1, 1]), np.array([2]), 0.0, None, "alpha must be a finite number > 0"),
        (np.array([0, 1, 1]), np.array([2]), -1.0, None, "alpha must be"),
        (np.array([0, 1, 1]), np.array([2]), float("inf"), None, "alpha must be"),
        (np.array([0, 1, 1]), np.array([2, 2]), 0.5, None, "sum to 4 but there are only 3"),
        (np.array([0, -1, 1]), np.array([2]), 0.5, None, "non-negative"),
        (np.array([0.0, 1.0]), np.array([1]), 0.5, None, "integer array"),
        (np.array([0, 5, 1]), np.array([2]), 0.5, 3, "class 5 but num_classes=3"),
    ],
)
def test_dirichlet_errors(labels, quotas, alpha, num_classes, message):
    with pytest.raises(ValueError, match=message):
        dirichlet_client_prior_partition(labels, quotas, alpha, np.random.default_rng(0), num_classes=num_classes)
