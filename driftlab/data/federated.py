"""The federated data container: shared tensors plus one index array per client.

A federated data set is a centralised train/test pair together with a
partition of the training set over clients. Clients never hold copies of
their data: each client is an int64 array of row indices into the shared
``train_inputs``/``train_targets`` tensors (and, optionally, into the shared
test tensors for a per-client test split, as in FedProx's 80%/20% split of
every device and EFL's mean per-client test accuracy). Memory therefore does
not grow with the number of clients, and a client's batch is one gather.

Example:
    >>> import numpy as np, torch
    >>> ds = FederatedDataset(
    ...     name="toy",
    ...     train_inputs=torch.zeros(5, 2), train_targets=torch.tensor([0, 0, 0, 0, 1]),
    ...     test_inputs=torch.zeros(1, 2), test_targets=torch.tensor([1]),
    ...     client_indices=(np.array([0, 1, 2, 3]), np.array([4])), num_classes=2)
    >>> ds.num_clients, ds.client_sizes.tolist(), ds.input_shape
    (2, [4, 1], (2,))
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from driftlab.data.array_checks import (
    _check_client_ids,
    _check_finite,
    _check_rows,
    _client_id_array,
    _is_integer,
    _number_of_classes,
    _rows_by_client,
    _tensor,
)
from driftlab.data.dataset_checks import (
    _check_free_targets,
    _check_pixels,
    _check_split,
    _checked_index_arrays,
    _hash_array,
)
from driftlab.data.dataset_items import _as_array, _stacked_items
from driftlab.data.pixels import PixelNormalisation
from driftlab.errors import ConfigError

__all__ = [
    "DataFileError",
    "FederatedArrays",
    "FederatedDataset",
    "classes_covering_fraction",
    "federated_dataset_from_arrays",
]


class DataFileError(ValueError):
    """A data file is missing, truncated, or not what its name says it is.

    The message names the file and states what was expected, so the user can
    fix the file (re-download, un-swap two files) without reading the code.
    """


def contiguous_ranges(sizes: Sequence[int] | np.ndarray) -> tuple[np.ndarray, ...]:
    """Consecutive index blocks of the given sizes: sizes (2, 3) -> ([0, 1], [2, 3, 4]).

    Loaders that store each client's rows together (generated data, LEAF, Shakespeare, ...) give every client one
    block."""
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    return tuple(np.arange(start, start + size, dtype=np.int64) for start, size in zip(starts, sizes, strict=True))


@dataclass(frozen=True, eq=False)
class FederatedDataset:
    """Shared train/test tensors and a partition of the training rows over clients.

    Attributes:
        name: human-readable name, e.g. ``"mnist/dirichlet(0.3)"`` or ``"synthetic(1,1)"``.
        train_inputs: ``[N, *input_shape]``, already preprocessed (float32 for
            images and features; integer token ids are accepted for text).
        train_targets: ``[N]`` int64 class ids in ``[0, num_classes)``.
        test_inputs: ``[M, *input_shape]``, preprocessed like ``train_inputs``.
        input_normalisation: with uint8 image inputs, the normalisation applied
            to every gathered batch (``data.pixels.PixelNormalisation``), a
            quarter of the memory of normalised float32 images; ``None``: the
            inputs are used as they are.
        test_targets: ``[M]`` int64 class ids.
        client_indices: one int64 array per client with row indices into the
            train tensors. Every client holds at least one row; no row belongs
            to two clients. Rows held by no client are allowed (a subsample).
        num_classes: number of classes of the task.
        client_test_indices: optional per-client test split, one int64 array
            per client with row indices into the test tensors (may be empty
            for a client; no test row belongs to two clients).
        global_test_size: when clients' local test splits were held out of
            the training data and appended to the test tensors, the number of
            leading test rows that are the global test set (``None``: all rows).
        multi_label: targets are float32 multi-hot rows ``[N, num_classes]``
            (0/1, any number of labels per example; StackOverflow's tags)
            instead of int64 class ids.
        targets_are_classes: targets are class ids (or multi-hot rows with
            ``multi_label``); False for targets of any dtype and shape with one
            row per example, which only a loss of the user's own reads
            (regression values; ``num_classes`` is then the model's output width).
        known_minimizer: the flat parameter vector minimising the global
            objective, for synthetic objectives where it is known in closed
            form (the quadratic clients); evaluation then reports the distance to it.
        clients_unassigned: the rows came without client ids (``FederatedArrays``
            without ``train_client_ids``): one placeholder client holds them all
            until ``experiments.run.datasets.own_clients`` deals them out by ``data.partition``.

    Equality is identity (``eq=False``): comparing tensors element-wise is
    never what ``==`` on a data set should mean. The index arrays are stored
    as read-only views so a client's partition cannot be changed by accident.
    """

    name: str
    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    test_inputs: torch.Tensor
    test_targets: torch.Tensor
    client_indices: tuple[np.ndarray, ...]
    num_classes: int
    client_test_indices: tuple[np.ndarray, ...] | None = None
    known_minimizer: np.ndarray | None = None  # the global minimiser, for synthetic objectives that have one
    global_test_size: int | None = None  # the first rows of the test tensors that form the global test set (None: all)
    multi_label: bool = False  # targets are float multi-hot rows [N, num_classes] instead of class ids
    targets_are_classes: bool = True  # False: targets of any shape for a loss of the user's own (regression)
    # uint8 image inputs kept as pixels, normalised batch by batch by this (data.pixels); None: inputs used as they are
    input_normalisation: PixelNormalisation | None = None
    # Per-client validation rows (data.validation_fraction): indices into the *train* tensors, held out of
    # client_indices, so they never train; None: no validation split.
    client_validation_indices: tuple[np.ndarray, ...] | None = None
    # Rows given without client ids (FederatedArrays without train_client_ids): one placeholder client holds every
    # row until ``experiments.run.datasets`` deals them out by ``data.partition``; never trained on as it is.
    clients_unassigned: bool = False

    def __post_init__(self) -> None:
        if self.input_normalisation is not None:
            _check_pixels(self.train_inputs, self.test_inputs, self.input_normalisation)
        if self.targets_are_classes:
            _check_split(self.train_inputs, self.train_targets, "train", self.num_classes, self.multi_label)
            _check_split(self.test_inputs, self.test_targets, "test", self.num_classes, self.multi_label)
        else:
            _check_free_targets(self.train_inputs, self.train_targets, "train")
            _check_free_targets(self.test_inputs, self.test_targets, "test")
        if tuple(self.train_inputs.shape[1:]) != tuple(self.test_inputs.shape[1:]):
            raise ValueError(
                f"train and test inputs have different per-sample shapes: "
                f"{tuple(self.train_inputs.shape[1:])} vs {tuple(self.test_inputs.shape[1:])}; "
                "preprocess both splits the same way"
            )
        clients = _checked_index_arrays(
            self.client_indices, len(self.train_targets), "client_indices", "train", allow_empty=False
        )
        if not clients:
            raise ValueError("client_indices is empty: a federated data set needs at least one client")
        # frozen=True blocks normal assignment; object.__setattr__ is the
        # documented way to normalise fields inside __post_init__.
        object.__setattr__(self, "client_indices", clients)
        if self.client_test_indices is not None:
            test_clients = _checked_index_arrays(
                self.client_test_indices, len(self.test_targets), "client_test_indices", "test", allow_empty=True
            )
            if len(test_clients) != len(clients):
                raise ValueError(
                    f"client_test_indices has {len(test_clients)} arrays but client_indices has "
                    f"{len(clients)}; give one test split per client (an empty array is allowed)"
                )
            object.__setattr__(self, "client_test_indices", test_clients)
        if self.client_validation_indices is not None:
            validation = _checked_index_arrays(
                self.client_validation_indices,
                len(self.train_targets),
                "client_validation_indices",
                "train",
                allow_empty=True,
            )
            if len(validation) != len(clients):
                raise ValueError(
                    f"client_validation_indices has {len(validation)} arrays but client_indices has {len(clients)}; "
                    "give one validation split per client (an empty array is allowed)"
                )
            for client_id, (train, held) in enumerate(zip(clients, validation, strict=True)):
                if np.intersect1d(train, held).size:
                    raise ValueError(
                        f"client {client_id}'s validation rows overlap its training rows; validation rows never train"
                    )
            object.__setattr__(self, "client_validation_indices", validation)

    @property
    def num_clients(self) -> int:
        """Number of clients."""
        return len(self.client_indices)

    @property
    def client_sizes(self) -> np.ndarray:
        """Training samples per client, int64 ``[num_clients]``."""
        return np.array([len(idx) for idx in self.client_indices], dtype=np.int64)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input sample (the train tensor's shape without the first axis)."""
        return tuple(self.train_inputs.shape[1:])

    @cached_property
    def digest(self) -> str:
        """SHA-256 of everything a run reads of the data: the tensors (dtype, shape, bytes), the partition and the task.

        config.json records it for the user's own data, so a resume with other data is refused."""
        hasher = hashlib.sha256()
        header = [self.num_classes, self.multi_label, self.targets_are_classes, self.global_test_size]
        if self.input_normalisation is not None:  # float data keeps the digest it always had
            header.append((self.input_normalisation.mean, self.input_normalisation.std))
        if self.clients_unassigned:  # partitioned data (every data set a run trains on) keeps the digest it had
            header.append("clients unassigned")
        hasher.update(repr(header).encode())
        for tensor in (self.train_inputs, self.train_targets, self.test_inputs, self.test_targets):
            _hash_array(hasher, tensor)
        for group in (self.client_indices, self.client_test_indices or ()):
            hasher.update(f"clients:{len(group)}".encode())
            for indices in group:
                _hash_array(hasher, indices)
        if self.client_validation_indices is not None:  # data without a validation split keeps the digest it had
            hasher.update(f"validation:{len(self.client_validation_indices)}".encode())
            for indices in self.client_validation_indices:
                _hash_array(hasher, indices)
        return hasher.hexdigest()

    def describe(self) -> dict:
        """Summary statistics of the partition.

        ``classes_for_80_percent_*`` is the heterogeneity statistic of FedDyn
        (Acar et al. 2021, Section 5 and Figure 3): for each client, the
        smallest number of classes whose samples make up at least 80% of the
        client's data; reported as min/median/max over clients. FedDyn reports
        about 5 (Dirichlet 0.6) and 3 (Dirichlet 0.3) on MNIST with 100 devices,
        and 8 for an IID split of a 10-class set.

        Returns:
            A flat dict with ``name``, ``clients``, ``train_samples`` (held by
            clients), ``test_samples`` (global test set), ``samples_per_client_min``,
            ``..._median``, ``..._max``, ``classes_for_80_percent_min``,
            ``..._median`` and ``..._max`` (the last three not for multi-label data).
        """
        sizes = self.client_sizes
        summary = {
            "name": self.name,
            "clients": self.num_clients,
            "train_samples": int(sizes.sum()),
            "test_samples": self.global_test_size if self.global_test_size is not None else len(self.test_targets),
            "samples_per_client_min": int(sizes.min()),
            "samples_per_client_median": float(np.median(sizes)),
            "samples_per_client_max": int(sizes.max()),
        }
        if (
            self.multi_label or not self.targets_are_classes
        ):  # no single class per example: the 80% statistic is undefined
            return summary
        targets = self.train_targets.numpy()
        classes_80 = np.array(
            [classes_covering_fraction(targets[idx], self.num_classes, 0.8) for idx in self.client_indices]
        )
        summary["classes_for_80_percent_min"] = int(classes_80.min())
        summary["classes_for_80_percent_median"] = float(np.median(classes_80))
        summary["classes_for_80_percent_max"] = int(classes_80.max())
        return summary


def classes_covering_fraction(labels: np.ndarray, num_classes: int, fraction: float) -> int:
    """Smallest number of classes whose samples make up at least ``fraction`` of ``labels``.

    Classes are taken largest first. Example: labels ``[0, 0, 1, 1, 2]`` with
    ``fraction=0.8`` need 4 of 5 samples, i.e. classes 0 and 1: the answer is 2.

    Args:
        labels: 1-D integer class ids in ``[0, num_classes)``, at least one.
        num_classes: number of classes.
        fraction: in ``(0, 1]``.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if len(labels) == 0:
        raise ValueError("labels is empty: the class coverage of an empty client is undefined")
    counts = np.sort(np.bincount(labels, minlength=num_classes))[::-1]
    # fraction * n is a float that can land just above the integer it means
    # (0.1 * 30 == 3.0000000000000004); a tolerance far below one sample
    # keeps "exactly 3 of 30" counted as covering 10%.
    needed = fraction * len(labels)
    covered = np.cumsum(counts)
    return int(np.searchsorted(covered, needed - 1e-9 * len(labels), side="left") + 1)


# ---------------------------------------------------------------- the user's own data


ArrayLike = Any  # a numpy array or a torch tensor


@dataclass(frozen=True, eq=False)
class FederatedArrays:
    """Your own federated data, in memory: what ``driftlab.run(config, data=...)`` and a ``data.loader`` take.

    Attributes:
        train_inputs: ``[N, ...]`` numpy array or tensor, one row per training example.
        train_targets: ``[N]`` integer class ids (a classifier: cross-entropy and accuracy by default), or
            floating targets of any shape ``[N, ...]`` for a loss of your own (``loss=``; no accuracy).
        train_client_ids: ``[N]`` integers: the client holding each training example, 0..C-1 with every
            client holding at least one example; or ``None``: the run deals the examples out to
            ``data.num_clients`` clients by ``data.partition`` (iid by default; dirichlet, classes_per_client, ...),
            seeded as the built-in data sets are.  The arrays are used without a copy where they can be,
            read-only ones (``np.load(mmap_mode="r")``) too; driftlab never writes into them.
        test_inputs, test_targets: the global test set, like the training arrays.
        test_client_ids: optional ``[M]``: each test example's client (its local test split, giving
            ``client_test_accuracy_mean``); ``None``: the test set is global only.
        num_classes: classes of integer targets; default: the largest class id in either split, plus one, which
            needs at least half of the ids 0..largest to occur (a stray label such as 10**7 among 0..9 is refused
            rather than made into 10**7 empty classes; set num_classes when most classes have no example).
        input_normalisation: for uint8 images ``[N, c, h, w]``, a ``driftlab.data.pixels.PixelNormalisation``:
            the images stay uint8 (a quarter of float32's memory) and every batch is normalised as it is
            gathered; ``None``: the inputs are used as given.

    ``FederatedArrays.from_datasets`` builds one from map-style torch Datasets or Hugging Face datasets.

    Example:
        >>> import numpy as np
        >>> arrays = FederatedArrays(
        ...     train_inputs=np.zeros((5, 2), np.float32), train_targets=np.array([0, 1, 0, 1, 1]),
        ...     train_client_ids=np.array([0, 0, 1, 1, 1]),
        ...     test_inputs=np.zeros((2, 2), np.float32), test_targets=np.array([0, 1]))
        >>> federated_dataset_from_arrays(arrays).client_sizes.tolist()
        [2, 3]
    """

    train_inputs: ArrayLike
    train_targets: ArrayLike
    train_client_ids: ArrayLike | None = None
    # Defaults only so that train_client_ids may be left out by keyword; both are required (the global test set).
    test_inputs: ArrayLike = None
    test_targets: ArrayLike = None
    test_client_ids: ArrayLike | None = None
    num_classes: int | None = None
    input_normalisation: PixelNormalisation | None = None

    @classmethod
    def from_datasets(
        cls,
        train: Any,
        client_ids: Sequence[int] | ArrayLike | None = None,
        test: Any = None,
        test_client_ids: Sequence[int] | ArrayLike | None = None,
        num_classes: int | None = None,
        *,
        input_key: str | None = None,
        label_key: str | None = None,
    ) -> "FederatedArrays":
        """Read map-style datasets into arrays: torch Datasets whose items are ``(input, target)``, or Hugging Face
        datasets (and any dataset) whose items are dicts, read at ``input_key`` and ``label_key``.

        ``client_ids``: one client id per training item, or None to have ``data.partition`` deal the items out.
        Every item is read once (``len(dataset)`` items, by index) and stacked, so the inputs must all have one
        shape; a PIL image becomes its ``[h, w(, c)]`` array as numpy reads it (give a model that reads that layout,
        or ``dataset.with_format("torch")`` after a transform).  Without ``input_key``/``label_key`` a dict's keys
        are found by name: the label is the one of ``label``, ``labels``, ``target``, ``targets``, ``y`` present, the
        input the one of ``image``, ``img``, ``pixel_values``, ``input_ids``, ``input``, ``inputs``, ``features``,
        ``x``, or the only other key; an item with several candidates (CIFAR-100's ``fine_label`` and
        ``coarse_label``) is refused with its keys listed.

        Example:
            >>> items = [{"image": [[0, 1], [2, 3]], "label": 1}, {"image": [[4, 5], [6, 7]], "label": 0}]
            >>> arrays = FederatedArrays.from_datasets(items, test=items[:1])
            >>> tuple(arrays.train_inputs.shape), arrays.train_targets.tolist(), arrays.train_client_ids
            ((2, 2, 2), [1, 0], None)
        """
        if test is None:
            raise ConfigError(
                "data: from_datasets needs the test set too: FederatedArrays.from_datasets(train, client_ids, test)"
            )
        train_inputs, train_targets = _stacked_items(train, "train", input_key, label_key)
        test_inputs, test_targets = _stacked_items(test, "test", input_key, label_key)
        train_ids = None if client_ids is None else _as_array(client_ids)
        test_ids = None if test_client_ids is None else _as_array(test_client_ids)
        return cls(train_inputs, train_targets, train_ids, test_inputs, test_targets, test_ids, num_classes)


def federated_dataset_from_arrays(
    arrays: FederatedArrays, origin: str = "data", name: str = "custom"
) -> FederatedDataset:
    """Your arrays as a FederatedDataset, every field checked; a ConfigError that names the field, what is wrong and the fix.

    ``origin`` names where the arrays came from in messages (``data=``, ``data.loader 'mod:load'``).
    """
    if not isinstance(arrays, FederatedArrays):
        raise ConfigError(
            f"{origin}: expected driftlab.FederatedArrays (train/test inputs and targets and the client id of every "
            f"training example), got {type(arrays).__name__}; build one with driftlab.FederatedArrays(...) or "
            "driftlab.FederatedArrays.from_datasets(train_dataset, client_ids, test_dataset)"
        )
    missing = [name for name in ("test_inputs", "test_targets") if getattr(arrays, name) is None]
    if missing:
        raise ConfigError(
            f"{origin}: {' and '.join(missing)} missing; give the global test set, test_inputs and test_targets"
        )
    unassigned = arrays.train_client_ids is None
    if unassigned and arrays.test_client_ids is not None:
        raise ConfigError(
            f"{origin}: test_client_ids are given but train_client_ids are not; give both, or neither (data.partition "
            "then deals out the training examples, and the test set is global)"
        )
    train_x = _tensor(arrays.train_inputs, "train_inputs", origin)
    train_y = _tensor(arrays.train_targets, "train_targets", origin)
    test_x = _tensor(arrays.test_inputs, "test_inputs", origin)
    test_y = _tensor(arrays.test_targets, "test_targets", origin)
    # Without ids one placeholder client holds every row, until experiments.run.datasets deals them out by data.partition.
    if unassigned:
        train_ids = np.zeros(len(train_y), np.int64)
    else:
        train_ids = _client_id_array(arrays.train_client_ids, "train_client_ids", origin)
    _check_rows(train_x, train_y, None if unassigned else train_ids, "train", origin)
    _check_rows(test_x, test_y, None, "test", origin)
    if tuple(train_x.shape[1:]) != tuple(test_x.shape[1:]):
        raise ConfigError(
            f"{origin}: train_inputs rows have shape {tuple(train_x.shape[1:])} but test_inputs rows {tuple(test_x.shape[1:])}; "
            "preprocess both splits the same way"
        )
    for label, tensor in (
        ("train_inputs", train_x),
        ("train_targets", train_y),
        ("test_inputs", test_x),
        ("test_targets", test_y),
    ):
        _check_finite(tensor, label, origin)
    num_clients = _check_client_ids(train_ids, "train_client_ids", origin)
    client_indices = _rows_by_client(train_ids, num_clients)
    client_test_indices = None
    if arrays.test_client_ids is not None:
        test_ids = _client_id_array(arrays.test_client_ids, "test_client_ids", origin)
        if len(test_ids) != len(test_y):
            raise ConfigError(
                f"{origin}: test_client_ids has {len(test_ids)} entries but test_targets has {len(test_y)}; give one client id per test example"
            )
        if len(test_ids) and (test_ids.min() < 0 or test_ids.max() >= num_clients):
            raise ConfigError(
                f"{origin}: test_client_ids lie in [{test_ids.min()}, {test_ids.max()}] but the training data has clients 0..{num_clients - 1}; "
                "use the training data's client ids"
            )
        client_test_indices = _rows_by_client(test_ids, num_clients)
    classes = _is_integer(train_y)
    if classes != _is_integer(test_y):
        raise ConfigError(
            f"{origin}: train_targets are {train_y.dtype} but test_targets are {test_y.dtype}; give both splits integer class ids, or both floating targets"
        )
    if classes:
        num_classes = _number_of_classes(arrays.num_classes, train_y, test_y, origin)
        train_y, test_y = train_y.long(), test_y.long()
    else:
        num_classes = int(np.prod(train_y.shape[1:], dtype=np.int64)) if train_y.dim() > 1 else 1
    try:
        return FederatedDataset(
            name,
            train_x,
            train_y,
            test_x,
            test_y,
            client_indices,
            num_classes,
            client_test_indices=client_test_indices,
            targets_are_classes=classes,
            input_normalisation=arrays.input_normalisation,
            clients_unassigned=unassigned,
        )
    except ValueError as error:
        raise ConfigError(f"{origin}: {error}") from None
