"""The checks of a FederatedDataset's fields, and its digest's hashing: each field validated as ``FederatedDataset``
builds (a ValueError that names the field, what is wrong and the fix), each array hashed with its dtype and shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from driftlab.data.pixels import PixelNormalisation


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
