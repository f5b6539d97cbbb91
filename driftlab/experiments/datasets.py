"""From a ``[data]`` config section to a ``FederatedDataset``.

Each data set name maps to a loader (official file formats, ``driftlab/data``)
or a generator; the training set is then split over clients by the partition
the config names (``natural`` keeps a data set's own clients: writers,
speaking roles, users, synthetic devices), and optionally every client's data
is split into a local train and test part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from driftlab.data.federated import DataFileError, FederatedDataset, federated_dataset_from_arrays
from driftlab.errors import ConfigError
from driftlab.simulation.randomness import Stream, generator

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]


def data_search_paths(name: str) -> list[Path]:
    """Where a data set's files are looked for when ``data.root`` is unset, in order.

    ``$DRIFTLAB_DATA/<name>`` alone when that variable is set; else
    ``./shared/data/<name>`` and ``../shared/data/<name>`` from the current
    directory, then ``../shared/data/<name>`` beside a source checkout of this
    package (only when that folder exists: after a plain install the package
    sits in site-packages, where no data is).
    """
    base = os.environ.get("DRIFTLAB_DATA")
    if base:
        return [Path(base).expanduser() / name]
    here = Path.cwd()
    candidates = [here / "shared" / "data" / name, here.parent / "shared" / "data" / name]
    checkout_data = REPOSITORY_ROOT.parent / "shared" / "data"
    if checkout_data.is_dir():
        candidates.append(checkout_data / name)
    unique: list[Path] = []
    for path in candidates:
        if not any(_same_place(path, seen) for seen in unique):
            unique.append(path)
    return unique


def _same_place(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b


def find_data(name: str) -> Path | None:
    """The first of ``data_search_paths(name)`` that exists, or None when none does (the files are absent)."""
    return next((path for path in data_search_paths(name) if path.exists()), None)


def default_data_root(name: str) -> Path:
    """The first of ``data_search_paths(name)`` that exists, else the first of them (for messages; it may not exist)."""
    return find_data(name) or data_search_paths(name)[0]


@dataclass(frozen=True)
class DataSetInfo:
    """A data set the config can name."""

    description: str
    default_location: str | None  # below the data root; None for generated data
    natural: bool  # has its own clients (default partition "natural")
    load: Callable  # (config, seed, path) -> FederatedDataset, or the four tensors of a pooled data set (images: uint8, and their PixelNormalisation fifth)
    vocabulary_size: Callable | None = None  # (config) -> token vocabulary for sequence models
    download_name: str | None = None  # the `driftlab data download` name that fetches its files
    num_classes: int | None = None  # classes of a pooled data set (not inferred from the labels present)


def _synthetic(config, seed, path):
    from driftlab.data.synthetic import synthetic_federated

    return synthetic_federated(
        config.synthetic_alpha, config.synthetic_beta, num_clients=config.num_clients, seed=seed, max_samples_per_client=config.samples_per_client
    )


def _synthetic_iid(config, seed, path):
    from driftlab.data.synthetic import synthetic_federated

    return synthetic_federated(0.0, 0.0, iid=True, num_clients=config.num_clients, seed=seed, max_samples_per_client=config.samples_per_client)


def _feddyn_synthetic(config, seed, path):
    from driftlab.data.synthetic_types import feddyn_synthetic

    return feddyn_synthetic(
        config.feddyn_kind, num_clients=config.num_clients, heterogeneity=config.feddyn_heterogeneity, seed=seed, test_fraction=0.2
    )


def _quadratic1d(config, seed, path):
    from driftlab.data.quadratic import scalar_quadratic_clients

    return scalar_quadratic_clients(config.num_clients)


def _quadratic(config, seed, path):
    from driftlab.data.quadratic import random_quadratic_clients

    return random_quadratic_clients(config.num_clients, config.quadratic_dimension, seed, config.quadratic_heterogeneity)


def _mnist(config, seed, path):
    from driftlab.data.idx import load_mnist_pixels

    return load_mnist_pixels(path)


def _fashion_mnist(config, seed, path):
    from driftlab.data.images import load_fashion_mnist_pixels

    return load_fashion_mnist_pixels(path)


def _emnist(split):
    def load(config, seed, path):
        from driftlab.data.images import load_emnist_pixels

        return load_emnist_pixels(path, split)

    return load


def _cifar(num_classes):
    def load(config, seed, path):
        from driftlab.data.images import load_cifar_pixels

        return load_cifar_pixels(path, num_classes)

    return load


def _cifar10_folder(config, seed, path):
    from driftlab.data.images import load_cifar10_image_folder_pixels

    train_x, train_y, test_x, test_y, _classes, normalisation = load_cifar10_image_folder_pixels(path, limit_per_class=config.limit_per_class)
    return train_x, train_y, test_x, test_y, normalisation


def _femnist(config, seed, path):
    from driftlab.data.leaf import load_leaf_femnist

    return load_leaf_femnist(path, max_clients=config.max_clients)


def _leaf_shakespeare(config, seed, path):
    from driftlab.data.leaf import load_leaf_shakespeare

    return load_leaf_shakespeare(path, max_clients=config.max_clients)


def _sent140(config, seed, path):
    from driftlab.data.leaf import load_leaf_sent140

    return load_leaf_sent140(path, vocabulary_size=config.vocabulary_size, max_clients=config.max_clients)


def _shakespeare(config, seed, path):
    from driftlab.data.shakespeare import load_shakespeare_text

    if path.is_dir():  # the directory `driftlab data download shakespeare --to DIR` writes to
        candidates = [path / name for name in ("input.txt", "input.txt.gz") if (path / name).is_file()]
        if not candidates:
            raise DataFileError(f"shakespeare: {path} holds neither input.txt nor input.txt.gz; set data.root to the text file")
        path = candidates[0]
    return load_shakespeare_text(
        path,
        min_samples_per_client=config.min_samples_per_client,
        max_clients=config.max_clients,
        samples_per_client=config.samples_per_client,
        test_fraction=config.client_test_fraction or 0.2,
        seed=seed,
    )


def _stackoverflow(config, seed, path):
    from driftlab.data.stackoverflow import load_stackoverflow

    return load_stackoverflow(
        path,
        vocabulary_size=config.vocabulary_size,
        tag_count=config.tag_count,
        max_clients=config.max_clients,
        max_samples_per_client=config.samples_per_client,
    )


def _custom(config, seed, path):
    """The user's data, from the function ``data.loader`` names (``driftlab.run(data=...)`` passes it directly instead)."""
    if not config.loader:
        raise ConfigError(
            'data.name = "custom" is your own data, and this run was given none: pass it to driftlab.run(config, data=...) '
            "(the same data again to resume), or set data.loader = \"module:function\" (or \"path/to/file.py:function\") "
            "naming a function that returns driftlab.FederatedArrays, so that sweeps, `driftlab run` and resumes load it"
        )
    from driftlab.experiments.config import import_function

    load = import_function(config.loader, "data.loader")
    origin = f"data.loader {config.loader!r}"
    try:
        arrays = load()
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's function failed: say so, with its own message
        raise ConfigError(f"{origin} failed: {type(error).__name__}: {error}") from error
    return federated_dataset_from_arrays(arrays, origin, "custom")


