"""``driftlab data download NAME --to DIR``: fetch the official files of a data set.

This is the only module of driftlab that touches the network, and only when
a user asks for it; the loaders never download, and the tests run it against
a local server only.

Each data set name maps to the files its authors distribute, the URLs they
are served from (tried in order) and the checksum published for them
(:data:`REGISTRY`). A download

* writes to ``<file>.part`` and resumes it with an HTTP ``Range`` request
  when rerun after an interruption (a server that ignores ``Range`` gets the
  file again from the start);
* verifies the checksum, then renames ``<file>.part`` to ``<file>``
  atomically, so ``<file>`` is either absent or complete and verified;
* skips a file that is already present with the right checksum;
* writes, resumes and deletes only files it wrote itself (listed in ``DIR/.driftlab-written.json``,
  ``driftlab.owned_folder``): a ``<file>`` or ``<file>.part`` it would write that is the user's stops it before
  anything is fetched, unless ``force``.

The files are kept as distributed (archives are not extracted): the loaders
read ``gzip.zip`` and the CIFAR tarballs directly.

Checksums and their sources:
    MNIST, Fashion-MNIST, EMNIST: MD5s as listed by torchvision's dataset
    classes (Fashion-MNIST's also in the data set's README). CIFAR binary
    versions: MD5s on https://www.cs.toronto.edu/~kriz/cifar.html.
    StackOverflow: SHA-256s in TensorFlow Federated's
    ``tff.simulation.datasets.stackoverflow`` loaders. Tiny Shakespeare:
    karpathy/char-rnn publishes no checksum; the SHA-256 is that of the
    1,115,394-byte ``input.txt`` served from the repository.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from driftlab.owned_folder import claim

__all__ = [
    "ChecksumMismatchError",
    "DownloadError",
    "NOT_DOWNLOADABLE",
    "REGISTRY",
    "RemoteFile",
    "dataset_names",
    "download",
    "download_file",
    "file_checksum",
]


@dataclass(frozen=True)
class RemoteFile:
    """One file of a data set as its authors distribute it.

    Attributes:
        filename: the name it is saved under (the official name).
        urls: where to get it, tried in order (mirrors serve identical bytes).
        algorithm: ``"md5"`` or ``"sha256"``, as the checksum is published.
        checksum: the published hex digest.
    """

    filename: str
    urls: tuple[str, ...]
    algorithm: str
    checksum: str

    def __post_init__(self) -> None:
        if self.algorithm not in ("md5", "sha256"):
            raise ValueError(f"{self.filename}: unsupported checksum algorithm {self.algorithm!r}")
        length = 32 if self.algorithm == "md5" else 64
        if len(self.checksum) != length or any(c not in "0123456789abcdef" for c in self.checksum):
            raise ValueError(f"{self.filename}: {self.algorithm} checksum must be {length} lower-case hex digits")
        if not self.urls or any(not u.startswith(("http://", "https://")) for u in self.urls):
            raise ValueError(f"{self.filename}: urls must be a non-empty tuple of http(s) URLs, got {self.urls!r}")


def _mirrored(filename: str, bases: tuple[str, ...], algorithm: str, checksum: str) -> RemoteFile:
    return RemoteFile(filename, tuple(base + filename for base in bases), algorithm, checksum)


_MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")
_FASHION = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",)
_TFF = ("https://storage.googleapis.com/tff-datasets-public/",)
_TORONTO = ("https://www.cs.toronto.edu/~kriz/",)

REGISTRY: dict[str, tuple[RemoteFile, ...]] = {
    "mnist": (
        _mirrored("train-images-idx3-ubyte.gz", _MNIST_MIRRORS, "md5", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
        _mirrored("train-labels-idx1-ubyte.gz", _MNIST_MIRRORS, "md5", "d53e105ee54ea40749a09fcbcd1e9432"),
        _mirrored("t10k-images-idx3-ubyte.gz", _MNIST_MIRRORS, "md5", "9fb629c4189551a2d022fa330f9573f3"),
        _mirrored("t10k-labels-idx1-ubyte.gz", _MNIST_MIRRORS, "md5", "ec29112dd5afa0611ce80d1b7f02629c"),
    ),
    "fashion_mnist": (
        _mirrored("train-images-idx3-ubyte.gz", _FASHION, "md5", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        _mirrored("train-labels-idx1-ubyte.gz", _FASHION, "md5", "25c81989df183df01b3e8a0aad5dffbe"),
        _mirrored("t10k-images-idx3-ubyte.gz", _FASHION, "md5", "bef4ecab320f06d8554ea6380940ec79"),
        _mirrored("t10k-labels-idx1-ubyte.gz", _FASHION, "md5", "bb300cfdad3c16e7a12a480ee83cd310"),
    ),
    # The whole official bundle (about 560 MB); all splits' IDX files are inside.
    "emnist": (
        RemoteFile(
            "gzip.zip",
            (
                "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
                "https://www.itl.nist.gov/iaui/vip/cs_links/EMNIST/gzip.zip",
            ),
            "md5",
            "58c8d27c78d21e728a6bc7b3cc06412e",
        ),
    ),
    "cifar10": (_mirrored("cifar-10-binary.tar.gz", _TORONTO, "md5", "c32a1d4ab5d03f1284b67883e8d87530"),),
    "cifar100": (_mirrored("cifar-100-binary.tar.gz", _TORONTO, "md5", "03b5dce01913d631647c71ecec9e9cb8"),),
    "shakespeare": (
        RemoteFile(
            "input.txt",
            ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",),
            "sha256",
            "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        ),
    ),
    "stackoverflow": (
        _mirrored(
            "stackoverflow.tar.bz2", _TFF, "sha256", "99eca2f8b8327a09e5fc123979df2d237acbc5e52322f6d86bf523ee47b961a2"
        ),
        _mirrored(
            "stackoverflow.word_count.tar.bz2",
            _TFF,
            "sha256",
            "1dc00256d6e527c54b9756d968118378ae14e6692c0b3b6cad470cdd3f0c519c",
        ),
        _mirrored(
            "stackoverflow.tag_count.tar.bz2",
            _TFF,
            "sha256",
            "6fe281cec490d9384a290d560072438e7e2b377bbb823876ce7bd6f82696772d",
        ),
    ),
}

# Data sets the papers use that have no single official file with a published checksum.
NOT_DOWNLOADABLE: dict[str, str] = {
    "femnist": (
        "LEAF has no single FEMNIST file: its scripts (https://github.com/TalwalkarLab/leaf, "
        "data/femnist/preprocess.sh) download NIST SD19 and build the JSON shards; point the LEAF loader at "
        "their output"
    ),
    "sent140": (
        "Sent140 has no stable official download with a published checksum: LEAF's scripts "
        "(https://github.com/TalwalkarLab/leaf, data/sent140/preprocess.sh) fetch the Sentiment140 CSV and "
        "build the JSON shards; point the LEAF loader at their output"
    ),
}


DOWNLOAD_COMMAND = "driftlab data download"  # recorded beside the files it writes (driftlab.owned_folder)


class DownloadError(RuntimeError):
    """A download failed; the message says what failed and whether rerunning resumes."""


class ChecksumMismatchError(DownloadError):
    """A downloaded (or already present) file does not have its published checksum."""


def dataset_names(registry: Mapping[str, tuple[RemoteFile, ...]] | None = None) -> list[str]:
    """Names accepted by :func:`download`, sorted."""
    return sorted(REGISTRY if registry is None else registry)


def file_checksum(path: str | os.PathLike, algorithm: str) -> str:
    """Hex digest of a file's content, read in 1 MiB blocks."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(
    name: str,
    to_dir: str | os.PathLike,
    progress: bool = True,
    *,
    registry: Mapping[str, tuple[RemoteFile, ...]] | None = None,
    timeout: float = 60.0,
    force: bool = False,
) -> list[Path]:
    """Download every official file of data set ``name`` into ``to_dir``.

    Args:
        name: a key of ``registry`` (:data:`REGISTRY` by default), e.g. ``"cifar10"``.
        to_dir: destination directory, created if needed.
        progress: print progress to stderr.
        registry: the table of files, for tests or private mirrors.
        timeout: seconds without data before a connection is given up.
        force: take over a ``<file>.part`` (or ``<file>``) of these names that driftlab did not write.

    Returns:
        The paths of the verified files, in registry order.

    Raises:
        DownloadError: unknown name, or a network failure (the message names
            the URL and the error, and says that rerunning resumes from the
            bytes kept in ``<file>.part``).
        ChecksumMismatchError: a file does not match its published checksum.
        ConfigError: ``to_dir`` holds a file of a name it would write that driftlab did not write (and not ``force``).
    """
    table = REGISTRY if registry is None else registry
    if name not in table:
        if name in NOT_DOWNLOADABLE:
            raise DownloadError(f"{name} cannot be downloaded by driftlab: {NOT_DOWNLOADABLE[name]}")
        raise DownloadError(f"unknown data set {name!r}; downloadable data sets: {', '.join(sorted(table))}")
    hint = f"driftlab data download {name} --to {to_dir}"
    # A file already there is verified and kept, never written; what is fetched, and its .part, must be ours.
    fetched = [remote.filename for remote in table[name] if not os.path.lexists(Path(to_dir) / remote.filename)]
    claim(
        to_dir,
        [*fetched, *(filename + ".part" for filename in fetched)],
        DOWNLOAD_COMMAND,
        force=force,
        another="choose another --to directory",
    )
    return [download_file(remote, to_dir, progress, timeout=timeout, rerun_hint=hint) for remote in table[name]]


