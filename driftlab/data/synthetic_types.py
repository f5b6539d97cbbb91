"""FedDyn's synthetic heterogeneity types 1, 2 and 3 (Acar et al. 2021, Appendix A.1.1, Table 6).

Multinomial logistic data, 5 classes in 30 dimensions, on 20 devices with
about 200 points each. Device i's points are

    y = argmax(θ_i x + b_i),     θ_i ∈ R^{5×30}, b_i ∈ R^5, entries ~ N(μ_i, 1), μ_i ~ N(0, γ1)
    x ~ N(ν_i, Σ),               Σ diagonal with Σ_kk = k^{-1.2}, ν_i entries ~ N(β_i, 1), β_i ~ N(0, γ2)
    n_i ~ LogNormal with variance γ3 (of log n_i), around 200 points

and the paper "allows only one type of heterogeneity at a time and disables
the randomness from the other two":

    kind 0, homogeneous: one (θ, b) ~ N(0, 1) for all devices, ν_i = 0, n_i = 200
    kind 1 (optimal models differ):       per-device (θ_i, b_i), ν_i = 0, n_i = 200
    kind 2 (feature distributions differ): one (θ, b), per-device ν_i,  n_i = 200
    kind 3 (amounts of data differ):       one (θ, b), ν_i = 0, n_i lognormal

Left open by the paper, settled here as the authors' public code does
(``alpemreacar/FedDyn``, ``utils_dataset.generate_syn_logistic`` and
``example_synthetic.py``):
  - the values of γ1, γ2, γ3 are not given; ``heterogeneity`` sets the one in
    use and defaults to 1 (the authors' example is named
    ``syn_alpha-1_beta-1_theta0``, i.e. γ1 = γ2 = 1);
  - sizes are ``int(LogNormal(mean=log(200), sigma))``: 200 is the median
    (with γ3 = 0 every device has exactly 200), not the mean;
  - a homogeneous-type device has ν_i = 0, exactly (the paper says so too).
Where the code and the paper's notation disagree, the paper is followed:
γ1, γ2 and γ3 are variances (the code passes them as standard deviations;
the two agree at the default 1). The authors evaluate on the training data
itself (Table 6 reports the training loss to reach); here each device's
points are split into train and ``test_fraction`` test as in
:func:`driftlab.data.synthetic.synthetic_federated`, and ``test_fraction=0``
reproduces the authors' choice (the test set is the training set).

As in FedProx's Synthetic(α, β) (see :mod:`driftlab.data.synthetic`), μ_i
adds the same ``μ_i (1ᵀx + 1)`` to every class score and cancels in the
argmax, so γ1 does not change the data: type 1 heterogeneity comes from
every device drawing its own (θ_i, b_i), which already happens at γ1 = 0.

All kinds draw the same underlying random numbers for a given seed (sizes,
per-device and shared parameters, feature means and noise are all drawn,
then the kind picks which to use), so kinds differ only in the heterogeneity
switched on.

Example:
    >>> ds = feddyn_synthetic(2, seed=0)
    >>> ds.name, ds.num_clients, ds.input_shape, ds.num_classes
    ('feddyn_synthetic_type2', 20, (30,), 5)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from driftlab.data.federated import FederatedDataset, contiguous_ranges

__all__ = ["FEDDYN_SYNTHETIC_KINDS", "feddyn_synthetic"]

FEDDYN_SYNTHETIC_KINDS = {0: "homogeneous", 1: "optimal models", 2: "feature distributions", 3: "amounts of data"}

# Second entropy word of the generator's SeedSequence (see driftlab.data.synthetic).
# Fixed forever: changing it changes every data set generated here.
_STREAM_TAG = 0x5F3D_0003


def feddyn_synthetic(
    kind: int,
    *,
    num_clients: int = 20,
    dimension: int = 30,
    num_classes: int = 5,
    samples_per_client: int = 200,
    heterogeneity: float = 1.0,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> FederatedDataset:
    """Generate FedDyn's synthetic data with heterogeneity of one type (module docstring).

    Args:
        kind: 0 homogeneous, 1 optimal models (γ1), 2 feature distributions
            (γ2), 3 amounts of data (γ3).
        num_clients: devices (FedDyn: 20).
        dimension: feature dimension (FedDyn: 30).
        num_classes: classes (FedDyn: 5).
        samples_per_client: points per device; the median of the lognormal for kind 3 (FedDyn: 200).
        heterogeneity: the variance γ of the type in use, >= 0 (ignored by kind 0 and,
            as explained above, without effect for kind 1).
        seed: non-negative integer; randomness comes from
            ``PCG64(SeedSequence([seed, _STREAM_TAG]))``.
        test_fraction: in [0, 1): each device's last ``n_i - floor((1 - f) n_i)``
            points are its test split. 0 makes the test set the training set
            (the authors' evaluation) with every device's test split equal to
            its training rows.

    Returns:
        A :class:`FederatedDataset` named ``"feddyn_synthetic_type{kind}"``
        (``"feddyn_synthetic_homogeneous"`` for kind 0), float32 inputs
        ``[n, dimension]``, int64 targets, contiguous client ranges and
        ``client_test_indices``.
    """
    _check_arguments(kind, num_clients, dimension, num_classes, samples_per_client, heterogeneity, seed, test_fraction)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _STREAM_TAG])))
    std = math.sqrt(heterogeneity)

    # Every draw happens for every kind, in a fixed order, so kinds share random numbers.
    log_size_noise = rng.standard_normal(num_clients)
    device_mu = std * rng.standard_normal(num_clients)  # μ_i (cancels in the argmax)
    device_weights = device_mu[:, None, None] + rng.standard_normal((num_clients, num_classes, dimension))
    device_biases = device_mu[:, None] + rng.standard_normal((num_clients, num_classes))
    shared_weights = rng.standard_normal((num_classes, dimension))
    shared_biases = rng.standard_normal(num_classes)
    device_beta = std * rng.standard_normal(num_clients)
    device_means = device_beta[:, None] + rng.standard_normal((num_clients, dimension))

    if kind == 3:
        # int(LogNormal(log(n + 0.001), σ)) as the authors (the 0.001 keeps σ = 0 from flooring
        # exp(log 200) = 199.99999999999997 to 199); at least 2 so train and test are never empty.
        log_median = math.log(samples_per_client + 1e-3)
        sizes = np.maximum(np.exp(log_median + std * log_size_noise).astype(np.int64), 2)
    else:
        sizes = np.full(num_clients, samples_per_client, dtype=np.int64)
    if kind == 1:
        weights, biases = device_weights, device_biases
    else:
        weights = np.broadcast_to(shared_weights, (num_clients, num_classes, dimension))
        biases = np.broadcast_to(shared_biases, (num_clients, num_classes))
    means = device_means if kind == 2 else np.zeros((num_clients, dimension))

    feature_std = np.arange(1, dimension + 1, dtype=np.float64) ** -0.6  # sqrt(k^{-1.2})
    inputs = np.repeat(means, sizes, axis=0) + rng.standard_normal((int(sizes.sum()), dimension)) * feature_std
    owner = np.repeat(np.arange(num_clients), sizes)
    scores = np.einsum("nd,ncd->nc", inputs, weights[owner]) + biases[owner]
    targets = np.argmax(scores, axis=1).astype(np.int64)

    name = "feddyn_synthetic_homogeneous" if kind == 0 else f"feddyn_synthetic_type{kind}"
    return _split_per_device(name, inputs, targets, sizes, test_fraction, num_classes)


def _split_per_device(
    name: str, inputs: np.ndarray, targets: np.ndarray, sizes: np.ndarray, test_fraction: float, num_classes: int
) -> FederatedDataset:
    train_sizes = np.floor((1.0 - test_fraction) * sizes + 1e-9).astype(np.int64)
    device_start = np.r_[0, np.cumsum(sizes)[:-1]]
    is_train = np.arange(len(targets)) - np.repeat(device_start, sizes) < np.repeat(train_sizes, sizes)
    train_x = torch.from_numpy(inputs[is_train].astype(np.float32))
    train_y = torch.from_numpy(targets[is_train])
    clients = contiguous_ranges(train_sizes)
    if test_fraction == 0:
        # The authors' evaluation: the test set is the training set.
        return FederatedDataset(name, train_x, train_y, train_x.clone(), train_y.clone(), clients, num_classes, clients)
    return FederatedDataset(
        name=name,
        train_inputs=train_x,
        train_targets=train_y,
        test_inputs=torch.from_numpy(inputs[~is_train].astype(np.float32)),
        test_targets=torch.from_numpy(targets[~is_train]),
        client_indices=clients,
        num_classes=num_classes,
        client_test_indices=contiguous_ranges(sizes - train_sizes),
    )


def _check_arguments(
    kind: int,
    num_clients: int,
    dimension: int,
    num_classes: int,
    samples_per_client: int,
    heterogeneity: float,
    seed: int,
    test_fraction: float,
) -> None:
    if kind not in FEDDYN_SYNTHETIC_KINDS:
        raise ValueError(
            f"kind must be one of {sorted(FEDDYN_SYNTHETIC_KINDS)} "
            f"({', '.join(f'{k} {v}' for k, v in FEDDYN_SYNTHETIC_KINDS.items())}), got {kind!r}"
        )
    for label, value, low in (
        ("num_clients", num_clients, 1),
        ("dimension", dimension, 1),
        ("num_classes", num_classes, 2),
        ("samples_per_client", samples_per_client, 2),
    ):
        if value < low:
            raise ValueError(f"{label} must be at least {low}, got {value}")
    if not (math.isfinite(heterogeneity) and heterogeneity >= 0):
        raise ValueError(f"heterogeneity is a variance and must be a finite number >= 0, got {heterogeneity}")
    if not (isinstance(seed, (int, np.integer)) and seed >= 0):
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    smallest = 2 if kind == 3 else samples_per_client
    if math.floor((1.0 - test_fraction) * smallest + 1e-9) < 1:
        raise ValueError(
            f"test_fraction={test_fraction} with as few as {smallest} points on a device leaves no training point; "
            "lower test_fraction or raise samples_per_client"
        )