def _characters(config) -> int:
    return 80  # LEAF's character vocabulary


DATA_SETS: dict[str, DataSetInfo] = {
    "synthetic": DataSetInfo("FedProx synthetic(α,β): 60 features, 10 classes, one client per device", None, True, _synthetic),
    "synthetic_iid": DataSetInfo("FedProx's IID synthetic data", None, True, _synthetic_iid),
    "feddyn_synthetic": DataSetInfo("FedDyn's synthetic heterogeneity types 0-3 (data.feddyn_kind): 30 features, 5 classes", None, True, _feddyn_synthetic),
    "quadratic1d": DataSetInfo("decaying-K paper's clients ½ z x² − x (model.name=quadratic)", None, True, _quadratic1d),
    "quadratic": DataSetInfo("heterogeneous diagonal quadratics with a known minimiser (model.name=quadratic)", None, True, _quadratic),
    "mnist": DataSetInfo("MNIST, official IDX files (gzipped or not)", "mnist", False, _mnist, download_name="mnist", num_classes=10),
    "fashion_mnist": DataSetInfo("Fashion-MNIST, official IDX files", "fashion-mnist", False, _fashion_mnist, download_name="fashion_mnist", num_classes=10),
    "emnist_letters10": DataSetInfo("EMNIST-L: the first 10 letters of EMNIST letters (FedDyn, AdaBest)", "emnist", False, _emnist("letters10"), download_name="emnist", num_classes=10),
    "emnist_letters": DataSetInfo("EMNIST letters, 26 classes, official gzip bundle", "emnist", False, _emnist("letters"), download_name="emnist", num_classes=26),
    "emnist_byclass": DataSetInfo("EMNIST byclass, 62 classes, official gzip bundle", "emnist", False, _emnist("byclass"), download_name="emnist", num_classes=62),
    "cifar10": DataSetInfo("CIFAR-10, official binary version (folder or tarball)", "cifar10", False, _cifar(10), download_name="cifar10", num_classes=10),
    "cifar100": DataSetInfo("CIFAR-100 (fine labels), official binary version", "cifar100", False, _cifar(100), download_name="cifar100", num_classes=100),
    "cifar10_folder": DataSetInfo(
        "CIFAR-10 as <split>/<class>/<image> files, a folder or a .tar.gz", "cifar10-jpeg/cifar10-jpeg.tar.gz", False, _cifar10_folder, num_classes=10
    ),
    "femnist": DataSetInfo("LEAF FEMNIST JSON (folder or tar.gz), one client per writer", "femnist-leaf-subset/femnist-leaf-subset.tar.gz", True, _femnist),
    "shakespeare": DataSetInfo(
        "Shakespeare raw text with speaker labels, one client per role, next character after 80", "tinyshakespeare/input.txt.gz", True, _shakespeare, _characters,
        download_name="shakespeare",
    ),
    "shakespeare_leaf": DataSetInfo("LEAF Shakespeare JSON, one client per role", "shakespeare-leaf", True, _leaf_shakespeare, _characters),
    "stackoverflow": DataSetInfo(
        "TFF StackOverflow tag prediction (h5 or sqlite): bag of words → multi-label tags, one client per user (model.name=mlr)",
        "stackoverflow",
        True,
        _stackoverflow,
        download_name="stackoverflow",
    ),
    "sent140": DataSetInfo(
        "LEAF Sent140 JSON, one client per user, 25 tokens", "sent140-leaf", True, _sent140, lambda config: config.vocabulary_size
    ),
    "custom": DataSetInfo(
        "your own data: driftlab.run(config, data=driftlab.FederatedArrays(...)), or data.loader = \"module:function\" returning one; "
        "your client ids are the clients",
        None,
        True,
        _custom,
    ),
}


