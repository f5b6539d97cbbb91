"""Tests for FedProx's Synthetic(alpha, beta) generator."""

import functools

import numpy as np
import pytest
import torch

from driftlab.data.synthetic import synthetic_federated

SEEDS = range(10)

# The generated data sets are immutable, so the heterogeneity tests can share them.
_cached = functools.lru_cache(maxsize=None)(synthetic_federated)


def _device_sizes(ds):
    return ds.client_sizes + np.array([len(t) for t in ds.client_test_indices])


def _feature_mean_spread(ds):
    """Variance across clients of each client's mean feature value (all coordinates pooled)."""
    x = ds.train_inputs.numpy()
    return np.var([x[idx].mean() for idx in ds.client_indices], ddof=1)


def _mean_label_total_variation(ds):
    """Mean over client pairs of the total-variation distance between label histograms."""
    y = ds.train_targets.numpy()
    shares = np.array([np.bincount(y[idx], minlength=ds.num_classes) / len(idx) for idx in ds.client_indices])
    distances = 0.5 * np.abs(shares[:, None, :] - shares[None, :, :]).sum(axis=-1)
    k = len(shares)
    return distances.sum() / (k * (k - 1))


def _mean_majority_share(ds):
    y = ds.train_targets.numpy()
    return np.mean([np.bincount(y[idx]).max() / len(idx) for idx in ds.client_indices])


def test_shapes_names_and_types():
    ds = synthetic_federated(1.0, 1.0, seed=0)
    assert ds.name == "synthetic(1,1)"
    assert synthetic_federated(0.5, 0.5).name == "synthetic(0.5,0.5)"
    assert synthetic_federated(0, 0, iid=True).name == "synthetic_iid"
    assert ds.num_clients == 30
    assert ds.input_shape == (60,)
    assert ds.num_classes == 10
    assert ds.train_inputs.dtype == torch.float32 and ds.train_targets.dtype == torch.int64
    assert len(ds.client_test_indices) == 30
    assert len(ds.test_targets) == sum(len(t) for t in ds.client_test_indices)
    y = torch.cat([ds.train_targets, ds.test_targets])
    assert int(y.min()) >= 0 and int(y.max()) <= 9


def test_each_device_split_80_20():
    ds = synthetic_federated(0.5, 0.5, seed=1)
    sizes = _device_sizes(ds)
    # floor(0.8 n) train, rest test; e.g. n = 55 gives 44 / 11.
    np.testing.assert_array_equal(ds.client_sizes, (8 * sizes) // 10)


def test_custom_shape_and_test_fraction():
    ds = synthetic_federated(1, 1, num_clients=5, dimension=7, num_classes=3, test_fraction=0.5, seed=2)
    assert ds.num_clients == 5 and ds.input_shape == (7,) and ds.num_classes == 3
    np.testing.assert_array_equal(ds.client_sizes, _device_sizes(ds) // 2)
    without_test = synthetic_federated(1, 1, num_clients=5, test_fraction=0.0, seed=2)
    assert len(without_test.test_targets) == 0


def test_device_sizes_follow_the_authors_power_law():
    # n_k = int(LogNormal(4, 2)) + 50: at least 50, median int(e^4) + 50 = 104.
    sizes = np.concatenate([_device_sizes(synthetic_federated(1, 1, seed=s)) for s in range(20)])
    assert sizes.min() >= 50
    assert 90 <= np.median(sizes) <= 120
    assert sizes.max() > 2000  # heavy tail: P(n > 2000) is about 3% per device, 600 devices


def test_iid_ignores_alpha_and_beta():
    a = synthetic_federated(0, 0, iid=True, seed=5)
    b = synthetic_federated(1, 1, iid=True, seed=5)
    assert torch.equal(a.train_inputs, b.train_inputs) and torch.equal(a.train_targets, b.train_targets)


def test_max_samples_per_client_caps_the_same_draws():
    free = synthetic_federated(1, 1, seed=4)
    capped = synthetic_federated(1, 1, seed=4, max_samples_per_client=200)
    np.testing.assert_array_equal(_device_sizes(capped), np.minimum(_device_sizes(free), 200))


def test_deterministic_per_seed_and_different_across_seeds():
    a, b = synthetic_federated(1, 1, seed=3), synthetic_federated(1, 1, seed=3)
    assert torch.equal(a.train_inputs, b.train_inputs) and torch.equal(a.train_targets, b.train_targets)
    assert all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices, strict=True))
    c = synthetic_federated(1, 1, seed=4)
    assert not np.array_equal(a.client_sizes, c.client_sizes)


