"""Loaders for the image benchmarks in their official formats, and CIFAR augmentation.

Everything here reads files that are already on disk, exactly as their
authors distribute them; nothing is extracted to disk and nothing is
downloaded (``driftlab data download NAME --to DIR`` does that, see
:mod:`driftlab.data.download`). Every loader returns plain tensors
``(train_x, train_y, test_x, test_y)``; partitioning over clients is done
elsewhere.

* Fashion-MNIST (Xiao et al. 2017): the four official IDX files, read with
  :func:`driftlab.data.idx.load_mnist` (same names and format as MNIST).
* EMNIST (Cohen et al. 2017): the IDX files of the official ``gzip.zip``
  bundle, loose, in ``gzip/``, or read straight from the zip. ``letters10`` is
  the EMNIST-L task of FedDyn (Acar et al. 2021) and AdaBest (Varno et al.
  2022): the first 10 letters of the letters split.
* CIFAR-10 / CIFAR-100 (Krizhevsky 2009): the official *binary* versions,
  fixed-size records, so no pickle is ever loaded; from the extracted folder
  or streamed from the official tarball.
* Image folders ``<split>/<class>/<image>``, plain or as a tar(.gz), decoded
  with Pillow (an optional dependency, imported only by these functions).

Preprocessing follows the FedDyn authors' code (``utils_dataset.py``): pixels
are scaled to [0, 1] then normalised per channel, and CIFAR training uses a
random horizontal flip and a random pad-4 crop, which the training backends
apply batch by batch (``driftlab.simulation.backends.augmentation.flip_crop_from_keys``,
with the draws taken from per-example keys).

Example:
    >>> train_x, train_y, test_x, test_y = load_cifar_tensors("data/cifar-10-binary.tar.gz", 10)  # doctest: +SKIP
    >>> train_x.shape  # doctest: +SKIP
    torch.Size([50000, 3, 32, 32])
"""

from __future__ import annotations

import io
import os
import warnings
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from driftlab.data import idx
from driftlab.data.archive import ArchiveLimits, corrupt_file_error, iter_tar_members, open_decompressed, read_capped
from driftlab.data.federated import DataFileError
from driftlab.data.pixels import PixelNormalisation

__all__ = [
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR10_FOLDER_LIMITS",
    "EMNIST_SPLITS",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "IMAGE_EXTENSIONS",
    "IMAGE_FOLDER_LIMITS",
    "MAX_IMAGE_PIXELS",
    "load_cifar10_image_folder",
    "load_cifar10_image_folder_pixels",
    "load_cifar_pixels",
    "load_cifar_tensors",
    "load_emnist_pixels",
    "load_emnist_tensors",
    "load_fashion_mnist_pixels",
    "load_fashion_mnist_tensors",
    "load_image_folder",
]

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# uint8 train images, labels, uint8 test images, labels and their normalisation (the ``load_*_pixels`` loaders).
Pixels = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PixelNormalisation]

# Fashion-MNIST statistics of the training pixels (scaled to [0, 1]).
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530

# Channel statistics exactly as in the FedDyn authors' utils_dataset.py
# (transforms.Normalize after ToTensor). For CIFAR-100 they cite
# https://gist.github.com/weiaicunzai/e623931921efefd4c331622c344d8151.
CIFAR10_MEAN = (0.491, 0.482, 0.447)
CIFAR10_STD = (0.247, 0.243, 0.262)
CIFAR100_MEAN = (0.5071, 0.4867, 0.4408)
CIFAR100_STD = (0.2675, 0.2565, 0.2761)

# The official label order (batches.meta.txt), which is also alphabetical, so
# an image folder with these class folders gets the same label ids.
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})

# Caps on an image folder archive (or folder), checked while it streams so that
# a damaged or hostile file is refused before it fills memory. The image bytes
# are all held until decoding, so the total bounds the memory spent on them.
# Generic folders: 1,000,000 entries, 32 MiB per image, 2 GiB in all (decoded
# to float32, that much JPEG is far more than fits in memory anyway).
IMAGE_FOLDER_LIMITS = ArchiveLimits(max_members=1_000_000, max_member_bytes=32 << 20, max_total_bytes=2 << 30)
# CIFAR-10 as images: the real JPEG tarball has 60,023 entries, its largest
# image is 1,124 bytes and it is 55 MB of images (about 90 MB as a tar stream);
# a 32x32 PNG is at most about 4 KB. These caps leave ample room for any
# encoding of the 60,000 images.
CIFAR10_FOLDER_LIMITS = ArchiveLimits(max_members=200_000, max_member_bytes=1 << 20, max_total_bytes=512 << 20)
# Image sizes are checked from the header, before decoding: at most this many
# pixels (4096 x 4096) per image unless the caller gives the exact size.
MAX_IMAGE_PIXELS = 1 << 24
# An EMNIST gzip.zip member (a gzipped IDX file, the largest 550 MB unzipped).
_EMNIST_MAX_MEMBER_BYTES = 1 << 30
# Official sample counts per EMNIST file split, the most a file may declare.
_EMNIST_COUNTS = {"letters": {"train": 124_800, "test": 20_800}, "byclass": {"train": 697_932, "test": 116_323}}


def _download_hint(name: str) -> str:
    return f"`driftlab data download {name} --to DIR` fetches the official files (it needs internet access)"


# --- Fashion-MNIST -----------------------------------------------------------


