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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DataFileError", "FederatedDataset", "classes_covering_fraction"]


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
        known_minimizer: the flat parameter vector minimising the global
            objective, for synthetic objectives where it is known in closed
            form (the quadratic clients); evaluation then reports the distance to it.

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

    def __post_init__(self) -> None:
        _check_split(self.train_inputs, self.train_targets, "train", self.num_classes, self.multi_label)
        _check_split(self.test_inputs, self.test_targets, "test", self.num_classes, self.multi_label)
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
        if self.multi_label:  # no single class per example: the 80% statistic is undefined
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


def _check_split(inputs: torch.Tensor, targets: torch.Tensor, split: str, num_classes: int, multi_label: bool = False) -> None:
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
            raise ValueError(f"{split}_inputs has {inputs.shape[0] if inputs.dim() else 0} rows but {split}_targets has {targets.shape[0]}")
        return
    if targets.dim() != 1:
        raise ValueError(f"{split}_targets must be 1-D [num_samples], got shape {tuple(targets.shape)}")
    if targets.dtype != torch.int64:
        raise ValueError(f"{split}_targets must be int64 (what cross-entropy expects), got {targets.dtype}; use .long()")
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
            description = f"{idx.dtype} array of shape {idx.shape}" if isinstance(idx, np.ndarray) else type(idx).__name__
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
