"""Tests for the image loaders and the CIFAR augmentation.

Every loader is tested on small files the tests write in the official formats
(IDX inside EMNIST's gzip.zip, CIFAR binary records in a tar.gz, image folders
written with Pillow); the real CIFAR-10 JPEG tarball and MNIST files are used
where the library finds them (``driftlab.experiments.run.real_data``) and skipped
otherwise.
"""

import gzip
import io
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from driftlab.data.archive_test import png_with_header, tar_bytes
from driftlab.data.federated import DataFileError
from driftlab.data.idx import MNIST_MEAN, MNIST_STD
from driftlab.data.image_folders import load_cifar10_image_folder, load_image_folder
from driftlab.data.images import (
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    load_cifar_pixels,
    load_cifar_tensors,
    load_emnist_tensors,
    load_fashion_mnist_tensors,
)
from driftlab.data.registry import lookup
from driftlab.experiments.run.real_data import needs_real_data, real_data_path
from driftlab.simulation.backends.augmentation import check_images, flip_crop_from_keys, flip_then_shift

# where the library finds them without a data.root, or None
REAL_CIFAR_JPEG = real_data_path("cifar10_folder")
REAL_MNIST = real_data_path("mnist")


# --- writers for the official formats ----------------------------------------


def _idx(array: np.ndarray) -> bytes:
    """IDX encoding of a uint8 array: magic 0 0 0x08 ndim, big-endian dims, data."""
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def _write_mnist_like(root: Path, rng: np.random.Generator, n_train=30, n_test=10, low=0, high=256) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    data = {
        "train-images-idx3-ubyte.gz": rng.integers(low, high, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte.gz": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte.gz": rng.integers(low, high, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte.gz": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for name, array in data.items():
        (root / name).write_bytes(gzip.compress(_idx(array)))
    return data


def _emnist_arrays(rng, split: str, n_train=40, n_test=20) -> dict:
    low, high = (1, 27) if split == "letters" else (0, 62)
    arrays = {}
    for part, n in (("train", n_train), ("test", n_test)):
        labels = rng.integers(low, high, n, dtype=np.uint8)
        labels[: high - low] = np.arange(low, high)[:n]  # every class present when n allows
        arrays[f"emnist-{split}-{part}-images-idx3-ubyte.gz"] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        arrays[f"emnist-{split}-{part}-labels-idx1-ubyte.gz"] = labels
    return arrays


def _write_emnist_zip(path: Path, arrays: dict) -> None:
    with zipfile.ZipFile(path, "w") as bundle:
        for name, array in arrays.items():
            bundle.writestr(f"gzip/{name}", gzip.compress(_idx(array)))


def _cifar_records(rng, n: int, label_bytes: int, limits=(10,)) -> tuple[bytes, np.ndarray, np.ndarray]:
    labels = np.stack([rng.integers(0, lim, n, dtype=np.uint8) for lim in limits], axis=1)
    pixels = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    raw = np.concatenate([labels, pixels.reshape(n, -1)], axis=1).tobytes()
    assert label_bytes == len(limits)
    return raw, labels[:, -1], pixels


def _write_cifar10(rng, where: Path, *, as_tar: bool, n=6) -> dict:
    files = {}
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        files[name] = _cifar_records(rng, n, 1)
    members = {f"cifar-10-batches-bin/{name}": raw for name, (raw, _, _) in files.items()}
    members["cifar-10-batches-bin/batches.meta.txt"] = "\n".join(CIFAR10_CLASSES).encode()
    _write_members(where, members, as_tar=as_tar)
    return files


def _write_members(where: Path, members: dict, *, as_tar: bool) -> None:
    if as_tar:
        with tarfile.open(where, "w:gz") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    else:
        for name, data in members.items():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            (where / name).write_bytes(data)


def _assert_refused(folder: Path, members: dict, load, match: str) -> None:
    """``members`` written as an image folder in ``folder`` and ``load`` refusing it with a message matching ``match``."""
    _write_members(folder, members, as_tar=False)
    with pytest.raises(DataFileError, match=match):
        load(folder)


def _encode(array: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def _image_folder_members(
    rng, prefix="c10/", classes=("cat", "airplane", "dog"), per_class=(3, 2), gray=False, fmt="PNG"
):
    """``{member name: bytes}`` of an image folder and the pixels of each image by name."""
    members, pixels = {}, {}
    ext = ".png" if fmt == "PNG" else ".jpg"
    for split, count in zip(("train", "test"), per_class, strict=True):
        for cls in classes:
            for k in range(count):
                shape = (8, 6) if gray else (8, 6, 3)
                if fmt == "JPEG":  # one flat colour per image: JPEG keeps it almost exactly
                    array = np.broadcast_to(rng.integers(0, 256, shape[2:], dtype=np.uint8), shape).copy()
                else:
                    array = rng.integers(0, 256, shape, dtype=np.uint8)
                name = f"{prefix}{split}/{cls}/{k:04d}{ext}"
                members[name] = _encode(array, fmt)
                pixels[name] = array
    return members, pixels


# --- Fashion-MNIST -------------------------------------------------------------


def test_fashion_mnist_shapes_labels_and_normalisation(tmp_path):
    data = _write_mnist_like(tmp_path, np.random.default_rng(0), low=40)
    train_x, train_y, test_x, test_y = load_fashion_mnist_tensors(tmp_path)
    assert train_x.shape == (30, 1, 28, 28) and test_x.shape == (10, 1, 28, 28)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64
    np.testing.assert_array_equal(train_y.numpy(), data["train-labels-idx1-ubyte.gz"])
    expected = (data["t10k-images-idx3-ubyte.gz"][3].astype(np.float32) / 255 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    np.testing.assert_allclose(test_x[3, 0].numpy(), expected, rtol=1e-6, atol=1e-6)


def test_fashion_mnist_missing_file_names_files_and_download_command(tmp_path):
    _write_mnist_like(tmp_path, np.random.default_rng(0), low=40)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataFileError) as info:
        load_fashion_mnist_tensors(tmp_path)
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte" in message and "driftlab data download fashion_mnist" in message
    assert "train-images" not in message  # only the missing file is listed


def test_fashion_mnist_refuses_mnist_digits(tmp_path):
    _write_mnist_like(tmp_path, np.random.default_rng(0), low=0, high=60)  # dark, like MNIST
    with pytest.raises(DataFileError, match="MNIST's digits"):
        load_fashion_mnist_tensors(tmp_path)


@needs_real_data("mnist")
def test_fashion_mnist_refuses_the_real_mnist_directory():
    with pytest.raises(DataFileError, match="not Fashion-MNIST"):
        load_fashion_mnist_tensors(REAL_MNIST)


# --- EMNIST --------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["zip", "loose", "gzip_folder", "zip_path", "ungzipped"])
def test_emnist_letters_found_in_every_official_layout(tmp_path, layout):
    arrays = _emnist_arrays(np.random.default_rng(1), "letters")
    if layout in ("zip", "zip_path"):
        _write_emnist_zip(tmp_path / "gzip.zip", arrays)
    else:
        folder = tmp_path / "gzip" if layout == "gzip_folder" else tmp_path
        folder.mkdir(exist_ok=True)
        for name, array in arrays.items():
            if layout == "ungzipped":
                (folder / name.removesuffix(".gz")).write_bytes(_idx(array))
            else:
                (folder / name).write_bytes(gzip.compress(_idx(array)))
    root = tmp_path / "gzip.zip" if layout == "zip_path" else tmp_path
    train_x, train_y, test_x, test_y = load_emnist_tensors(root, "letters", normalisation="mnist")
    assert train_x.shape == (40, 1, 28, 28) and test_x.shape == (20, 1, 28, 28)
    np.testing.assert_array_equal(train_y.numpy(), arrays["emnist-letters-train-labels-idx1-ubyte.gz"] - 1)
    assert train_y.min() == 0 and train_y.max() == 25
    # Stored transposed: the loader's image is the file's image transposed.
    stored = arrays["emnist-letters-test-images-idx3-ubyte.gz"][5].astype(np.float32)
    expected = (stored.T / 255 - MNIST_MEAN) / MNIST_STD
    np.testing.assert_allclose(test_x[5, 0].numpy(), expected, rtol=1e-6, atol=1e-6)


def test_emnist_transposition_makes_a_stored_column_a_row(tmp_path):
    arrays = _emnist_arrays(np.random.default_rng(2), "letters", n_train=26, n_test=26)
    image = np.zeros((28, 28), dtype=np.uint8)
    image[:, 3] = 255  # a vertical stroke in the file (column 3) is a horizontal one upright
    arrays["emnist-letters-train-images-idx3-ubyte.gz"][0] = image
    _write_emnist_zip(tmp_path / "gzip.zip", arrays)
    train_x = load_emnist_tensors(tmp_path, "letters")[0]
    bright = (train_x[0, 0] == train_x[0, 0].max()).numpy()
    assert bright[3].all() and bright.sum() == 28  # exactly row 3


def test_emnist_letters10_keeps_first_ten_letters_with_train_statistics(tmp_path):
    arrays = _emnist_arrays(np.random.default_rng(3), "letters", n_train=60, n_test=40)
    _write_emnist_zip(tmp_path / "gzip.zip", arrays)
    train_x, train_y, test_x, test_y = load_emnist_tensors(tmp_path, "letters10")
    file_train_labels = arrays["emnist-letters-train-labels-idx1-ubyte.gz"]
    keep = file_train_labels <= 10
    np.testing.assert_array_equal(train_y.numpy(), file_train_labels[keep] - 1)
    assert set(train_y.tolist()) == set(range(10))
    assert len(test_y) == int((arrays["emnist-letters-test-labels-idx1-ubyte.gz"] <= 10).sum())
    # FedDyn standardises with the kept training images' own mean and deviation.
    kept = arrays["emnist-letters-train-images-idx3-ubyte.gz"][keep].astype(np.float64) / 255
    expected = (kept[0].T - kept.mean()) / kept.std()
    np.testing.assert_allclose(train_x[0, 0].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert abs(float(train_x.mean())) < 1e-4 and abs(float(train_x.std()) - 1) < 1e-2


def test_emnist_byclass_has_62_classes(tmp_path):
    arrays = _emnist_arrays(np.random.default_rng(4), "byclass", n_train=70, n_test=10)
    _write_emnist_zip(tmp_path / "gzip.zip", arrays)
    _, train_y, _, test_y = load_emnist_tensors(tmp_path, "byclass")
    assert set(train_y.tolist()) == set(range(62))
    np.testing.assert_array_equal(test_y.numpy(), arrays["emnist-byclass-test-labels-idx1-ubyte.gz"])


def test_emnist_missing_files_name_them_and_the_download_command(tmp_path):
    with pytest.raises(DataFileError) as info:
        load_emnist_tensors(tmp_path, "letters10")
    message = str(info.value)
    assert "emnist-letters-train-images-idx3-ubyte.gz" in message and "emnist-letters-test-labels" in message
    assert "gzip.zip" in message and "driftlab data download emnist" in message


def test_emnist_zip_without_the_split_names_the_member(tmp_path):
    _write_emnist_zip(tmp_path / "gzip.zip", _emnist_arrays(np.random.default_rng(5), "letters"))
    with pytest.raises(DataFileError, match="emnist-byclass-train-images-idx3-ubyte.gz"):
        load_emnist_tensors(tmp_path, "byclass")


def test_emnist_mislabelled_file_names_the_file(tmp_path):
    arrays = _emnist_arrays(np.random.default_rng(6), "letters")
    arrays["emnist-letters-test-labels-idx1-ubyte.gz"][7] = 0  # letters start at 1
    _write_emnist_zip(tmp_path / "gzip.zip", arrays)
    with pytest.raises(DataFileError, match=r"emnist-letters-test-labels-idx1-ubyte.gz.*1\.\.26.*0"):
        load_emnist_tensors(tmp_path, "letters")


def test_emnist_truncated_member_names_the_member(tmp_path):
    arrays = _emnist_arrays(np.random.default_rng(7), "letters")
    with zipfile.ZipFile(tmp_path / "gzip.zip", "w") as bundle:
        for name, array in arrays.items():
            content = _idx(array)
            if "train-images" in name:
                content = content[:-100]
            bundle.writestr(f"gzip/{name}", gzip.compress(content))
    with pytest.raises(DataFileError, match=r"gzip.zip:gzip/emnist-letters-train-images.*truncated"):
        load_emnist_tensors(tmp_path, "letters")


def test_emnist_image_and_label_counts_must_agree(tmp_path):
    arrays = _emnist_arrays(np.random.default_rng(8), "letters")
    arrays["emnist-letters-train-labels-idx1-ubyte.gz"] = arrays["emnist-letters-train-labels-idx1-ubyte.gz"][:-1]
    _write_emnist_zip(tmp_path / "gzip.zip", arrays)
    with pytest.raises(DataFileError, match="40 images but .* 39 labels"):
        load_emnist_tensors(tmp_path, "letters")


def test_emnist_rejects_unknown_split(tmp_path):
    with pytest.raises(ValueError, match="letters10"):
        load_emnist_tensors(tmp_path, "digits")


# --- CIFAR binary ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["tarball", "dir_with_tarball", "extracted", "extracted_parent"])
def test_cifar10_binary_every_layout(tmp_path, layout):
    rng = np.random.default_rng(10)
    if layout in ("tarball", "dir_with_tarball"):
        files = _write_cifar10(rng, tmp_path / "cifar-10-binary.tar.gz", as_tar=True)
        root = tmp_path / "cifar-10-binary.tar.gz" if layout == "tarball" else tmp_path
    else:
        files = _write_cifar10(rng, tmp_path, as_tar=False)
        root = tmp_path / "cifar-10-batches-bin" if layout == "extracted" else tmp_path
    train_x, train_y, test_x, test_y = load_cifar_tensors(root, 10)
    assert train_x.shape == (30, 3, 32, 32) and test_x.shape == (6, 3, 32, 32)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64
    expected_labels = np.concatenate([files[f"data_batch_{i}.bin"][1] for i in range(1, 6)])
    np.testing.assert_array_equal(train_y.numpy(), expected_labels)
    pixels = files["data_batch_2.bin"][2][1]  # record 1 of batch 2 is training row 7
    mean = np.array(CIFAR10_MEAN, dtype=np.float32).reshape(3, 1, 1)
    std = np.array(CIFAR10_STD, dtype=np.float32).reshape(3, 1, 1)
    np.testing.assert_allclose(train_x[7].numpy(), (pixels / np.float32(255) - mean) / std, rtol=1e-6, atol=1e-6)


def test_cifar100_binary_uses_fine_labels(tmp_path):
    rng = np.random.default_rng(11)
    train_raw, train_fine, _ = _cifar_records(rng, 12, 2, limits=(20, 100))
    test_raw, test_fine, test_pixels = _cifar_records(rng, 4, 2, limits=(20, 100))
    _write_members(
        tmp_path / "cifar-100-binary.tar.gz",
        {"cifar-100-binary/train.bin": train_raw, "cifar-100-binary/test.bin": test_raw},
        as_tar=True,
    )
    train_x, train_y, test_x, test_y = load_cifar_tensors(tmp_path, 100)
    np.testing.assert_array_equal(train_y.numpy(), train_fine)
    np.testing.assert_array_equal(test_y.numpy(), test_fine)
    mean = np.array(CIFAR100_MEAN, dtype=np.float32).reshape(3, 1, 1)
    std = np.array(CIFAR100_STD, dtype=np.float32).reshape(3, 1, 1)
    np.testing.assert_allclose(test_x[2].numpy(), (test_pixels[2] / np.float32(255) - mean) / std, atol=1e-6)


def test_cifar_binary_limit_per_class_keeps_each_class_first_records(tmp_path):
    fine = {"train.bin": [3, 5, 3, 3, 5, 7, 3], "test.bin": [7, 7, 7, 1]}
    pixels = {
        name: np.random.default_rng(13).integers(0, 256, (len(f), 3, 32, 32), dtype=np.uint8)
        for name, f in fine.items()
    }
    members = {
        f"cifar-100-binary/{name}": np.concatenate(
            [np.stack([np.zeros(len(f), np.uint8), np.array(f, np.uint8)], axis=1), pixels[name].reshape(len(f), -1)],
            axis=1,
        ).tobytes()
        for name, f in fine.items()
    }
    _write_members(tmp_path / "cifar-100-binary.tar.gz", members, as_tar=True)
    train_x, train_y, test_x, test_y, _ = load_cifar_pixels(tmp_path, 100, limit_per_class=2)
    # by hand: class 3 keeps rows 0 and 2, class 5 rows 1 and 4, class 7 row 5; file order is kept
    assert train_y.tolist() == [3, 5, 3, 5, 7] and test_y.tolist() == [7, 7, 1]
    np.testing.assert_array_equal(train_x.numpy(), pixels["train.bin"][[0, 1, 2, 4, 5]])
    np.testing.assert_array_equal(test_x.numpy(), pixels["test.bin"][[0, 1, 3]])
    assert load_cifar_pixels(tmp_path, 100, limit_per_class=4)[1].tolist() == fine["train.bin"]
    with pytest.raises(ValueError, match="limit_per_class"):
        load_cifar_pixels(tmp_path, 100, limit_per_class=0)


def test_the_cifar_data_sets_take_data_limit_per_class(tmp_path):
    _write_cifar10(np.random.default_rng(14), tmp_path, as_tar=False, n=12)
    entry = lookup("cifar10")
    train_x, train_y, test_x, test_y, _ = entry.load(entry.config_type(limit_per_class=1), 0, tmp_path)
    assert sorted(train_y.tolist()) == sorted(set(train_y.tolist())) and len(train_x) == len(train_y)
    assert sorted(test_y.tolist()) == sorted(set(test_y.tolist()))
    assert "limit_per_class" in lookup("cifar100").own_keys


def test_cifar_truncated_file_gives_expected_and_found_bytes(tmp_path):
    _write_cifar10(np.random.default_rng(12), tmp_path, as_tar=False)
    batch = tmp_path / "cifar-10-batches-bin" / "data_batch_3.bin"
    batch.write_bytes(batch.read_bytes()[:-10])
    with pytest.raises(DataFileError) as info:
        load_cifar_tensors(tmp_path, 10)
    message = str(info.value)
    assert "data_batch_3.bin" in message and "30730000 bytes" in message and f"found {6 * 3073 - 10}" in message


def test_cifar_label_out_of_range_names_file_and_record(tmp_path):
    rng = np.random.default_rng(13)
    files = _write_cifar10(rng, tmp_path, as_tar=False)
    raw = bytearray(files["test_batch.bin"][0])
    raw[2 * 3073] = 12  # label byte of record 2
    (tmp_path / "cifar-10-batches-bin" / "test_batch.bin").write_bytes(bytes(raw))
    with pytest.raises(DataFileError, match=r"test_batch.bin: record 2 has label 12.*0\.\.9"):
        load_cifar_tensors(tmp_path, 10)


def test_cifar_missing_files_name_layouts_and_download_command(tmp_path):
    with pytest.raises(DataFileError) as info:
        load_cifar_tensors(tmp_path, 100)
    message = str(info.value)
    assert "cifar-100-binary.tar.gz" in message and "train.bin" in message
    assert "driftlab data download cifar100" in message


def test_cifar_partial_folder_names_missing_batch(tmp_path):
    _write_cifar10(np.random.default_rng(14), tmp_path, as_tar=False)
    (tmp_path / "cifar-10-batches-bin" / "data_batch_4.bin").unlink()
    with pytest.raises(DataFileError, match="misses data_batch_4.bin"):
        load_cifar_tensors(tmp_path, 10)


def test_cifar_python_version_is_refused_without_unpickling(tmp_path):
    _write_members(
        tmp_path / "cifar-10-binary.tar.gz",
        {"cifar-10-batches-py/data_batch_1": b"\x80\x04not read", "cifar-10-batches-py/batches.meta": b""},
        as_tar=True,
    )
    with pytest.raises(DataFileError, match="python \\(pickle\\) version"):
        load_cifar_tensors(tmp_path / "cifar-10-binary.tar.gz", 10)


def test_cifar_corrupt_tarball_is_a_data_file_error(tmp_path):
    _write_cifar10(np.random.default_rng(15), tmp_path / "cifar-10-binary.tar.gz", as_tar=True)
    archive = tmp_path / "cifar-10-binary.tar.gz"
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(DataFileError, match="cifar-10-binary.tar.gz"):
        load_cifar_tensors(archive, 10)


# --- image folders ---------------------------------------------------------------


@pytest.mark.parametrize("as_tar", [False, True])
def test_image_folder_png_dir_and_tar_agree(tmp_path, as_tar):
    rng = np.random.default_rng(20)
    members, pixels = _image_folder_members(rng)
    members["c10/README.txt"] = b"not an image"
    members["c10/train/cat/._0000.png"] = b"macOS resource fork"
    where = tmp_path / "folder.tar.gz" if as_tar else tmp_path
    _write_members(where, members, as_tar=as_tar)
    path = where if as_tar else tmp_path / "c10"
    train_x, train_y, test_x, test_y, classes = load_image_folder(path)
    assert classes == ("airplane", "cat", "dog")
    assert train_x.shape == (9, 3, 8, 6) and test_x.shape == (6, 3, 8, 6)
    assert train_y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and test_y.tolist() == [0, 0, 1, 1, 2, 2]
    # Row 4 is cat/0001.png: PNG is lossless, so the pixels come back exactly.
    expected = pixels["c10/train/cat/0001.png"].transpose(2, 0, 1) / np.float32(255)
    np.testing.assert_allclose(train_x[4].numpy(), expected)


def test_image_folder_from_dir_given_the_parent_of_the_prefix(tmp_path):
    members, _ = _image_folder_members(np.random.default_rng(21))
    _write_members(tmp_path, members, as_tar=False)
    assert load_image_folder(tmp_path)[0].shape == (9, 3, 8, 6)


def test_image_folder_grayscale_gives_one_channel_and_normalises(tmp_path):
    members, pixels = _image_folder_members(np.random.default_rng(22), prefix="", gray=True)
    _write_members(tmp_path / "g.tar", members, as_tar=True)
    train_x, _, test_x, _, _ = load_image_folder(tmp_path / "g.tar", normalise=(0.5, 0.25))
    assert train_x.shape == (9, 1, 8, 6)
    expected = (pixels["test/dog/0001.png"] / np.float32(255) - 0.5) / 0.25
    np.testing.assert_allclose(test_x[5, 0].numpy(), expected, rtol=1e-6, atol=1e-6)


def test_image_folder_jpeg_limit_and_channel_normalisation(tmp_path):
    members, pixels = _image_folder_members(np.random.default_rng(23), fmt="JPEG", per_class=(4, 2))
    _write_members(tmp_path / "j.tar.gz", members, as_tar=True)
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.3, 0.4)
    raw = load_image_folder(tmp_path / "j.tar.gz", limit_per_class=2)
    normalised = load_image_folder(tmp_path / "j.tar.gz", normalise=(mean, std), limit_per_class=2)
    assert raw[0].shape == (6, 3, 8, 6) and raw[1].tolist() == [0, 0, 1, 1, 2, 2]
    expected = (raw[0] - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(normalised[0], expected)
    # JPEG is lossy but close; the first two files of each class are kept.
    original = pixels["c10/train/dog/0001.jpg"].transpose(2, 0, 1) / 255.0
    assert np.abs(raw[0][5].numpy() - original).max() < 0.03


def test_image_folder_corrupt_image_names_the_member(tmp_path):
    members, _ = _image_folder_members(np.random.default_rng(24))
    members["c10/test/dog/0001.png"] = b"\x89PNG\r\n\x1a\n truncated"
    _write_members(tmp_path / "bad.tar.gz", members, as_tar=True)
    with pytest.raises(DataFileError, match=r"bad.tar.gz:c10/test/dog/0001.png: cannot decode"):
        load_image_folder(tmp_path / "bad.tar.gz")


def test_image_folder_size_mismatch_names_the_file(tmp_path):
    members, _ = _image_folder_members(np.random.default_rng(25))
    members["c10/train/dog/0002.png"] = _encode(np.zeros((9, 9, 3), dtype=np.uint8), "PNG")
    _assert_refused(tmp_path, members, load_image_folder, r"dog/0002.png: image is 9x9 but the first image is 6x8")


def test_image_folder_missing_split_and_missing_path(tmp_path):
    members, _ = _image_folder_members(np.random.default_rng(26))
    members = {k: v for k, v in members.items() if "/test/" not in k}
    _assert_refused(
        tmp_path,
        members,
        load_image_folder,
        r"no images in a 'test/<class>/<image>' folder \(found splits: \['train'\]",
    )
    with pytest.raises(DataFileError, match="does not exist"):
        load_image_folder(tmp_path / "nope.tar.gz")


def test_image_folder_test_class_absent_from_train(tmp_path):
    members, _ = _image_folder_members(np.random.default_rng(27))
    members["c10/test/zebra/0000.png"] = members["c10/test/dog/0000.png"]
    _assert_refused(tmp_path, members, load_image_folder, "zebra")


def test_image_folder_two_prefixes_are_ambiguous(tmp_path):
    members, _ = _image_folder_members(np.random.default_rng(28))
    members.update({k.replace("c10/", "copy/"): v for k, v in members.items()})
    _write_members(tmp_path / "two.tar", members, as_tar=True)
    with pytest.raises(DataFileError, match="several prefixes"):
        load_image_folder(tmp_path / "two.tar")


def test_cifar10_image_folder_checks_ten_classes(tmp_path):
    rng = np.random.default_rng(29)
    members, _ = _image_folder_members(rng)
    members = {k: _encode(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "PNG") for k in members}
    _assert_refused(tmp_path, members, load_cifar10_image_folder, "expected CIFAR-10, 10 classes")


def test_cifar10_image_folder_checks_the_size_from_the_header_before_decoding(tmp_path):
    members, _ = _image_folder_members(np.random.default_rng(29))  # 6x8 images
    _assert_refused(
        tmp_path,
        members,
        load_cifar10_image_folder,
        r"c10/train/airplane/0000.png: image is 6x8 but the data set's images are 32x32",
    )


def test_cifar10_image_folder_normalises_with_cifar10_statistics(tmp_path):
    rng = np.random.default_rng(30)
    members, _ = _image_folder_members(rng, classes=CIFAR10_CLASSES, per_class=(2, 1))
    members = {k: _encode(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "PNG") for k in members}
    _write_members(tmp_path / "c.tar.gz", members, as_tar=True)
    raw = load_image_folder(tmp_path / "c.tar.gz")
    train_x, train_y, test_x, test_y, classes = load_cifar10_image_folder(tmp_path / "c.tar.gz")
    assert classes == CIFAR10_CLASSES and train_x.shape == (20, 3, 32, 32) and test_x.shape == (10, 3, 32, 32)
    mean, std = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(test_x, (raw[2] - mean) / std)


@needs_real_data("cifar10_folder")
def test_real_cifar10_jpeg_tarball_subset():
    train_x, train_y, test_x, test_y, classes = load_image_folder(REAL_CIFAR_JPEG, limit_per_class=50)
    assert classes == CIFAR10_CLASSES
    assert train_x.shape == (500, 3, 32, 32) and test_x.shape == (500, 3, 32, 32)
    assert torch.equal(train_y.bincount(), torch.full((10,), 50))
    channel_means = torch.cat([train_x, test_x]).mean(dim=(0, 2, 3))
    torch.testing.assert_close(channel_means, torch.tensor(CIFAR10_MEAN), atol=0.02, rtol=0)


# --- integrity and bounds ----------------------------------------------------------


def _cifar_jpeg_members(rng, per_class=(2, 1)) -> dict:
    members, _ = _image_folder_members(rng, classes=CIFAR10_CLASSES, per_class=per_class, fmt="JPEG")
    return {k: _encode(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "JPEG") for k in members}


def test_cifar_jpeg_tarball_bit_flip_is_corrupt_not_a_changed_image(tmp_path):
    members = _cifar_jpeg_members(np.random.default_rng(40))
    # Level 0: the JPEG bytes are stored verbatim, so the flip changes pixels without any deflate error.
    raw = bytearray(gzip.compress(tar_bytes(members), compresslevel=0, mtime=0))
    target = members["c10/train/dog/0001.jpg"]
    raw[raw.index(target[-200:-150]) + 7] ^= 0x10
    path = tmp_path / "cifar10-jpeg.tar.gz"
    path.write_bytes(bytes(raw))
    with pytest.raises(
        DataFileError, match=r"cifar10-jpeg\.tar\.gz is corrupt \(CRC check failed.*\): download it again"
    ):
        load_cifar10_image_folder(path)


def test_truncated_image_tarball_is_corrupt(tmp_path):
    members = _cifar_jpeg_members(np.random.default_rng(41))
    _write_members(tmp_path / "c.tar.gz", members, as_tar=True)
    path = tmp_path / "c.tar.gz"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataFileError, match=r"c\.tar\.gz is corrupt \(.*\): download it again"):
        load_cifar10_image_folder(path)


def test_cifar_binary_bit_flip_in_the_tarball_is_corrupt(tmp_path):
    members = {}
    rng = np.random.default_rng(42)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        members[f"cifar-10-batches-bin/{name}"] = _cifar_records(rng, 4, 1)[0]
    raw = bytearray(gzip.compress(tar_bytes(members), compresslevel=0, mtime=0))
    raw[raw.index(members["cifar-10-batches-bin/data_batch_3.bin"][500:540]) + 3] ^= 0x01
    path = tmp_path / "cifar-10-binary.tar.gz"
    path.write_bytes(bytes(raw))
    with pytest.raises(
        DataFileError, match=r"cifar-10-binary\.tar\.gz is corrupt \(CRC check failed.*\): download it again"
    ):
        load_cifar_tensors(path, 10)


def test_huge_png_header_is_refused_before_decoding(tmp_path):
    members, _ = _image_folder_members(np.random.default_rng(43))
    members["c10/train/cat/0000.png"] = png_with_header(20_000, 20_000)
    _write_members(tmp_path / "bomb.tar.gz", members, as_tar=True)
    with pytest.raises(
        DataFileError, match=r"bomb\.tar\.gz:c10/train/cat/0000\.png: the image header declares a huge image"
    ):
        load_image_folder(tmp_path / "bomb.tar.gz")
    # Below Pillow's own limit but above driftlab's: refused from the header too.
    members["c10/train/cat/0000.png"] = members["c10/train/cat/0001.png"]
    members["c10/train/airplane/0000.png"] = png_with_header(5_000, 5_000)  # the first image decoded
    _assert_refused(
        tmp_path,
        members,
        load_image_folder,
        r"airplane/0000\.png: image is 5000x5000, more than the 16,777,216 pixels allowed",
    )


def test_cifar_folder_refuses_a_big_image_from_its_header(tmp_path):
    rng = np.random.default_rng(44)
    members = _cifar_jpeg_members(rng)
    members["c10/test/cat/0000.jpg"] = png_with_header(5_000, 5_000)
    _assert_refused(
        tmp_path,
        members,
        load_cifar10_image_folder,
        r"c10/test/cat/0000\.jpg: image is 5000x5000 but the data set's images are 32x32",
    )


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_images_name_the_file(tmp_path, damage):
    rng = np.random.default_rng(45)
    members = _cifar_jpeg_members(rng)
    good = members["c10/train/frog/0001.jpg"]
    members["c10/train/frog/0001.jpg"] = {
        "truncated": good[: len(good) // 2],
        "garbage": good[:20] + bytes(200),
        "empty": b"",
    }[damage]
    _write_members(tmp_path / "c.tar.gz", members, as_tar=True)
    with pytest.raises(
        DataFileError,
        match=r"c\.tar\.gz:c10/train/frog/0001\.jpg: cannot decode the image .*download the data set again",
    ):
        load_cifar10_image_folder(tmp_path / "c.tar.gz")


def test_cifar_folder_limits_bound_each_image_file(tmp_path):
    rng = np.random.default_rng(46)
    members = _cifar_jpeg_members(rng)
    members["c10/train/ship/0000.jpg"] += bytes(2 << 20)  # a JPEG followed by 2 MiB
    _write_members(tmp_path / "c.tar.gz", members, as_tar=True)
    with pytest.raises(
        DataFileError, match=r"member c10/train/ship/0000\.jpg is [\d,]+ bytes, more than the 1,048,576 allowed"
    ):
        load_cifar10_image_folder(tmp_path / "c.tar.gz")
    _assert_refused(
        tmp_path,
        members,
        load_cifar10_image_folder,
        r"ship/0000\.jpg is [\d,]+ bytes, more than the 1,048,576 allowed for an image",
    )


def test_emnist_zip_with_a_bad_member_crc_is_corrupt(tmp_path):
    arrays = _emnist_arrays(np.random.default_rng(47), "letters")
    _write_emnist_zip(tmp_path / "gzip.zip", {k: v for k, v in arrays.items()})
    raw = bytearray((tmp_path / "gzip.zip").read_bytes())
    # Stored (not deflated) members: flip a byte inside the first member's data.
    with zipfile.ZipFile(tmp_path / "gzip.zip") as bundle:
        info = bundle.infolist()[0]
    raw[info.header_offset + 30 + len(info.filename) + 40] ^= 0x01
    (tmp_path / "gzip.zip").write_bytes(bytes(raw))
    with pytest.raises(DataFileError, match=r"gzip\.zip is corrupt \(.*\): download it again"):
        load_emnist_tensors(tmp_path, "letters")


def test_emnist_header_beyond_the_official_count_is_refused_before_reading(tmp_path):
    arrays = _emnist_arrays(np.random.default_rng(48), "letters")
    name = "emnist-letters-test-labels-idx1-ubyte.gz"
    # Only the header: declares 10 million labels, more than the 20,800 of the official test split.
    header = bytes([0, 0, 8, 1]) + struct.pack(">I", 10_000_000)
    with zipfile.ZipFile(tmp_path / "gzip.zip", "w") as bundle:
        for member, array in arrays.items():
            bundle.writestr(f"gzip/{member}", gzip.compress(header if member == name else _idx(array)))
    with pytest.raises(
        DataFileError,
        match=r"test-labels-idx1-ubyte\.gz: the IDX header declares 10,000,000 labels but the official EMNIST letters test split has 20,800",
    ):
        load_emnist_tensors(tmp_path, "letters")


@pytest.mark.slow
@needs_real_data("cifar10_folder")
def test_real_cifar10_jpeg_tarball_one_bit_flip_is_refused(tmp_path):
    raw = bytearray(REAL_CIFAR_JPEG.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path = tmp_path / "cifar10-jpeg.tar.gz"
    path.write_bytes(bytes(raw))
    with pytest.raises(DataFileError, match=r"cifar10-jpeg\.tar\.gz is corrupt \(.*\): download it again"):
        load_cifar10_image_folder(path, limit_per_class=1)


# --- augmentation -----------------------------------------------------------------


def random_flip_crop(
    images: torch.Tensor,
    generator: torch.Generator,
    padding: int = 4,
    crop_probability: float = 0.5,
) -> torch.Tensor:
    """CIFAR training augmentation of the FedDyn authors' code, batched, with the draws from a generator: the
    reference these tests hold ``flip_then_shift`` (what the backends apply) to.

    For every image independently: a horizontal flip with probability 1/2;
    then, with probability ``crop_probability``, zero-padding by ``padding``
    pixels on each side and a random crop back to the original size (both
    offsets uniform in ``0..2*padding``). The FedDyn code
    (``utils_dataset.Dataset.__getitem__``) crops with probability 1/2 and
    pads the *normalised* image with zeros, which is what this does when
    given normalised images; ``crop_probability=1`` is torchvision's
    ``RandomCrop(32, padding=4)`` after ``RandomHorizontalFlip``.

    The random draws come from ``generator`` only (three draws of fixed size
    per call), so the result is a function of the images and the generator's
    state. No Python loop over images.

    Args:
        images: ``[n, c, h, w]`` float tensor.
        generator: a CPU ``torch.Generator``.
        padding: pixels of zero padding on each side before cropping.
        crop_probability: probability of the pad-and-crop step.

    Returns:
        A new ``[n, c, h, w]`` tensor; ``images`` is not modified.
    """
    check_images(images, padding)
    n, c, h, w = images.shape
    device = images.device
    flip = (torch.rand(n, generator=generator) < 0.5).to(device)
    crop = torch.rand(n, generator=generator) < crop_probability
    offsets = torch.randint(0, 2 * padding + 1, (n, 2), generator=generator)
    offsets = torch.where(crop[:, None], offsets, torch.full_like(offsets, padding)).to(device)
    return flip_then_shift(images, flip, offsets, padding)


def _reference_flip_crop(images, flip, crop, offsets, padding=4):
    """Per-image loop as in FedDyn's Dataset.__getitem__, driven by given draws."""
    out = []
    for img, f, c, (dy, dx) in zip(images, flip, crop, offsets, strict=True):
        if f:
            img = img.flip(-1)
        if c:
            padded = torch.zeros(img.shape[0], img.shape[1] + 2 * padding, img.shape[2] + 2 * padding)
            padded[:, padding:-padding, padding:-padding] = img
            img = padded[:, dy : dy + img.shape[1], dx : dx + img.shape[2]]
        out.append(img)
    return torch.stack(out)


def test_random_flip_crop_matches_a_per_image_reference():
    images = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    result = random_flip_crop(images, torch.Generator().manual_seed(5))
    draws = torch.Generator().manual_seed(5)  # replay the draws in the documented order
    flip = torch.rand(64, generator=draws) < 0.5
    crop = torch.rand(64, generator=draws) < 0.5
    offsets = torch.randint(0, 9, (64, 2), generator=draws)
    torch.testing.assert_close(result, _reference_flip_crop(images, flip, crop, offsets.tolist()))
    assert 10 < int(flip.sum()) < 54 and 10 < int(crop.sum()) < 54


def test_random_flip_crop_is_deterministic_and_leaves_input_alone():
    images = torch.randn(16, 3, 32, 32)
    before = images.clone()
    a = random_flip_crop(images, torch.Generator().manual_seed(1), crop_probability=1.0)
    b = random_flip_crop(images, torch.Generator().manual_seed(1), crop_probability=1.0)
    c = random_flip_crop(images, torch.Generator().manual_seed(2), crop_probability=1.0)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(images, before) and a.shape == images.shape


def test_random_flip_crop_zero_padding_reaches_the_border():
    images = torch.ones(200, 1, 8, 8)
    out = random_flip_crop(images, torch.Generator().manual_seed(3), crop_probability=1.0)
    zeros_per_image = (out == 0).flatten(1).sum(1)
    # An offset of 4 in both directions is the identity; others expose zero padding.
    assert (zeros_per_image > 0).float().mean() > 0.8
    assert torch.all((out == 0) | (out == 1))


# --- flip_crop_from_keys: the draws are bits of per-example keys ---------------


def _key(flip: int = 0, crop_bits: int = 0, row_bits: int = 0, col_bits: int = 0) -> int:
    """The int64 with the documented layout: bit 0 flip, bits 8-31 crop draw, 32-47 row, 48-63 column."""
    value = flip | crop_bits << 8 | row_bits << 32 | col_bits << 48
    return value - (1 << 64) if value >= 1 << 63 else value


def _keys(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


NO_CROP = 0xFFFFFF  # the largest crop draw: no crop for any crop_probability < 1


def test_flip_crop_from_keys_by_hand():
    image = torch.arange(1.0, 13.0).view(1, 1, 3, 4)  # rows [1 2 3 4], [5 6 7 8], [9 10 11 12]
    # Flip bit only (crop draw too large): a horizontal flip.
    flipped = flip_crop_from_keys(image, _keys(_key(flip=1, crop_bits=NO_CROP)), padding=1)
    assert flipped[0, 0].tolist() == [[4, 3, 2, 1], [8, 7, 6, 5], [12, 11, 10, 9]]
    # No bit set: crop draw 0 < threshold, offsets (0, 0): content moves down-right by the padding, zeros fill in.
    shifted = flip_crop_from_keys(image, _keys(0), padding=1)
    assert shifted[0, 0].tolist() == [[0, 0, 0, 0], [0, 1, 2, 3], [0, 5, 6, 7]]
    # Largest row and column bits: offsets (2p, 2p), content moves up-left; with the flip, flipped first.
    up_left = flip_crop_from_keys(
        image.expand(2, 1, 3, 4),
        _keys(_key(row_bits=0xFFFF, col_bits=0xFFFF), _key(flip=1, row_bits=0xFFFF, col_bits=0xFFFF)),
        padding=1,
    )
    assert up_left[0, 0].tolist() == [[6, 7, 8, 0], [10, 11, 12, 0], [0, 0, 0, 0]]
    assert up_left[1, 0].tolist() == [[7, 6, 5, 0], [11, 10, 9, 0], [0, 0, 0, 0]]
    # Row offset from bits 32-47 (⌊v·3/2^16⌋: 0x5555 → 0, 0x5556 → 1, 0xAAAB → 2), column offset p (v = 0x8000): a vertical shift.
    rows = flip_crop_from_keys(
        image.expand(3, 1, 3, 4),
        _keys(*(_key(row_bits=v, col_bits=0x8000) for v in (0x5555, 0x5556, 0xAAAB))),
        padding=1,
    )
    assert rows[0, 0].tolist() == [[0, 0, 0, 0], [1, 2, 3, 4], [5, 6, 7, 8]]
    assert torch.equal(rows[1], image[0])
    assert rows[2, 0].tolist() == [[5, 6, 7, 8], [9, 10, 11, 12], [0, 0, 0, 0]]
    # crop_probability 0: never a crop, whatever the bits; 1: always one.
    keys = _keys(0, _key(row_bits=0xFFFF), _key(flip=1, col_bits=0x1234))
    never = flip_crop_from_keys(image.expand(3, 1, 3, 4), keys, padding=1, crop_probability=0.0)
    assert (
        torch.equal(never[0], image[0]) and torch.equal(never[1], image[0]) and torch.equal(never[2], image[0].flip(-1))
    )
    always = flip_crop_from_keys(image, _keys(_key(crop_bits=NO_CROP)), padding=1, crop_probability=1.0)
    assert always[0, 0].tolist() == [[0, 0, 0, 0], [0, 1, 2, 3], [0, 5, 6, 7]]
    # The crop threshold is round(p · 2^24): for p = 1/2 draws below 2^23 crop, the rest do not.
    half = flip_crop_from_keys(
        image.expand(2, 1, 3, 4), _keys(_key(crop_bits=0x7FFFFF), _key(crop_bits=0x800000)), padding=1
    )
    assert half[0, 0].tolist() == [[0, 0, 0, 0], [0, 1, 2, 3], [0, 5, 6, 7]] and torch.equal(half[1], image[0])


def test_flip_crop_from_keys_matches_the_per_image_reference():
    """On 32x32 images with padding 4: the decoded bits drive the FedDyn per-image loop to the same result."""
    images = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    keys = torch.randint(-(2**63), 2**63 - 1, (64,), dtype=torch.int64, generator=torch.Generator().manual_seed(4))
    unsigned = [k & ((1 << 64) - 1) for k in keys.tolist()]
    flip = [u & 1 for u in unsigned]
    crop = [(u >> 8) & 0xFFFFFF < 2**23 for u in unsigned]
    offsets = [(((u >> 32) & 0xFFFF) * 9 >> 16, ((u >> 48) & 0xFFFF) * 9 >> 16) for u in unsigned]
    result = flip_crop_from_keys(images, keys)
    torch.testing.assert_close(result, _reference_flip_crop(images, flip, crop, offsets), rtol=0, atol=0)
    assert 10 < sum(flip) < 54 and 10 < sum(crop) < 54 and {o for pair in offsets for o in pair} <= set(range(9))


def test_flip_crop_from_keys_is_per_example_and_deterministic():
    images = torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    before = images.clone()
    keys = torch.randint(-(2**63), 2**63 - 1, (32,), dtype=torch.int64, generator=torch.Generator().manual_seed(2))
    out = flip_crop_from_keys(images, keys, padding=2)
    assert out.shape == images.shape and out.dtype == images.dtype and torch.equal(images, before)
    assert torch.equal(out, flip_crop_from_keys(images, keys.clone(), padding=2))  # same keys, same output
    # An example's output depends on its own image and key only, not on the rest of the call.
    order = torch.randperm(32, generator=torch.Generator().manual_seed(3))
    assert torch.equal(flip_crop_from_keys(images[order], keys[order], padding=2), out[order])
    assert torch.equal(flip_crop_from_keys(images[5:9], keys[5:9], padding=2), out[5:9])
    assert not torch.equal(flip_crop_from_keys(images, keys + 1, padding=2), out)  # keys + 1 toggles every flip bit
    # Zero padding: a crop moves at most 2 rows/columns in, so the centre 4x4 of a shifted image keeps values, border zeros appear.
    ones = flip_crop_from_keys(
        torch.ones(200, 1, 8, 8),
        torch.arange(200, dtype=torch.int64) * 0x9E3779B97F4A7C1,
        padding=2,
        crop_probability=1.0,
    )
    assert torch.all((ones == 0) | (ones == 1)) and torch.all(ones[:, :, 2:6, 2:6] == 1)


def test_flip_crop_from_keys_rejects_bad_arguments():
    images = torch.zeros(2, 1, 4, 4)
    with pytest.raises(ValueError, match="int64"):
        flip_crop_from_keys(images, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="shape"):
        flip_crop_from_keys(images, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="crop_probability"):
        flip_crop_from_keys(images, torch.zeros(2, dtype=torch.int64), crop_probability=1.5)
    with pytest.raises(ValueError, match="images"):
        flip_crop_from_keys(torch.zeros(1, 4, 4), torch.zeros(1, dtype=torch.int64))
