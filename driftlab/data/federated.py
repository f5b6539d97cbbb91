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
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

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


def _check_pixels(train: torch.Tensor, test: torch.Tensor, normalisation: PixelNormalisation) -> None:
    """Raise ValueError unless both splits are uint8 pixels with the normalisation's channels."""
    for split, inputs in (("train", train), ("test", test)):
        if not isinstance(inputs, torch.Tensor) or inputs.dtype != torch.uint8:
            dtype = inputs.dtype if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise ValueError(
                f"input_normalisation is for uint8 pixels but {split}_inputs are {dtype}; give uint8 images or leave input_normalisation unset"
            )
        if normalisation.channels > 1 and (inputs.dim() < 4 or inputs.shape[-3] != normalisation.channels):
            raise ValueError(
                f"input_normalisation has {normalisation.channels} channels but {split}_inputs have shape {tuple(inputs.shape)}; "
                "give images [n, c, h, w] with one mean and deviation per channel"
            )


def _check_split(
    inputs: torch.Tensor, targets: torch.Tensor, split: str, num_classes: int, multi_label: bool = False
) -> None:
    """Raise ValueError unless ``inputs``/``targets`` form a valid ``split`` set."""
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ValueError(
            f"{split}_inputs and {split}_targets must be torch.Tensors, got "
            f"{type(inputs).__name__} and {type(targets).__name__}; wrap numpy arrays with torch.from_numpy"
        )
    if multi_label:
        if targets.dtype != torch.float32 or targets.dim() != 2 or targets.shape[1] != num_classes:
            raise ValueError(
                f"multi-label {split}_targets must be float32 [num_samples, {num_classes}] multi-hot rows, "
                f"got {targets.dtype} of shape {tuple(targets.shape)}"
            )
        if inputs.dim() < 1 or inputs.shape[0] != targets.shape[0]:
            raise ValueError(
                f"{split}_inputs has {inputs.shape[0] if inputs.dim() else 0} rows but {split}_targets has {targets.shape[0]}"
            )
        return
    if targets.dim() != 1:
        raise ValueError(f"{split}_targets must be 1-D [num_samples], got shape {tuple(targets.shape)}")
    if targets.dtype != torch.int64:
        raise ValueError(
            f"{split}_targets must be int64 (what cross-entropy expects), got {targets.dtype}; use .long()"
        )
    if inputs.dim() < 1 or inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"{split}_inputs has {inputs.shape[0] if inputs.dim() else 0} rows but {split}_targets has "
            f"{targets.shape[0]}; inputs and targets must have one row per sample"
        )
    if num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}")
    if len(targets) and (int(targets.min()) < 0 or int(targets.max()) >= num_classes):
        raise ValueError(
            f"{split}_targets must lie in [0, {num_classes}) for num_classes={num_classes}, "
            f"found range [{int(targets.min())}, {int(targets.max())}]"
        )


def _checked_index_arrays(
    arrays: Sequence[np.ndarray], size: int, field: str, split: str, *, allow_empty: bool
) -> tuple[np.ndarray, ...]:
    """Validate per-client index arrays into a split of ``size`` rows; return read-only views."""
    checked = []
    for client, idx in enumerate(arrays):
        if not isinstance(idx, np.ndarray) or idx.dtype != np.int64 or idx.ndim != 1:
            description = (
                f"{idx.dtype} array of shape {idx.shape}" if isinstance(idx, np.ndarray) else type(idx).__name__
            )
            raise ValueError(
                f"{field}[{client}] must be a 1-D int64 numpy array, got {description}; "
                "use np.asarray(indices, dtype=np.int64)"
            )
        if len(idx) == 0 and not allow_empty:
            raise ValueError(f"{field}[{client}] is empty: every client must hold at least one {split} sample")
        if len(idx) and (idx.min() < 0 or idx.max() >= size):
            raise ValueError(
                f"{field}[{client}] has indices in [{idx.min()}, {idx.max()}] but the {split} set "
                f"has {size} rows; indices must lie in [0, {size})"
            )
        view = idx.view()
        view.flags.writeable = False
        checked.append(view)
    if checked:
        owners = np.bincount(np.concatenate(checked), minlength=size)
        if owners.max(initial=0) > 1:
            row = int(np.argmax(owners > 1))
            holders = [k for k, idx in enumerate(checked) if np.any(idx == row)]
            raise ValueError(
                f"{field}: {split} row {row} is used by clients {holders} (and {int((owners > 1).sum()) - 1} "
                "other rows are shared too); a partition must give every row to at most one client"
            )
    return tuple(checked)


