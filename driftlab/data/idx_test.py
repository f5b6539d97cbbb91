"""Tests for the IDX reader and the MNIST loaders.

The tests write their own small IDX files; the real MNIST test runs only where
the library finds MNIST without a ``data.root`` (``$DRIFTLAB_DATA/mnist``, else
``./shared/data/mnist`` or ``../shared/data/mnist``) and skips otherwise.
"""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from driftlab.data.federated import DataFileError
from driftlab.data.idx import IDX_DTYPES, load_mnist, load_mnist_tensors, read_idx
from driftlab.experiments.run.real_data import real_data_path, real_data_skip_reason

_CODES = {np.dtype(d.newbyteorder("=")): code for code, d in IDX_DTYPES.items()}


def _idx_bytes(array: np.ndarray) -> bytes:
    """Encode an array as IDX: zero magic, dtype code, ndim, big-endian dims, big-endian data."""
    code = _CODES[array.dtype]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def _write(path: Path, content: bytes, *, compress: bool = False) -> Path:
    path.write_bytes(gzip.compress(content) if compress else content)
    return path


# --- read_idx -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_every_dtype(tmp_path, dtype, compress):
    array = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
    path = _write(tmp_path / "a.idx", _idx_bytes(array), compress=compress)
    result = read_idx(path)
    assert result.dtype == np.dtype(dtype)
    assert result.dtype.isnative
    np.testing.assert_array_equal(result, array)
    result[0, 0, 0] = 1  # writable


def test_big_endian_values_decoded_by_hand(tmp_path):
    # int16 [2]: 0x0102 = 258 and 0xfffe = -2.
    content = bytes([0, 0, 0x0B, 1, 0, 0, 0, 2, 0x01, 0x02, 0xFF, 0xFE])
    np.testing.assert_array_equal(read_idx(_write(tmp_path / "b", content)), [258, -2])


def test_gzip_detected_by_content_not_name(tmp_path):
    array = np.arange(6, dtype=np.uint8).reshape(2, 3)
    gz_without_suffix = _write(tmp_path / "labels-idx1-ubyte", _idx_bytes(array), compress=True)
    plain_with_gz_suffix = _write(tmp_path / "labels-idx1-ubyte.gz", _idx_bytes(array))
    np.testing.assert_array_equal(read_idx(gz_without_suffix), array)
    np.testing.assert_array_equal(read_idx(plain_with_gz_suffix), array)


def test_truncated_file_reports_expected_and_found_bytes(tmp_path):
    # uint8 [3, 4]: 4 + 2 * 4 = 12 header bytes + 12 data bytes = 24; we write 10 data bytes.
    full = _idx_bytes(np.zeros((3, 4), dtype=np.uint8))
    path = _write(tmp_path / "short", full[:22])
    with pytest.raises(
        DataFileError,
        match=r"short: truncated IDX file.*needs 24 bytes \(12 header \+ 12 data\) but the file has 22 \(10 data\)",
    ):
        read_idx(path)


def test_truncated_header(tmp_path):
    with pytest.raises(DataFileError, match="at least 4 bytes but the file has 2"):
        read_idx(_write(tmp_path / "tiny", b"\x00\x00"))
    # 3 dimensions declared but only one dimension present.
    with pytest.raises(DataFileError, match="3 dimensions needs 16 bytes but the file has 8"):
        read_idx(_write(tmp_path / "header", bytes([0, 0, 8, 3, 0, 0, 0, 1])))