def load_fashion_mnist_pixels(root: str | os.PathLike) -> Pixels:
    """Load Fashion-MNIST (Xiao, Rasul and Vollgraf 2017) from its four official IDX files.

    The files have MNIST's names and format (``train-images-idx3-ubyte.gz``,
    ..., plain or gzipped), so they are read with
    :func:`driftlab.data.idx.load_mnist`. Pixels become
    ``(p / 255 - 0.2860) / 0.3530``, Fashion-MNIST's own training statistics.

    Returns:
        ``(train_x, train_y, test_x, test_y, normalisation)``: uint8 ``[n, 1, 28, 28]``
        pixels, int64 labels in ``0..9`` (T-shirt/top ... ankle boot) and the
        normalisation (``load_fashion_mnist_tensors`` applies it).

    Raises:
        DataFileError: a file is missing (the message lists the four expected
            names and the download command), malformed (see ``load_mnist``),
            or the directory holds MNIST digits rather than Fashion-MNIST
            (same file names; told apart by the mean pixel, 0.13 vs 0.29).
    """
    root = Path(root)
    missing = [
        " or ".join(idx._mnist_candidate_names(split, kind))
        for split, kind in idx._MNIST_FILES
        if not any((root / name).is_file() for name in idx._mnist_candidate_names(split, kind))
    ]
    if missing:
        state = "" if root.is_dir() else " (the directory does not exist)"
        listing = "\n".join(f"  {names}" for names in missing)
        raise DataFileError(
            f"Fashion-MNIST files not found in {root}{state}. Missing (each plain or gzipped, the same "
            f"names as MNIST's):\n{listing}\n{_download_hint('fashion_mnist')}, or get them from "
            "https://github.com/zalandoresearch/fashion-mnist."
        )
    train_images, train_labels, test_images, test_labels = idx.load_mnist(root)
    mean = train_images.mean(dtype=np.float64) / 255.0
    if len(train_images) and mean < 0.2:
        raise DataFileError(
            f"{root}: the training images have mean pixel {mean:.3f}, which is MNIST's digits (0.131), not "
            "Fashion-MNIST (0.286); both use the same file names, so check that the directory holds the "
            "Fashion-MNIST files"
        )
    return (
        idx.gray_pixels(train_images),
        torch.from_numpy(train_labels.astype(np.int64)),
        idx.gray_pixels(test_images),
        torch.from_numpy(test_labels.astype(np.int64)),
        PixelNormalisation((FASHION_MNIST_MEAN,), (FASHION_MNIST_STD,)),
    )


def load_fashion_mnist_tensors(root: str | os.PathLike) -> Tensors:
    """``load_fashion_mnist_pixels`` normalised: float32 ``[n, 1, 28, 28]`` images, ``(p / 255 - 0.2860) / 0.3530``,
    and int64 labels, as ``(train_x, train_y, test_x, test_y)``."""
    return normalised(load_fashion_mnist_pixels(root))


def normalised(pixels: Pixels) -> Tensors:
    """A pixel loader's ``(train_x, train_y, test_x, test_y, normalisation)`` as normalised float32 tensors."""
    train_x, train_y, test_x, test_y, normalisation = pixels
    return normalisation(train_x), train_y, normalisation(test_x), test_y


# --- EMNIST ----------------------------------------------------------------


@dataclass(frozen=True)
class _EmnistSplit:
    file_split: str  # the split name in the official file names
    first_label: int  # smallest label in the files
    num_file_classes: int  # number of labels in the files
    keep_classes: int  # classes kept, counted from first_label


EMNIST_SPLITS = {
    # letters: labels 1..26 (a..z, upper and lower case merged) -> 0..25.
    "letters": _EmnistSplit("letters", 1, 26, 26),
    # byclass: 0..9 digits, 10..35 upper case, 36..61 lower case.
    "byclass": _EmnistSplit("byclass", 0, 62, 62),
    # EMNIST-L of FedDyn and AdaBest: the letters split restricted to a..j.
    "letters10": _EmnistSplit("letters", 1, 26, 10),
}