def test_within_device_covariance_is_j_to_the_minus_1_2():
    # Biggest device of one data set: per-coordinate variance around the device
    # mean should be Sigma_jj = j^-1.2, i.e. 1 for j = 1 and 60^-1.2 = 0.0074 for j = 60.
    ds = synthetic_federated(1, 1, seed=0)
    biggest = ds.client_indices[int(np.argmax(ds.client_sizes))]
    assert len(biggest) > 1000
    variance = ds.train_inputs.numpy()[biggest].astype(np.float64).var(axis=0)
    expected = np.arange(1, 61) ** -1.2
    np.testing.assert_allclose(variance, expected, rtol=0.15)


def test_alpha_does_not_change_the_data():
    # u_k shifts every class logit by the same u_k (1'x + 1), which cancels in
    # the argmax; with the same seed, only alpha differs, so the data agree.
    for seed in range(3):
        low, high = synthetic_federated(0, 1, seed=seed), synthetic_federated(1, 1, seed=seed)
        assert torch.equal(low.train_inputs, high.train_inputs)
        agreement = (low.train_targets == high.train_targets).double().mean().item()
        assert agreement > 0.999


def test_beta_spreads_client_feature_means_as_predicted():
    # mean over the 60 coordinates of v_k is B_k + N(0, 1/60), so across clients
    # its variance is beta + 1/60 (plus a negligible sampling term).
    for beta in (0.0, 0.5, 1.0):
        spread = np.mean([_feature_mean_spread(_cached(beta, beta, seed=s)) for s in SEEDS])
        assert spread == pytest.approx(beta + 1 / 60, rel=0.25)


def test_heterogeneity_grows_from_0_0_to_1_1_and_iid_is_homogeneous():
    settings = [(0.0, 0.0), (0.5, 0.5), (1.0, 1.0)]
    spread = [np.mean([_feature_mean_spread(_cached(a, b, seed=s)) for s in SEEDS]) for a, b in settings]
    majority = [np.mean([_mean_majority_share(_cached(a, b, seed=s)) for s in SEEDS]) for a, b in settings]
    assert spread[0] < spread[1] < spread[2]
    # A larger feature shift makes logits larger, so each device's labels concentrate more.
    assert majority[0] < majority[1] < majority[2]

    iid_distance = np.mean([_mean_label_total_variation(_cached(0, 0, iid=True, seed=s)) for s in SEEDS])
    skewed_distance = np.mean([_mean_label_total_variation(_cached(1, 1, seed=s)) for s in SEEDS])
    iid_spread = np.mean([_feature_mean_spread(_cached(0, 0, iid=True, seed=s)) for s in SEEDS])
    # IID: every device samples the same distribution, so label histograms differ only by sampling noise.
    assert iid_distance < 0.15 < 0.6 < skewed_distance
    assert iid_spread < 0.01 < spread[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(alpha=-1.0, beta=0.0), "alpha is a variance"),
        (dict(alpha=0.0, beta=float("nan")), "beta is a variance"),
        (dict(alpha=1.0, beta=1.0, num_clients=0), "num_clients must be at least 1"),
        (dict(alpha=1.0, beta=1.0, num_classes=1), "num_classes must be at least 2"),
        (dict(alpha=1.0, beta=1.0, seed=-1), "non-negative integer"),
        (dict(alpha=1.0, beta=1.0, test_fraction=1.0), "test_fraction must be in \\[0, 1\\)"),
        (dict(alpha=1.0, beta=1.0, max_samples_per_client=0), "at least 1 or None"),
        (dict(alpha=1.0, beta=1.0, max_samples_per_client=1, test_fraction=0.5), "leaves no training sample"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        synthetic_federated(**kwargs)
