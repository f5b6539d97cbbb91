"""Readers for the IDX file format and the official MNIST files.

IDX (LeCun et al., the format of http://yann.lecun.com/exdb/mnist/) is a
tiny header followed by raw big-endian values:

    bytes 0-1   0x00 0x00                     magic
    byte  2     dtype code                    0x08 uint8, 0x09 int8, 0x0B int16,
                                              0x0C int32, 0x0D float32, 0x0E float64
    byte  3     ndim
    4 * ndim    big-endian uint32 dimensions
    rest        prod(dims) values of the dtype, big-endian, C order

The files are usually distributed gzipped; the readers here recognise gzip by
its magic bytes (0x1f 0x8b), so a gzipped file works whatever its name.

Nothing in this module downloads anything: the data must already be on disk.

Example:
    >>> train_x, train_y, test_x, test_y = load_mnist_tensors("../shared/data/mnist")  # doctest: +SKIP
    >>> train_x.shape, train_y.dtype  # doctest: +SKIP
    (torch.Size([60000, 1, 28, 28]), torch.int64)
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from driftlab.data.federated import DataFileError

__all__ = [
    "IDX_DTYPES",
    "MNIST_MEAN",
    "MNIST_STD",
    "MNIST_URL",
    "load_mnist",
    "load_mnist_tensors",
    "read_idx",
]

# dtype code -> big-endian numpy dtype, from the IDX specification.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

# Normalisation used by the FedDyn authors' code (torchvision's usual MNIST
# statistics): x = (pixel / 255 - 0.1307) / 0.3081.
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
MNIST_URL = "http://yann.lecun.com/exdb/mnist/"

_GZIP_MAGIC = b"\x1f\x8b"

# (split, kind) -> the official base name and IDX dimensionality.
_MNIST_FILES = {
    ("train", "images"): ("train-images", 3),
    ("train", "labels"): ("train-labels", 1),
    ("test", "images"): ("t10k-images", 3),
    ("test", "labels"): ("t10k-labels", 1),
}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (plain or gzipped) into a native-endian numpy array.

    Args:
        path: the file. Gzip is detected from the content, not the name.

    Returns:
        A writable array with the file's shape and dtype in native byte order.

    Raises:
        DataFileError: the file is missing, is not IDX (bad magic or unknown
            dtype code), is truncated (the message gives the bytes expected
            and found), or has bytes after the declared data.
    """
    path = Path(path)
    raw = _read_bytes(path)
    dtype, shape, header_size = _parse_header(raw, path)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    found = len(raw) - header_size
    if found < expected:
        raise DataFileError(
            f"{path}: truncated IDX file: shape {shape} of {dtype.name} needs {header_size + expected} bytes "
            f"({header_size} header + {expected} data) but the file has {len(raw)} "
            f"({found} data); the download was probably interrupted, fetch the file again"
        )
    if found > expected:
        raise DataFileError(
            f"{path}: {found - expected} unexpected bytes after the data: shape {shape} of {dtype.name} "
            f"needs exactly {header_size + expected} bytes but the file has {len(raw)}; "
            "the file is corrupt or not the IDX file its header describes"
        )
    values = np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)), offset=header_size)
    # astype copies, which both converts to native byte order and gives a
    # writable array (frombuffer over bytes is read-only).
    return values.astype(dtype.newbyteorder("="), copy=True).reshape(shape)


