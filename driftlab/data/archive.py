"""Bounded, integrity-checked reading of compressed data files and tar archives.

Every data file driftlab reads through here is read to its very end, so the
checks its format carries are made: a gzip member's CRC-32 and length (which
Python's :mod:`gzip` checks only when the stream is read to EOF), the
equivalent checks of bz2 and xz, and a tar archive's end-of-archive marker.
A reader that stops at the tar end-of-archive block never reaches the gzip
trailer, and :mod:`tarfile` takes a damaged or missing header after the first
one for the end of the archive, so a flipped bit could silently change or
drop data; here both are errors.

Sizes are bounded before memory is spent: a decompressed stream refuses to
give more than its limit, tar members are counted, and each member's size is
checked from its header before its data is read, so a small "decompression
bomb" is rejected after reading at most the limits below, never expanded in
full.

Every failure is a :class:`DataFileError` naming the file; corruption reads
``FILE is corrupt (...): download it again``.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from driftlab.data.federated import DataFileError

__all__ = [
    "ArchiveLimits",
    "compression",
    "corrupt_file_error",
    "iter_tar_members",
    "open_decompressed",
    "read_decompressed",
]

_MAGICS = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"))
# Errors a damaged compressed stream or tar archive raises while being read.
_CORRUPTION_ERRORS = (EOFError, zlib.error, lzma.LZMAError, tarfile.TarError, OSError)
_CHUNK = 1 << 20
# Real writers pad an archive after its end-of-archive blocks to a record
# (GNU tar and Python: 10 KiB); more than this after the end is not padding.
_MAX_TRAILING_BYTES = 1 << 20


@dataclass(frozen=True)
class ArchiveLimits:
    """Caps on what one archive may hold, checked while it streams.

    Attributes:
        max_members: tar entries of any kind (files, folders, links).
        max_member_bytes: the size of any one entry (from its header, so
            before its data is read) and of any extended header.
        max_total_bytes: the whole decompressed stream, padding included.
    """

    max_members: int
    max_member_bytes: int
    max_total_bytes: int


def corrupt_file_error(path: str | os.PathLike, error: BaseException | str) -> DataFileError:
    """The error for a file whose content is damaged: ``FILE is corrupt (...): download it again``."""
    return DataFileError(
        f"{path} is corrupt ({error}): download it again (an interrupted or damaged download is the usual cause)"
    )


class _BoundedReader:
    """A read-only view of a stream that raises DataFileError past ``limit`` bytes.

    ``mark()`` starts a second count, bounded by ``window`` when that is set,
    so that no single tar entry (extended headers included, which
    :mod:`tarfile` reads whole into memory before showing anything) can grow
    past the member limit.
    """

    def __init__(self, inner: BinaryIO, path: Path, limit: int, what: str) -> None:
        self._inner, self._path, self._limit, self._what = inner, path, limit, what
        self.window: int | None = None
        self.count = 0
        self._mark = 0

    def mark(self) -> None:
        self._mark = self.count

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._limit - self.count + 1  # never an unbounded read
        data = self._inner.read(min(size, self._limit - self.count + 1))
        self.count += len(data)
        if self.count > self._limit:
            raise DataFileError(
                f"{self._path} decompresses to more than {self._limit:,} bytes, the limit for {self._what}; "
                "it is not a genuine data file (a damaged download or a decompression bomb)"
            )
        if self.window is not None and self.count - self._mark > self.window:
            raise DataFileError(
                f"{self._path}: a tar entry or header is larger than {self.window:,} bytes, the limit for one "
                f"member of {self._what}; it is not a genuine data file (a damaged download or a decompression bomb)"
            )
        return data


def _compression(head: bytes) -> str | None:
    return next((name for magic, name in _MAGICS if head.startswith(magic)), None)


def compression(path: str | os.PathLike) -> str | None:
    """``"gzip"``, ``"bz2"`` or ``"xz"`` when ``path`` starts with that format's magic (its content is checksummed), else None."""
    with open(path, "rb") as file:
        return _compression(file.read(6))