def load_emnist_pixels(root: str | os.PathLike, split: str, normalisation: str = "train") -> Pixels:
    """Load an EMNIST split (Cohen et al. 2017) from the official gzip bundle's IDX files.

    The files ``emnist-{letters,byclass}-{train,test}-{images-idx3,labels-idx1}-ubyte.gz``
    are looked up, in this order, in ``root``, in ``root/gzip/`` (the bundle
    unzipped), and inside the official ``root/gzip.zip`` (read with
    :mod:`zipfile`, nothing is extracted). ``root`` may also be the zip itself.
    Each file may be gzipped or not.

    EMNIST stores every image transposed (column-major); the images are
    transposed back so that they are upright like MNIST's.

    Splits:
        ``"letters"``: 26 classes, file labels 1..26 become 0..25.
        ``"byclass"``: 62 classes 0..61 (digits, upper case, lower case).
        ``"letters10"``: EMNIST-L of FedDyn (Acar et al. 2021) and AdaBest
        (Varno et al. 2022): only the samples of the first 10 letters
        (file labels 1..10 become 0..9); 48,000 train and 8,000 test images.

    Args:
        root: directory (or ``gzip.zip``) holding the files.
        split: one of ``"letters"``, ``"byclass"``, ``"letters10"``.
        normalisation: ``"train"`` (default) standardises with the mean and
            standard deviation of the loaded training images, one scalar each,
            as the FedDyn authors' code does for EMNIST-L; ``"mnist"`` uses
            MNIST's constants (0.1307, 0.3081).

    Returns:
        ``(train_x, train_y, test_x, test_y, normalisation)``: uint8 ``[n, 1, 28, 28]`` pixels, int64 labels
        and the normalisation (``load_emnist_tensors`` applies it).

    Raises:
        DataFileError: a file is missing (the message lists the expected names,
            where they were looked for, and the download command), is not
            IDX, is truncated, or holds the wrong content (labels outside the
            split's range, counts of images and labels that disagree).
        ValueError: unknown ``split`` or ``normalisation``.
    """
    if split not in EMNIST_SPLITS:
        raise ValueError(f"unknown EMNIST split {split!r}; expected one of {sorted(EMNIST_SPLITS)}")
    if normalisation not in ("train", "mnist"):
        raise ValueError(f"unknown normalisation {normalisation!r}; expected 'train' or 'mnist'")
    spec = EMNIST_SPLITS[split]
    root = Path(root)
    arrays = {}
    for part in ("train", "test"):
        limit = _EMNIST_COUNTS[spec.file_split][part]
        images, images_name = _read_emnist_file(root, spec.file_split, part, "images", limit)
        labels, labels_name = _read_emnist_file(root, spec.file_split, part, "labels", limit)
        _check_emnist(images, images_name, labels, labels_name, spec)
        keep = labels < spec.first_label + spec.keep_classes
        if not keep.all():
            images, labels = images[keep], labels[keep]
        # Transpose back to upright; the copy is contiguous and writable.
        images = np.ascontiguousarray(images.transpose(0, 2, 1))
        arrays[part] = (images, labels.astype(np.int64) - spec.first_label)
    train_images, train_labels = arrays["train"]
    test_images, test_labels = arrays["test"]
    if normalisation == "mnist":
        mean, std = idx.MNIST_MEAN, idx.MNIST_STD
    else:
        mean, std = _uint8_mean_std(train_images)
    return (
        idx.gray_pixels(train_images),
        torch.from_numpy(train_labels),
        idx.gray_pixels(test_images),
        torch.from_numpy(test_labels),
        PixelNormalisation((mean,), (std,)),
    )


def load_emnist_tensors(root: str | os.PathLike, split: str, normalisation: str = "train") -> Tensors:
    """``load_emnist_pixels`` normalised: float32 ``[n, 1, 28, 28]`` images and int64 labels,
    as ``(train_x, train_y, test_x, test_y)``."""
    return normalised(load_emnist_pixels(root, split, normalisation))


def _uint8_mean_std(images: np.ndarray) -> tuple[float, float]:
    """Exact mean and (population) standard deviation of ``images / 255`` from a 256-bin histogram.

    A histogram needs no float copy of the images (byclass has 700k of them).
    """
    counts = np.bincount(images.reshape(-1), minlength=256).astype(np.float64)
    if counts.sum() == 0:
        raise DataFileError("cannot standardise with the training statistics: the training split is empty")
    values = np.arange(256, dtype=np.float64) / 255.0
    mean = float(counts @ values / counts.sum())
    var = float(counts @ (values - mean) ** 2 / counts.sum())
    return mean, max(var, 1e-12) ** 0.5


def _emnist_name(file_split: str, part: str, kind: str) -> str:
    ndim = 3 if kind == "images" else 1
    return f"emnist-{file_split}-{part}-{kind}-idx{ndim}-ubyte"


def _read_emnist_file(root: Path, file_split: str, part: str, kind: str, limit: int) -> tuple[np.ndarray, str]:
    """Find one EMNIST file (loose, in gzip/, or in gzip.zip) and read it; returns (array, name for messages).

    The IDX header is checked before the data is read: images ``[n, 28, 28]``,
    labels ``[n]``, ``n`` at most the official count ``limit``.
    """
    base = _emnist_name(file_split, part, kind)
    names = (base + ".gz", base)

    def check_header(label: str):
        def check(dtype: np.dtype, shape: tuple[int, ...]) -> None:
            _check_emnist_header(dtype, shape, label, kind, f"EMNIST {file_split} {part}", limit)

        return check

    if root.is_dir():
        for folder in (root, root / "gzip"):
            for name in names:
                if (folder / name).is_file():
                    path = folder / name
                    return idx.read_idx(path, check_header=check_header(str(path))), str(path)
    archive = root if root.is_file() else root / "gzip.zip"
    if archive.is_file():
        try:
            with zipfile.ZipFile(archive) as bundle:
                members = {Path(info.filename).name: info for info in bundle.infolist()}
                for name in names:
                    if name in members:
                        info = members[name]
                        label = f"{archive}:{info.filename}"
                        if info.file_size > _EMNIST_MAX_MEMBER_BYTES:
                            raise DataFileError(
                                f"{label} is {info.file_size:,} bytes, more than the {_EMNIST_MAX_MEMBER_BYTES:,} "
                                "any official EMNIST file has; the archive is corrupt or not EMNIST's: download it again"
                            )
                        raw = bundle.read(info.filename)  # zipfile checks the member's CRC
                        return _idx_from_bytes(raw, label, check_header(label)), label
        except DataFileError:
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError, ValueError) as error:
            raise corrupt_file_error(archive, f"not a readable zip archive: {error}") from error
        raise DataFileError(
            f"{archive} does not contain {names[0]}; expected the official EMNIST gzip.zip, which holds "
            f"gzip/{names[0]}. {_download_hint('emnist')}"
        )
    expected = "\n".join(
        f"  {_emnist_name(file_split, p, k)}.gz" for p in ("train", "test") for k in ("images", "labels")
    )
    state = "" if root.exists() else " (it does not exist)"
    raise DataFileError(
        f"EMNIST {file_split} {part} {kind} not found under {root}{state}. Expected these files (gzipped or "
        f"not) in that directory or in its gzip/ folder, or the official gzip.zip bundle there:\n{expected}\n"
        f"{_download_hint('emnist')}."
    )