def download_file(
    remote: RemoteFile,
    to_dir: str | os.PathLike,
    progress: bool = True,
    *,
    timeout: float = 60.0,
    rerun_hint: str | None = None,
) -> Path:
    """Download one file with resume, checksum verification and an atomic rename; see :func:`download`."""
    to_dir = Path(to_dir)
    final = to_dir / remote.filename
    part = to_dir / (remote.filename + ".part")
    rerun = f"`{rerun_hint}`" if rerun_hint else "the download again"
    if final.exists():
        actual = file_checksum(final, remote.algorithm)
        if actual == remote.checksum:
            if progress:
                print(f"{final}: already present, {remote.algorithm} verified", file=sys.stderr)
            return final
        raise ChecksumMismatchError(
            f"{final} already exists but its {remote.algorithm} is {actual}, expected {remote.checksum}; "
            f"it was left untouched. Move or delete it, then run {rerun}"
        )
    claim(
        to_dir, [remote.filename, remote.filename + ".part"], DOWNLOAD_COMMAND, another="choose another --to directory"
    )
    failures = []
    for url in remote.urls:
        try:
            _fetch(url, part, timeout, progress)
            break
        except _FetchError as error:
            failures.append(f"{url}: {error}")
    else:
        kept = part.stat().st_size if part.exists() else 0
        resume = (
            f"{kept} bytes are kept in {part}; run {rerun} to resume from there" if kept else f"run {rerun} to retry"
        )
        raise DownloadError(f"could not download {remote.filename}:\n  " + "\n  ".join(failures) + f"\n{resume}")
    actual = file_checksum(part, remote.algorithm)
    if actual != remote.checksum:
        size = part.stat().st_size
        part.unlink()
        raise ChecksumMismatchError(
            f"{final}: checksum mismatch: expected {remote.algorithm} {remote.checksum}, got {actual} "
            f"({size} bytes from {url}). The corrupt download {part} was deleted and nothing else was touched; "
            f"run {rerun} to fetch it again (if it fails again, the server's file differs from the official one)"
        )
    os.replace(part, final)
    return final


