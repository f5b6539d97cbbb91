"""The wiring of issue 6: every data set, partition and model key reachable from the config.

The loaders and partitions have their own unit tests (``driftlab/data/*_test.py``);
here they are reached the way a user reaches them, through ``[data]`` and
``[model]`` keys, ``build_dataset``/``build_simulation`` and one round of
``driftlab.run`` on both training backends. File-based data sets are written
here, tiny, in their official formats (IDX, the EMNIST gzip bundle, CIFAR
binary records, an image folder tarball, LEAF JSON shards, raw Shakespeare
text) and passed with ``data.root``; tests on the real files find them as a
run without ``data.root`` does (``$DRIFTLAB_DATA``, else ``./shared/data`` and
``../shared/data``: ``driftlab.experiments.run.real_data``) and skip when they are
absent. Nothing uses the network.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import struct
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import driftlab
from driftlab.data.cifar100_pfllib_test import pfllib_arrays, write_cifar100_pfllib
from driftlab.data.federated import DataFileError
from driftlab.experiments.config import PARTITIONS, load_config
from driftlab.experiments.run import datasets as datasets_module
from driftlab.experiments.run.assembly import build_simulation
from driftlab.experiments.run.datasets import DATA_SETS, build_dataset, default_data_root
from driftlab.experiments.run.real_data import needs_real_data, real_data_path
from driftlab.simulation.evaluation import evaluate

REPO_ROOT = Path(driftlab.__file__).resolve().parents[1]

BACKENDS = ("sequential", "vectorized")
ONE_ROUND = ["rounds=1", "client.steps=1", "client.batch_size=4", "sampling.participation=0.5", "evaluation.every=1"]
# torch's vmap has no batching rule for the CPU LSTM kernel; the vectorized backend still runs it (slower)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

RECORD_KEYS = {"round", "num_selected", "num_reporting", "test_loss", "train_loss", "test_accuracy", "round_seconds"}


# =========================================================================== official formats, tiny


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file (big-endian header, uint8 data) holding ``array``."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    return struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_mnist(
    root: Path, n_train: int = 80, n_test: int = 20, *, gzipped: bool = True, bright: bool = False, seed: int = 0
) -> Path:
    """MNIST's (or Fashion-MNIST's) four IDX files; labels cycle 0..9.

    ``bright`` draws pixels from 100..255, so the mean pixel passes the
    Fashion-MNIST check (MNIST's digits are dark, mean 0.13).
    """
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        low = 100 if bright else 0
        images = rng.integers(low, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            name = f"{prefix}-{kind}-ubyte"
            raw = idx_bytes(array)
            if gzipped:
                (root / f"{name}.gz").write_bytes(gzip.compress(raw))
            else:
                (root / name).write_bytes(raw)
    return root


def write_emnist(root: Path, n_train: int = 62, n_test: int = 20, *, as_zip: bool = False) -> Path:
    """The EMNIST letters and byclass IDX files of the official gzip bundle (loose, or inside gzip.zip)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    files = {}
    for split, first, count in (("letters", 1, 26), ("byclass", 0, 62)):
        for part, n in (("train", n_train), ("test", n_test)):
            images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
            labels = (first + np.arange(n) % count).astype(np.uint8)  # every class in the train split
            files[f"emnist-{split}-{part}-images-idx3-ubyte.gz"] = gzip.compress(idx_bytes(images))
            files[f"emnist-{split}-{part}-labels-idx1-ubyte.gz"] = gzip.compress(idx_bytes(labels))
    if as_zip:
        with zipfile.ZipFile(root / "gzip.zip", "w") as bundle:
            for name, raw in files.items():
                bundle.writestr(f"gzip/{name}", raw)
    else:
        for name, raw in files.items():
            (root / name).write_bytes(raw)
    return root


def cifar_records(n: int, label_bytes: int, num_classes: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    fine = (np.arange(n) % num_classes).astype(np.uint8)
    labels = [fine // 5, fine] if label_bytes == 2 else [fine]  # CIFAR-100: coarse byte, then fine byte
    pixels = rng.integers(0, 256, size=(n, 3 * 32 * 32), dtype=np.uint8)
    return np.concatenate([np.stack(labels, axis=1), pixels], axis=1).tobytes()


def write_cifar10(root: Path, per_batch: int = 12, *, tarball: bool = False) -> Path:
    """CIFAR-10's binary version: ``cifar-10-batches-bin/data_batch_{1..5}.bin, test_batch.bin`` (or its tarball)."""
    root.mkdir(parents=True, exist_ok=True)
    members = {f"cifar-10-batches-bin/data_batch_{i}.bin": cifar_records(per_batch, 1, 10, i) for i in range(1, 6)}
    members["cifar-10-batches-bin/test_batch.bin"] = cifar_records(per_batch, 1, 10, 9)
    if tarball:
        _write_tar(root / "cifar-10-binary.tar.gz", members)
    else:
        for name, raw in members.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(raw)
    return root


def write_cifar100(root: Path, n_train: int = 200, n_test: int = 100) -> Path:
    """CIFAR-100's binary version: ``cifar-100-binary/train.bin, test.bin`` (coarse and fine label bytes)."""
    folder = root / "cifar-100-binary"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.bin").write_bytes(cifar_records(n_train, 2, 100, 0))
    (folder / "test.bin").write_bytes(cifar_records(n_test, 2, 100, 1))
    return root


def _write_tar(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, raw in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def write_image_folder(path: Path, per_class: int = 3) -> Path:
    """A CIFAR-10 style image folder ``c10/<split>/<class>/<n>.png`` as a .tar.gz (10 classes, 32x32 RGB)."""
    from PIL import Image

    classes = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    rng = np.random.default_rng(2)
    members = {}
    for split in ("train", "test"):
        for cls in classes:
            for i in range(per_class if split == "train" else 1):
                buffer = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8), "RGB").save(
                    buffer, format="PNG"
                )
                members[f"c10/{split}/{cls}/{i}.png"] = buffer.getvalue()
    return _write_tar(path, members)


LINES = (
    "Before we proceed any further, hear me speak. You are all resolved rather to die than to famish? "
    "Resolved, resolved. First, you know Caius Marcius is chief enemy to the people. We know't, we know't. "
    "Let us kill him, and we'll have corn at our own price. Is't a verdict? No more talking on't; let it be done."
)


def leaf_shard(users: dict[str, tuple[list, list]]) -> dict:
    return {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }


def _leaf_samples(kind: str, n: int, user: int, rng: np.random.Generator) -> tuple[list, list]:
    if kind == "femnist":
        return [rng.random(784).round(3).tolist() for _ in range(n)], [int((user * 7 + i) % 62) for i in range(n)]
    if kind == "shakespeare":
        starts = rng.integers(0, len(LINES) - 81, size=n)
        return [LINES[s : s + 80] for s in starts], [LINES[s + 80] for s in starts]
    words = LINES.split()
    tweets = [" ".join(rng.choice(words, size=int(rng.integers(3, 30)))) for _ in range(n)]
    return [[str(i), "Mon Apr 06", "NO_QUERY", f"user{user}", t] for i, t in enumerate(tweets)], [
        int(i % 2) for i in range(n)
    ]


def write_leaf(root: Path, kind: str, num_users: int = 5, *, tarball: bool = False) -> Path:
    """LEAF JSON shards ``data/train/*.json`` and ``data/test/*.json`` for femnist, shakespeare or sent140.

    Users get 6 + 2u train samples and 2 test samples; they are spread over
    two train shards. ``tarball`` packs the tree as ``<kind>.tar.gz``.
    """
    rng = np.random.default_rng(3)
    train = {f"u{u:03d}": _leaf_samples(kind, 6 + 2 * u, u, rng) for u in range(num_users)}
    test = {f"u{u:03d}": _leaf_samples(kind, 2, u, rng) for u in range(num_users)}
    half = num_users // 2
    names = list(train)
    members = {
        "data/train/all_data_0_train.json": leaf_shard({u: train[u] for u in names[:half]}),
        "data/train/all_data_1_train.json": leaf_shard({u: train[u] for u in names[half:]}),
        "data/test/all_data_0_test.json": leaf_shard(test),
    }
    encoded = {name: json.dumps(content).encode() for name, content in members.items()}
    if tarball:
        return _write_tar(root / f"{kind}.tar.gz", encoded)
    for name, raw in encoded.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(raw)
    return root


def write_shakespeare(path: Path, roles: int = 4, *, gzipped: bool = False) -> Path:
    """Raw tiny-shakespeare text: ``NAME:`` line, speech, blank line; every role has several hundred characters."""
    words = LINES.split()
    blocks = []
    for speech in range(3):
        for role in range(roles):
            text = " ".join(words[(role * 5 + speech * 11 + i) % len(words)] for i in range(25 + 6 * role))
            blocks.append(f"Citizen {chr(65 + role)}:\n{text[: len(text) // 2]}\n{text[len(text) // 2 :]}")
    raw = ("\n\n".join(blocks) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw) if gzipped else raw)
    return path


# =========================================================================== every data set from the config

GENERATED = {
    "synthetic": (["data.num_clients=4", "data.synthetic_alpha=0.5", "data.synthetic_beta=0.5"], "test_accuracy"),
    "synthetic_iid": (["data.num_clients=4"], "test_accuracy"),
    "feddyn_synthetic/0": (["data.num_clients=4", "data.feddyn_kind=0"], "test_accuracy"),
    "feddyn_synthetic/1": (["data.num_clients=4", "data.feddyn_kind=1"], "test_accuracy"),
    "feddyn_synthetic/2": (["data.num_clients=4", "data.feddyn_kind=2"], "test_accuracy"),
    "feddyn_synthetic/3": (
        ["data.num_clients=4", "data.feddyn_kind=3", "data.feddyn_heterogeneity=0.5"],
        "test_accuracy",
    ),
    "quadratic1d": (["data.num_clients=4", "model.name=quadratic"], "distance_to_minimizer"),
    "quadratic": (
        ["data.num_clients=4", "data.quadratic_dimension=3", "model.name=quadratic"],
        "distance_to_minimizer",
    ),
    "custom": (["data.loader=driftlab.experiments.run.datasets_test:four_clients"], "test_accuracy"),
}


def four_clients():
    """A data loader (``data.loader``) of the kind a user writes: 4 clients of 6 examples, 3 classes."""
    from driftlab.data.federated import FederatedArrays

    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 5)).astype(np.float32)
    y = np.arange(24) % 3
    return FederatedArrays(x, y, np.arange(24) // 6, x[:6], y[:6])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(GENERATED))
def test_generated_data_sets_run_one_round(case, backend):
    overrides, metric = GENERATED[case]
    name = case.split("/")[0]
    result = driftlab.run(None, overrides=[*ONE_ROUND, f"data.name={name}", f"backend={backend}", *overrides])
    (record,) = result.records
    assert record["round"] == 1 and record["num_reporting"] == 2
    assert metric in record and math.isfinite(record[metric])
    assert math.isfinite(record["test_loss"]) and math.isfinite(record["train_loss"])
    if metric == "test_accuracy":
        assert RECORD_KEYS <= record.keys()
        assert 0.0 <= record["test_accuracy"] <= 1.0
    if case.startswith("feddyn_synthetic"):
        sim, _ = build_simulation(result.config)
        kind = int(case.split("/")[1])
        assert sim.data.name == ("feddyn_synthetic_homogeneous" if kind == 0 else f"feddyn_synthetic_type{kind}")
        assert sim.data.input_shape == (30,) and sim.data.num_classes == 5 and sim.data.num_clients == 4


def _mnist_root(tmp: Path) -> Path:
    return write_mnist(tmp / "mnist")


def _fashion_root(tmp: Path) -> Path:
    return write_mnist(tmp / "fashion", gzipped=False, bright=True)


def _emnist_root(tmp: Path) -> Path:
    return write_emnist(tmp / "emnist")


def _emnist_zip(tmp: Path) -> Path:
    return write_emnist(tmp / "emnist-zip", as_zip=True)


def _leaf(folder: str, kind: str, *, tarball: bool = False) -> Callable[[Path], Path]:
    """The writer of a LEAF data set of ``kind`` in ``folder`` of a test's directory (as a tarball: ``tarball``)."""
    return lambda tmp: write_leaf(tmp / folder, kind, tarball=tarball)


SMALL_RNN = "model.rnn_hidden=8"  # the recurrent models' hidden size in these one-round runs


# case "name" or "name/variant" of data set name: (writer -> data.root, model, extra overrides, (input shape, classes))
FILE_BASED = {
    "mnist": (_mnist_root, "mlr", [], ((1, 28, 28), 10)),
    "fashion_mnist": (_fashion_root, "mlp", ["model.hidden=[8]"], ((1, 28, 28), 10)),
    "emnist_letters10": (_emnist_root, "mlp", ["model.hidden=[8, 4]"], ((1, 28, 28), 10)),
    "emnist_letters": (_emnist_zip, "femnist_cnn", [], ((1, 28, 28), 26)),
    "emnist_byclass": (_emnist_root, "mlr", [], ((1, 28, 28), 62)),
    "cifar10": (lambda tmp: write_cifar10(tmp / "cifar10", tarball=True), "cnn", [], ((3, 32, 32), 10)),
    "cifar10/folder": (
        lambda tmp: write_cifar10(tmp / "cifar10") / "cifar-10-batches-bin",
        "mlr",
        [],
        ((3, 32, 32), 10),
    ),
    "cifar100": (lambda tmp: write_cifar100(tmp / "cifar100"), "cnn", [], ((3, 32, 32), 100)),
    "cifar10_folder": (
        lambda tmp: write_image_folder(tmp / "c10.tar.gz"),
        "cnn",
        ["data.limit_per_class=2"],
        ((3, 32, 32), 10),
    ),
    "cifar100_pfllib": (
        lambda tmp: write_cifar100_pfllib(
            tmp / "cifar100-pfllib.tar.xz", pfllib_arrays([(i % 100, i % 4, int(i % 5 == 0)) for i in range(40)])
        ),
        "cnn",
        [],
        ((3, 32, 32), 100),
    ),
    "femnist": (_leaf("femnist", "femnist", tarball=True), "femnist_cnn", [], ((1, 28, 28), 62)),
    "femnist/mlr": (_leaf("femnist", "femnist"), "mlr", ["data.max_clients=3"], ((1, 28, 28), 62)),
    "shakespeare_leaf": (_leaf("shk", "shakespeare"), "lstm", [SMALL_RNN], ((80,), 80)),
    "shakespeare_leaf/gru": (
        _leaf("shk", "shakespeare", tarball=True),
        "gru",
        [SMALL_RNN, "model.rnn_layers=1"],
        ((80,), 80),
    ),
    "sent140": (_leaf("s140", "sent140"), "lstm", [SMALL_RNN, "data.vocabulary_size=50"], ((25,), 2)),
    "sent140/gru": (_leaf("s140", "sent140", tarball=True), "gru", [SMALL_RNN, "data.vocabulary_size=30"], ((25,), 2)),
    "shakespeare": (lambda tmp: write_shakespeare(tmp / "input.txt"), "lstm", [SMALL_RNN], ((80,), 80)),
    "shakespeare/gz": (
        lambda tmp: write_shakespeare(tmp / "input.txt.gz", gzipped=True),
        "gru",
        [SMALL_RNN, "data.max_clients=2", "data.samples_per_client=100"],
        ((80,), 80),
    ),
}


def test_every_data_set_has_a_test_through_the_config():
    """A name added to DATA_SETS without a case here fails this test."""
    covered = (
        {case.split("/")[0] for case in GENERATED} | {case.split("/")[0] for case in FILE_BASED} | {"stackoverflow"}
    )
    assert covered == set(DATA_SETS)
    generated = {name for name, info in DATA_SETS.items() if info.location is None}
    assert generated == {case.split("/")[0] for case in GENERATED}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(FILE_BASED))