def _idx_from_bytes(raw: bytes, label: str, check_header: idx.HeaderCheck) -> np.ndarray:
    """Parse IDX content that is not a file on disk (a zip member), with the checks and bounds of ``read_idx``."""
    limit = idx.MAX_IDX_BYTES
    with open_decompressed(label, limit + (2 << 20), "an IDX file", fileobj=io.BytesIO(raw)) as stream:
        return idx._read_idx_stream(stream, label, limit, check_header)


def _check_emnist_header(
    dtype: np.dtype, shape: tuple[int, ...], label: str, kind: str, what: str, limit: int
) -> None:
    """Header check of one EMNIST file, made before its data is read."""
    if kind == "images" and (len(shape) != 3 or shape[1:] != (28, 28) or dtype != np.uint8):
        raise DataFileError(
            f"{label}: expected EMNIST images, uint8 of shape [n, 28, 28], got {dtype.name} of shape {shape}; "
            "check that it is not swapped with the label file"
        )
    if kind == "labels" and (len(shape) != 1 or dtype != np.uint8):
        raise DataFileError(f"{label}: expected EMNIST labels, 1-D uint8, got {dtype.name} of shape {shape}")
    if shape[0] > limit:
        raise DataFileError(
            f"{label}: the IDX header declares {shape[0]:,} {kind} but the official {what} split has {limit:,}; "
            "the file is corrupt or not an EMNIST file: download it again"
        )


def _check_emnist(
    images: np.ndarray, images_name: str, labels: np.ndarray, labels_name: str, spec: _EmnistSplit
) -> None:
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise DataFileError(
            f"{images_name}: expected EMNIST images, uint8 of shape [n, 28, 28], got {images.dtype} of "
            f"shape {images.shape}; check that it is not swapped with {labels_name}"
        )
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DataFileError(
            f"{labels_name}: expected EMNIST labels, 1-D uint8, got {labels.dtype} of shape {labels.shape}"
        )
    if len(images) != len(labels):
        raise DataFileError(
            f"{images_name} holds {len(images)} images but {labels_name} holds {len(labels)} labels; "
            "both files must come from the same split"
        )
    low, high = spec.first_label, spec.first_label + spec.num_file_classes - 1
    if len(labels) and (labels.min() < low or labels.max() > high):
        bad = int(labels.min()) if labels.min() < low else int(labels.max())
        raise DataFileError(
            f"{labels_name}: EMNIST {spec.file_split} labels must be in {low}..{high} but the file contains "
            f"{bad}; it is not a {spec.file_split} label file"
        )


# --- CIFAR binary ------------------------------------------------------------


@dataclass(frozen=True)
class _CifarSpec:
    name: str
    folder: str
    archive: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    label_bytes: int
    label_limits: tuple[int, ...]  # number of classes of each label byte
    records_per_file: dict
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    python_folder: str  # the pickled version, which is refused
    python_archive: str
    download_name: str  # the name for `driftlab data download`


_CIFAR = {
    10: _CifarSpec(
        name="CIFAR-10",
        folder="cifar-10-batches-bin",
        archive="cifar-10-binary.tar.gz",
        train_files=tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
        test_files=("test_batch.bin",),
        label_bytes=1,
        label_limits=(10,),
        records_per_file={**{f"data_batch_{i}.bin": 10000 for i in range(1, 6)}, "test_batch.bin": 10000},
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        python_folder="cifar-10-batches-py",
        python_archive="cifar-10-python.tar.gz",
        download_name="cifar10",
    ),
    100: _CifarSpec(
        name="CIFAR-100",
        folder="cifar-100-binary",
        archive="cifar-100-binary.tar.gz",
        train_files=("train.bin",),
        test_files=("test.bin",),
        label_bytes=2,  # coarse (20 superclasses), then fine (100 classes)
        label_limits=(20, 100),
        records_per_file={"train.bin": 50000, "test.bin": 10000},
        mean=CIFAR100_MEAN,
        std=CIFAR100_STD,
        python_folder="cifar-100-python",
        python_archive="cifar-100-python.tar.gz",
        download_name="cifar100",
    ),
}

_CIFAR_PIXELS = 3 * 32 * 32
# The official binary tarballs have about 8 entries and 170-185 MB of content;
# their largest file is CIFAR-100's train.bin (153.7 MB); the python version's
# pickles are about as large (read past only to say it is the wrong version).
_CIFAR_BINARY_LIMITS = ArchiveLimits(max_members=1_000, max_member_bytes=256 << 20, max_total_bytes=1 << 30)


