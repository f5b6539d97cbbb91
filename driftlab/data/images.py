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
* Image folders ``<split>/<class>/<image>`` (CIFAR-10 as JPEGs among them) are
  :mod:`driftlab.data.image_folders`'.

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
import zipfile
import zlib
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
    "EMNIST_SPLITS",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "load_cifar_pixels",
    "load_cifar_tensors",
    "load_emnist_pixels",
    "load_emnist_tensors",
    "load_fashion_mnist_pixels",
    "load_fashion_mnist_tensors",
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


def _check_emnist_header(dtype: np.dtype, shape: tuple[int, ...], label: str, kind: str, what: str, limit: int) -> None:
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


def load_cifar_pixels(root: str | os.PathLike, num_classes: int, limit_per_class: int | None = None) -> Pixels:
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

    ``limit_per_class`` keeps only the first this-many records (in file order) of every class in each split, as
    ``data.limit_per_class`` does for an image folder (:func:`driftlab.data.image_folders.load_image_folder`);
    ``None`` keeps all.

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
        ValueError: ``num_classes`` is not 10 or 100, or ``limit_per_class`` is not a positive integer or None.
    """
    if num_classes not in _CIFAR:
        raise ValueError(f"num_classes must be 10 (CIFAR-10) or 100 (CIFAR-100), got {num_classes!r}")
    if limit_per_class is not None and limit_per_class < 1:
        raise ValueError(f"limit_per_class must be a positive integer or None, got {limit_per_class!r}")
    spec = _CIFAR[num_classes]
    contents = _cifar_file_contents(Path(root), spec)
    splits = []
    for files in (spec.train_files, spec.test_files):
        parsed = [_parse_cifar_records(contents[name][1], contents[name][0], name, spec) for name in files]
        images = np.concatenate([p[0] for p in parsed]) if len(parsed) > 1 else parsed[0][0]
        labels = np.concatenate([p[1] for p in parsed]) if len(parsed) > 1 else parsed[0][1]
        if limit_per_class is not None:
            kept = first_per_class(labels, limit_per_class)
            images, labels = images[kept], labels[kept]
        splits.append((torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels.astype(np.int64))))
    (train_x, train_y), (test_x, test_y) = splits
    return train_x, train_y, test_x, test_y, PixelNormalisation(spec.mean, spec.std)


def load_cifar_tensors(root: str | os.PathLike, num_classes: int, limit_per_class: int | None = None) -> Tensors:
    """``load_cifar_pixels`` normalised: float32 ``[n, 3, 32, 32]`` images, ``(p / 255 - mean[c]) / std[c]``,
    and int64 labels, as ``(train_x, train_y, test_x, test_y)``."""
    return normalised(load_cifar_pixels(root, num_classes, limit_per_class))


def first_per_class(labels: np.ndarray, limit: int) -> np.ndarray:
    """The positions of the first ``limit`` rows of every label in ``labels``, in increasing order.

    A row's rank within its class is its place in a stable sort by label minus where its class starts there.
    """
    order = np.argsort(labels, kind="stable")
    by_label = labels[order]
    rank = np.arange(len(labels)) - np.searchsorted(by_label, by_label, side="left")
    return np.sort(order[rank < limit])


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
