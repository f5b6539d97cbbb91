"""PFLlib's pooled CIFAR-100, read from tiny archives in the distributed format (a tar.xz of ``cifar100_60k.npz``), and
from the real one where the library finds it."""

import io
import lzma
from pathlib import Path

import numpy as np
import pytest

from driftlab.data.archive_test import tar_bytes
from driftlab.data.cifar100_pfllib import load_cifar100_pfllib
from driftlab.data.federated import DataFileError
from driftlab.data.images import CIFAR100_MEAN
from driftlab.experiments.run.real_data import needs_real_data, real_data_path

# image -> (fine label, client, split), by hand: client 1's rows come before client 0's in the file
ROWS = [(7, 1, 0), (3, 0, 0), (99, 1, 1), (0, 0, 0), (5, 1, 0), (42, 0, 1)]


def pfllib_arrays(rows=ROWS, seed: int = 0) -> dict[str, np.ndarray]:
    labels, clients, splits = (np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))
    x = np.random.default_rng(seed).integers(0, 256, (len(rows), 32, 32, 3), dtype=np.uint8)
    return {"x": x, "y": labels, "client": clients, "split": splits.astype(np.uint8)}


def write_cifar100_pfllib(path: Path, arrays: dict[str, np.ndarray] | None = None) -> Path:
    """``path`` (a ``.tar.xz``) holding ``cifar100-pfllib/cifar100_60k.npz`` as the shared copy lays it out."""
    buffer = io.BytesIO()
    np.savez(buffer, **(pfllib_arrays() if arrays is None else arrays))
    members = {
        "cifar100-pfllib/cifar100_60k.npz": buffer.getvalue(),
        "cifar100-pfllib/fine_label_names.txt": b"apple\naquarium_fish\n",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(tar_bytes(members)))
    return path


def test_clients_keep_their_train_and_test_rows_in_file_order(tmp_path):
    arrays = pfllib_arrays()
    data = load_cifar100_pfllib(write_cifar100_pfllib(tmp_path / "cifar100-pfllib.tar.xz", arrays))
    # by hand from ROWS: train rows grouped by client, client 0's (file rows 1, 3) then client 1's (0, 4)
    assert data.train_targets.tolist() == [3, 0, 7, 5] and data.test_targets.tolist() == [42, 99]
    assert [c.tolist() for c in data.client_indices] == [[0, 1], [2, 3]]
    assert [c.tolist() for c in data.client_test_indices] == [[0], [1]]
    np.testing.assert_array_equal(data.train_inputs[2].numpy(), arrays["x"][0].transpose(2, 0, 1))
    np.testing.assert_array_equal(data.test_inputs[0].numpy(), arrays["x"][5].transpose(2, 0, 1))
    assert data.num_classes == 100 and data.input_normalisation.mean == CIFAR100_MEAN


@pytest.mark.parametrize("layout", ["directory_with_archive", "extracted_folder", "npz"])
def test_every_layout_reads_the_same(tmp_path, layout):
    arrays = pfllib_arrays(seed=1)
    if layout == "directory_with_archive":
        write_cifar100_pfllib(tmp_path / "cifar100-pfllib.tar.xz", arrays)
        path = tmp_path
    else:
        folder = tmp_path / "cifar100-pfllib"
        folder.mkdir()
        np.savez(folder / "cifar100_60k.npz", **arrays)
        path = tmp_path if layout == "extracted_folder" else folder / "cifar100_60k.npz"
    assert load_cifar100_pfllib(path).train_targets.tolist() == [3, 0, 7, 5]


def test_wrong_arrays_are_named(tmp_path):
    arrays = pfllib_arrays()
    del arrays["split"]
    with pytest.raises(DataFileError, match="lacks the array.*split"):
        load_cifar100_pfllib(write_cifar100_pfllib(tmp_path / "a.tar.xz", arrays))
    arrays = pfllib_arrays()
    arrays["y"][0] = 100
    with pytest.raises(DataFileError, match=r"y must lie in 0\.\.99"):
        load_cifar100_pfllib(write_cifar100_pfllib(tmp_path / "b.tar.xz", arrays))
    arrays = pfllib_arrays(rows=[(1, 0, 0), (2, 2, 0)])
    with pytest.raises(DataFileError, match="client 1 has no training row"):
        load_cifar100_pfllib(write_cifar100_pfllib(tmp_path / "c.tar.xz", arrays))
    with pytest.raises(DataFileError, match="not found"):
        load_cifar100_pfllib(tmp_path / "nowhere")


@pytest.mark.slow
@needs_real_data("cifar100_pfllib")
def test_the_shared_copy_has_pfllibs_split():
    data = load_cifar100_pfllib(real_data_path("cifar100_pfllib"))
    assert (len(data.train_targets), len(data.test_targets), data.num_clients) == (44_962, 15_038, 100)
    assert np.bincount(np.concatenate([data.train_targets.numpy(), data.test_targets.numpy()])).tolist() == [600] * 100
    means = data.train_inputs.float().mean(dim=(0, 2, 3)) / 255
    np.testing.assert_allclose(means.numpy(), CIFAR100_MEAN, atol=0.01)