def test_truncated_gzip(tmp_path):
    compressed = gzip.compress(_idx_bytes(np.arange(1000, dtype=np.int32)))
    path = _write(tmp_path / "cut.gz", compressed[: len(compressed) // 2])
    with pytest.raises(DataFileError, match=r"cut.gz is corrupt \(Compressed file ended.*\): download it again"):
        read_idx(path)


def test_trailing_garbage(tmp_path):
    path = _write(tmp_path / "long", _idx_bytes(np.zeros(5, dtype=np.uint8)) + b"xy")
    with pytest.raises(DataFileError, match="2 unexpected bytes after the data.*exactly 13 bytes but the file has 15"):
        read_idx(path)


def test_bad_magic_and_dtype(tmp_path):
    with pytest.raises(DataFileError, match="not an IDX file: the first two bytes are 0x01 0x02, expected 0x00 0x00"):
        read_idx(_write(tmp_path / "m", bytes([1, 2, 8, 1, 0, 0, 0, 0])))
    with pytest.raises(DataFileError, match="HTML page"):
        read_idx(_write(tmp_path / "page", b"<html>Not Found</html>"))
    with pytest.raises(DataFileError, match="unknown IDX dtype code 0x07; supported codes are 0x08 uint8"):
        read_idx(_write(tmp_path / "d", bytes([0, 0, 7, 1, 0, 0, 0, 0])))


def test_missing_file(tmp_path):
    with pytest.raises(DataFileError, match="nothing-here does not exist"):
        read_idx(tmp_path / "nothing-here")
    with pytest.raises(DataFileError, match="is a directory"):
        read_idx(tmp_path)


# --- load_mnist -----------------------------------------------------------


def _fake_mnist(root: Path, *, n_train=6, n_test=4, names=None, compress=True) -> dict:
    """Write a small MNIST in the official format; return the arrays written."""
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    names = names or {}
    for official, array in arrays.items():
        name = names.get(official, official + (".gz" if compress else ""))
        _write(root / name, _idx_bytes(array), compress=name.endswith(".gz"))
    return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_load_mnist_official_names(tmp_path, compress):
    written = _fake_mnist(tmp_path, compress=compress)
    loaded = load_mnist(tmp_path)
    for array, expected in zip(loaded, written.values(), strict=True):
        np.testing.assert_array_equal(array, expected)


def test_load_mnist_dot_variant_and_mixed_compression(tmp_path):
    written = _fake_mnist(
        tmp_path,
        names={
            "train-images-idx3-ubyte": "train-images.idx3-ubyte",
            "t10k-labels-idx1-ubyte": "t10k-labels.idx1-ubyte.gz",
        },
    )
    np.testing.assert_array_equal(load_mnist(tmp_path)[0], written["train-images-idx3-ubyte"])


def test_load_mnist_tensors_normalises_like_feddyn(tmp_path):
    _fake_mnist(tmp_path)
    images = np.zeros((2, 28, 28), dtype=np.uint8)
    images[1] = 255
    _write(tmp_path / "train-images-idx3-ubyte.gz", _idx_bytes(images), compress=True)
    _write(tmp_path / "train-labels-idx1-ubyte.gz", _idx_bytes(np.array([3, 9], dtype=np.uint8)), compress=True)
    train_x, train_y, test_x, test_y = load_mnist_tensors(tmp_path)
    assert train_x.shape == (2, 1, 28, 28) and train_x.dtype == torch.float32
    assert test_x.shape == (4, 1, 28, 28)
    assert train_y.dtype == torch.int64 and train_y.tolist() == [3, 9]
    # (0 - 0.1307) / 0.3081 = -0.424213 and (1 - 0.1307) / 0.3081 = 2.821487
    assert torch.allclose(train_x[0], torch.full((1, 28, 28), -0.424213), atol=1e-5)
    assert torch.allclose(train_x[1], torch.full((1, 28, 28), 2.821487), atol=1e-5)


def test_missing_mnist_file_lists_names_and_download_site(tmp_path):
    _fake_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataFileError) as error:
        load_mnist(tmp_path)
    message = str(error.value)
    assert "MNIST test labels not found" in message
    for name in ("train-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"):
        assert name in message
    assert "http://yann.lecun.com/exdb/mnist/" in message and "driftlab data download mnist --to DIR" in message


def test_missing_mnist_directory(tmp_path):
    with pytest.raises(DataFileError, match="the directory does not exist"):
        load_mnist(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "target, source, match",
    [
        # the test labels (4) stored under the train label name
        (
            "train-labels-idx1-ubyte.gz",
            "t10k-labels-idx1-ubyte",
            "train-images-idx3-ubyte.gz holds 6 images but .*train-labels-idx1-ubyte.gz holds 4 labels",
        ),
        (
            "train-labels-idx1-ubyte.gz",
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte.gz: expected MNIST labels.*looks like an image file.*train-images",
        ),
        (
            "t10k-images-idx3-ubyte.gz",
            "t10k-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte.gz is 1-D.*label file.*t10k-labels",
        ),
    ],
    ids=["label_file_from_the_other_split", "images_given_as_labels", "labels_given_as_images"],
)
def test_a_file_in_the_place_of_another_is_named(tmp_path, target, source, match):
    written = _fake_mnist(tmp_path, n_train=6, n_test=4)
    _write(tmp_path / target, _idx_bytes(written[source]), compress=True)
    with pytest.raises(DataFileError, match=match):
        load_mnist(tmp_path)


def test_wrong_image_shape_and_label_values(tmp_path):
    _fake_mnist(tmp_path)
    _write(tmp_path / "train-images-idx3-ubyte.gz", _idx_bytes(np.zeros((6, 27, 28), dtype=np.uint8)), compress=True)
    with pytest.raises(DataFileError, match=r"uint8 of shape \[n, 28, 28\], got uint8 of shape \(6, 27, 28\)"):
        load_mnist(tmp_path)
    _fake_mnist(tmp_path)
    _write(tmp_path / "t10k-labels-idx1-ubyte.gz", _idx_bytes(np.array([0, 1, 10, 2], dtype=np.uint8)), compress=True)
    with pytest.raises(DataFileError, match="digits 0..9 but the file contains 10"):
        load_mnist(tmp_path)


# --- integrity and bounds -------------------------------------------------


def test_gzip_crc_flip_is_corrupt_not_silently_different_values(tmp_path):
    array = np.arange(4000, dtype=np.int32)
    raw = bytearray(gzip.compress(_idx_bytes(array), compresslevel=0))  # stored: the flip changes a value silently
    raw[len(raw) // 2] ^= 0x01
    path = _write(tmp_path / "flip.gz", bytes(raw))
    with pytest.raises(DataFileError, match=r"flip\.gz is corrupt \(CRC check failed.*\): download it again"):
        read_idx(path)


def test_garbage_after_the_gzip_stream_is_corrupt(tmp_path):
    path = _write(tmp_path / "tail.gz", gzip.compress(_idx_bytes(np.zeros(5, dtype=np.uint8))) + b"junk!")
    with pytest.raises(DataFileError, match=r"tail\.gz is corrupt \(Not a gzipped file.*\): download it again"):
        read_idx(path)


def test_gzipped_data_beyond_the_declared_size(tmp_path):
    path = _write(tmp_path / "long.gz", _idx_bytes(np.zeros(5, dtype=np.uint8)) + b"xyz", compress=True)
    with pytest.raises(
        DataFileError, match="long.gz: 3 unexpected bytes after the data.*exactly 13 bytes but the file has 16"
    ):
        read_idx(path)


def test_declared_size_is_checked_before_anything_is_allocated(tmp_path):
    # The header declares 4e9 x 4e9 float64 (far past any memory); the file is 24 bytes.
    header = bytes([0, 0, 0x0E, 2]) + struct.pack(">2I", 4_000_000_000, 4_000_000_000)
    path = _write(tmp_path / "huge", header + bytes(8))
    with pytest.raises(
        DataFileError,
        match=r"declares shape \(4000000000, 4000000000\) of float64, 128,000,000,000,000,000,000 bytes of data, "
        r"more than the 1,073,741,824 allowed",
    ):
        read_idx(path)
    small = _write(tmp_path / "small", _idx_bytes(np.zeros(100, dtype=np.uint8)))
    with pytest.raises(DataFileError, match="more than the 99 allowed"):
        read_idx(small, max_bytes=99)
    assert read_idx(small, max_bytes=100).shape == (100,)


def test_check_header_runs_before_the_data_is_read(tmp_path):
    seen = []

    def refuse(dtype, shape):
        seen.append((dtype.name, shape))
        raise DataFileError("refused")

    path = _write(tmp_path / "short", _idx_bytes(np.zeros((3, 4), dtype=np.uint8))[:14])  # truncated data
    with pytest.raises(DataFileError, match="^refused$"):
        read_idx(path, check_header=refuse)
    assert seen == [("uint8", (3, 4))]


def test_mnist_header_beyond_the_official_count_is_refused(tmp_path):
    _fake_mnist(tmp_path)
    header = bytes([0, 0, 8, 3]) + struct.pack(">3I", 60_001, 28, 28)
    _write(tmp_path / "train-images-idx3-ubyte.gz", header, compress=True)  # header only: never read further
    with pytest.raises(
        DataFileError,
        match=r"train-images-idx3-ubyte\.gz: the IDX header declares 60,001 images but MNIST's train split .* has 60,000",
    ):
        load_mnist(tmp_path)


# --- real MNIST -----------------------------------------------------------


@pytest.fixture(scope="module")
def real_mnist():
    path = real_data_path("mnist")
    if path is None:
        pytest.skip(real_data_skip_reason("mnist"))
    return load_mnist_tensors(path)


def test_real_mnist(real_mnist):
    train_x, train_y, test_x, test_y = real_mnist
    assert train_x.shape == (60000, 1, 28, 28) and test_x.shape == (10000, 1, 28, 28)
    # The canonical per-digit counts of MNIST.
    assert torch.bincount(train_y).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert torch.bincount(test_y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    # 0.1307 and 0.3081 are the train set's pixel mean and std, so normalised pixels have mean 0, std 1.
    assert abs(train_x.mean().item()) < 0.01
    assert abs(train_x.std().item() - 1.0) < 0.01