def load_cifar_pixels(root: str | os.PathLike, num_classes: int) -> Pixels:
    """Load CIFAR-10 or CIFAR-100 (Krizhevsky 2009) from the official binary version.

    The binary version is fixed-size records, so nothing is unpickled:
    CIFAR-10 (``cifar-10-batches-bin/data_batch_{1..5}.bin``, ``test_batch.bin``)
    has 1 label byte + 3072 pixel bytes per record; CIFAR-100
    (``cifar-100-binary/train.bin``, ``test.bin``) has a coarse and a fine
    label byte + 3072 pixel bytes, and the fine label (100 classes) is used.
    Pixels are the red, green and blue 32x32 planes, row-major.

    ``root`` may be the extracted folder, its parent, the official tarball
    (``cifar-10-binary.tar.gz`` / ``cifar-100-binary.tar.gz``, streamed with
    :mod:`tarfile`, nothing extracted), or a directory holding that tarball.

    Pixels become ``(p / 255 - mean[c]) / std[c]`` with the FedDyn authors'
    channel statistics (:data:`CIFAR10_MEAN`/``STD``, :data:`CIFAR100_MEAN`/``STD``).

    Returns:
        ``(train_x, train_y, test_x, test_y, normalisation)``: uint8 ``[n, 3, 32, 32]`` pixels, int64 labels
        and the normalisation (``load_cifar_tensors`` applies it).

    Raises:
        DataFileError: files missing (the message lists the accepted layouts
            and the download command; the pickled python version is refused
            with a pointer to the binary one), truncated (bytes expected vs
            found), with labels out of range, or a corrupt tarball
            (``... is corrupt (...): download it again``; it is read to its
            end, so the gzip CRC is checked).
        ValueError: ``num_classes`` is not 10 or 100.
    """
    if num_classes not in _CIFAR:
        raise ValueError(f"num_classes must be 10 (CIFAR-10) or 100 (CIFAR-100), got {num_classes!r}")
    spec = _CIFAR[num_classes]
    contents = _cifar_file_contents(Path(root), spec)
    splits = []
    for files in (spec.train_files, spec.test_files):
        parsed = [_parse_cifar_records(contents[name][1], contents[name][0], name, spec) for name in files]
        images = np.concatenate([p[0] for p in parsed]) if len(parsed) > 1 else parsed[0][0]
        labels = np.concatenate([p[1] for p in parsed]) if len(parsed) > 1 else parsed[0][1]
        splits.append((torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels.astype(np.int64))))
    (train_x, train_y), (test_x, test_y) = splits
    return train_x, train_y, test_x, test_y, PixelNormalisation(spec.mean, spec.std)


def load_cifar_tensors(root: str | os.PathLike, num_classes: int) -> Tensors:
    """``load_cifar_pixels`` normalised: float32 ``[n, 3, 32, 32]`` images, ``(p / 255 - mean[c]) / std[c]``,
    and int64 labels, as ``(train_x, train_y, test_x, test_y)``."""
    return normalised(load_cifar_pixels(root, num_classes))


def _cifar_file_contents(root: Path, spec: _CifarSpec) -> dict[str, tuple[str, bytes]]:
    """``file name -> (label for messages, bytes)`` for every train and test file of ``spec``."""
    wanted = spec.train_files + spec.test_files
    if root.is_file():
        return _cifar_from_tar(root, spec)
    if root.is_dir():
        for folder in (root, root / spec.folder):
            present = [name for name in wanted if (folder / name).is_file()]
            if len(present) == len(wanted):
                cap, what = _CIFAR_BINARY_LIMITS.max_member_bytes, f"a {spec.name} binary file"
                return {name: (str(folder / name), read_capped(folder / name, cap, what)) for name in wanted}
            if present:
                missing = ", ".join(name for name in wanted if name not in present)
                raise DataFileError(
                    f"{folder} holds part of the {spec.name} binary version but misses {missing}; "
                    f"expected all of {', '.join(wanted)}. {_download_hint(spec.download_name)}"
                )
        if (root / spec.archive).is_file():
            return _cifar_from_tar(root / spec.archive, spec)
        if (root / spec.python_folder).is_dir() or (root / spec.python_archive).is_file():
            raise DataFileError(
                f"{root} holds the python (pickle) version of {spec.name}, which driftlab does not read "
                f"(unpickling a downloaded file can run arbitrary code); use the binary version "
                f"{spec.archive}. {_download_hint(spec.download_name)}"
            )
    state = "" if root.exists() else " (it does not exist)"
    raise DataFileError(
        f"{spec.name} binary files not found at {root}{state}. Expected one of: the files "
        f"{', '.join(wanted)} in that directory; the folder {spec.folder}/ holding them; or the official "
        f"tarball {spec.archive} (the path itself or inside the directory). "
        f"{_download_hint(spec.download_name)}."
    )


def _cifar_from_tar(archive: Path, spec: _CifarSpec) -> dict[str, tuple[str, bytes]]:
    """Stream the needed members out of a CIFAR binary tarball, matched by ``<folder>/<file>`` suffix."""
    wanted = set(spec.train_files + spec.test_files)
    found: dict[str, tuple[str, bytes]] = {}
    saw_python = False

    def is_wanted(member) -> bool:
        nonlocal saw_python
        parts = member.name.split("/")
        saw_python = saw_python or spec.python_folder in parts
        return parts[-1] in wanted and len(parts) >= 2 and parts[-2] == spec.folder

    for name, content in iter_tar_members(archive, _CIFAR_BINARY_LIMITS, is_wanted, f"the {spec.name} binary tarball"):
        found[name.split("/")[-1]] = (f"{archive}:{name}", content)
    missing = sorted(wanted - found.keys())
    if missing:
        hint = (
            f" This is the python (pickle) version, which driftlab does not read; use the binary version "
            f"{spec.archive}."
            if saw_python
            else ""
        )
        raise DataFileError(
            f"{archive} does not contain {', '.join(f'{spec.folder}/{m}' for m in missing)}; expected the official "
            f"{spec.name} binary tarball {spec.archive}.{hint} {_download_hint(spec.download_name)}"
        )
    return found