def data_location(config) -> Path | None:
    """Where the ``[data]`` config's files are: ``data.root``, else the first search path that holds them.

    None when there is nothing to read: generated data, or files that are
    absent (``missing_data_message`` then says where they were looked for).
    """
    info = DATA_SETS[config.name]
    if info.default_location is None:
        return None
    path = Path(config.root).expanduser() if config.root else find_data(info.default_location)
    return path if path is not None and path.exists() else None


def missing_data_message(config) -> str:
    """What is missing, where it was looked for, and every way to point driftlab at the files."""
    info = DATA_SETS[config.name]
    folder = info.default_location
    fixes = ["data.root=PATH (the files' location)"]
    if config.root:
        where = f"{Path(config.root).expanduser()} (data.root) does not exist"
    else:
        looked = data_search_paths(folder)
        where = f"no files found; looked in {', '.join(str(p) for p in looked)}"
        fixes.append(f"DRIFTLAB_DATA=DIR (a folder holding {folder})")
    if info.download_name:
        fixes.append(f"fetch them with `driftlab data download {info.download_name} --to DIR`, then data.root=DIR")
    return f"{config.name}: {where}. The files: {info.description}. Fix with one of: " + "; ".join(fixes) + near_miss_hint(config)


def near_miss_hint(config) -> str:
    """A sentence naming the setting that reaches the files when ``data.root`` or ``$DRIFTLAB_DATA`` is one folder off ("" if none).

    A path one level too high (the folder holding the CIFAR tarball, the data
    folder holding ``mnist/``) or too low (a file inside the MNIST folder) is
    the commonest slip; the candidates are judged by the names the default
    location uses, so nothing is loaded to find them.
    """
    location = DATA_SETS[config.name].default_location
    if location is None:
        return ""
    if config.root:
        root = Path(config.root).expanduser()
        found = _near_misses(root if root.exists() else root.parent, location, is_root=root.exists())
        settings = [f"data.root={path}" for path in found if not _same_place(path, root)]
    elif os.environ.get("DRIFTLAB_DATA"):
        base = Path(os.environ["DRIFTLAB_DATA"]).expanduser()
        folders = [base.parent, base.parent.parent, *_children(base, directories=True)]
        settings = [f"DRIFTLAB_DATA={folder}" for folder in folders if (folder / location).exists() and not _same_place(folder, base)]
    else:
        return ""
    if not settings:
        return ""
    return f". Near miss: the files look one folder off; try {' or '.join(list(dict.fromkeys(settings))[:3])}"