def _check_free_targets(inputs: torch.Tensor, targets: torch.Tensor, split: str) -> None:
    """Targets a loss of the user's own reads: any shape, one row per example."""
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ValueError(
            f"{split}_inputs and {split}_targets must be torch.Tensors, got {type(inputs).__name__} and {type(targets).__name__}"
        )
    if inputs.dim() < 1 or targets.dim() < 1 or inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"{split}_inputs has {inputs.shape[0] if inputs.dim() else 0} rows but {split}_targets has "
            f"{targets.shape[0] if targets.dim() else 0}; inputs and targets must have one row per sample"
        )


def _hash_array(hasher: Any, values: torch.Tensor | np.ndarray) -> None:
    if isinstance(values, torch.Tensor):
        tensor = values.detach().cpu().contiguous()
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        values = tensor.reshape(-1).view(torch.uint8).numpy()  # bytes of any dtype, bfloat16 included
    array = np.ascontiguousarray(values)
    hasher.update(f"{array.dtype}{array.shape}".encode())
    hasher.update(array.data.cast("B") if array.size else b"")


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


def _as_array(values: Any) -> Any:
    return values if isinstance(values, (np.ndarray, torch.Tensor)) else np.asarray(values)


# The names datasets give an example's input and its label (Hugging Face's image, text-token and tabular sets).
INPUT_KEYS = ("image", "img", "pixel_values", "input_ids", "input", "inputs", "features", "x")
LABEL_KEYS = ("label", "labels", "target", "targets", "y")


def _stacked_items(
    dataset: Any, split: str, input_key: str | None = None, label_key: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"the {split} Dataset"
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"data: {where} is a {type(dataset).__name__}, not a map-style torch Dataset; give an object with "
            "__len__ and __getitem__(index) -> (input, target), such as torch.utils.data.TensorDataset"
        )
    count = len(dataset)
    if count == 0:
        raise ConfigError(f"data: {where} is empty; give at least one (input, target) item")
    inputs, targets = [], []
    keys: tuple[str, str] | None = None
    for index in range(count):
        item = dataset[index]
        if isinstance(item, Mapping):
            if keys is None:
                keys = dict_keys(item, input_key, label_key, where)
            try:
                item = (item[keys[0]], item[keys[1]])
            except KeyError as missing:
                listed = ", ".join(map(str, item))
                raise ConfigError(
                    f"data: item {index} of {where} has no key {missing} (its keys: {listed}); every item needs both"
                ) from None
        elif not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(
                f"data: item {index} of {where} is a {type(item).__name__}, not an (input, target) pair or a dict; "
                "make __getitem__ return (input, target)"
            )
        inputs.append(item[0] if isinstance(item[0], torch.Tensor) else torch.as_tensor(np.asarray(item[0])))
        targets.append(torch.as_tensor(item[1]))
    for name, values in (("inputs", inputs), ("targets", targets)):
        shapes = {tuple(value.shape) for value in values}
        if len(shapes) > 1:
            raise ConfigError(
                f"data: the {name} of {where} have different shapes {sorted(shapes)[:3]}; every item's {name[:-1]} must have one shape"
            )
    return torch.stack(inputs), torch.stack(targets)


