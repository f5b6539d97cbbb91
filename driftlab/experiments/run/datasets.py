"""From a ``[data]`` config section to a ``FederatedDataset``.

Each data set name is an entry of ``driftlab.data.registry`` (driftlab's own in
``driftlab.data.builtins``, yours from a plugin) holding its loader (official file
formats) or generator; here its files are found, it is loaded, and its training set
is split over clients by the partition the config names (``natural`` keeps a data
set's own clients: writers, speaking roles, users, synthetic devices), and
optionally every client's data is split into a local train and test part.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import torch

from driftlab.data.federated import DataFileError, FederatedDataset
from driftlab.data.partition import deal_test_like_training
from driftlab.data.registry import DATA_SETS, DataSetEntry, entry_of  # noqa: F401 - DATA_SETS: re-exported
from driftlab.errors import ConfigError
from driftlab.randomness import Stream, generator

REPOSITORY_ROOT = Path(__file__).resolve().parents[3]


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


def data_location(config) -> Path | None:
    """Where the ``[data]`` config's files are: ``data.root``, else the first search path that holds them.

    None when there is nothing to read: generated data, or files that are
    absent (``missing_data_message`` then says where they were looked for).
    """
    entry = entry_of(config)
    if entry.location is None:
        return None
    path = Path(config.root).expanduser() if config.root else find_data(entry.location)
    return path if path is not None and path.exists() else None


def missing_data_message(config) -> str:
    """What is missing, where it was looked for, and every way to point driftlab at the files."""
    entry = entry_of(config)
    folder = entry.location
    fixes = ["data.root=PATH (the files' location)"]
    if config.root:
        where = f"{Path(config.root).expanduser()} (data.root) does not exist"
    else:
        looked = data_search_paths(folder)
        where = f"no files found; looked in {', '.join(str(p) for p in looked)}"
        fixes.append(f"DRIFTLAB_DATA=DIR (a folder holding {folder})")
    if entry.download is not None:
        fixes.append(f"fetch them with `driftlab data download {entry.download.name} --to DIR`, then data.root=DIR")
    return (
        f"{config.name}: {where}. The files: {entry.description}. Fix with one of: "
        + "; ".join(fixes)
        + near_miss_hint(config)
    )


def near_miss_hint(config) -> str:
    """A sentence naming the setting that reaches the files when ``data.root`` or ``$DRIFTLAB_DATA`` is one folder off ("" if none).

    A path one level too high (the folder holding the CIFAR tarball, the data
    folder holding ``mnist/``) or too low (a file inside the MNIST folder) is
    the commonest slip; the candidates are judged by the names the default
    location uses, so nothing is loaded to find them.
    """
    location = entry_of(config).location
    if location is None:
        return ""
    if config.root:
        root = Path(config.root).expanduser()
        found = _near_misses(root if root.exists() else root.parent, location, is_root=root.exists())
        settings = [f"data.root={path}" for path in found if not _same_place(path, root)]
    elif os.environ.get("DRIFTLAB_DATA"):
        base = Path(os.environ["DRIFTLAB_DATA"]).expanduser()
        folders = [base.parent, base.parent.parent, *_children(base, directories=True)]
        settings = [
            f"DRIFTLAB_DATA={folder}"
            for folder in folders
            if (folder / location).exists() and not _same_place(folder, base)
        ]
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
                if entry.is_dir() if directories else entry.is_file():
                    chosen.append(Path(entry.path))
    except OSError:
        return []
    return sorted(chosen)


def build_dataset(config, seed: int) -> FederatedDataset:
    """Generate or load the data set and split it over clients, seeded by ``config.seed`` (default ``seed``)."""
    data_seed = config.seed if config.seed is not None else seed
    entry = entry_of(config)
    path = data_location(config)
    if path is None and entry.location is not None:
        raise DataFileError(missing_data_message(config))
    partition = config.partition or ("natural" if entry.natural_clients else "iid")
    try:
        return _build(config, entry, path, partition, data_seed)
    except DataFileError as error:
        hint = near_miss_hint(config)
        if hint:
            raise DataFileError(f"{str(error).rstrip('.')}{hint}") from None
        raise
    except ConfigError:
        raise
    except ValueError as error:
        raise DataSetupError(
            f"data ({config.name}, partition={partition}, num_clients={config.num_clients}): {error}"
        ) from None


def _build(config, entry: DataSetEntry, path: Path | None, partition: str, data_seed: int) -> FederatedDataset:
    loaded = entry.load(config, data_seed, path)
    if isinstance(loaded, FederatedDataset) and loaded.multi_label:
        if partition != "natural" or config.client_test_fraction > 0:
            raise ValueError(
                "stackoverflow keeps its users as clients and its own test split: leave data.partition and data.client_test_fraction unset"
            )
        return loaded
    if isinstance(loaded, FederatedDataset) and (loaded.clients_unassigned or config.name == "custom"):
        dataset = own_clients(loaded, config, data_seed)  # your own data (data.loader): its ids, or data.partition's
    elif isinstance(loaded, FederatedDataset):
        if partition == "natural":
            dataset = loaded
        else:
            dataset = _resplit(loaded, config, partition, data_seed, entry.tests_from_fraction)
    else:
        if partition == "natural":
            raise DataFileError(
                f"data.partition=natural: {config.name} has no natural clients; use iid, dirichlet, ..."
            )
        # image loaders give uint8 pixels and their normalisation, applied batch by batch (a quarter of the memory)
        train_x, train_y, test_x, test_y, *normalisation = loaded
        client_indices = split_over_clients(train_y.numpy(), config, partition, data_seed)
        num_classes = entry.num_classes or int(max(train_y.max(), test_y.max())) + 1
        dataset = FederatedDataset(
            config.name,
            train_x,
            train_y,
            test_x,
            test_y,
            client_indices,
            num_classes=num_classes,
            input_normalisation=normalisation[0] if normalisation else None,
        )
    if config.client_test_fraction > 0 and dataset.client_test_indices is None:
        dataset = _with_client_test_splits(dataset, config.client_test_fraction, data_seed)
    if config.validation_fraction:
        dataset = with_validation_split(dataset, config.validation_fraction, data_seed)
    return dataset


def prepared_custom_data(dataset: FederatedDataset, config, seed: int) -> FederatedDataset:
    """Your own data set (``driftlab.run(data=...)``) as a run of this ``[data]`` config uses it, as ``build_dataset``
    prepares a loader's: examples given without client ids dealt out by ``data.partition`` (``own_clients``), then
    ``data.client_test_fraction`` of every client held out, seeded like the built-in data sets."""
    data_seed = config.seed if config.seed is not None else seed
    try:
        dataset = own_clients(dataset, config, data_seed)
        if config.client_test_fraction > 0 and dataset.client_test_indices is None:
            dataset = _with_client_test_splits(dataset, config.client_test_fraction, data_seed)
        if config.validation_fraction:
            dataset = with_validation_split(dataset, config.validation_fraction, data_seed)
    except ValueError as error:
        raise DataSetupError(f"data (custom): {error}") from None
    return dataset


def own_clients(dataset: FederatedDataset, config, seed: int) -> FederatedDataset:
    """Your own data's clients: the client ids it came with, or, for examples given without ids
    (``dataset.clients_unassigned``), ``data.num_clients`` clients dealt out by ``data.partition`` (default iid) with
    ``split_over_clients``, exactly as a built-in pooled data set is split for the same data seed.

    ValueError when the partition cannot apply: ``natural`` without ids, a partition by class of targets that are not
    class ids, or a partition other than ``natural`` of data that brings its own client ids.
    """
    partition = config.partition
    if not dataset.clients_unassigned:
        if partition not in (None, "natural"):
            raise ValueError(
                f"data.partition = {partition!r} deals out examples, but your data brings its own client ids; leave "
                "data.partition unset to keep them, or give the arrays without train_client_ids to have them dealt out"
            )
        return dataset
    partition = partition or "iid"
    if partition == "natural":
        raise ValueError(
            "data.partition = natural keeps your client ids, and the data came without any; give train_client_ids, or "
            "set data.partition to iid, dirichlet, dirichlet_classwise, classes_per_client or power_law"
        )
    if partition != "iid" and (not dataset.targets_are_classes or dataset.multi_label):
        raise ValueError(
            f"data.partition = {partition} deals out examples by class, and your targets are not class ids; "
            "use data.partition = iid"
        )
    labels = dataset.train_targets.numpy() if partition != "iid" else np.zeros(len(dataset.train_targets), np.int64)
    clients = split_over_clients(labels, config, partition, seed)
    return dataclasses.replace(dataset, client_indices=tuple(clients), clients_unassigned=False)


def with_validation_split(dataset: FederatedDataset, fraction: float, seed: int) -> FederatedDataset:
    """``dataset`` with ``v_k = ⌈fraction · n_k⌉`` of client k's training rows held out as its validation rows.

    Client k's rows are drawn by a generator of (seed, client id) alone (``Stream.VALIDATION_SPLIT``), so a client's
    split does not depend on the other clients; the held-out rows leave ``client_indices`` (they never train) and
    stay in the training tensors, where evaluation reads them (``validation_loss``, ``validation_accuracy``).  The
    test splits are untouched.  ValueError naming the client when the holdout would leave it no training row.
    """
    if dataset.client_validation_indices is not None:
        raise ValueError("the data set already has validation splits; leave data.validation_fraction unset")
    train, held = [], []
    for client_id, rows in enumerate(dataset.client_indices):
        n = len(rows)
        count = math.ceil(fraction * n - 1e-9)
        if count >= n:
            raise ValueError(
                f"data.validation_fraction = {fraction:g} holds out {count} of client {client_id}'s {n} training rows and "
                f"leaves it none to train on; lower data.validation_fraction (below {(n - 1) / n:.3g} for this client) or use "
                "fewer, larger clients"
            )
        order = generator(seed, Stream.VALIDATION_SPLIT, 0, client_id).permutation(n)
        train.append(np.sort(rows[order[: n - count]]))
        held.append(np.sort(rows[order[n - count :]]))
    return dataclasses.replace(dataset, client_indices=tuple(train), client_validation_indices=tuple(held))


class DataSetupError(ValueError):
    """The data set loaded, but the config cannot be applied to it (too many clients, an impossible partition, ...)."""


def vocabulary_size(config) -> int | None:
    """The token vocabulary a sequence model embeds for the ``[data]`` section ``config`` (None: not sequence data)."""
    entry = entry_of(config)
    return entry.vocabulary(config) if entry.vocabulary is not None else None


def split_over_clients(labels: np.ndarray, config, partition: str, seed: int) -> tuple[np.ndarray, ...]:
    from driftlab.data import partition as partitions

    rng = generator(seed, Stream.PARTITION)
    num_samples = len(labels)
    if partition == "dirichlet_classwise":
        return partitions.dirichlet_classwise_partition(
            labels, config.num_clients, config.dirichlet_alpha, rng, config.min_client_size
        )
    if partition == "power_law":
        return partitions.power_law_partition(labels, config.num_clients, config.classes_per_client, rng)
    if config.quotas == "lognormal":
        quotas = partitions.lognormal_quotas(num_samples, config.num_clients, config.lognormal_sigma, rng)
    else:
        quotas = partitions.balanced_quotas(num_samples, config.num_clients)
    if partition == "dirichlet":
        return partitions.dirichlet_client_prior_partition(labels, quotas, config.dirichlet_alpha, rng)
    if partition == "classes_per_client":
        return partitions.classes_per_client_partition(
            labels, config.num_clients, config.classes_per_client, rng, quotas=quotas
        )
    if partition == "iid":
        return partitions.iid_partition(num_samples, quotas, rng)
    raise ValueError(f"unknown partition {partition!r}")


def _resplit(
    dataset: FederatedDataset, config, partition: str, seed: int, tests_from_fraction: bool = False
) -> FederatedDataset:
    """Pool a naturally partitioned training set and split it again (e.g. FEMNIST made IID).

    Where the loader itself held out ``data.client_test_fraction`` of every client (``tests_from_fraction``:
    Shakespeare), those test rows are dealt to the new clients like their training labels
    (``deal_test_like_training``) instead of a second share of the training rows being held out.
    """
    pooled = np.concatenate(dataset.client_indices)
    labels = dataset.train_targets.numpy()[pooled]
    clients = tuple(np.sort(pooled[indices]) for indices in split_over_clients(labels, config, partition, seed))
    client_test = None
    if tests_from_fraction and config.client_test_fraction > 0 and dataset.client_test_indices is not None:
        rows = np.sort(np.concatenate(dataset.client_test_indices))
        train_targets = dataset.train_targets.numpy()
        dealt = deal_test_like_training(
            [train_targets[c] for c in clients],
            dataset.test_targets.numpy()[rows],
            generator(seed, Stream.PARTITION, 2),
        )
        client_test = tuple(rows[d] for d in dealt)
    return FederatedDataset(
        f"{dataset.name}/{partition}",
        dataset.train_inputs,
        dataset.train_targets,
        dataset.test_inputs,
        dataset.test_targets,
        clients,
        num_classes=dataset.num_classes,
        client_test_indices=client_test,
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
        raise ValueError(
            f"data.client_test_fraction={fraction} holds out no example (the clients are too small); raise it or set it to 0"
        )
    offset = len(dataset.test_targets)
    test_inputs = torch.cat([dataset.test_inputs, dataset.train_inputs[torch.as_tensor(held_out)]])
    test_targets = torch.cat([dataset.test_targets, dataset.train_targets[torch.as_tensor(held_out)]])
    bounds = np.cumsum([0, *[len(p) for p in test_parts]])
    client_test = tuple(
        np.arange(offset + bounds[i], offset + bounds[i + 1], dtype=np.int64) for i in range(len(test_parts))
    )
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