@contextlib.contextmanager
def open_decompressed(
    path: str | os.PathLike, max_bytes: int, what: str, fileobj: BinaryIO | None = None
) -> Iterator[_BoundedReader]:
    """The content of ``path``, decompressed when its first bytes are gzip, bz2 or xz magic.

    The stream raises :class:`DataFileError` once more than ``max_bytes``
    decompressed bytes are read. Damage found while reading inside the
    ``with`` block (bad CRC, truncation, invalid data) becomes
    ``FILE is corrupt (...): download it again``; read the stream to its end
    to have the trailer checked.

    Args:
        path: the file, or only its name for messages when ``fileobj`` is given.
        max_bytes: the most decompressed bytes the file may give.
        what: what the file should be, for messages ("an IDX file").
        fileobj: an open, seekable binary file to read instead of opening ``path``.
    """
    path = Path(path)
    with contextlib.ExitStack() as stack:
        if fileobj is None:
            try:
                fileobj = stack.enter_context(open(path, "rb"))
            except OSError as error:
                raise DataFileError(f"cannot read {path} ({error.strerror or error}); expected {what}") from error
        try:
            kind = _compression(fileobj.read(6))
            fileobj.seek(0)
            inner: BinaryIO = fileobj
            if kind == "gzip":
                inner = stack.enter_context(gzip.GzipFile(fileobj=fileobj, mode="rb"))
            elif kind == "bz2":
                inner = stack.enter_context(bz2.BZ2File(fileobj, mode="rb"))
            elif kind == "xz":
                inner = stack.enter_context(lzma.LZMAFile(fileobj, mode="rb"))
            yield _BoundedReader(inner, path, max_bytes, what)
        except DataFileError:
            raise
        except _CORRUPTION_ERRORS as error:
            raise corrupt_file_error(path, error) from error


def read_capped(path: str | os.PathLike, max_bytes: int, what: str) -> bytes:
    """A plain file's bytes, refused without reading it when it is larger than ``max_bytes``."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise DataFileError(
            f"{path} is {size:,} bytes, more than the {max_bytes:,} allowed for {what}; it is not a genuine data file"
        )
    return path.read_bytes()


def read_decompressed(path: str | os.PathLike, max_bytes: int, what: str) -> bytes:
    """All of ``path``'s content (decompressed, CRC checked), or DataFileError past ``max_bytes``."""
    with open_decompressed(path, max_bytes, what) as stream:
        parts = []
        while chunk := stream.read(_CHUNK):
            parts.append(chunk)
    return b"".join(parts)


def iter_tar_members(
    path: str | os.PathLike,
    limits: ArchiveLimits,
    wanted: Callable[[tarfile.TarInfo], bool],
    what: str,
) -> Iterator[tuple[str, bytes]]:
    """``(name, content)`` of every regular member for which ``wanted`` is true, streaming the archive once.

    The archive may be a plain tar or a gzip, bz2 or xz compressed one. Names
    lose a leading ``./``. After the last member the rest of the stream is
    read: it must be the end-of-archive marker followed by zero padding, and
    reading it to its end checks the compression trailer, so a damaged or
    truncated archive is an error however late the damage is.

    Raises:
        DataFileError: the archive is corrupt or truncated (``... is corrupt
            (...): download it again``), or exceeds ``limits`` (the message
            gives the limit).
    """
    path = Path(path)
    with open_decompressed(path, limits.max_total_bytes, what) as stream:
        stream.window = limits.max_member_bytes + _MAX_TRAILING_BYTES  # headers and record padding on top
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            count = 0
            while True:
                stream.mark()
                member = tar.next()
                if member is None:
                    break
                tar.members.clear()  # tarfile keeps every header it has seen; a stream never needs them
                count += 1
                if count > limits.max_members:
                    raise DataFileError(
                        f"{path} has more than {limits.max_members:,} entries, the limit for {what}; it is not a "
                        "genuine data archive (or it holds much more than the data set)"
                    )
                if member.size > limits.max_member_bytes:
                    raise DataFileError(
                        f"{path}: member {member.name} is {member.size:,} bytes, more than the {limits.max_member_bytes:,} "
                        f"allowed for one member of {what}; it is not a genuine data archive (a damaged download "
                        "or a decompression bomb)"
                    )
                if member.isfile() and wanted(member):
                    handle = tar.extractfile(member)
                    content = handle.read() if handle is not None else b""
                    if len(content) != member.size:
                        raise corrupt_file_error(path, f"member {member.name} is cut short")
                    name = member.name[2:] if member.name.startswith("./") else member.name
                    yield name, content
            _check_archive_end(tar, stream, path)


def _check_archive_end(tar: tarfile.TarFile, stream: _BoundedReader, path: Path) -> None:
    """After tarfile's last member: the end-of-archive block was read, and only zeros follow, to the stream's end."""
    # tarfile stops without a word at a missing, truncated or damaged header; a
    # real end-of-archive marker is a whole block of zeros at tar.offset.
    if tar.fileobj.tell() != tar.offset + tarfile.BLOCKSIZE:
        raise corrupt_file_error(
            path, f"the archive ends at byte {tar.fileobj.tell():,} without its end-of-archive marker"
        )
    stream.window = None  # the padding has its own, smaller bound
    trailing = 0
    while chunk := tar.fileobj.read(64 << 10):
        trailing += len(chunk)
        if chunk.count(0) != len(chunk):
            raise corrupt_file_error(
                path, f"data after the end of the archive at byte {tar.offset:,}; a damaged header ended it early"
            )
        if trailing > _MAX_TRAILING_BYTES:
            raise corrupt_file_error(
                path, f"more than {_MAX_TRAILING_BYTES:,} bytes of padding after the end of the archive"
            )
