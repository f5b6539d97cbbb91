"""From a ``[data]`` config section to a ``FederatedDataset``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from driftlab.data.federated import DataFileError, FederatedDataset
from driftlab.simulation.randomness import Stream, generator

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]


def default_data_root(name: str) -> Path:
    """``$DRIFTLAB_DATA/<name>`` when set, else ``../shared/data/<name>`` beside the repository."""
    base = os.environ.get("DRIFTLAB_DATA")
    return Path(base) / name if base else REPOSITORY_ROOT.parent / "shared" / "data" / name


def build_dataset(config, seed: int) -> FederatedDataset:
    """Generate or load the data set and split it over clients, seeded by ``config.seed`` (default ``seed``)."""
    data_seed = config.seed if config.seed is not None else seed
    if config.name in ("synthetic", "synthetic_iid"):
        from driftlab.data.synthetic import synthetic_federated

        return synthetic_federated(
            config.synthetic_alpha,
            config.synthetic_beta,
            iid=config.name == "synthetic_iid",
            num_clients=config.num_clients,
            seed=data_seed,
        )
    if config.name == "quadratic1d":
        from driftlab.data.quadratic import scalar_quadratic_clients

        return scalar_quadratic_clients(config.num_clients)
    if config.name == "quadratic":
        from driftlab.data.quadratic import random_quadratic_clients

        return random_quadratic_clients(config.num_clients, config.quadratic_dimension, data_seed, config.quadratic_heterogeneity)
    if config.name == "mnist":
        from driftlab.data.idx import load_mnist_tensors

        root = Path(config.root) if config.root else default_data_root("mnist")
        if not root.is_dir():
            raise DataFileError(
                f"MNIST directory {root} does not exist; set data.root to the directory holding "
                "train-images-idx3-ubyte(.gz), train-labels-idx1-ubyte(.gz), t10k-images-idx3-ubyte(.gz), t10k-labels-idx1-ubyte(.gz)"
            )
        train_x, train_y, test_x, test_y = load_mnist_tensors(root)
        client_indices = split_over_clients(train_y.numpy(), config, data_seed)
        return FederatedDataset("mnist", train_x, train_y, test_x, test_y, client_indices, num_classes=10)
    raise ValueError(f"unknown data set {config.name!r}")


def split_over_clients(labels: np.ndarray, config, seed: int) -> tuple[np.ndarray, ...]:
    from driftlab.data.partition import balanced_quotas, dirichlet_client_prior_partition, iid_partition, lognormal_quotas

    rng = generator(seed, Stream.PARTITION)
    num_samples = len(labels)
    if config.quotas == "lognormal":
        quotas = lognormal_quotas(num_samples, config.num_clients, config.lognormal_sigma, rng)
    else:
        quotas = balanced_quotas(num_samples, config.num_clients)
    if config.partition == "dirichlet":
        return dirichlet_client_prior_partition(labels, quotas, config.dirichlet_alpha, rng)
    return iid_partition(num_samples, quotas, rng)