def _near_misses(root: Path, location: str, is_root: bool) -> list[Path]:
    """Paths near ``root`` that look like ``location``'s files: its tail below ``root``, a file of its kind in ``root``, or ``root``'s folder."""
    parts = Path(location).parts
    target = Path(parts[-1])
    found = [root / Path(*parts[i:]) for i in range(len(parts)) if (root / Path(*parts[i:])).exists()]
    suffix = "".join(target.suffixes)
    if suffix and is_root:  # a file (a tarball, a gzipped text): one of that kind in the folder given
        found += [child for child in _children(root, directories=False) if child.name.endswith(suffix)]
    elif is_root and root.is_file():  # a folder is expected and data.root names a file in it
        found.append(root.parent)
    return found


def _children(folder: Path, directories: bool, limit: int = 1000) -> list[Path]:
    """Up to ``limit`` entries of ``folder`` (folders or files), sorted; none when it cannot be listed."""
    try:
        with os.scandir(folder) as entries:
            chosen = []
            for count, entry in enumerate(entries):
                if count >= limit:
                    break
                if (entry.is_dir() if directories else entry.is_file()):
                    chosen.append(Path(entry.path))
    except OSError:
        return []
    return sorted(chosen)


def build_dataset(config, seed: int) -> FederatedDataset:
    """Generate or load the data set and split it over clients, seeded by ``config.seed`` (default ``seed``)."""
    data_seed = config.seed if config.seed is not None else seed
    info = DATA_SETS[config.name]
    path = data_location(config)
    if path is None and info.default_location is not None:
        raise DataFileError(missing_data_message(config))
    partition = config.partition or ("natural" if info.natural else "iid")
    try:
        return _build(config, info, path, partition, data_seed)
    except DataFileError as error:
        hint = near_miss_hint(config)
        if hint:
            raise DataFileError(f"{str(error).rstrip('.')}{hint}") from None
        raise
    except ConfigError:
        raise
    except ValueError as error:
        raise DataSetupError(f"data ({config.name}, partition={partition}, num_clients={config.num_clients}): {error}") from None


def _build(config, info: DataSetInfo, path: Path | None, partition: str, data_seed: int) -> FederatedDataset:
    loaded = info.load(config, data_seed, path)
    if isinstance(loaded, FederatedDataset) and loaded.multi_label:
        if partition != "natural" or config.client_test_fraction > 0:
            raise ValueError("stackoverflow keeps its users as clients and its own test split: leave data.partition and data.client_test_fraction unset")
        return loaded
    if isinstance(loaded, FederatedDataset):
        if partition == "natural":
            dataset = loaded
        else:
            dataset = _resplit(loaded, config, partition, data_seed)
    else:
        if partition == "natural":
            raise DataFileError(f"data.partition=natural: {config.name} has no natural clients; use iid, dirichlet, ...")
        # image loaders give uint8 pixels and their normalisation, applied batch by batch (a quarter of the memory)
        train_x, train_y, test_x, test_y, *normalisation = loaded
        client_indices = split_over_clients(train_y.numpy(), config, partition, data_seed)
        num_classes = info.num_classes or int(max(train_y.max(), test_y.max())) + 1
        dataset = FederatedDataset(
            config.name, train_x, train_y, test_x, test_y, client_indices, num_classes=num_classes,
            input_normalisation=normalisation[0] if normalisation else None,
        )
    if config.client_test_fraction > 0 and dataset.client_test_indices is None:
        dataset = _with_client_test_splits(dataset, config.client_test_fraction, data_seed)
    return dataset


