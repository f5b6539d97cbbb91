"""Tests for bounded, integrity-checked archive reading, on archives the tests build (and the real ones when present)."""

import io
import json
import struct
import subprocess
import sys
import tarfile
import zlib

import numpy as np
import pytest

from driftlab.data.archive import ArchiveLimits, iter_tar_members, read_decompressed
from driftlab.data.federated import DataFileError
from driftlab.experiments.run.real_data import needs_real_data, real_data_path

GENEROUS = ArchiveLimits(max_members=1000, max_member_bytes=1 << 24, max_total_bytes=1 << 26)
ANY = lambda member: True  # noqa: E731


def tar_bytes(members: dict[str, bytes]) -> bytes:
    """An uncompressed tar archive holding ``members`` (name -> bytes)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _gzip(data: bytes, level: int = 9) -> bytes:
    import gzip

    return gzip.compress(data, compresslevel=level, mtime=0)


def _random_members(n=3, size=5000) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {f"data/train/{i}.bin": rng.integers(0, 256, size, dtype=np.uint8).tobytes() for i in range(n)}


def _read_all(path, limits=GENEROUS):
    return list(iter_tar_members(path, limits, ANY, "a test archive"))


def gzip_of_zeros(prefix: bytes, total: int) -> bytes:
    """A gzip file whose content is ``prefix`` then zeros up to ``total`` bytes, built in milliseconds.

    One 1 MiB block of zeros is deflated once from a fresh state and ended by a
    full flush, so copies of it chain into a valid stream. The trailer's CRC is
    wrong on purpose: a reader must refuse the file long before reaching it.
    """
    chunk = 1 << 20

    def deflate(data: bytes, mode: int) -> bytes:
        compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
        return compressor.compress(data) + compressor.flush(mode)

    body = deflate(prefix, zlib.Z_FULL_FLUSH) + deflate(bytes(chunk), zlib.Z_FULL_FLUSH) * (
        (total - len(prefix)) // chunk
    )
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return header + body + deflate(b"", zlib.Z_FINISH) + struct.pack("<II", 0, total & 0xFFFFFFFF)


# --- integrity -------------------------------------------------------------------------


def test_round_trip_plain_and_every_compression(tmp_path):
    import bz2
    import lzma

    members = _random_members()
    tar = tar_bytes(members)
    for name, content in (
        ("a.tar", tar),
        ("a.tar.gz", _gzip(tar)),
        ("a.tar.bz2", bz2.compress(tar)),
        ("a.tar.xz", lzma.compress(tar)),
    ):
        (tmp_path / name).write_bytes(content)
        assert dict(_read_all(tmp_path / name)) == members, name


def test_one_bit_flip_in_stored_gzip_data_is_caught_by_the_crc(tmp_path):
    # Level 0 stores the bytes verbatim, so a flipped bit there changes a
    # member's content without any deflate error: only the CRC can tell.
    members = _random_members()
    raw = bytearray(_gzip(tar_bytes(members), level=0))
    position = raw.index(members["data/train/1.bin"][100:140]) + 10
    raw[position] ^= 0x04
    path = tmp_path / "flip.tar.gz"
    path.write_bytes(bytes(raw))
    with tarfile.open(path, "r|gz") as tar:  # tarfile alone reads the changed member without a word
        changed = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    assert changed["data/train/1.bin"] != members["data/train/1.bin"]
    with pytest.raises(DataFileError, match=r"flip\.tar\.gz is corrupt \(CRC check failed.*\): download it again"):
        _read_all(path)


def test_truncated_gzip_tarball_is_corrupt(tmp_path):
    raw = _gzip(tar_bytes(_random_members()))
    path = tmp_path / "cut.tar.gz"
    for keep in (len(raw) - 4, len(raw) // 2, 20):
        path.write_bytes(raw[:keep])
        with pytest.raises(DataFileError, match=r"cut\.tar\.gz is corrupt \(.*\): download it again"):
            _read_all(path)


def test_damaged_middle_header_does_not_silently_end_the_archive(tmp_path):
    # tarfile takes a bad header after the first for the end of the archive and drops the rest.
    raw = bytearray(tar_bytes(_random_members()))
    second_header = 512 + 5120  # first header, then 5000 bytes of data padded to 5120
    assert raw[second_header : second_header + 16].startswith(b"data/train/1.bin")
    raw[second_header + 3] ^= 0x01
    path = tmp_path / "header.tar"
    path.write_bytes(bytes(raw))
    with tarfile.open(path, "r|") as tar:
        assert len([m for m in tar]) == 1  # what tarfile alone makes of it
    with pytest.raises(
        DataFileError, match=r"header\.tar is corrupt \(data after the end of the archive.*\): download it again"
    ):
        _read_all(path)


def test_plain_tar_cut_at_a_member_boundary_lacks_the_end_marker(tmp_path):
    raw = tar_bytes(_random_members())
    path = tmp_path / "cut.tar"
    path.write_bytes(raw[: 2 * (512 + 5120)])  # two whole members, nothing after
    with pytest.raises(
        DataFileError,
        match=r"cut\.tar is corrupt \(the archive ends at byte 11,264 without its end-of-archive marker\)",
    ):
        _read_all(path)


def test_read_decompressed_checks_the_gzip_crc(tmp_path):
    raw = bytearray(_gzip(b"hello world" * 100))
    raw[-6] ^= 0x10
    path = tmp_path / "text.gz"
    path.write_bytes(bytes(raw))
    with pytest.raises(DataFileError, match=r"text\.gz is corrupt \(CRC check failed.*\): download it again"):
        read_decompressed(path, 1 << 20, "a text")
    path.write_bytes(_gzip(b"hello world" * 100) + b"garbage")
    with pytest.raises(DataFileError, match=r"text\.gz is corrupt \(Not a gzipped file.*\): download it again"):
        read_decompressed(path, 1 << 20, "a text")


def test_unreadable_path_is_a_data_file_error(tmp_path):
    with pytest.raises(DataFileError, match="cannot read .*missing.tar.gz"):
        _read_all(tmp_path / "missing.tar.gz")


# --- limits ----------------------------------------------------------------------------


def test_member_count_limit(tmp_path):
    path = tmp_path / "many.tar.gz"
    path.write_bytes(_gzip(tar_bytes({f"f{i}": b"x" for i in range(5)})))
    assert len(_read_all(path, ArchiveLimits(5, 100, 1 << 20))) == 5
    with pytest.raises(DataFileError, match=r"many\.tar\.gz has more than 4 entries, the limit for a test archive"):
        _read_all(path, ArchiveLimits(4, 100, 1 << 20))


def test_member_size_limit_is_checked_from_the_header_before_reading(tmp_path):
    path = tmp_path / "big.tar.gz"
    path.write_bytes(_gzip(tar_bytes({"small": b"x" * 10, "data/big.json": b" " * 5000})))
    seen = []
    with pytest.raises(
        DataFileError, match=r"big\.tar\.gz: member data/big\.json is 5,000 bytes, more than the 4,096 allowed"
    ):
        for name, _ in iter_tar_members(path, ArchiveLimits(10, 4096, 1 << 20), ANY, "a test archive"):
            seen.append(name)
    assert seen == ["small"]


def test_skipped_members_are_held_to_the_member_limit_too(tmp_path):
    path = tmp_path / "big.tar"
    path.write_bytes(tar_bytes({"readme": b"x" * 5000}))
    with pytest.raises(DataFileError, match="member readme is 5,000 bytes"):
        list(iter_tar_members(path, ArchiveLimits(10, 4096, 1 << 20), lambda m: False, "a test archive"))


def test_total_limit_counts_decompressed_bytes(tmp_path):
    path = tmp_path / "total.tar.gz"
    path.write_bytes(_gzip(tar_bytes(_random_members(n=4))))
    with pytest.raises(
        DataFileError, match=r"total\.tar\.gz decompresses to more than 10,000 bytes, the limit for a test archive"
    ):
        _read_all(path, ArchiveLimits(10, 1 << 20, 10_000))


def test_huge_extended_header_is_refused_before_tarfile_holds_it(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("x")
        info.pax_headers = {"comment": "y" * (2 << 20)}
        tar.addfile(info, io.BytesIO(b""))
    path = tmp_path / "pax.tar"
    path.write_bytes(buffer.getvalue())
    with pytest.raises(DataFileError, match=r"pax\.tar: a tar entry or header is larger than"):
        _read_all(path, ArchiveLimits(10, 1000, 1 << 24))


def test_zero_padding_after_the_end_is_bounded(tmp_path):
    tar = tar_bytes({"a": b"x"})
    path = tmp_path / "pad.tar.gz"
    path.write_bytes(_gzip(tar + bytes(100_000)))
    assert _read_all(path) == [("a", b"x")]
    path.write_bytes(_gzip(tar + bytes(3 << 20)))
    with pytest.raises(DataFileError, match=r"pad\.tar\.gz is corrupt \(more than 1,048,576 bytes of padding"):
        _read_all(path)


def test_gzip_of_zeros_helper_builds_what_it_says():
    import gzip

    stream = gzip.GzipFile(fileobj=io.BytesIO(gzip_of_zeros(b"abc", (3 << 20) + 3)))
    head = stream.read(3 + (3 << 20))
    assert head[:3] == b"abc" and head.count(0) == 3 << 20


# --- peak memory while rejecting bombs ---------------------------------------------------

_BOMB_CHILD = r"""
import json, sys
from driftlab.data.federated import DataFileError
from driftlab.data.idx import read_idx
from driftlab.data.image_folders import load_cifar10_image_folder, load_image_folder
from driftlab.data.leaf import load_leaf_femnist
from driftlab.data.shakespeare import read_shakespeare_roles

