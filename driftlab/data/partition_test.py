"""Tests for quota rules and partitions (benchmarks.md, "Partitions")."""

import numpy as np
import pytest

from driftlab.data.federated import classes_covering_fraction
from driftlab.data.partition import (
    _raise_empty_clients,
    balanced_quotas,
    classes_per_client_partition,
    deal_test_like_training,
    dirichlet_classwise_partition,
    dirichlet_client_prior_partition,
    iid_partition,
    kept_clients,
    lognormal_quotas,
    natural_client_groups,
    natural_partition,
    power_law_partition,
    split_client_test,
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
        [
            class_counts(dirichlet_client_prior_partition(labels, quotas, 0.5, np.random.default_rng(s)))
            for s in range(runs)
        ]
    )
    slow = np.array(
        [
            class_counts(_sequential_reference(labels, quotas, 0.5, np.random.default_rng(10**6 + s), 3))
            for s in range(runs)
        ]
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
            labels,
            dirichlet_client_prior_partition(labels, balanced_quotas(60000, 100), alpha, np.random.default_rng(s)),
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


# --- shared checks for the partitions below ---------------------------------


def _assert_disjoint_sorted(parts, num_samples):
    """Sorted int64 arrays, no sample in two clients, all indices in range; returns the samples used."""
    assert all(p.dtype == np.int64 and p.ndim == 1 and np.all(np.diff(p) > 0) for p in parts)
    used = np.concatenate(parts)
    assert len(np.unique(used)) == len(used), "a sample is given to two clients"
    assert len(used) == 0 or (used.min() >= 0 and used.max() < num_samples)
    return used


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _classes_held(labels, parts):
    return np.array([len(np.unique(labels[p])) for p in parts])


# --- Dirichlet, class-wise form --------------------------------------------


def test_classwise_dirichlet_covers_every_sample_once_and_respects_the_minimum():
    labels = _balanced_labels(10, 600)
    parts = dirichlet_classwise_partition(labels, 30, 0.5, np.random.default_rng(0), min_client_size=20)
    assert len(parts) == 30
    assert len(_assert_disjoint_sorted(parts, len(labels))) == len(labels)
    assert min(len(p) for p in parts) >= 20


def test_classwise_dirichlet_small_alpha_gives_few_classes_large_alpha_many():
    labels = _balanced_labels(10, 6000)
    few = dirichlet_classwise_partition(labels, 100, 0.05, np.random.default_rng(0), min_client_size=0)
    many = dirichlet_classwise_partition(labels, 100, 100.0, np.random.default_rng(0))
    covering = [[classes_covering_fraction(labels[p], 10, 0.8) for p in parts if len(p)] for parts in (few, many)]
    assert np.median(covering[0]) <= 2
    assert np.median(covering[1]) == 8  # near the global mixture: 8 of 10 balanced classes hold 80%
    # The class shares match the draw: each class is split over all clients.
    assert np.all(np.bincount(labels[np.concatenate(many)], minlength=10) == 6000)


def test_classwise_dirichlet_cut_matches_the_flower_rule():
    # One class, 3 clients: the cut is floor(cumsum(p) * n) of the proportions drawn from the same generator.
    labels = np.zeros(100, dtype=np.int64)
    parts = dirichlet_classwise_partition(labels, 3, 1.0, np.random.default_rng(5), min_client_size=0)
    proportions = np.random.default_rng(5).dirichlet(np.ones(3))
    cuts = (np.cumsum(proportions) * 100).astype(int)[:-1]
    assert [len(p) for p in parts] == np.diff(np.r_[0, cuts, 100]).tolist()


def test_classwise_dirichlet_self_balancing_caps_growth():
    labels = _balanced_labels(10, 1000)
    plain = dirichlet_classwise_partition(labels, 50, 0.1, np.random.default_rng(0), min_client_size=0)
    balanced = dirichlet_classwise_partition(
        labels, 50, 0.1, np.random.default_rng(0), min_client_size=0, self_balancing=True
    )
    assert len(_assert_disjoint_sorted(balanced, len(labels))) == len(labels)
    assert np.std([len(p) for p in balanced]) < np.std([len(p) for p in plain])


def test_classwise_dirichlet_large_scale_is_fast_and_fails_fast_when_impossible():
    # 50,000 samples over 1,000 clients at alpha 0.03 (benchmarks/partition_speed.py times it).
    labels = np.random.default_rng(0).integers(10, size=50000)
    parts = dirichlet_classwise_partition(labels, 1000, 0.03, np.random.default_rng(1), min_client_size=0)
    assert len(_assert_disjoint_sorted(parts, 50000)) == 50000
    # About a quarter of the clients get nothing at this alpha, so a minimum size cannot be met: a clear error.
    with pytest.raises(ValueError, match="lower min_client_size or raise alpha"):
        dirichlet_classwise_partition(labels, 1000, 0.03, np.random.default_rng(1), min_client_size=1, max_attempts=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_clients=0), "num_clients must be an integer >= 1"),
        (dict(alpha=0.0), "alpha must be a finite number > 0"),
        (dict(alpha=float("nan")), "alpha must be"),
        (dict(min_client_size=-1), "min_client_size must be an integer >= 0"),
        (dict(min_client_size=200), "need 1000 samples but there are only 100"),
        (dict(max_attempts=0), "max_attempts must be"),
        (dict(labels=np.array([0.5, 1.0])), "integer array"),
    ],
)
def test_classwise_dirichlet_errors(kwargs, message):
    arguments = dict(
        labels=_balanced_labels(4, 25), num_clients=5, alpha=0.5, rng=np.random.default_rng(0), min_client_size=1
    )
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        dirichlet_classwise_partition(**arguments)


