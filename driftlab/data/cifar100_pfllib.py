"""CIFAR-100 as PFLlib deals it out: all 60,000 images pooled, 100 Dirichlet clients, each split 75/25.

PFLlib's generator (Zhang et al. 2023, ``dataset/generate_Cifar100.py``) pools the official train and test sets,
spreads the 60,000 images over 100 clients with a Dirichlet label prior and splits every client's images 75/25 into
its train and test rows (44,962 + 15,038 in the copy of ``../shared/data/cifar100-pfllib``).  That copy keeps the
original pixel bytes in one NumPy archive, ``cifar100-pfllib/cifar100_60k.npz``: ``x`` uint8 ``[60000, 32, 32, 3]``
(HWC, RGB), ``y`` the fine label 0..99 in the official order, ``client`` 0..99 and ``split`` (0 train, 1 test).

Here every PFLlib client is a client of its own (``data.partition = "natural"``, the default) with its own test rows;
the global test set is their union.  Any other ``data.partition`` pools the training rows and deals them out again.
The archive is read as it is distributed (``cifar100-pfllib.tar.xz``, streamed, nothing extracted), or from the
extracted folder, a directory holding either, or the ``.npz`` itself; ``numpy.load`` never unpickles
(``allow_pickle=False``).  Pixels are normalised batch by batch with the CIFAR-100 channel statistics of the FedDyn
authors (:data:`driftlab.data.images.CIFAR100_MEAN`), which the pooled images match (means 0.507, 0.487, 0.441).
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from driftlab.data.archive import ArchiveLimits, iter_tar_members, read_capped
from driftlab.data.federated import DataFileError, FederatedDataset, contiguous_ranges
from driftlab.data.images import CIFAR100_MEAN, CIFAR100_STD
from driftlab.data.pixels import PixelNormalisation

__all__ = ["ARCHIVE_NAME", "NPZ_NAME", "load_cifar100_pfllib"]

ARCHIVE_NAME = "cifar100-pfllib.tar.xz"
FOLDER = "cifar100-pfllib"
NPZ_NAME = "cifar100_60k.npz"
_MAX_IMAGES = 60_000  # all of CIFAR-100
# The archive holds the .npz (184.5 MB), the label names and a README.
_LIMITS = ArchiveLimits(max_members=100, max_member_bytes=256 << 20, max_total_bytes=512 << 20)


def load_cifar100_pfllib(path: str | os.PathLike) -> FederatedDataset:
    """PFLlib's CIFAR-100 clients (module docstring): uint8 ``[n, 3, 32, 32]`` pixels, fine labels, one client per
    PFLlib client with its train rows (``client_indices``) and test rows (``client_test_indices``), ordered by client
    and then as in the file.

    Raises:
        DataFileError: the archive or ``.npz`` is missing (the message lists the layouts looked for), corrupt, or
            holds arrays of the wrong shape, type or range (the message names the array); a client with no
            training row.
    """
    path = Path(path)
    raw, label = _npz_bytes(path)
    arrays = _read_arrays(raw, label)
    x, y, client, split = (arrays[key] for key in ("x", "y", "client", "split"))
    num_clients = int(client.max()) + 1
    # Rows grouped by client, each client's rows in file order: a stable sort by client.
    train_rows = np.flatnonzero(split == 0)
    test_rows = np.flatnonzero(split == 1)
    train_rows = train_rows[np.argsort(client[train_rows], kind="stable")]
    test_rows = test_rows[np.argsort(client[test_rows], kind="stable")]
    train_sizes = np.bincount(client[train_rows], minlength=num_clients)
    if (train_sizes == 0).any():
        empty = int(np.flatnonzero(train_sizes == 0)[0])
        raise DataFileError(f"{label}: client {empty} has no training row (split 0); every PFLlib client has some")
    test_sizes = np.bincount(client[test_rows], minlength=num_clients)
    return FederatedDataset(
        name="cifar100_pfllib",
        train_inputs=_pixels(x, train_rows),
        train_targets=torch.from_numpy(y[train_rows].astype(np.int64)),
        test_inputs=_pixels(x, test_rows),
        test_targets=torch.from_numpy(y[test_rows].astype(np.int64)),
        client_indices=contiguous_ranges(train_sizes),
        num_classes=100,
        client_test_indices=contiguous_ranges(test_sizes) if len(test_rows) else None,
        input_normalisation=PixelNormalisation(CIFAR100_MEAN, CIFAR100_STD),
    )


def _npz_bytes(path: Path) -> tuple[bytes, str]:
    """The ``.npz``'s bytes and a label for messages, from any of the accepted layouts."""
    if path.is_dir():
        for candidate in (path / NPZ_NAME, path / FOLDER / NPZ_NAME, path / ARCHIVE_NAME, path / FOLDER / ARCHIVE_NAME):
            if candidate.is_file():
                return _npz_bytes(candidate)
    elif path.is_file() and path.name.endswith(".npz"):
        return read_capped(path, _LIMITS.max_member_bytes, "the CIFAR-100 (PFLlib) arrays"), str(path)
    elif path.is_file():
        wanted = lambda member: member.name.split("/")[-1] == NPZ_NAME  # noqa: E731
        for name, content in iter_tar_members(path, _LIMITS, wanted, "the CIFAR-100 (PFLlib) archive"):
            return content, f"{path}:{name}"
        raise DataFileError(f"{path} holds no {NPZ_NAME}; expected the archive {ARCHIVE_NAME} with {FOLDER}/{NPZ_NAME}")
    state = "" if path.exists() else " (it does not exist)"
    raise DataFileError(
        f"CIFAR-100 (PFLlib) not found at {path}{state}. Expected the archive {ARCHIVE_NAME}, the folder {FOLDER}/ "
        f"holding {NPZ_NAME}, a directory holding either, or {NPZ_NAME} itself"
    )


def _read_arrays(raw: bytes, label: str) -> dict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as archive:
            missing = sorted({"x", "y", "client", "split"} - set(archive.files))
            if missing:
                raise DataFileError(
                    f"{label} lacks the array(s) {', '.join(missing)}; expected x, y, client and split (PFLlib's pooled "
                    "CIFAR-100 as ../shared/data/README.md describes it)"
                )
            arrays = {key: archive[key] for key in ("x", "y", "client", "split")}
    except DataFileError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise DataFileError(f"{label} is not a readable NumPy .npz ({error}): fetch it again") from error
    x = arrays["x"]
    n = len(x)
    if x.dtype != np.uint8 or x.shape[1:] != (32, 32, 3) or not 0 < n <= _MAX_IMAGES:
        raise DataFileError(
            f"{label}: x must be uint8 images [n, 32, 32, 3] (HWC) with 0 < n <= {_MAX_IMAGES:,}, got {x.dtype} "
            f"{x.shape}"
        )
    for key, high in (("y", 99), ("client", None), ("split", 1)):
        column = arrays[key]
        if column.shape != (n,) or column.dtype.kind not in "iu":
            raise DataFileError(
                f"{label}: {key} must be {n} integers (one per image), got {column.dtype} {column.shape}"
            )
        if column.min() < 0 or (high is not None and column.max() > high):
            bound = "" if high is None else f"..{high}"
            raise DataFileError(f"{label}: {key} must lie in 0{bound}, found {column.min()}..{column.max()}")
        arrays[key] = column.astype(np.int64)
    return arrays


def _pixels(x: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x[rows]).permute(0, 3, 1, 2).contiguous()