loaders = {"idx": read_idx, "images": load_image_folder, "cifar": load_cifar10_image_folder,
           "leaf": load_leaf_femnist, "text": read_shakespeare_roles}
messages = {}
for case, (loader, path) in json.loads(sys.argv[1]).items():
    try:
        loaders[loader](path)
        messages[case] = "ACCEPTED"
    except DataFileError as error:
        messages[case] = str(error)
# VmHWM is this process image's own peak: ru_maxrss would carry over the forking parent's peak across exec.
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"messages": messages, "maxrss_kib": peak_kib}))
"""


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=tarfile.GNU_FORMAT)


def png_with_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (the pixel data is a stub: only the header is read)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")
    )


@pytest.mark.slow
def test_peak_memory_while_rejecting_two_gigabyte_bombs_stays_small(tmp_path):
    two_gb = 2 << 30
    idx_header = bytes([0, 0, 8, 3]) + struct.pack(">3I", 60_000, 28, 28)
    cases = {
        # An IDX file whose data goes on far past what its header declares.
        "idx-trailing": ("idx", gzip_of_zeros(idx_header, two_gb)),
        # An IDX header declaring 2 GB of data.
        "idx-declared": ("idx", gzip_of_zeros(bytes([0, 0, 8, 3]) + struct.pack(">3I", 2_800_000, 28, 28), two_gb)),
        # A tar member declaring 2 GB (the 1.17 MB tarball that reached 2.3 GB).
        "leaf-member": ("leaf", gzip_of_zeros(_tar_header("femnist/train/a.json", two_gb), two_gb)),
        "images-member": ("images", gzip_of_zeros(_tar_header("c10/train/cat/0.png", two_gb), two_gb)),
        # A small valid tar, then 2 GB of zeros after its end.
        "cifar-padding": ("cifar", gzip_of_zeros(tar_bytes({"c10/train/cat/0.png": png_with_header(32, 32)}), two_gb)),
        # 2 GB of text.
        "text": ("text", gzip_of_zeros(b"A:\nhello\n", two_gb)),
    }
    arguments = {}
    for case, (loader, content) in cases.items():
        path = tmp_path / f"{case}.gz"
        if loader in ("leaf", "images", "cifar"):
            path = tmp_path / f"{case}.tar.gz"
        path.write_bytes(content)
        assert path.stat().st_size < 4 << 20  # each bomb is a few MB at most
        arguments[case] = (loader, str(path))
    png = tmp_path / "png" / "train" / "cat"
    png.mkdir(parents=True)
    (png / "0.png").write_bytes(png_with_header(20_000, 20_000))  # the 20000x20000 PNG, 400 Mpixel
    (tmp_path / "png" / "test" / "cat").mkdir(parents=True)
    (tmp_path / "png" / "test" / "cat" / "0.png").write_bytes(png_with_header(20_000, 20_000))
    arguments["png-20000"] = ("images", str(tmp_path / "png"))

    result = subprocess.run(
        [sys.executable, "-c", _BOMB_CHILD, json.dumps(arguments)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    messages = report["messages"]
    assert "unexpected bytes after the data" in messages["idx-trailing"]
    assert "more than the 1,073,741,824 allowed" in messages["idx-declared"]
    assert "member femnist/train/a.json is 2,147,483,648 bytes, more than" in messages["leaf-member"]
    assert "member c10/train/cat/0.png is 2,147,483,648 bytes, more than" in messages["images-member"]
    assert "is corrupt (more than 1,048,576 bytes of padding" in messages["cifar-padding"]
    assert "decompresses to more than 67,108,864 bytes" in messages["text"]
    assert "0.png: the image header declares a huge image" in messages["png-20000"]
    for case, (_, path) in arguments.items():
        assert path in messages[case], (case, messages[case])
    peak_mb = report["maxrss_kib"] / 1024
    assert peak_mb < 600, f"peak RSS {peak_mb:.0f} MB while rejecting the bombs"


# --- the real archives ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=needs_real_data(name)) for name in ("femnist", "cifar10_folder")]
)
def test_real_archives_read_to_their_end_without_error(name):
    from driftlab.data.image_folders import CIFAR10_FOLDER_LIMITS
    from driftlab.data.leaf import LEAF_ARCHIVE_LIMITS

    if name == "femnist":
        leaf = list(iter_tar_members(real_data_path(name), LEAF_ARCHIVE_LIMITS, ANY, "x"))
        assert len(leaf) == 40 and sum(len(c) for _, c in leaf) == 85_995_559
    else:
        images = sum(1 for _ in iter_tar_members(real_data_path(name), CIFAR10_FOLDER_LIMITS, ANY, "x"))
        assert images == 60_000