def test_file_based_data_sets_run_one_round(tmp_path, case, backend):
    name, (write, model, extra, (shape, classes)) = case.split("/")[0], FILE_BASED[case]
    root = write(tmp_path)
    overrides = [
        *ONE_ROUND,
        f"data.name={name}",
        f"data.root={root}",
        f"model.name={model}",
        f"backend={backend}",
        "data.num_clients=4",
        *extra,
    ]
    result = driftlab.run(None, overrides=overrides)
    (record,) = result.records
    assert RECORD_KEYS <= record.keys(), sorted(record)
    assert 0.0 <= record["test_accuracy"] <= 1.0
    assert math.isfinite(record["test_loss"]) and math.isfinite(record["train_loss"])
    sim, _ = build_simulation(result.config)
    assert sim.data.input_shape == shape and sim.data.num_classes == classes
    assert result.num_parameters == sim.model.num_parameters
    if DATA_SETS[name].natural_clients:
        assert sim.data.client_test_indices is not None and "client_test_accuracy_mean" in record
        assert 0.0 <= record["client_test_accuracy_mean"] <= 1.0
    else:
        assert sim.data.num_clients == 4


def test_file_based_loaders_read_what_was_written(tmp_path):
    """Spot checks that the tiny files are read as meant (so the runs above exercise real content)."""
    mnist = build_dataset(
        load_config(None, [f"data.root={_mnist_root(tmp_path)}", "data.name=mnist", "data.num_clients=4"]).data, 0
    )
    assert len(mnist.train_targets) == 80 and len(mnist.test_targets) == 20
    letters10 = build_dataset(
        load_config(
            None, ["data.name=emnist_letters10", f"data.root={_emnist_root(tmp_path)}", "data.num_clients=2"]
        ).data,
        0,
    )
    assert (
        int(letters10.train_targets.max()) == 9 and len(letters10.train_targets) == 30
    )  # 62 rows cycling over 26 letters
    femnist = build_dataset(
        load_config(
            None, ["data.name=femnist", f"data.root={write_leaf(tmp_path / 'f', 'femnist')}", "data.max_clients=3"]
        ).data,
        0,
    )
    assert femnist.num_clients == 3 and femnist.client_sizes.tolist() == [6, 8, 10]
    folder = build_dataset(
        load_config(
            None,
            [
                "data.name=cifar10_folder",
                f"data.root={write_image_folder(tmp_path / 'c.tar.gz', per_class=3)}",
                "data.limit_per_class=2",
                "data.num_clients=4",
            ],
        ).data,
        0,
    )
    assert len(folder.train_targets) == 20 and len(folder.test_targets) == 10


