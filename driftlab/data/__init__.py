"""Data: the federated container, official-format loaders, synthetic generators, partitions.

A federated data set is shared train/test tensors plus one int64 index array
per client (:class:`FederatedDataset`); partitions produce those index arrays
from labels, quotas and an explicit ``numpy.random.Generator``.

The data sets a config names (``data.name``) are the entries of
``driftlab.data.registry``; driftlab's own (``driftlab.data.builtins``) are
registered here through the same ``register`` a plugin calls.
"""

from driftlab.data import builtins, registry
from driftlab.data.federated import DataFileError, FederatedDataset, classes_covering_fraction
from driftlab.data.idx import MNIST_MEAN, MNIST_STD, load_mnist, load_mnist_tensors, read_idx
from driftlab.data.partition import (
    balanced_quotas,
    dirichlet_client_prior_partition,
    iid_partition,
    lognormal_quotas,
)
from driftlab.data.registry import DataSection, DataSetEntry, Download, register
from driftlab.data.synthetic import synthetic_federated

builtins.register_built_ins()
registry.REGISTRY.finish_built_ins()

__all__ = [
    "DataFileError",
    "DataSection",
    "DataSetEntry",
    "Download",
    "FederatedDataset",
    "MNIST_MEAN",
    "MNIST_STD",
    "balanced_quotas",
    "classes_covering_fraction",
    "dirichlet_client_prior_partition",
    "iid_partition",
    "load_mnist",
    "load_mnist_tensors",
    "lognormal_quotas",
    "read_idx",
    "register",
    "synthetic_federated",
]