def dict_keys(item: Mapping, input_key: str | None, label_key: str | None, where: str) -> tuple[str, str]:
    """The (input, label) keys of a dict item: those given, else found by name (``INPUT_KEYS``, ``LABEL_KEYS``, or the
    only other key); a ConfigError listing the item's keys when a given key is absent or the choice is ambiguous."""
    keys = list(item)
    shown = ", ".join(repr(key) for key in keys)
    for role, given in (("input_key", input_key), ("label_key", label_key)):
        if given is not None and given not in item:
            raise ConfigError(f"data: {role}={given!r} is not a key of the items of {where}; their keys are {shown}")

    def named(given: str | None, names: tuple[str, ...]) -> str | None:
        if given is not None:
            return given
        present = [key for key in keys if key in names]
        return present[0] if len(present) == 1 else None

    label, inputs = named(label_key, LABEL_KEYS), named(input_key, INPUT_KEYS)
    others = [key for key in keys if key not in (label, inputs)]
    if label is None and inputs is not None and len(others) == 1:
        label = others[0]
    elif inputs is None and label is not None and len(others) == 1:
        inputs = others[0]
    if inputs is None or label is None or inputs == label:
        raise ConfigError(
            f"data: the items of {where} are dicts with keys {shown}, and which holds the input and which the label is "
            "ambiguous; name them: FederatedArrays.from_datasets(train, test=test, input_key=..., label_key=...)"
        )
    return inputs, label


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