# --- m classes per client ----------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 5])
def test_classes_per_client_aligned_case_gives_exactly_m_classes(m):
    # 10 classes of 600, 20 clients: 20*m shards of 300/m samples, whole shards per class for m in {1, 2, 5}.
    labels = _balanced_labels(10, 600)
    parts = classes_per_client_partition(labels, 20, m, np.random.default_rng(m))
    assert len(_assert_disjoint_sorted(parts, len(labels))) == len(labels)
    assert [len(p) for p in parts] == [6000 // 20] * 20
    assert np.all(_classes_held(labels, parts) == m)
    # every client's shards are whole: equal amounts of each of its classes
    for part in parts:
        counts = np.bincount(labels[part])
        assert set(counts[counts > 0]) == {300 // m}


def test_classes_per_client_fedavg_mnist_shards():
    # FedAvg: 60,000 MNIST-like samples, 100 clients, 2 shards of 300 each.
    labels = _balanced_labels(10, 6000)
    parts = classes_per_client_partition(labels, 100, 2, np.random.default_rng(0))
    assert all(len(p) == 600 for p in parts)
    assert np.all(_classes_held(labels, parts) == 2)


def test_classes_per_client_unaligned_shards_straddle_classes():
    # 7 classes of unequal size: shards straddle class boundaries, so some clients get m + 1 classes.
    labels = np.repeat(np.arange(7), [50, 70, 30, 90, 40, 60, 55])
    parts = classes_per_client_partition(labels, 9, 2, np.random.default_rng(0))
    assert len(_assert_disjoint_sorted(parts, len(labels))) == len(labels)
    held = _classes_held(labels, parts)
    assert held.min() >= 1 and held.max() <= 4 and held.max() > 2
    assert sorted(len(p) for p in parts) == sorted(
        int(a + b) for a, b in balanced_quotas(len(labels), 18).reshape(2, 9).T
    )  # sizes are two shards of the balanced cut


def test_classes_per_client_with_quotas_has_exact_sizes():
    labels = _balanced_labels(10, 200)
    rng = np.random.default_rng(2)
    quotas = lognormal_quotas(1500, 25, 0.3, rng)  # sums to 1500 < 2000: a random subset is used
    parts = classes_per_client_partition(labels, 25, 3, rng, quotas=quotas)
    assert [len(p) for p in parts] == quotas.tolist()
    _assert_disjoint_sorted(parts, len(labels))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(classes_per_client=11), "only 10 classes have samples"),
        (dict(classes_per_client=0), "classes_per_client must be an integer >= 1"),
        (dict(num_clients=0), "num_clients must be"),
        (dict(num_clients=60), "need 120 shards .* only 100 samples"),
        (dict(quotas=np.array([10] * 4)), "quotas has 4 entries but num_clients=5"),
        (dict(quotas=np.array([10, 10, 10, 10, 1])), "client 4 has a quota of 1"),
        (dict(quotas=np.array([30] * 5)), "sum to 150 but there are only 100"),
    ],
)
def test_classes_per_client_errors(kwargs, message):
    arguments = dict(labels=_balanced_labels(10, 10), num_clients=5, classes_per_client=2, rng=np.random.default_rng(0))
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        classes_per_client_partition(**arguments)