# --------------------------------------------------------------------------- the real files


REAL = {
    "mnist": ("mlr", ["data.partition=dirichlet", "data.num_clients=10", "sampling.participation=0.2"]),
    "cifar10_folder": ("cnn", ["data.limit_per_class=3", "data.num_clients=4"]),
    "femnist": ("femnist_cnn", ["data.max_clients=4"]),
    "shakespeare": ("lstm", ["data.max_clients=4", "data.samples_per_client=200", "model.rnn_hidden=16"]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", [pytest.param(name, marks=needs_real_data(name)) for name in REAL])
def test_real_files_run_one_round(name, backend):
    """The real files where a run without data.root finds them ($DRIFTLAB_DATA, else the shared folders)."""
    model, extra = REAL[name]
    result = driftlab.run(
        None, overrides=[*ONE_ROUND, f"data.name={name}", f"model.name={model}", f"backend={backend}", *extra]
    )
    (record,) = result.records
    assert RECORD_KEYS <= record.keys()
    assert 0.0 <= record["test_accuracy"] <= 1.0
    if DATA_SETS[name].natural_clients:
        assert 0.0 <= record["client_test_accuracy_mean"] <= 1.0
    assert datasets_module.data_location(result.config.data) == real_data_path(name)


@needs_real_data("mnist")
def test_real_mnist_dirichlet_partition_is_skewed():
    data = build_dataset(
        load_config(
            None, ["data.name=mnist", "data.partition=dirichlet", "data.num_clients=20", "data.dirichlet_alpha=0.1"]
        ).data,
        0,
    )
    assert len(data.train_targets) == 60000 and len(data.test_targets) == 10000
    assert data.client_sizes.sum() == 60000 and data.client_sizes.tolist() == [3000] * 20  # balanced quotas
    assert data.describe()["classes_for_80_percent_median"] <= 3


# =========================================================================== partitions through the config


def _data(tmp_path: Path, *overrides: str, seed: int = 0):
    root = tmp_path / "mnist"
    if not root.exists():
        write_mnist(root, n_train=200, n_test=20)
    config = load_config(None, ["data.name=mnist", f"data.root={root}", "data.num_clients=5", *overrides])
    return build_dataset(config.data, seed)


def _assert_partition(data, num_rows: int, num_clients: int) -> None:
    assert data.num_clients == num_clients
    rows = np.concatenate(data.client_indices)
    assert len(rows) == len(np.unique(rows)) and rows.min() >= 0 and rows.max() < num_rows
    assert all(len(c) > 0 for c in data.client_indices)


POOLED_PARTITIONS = {
    "iid": [],
    "dirichlet": ["data.dirichlet_alpha=0.5"],
    "dirichlet_classwise": ["data.dirichlet_alpha=0.5", "data.min_client_size=2"],
    "classes_per_client": ["data.classes_per_client=2"],
    "power_law": ["data.classes_per_client=2"],
}


def test_every_partition_value_is_tested():
    assert set(POOLED_PARTITIONS) | {"natural"} == set(PARTITIONS)


@pytest.mark.parametrize("partition", list(POOLED_PARTITIONS))
def test_every_partition_through_the_config(tmp_path, partition):
    data = _data(tmp_path, f"data.partition={partition}", *POOLED_PARTITIONS[partition])
    _assert_partition(data, 200, 5)
    if partition != "power_law":  # power_law may leave rows unused; the others give every row away
        assert data.client_sizes.sum() == 200
    labels = data.train_targets.numpy()
    classes = [len(np.unique(labels[c])) for c in data.client_indices]
    if partition == "iid":
        assert data.client_sizes.tolist() == [40] * 5
    if partition in ("classes_per_client", "power_law"):
        assert max(classes) <= 2
    # the same config gives the same partition; a run on it trains
    again = _data(tmp_path, f"data.partition={partition}", *POOLED_PARTITIONS[partition])
    assert all(np.array_equal(a, b) for a, b in zip(data.client_indices, again.client_indices, strict=True))


@pytest.mark.parametrize("partition", list(POOLED_PARTITIONS))
def test_every_partition_runs_a_round(tmp_path, partition):
    write_mnist(tmp_path / "mnist", n_train=200, n_test=20)
    result = driftlab.run(
        None,
        overrides=[
            *ONE_ROUND,
            "data.name=mnist",
            f"data.root={tmp_path / 'mnist'}",
            "data.num_clients=5",
            f"data.partition={partition}",
            *POOLED_PARTITIONS[partition],
        ],
    )
    assert 0.0 <= result.records[0]["test_accuracy"] <= 1.0


def test_default_partition_is_iid_for_pooled_and_natural_for_natural_data(tmp_path):
    pooled = _data(tmp_path)
    assert pooled.client_sizes.tolist() == [40] * 5
    natural = build_dataset(
        load_config(None, ["data.name=femnist", f"data.root={write_leaf(tmp_path / 'f', 'femnist')}"]).data, 0
    )
    assert natural.client_sizes.tolist() == [6, 8, 10, 12, 14]


def test_natural_is_refused_for_pooled_data_with_a_clear_message(tmp_path):
    with pytest.raises(DataFileError) as error:
        _data(tmp_path, "data.partition=natural")
    message = str(error.value)
    assert "natural" in message and "mnist" in message and "iid" in message


def test_natural_is_refused_before_anything_is_written(tmp_path):
    write_mnist(tmp_path / "mnist")
    out = tmp_path / "run"
    with pytest.raises(DataFileError, match="natural"):
        driftlab.run(
            None,
            out,
            overrides=[*ONE_ROUND, "data.name=mnist", f"data.root={tmp_path / 'mnist'}", "data.partition=natural"],
        )
    # Only the resolved config (written first, so a killed run resumes) and the directory lock.
    assert {p.name for p in out.iterdir()} <= {"config.json", ".lock"}


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "classes_per_client"])
def test_a_natural_data_set_is_pooled_and_resplit(tmp_path, partition):
    root = write_leaf(tmp_path / "femnist", "femnist", num_users=5)
    natural = build_dataset(load_config(None, ["data.name=femnist", f"data.root={root}"]).data, 0)
    config = load_config(
        None, ["data.name=femnist", f"data.root={root}", f"data.partition={partition}", "data.num_clients=3"]
    )
    resplit = build_dataset(config.data, 0)
    assert resplit.num_clients == 3 and natural.num_clients == 5
    assert partition in resplit.name
    # the same pooled rows, handed out again
    assert np.array_equal(
        np.sort(np.concatenate(resplit.client_indices)), np.sort(np.concatenate(natural.client_indices))
    )
    assert torch.equal(resplit.test_targets, natural.test_targets)
    if partition == "iid":
        assert sorted(resplit.client_sizes.tolist()) == [16, 17, 17]  # 50 rows, balanced
    result = driftlab.run(config, overrides=[*ONE_ROUND])
    assert 0.0 <= result.records[0]["test_accuracy"] <= 1.0