def _tensor(values: Any, field: str, origin: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        tensor = values.detach().cpu()
    elif isinstance(values, np.ndarray):
        if values.dtype == object or not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
            raise ConfigError(
                f"{origin}: {field} is a numpy array of {values.dtype}, not numbers; convert it with np.asarray(..., dtype=np.float32)"
            )
        tensor = _from_numpy(np.ascontiguousarray(values))
    else:
        raise ConfigError(
            f"{origin}: {field} is a {type(values).__name__}; give a numpy array or a torch tensor (np.asarray(values))"
        )
    if tensor.dim() == 0:
        raise ConfigError(f"{origin}: {field} is a single number; give one row per example")
    if tensor.is_complex():
        raise ConfigError(f"{origin}: {field} is complex ({tensor.dtype}); give real numbers")
    return tensor


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(array)``: the tensor shares the array's memory, read-only arrays (``np.load(mmap_mode="r")``,
    ``np.frombuffer``) included, so nothing is copied.

    Torch warns that it cannot mark a tensor over read-only memory read-only; driftlab never writes into a data
    set's tensors (batches are gathered copies), so that one warning is silenced for this call only.
    """
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(array)


def _client_id_array(values: Any, field: str, origin: str) -> np.ndarray:
    ids = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or (ids.size == 0 and ids.dtype == np.float64)):
        raise ConfigError(
            f"{origin}: {field} must be a 1-D array of integer client ids, got {ids.dtype} of shape {ids.shape}; "
            "use np.asarray(ids, dtype=np.int64)"
        )
    return ids.astype(np.int64)


def _check_rows(inputs: torch.Tensor, targets: torch.Tensor, ids: np.ndarray | None, split: str, origin: str) -> None:
    counts = {f"{split}_inputs": inputs.shape[0], f"{split}_targets": targets.shape[0]}
    if ids is not None:
        counts[f"{split}_client_ids"] = len(ids)
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{key} {value}" for key, value in counts.items())
        raise ConfigError(
            f"{origin}: the {split} arrays have different lengths ({listed}); give one row per {split} example in each"
        )
    if inputs.shape[0] == 0:
        raise ConfigError(f"{origin}: {split}_inputs has no rows; give at least one {split} example")


def _check_finite(tensor: torch.Tensor, field: str, origin: str) -> None:
    if tensor.is_floating_point():
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            row = int(bad.reshape(len(tensor), -1).any(dim=1).nonzero()[0, 0])
            raise ConfigError(
                f"{origin}: {field} holds {int(bad.sum())} NaN or infinite values (the first in row {row}); "
                "remove or impute those rows (np.isfinite finds them)"
            )


def _check_client_ids(ids: np.ndarray, field: str, origin: str) -> int:
    """The number of clients: the ids must be exactly 0..C-1, each holding an example.

    Every client holds an example, so no id can reach the number of examples: a larger one is refused
    before a count per id is allocated (one stray id 10**12 would otherwise ask for 8 TB).
    """
    if ids.min() < 0:
        index = int(np.argmin(ids))
        raise ConfigError(
            f"{origin}: {field} holds negative ids (smallest {ids.min()}, at {field}[{index}]); number the clients 0..C-1, "
            "e.g. np.unique(ids, return_inverse=True)[1]"
        )
    largest = int(ids.max())
    if largest >= len(ids):
        index = int(np.argmax(ids))
        raise ConfigError(
            f"{origin}: {field}[{index}] is {largest:,}, but {len(ids):,} examples can hold at most {len(ids):,} clients "
            f"(ids 0..{len(ids) - 1:,}, every client holding an example); fix that id, or renumber the clients 0..C-1, "
            "e.g. np.unique(ids, return_inverse=True)[1]"
        )
    counts = np.bincount(ids)
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        shown = ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5 else "")
        raise ConfigError(
            f"{origin}: {field} must number the clients 0..C-1 with every client holding a training example, but "
            f"{len(empty)} of the ids 0..{len(counts) - 1} hold none ({shown}); renumber them, e.g. "
            "np.unique(ids, return_inverse=True)[1]"
        )
    return len(counts)


def _rows_by_client(ids: np.ndarray, num_clients: int) -> tuple[np.ndarray, ...]:
    order = np.argsort(ids, kind="stable")
    bounds = np.searchsorted(ids[order], np.arange(num_clients + 1))
    return tuple(order[bounds[k] : bounds[k + 1]].astype(np.int64) for k in range(num_clients))


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and tensor.dtype != torch.bool


def _number_of_classes(given: int | None, train: torch.Tensor, test: torch.Tensor, origin: str) -> int:
    if train.dim() != 1 or test.dim() != 1:
        raise ConfigError(
            f"{origin}: integer targets are class ids and must be 1-D, got train_targets of shape {tuple(train.shape)} and test_targets "
            f"{tuple(test.shape)}; for other targets give floating values and a loss of your own (loss=)"
        )
    smallest, split, index = _extreme(train, test, largest=False)
    if smallest < 0:
        raise ConfigError(
            f"{origin}: class ids in the targets must be 0 or more, found {smallest} at {split}_targets[{index}]; number the classes 0..K-1"
        )
    largest, split, index = _extreme(train, test, largest=True)
    if given is None:
        _check_dense_classes(train, test, largest, f"{split}_targets[{index}]", origin)
        return largest + 1
    if isinstance(given, bool) or not isinstance(given, int) or given < 1 or given <= largest:
        raise ConfigError(
            f"{origin}: num_classes={given!r}, but the targets hold class id {largest} (at {split}_targets[{index}]); "
            f"set num_classes to at least {largest + 1} (or leave it unset)"
        )
    return given


def _extreme(train: torch.Tensor, test: torch.Tensor, largest: bool) -> tuple[int, str, int]:
    """The largest (or smallest) class id of both splits, the split holding it and its first index there."""
    found = []
    for split, targets in (("train", train), ("test", test)):
        index = int(targets.argmax() if largest else targets.argmin())  # the first occurrence
        found.append((int(targets[index]), split, index))
    return max(found, key=lambda item: item[0]) if largest else min(found, key=lambda item: item[0])


def _check_dense_classes(train: torch.Tensor, test: torch.Tensor, largest: int, where: str, origin: str) -> None:
    """Without ``num_classes`` the classes are 0..largest: refuse ids so sparse that most of those classes are empty.

    One stray label (10**7 among ids 0..9) would otherwise make a model with 10**7 outputs and die allocating it;
    a data set whose class ids are mostly present (at least half of 0..largest) is taken as it is.
    """
    present = torch.unique(torch.cat([train.reshape(-1).long(), test.reshape(-1).long()]))
    if largest + 1 <= 2 * len(present):
        return
    below = f"the next largest is {int(present[-2]):,}" if len(present) > 1 else "it is the only one"
    raise ConfigError(
        f"{origin}: {where} is class id {largest:,}, but only {len(present):,} distinct class ids occur ({below}); class ids "
        f"number the classes 0..K-1, so this would make {largest + 1:,} classes, most of them without an example. "
        "Fix that label, renumber the classes (np.unique(targets, return_inverse=True)[1]), "
        f"or set num_classes={largest + 1} if there really are that many classes"
    )