def prepared_custom_data(dataset: FederatedDataset, config, seed: int) -> FederatedDataset:
    """Your own data set (``driftlab.run(data=...)``) as a run of this ``[data]`` config uses it, as ``build_dataset``
    prepares a loader's: ``data.client_test_fraction`` of every client held out, seeded like the built-in data sets."""
    data_seed = config.seed if config.seed is not None else seed
    if config.client_test_fraction > 0 and dataset.client_test_indices is None:
        try:
            return _with_client_test_splits(dataset, config.client_test_fraction, data_seed)
        except ValueError as error:
            raise DataSetupError(f"data (custom): {error}") from None
    return dataset


class DataSetupError(ValueError):
    """The data set loaded, but the config cannot be applied to it (too many clients, an impossible partition, ...)."""


def vocabulary_size(config) -> int | None:
    info = DATA_SETS[config.name]
    return info.vocabulary_size(config) if info.vocabulary_size is not None else None


def split_over_clients(labels: np.ndarray, config, partition: str, seed: int) -> tuple[np.ndarray, ...]:
    from driftlab.data import partition as partitions

    rng = generator(seed, Stream.PARTITION)
    num_samples = len(labels)
    if partition == "dirichlet_classwise":
        return partitions.dirichlet_classwise_partition(labels, config.num_clients, config.dirichlet_alpha, rng, config.min_client_size)
    if partition == "power_law":
        return partitions.power_law_partition(labels, config.num_clients, config.classes_per_client, rng)
    if config.quotas == "lognormal":
        quotas = partitions.lognormal_quotas(num_samples, config.num_clients, config.lognormal_sigma, rng)
    else:
        quotas = partitions.balanced_quotas(num_samples, config.num_clients)
    if partition == "dirichlet":
        return partitions.dirichlet_client_prior_partition(labels, quotas, config.dirichlet_alpha, rng)
    if partition == "classes_per_client":
        return partitions.classes_per_client_partition(labels, config.num_clients, config.classes_per_client, rng, quotas=quotas)
    if partition == "iid":
        return partitions.iid_partition(num_samples, quotas, rng)
    raise ValueError(f"unknown partition {partition!r}")


def _resplit(dataset: FederatedDataset, config, partition: str, seed: int) -> FederatedDataset:
    """Pool a naturally partitioned training set and split it again (e.g. FEMNIST made IID)."""
    pooled = np.concatenate(dataset.client_indices)
    labels = dataset.train_targets.numpy()[pooled]
    clients = tuple(pooled[indices] for indices in split_over_clients(labels, config, partition, seed))
    return FederatedDataset(
        f"{dataset.name}/{partition}",
        dataset.train_inputs,
        dataset.train_targets,
        dataset.test_inputs,
        dataset.test_targets,
        tuple(np.sort(c) for c in clients),
        num_classes=dataset.num_classes,
        known_minimizer=dataset.known_minimizer,
        input_normalisation=dataset.input_normalisation,
    )


def _with_client_test_splits(dataset: FederatedDataset, fraction: float, seed: int) -> FederatedDataset:
    """Hold out ``fraction`` of every client's training rows as its local test split (EFL's per-client accuracy).

    The held-out rows are copied after the test rows; the global test set stays
    the data set's own (``global_test_size``), and the held-out rows leave the
    clients' training indices.
    """
    from driftlab.data.partition import split_client_test

    rng = generator(seed, Stream.PARTITION, 1)
    train_parts, test_parts = split_client_test(dataset.client_indices, fraction, rng)
    held_out = np.concatenate(test_parts)
    if len(held_out) == 0:
        raise ValueError(f"data.client_test_fraction={fraction} holds out no example (the clients are too small); raise it or set it to 0")
    offset = len(dataset.test_targets)
    test_inputs = torch.cat([dataset.test_inputs, dataset.train_inputs[torch.as_tensor(held_out)]])
    test_targets = torch.cat([dataset.test_targets, dataset.train_targets[torch.as_tensor(held_out)]])
    bounds = np.cumsum([0, *[len(p) for p in test_parts]])
    client_test = tuple(np.arange(offset + bounds[i], offset + bounds[i + 1], dtype=np.int64) for i in range(len(test_parts)))
    return FederatedDataset(
        dataset.name,
        dataset.train_inputs,
        dataset.train_targets,
        test_inputs,
        test_targets,
        tuple(train_parts),
        num_classes=dataset.num_classes,
        client_test_indices=client_test,
        known_minimizer=dataset.known_minimizer,
        global_test_size=offset,
        targets_are_classes=dataset.targets_are_classes,
        input_normalisation=dataset.input_normalisation,
    )