def test_max_clients_then_resplit_pools_only_the_kept_clients(tmp_path):
    root = write_leaf(tmp_path / "femnist", "femnist", num_users=5)
    resplit = build_dataset(
        load_config(
            None,
            [
                "data.name=femnist",
                f"data.root={root}",
                "data.max_clients=2",
                "data.partition=iid",
                "data.num_clients=2",
            ],
        ).data,
        0,
    )
    assert resplit.client_sizes.sum() == 6 + 8


def test_quotas_balanced_and_lognormal(tmp_path):
    balanced = _data(tmp_path, "data.partition=iid", "data.quotas=balanced", "data.num_clients=7")
    sizes = balanced.client_sizes
    assert sizes.sum() == 200 and sizes.max() - sizes.min() <= 1
    lognormal = _data(
        tmp_path, "data.partition=iid", "data.quotas=lognormal", "data.lognormal_sigma=1.0", "data.num_clients=7"
    )
    sizes = lognormal.client_sizes
    assert sizes.sum() == 200 and sizes.max() - sizes.min() > 5
    for partition in ("dirichlet", "classes_per_client"):
        skewed = _data(
            tmp_path,
            f"data.partition={partition}",
            "data.quotas=lognormal",
            "data.lognormal_sigma=1.0",
            "data.num_clients=7",
        )
        assert (
            skewed.client_sizes.tolist() == lognormal.client_sizes.tolist()
            or skewed.client_sizes.max() - skewed.client_sizes.min() > 5
        )


def _same_partition(a, b) -> bool:
    return len(a.client_indices) == len(b.client_indices) and all(
        np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices, strict=True)
    )


@pytest.mark.parametrize("partition", list(POOLED_PARTITIONS))
def test_partitions_are_deterministic_per_data_seed_and_differ_across_seeds(tmp_path, partition):
    extra = POOLED_PARTITIONS[partition]
    a = _data(tmp_path, f"data.partition={partition}", "data.seed=1", *extra)
    b = _data(
        tmp_path, f"data.partition={partition}", "data.seed=1", *extra, seed=99
    )  # data.seed wins over the experiment seed
    c = _data(tmp_path, f"data.partition={partition}", "data.seed=2", *extra)
    assert _same_partition(a, b)
    assert not _same_partition(a, c)
    # without data.seed, the experiment seed decides
    d = _data(tmp_path, f"data.partition={partition}", *extra, seed=1)
    e = _data(tmp_path, f"data.partition={partition}", *extra, seed=2)
    assert _same_partition(a, d) and not _same_partition(d, e)


def test_generated_data_follow_data_seed():
    first = build_dataset(load_config(None, ["data.num_clients=3", "data.seed=4"]).data, 0)
    second = build_dataset(load_config(None, ["data.num_clients=3", "data.seed=4"]).data, 7)
    third = build_dataset(load_config(None, ["data.num_clients=3", "data.seed=5"]).data, 0)
    assert torch.equal(first.train_inputs, second.train_inputs)
    assert not torch.equal(first.train_inputs[:10], third.train_inputs[:10])


# =========================================================================== per-client test splits


def test_client_test_fraction_hand_checked_tiny_case(tmp_path):
    """4 clients x 10 rows, fraction 0.2: every client keeps 8 and holds out 2, appended after the 20 official test rows."""
    write_mnist(tmp_path / "mnist", n_train=40, n_test=20)
    overrides = ["data.name=mnist", f"data.root={tmp_path / 'mnist'}", "data.num_clients=4", "data.partition=iid"]
    plain = build_dataset(load_config(None, overrides).data, 0)
    split = build_dataset(load_config(None, [*overrides, "data.client_test_fraction=0.2"]).data, 0)
    assert plain.client_test_indices is None and plain.global_test_size is None
    assert split.global_test_size == 20 and len(split.test_targets) == 20 + 8
    assert split.client_sizes.tolist() == [8, 8, 8, 8]
    assert [c.tolist() for c in split.client_test_indices] == [[20, 21], [22, 23], [24, 25], [26, 27]]
    # the official test rows are untouched
    assert torch.equal(split.test_inputs[:20], plain.test_inputs) and torch.equal(
        split.test_targets[:20], plain.test_targets
    )
    for before, train_rows, test_rows in zip(
        plain.client_indices, split.client_indices, split.client_test_indices, strict=True
    ):
        held_out = np.setdiff1d(before, train_rows)
        assert len(held_out) == 2 and set(train_rows) <= set(before)
        # the held-out rows are the client's own rows, copied into the test tensors, and gone from training
        test_rows, held_out = torch.as_tensor(np.array(test_rows)), torch.as_tensor(held_out)
        assert torch.equal(split.test_inputs[test_rows], split.train_inputs[held_out])
        assert torch.equal(split.test_targets[test_rows], split.train_targets[held_out])
    train_union = np.concatenate(split.client_indices)
    held_union = np.concatenate(
        [np.setdiff1d(b, t) for b, t in zip(plain.client_indices, split.client_indices, strict=True)]
    )
    assert np.intersect1d(train_union, held_union).size == 0