def load_mnist(root: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Load MNIST from the four official IDX files in ``root``.

    Each file may be plain or gzipped and may use the official name
    (``train-images-idx3-ubyte``) or the dot variant some mirrors use
    (``train-images.idx3-ubyte``), with or without ``.gz``.

    Returns:
        ``(train_images, train_labels, test_images, test_labels)``: uint8
        ``[n, 28, 28]`` images and uint8 ``[n]`` labels in ``0..9``.

    Raises:
        DataFileError: a file is missing (the message lists the accepted names
            and where to download MNIST), unreadable, or the wrong content
            (images not 3-D 28x28 uint8, labels not 1-D uint8 in 0..9, or
            image and label counts of a split that disagree, e.g. a label file
            from the other split).
    """
    root = Path(root)
    arrays = {}
    for split in ("train", "test"):
        images_path = _find_mnist_file(root, split, "images")
        labels_path = _find_mnist_file(root, split, "labels")
        images, labels = read_idx(images_path), read_idx(labels_path)
        _check_mnist_images(images, images_path, labels_path)
        _check_mnist_labels(labels, labels_path, images_path)
        if len(images) != len(labels):
            raise DataFileError(
                f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels; "
                f"an image file and its label file must come from the same split (official MNIST: 60000 "
                f"train, 10000 test), so one of the two files is from the other split or is mislabelled"
            )
        arrays[split] = (images, labels)
    return (*arrays["train"], *arrays["test"])


def load_mnist_tensors(root: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load MNIST as normalised float tensors, preprocessed as in the FedDyn authors' code.

    Pixels become ``(p / 255 - 0.1307) / 0.3081`` (torchvision's
    ``ToTensor`` then ``Normalize((0.1307,), (0.3081,))``), shaped
    ``[n, 1, 28, 28]`` float32; labels become int64.

    Returns:
        ``(train_x, train_y, test_x, test_y)``.
    """
    train_images, train_labels, test_images, test_labels = load_mnist(root)
    return (
        _normalise_mnist(train_images),
        torch.from_numpy(train_labels.astype(np.int64)),
        _normalise_mnist(test_images),
        torch.from_numpy(test_labels.astype(np.int64)),
    )


def _normalise_mnist(images: np.ndarray) -> torch.Tensor:
    # Same operation order as ToTensor + Normalize, so values match torchvision's bit for bit.
    x = torch.from_numpy(images).to(torch.float32).div_(255.0)
    return x.sub_(MNIST_MEAN).div_(MNIST_STD).unsqueeze(1)


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped if the content starts with the gzip magic."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataFileError(f"{path} {what}; expected an IDX file (plain or gzipped)")
    raw = path.read_bytes()
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise DataFileError(
            f"{path}: gzip data is truncated or corrupt ({error}); the compressed file has {len(raw)} bytes. "
            "The download was probably interrupted: fetch the file again"
        ) from error


def _parse_header(raw: bytes, path: Path) -> tuple[np.dtype, tuple[int, ...], int]:
    """Return ``(dtype, shape, header_size)`` from an IDX header, or raise DataFileError."""
    if len(raw) < 4:
        raise DataFileError(
            f"{path}: truncated IDX file: the header needs at least 4 bytes but the file has {len(raw)}"
        )
    if raw[0] != 0 or raw[1] != 0:
        hint = " (it looks like text or an HTML page, not binary data)" if raw[:1] in (b"<", b"{", b"#") else ""
        raise DataFileError(
            f"{path}: not an IDX file: the first two bytes are 0x{raw[0]:02x} 0x{raw[1]:02x}, "
            f"expected 0x00 0x00{hint}"
        )
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        supported = ", ".join(f"0x{c:02x} {d.name}" for c, d in IDX_DTYPES.items())
        raise DataFileError(f"{path}: unknown IDX dtype code 0x{code:02x}; supported codes are {supported}")
    if ndim == 0:
        raise DataFileError(f"{path}: the IDX header declares 0 dimensions; expected at least 1")
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataFileError(
            f"{path}: truncated IDX file: a header with {ndim} dimensions needs {header_size} bytes "
            f"but the file has {len(raw)}"
        )
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    return IDX_DTYPES[code], shape, header_size


def _mnist_candidate_names(split: str, kind: str) -> list[str]:
    """Accepted file names for one MNIST file, in lookup order."""
    base, ndim = _MNIST_FILES[(split, kind)]
    names = [f"{base}-idx{ndim}-ubyte", f"{base}.idx{ndim}-ubyte"]
    return [name + suffix for name in names for suffix in ("", ".gz")]


def _find_mnist_file(root: Path, split: str, kind: str) -> Path:
    """The first accepted name for this MNIST file that exists in ``root``."""
    for name in _mnist_candidate_names(split, kind):
        if (root / name).is_file():
            return root / name
    expected = "\n".join(
        f"  {' or '.join(_mnist_candidate_names(s, k))}" for s, k in _MNIST_FILES
    )
    state = "" if root.is_dir() else " (the directory does not exist)"
    raise DataFileError(
        f"MNIST {split} {kind} not found in {root}{state}. Expected these four files there, each "
        f"plain or gzipped:\n{expected}\n"
        f"`driftlab data download mnist --to DIR` fetches them (it needs internet access), "
        f"or get them from {MNIST_URL} (or a mirror) and put them in that directory."
    )


def _check_mnist_images(images: np.ndarray, images_path: Path, labels_path: Path) -> None:
    if images.ndim == 1:
        raise DataFileError(
            f"{images_path} is 1-D with {images.shape[0]} entries, which is a label file, not images; "
            f"check that it is not swapped with {labels_path}"
        )
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise DataFileError(
            f"{images_path}: expected MNIST images, uint8 of shape [n, 28, 28], "
            f"got {images.dtype} of shape {images.shape}"
        )


def _check_mnist_labels(labels: np.ndarray, labels_path: Path, images_path: Path) -> None:
    if labels.ndim != 1:
        raise DataFileError(
            f"{labels_path}: expected MNIST labels, 1-D uint8, got shape {labels.shape}, which looks like an "
            f"image file; check that it is not swapped with {images_path}"
        )
    if labels.dtype != np.uint8:
        raise DataFileError(f"{labels_path}: expected MNIST labels of dtype uint8, got {labels.dtype}")
    if len(labels) and labels.max() > 9:
        raise DataFileError(
            f"{labels_path}: MNIST labels must be digits 0..9 but the file contains {int(labels.max())}; "
            "it is not an MNIST label file"
        )
