"""Tests for FedDyn's synthetic heterogeneity types (Appendix A.1.1)."""

import numpy as np
import pytest
import torch

from driftlab.data.synthetic_types import feddyn_synthetic


def _device_sizes(ds):
    return ds.client_sizes + np.array([len(t) for t in ds.client_test_indices])


def _label_shares(ds):
    y = ds.train_targets.numpy()
    return np.array([np.bincount(y[idx], minlength=ds.num_classes) / len(idx) for idx in ds.client_indices])


def _mean_total_variation(ds):
    shares = _label_shares(ds)
    distances = 0.5 * np.abs(shares[:, None] - shares[None]).sum(-1)
    k = len(shares)
    return distances.sum() / (k * (k - 1))


def _feature_mean_spread(ds):
    x = ds.train_inputs.numpy()
    return np.var([x[idx].mean() for idx in ds.client_indices], ddof=1)


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_shapes_and_split(kind):
    ds = feddyn_synthetic(kind, seed=0)
    assert ds.num_clients == 20 and ds.input_shape == (30,) and ds.num_classes == 5
    assert ds.train_inputs.dtype == torch.float32 and ds.train_targets.dtype == torch.int64
    sizes = _device_sizes(ds)
    np.testing.assert_array_equal(ds.client_sizes, (8 * sizes) // 10)
    assert len(ds.test_targets) == sum(len(t) for t in ds.client_test_indices)
    if kind != 3:
        assert set(sizes.tolist()) == {200}


def test_names_and_determinism():
    assert feddyn_synthetic(0).name == "feddyn_synthetic_homogeneous"
    assert feddyn_synthetic(2).name == "feddyn_synthetic_type2"
    a, b = feddyn_synthetic(1, seed=4), feddyn_synthetic(1, seed=4)
    assert torch.equal(a.train_inputs, b.train_inputs) and torch.equal(a.train_targets, b.train_targets)
    assert not torch.equal(a.train_inputs, feddyn_synthetic(1, seed=5).train_inputs)


def test_only_type3_varies_sizes():
    sizes = _device_sizes(feddyn_synthetic(3, seed=0))
    assert sizes.std() > 50 and 80 < np.median(sizes) < 500  # LogNormal(log 200, 1): median 200
    assert set(_device_sizes(feddyn_synthetic(3, heterogeneity=0.0)).tolist()) == {200}


def test_type2_shifts_features_and_labels_type1_labels_only():
    seeds = range(5)
    homogeneous = [feddyn_synthetic(0, seed=s) for s in seeds]
    type1 = [feddyn_synthetic(1, seed=s) for s in seeds]
    type2 = [feddyn_synthetic(2, seed=s) for s in seeds]
    spread = {
        name: np.mean([_feature_mean_spread(d) for d in group])
        for name, group in (("h", homogeneous), ("1", type1), ("2", type2))
    }
    assert spread["2"] > 20 * spread["h"] and spread["1"] < 3 * spread["h"]
    tv = {
        name: np.mean([_mean_total_variation(d) for d in group])
        for name, group in (("h", homogeneous), ("1", type1), ("2", type2))
    }
    assert tv["1"] > 2 * tv["h"] and tv["2"] > 2 * tv["h"]


def test_homogeneous_and_type3_share_one_model():
    # With a shared (θ, b) and ν = 0, all devices draw from one distribution: every label
    # share is close to the pooled share.
    ds = feddyn_synthetic(0, samples_per_client=2000, seed=1)
    shares = _label_shares(ds)
    assert np.abs(shares - shares.mean(0)).max() < 0.06


def test_test_fraction_zero_reuses_training_data():
    ds = feddyn_synthetic(1, test_fraction=0.0)
    assert torch.equal(ds.test_inputs, ds.train_inputs)
    assert [t.tolist() for t in ds.client_test_indices] == [c.tolist() for c in ds.client_indices]


def test_argument_errors():
    with pytest.raises(ValueError, match="kind must be one of"):
        feddyn_synthetic(4)
    with pytest.raises(ValueError, match="heterogeneity"):
        feddyn_synthetic(1, heterogeneity=-1.0)
    with pytest.raises(ValueError, match="test_fraction"):
        feddyn_synthetic(1, test_fraction=1.0)
    with pytest.raises(ValueError, match="no training point"):
        feddyn_synthetic(3, test_fraction=0.6)