def test_client_test_accuracy_is_evaluated_on_the_held_out_rows_and_test_accuracy_on_official_rows(tmp_path):
    write_mnist(tmp_path / "mnist", n_train=40, n_test=20)
    base = [
        *ONE_ROUND,
        "data.name=mnist",
        f"data.root={tmp_path / 'mnist'}",
        "data.num_clients=4",
        "data.partition=iid",
    ]
    sim_plain, state_plain = build_simulation(load_config(None, base))
    sim_split, state_split = build_simulation(load_config(None, [*base, "data.client_test_fraction=0.2"]))
    params = state_split.server.params
    assert torch.equal(params, state_plain.server.params)
    metrics_plain, metrics_split = evaluate(sim_plain, params), evaluate(sim_split, params)
    # global test metrics: the official 20 rows only, identical with and without local splits
    assert metrics_split["test_accuracy"] == metrics_plain["test_accuracy"]
    assert metrics_split["test_loss"] == pytest.approx(metrics_plain["test_loss"])
    predictions = sim_split.model.forward(params, sim_split.test_data.model_inputs(sim_split.test_data.inputs)).argmax(
        1
    )
    correct = (predictions == sim_split.test_data.targets).float()
    assert metrics_split["test_accuracy"] == pytest.approx(float(correct[:20].mean()))
    expected = np.mean(
        [float(correct[torch.as_tensor(np.array(rows))].mean()) for rows in sim_split.data.client_test_indices]
    )
    assert metrics_split["client_test_accuracy_mean"] == pytest.approx(expected)
    assert "client_test_accuracy_mean" not in metrics_plain
    record = driftlab.run(None, overrides=[*base, "data.client_test_fraction=0.2"]).records[-1]
    assert 0.0 <= record["client_test_accuracy_mean"] <= 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_client_test_fraction_after_a_resplit_of_natural_data(tmp_path, backend):
    root = write_leaf(tmp_path / "femnist", "femnist", num_users=4)
    natural = build_dataset(load_config(None, ["data.name=femnist", f"data.root={root}"]).data, 0)
    config = load_config(
        None,
        [
            *ONE_ROUND,
            "data.name=femnist",
            f"data.root={root}",
            "data.partition=iid",
            "data.num_clients=3",
            "data.client_test_fraction=0.25",
            f"backend={backend}",
        ],
    )
    data = build_dataset(config.data, 0)
    assert data.global_test_size == len(natural.test_targets)
    held = sum(len(t) for t in data.client_test_indices)
    assert held + data.client_sizes.sum() == natural.client_sizes.sum()
    assert len(data.test_targets) == len(natural.test_targets) + held
    record = driftlab.run(config).records[-1]
    assert "client_test_accuracy_mean" in record and 0.0 <= record["test_accuracy"] <= 1.0


def test_data_sets_with_their_own_client_splits_keep_them(tmp_path):
    root = write_leaf(tmp_path / "femnist", "femnist", num_users=3)
    own = build_dataset(load_config(None, ["data.name=femnist", f"data.root={root}"]).data, 0)
    asked = build_dataset(
        load_config(None, ["data.name=femnist", f"data.root={root}", "data.client_test_fraction=0.5"]).data, 0
    )
    assert asked.client_sizes.tolist() == own.client_sizes.tolist()
    assert [len(c) for c in asked.client_test_indices] == [2, 2, 2]


def test_shakespeare_test_fraction_comes_from_client_test_fraction(tmp_path):
    path = write_shakespeare(tmp_path / "input.txt")
    default = build_dataset(
        load_config(None, ["data.name=shakespeare", f"data.root={path}", "data.samples_per_client=100"]).data, 0
    )
    half = build_dataset(
        load_config(
            None,
            [
                "data.name=shakespeare",
                f"data.root={path}",
                "data.samples_per_client=100",
                "data.client_test_fraction=0.5",
            ],
        ).data,
        0,
    )
    assert set(default.client_sizes.tolist()) == {80} and set(half.client_sizes.tolist()) == {50}
    assert {len(t) for t in half.client_test_indices} == {50}


def test_shakespeare_made_iid_takes_its_test_split_once(tmp_path):
    """The loader holds out data.client_test_fraction of every role (80 windows apart from its training windows); made
    IID, the devices train on every training window and get those test windows, not a second share held out."""
    base = ["data.name=shakespeare", f"data.root={write_shakespeare(tmp_path / 'input.txt')}"]
    base += ["data.samples_per_client=100", "data.client_test_fraction=0.5"]
    natural = build_dataset(load_config(None, base).data, 0)
    iid = build_dataset(load_config(None, [*base, "data.partition=iid", "data.num_clients=3"]).data, 0)
    assert iid.num_clients == 3 and iid.client_sizes.sum() == natural.client_sizes.sum() == 50 * natural.num_clients
    assert torch.equal(iid.test_targets, natural.test_targets) and iid.global_test_size is None
    dealt = np.concatenate(iid.client_test_indices)
    assert len(np.unique(dealt)) == len(dealt) and set(dealt.tolist()) <= set(range(len(natural.test_targets)))
    assert len(dealt) >= 0.9 * len(natural.test_targets)  # all but the rows of characters no device trains on


# =========================================================================== model keys reach the module


def _lstm_parameters(vocab: int, embedding: int, hidden: int, layers: int, classes: int, gates: int) -> int:
    total = vocab * embedding + hidden * classes + classes
    for layer in range(layers):
        inputs = embedding if layer == 0 else hidden
        total += gates * hidden * (inputs + hidden) + 2 * gates * hidden
    return total


def _resnet_parameters(width: int, stem: str, classes: int, in_channels: int = 3) -> int:
    kernel = 3 if stem == "cifar" else 7
    total = in_channels * width * kernel * kernel + 2 * width
    previous = width
    for index, out in enumerate([width, 2 * width, 4 * width, 8 * width]):
        for block in range(2):
            block_in = previous if block == 0 else out
            total += block_in * out * 9 + 2 * out + out * out * 9 + 2 * out
            if block == 0 and (index > 0 or block_in != out):
                total += block_in * out + 2 * out
        previous = out
    return total + previous * classes + classes


