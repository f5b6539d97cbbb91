"""Image classification folders ``<split>/<class>/<image>``, plain or as a tar(.gz), decoded with Pillow (an optional
dependency, imported only by these functions), and CIFAR-10 as such a folder (``cifar10-jpeg.tar.gz``).

Nothing is extracted to disk; archives are streamed and capped (``ArchiveLimits``) so that a damaged or hostile file is
refused before it fills memory.  The official binary CIFAR files, EMNIST and Fashion-MNIST are :mod:`driftlab.data.images`'.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from driftlab.data.archive import ArchiveLimits, iter_tar_members, read_capped
from driftlab.data.federated import DataFileError
from driftlab.data.images import CIFAR10_MEAN, CIFAR10_STD
from driftlab.data.pixels import PixelNormalisation

__all__ = [
    "CIFAR10_FOLDER_LIMITS",
    "IMAGE_EXTENSIONS",
    "IMAGE_FOLDER_LIMITS",
    "MAX_IMAGE_PIXELS",
    "load_cifar10_image_folder",
    "load_cifar10_image_folder_pixels",
    "load_image_folder",
]

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
    result = load_image_folder(
        path, limit_per_class=limit_per_class, image_size=(32, 32), limits=CIFAR10_FOLDER_LIMITS, as_pixels=True
    )
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