def _parse_cifar_records(raw: bytes, label: str, file_name: str, spec: _CifarSpec) -> tuple[np.ndarray, np.ndarray]:
    """Split CIFAR binary records into uint8 images ``[n, 3, 32, 32]`` and the (fine) label of each."""
    record = spec.label_bytes + _CIFAR_PIXELS
    official = spec.records_per_file[file_name]
    if len(raw) == 0 or len(raw) % record:
        raise DataFileError(
            f"{label}: truncated or not a {spec.name} binary file: {len(raw)} bytes is not a whole number of "
            f"{record}-byte records ({spec.label_bytes} label byte(s) + {_CIFAR_PIXELS} pixels); the official file "
            f"has {official * record} bytes ({official} records), found {len(raw)}. Fetch the file again"
        )
    records = np.frombuffer(raw, dtype=np.uint8).reshape(-1, record)
    for byte, limit in enumerate(spec.label_limits):
        column = records[:, byte]
        if column.max() >= limit:
            row = int(np.argmax(column >= limit))
            kind = "fine " if byte == 1 else ("coarse " if spec.label_bytes == 2 else "")
            raise DataFileError(
                f"{label}: record {row} has {kind}label {int(column[row])}, but {spec.name} {kind}labels are "
                f"0..{limit - 1}; the file is corrupt or from the other CIFAR data set"
            )
    labels = records[:, spec.label_bytes - 1].copy()
    images = records[:, spec.label_bytes :].reshape(-1, 3, 32, 32)
    return images, labels


# --- image folders -----------------------------------------------------------


def load_image_folder(
    path: str | os.PathLike,
    normalise: tuple[Sequence[float] | float, Sequence[float] | float] | None = None,
    limit_per_class: int | None = None,
    splits: tuple[str, str] = ("train", "test"),
    *,
    image_size: tuple[int, int] | None = None,
    limits: ArchiveLimits = IMAGE_FOLDER_LIMITS,
    as_pixels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[str, ...]]:
    """Load an image classification folder ``<split>/<class>/<image>``, plain or as a tar archive.

    ``path`` is a directory or a ``.tar``/``.tar.gz``/``.tgz`` file (streamed
    with :mod:`tarfile`, nothing extracted). Images are found by the pattern
    ``[prefix/]<split>/<class>/<file>`` with an image extension
    (:data:`IMAGE_EXTENSIONS`), whatever the common leading prefix (such as
    ``c10/``); hidden files and other files are ignored. All images must have
    the same size. They are decoded with Pillow to RGB, or to one gray channel
    when every image is grayscale (modes ``1``, ``L``, ``LA``).

    Class names are sorted and numbered from 0 (for CIFAR-10 folders this is
    also the official label order, :data:`CIFAR10_CLASSES`). Within a split,
    samples are ordered by class, then file name, whatever the order in the
    archive, so the result is the same for a directory and its tarball.

    Args:
        path: the directory or tar archive.
        normalise: ``(mean, std)``, per channel or scalars: pixels become
            ``(p / 255 - mean) / std`` (torchvision's ToTensor + Normalize).
            ``None`` leaves them in ``[0, 1]``.
        limit_per_class: keep only the first this-many images (in file name
            order) of every class in each split; ``None`` keeps all.
        splits: the names of the training and test folders.
        image_size: ``(width, height)`` every image must have; ``None``
            takes the first image's size (at most :data:`MAX_IMAGE_PIXELS`).
            Sizes are read from the image headers before any decoding.
        limits: caps on the archive's entries, each file's bytes and the
            whole stream (:data:`IMAGE_FOLDER_LIMITS`); a folder's files are
            held to the per-file cap.
        as_pixels: give the uint8 ``[n, c, h, w]`` pixels as decoded (``normalise`` is then not applied).

    Returns:
        ``(train_x, train_y, test_x, test_y, class_names)``: float32
        ``[n, c, h, w]`` images, int64 labels, and the sorted class names.

    Raises:
        DataFileError: the path is missing or unreadable, the archive is
            corrupt (``... is corrupt (...): download it again``) or exceeds
            ``limits``, a split has no images, the test split has a class the
            training split lacks, an image cannot be decoded or has the wrong
            size (the message names the file), or several different prefixes
            hold ``<split>`` folders.
        ImportError: Pillow is not installed.
    """
    if limit_per_class is not None and limit_per_class < 1:
        raise ValueError(f"limit_per_class must be a positive integer or None, got {limit_per_class!r}")
    try:
        from PIL import Image  # noqa: F401  (checked early: a clear message before reading an archive)
    except ImportError as error:
        raise ImportError("loading image folders needs Pillow: pip install pillow") from error
    path = Path(path)
    entries = _image_folder_entries(path, splits, limits)
    by_split: dict[str, dict[str, list[tuple[str, str, bytes | Path]]]] = {s: {} for s in splits}
    for split, cls, name, source in entries:
        label = f"{path}:{name}" if isinstance(source, bytes) else str(source)
        by_split[split].setdefault(cls, []).append((name, label, source))
    for split in splits:
        if not by_split[split]:
            found = sorted({e[0] for e in entries})
            raise DataFileError(
                f"{path}: no images in a '{split}/<class>/<image>' folder (found splits: {found or 'none'}); "
                f"expected an image folder laid out as {'/'.join(splits)}/<class>/<image>"
            )
    classes = tuple(sorted(by_split[splits[0]]))
    extra = sorted(set(by_split[splits[1]]) - set(classes))
    if extra:
        raise DataFileError(
            f"{path}: the {splits[1]} split has classes with no {splits[0]} images: {', '.join(extra)}; "
            "both splits must use the same class folders"
        )
    class_ids = {c: i for i, c in enumerate(classes)}
    outputs: list[torch.Tensor] = []
    decoded = []
    for split in splits:
        items, labels = [], []
        for cls in sorted(by_split[split]):
            files = sorted(by_split[split][cls], key=lambda item: item[0])
            if limit_per_class is not None:
                files = files[:limit_per_class]
            items.extend(files)
            labels.extend([class_ids[cls]] * len(files))
        decoded.append((_decode_images(items, image_size, limits.max_member_bytes), np.asarray(labels, dtype=np.int64)))
    (train_u8, train_gray), _ = decoded[0]
    (test_u8, test_gray), _ = decoded[1]
    if train_u8.shape[1:] != test_u8.shape[1:]:
        raise DataFileError(
            f"{path}: {splits[0]} images are {train_u8.shape[2]}x{train_u8.shape[1]} but {splits[1]} images are "
            f"{test_u8.shape[2]}x{test_u8.shape[1]}; all images must have the same size"
        )
    gray = train_gray and test_gray
    for (u8, _), labels in decoded:
        chw = u8[..., :1] if gray else u8
        pixels = torch.from_numpy(chw).permute(0, 3, 1, 2).contiguous()
        if as_pixels:
            outputs.extend([pixels, torch.from_numpy(labels)])
            continue
        x = pixels.to(torch.float32).div_(255.0)
        if normalise is not None:
            mean, std = (torch.as_tensor(v, dtype=torch.float32).reshape(-1, 1, 1) for v in normalise)
            if mean.shape[0] not in (1, x.shape[1]) or std.shape[0] not in (1, x.shape[1]):
                raise ValueError(
                    f"normalise has {mean.shape[0]} means and {std.shape[0]} deviations but the images have "
                    f"{x.shape[1]} channel(s)"
                )
            x.sub_(mean).div_(std)
        outputs.extend([x, torch.from_numpy(labels)])
    return outputs[0], outputs[1], outputs[2], outputs[3], classes