# --- power law (FedProx MNIST) ------------------------------------------------


def test_power_law_fedprox_mnist_setting():
    # FedProx: 70,000 MNIST images (here ~7,000 per digit), 1,000 devices, 2 digits each.
    labels = _balanced_labels(10, 7000)
    parts = power_law_partition(labels, 1000, 2, np.random.default_rng(0))
    used = _assert_disjoint_sorted(parts, len(labels))
    assert len(parts) == 1000
    # Unassigned: only the rounding remainder, fewer than 200 slots per digit.
    assert 70000 - 10 * 200 < len(used) <= 70000
    for k in (0, 1, 9, 10, 999):  # client k holds digits k % 10 and (k + 1) % 10, at least 5 of each
        counts = np.bincount(labels[parts[k]], minlength=10)
        assert set(np.flatnonzero(counts)) == {k % 10, (k + 1) % 10}
        assert counts[k % 10] >= 5 and counts[(k + 1) % 10] >= 5
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 10
    assert sizes.max() > 10 * np.median(sizes)  # heavy-tailed (lognormal, sigma 2)


def test_power_law_sigma_zero_gives_equal_shares():
    labels = _balanced_labels(4, 100)
    parts = power_law_partition(labels, 8, 2, np.random.default_rng(0), sigma=0.0)
    # each class has 4 slots: 5 each, then (100 - 20) / 4 = 20 more each
    assert [len(p) for p in parts] == [50] * 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(classes_per_client=11), "exceeds the 10 classes"),
        (dict(num_clients=300), "class 0 has 100 samples but its 60 .* slots need"),
        (dict(min_per_class=0), "min_per_class must be an integer >= 1"),
        (dict(sigma=-1.0), "sigma must be a finite number >= 0"),
    ],
)
def test_power_law_errors(kwargs, message):
    arguments = dict(
        labels=_balanced_labels(10, 100), num_clients=20, classes_per_client=2, rng=np.random.default_rng(0)
    )
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        power_law_partition(**arguments)


# --- natural ---------------------------------------------------------------


def test_natural_partition_first_appearance_and_sorted_orders():
    writers = np.array(["w7", "w2", "w7", "w9", "w2", "w2"])
    first = natural_partition(writers)
    assert [p.tolist() for p in first] == [[0, 2], [1, 4, 5], [3]]
    assert natural_client_groups(writers).tolist() == ["w7", "w2", "w9"]
    ordered = natural_partition(writers, order="sorted")
    assert [p.tolist() for p in ordered] == [[1, 4, 5], [0, 2], [3]]
    assert natural_client_groups(writers, order="sorted").tolist() == ["w2", "w7", "w9"]
    assert all(p.dtype == np.int64 for p in first)


def test_natural_partition_integer_ids_cover_everything():
    roles = np.random.default_rng(0).integers(0, 50, size=1000)
    parts = natural_partition(roles)
    assert len(_assert_disjoint_sorted(parts, 1000)) == 1000
    assert len(parts) == len(np.unique(roles))
    assert all(len(np.unique(roles[p])) == 1 for p in parts)


@pytest.mark.parametrize(
    "ids, order, message",
    [
        (np.array([], dtype=np.int64), "first", "non-empty 1-D"),
        (np.zeros((2, 2)), "first", "non-empty 1-D"),
        (np.array([1, 2]), "random", "order must be 'first'"),
        (np.array(["a", 1, None], dtype=object), "first", "mutually comparable"),
    ],
)
def test_natural_partition_errors(ids, order, message):
    with pytest.raises(ValueError, match=message):
        natural_partition(ids, order=order)


# --- per-client test splits --------------------------------------------------


def test_split_client_test_partitions_each_client_with_the_fedprox_sizes():
    clients = (np.arange(0, 10), np.arange(10, 25), np.array([30]), np.arange(40, 42))
    train, test = split_client_test(clients, 0.1, np.random.default_rng(0))
    # train = floor(0.9 n) (FedProx's int(0.9 * n)), but never zero
    assert [len(t) for t in train] == [9, 13, 1, 1]
    assert [len(t) for t in test] == [1, 2, 0, 1]
    for client, a, b in zip(clients, train, test, strict=True):
        assert a.dtype == np.int64 and b.dtype == np.int64
        assert np.all(np.diff(a) > 0) and np.all(np.diff(b) > 0)
        np.testing.assert_array_equal(np.sort(np.concatenate([a, b])), client)


