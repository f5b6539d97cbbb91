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

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from driftlab.data.archive import open_decompressed
from driftlab.data.federated import DataFileError
from driftlab.data.pixels import PixelNormalisation

__all__ = [
    "IDX_DTYPES",
    "MAX_IDX_BYTES",
    "MNIST_MEAN",
    "MNIST_STD",
    "MNIST_URL",
    "load_mnist",
    "load_mnist_pixels",
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

# Data bytes a file may declare unless the caller says otherwise: twice the
# largest official IDX file (EMNIST byclass training images, 697,932 x 28 x 28
# = 547 MB). The header is checked against it before anything is allocated.
MAX_IDX_BYTES = 1 << 30
# At most this much data after the declared data is read to report it.
_TRAILING_PROBE = 1 << 20
_CHUNK = 1 << 20

# (dtype, shape) -> raise DataFileError when the header is not what the caller expects.
HeaderCheck = Callable[[np.dtype, tuple[int, ...]], None]

# Official sizes of MNIST and Fashion-MNIST, the most any of their files may declare.
_MNIST_COUNTS = {"train": 60_000, "test": 10_000}
# (split, kind) -> the official base name and IDX dimensionality.
_MNIST_FILES = {
    ("train", "images"): ("train-images", 3),
    ("train", "labels"): ("train-labels", 1),
    ("test", "images"): ("t10k-images", 3),
    ("test", "labels"): ("t10k-labels", 1),
}


def read_idx(
    path: str | os.PathLike, *, max_bytes: int = MAX_IDX_BYTES, check_header: HeaderCheck | None = None
) -> np.ndarray:
    """Read one IDX file (plain, gzipped, bz2 or xz) into a native-endian numpy array.

    The header is validated (and passed to ``check_header``) before the data
    is allocated, the data is read into one array of exactly the declared
    size, and the file is read to its end, so a compressed file's CRC is
    checked and bytes after the declared data are an error. At most
    ``max_bytes`` of data plus 1 MiB are ever decompressed, whatever the file
    holds.

    Args:
        path: the file. Compression is detected from the content, not the name.
        max_bytes: the most data bytes the header may declare.
        check_header: called with ``(dtype, shape)`` before any allocation;
            raises DataFileError when they are not what the caller expects.

    Returns:
        A writable array with the file's shape and dtype in native byte order.

    Raises:
        DataFileError: the file is missing, is not IDX (bad magic or unknown
            dtype code), declares more than ``max_bytes``, is truncated (the
            message gives the bytes expected and found), has bytes after the
            declared data, or is corrupt (``... is corrupt (...): download it
            again``).
    """
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataFileError(f"{path} {what}; expected an IDX file (plain or gzipped)")
    with open_decompressed(path, max_bytes + _HEADER_LIMIT + _TRAILING_PROBE, "an IDX file") as stream:
        return _read_idx_stream(stream, path, max_bytes, check_header)


def _read_idx_stream(
    stream: BinaryIO, path: Path | str, max_bytes: int, check_header: HeaderCheck | None
) -> np.ndarray:
    """Parse IDX from a (decompressed) stream: header, checks, then exactly the declared data, then EOF."""
    head = _read_up_to(stream, 4)
    if len(head) == 4 and head[0] == 0 and head[1] == 0 and head[2] in IDX_DTYPES and head[3] > 0:
        head += _read_up_to(stream, 4 * head[3])
    dtype, shape, header_size = _parse_header(head, path)
    count = int(np.prod(shape, dtype=object))  # exact: big dimensions must not wrap around
    expected = count * dtype.itemsize
    if check_header is not None:
        check_header(dtype, shape)
    if expected > max_bytes:
        raise DataFileError(
            f"{path}: the IDX header declares shape {shape} of {dtype.name}, {expected:,} bytes of data, more than "
            f"the {max_bytes:,} allowed; the file is corrupt or not the data set it is named after"
        )
    values = np.empty(count, dtype=dtype)
    target = memoryview(values.view(np.uint8).reshape(-1))
    found = 0
    while found < expected and (chunk := stream.read(min(_CHUNK, expected - found))):
        target[found : found + len(chunk)] = chunk
        found += len(chunk)
    if found < expected:
        raise DataFileError(
            f"{path}: truncated IDX file: shape {shape} of {dtype.name} needs {header_size + expected} bytes "
            f"({header_size} header + {expected} data) but the file has {header_size + found} "
            f"({found} data); the download was probably interrupted: download it again"
        )
    extra = len(_read_up_to(stream, _TRAILING_PROBE))  # reaching EOF is what checks a gzip CRC
    if extra:
        amount = f"more than {extra - 1}" if extra == _TRAILING_PROBE else str(extra)
        total = (
            f"more than {header_size + expected + extra - 1}"
            if extra == _TRAILING_PROBE
            else str(header_size + expected + extra)
        )
        raise DataFileError(
            f"{path}: {amount} unexpected bytes after the data: shape {shape} of {dtype.name} "
            f"needs exactly {header_size + expected} bytes but the file has {total}; "
            "the file is corrupt or not the IDX file its header describes"
        )
    native = dtype.newbyteorder("=")
    if values.dtype != native:  # big-endian values on a little-endian machine: swap in place, no copy
        values = values.byteswap(inplace=True).view(native)
    return values.reshape(shape)


def _read_up_to(stream: BinaryIO, size: int) -> bytes:
    """``size`` bytes, or fewer only at the end of the stream."""
    parts, got = [], 0
    while got < size and (chunk := stream.read(min(_CHUNK, size - got))):
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


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
            (images not 3-D 28x28 uint8, labels not 1-D uint8 in 0..9, more
            images or labels than the official split has (60,000 train, 10,000
            test; checked from the header, before the data is read), or image
            and label counts of a split that disagree, e.g. a label file from
            the other split), or corrupt (``... is corrupt (...): download it
            again``).
    """
    root = Path(root)
    arrays = {}
    for split in ("train", "test"):
        images_path = _find_mnist_file(root, split, "images")
        labels_path = _find_mnist_file(root, split, "labels")
        limit = _MNIST_COUNTS[split]
        # read_idx calls check_header before it returns: each lambda runs within this iteration, on this split's names
        images = read_idx(
            images_path,
            check_header=lambda d, s: _check_mnist_images(d, s, images_path, labels_path, split, limit),  # noqa: B023
        )
        labels = read_idx(
            labels_path,
            check_header=lambda d, s: _check_mnist_labels(d, s, labels_path, images_path, split, limit),  # noqa: B023
        )
        _check_mnist_label_values(labels, labels_path)
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
    train_x, train_y, test_x, test_y, normalisation = load_mnist_pixels(root)
    return normalisation(train_x), train_y, normalisation(test_x), test_y


def load_mnist_pixels(
    root: str | os.PathLike,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PixelNormalisation]:
    """MNIST as uint8 ``[n, 1, 28, 28]`` pixels, int64 labels and the normalisation ``load_mnist_tensors`` applies.

    A quarter of the memory of the float tensors; a run normalises each gathered batch
    (``PixelNormalisation``), to the same values bit for bit.

    Returns:
        ``(train_x, train_y, test_x, test_y, normalisation)``.
    """
    train_images, train_labels, test_images, test_labels = load_mnist(root)
    return (
        gray_pixels(train_images),
        torch.from_numpy(train_labels.astype(np.int64)),
        gray_pixels(test_images),
        torch.from_numpy(test_labels.astype(np.int64)),
        PixelNormalisation((MNIST_MEAN,), (MNIST_STD,)),
    )


def gray_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 ``[n, h, w]`` -> uint8 ``[n, 1, h, w]`` (one channel, as ToTensor shapes a gray image)."""
    return torch.from_numpy(np.ascontiguousarray(images)).unsqueeze(1)


# The longest header: 4 bytes and 255 dimensions of 4 bytes.
_HEADER_LIMIT = 4 + 4 * 255


def _parse_header(raw: bytes, path: Path | str) -> tuple[np.dtype, tuple[int, ...], int]:
    """Return ``(dtype, shape, header_size)`` from an IDX header, or raise DataFileError."""
    if len(raw) < 4:
        raise DataFileError(
            f"{path}: truncated IDX file: the header needs at least 4 bytes but the file has {len(raw)}"
        )
    if raw[0] != 0 or raw[1] != 0:
        hint = " (it looks like text or an HTML page, not binary data)" if raw[:1] in (b"<", b"{", b"#") else ""
        raise DataFileError(
            f"{path}: not an IDX file: the first two bytes are 0x{raw[0]:02x} 0x{raw[1]:02x}, expected 0x00 0x00{hint}"
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
    expected = "\n".join(f"  {' or '.join(_mnist_candidate_names(s, k))}" for s, k in _MNIST_FILES)
    state = "" if root.is_dir() else " (the directory does not exist)"
    raise DataFileError(
        f"MNIST {split} {kind} not found in {root}{state}. Expected these four files there, each "
        f"plain or gzipped:\n{expected}\n"
        f"`driftlab data download mnist --to DIR` fetches them (it needs internet access), "
        f"or get them from {MNIST_URL} (or a mirror) and put them in that directory."
    )


def _check_mnist_images(
    dtype: np.dtype, shape: tuple[int, ...], images_path: Path, labels_path: Path, split: str, limit: int
) -> None:
    """Header check of an MNIST image file, made before its data is read."""
    if len(shape) == 1:
        raise DataFileError(
            f"{images_path} is 1-D with {shape[0]} entries, which is a label file, not images; "
            f"check that it is not swapped with {labels_path}"
        )
    if len(shape) != 3 or shape[1:] != (28, 28) or dtype != np.uint8:
        raise DataFileError(
            f"{images_path}: expected MNIST images, uint8 of shape [n, 28, 28], got {dtype.name} of shape {shape}"
        )
    _check_mnist_count(shape[0], images_path, "images", split, limit)


def _check_mnist_labels(
    dtype: np.dtype, shape: tuple[int, ...], labels_path: Path, images_path: Path, split: str, limit: int
) -> None:
    """Header check of an MNIST label file, made before its data is read."""
    if len(shape) != 1:
        raise DataFileError(
            f"{labels_path}: expected MNIST labels, 1-D uint8, got shape {shape}, which looks like an "
            f"image file; check that it is not swapped with {images_path}"
        )
    if dtype != np.uint8:
        raise DataFileError(f"{labels_path}: expected MNIST labels of dtype uint8, got {dtype.name}")
    _check_mnist_count(shape[0], labels_path, "labels", split, limit)


def _check_mnist_count(count: int, path: Path, kind: str, split: str, limit: int) -> None:
    if count > limit:
        raise DataFileError(
            f"{path}: the IDX header declares {count:,} {kind} but MNIST's {split} split (and Fashion-MNIST's) has "
            f"{limit:,}; the file is corrupt or not an MNIST file: download it again"
        )


def _check_mnist_label_values(labels: np.ndarray, labels_path: Path) -> None:
    if len(labels) and labels.max() > 9:
        raise DataFileError(
            f"{labels_path}: MNIST labels must be digits 0..9 but the file contains {int(labels.max())}; "
            "it is not an MNIST label file"
        )
