"""The checks of your own arrays as ``federated_dataset_from_arrays`` reads them: each field made a tensor or a client id
array, checked for rows, finiteness, client ids and classes (a ConfigError that names the field and the fix)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from driftlab.errors import ConfigError


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