def _vgg_parameters(width: int, classes: int, in_channels: int = 3) -> int:
    total, channels = 0, in_channels
    for item in (1, "M", 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M"):
        if item != "M":
            total += channels * item * width * 9 + item * width
            channels = item * width
    hidden = 8 * width
    return total + channels * hidden + hidden + hidden * hidden + hidden + hidden * classes + classes


def _built(*overrides: str):
    sim, _ = build_simulation(load_config(None, list(overrides)))
    return sim.model


def test_mlp_hidden_reaches_the_module():
    model = _built("data.num_clients=3", "model.name=mlp", "model.hidden=[7, 5]")
    assert model.num_parameters == (60 * 7 + 7) + (7 * 5 + 5) + (5 * 10 + 10)
    assert _built("data.num_clients=3", "model.name=mlr").num_parameters == 60 * 10 + 10


@pytest.mark.parametrize("name, gates", [("lstm", 4), ("gru", 3)])
def test_rnn_keys_reach_the_module(tmp_path, name, gates):
    path = write_shakespeare(tmp_path / "input.txt")
    model = _built(
        "data.name=shakespeare",
        f"data.root={path}",
        f"model.name={name}",
        "model.rnn_hidden=6",
        "model.rnn_layers=3",
        "model.embedding_dim=4",
    )
    assert model.num_parameters == _lstm_parameters(80, 4, 6, 3, 80, gates)
    assert model.module.rnn.num_layers == 3 and model.module.rnn.hidden_size == 6
    default = _built("data.name=shakespeare", f"data.root={path}", f"model.name={name}")
    assert default.num_parameters == _lstm_parameters(80, 8, 100 if name == "lstm" else 256, 2, 80, gates)


def test_sent140_vocabulary_size_reaches_the_embedding(tmp_path):
    root = write_leaf(tmp_path / "s140", "sent140")
    model = _built(
        "data.name=sent140",
        f"data.root={root}",
        "model.name=lstm",
        "model.rnn_hidden=5",
        "model.rnn_layers=1",
        "data.vocabulary_size=40",
    )
    assert model.module.embedding.num_embeddings == 40
    assert model.num_parameters == _lstm_parameters(40, 8, 5, 1, 2, 4)


@pytest.mark.parametrize("stem", ["cifar", "imagenet"])
def test_resnet_keys_reach_the_module(tmp_path, stem):
    root = write_cifar10(tmp_path / "cifar10", per_batch=10)
    model = _built(
        "data.name=cifar10",
        f"data.root={root}",
        "data.num_clients=2",
        "model.name=resnet18_gn",
        "model.width=4",
        "model.groups=4",
        f"model.resnet_stem={stem}",
    )
    assert model.num_parameters == _resnet_parameters(4, stem, 10)
    assert model.module.bn1.num_groups == 4 and model.module.layer4[1].bn2.num_groups == 4
    assert model.module.conv1.kernel_size == ((3, 3) if stem == "cifar" else (7, 7))


def test_vgg_width_reaches_the_module(tmp_path):
    root = write_cifar10(tmp_path / "cifar10", per_batch=10)
    model = _built("data.name=cifar10", f"data.root={root}", "data.num_clients=2", "model.name=vgg11", "model.width=2")
    assert model.num_parameters == _vgg_parameters(2, 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_resnet_and_vgg_train_a_round(tmp_path, backend):
    root = write_cifar10(tmp_path / "cifar10", per_batch=4)
    for model in (["model.name=resnet18_gn", "model.width=2", "model.groups=2"], ["model.name=vgg11", "model.width=2"]):
        overrides = [
            *ONE_ROUND,
            "data.name=cifar10",
            f"data.root={root}",
            "data.num_clients=2",
            f"backend={backend}",
            *model,
        ]
        record = driftlab.run(None, overrides=overrides).records[0]
        assert 0.0 <= record["test_accuracy"] <= 1.0


# =========================================================================== missing files


DOWNLOADABLE = {name: info.download.name for name, info in DATA_SETS.items() if info.download}


def test_downloadable_data_sets_are_the_ones_with_official_files():
    assert DOWNLOADABLE == {
        "mnist": "mnist",
        "fashion_mnist": "fashion_mnist",
        "emnist_letters10": "emnist",
        "emnist_letters": "emnist",
        "emnist_byclass": "emnist",
        "cifar10": "cifar10",
        "cifar100": "cifar100",
        "shakespeare": "shakespeare",
        "stackoverflow": "stackoverflow",
    }
    from driftlab.data.download import dataset_names

    assert set(DOWNLOADABLE.values()) == set(dataset_names())  # every download feeds a data set


@pytest.mark.parametrize("name", [name for name, info in DATA_SETS.items() if info.location is not None])
def test_a_missing_path_names_the_path_the_data_set_and_the_download_command(tmp_path, name):
    missing = tmp_path / "nowhere" / "at-all"
    out = tmp_path / "run"
    with pytest.raises(DataFileError) as error:
        driftlab.run(None, out, overrides=[*ONE_ROUND, f"data.name={name}", f"data.root={missing}"])
    message = str(error.value)
    assert str(missing) in message and name in message
    if name in DOWNLOADABLE:
        assert f"driftlab data download {DOWNLOADABLE[name]}" in message
    else:
        assert "driftlab data download" not in message
    # no metrics, checkpoint or model: at most the config (written first, so a killed run can resume) and the run's lock
    assert not out.exists() or {p.name for p in out.iterdir()} <= {"config.json", ".lock"}


@pytest.mark.parametrize("name", ["mnist", "cifar10_folder", "femnist"])
def test_a_missing_default_location_follows_driftlab_data(tmp_path, monkeypatch, name):
    monkeypatch.setenv("DRIFTLAB_DATA", str(tmp_path / "data"))
    expected = tmp_path / "data" / DATA_SETS[name].location
    with pytest.raises(DataFileError) as error:
        build_dataset(load_config(None, [f"data.name={name}"]).data, 0)
    assert str(expected) in str(error.value)


def test_data_root_search_order_without_driftlab_data(tmp_path, monkeypatch):
    """./shared/data, then ../shared/data from the current directory, then the checkout's; the first that exists wins."""
    monkeypatch.delenv("DRIFTLAB_DATA", raising=False)
    project = tmp_path / "project"
    here = project / "work"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    looked = datasets_module.data_search_paths("mnist")
    assert looked[:2] == [here / "shared" / "data" / "mnist", project / "shared" / "data" / "mnist"]
    checkout = REPO_ROOT.parent / "shared" / "data"
    assert (checkout / "mnist" in looked) == checkout.is_dir()  # never a site-packages path that cannot exist
    (project / "shared" / "data" / "mnist").mkdir(parents=True)
    assert default_data_root("mnist") == project / "shared" / "data" / "mnist"
    (here / "shared" / "data" / "mnist").mkdir(parents=True)
    assert default_data_root("mnist") == here / "shared" / "data" / "mnist"


def test_driftlab_data_replaces_the_search(tmp_path, monkeypatch):
    monkeypatch.setenv("DRIFTLAB_DATA", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shared" / "data" / "mnist").mkdir(parents=True)  # ignored: DRIFTLAB_DATA says where the data is
    assert datasets_module.data_search_paths("mnist") == [tmp_path / "data" / "mnist"]
    assert default_data_root("mnist") == tmp_path / "data" / "mnist"


def test_data_root_wins_over_driftlab_data(tmp_path, monkeypatch):
    monkeypatch.setenv("DRIFTLAB_DATA", str(tmp_path / "data"))
    root = write_mnist(tmp_path / "mine", n_train=20, n_test=10)
    config = load_config(None, ["data.name=mnist", f"data.root={root}", "data.num_clients=5"]).data
    assert datasets_module.data_location(config) == root
    assert len(build_dataset(config, 0).train_targets) == 20


def test_absent_files_have_no_location(tmp_path, monkeypatch):
    """data_location is None when nothing is there (a skipif on it fires), the path once the files exist."""
    monkeypatch.setenv("DRIFTLAB_DATA", str(tmp_path / "data"))
    config = load_config(None, ["data.name=mnist", "data.num_clients=5"]).data
    assert datasets_module.find_data("mnist") is None and datasets_module.data_location(config) is None
    assert real_data_path("mnist") is None
    assert (
        datasets_module.data_location(load_config(None, ["data.name=mnist", f"data.root={tmp_path / 'nowhere'}"]).data)
        is None
    )
    assert datasets_module.data_location(load_config(None, ["data.name=synthetic"]).data) is None  # generated: no files
    write_mnist(tmp_path / "data" / "mnist", n_train=20, n_test=10)
    assert datasets_module.data_location(config) == real_data_path("mnist") == tmp_path / "data" / "mnist"
    assert len(build_dataset(config, 0).train_targets) == 20


def test_real_data_skip_reason_names_where_the_library_looked(tmp_path, monkeypatch):
    from driftlab.experiments.run.real_data import needs_real_data, real_data_skip_reason

    monkeypatch.setenv("DRIFTLAB_DATA", str(tmp_path / "data"))
    reason = real_data_skip_reason("cifar10_folder")
    where = tmp_path / "data" / "cifar10-jpeg" / "cifar10-jpeg.tar.gz"
    assert (
        reason
        == f"real cifar10_folder data not found; looked in {where} (set DRIFTLAB_DATA=DIR, a folder holding cifar10-jpeg/cifar10-jpeg.tar.gz)"
    )
    mark = needs_real_data("cifar10_folder").mark
    assert mark.args == (True,) and mark.kwargs["reason"] == reason
    write_image_folder(where)
    assert needs_real_data("cifar10_folder").mark.args == (False,)


def _one_off(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """The data set's files at their default layout under tmp_path/data: (the data folder, the files' path)."""
    data = tmp_path / "data"
    files = data / DATA_SETS[name].location
    if name == "mnist":
        write_mnist(files, n_train=20, n_test=10)
    else:
        write_image_folder(files)
    return data, files


@pytest.mark.parametrize(
    "name, given",
    [
        ("cifar10_folder", lambda data, files: files.parent),  # the folder holding the tarball (issue 30)
        ("cifar10_folder", lambda data, files: data),  # the data folder, two levels up
        ("mnist", lambda data, files: data),  # the folder holding mnist/
        ("mnist", lambda data, files: files / "train-images-idx3-ubyte.gz"),  # a file inside the MNIST folder
        ("mnist", lambda data, files: data / "minst"),  # a misspelt folder beside the right one
    ],
    ids=["cifar-tarball-folder", "cifar-data-folder", "mnist-data-folder", "mnist-file", "mnist-typo"],
)
def test_a_data_root_one_folder_off_gets_a_hint(tmp_path, name, given):
    data, files = _one_off(tmp_path, name)
    root = given(data, files)
    with pytest.raises(DataFileError) as error:
        build_dataset(load_config(None, [f"data.name={name}", f"data.root={root}", "data.num_clients=2"]).data, 0)
    message = str(error.value)
    assert message.endswith(f". Near miss: the files look one folder off; try data.root={files}"), message
    assert ".." not in message
    assert (
        len(
            build_dataset(
                load_config(None, [f"data.name={name}", f"data.root={files}", "data.num_clients=2"]).data, 0
            ).test_targets
        )
        > 0
    )


@pytest.mark.parametrize("off", ["parent", "child"])
def test_driftlab_data_one_folder_off_gets_a_hint(tmp_path, monkeypatch, off):
    data, files = _one_off(tmp_path, "mnist")
    (data / "unrelated").mkdir()
    monkeypatch.setenv(
        "DRIFTLAB_DATA", str(files if off == "parent" else tmp_path)
    )  # the mnist folder itself; the folder above data/
    with pytest.raises(DataFileError) as error:
        build_dataset(load_config(None, ["data.name=mnist"]).data, 0)
    assert str(error.value).endswith(f". Near miss: the files look one folder off; try DRIFTLAB_DATA={data}")


def test_no_hint_for_a_damaged_file_at_the_right_path_or_nothing_near(tmp_path):
    data, files = _one_off(tmp_path, "cifar10_folder")
    files.write_bytes(files.read_bytes()[:100])  # truncated where it should be
    for root in (files, tmp_path / "elsewhere"):
        with pytest.raises(DataFileError) as error:
            build_dataset(load_config(None, ["data.name=cifar10_folder", f"data.root={root}"]).data, 0)
        assert "Near miss" not in str(error.value)


@pytest.mark.parametrize("name", ["quadratic1d", "quadratic"])
@pytest.mark.parametrize("partition", [p for p in PARTITIONS if p not in ("natural", "iid")])
def test_quadratic_data_refuse_the_label_based_partitions(name, partition):
    """Quadratic objectives have no classes to skew (issue 31: dirichlet on quadratic1d was silently accepted)."""
    with pytest.raises(driftlab.ConfigError) as error:
        load_config(None, [f"data.name={name}", "model.name=quadratic", f"data.partition={partition}"])
    message = str(error.value)
    assert (
        f"data.partition = {partition!r} deals out examples by class, and {name}'s clients are objectives with no classes"
        in message
    )
    assert 'use data.partition = "natural" (the default: one objective per client) or "iid"' in message
    for allowed in ("natural", "iid"):
        data = build_dataset(
            load_config(
                None, [f"data.name={name}", "model.name=quadratic", f"data.partition={allowed}", "data.num_clients=4"]
            ).data,
            0,
        )
        assert data.num_clients == 4 and data.known_minimizer is not None


@pytest.mark.parametrize("name", ["mnist", "femnist"])
def test_missing_default_data_says_where_it_looked_and_every_fix(tmp_path, monkeypatch, name):
    monkeypatch.delenv("DRIFTLAB_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        datasets_module, "REPOSITORY_ROOT", tmp_path / "site-packages"
    )  # an installed package: no checkout data
    with pytest.raises(DataFileError) as error:
        build_dataset(load_config(None, [f"data.name={name}"]).data, 0)
    message = str(error.value)
    folder = DATA_SETS[name].location
    assert (
        f"looked in {tmp_path / 'shared' / 'data' / folder}, {tmp_path.parent / 'shared' / 'data' / folder}" in message
    )
    assert "site-packages" not in message
    assert "data.root=PATH" in message and f"DRIFTLAB_DATA=DIR (a folder holding {folder})" in message
    assert ("driftlab data download mnist --to DIR" in message) == (name == "mnist")


@pytest.mark.parametrize(
    "name", ["fashion_mnist", "emnist_letters", "cifar10", "cifar100"]
)  # mnist: its own test below
def test_an_empty_data_directory_error_points_at_the_download_command(tmp_path, name):
    """The directory exists but holds none of the files: the loader's own message must still name the download."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataFileError) as error:
        build_dataset(load_config(None, [f"data.name={name}", f"data.root={empty}"]).data, 0)
    message = str(error.value)
    assert str(empty) in message
    assert f"driftlab data download {DOWNLOADABLE[name]}" in message


@pytest.mark.parametrize("name", ["femnist", "sent140", "shakespeare_leaf", "cifar10_folder"])
def test_an_empty_directory_for_data_without_a_download_does_not_offer_one(tmp_path, name):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataFileError) as error:
        build_dataset(load_config(None, [f"data.name={name}", f"data.root={empty}"]).data, 0)
    assert str(empty) in str(error.value)
    assert "driftlab data download" not in str(error.value)


def test_empty_mnist_directory_names_the_download_command(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataFileError) as error:
        build_dataset(load_config(None, ["data.name=mnist", f"data.root={empty}"]).data, 0)
    message = str(error.value)
    assert "driftlab data download mnist" in message and "does not download" not in message


def test_nothing_is_written_to_out_when_loading_fails(tmp_path):
    root = write_mnist(tmp_path / "mnist")
    (root / "train-labels-idx1-ubyte.gz").unlink()
    out = tmp_path / "run"
    with pytest.raises(DataFileError, match="train"):
        driftlab.run(None, out, overrides=[*ONE_ROUND, "data.name=mnist", f"data.root={root}"])
    assert {p.name for p in out.iterdir()} <= {"config.json", ".lock"}


# =========================================================================== regressions of bugs found in review


def test_shakespeare_root_may_be_the_download_directory(tmp_path):
    write_shakespeare(tmp_path / "download" / "input.txt")
    data = build_dataset(load_config(None, ["data.name=shakespeare", f"data.root={tmp_path / 'download'}"]).data, 0)
    assert data.num_clients == 4


def test_resplit_quadratic_clients_keep_the_known_minimizer():
    config = load_config(
        None, ["data.name=quadratic", "model.name=quadratic", "data.num_clients=4", "data.quadratic_dimension=2"]
    )
    natural = build_dataset(config.data, 0)
    resplit = build_dataset(load_config(config.to_dict(), ["data.partition=iid"]).data, 0)
    assert resplit.known_minimizer is not None
    assert np.allclose(resplit.known_minimizer, natural.known_minimizer)


def test_pooled_num_classes_is_the_data_sets_not_the_largest_label(tmp_path):
    folder = tmp_path / "cifar100" / "cifar-100-binary"
    folder.mkdir(parents=True)
    (folder / "train.bin").write_bytes(cifar_records(20, 2, 10, 0))
    (folder / "test.bin").write_bytes(cifar_records(10, 2, 10, 1))
    data = build_dataset(
        load_config(None, ["data.name=cifar100", f"data.root={tmp_path / 'cifar100'}", "data.num_clients=2"]).data, 0
    )
    assert data.num_classes == 100


def test_client_test_fraction_that_holds_out_nothing_is_a_config_error(tmp_path):
    # one row per client: a 10% local test split holds out no example, so no client could be scored
    write_mnist(tmp_path / "mnist", n_train=40, n_test=20)
    with pytest.raises(driftlab.ConfigError, match="client_test_fraction=0.1 holds out no example"):
        driftlab.run(
            None,
            overrides=[
                *ONE_ROUND,
                "data.name=mnist",
                f"data.root={tmp_path / 'mnist'}",
                "data.num_clients=40",
                "data.client_test_fraction=0.1",
            ],
        )


# =========================================================================== multi-label: StackOverflow tag prediction


@pytest.mark.parametrize("backend", BACKENDS)
def test_stackoverflow_runs_as_multi_label_tag_prediction(tmp_path, backend):
    from driftlab.data.stackoverflow_test import _write_sqlite

    database = _write_sqlite(tmp_path / "stackoverflow.sqlite")
    overrides = [
        *ONE_ROUND,
        "data.name=stackoverflow",
        f"data.root={database}",
        "model.name=mlr",
        f"backend={backend}",
        "sampling.participation=1.0",
    ]
    result = driftlab.run(None, overrides=overrides)
    (record,) = result.records
    assert "test_accuracy" not in record  # multi-label: recall of the top 5 tags instead
    assert 0.0 <= record["test_recall_at_5"] <= 1.0
    assert math.isfinite(record["test_loss"]) and math.isfinite(record["train_loss"])
    sim, _ = build_simulation(result.config)
    assert sim.model.multi_label and sim.data.num_classes == len(sim.data.labels)
    assert sim.training_data.targets.dtype == torch.float32  # multi-hot targets follow the arithmetic's dtype


def test_stackoverflow_recall_at_5_by_hand(tmp_path):
    from driftlab.data.stackoverflow_test import _write_sqlite
    from driftlab.simulation.evaluation import evaluate

    database = _write_sqlite(tmp_path / "stackoverflow.sqlite")
    config = load_config(
        None, ["data.name=stackoverflow", f"data.root={database}", "model.name=mlr", "precision=float64"]
    )
    sim, state = build_simulation(config)
    params = torch.randn_like(state.server.params)
    outputs = sim.model.forward(params, sim.test_data.inputs)
    targets = sim.test_data.targets
    top = outputs.topk(min(5, outputs.shape[1]), dim=1).indices
    expected = float(targets.gather(1, top).sum() / targets.sum())
    assert evaluate(sim, params)["test_recall_at_5"] == pytest.approx(expected, rel=1e-12)


def test_stackoverflow_refuses_repartitioning(tmp_path):
    from driftlab.data.stackoverflow_test import _write_sqlite

    database = _write_sqlite(tmp_path / "stackoverflow.sqlite")
    with pytest.raises(driftlab.ConfigError, match="stackoverflow keeps its users as clients"):
        driftlab.run(
            None, overrides=[*ONE_ROUND, "data.name=stackoverflow", f"data.root={database}", "data.partition=iid"]
        )


def test_stackoverflow_describe_has_no_single_class_statistic(tmp_path):
    from driftlab.data.stackoverflow_test import _write_sqlite

    database = _write_sqlite(tmp_path / "stackoverflow.sqlite")
    data = build_dataset(load_config(None, ["data.name=stackoverflow", f"data.root={database}"]).data, 0)
    summary = data.describe()
    assert summary["clients"] == data.num_clients and summary["train_samples"] == len(data.train_targets)
    assert "classes_for_80_percent_min" not in summary


def test_samples_per_client_caps_synthetic_devices():
    for name in ("synthetic", "synthetic_iid"):
        capped = build_dataset(
            load_config(None, [f"data.name={name}", "data.num_clients=30", "data.samples_per_client=10"]).data, 0
        )
        full = build_dataset(load_config(None, [f"data.name={name}", "data.num_clients=30"]).data, 0)
        sizes = [
            len(train) + len(test)
            for train, test in zip(capped.client_indices, capped.client_test_indices, strict=True)
        ]
        assert max(sizes) == 10 and len(capped.client_indices) == 30
        assert (
            int(full.client_sizes.min()) > 10
        )  # FedProx's devices hold at least 50 samples, so the cap is what bounded them


# ---------------------------------------------------------------- your own data without client ids


def _unassigned(classes=4, rows=120):
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(rows, 3, generator=generator)
    return driftlab.FederatedArrays(
        train_inputs=inputs,
        train_targets=torch.arange(rows) % classes,
        test_inputs=inputs[:10],
        test_targets=torch.arange(10) % classes,
    )


def test_arrays_without_client_ids_get_the_builtin_partition_for_the_same_seed():
    from driftlab.data import partition as partitions
    from driftlab.data.federated import federated_dataset_from_arrays
    from driftlab.experiments.config import load_config
    from driftlab.experiments.run.datasets import prepared_custom_data
    from driftlab.randomness import Stream, generator

    arrays = _unassigned()
    keys = ["data.name=custom", "data.partition=dirichlet", "data.num_clients=6", "data.dirichlet_alpha=0.5", "seed=7"]
    config = load_config(None, keys)
    dataset = prepared_custom_data(federated_dataset_from_arrays(arrays), config.data, config.seed)
    labels = arrays.train_targets.numpy()
    quotas = partitions.balanced_quotas(120, 6)
    expected = partitions.dirichlet_client_prior_partition(labels, quotas, 0.5, generator(7, Stream.PARTITION))
    assert not dataset.clients_unassigned and dataset.num_clients == 6
    assert [c.tolist() for c in dataset.client_indices] == [c.tolist() for c in expected]
    iid = load_config(None, ["data.name=custom", "data.num_clients=5", "seed=7"])  # no partition: iid
    dealt = prepared_custom_data(federated_dataset_from_arrays(arrays), iid.data, iid.seed)
    expected = partitions.iid_partition(120, partitions.balanced_quotas(120, 5), generator(7, Stream.PARTITION))
    assert [c.tolist() for c in dealt.client_indices] == [c.tolist() for c in expected]
    keys = ["data.name=custom", "data.partition=classes_per_client", "data.classes_per_client=1", "data.num_clients=4"]
    shards = load_config(None, keys)
    by_class = prepared_custom_data(federated_dataset_from_arrays(arrays), shards.data, 0)
    assert all(len(set(labels[c].tolist())) == 1 for c in by_class.client_indices)


def test_a_run_on_arrays_without_ids_records_the_partition_and_resumes(tmp_path):
    arrays = _unassigned()
    config = {"rounds": 1, "data": {"partition": "dirichlet", "num_clients": 6}}
    first = driftlab.run(config, out_dir=tmp_path / "run", data=arrays)
    assert first.config.data.name == "custom" and first.config.data.partition == "dirichlet"
    longer = first.config.model_copy(update={"rounds": 2})
    resumed = driftlab.run(longer, out_dir=tmp_path / "run", data=arrays, resume=True)
    assert [r["round"] for r in resumed.records] == [1, 2]


def test_a_partition_that_cannot_apply_to_your_data_is_refused():
    labels = torch.tensor([0, 1, 0, 1])
    ids = driftlab.FederatedArrays(torch.zeros(4, 2), labels, torch.tensor([0, 0, 1, 1]), torch.zeros(2, 2), labels[:2])
    with pytest.raises(driftlab.ConfigError, match=r"your data brings its own client ids; leave data.partition unset"):
        driftlab.run({"rounds": 1, "data": {"partition": "iid"}}, data=ids)
    with pytest.raises(driftlab.ConfigError, match=r"natural keeps your client ids, and the data came without"):
        driftlab.run({"rounds": 1, "data": {"partition": "natural"}}, data=_unassigned())
    regression = driftlab.FederatedArrays(
        train_inputs=torch.zeros(8, 2),
        train_targets=torch.zeros(8, 1),
        test_inputs=torch.zeros(2, 2),
        test_targets=torch.zeros(2, 1),
    )
    with pytest.raises(driftlab.ConfigError, match=r"deals out examples by class, and your targets are not class ids"):
        driftlab.run({"rounds": 1, "data": {"partition": "dirichlet", "num_clients": 2}}, data=regression)


def test_a_loader_returning_arrays_without_ids_is_dealt_out_too(tmp_path, monkeypatch):
    (tmp_path / "own_unassigned.py").write_text(
        "import torch, driftlab\n"
        "def load():\n"
        "    x = torch.arange(60, dtype=torch.float32).reshape(30, 2)\n"
        "    return driftlab.FederatedArrays(\n"
        "        train_inputs=x, train_targets=torch.arange(30) % 3, test_inputs=x[:3], test_targets=torch.arange(3)\n"
        "    )\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from driftlab.experiments.config import load_config

    config = load_config(None, ["data.name=custom", "data.loader=own_unassigned:load", "data.num_clients=3"])
    dataset = build_dataset(config.data, config.seed)
    assert dataset.num_clients == 3 and not dataset.clients_unassigned
    assert sorted(np.concatenate(dataset.client_indices).tolist()) == list(range(30))