def load_cifar10_image_folder(
    path: str | os.PathLike, limit_per_class: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[str, ...]]:
    """Load CIFAR-10 from an image folder (e.g. ``cifar10-jpeg.tar.gz``) with CIFAR-10 normalisation.

    :func:`load_image_folder` with the FedDyn authors' CIFAR-10 channel
    statistics; checks that there are 10 classes of 32x32 RGB images (the
    size of every image is checked from its header before decoding) and
    holds the archive to :data:`CIFAR10_FOLDER_LIMITS`. JPEG copies of
    CIFAR-10 differ slightly from the official pixels.

    Returns:
        ``(train_x, train_y, test_x, test_y, class_names)``, float32 ``[n, 3, 32, 32]``.
    """
    train_x, train_y, test_x, test_y, classes, normalisation = load_cifar10_image_folder_pixels(path, limit_per_class)
    return normalisation(train_x), train_y, normalisation(test_x), test_y, classes


def load_cifar10_image_folder_pixels(
    path: str | os.PathLike, limit_per_class: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[str, ...], PixelNormalisation]:
    """``load_cifar10_image_folder`` keeping the uint8 ``[n, 3, 32, 32]`` pixels, with the CIFAR-10 normalisation it applies.

    Returns:
        ``(train_x, train_y, test_x, test_y, class_names, normalisation)``.
    """
    result = load_image_folder(path, limit_per_class=limit_per_class, image_size=(32, 32), limits=CIFAR10_FOLDER_LIMITS, as_pixels=True)
    train_x, class_names = result[0], result[4]
    if len(class_names) != 10 or tuple(train_x.shape[1:]) != (3, 32, 32):
        raise DataFileError(
            f"{path}: expected CIFAR-10, 10 classes of 32x32 RGB images, got {len(class_names)} classes "
            f"({', '.join(class_names)}) of shape {tuple(train_x.shape[1:])}"
        )
    return (*result, PixelNormalisation(CIFAR10_MEAN, CIFAR10_STD))