class _FetchError(Exception):
    """One URL failed; the partial bytes stay in the .part file."""


def _fetch(url: str, part: Path, timeout: float, progress: bool) -> None:
    """Fetch ``url`` into ``part``, resuming from its current size with a Range request."""
    start = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "driftlab-download"}
    if start:
        headers["Range"] = f"bytes={start}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:
        if error.code == 416 and start:
            return  # the .part already holds the whole file; the checksum decides
        raise _FetchError(f"HTTP {error.code} {error.reason}") from error
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise _FetchError(f"network error: {reason}") from error
    with response:
        resumed = start > 0 and response.status == 206
        if resumed and not response.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
            raise _FetchError(
                f"the server answered the resume request with Content-Range "
                f"{response.headers.get('Content-Range')!r}, expected bytes {start}-"
            )
        offset = start if resumed else 0  # a plain 200 is the whole file: start over
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length and length.isdigit() else None
        meter = _Progress(part.name.removesuffix(".part"), offset, total) if progress else None
        try:
            with open(part, "ab" if resumed else "wb") as handle:
                while block := response.read(1 << 16):
                    handle.write(block)
                    offset += len(block)
                    if meter:
                        meter.update(offset)
                handle.flush()
                os.fsync(handle.fileno())
        except (OSError, http.client.HTTPException) as error:
            raise _FetchError(f"connection lost after {offset} bytes ({error})") from error
        finally:
            if meter:
                meter.close(offset)
        if total is not None and offset < total:
            raise _FetchError(f"connection closed after {offset} of {total} bytes")


class _Progress:
    """A one-line progress meter on stderr, redrawn at most every half second."""

    def __init__(self, label: str, done: int, total: int | None) -> None:
        self.label, self.total, self.last = label, total, 0.0
        self.update(done)

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last >= 0.5:
            self.last = now
            self._draw(done)

    def close(self, done: int) -> None:
        self._draw(done)
        sys.stderr.write("\n")
        sys.stderr.flush()

    def _draw(self, done: int) -> None:
        text = f"{done / 1e6:.1f} MB"
        if self.total:
            text += f" / {self.total / 1e6:.1f} MB ({100 * done / self.total:.0f}%)"
        sys.stderr.write(f"\r{self.label}: {text}")
        sys.stderr.flush()