def test_split_client_test_is_random_and_deterministic_or_takes_the_last_samples():
    clients = (np.arange(100),)
    a = split_client_test(clients, 0.2, np.random.default_rng(1))
    b = split_client_test(clients, 0.2, np.random.default_rng(1))
    assert _same(a[1], b[1]) and not np.array_equal(a[1][0], np.arange(80, 100))
    train, test = split_client_test((np.array([9, 3, 7, 1, 5]),), 0.2, None, shuffle=False)
    assert train[0].tolist() == [1, 3, 5, 7] and test[0].tolist() == [9]
    train, test = split_client_test(clients, 0.0, np.random.default_rng(0))
    assert len(train[0]) == 100 and len(test[0]) == 0


@pytest.mark.parametrize(
    "clients, fraction, rng, message",
    [
        ((np.arange(3),), 1.0, np.random.default_rng(0), "fraction must be a number in \\[0, 1\\)"),
        ((np.arange(3),), -0.1, np.random.default_rng(0), "fraction must be"),
        ((np.arange(3),), 0.1, None, "needs an rng"),
        ((np.arange(3), np.array([], dtype=np.int64)), 0.1, np.random.default_rng(0), "client 1 has no samples"),
        ((np.array([0.5]),), 0.1, np.random.default_rng(0), "1-D integer array"),
        ((), 0.1, np.random.default_rng(0), "at least one client"),
        (np.arange(3), 0.1, np.random.default_rng(0), "sequence of index arrays"),
    ],
)
def test_split_client_test_errors(clients, fraction, rng, message):
    with pytest.raises(ValueError, match=message):
        split_client_test(clients, fraction, rng)


# --- every partition ------------------------------------------------------------


@pytest.mark.parametrize(
    "partition, seed",
    [
        (lambda rng: iid_partition(1000, balanced_quotas(1000, 10), rng), 5),
        (
            lambda rng: dirichlet_client_prior_partition(
                _balanced_labels(10, 100), balanced_quotas(1000, 20), 0.3, rng
            ),
            7,
        ),
        (lambda rng: dirichlet_classwise_partition(_balanced_labels(10, 100), 10, 0.5, rng), 3),
        (lambda rng: classes_per_client_partition(_balanced_labels(10, 60), 10, 2, rng), 1),
        (lambda rng: power_law_partition(_balanced_labels(10, 100), 20, 2, rng), 1),
    ],
    ids=["iid", "dirichlet_client_prior", "dirichlet_classwise", "classes_per_client", "power_law"],
)
def test_every_partition_is_deterministic_and_seed_dependent(partition, seed):
    first, again, other = (partition(np.random.default_rng(s)) for s in (seed, seed, seed + 1))
    assert _same(first, again) and not _same(first, other)


def test_max_clients_keeps_the_first_or_a_seeded_draw():
    assert kept_clients(5, 2).tolist() == [0, 1] and kept_clients(5, None).tolist() == [0, 1, 2, 3, 4]
    assert kept_clients(3, 9, np.random.default_rng(0)).tolist() == [0, 1, 2]  # all kept: nothing drawn
    drawn = kept_clients(5, 2, np.random.default_rng(7))
    assert drawn.tolist() == sorted(np.random.default_rng(7).choice(5, 2, replace=False).tolist())
    assert set().union(*(kept_clients(5, 2, np.random.default_rng(s)).tolist() for s in range(20))) == set(range(5))
    with pytest.raises(ValueError, match="max_clients"):
        kept_clients(5, 0)


def test_test_rows_follow_each_clients_training_labels():
    train = [np.array([0, 0, 0, 1]), np.array([0, 1, 1, 1]), np.array([2])]
    test_labels = np.array([0, 0, 0, 0, 1, 1, 2, 3])
    dealt = deal_test_like_training(train, test_labels, np.random.default_rng(0))
    # by hand: class 0's four rows split 3:1 like the training rows; class 1's two rows 1:1 (exact shares 0.5 and
    # 1.5: one each from the floors, the one left to the tie's lower client); class 2's row to client 2; class 3,
    # which no client trains on, to nobody
    assert [sorted(test_labels[rows].tolist()) for rows in dealt] == [[0, 0, 0, 1], [0, 1], [2]]
    assert sorted(np.concatenate(dealt).tolist()) == list(range(7))
    again = deal_test_like_training(train, test_labels, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(dealt, again, strict=True))