def _image_folder_entries(
    path: Path, splits: Sequence[str], limits: ArchiveLimits
) -> list[tuple[str, str, str, bytes | Path]]:
    """``(split, class, name, bytes-or-path)`` of every image under ``[prefix/]<split>/<class>/``.

    ``name`` is the path inside the folder or archive, used for sorting and in
    messages. All matches must share one prefix.
    """
    if path.is_dir():
        candidates = _walk_directory(path)
    elif path.is_file():
        candidates = _walk_tar(path, limits)
    else:
        raise DataFileError(f"{path} does not exist; expected an image folder directory or a .tar.gz of one")
    entries, prefixes = [], set()
    for name, source in candidates:
        parts = name.split("/")
        if len(parts) < 3 or parts[-3] not in splits or _suffix(parts[-1]) not in IMAGE_EXTENSIONS:
            continue
        if any(p.startswith(".") or p == "__MACOSX" for p in parts):
            continue
        prefixes.add("/".join(parts[:-3]))
        entries.append((parts[-3], parts[-2], name, source))
    if len(prefixes) > 1:
        shown = ", ".join(repr(p + "/") if p else "'' (top level)" for p in sorted(prefixes))
        raise DataFileError(
            f"{path}: split folders found under several prefixes ({shown}); expected one image folder "
            f"{'/'.join(splits)}/<class>/<image>, so point to the one you want"
        )
    return entries


def _walk_directory(root: Path) -> Iterator[tuple[str, Path]]:
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        rel = Path(folder).relative_to(root).as_posix()
        for file in sorted(files):
            yield (file if rel == "." else f"{rel}/{file}"), Path(folder) / file


def _walk_tar(archive: Path, limits: ArchiveLimits) -> list[tuple[str, bytes]]:
    """Every image-named regular member of a tar archive with its bytes, read in one streaming pass."""
    wanted = lambda member: _suffix(member.name) in IMAGE_EXTENSIONS  # noqa: E731
    return list(iter_tar_members(archive, limits, wanted, "an image folder archive"))


def _suffix(name: str) -> str:
    # os.path on strings: pathlib objects cost more than decoding a 32x32 JPEG.
    return os.path.splitext(name)[1].lower()


_GRAY_MODES = frozenset({"1", "L", "LA"})
_FORMATS_BY_SUFFIX = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG"}


def _decode_images(
    items: Sequence[tuple[str, str, bytes | Path]], image_size: tuple[int, int] | None, max_file_bytes: int
) -> tuple[np.ndarray, bool]:
    """Decode ``(name, label, bytes-or-path)`` images into one uint8 ``[n, h, w, 3]`` array.

    Returns the array and whether every image was grayscale (then all three
    channels are equal). Every image's size is read from its header (Pillow
    opens lazily) and checked before it is decoded: it must be
    ``image_size``, or the first image's size, which must be at most
    :data:`MAX_IMAGE_PIXELS`. The array is allocated once, from that size.
    """
    from PIL import Image

    out: np.ndarray | None = None
    all_gray = True
    expected = image_size
    with warnings.catch_warnings():
        # Pillow only warns below twice its own pixel limit; here that is an error.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        for i, (name, label, source) in enumerate(items):
            data = source if isinstance(source, bytes) else read_capped(Path(source), max_file_bytes, "an image")
            image = _open_image(data, name, label)
            if expected is None:
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise DataFileError(
                        f"{label}: image is {width}x{height}, more than the {MAX_IMAGE_PIXELS:,} pixels allowed for an "
                        "image folder; it is not a genuine data set image (or give image_size)"
                    )
                expected = (width, height)
            if image.size != expected:
                first = "the first image is" if image_size is None else "the data set's images are"
                raise DataFileError(
                    f"{label}: image is {image.size[0]}x{image.size[1]} but {first} "
                    f"{expected[0]}x{expected[1]}; all images of an image folder must have the same size"
                )
            try:
                image.load()
            except Exception as error:  # Pillow's decoders raise many types on damaged data
                raise _undecodable(label, error) from error
            if out is None:
                out = np.empty((len(items), expected[1], expected[0], 3), dtype=np.uint8)
            # frombuffer(tobytes()) is the cheapest copy out of Pillow for small images.
            if image.mode in _GRAY_MODES:
                gray = image if image.mode == "L" else image.convert("L")
                out[i] = np.frombuffer(gray.tobytes(), dtype=np.uint8).reshape(out.shape[1], out.shape[2], 1)
            else:
                all_gray = False
                rgb = image if image.mode == "RGB" else image.convert("RGB")
                out[i] = np.frombuffer(rgb.tobytes(), dtype=np.uint8).reshape(out.shape[1:])
    if out is None:
        out = np.empty((0, 0, 0, 3), dtype=np.uint8)
    return out, all_gray


def _open_image(data: bytes, name: str, label: str):
    """Open (lazily: the header only) one image, or raise DataFileError naming it."""
    from PIL import Image, UnidentifiedImageError

    suffix_format = _FORMATS_BY_SUFFIX.get(_suffix(name))
    try:
        try:
            # Naming the expected format skips Pillow's format sniffing, which is a
            # large share of the time for tiny images; fall back for misnamed files.
            return Image.open(io.BytesIO(data), formats=(suffix_format,) if suffix_format else None)
        except UnidentifiedImageError:
            return Image.open(io.BytesIO(data))
    except Exception as error:  # Pillow's plugins raise many types on damaged headers
        raise _undecodable(label, error) from error


def _undecodable(label: str, error: BaseException) -> DataFileError:
    from PIL import Image

    if isinstance(error, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return DataFileError(
            f"{label}: the image header declares a huge image ({error}); it is not a genuine data set image"
        )
    return DataFileError(
        f"{label}: cannot decode the image ({type(error).__name__}: {error}); the file is corrupt or not an "
        "image: download the data set again"
    )
