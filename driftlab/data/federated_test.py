"""Tests for the FederatedDataset container and its validation."""

import warnings

import numpy as np
import pytest
import torch

from driftlab.data.federated import DataFileError, FederatedDataset, classes_covering_fraction


def _dataset(client_indices, *, train_targets=None, client_test_indices=None, num_classes=3, **overrides):
    """A small data set: 8 train rows of shape [2, 2], 4 test rows."""
    if train_targets is None:
        train_targets = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    fields = dict(
        name="toy",
        train_inputs=torch.arange(len(train_targets) * 4, dtype=torch.float32).reshape(-1, 2, 2),
        train_targets=train_targets,
        test_inputs=torch.zeros(4, 2, 2),
        test_targets=torch.tensor([0, 1, 2, 2]),
        client_indices=client_indices,
        num_classes=num_classes,
        client_test_indices=client_test_indices,
    )
    fields.update(overrides)
    return FederatedDataset(**fields)


def _ids(*values):
    return np.array(values, dtype=np.int64)


def test_properties_and_describe_hand_computed():
    # client 0: labels [0,0,0,0,1] -> 80% of 5 = 4 samples -> class 0 alone: 1 class
    # client 1: labels [1,2]       -> 80% of 2 = 1.6 -> both classes: 2
    # client 2: labels [2]         -> 1 class
    ds = _dataset((_ids(0, 1, 2, 3, 4), _ids(5, 6), _ids(7)))
    assert ds.num_clients == 3
    assert ds.client_sizes.dtype == np.int64
    assert ds.client_sizes.tolist() == [5, 2, 1]
    assert ds.input_shape == (2, 2)
    assert ds.describe() == {
        "name": "toy",
        "clients": 3,
        "train_samples": 8,
        "test_samples": 4,
        "samples_per_client_min": 1,
        "samples_per_client_median": 2.0,
        "samples_per_client_max": 5,
        "classes_for_80_percent_min": 1,
        "classes_for_80_percent_median": 1.0,
        "classes_for_80_percent_max": 2,
    }


def test_train_samples_counts_only_rows_held_by_clients():
    ds = _dataset((_ids(0, 1), _ids(5)))
    assert ds.describe()["train_samples"] == 3


@pytest.mark.parametrize(
    "labels, fraction, expected",
    [
        ([0, 0, 1, 1, 2], 0.8, 2),  # needs 4 of 5: classes 0 and 1
        ([0, 0, 0, 0, 1], 0.8, 1),  # exactly 80% in one class counts as covered
        ([0, 1, 2, 3, 4], 0.8, 4),  # uniform over 5: 4 of 5
        ([0] * 27 + [1] * 3, 0.1, 1),  # 0.1 * 30 == 3.0000000000000004 in floating point
        ([2, 2, 1], 1.0, 2),
    ],
)
def test_classes_covering_fraction(labels, fraction, expected):
    assert classes_covering_fraction(np.array(labels), 5, fraction) == expected


def test_index_arrays_are_read_only_views():
    mine = _ids(0, 1, 2)
    ds = _dataset([mine, _ids(3)])
    assert isinstance(ds.client_indices, tuple)
    with pytest.raises(ValueError):
        ds.client_indices[0][0] = 7
    assert mine.flags.writeable  # only the stored view is locked, not the caller's array


def test_per_client_test_split_accepted_and_may_be_empty():
    ds = _dataset((_ids(0, 1), _ids(2)), client_test_indices=(_ids(0, 3), _ids()))
    assert [len(t) for t in ds.client_test_indices] == [2, 0]


def test_shared_tensors_are_not_copied():
    inputs = torch.zeros(8, 2, 2)
    ds = _dataset((_ids(0),), train_inputs=inputs)
    assert ds.train_inputs is inputs


@pytest.mark.parametrize(
    "client_indices, message",
    [
        ((_ids(0, 1), _ids(1, 2)), "row 1 is used by clients \\[0, 1\\]"),
        ((_ids(0, 8),), "indices must lie in \\[0, 8\\)"),
        ((_ids(-1),), "indices must lie in \\[0, 8\\)"),
        ((_ids(0), _ids()), "client_indices\\[1\\] is empty"),
        ((np.array([0, 1], dtype=np.int32),), "int64.*np.asarray"),
        (([0, 1],), "must be a 1-D int64 numpy array, got list"),
        ((), "at least one client"),
    ],
)
def test_bad_client_indices_rejected(client_indices, message):
    with pytest.raises(ValueError, match=message):
        _dataset(client_indices)


def test_bad_tensors_rejected():
    with pytest.raises(ValueError, match="int64"):
        _dataset((_ids(0),), train_targets=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="7 rows but train_targets has 8"):
        _dataset((_ids(0),), train_inputs=torch.zeros(7, 2, 2))
    with pytest.raises(ValueError, match="lie in \\[0, 2\\).*\\[0, 2\\]"):
        _dataset((_ids(0),), num_classes=2)
    with pytest.raises(ValueError, match="different per-sample shapes"):
        _dataset((_ids(0),), test_inputs=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="torch.from_numpy"):
        _dataset((_ids(0),), train_inputs=np.zeros((8, 2, 2)))


def test_bad_client_test_indices_rejected():
    with pytest.raises(ValueError, match="one test split per client"):
        _dataset((_ids(0), _ids(1)), client_test_indices=(_ids(0),))
    with pytest.raises(ValueError, match="test row 0 is used by clients \\[0, 1\\]"):
        _dataset((_ids(0), _ids(1)), client_test_indices=(_ids(0), _ids(0, 1)))
    with pytest.raises(ValueError, match="test set has 4 rows"):
        _dataset((_ids(0),), client_test_indices=(_ids(4),))


def test_data_file_error_is_a_value_error():
    assert issubclass(DataFileError, ValueError)


# ---------------------------------------------------------------- the user's own arrays

from driftlab.data.federated import FederatedArrays, federated_dataset_from_arrays  # noqa: E402
from driftlab.errors import ConfigError  # noqa: E402


def _arrays(**changes):
    rng = np.random.default_rng(0)
    fields = dict(
        train_inputs=rng.normal(size=(6, 3)).astype(np.float32),
        train_targets=np.array([0, 1, 2, 0, 1, 1]),
        train_client_ids=np.array([1, 0, 1, 2, 2, 0]),
        test_inputs=rng.normal(size=(4, 3)).astype(np.float32),
        test_targets=np.array([2, 1, 0, 0]),
    )
    fields.update(changes)
    return FederatedArrays(**fields)


def test_arrays_become_a_dataset_with_one_client_per_id():
    dataset = federated_dataset_from_arrays(_arrays())
    assert [idx.tolist() for idx in dataset.client_indices] == [[1, 5], [0, 2], [3, 4]]
    assert dataset.num_classes == 3 and dataset.targets_are_classes and dataset.train_targets.dtype == torch.int64
    assert dataset.name == "custom" and dataset.input_shape == (3,)


def test_tensors_work_like_numpy_arrays_and_give_the_same_digest():
    from_numpy = federated_dataset_from_arrays(_arrays())
    arrays = _arrays()
    from_torch = federated_dataset_from_arrays(
        FederatedArrays(
            *(
                torch.as_tensor(getattr(arrays, name))
                for name in ("train_inputs", "train_targets", "train_client_ids", "test_inputs", "test_targets")
            )
        )
    )
    assert from_numpy.digest == from_torch.digest


def test_the_digest_changes_with_any_value_or_client():
    digest = federated_dataset_from_arrays(_arrays()).digest
    moved = federated_dataset_from_arrays(_arrays(train_client_ids=np.array([1, 0, 1, 2, 0, 2])))
    inputs = _arrays().train_inputs.copy()
    inputs[5, 2] = np.nextafter(inputs[5, 2], np.float32(np.inf))
    nudged = federated_dataset_from_arrays(_arrays(train_inputs=inputs))
    assert len({digest, moved.digest, nudged.digest}) == 3


def test_floating_targets_are_free_targets_with_their_width_as_outputs():
    dataset = federated_dataset_from_arrays(_arrays(train_targets=np.ones((6, 2)), test_targets=np.zeros((4, 2))))
    assert not dataset.targets_are_classes and dataset.num_classes == 2
    assert "classes_for_80_percent_min" not in dataset.describe()


def test_test_client_ids_give_each_client_its_test_rows():
    dataset = federated_dataset_from_arrays(_arrays(test_client_ids=np.array([2, 0, 0, 2])))
    assert [idx.tolist() for idx in dataset.client_test_indices] == [[1, 2], [], [0, 3]]


@pytest.mark.parametrize(
    "changes, fragments",
    [
        (
            {"train_targets": np.array([0, 1, 2, 0, 1])},
            ["train arrays have different lengths", "train_targets 5", "one row per train example"],
        ),
        ({"train_client_ids": np.array([0, 1, 0])}, ["train_client_ids 3"]),
        ({"test_inputs": np.zeros((3, 3), np.float32)}, ["test arrays have different lengths"]),
        (
            {"test_inputs": np.zeros((4, 2), np.float32)},
            ["rows have shape (3,)", "(2,)", "preprocess both splits the same way"],
        ),
        (
            {"train_inputs": np.where(np.eye(6, 3) > 0, np.nan, 0.0)},
            ["train_inputs holds 3 NaN or infinite values", "first in row 0", "np.isfinite"],
        ),
        ({"test_targets": np.array([0.0, np.inf, 1.0, 0.0])}, ["test_targets holds 1 NaN", "row 1"]),
        (
            {"train_client_ids": np.array([0, 0, 2, 2, 3, 3])},
            ["0..C-1", "1 of the ids 0..3 hold none (1)", "np.unique(ids, return_inverse=True)[1]"],
        ),
        ({"train_client_ids": np.array([-1, 0, 0, 1, 1, 1])}, ["negative ids", "0..C-1"]),
        ({"train_client_ids": np.array([0.0, 1, 0, 1, 1, 0])}, ["integer client ids", "np.int64"]),
        ({"test_client_ids": np.array([0, 3, 0, 1])}, ["test_client_ids lie in [0, 3]", "clients 0..2"]),
        ({"train_inputs": [[1.0, 2.0, 3.0]] * 6}, ["train_inputs is a list", "numpy array or a torch tensor"]),
        ({"train_targets": np.array([0, 1, -2, 0, 1, 1])}, ["class ids", "found -2"]),
        ({"num_classes": 2}, ["num_classes=2", "class id 2", "at least 3"]),
        (
            {"test_targets": np.zeros(4, np.float32)},
            ["train_targets are torch.int64 but test_targets are torch.float32"],
        ),
    ],
)
def test_bad_arrays_are_refused_with_what_to_fix(changes, fragments):
    with pytest.raises(ConfigError) as error:
        federated_dataset_from_arrays(_arrays(**changes), "data=")
    message = str(error.value)
    assert message.startswith("data=: ")
    for fragment in fragments:
        assert fragment in message, message


def test_something_else_than_arrays_is_refused_naming_the_type():
    with pytest.raises(ConfigError, match=r"data=: expected driftlab.FederatedArrays .* got dict; build one with"):
        federated_dataset_from_arrays({"train_inputs": np.zeros(3)}, "data=")


def test_torch_datasets_are_read_into_arrays():
    from torch.utils.data import TensorDataset

    arrays = _arrays()
    train = TensorDataset(torch.as_tensor(arrays.train_inputs), torch.as_tensor(arrays.train_targets))
    test = TensorDataset(torch.as_tensor(arrays.test_inputs), torch.as_tensor(arrays.test_targets))
    read = FederatedArrays.from_datasets(train, list(arrays.train_client_ids), test)
    assert federated_dataset_from_arrays(read).digest == federated_dataset_from_arrays(arrays).digest


def test_a_dataset_whose_items_are_not_pairs_is_refused():
    class Singles:
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return torch.zeros(3)

    with pytest.raises(ConfigError, match=r"item 0 of the train Dataset is a Tensor, not an \(input, target\) pair"):
        FederatedArrays.from_datasets(Singles(), [0, 0], Singles())
    with pytest.raises(ConfigError, match="not a map-style torch Dataset"):
        FederatedArrays.from_datasets(iter([]), [0], Singles())


@pytest.mark.parametrize(
    "changes, message",
    [
        # one stray label among 0..2: refused, naming the value and where it is, before 10**7 classes exist
        (
            {"train_targets": np.array([0, 1, 2, 0, 10**7, 1])},
            "data=: train_targets[4] is class id 10,000,000, but only 4 distinct class ids occur (the next largest is 2); class ids number "
            "the classes 0..K-1, so this would make 10,000,001 classes, most of them without an example. Fix that label, renumber the "
            "classes (np.unique(targets, return_inverse=True)[1]), or set num_classes=10000001 if there really are that many classes",
        ),
        (
            {"test_targets": np.array([2, 1, 0, 9])},
            "data=: test_targets[3] is class id 9, but only 4 distinct class ids occur (the next largest is 2)",
        ),
        (
            {"train_targets": np.array([0, 1, 2, 0, -3, 1])},
            "data=: class ids in the targets must be 0 or more, found -3 at train_targets[4]",
        ),
        (
            {"num_classes": 2},
            "data=: num_classes=2, but the targets hold class id 2 (at train_targets[2]); set num_classes to at least 3",
        ),
        # a client id no partition of 6 examples can have: refused before a count per id is allocated
        (
            {"train_client_ids": np.array([1, 0, 10**12, 2, 2, 0])},
            "data=: train_client_ids[2] is 1,000,000,000,000, but 6 examples can hold at most 6 clients (ids 0..5, every client holding "
            "an example); fix that id, or renumber the clients 0..C-1, e.g. np.unique(ids, return_inverse=True)[1]",
        ),
        (
            {"train_client_ids": np.array([1, 0, 1, 2, -2, 0])},
            "data=: train_client_ids holds negative ids (smallest -2, at train_client_ids[4])",
        ),
    ],
)
def test_stray_labels_and_client_ids_are_refused_by_value_and_index(changes, message):
    with pytest.raises(ConfigError) as error:
        federated_dataset_from_arrays(_arrays(**changes), "data=")
    assert str(error.value).startswith(message), str(error.value)


def test_sparse_class_ids_are_kept_when_half_occur_or_num_classes_says_so():
    # ids {0, 1, 3}: 3 of the 4 classes 0..3 occur, taken as they are
    assert federated_dataset_from_arrays(_arrays(train_targets=np.array([0, 1, 3, 0, 1, 1]))).num_classes == 4
    # ids {0, 1, 2, 9}: stated by num_classes, accepted
    stated = federated_dataset_from_arrays(_arrays(test_targets=np.array([2, 1, 0, 9]), num_classes=10))
    assert stated.num_classes == 10


def _peak_kib_of(script: str) -> tuple[str, int]:
    import subprocess
    import sys

    # VmHWM is this process image's own peak: ru_maxrss would carry over the forking parent's peak across exec
    code = (
        script
        + '\nprint(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")))'
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    *lines, peak = result.stdout.strip().splitlines()
    return "\n".join(lines), int(peak)


def test_a_stray_label_or_client_id_is_refused_in_little_memory():
    """Issue 31: one stray label 10**7 made 10**7 classes and died at 5.7 GB; the refusal peaks far under 1 GB."""
    message, peak = _peak_kib_of(
        """
import numpy as np
import driftlab
from driftlab.errors import ConfigError
rng = np.random.default_rng(0)
x = rng.normal(size=(20_000, 60)).astype(np.float32)
y = rng.integers(0, 10, size=20_000)
ids = np.arange(20_000) % 100
for labels, clients in ((np.where(np.arange(20_000) == 777, 10**7, y), ids), (y, np.where(np.arange(20_000) == 5, 10**12, ids))):
    try:
        driftlab.run({"rounds": 1, "data": {"name": "custom"}}, None, data=driftlab.FederatedArrays(x, labels, clients, x[:100], y[:100]))
    except ConfigError as error:
        print(error)
"""
    )
    labels, clients = message.splitlines()
    assert labels.startswith(
        "data=: train_targets[777] is class id 10,000,000, but only 11 distinct class ids occur (the next largest is 9)"
    )
    assert clients.startswith(
        "data=: train_client_ids[5] is 1,000,000,000,000, but 20,000 examples can hold at most 20,000 clients"
    )
    assert peak < 2**20  # KiB: under 1 GiB resident


def test_read_only_arrays_become_tensors_without_a_warning_or_a_copy():
    arrays = _arrays()
    for array in (arrays.train_inputs, arrays.train_targets, arrays.test_inputs):
        array.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "non-writable tensors" UserWarning would fail here
        dataset = federated_dataset_from_arrays(arrays)
    assert dataset.train_inputs.data_ptr() == arrays.train_inputs.ctypes.data  # the same memory, not a copy
    assert torch.equal(dataset.train_inputs, torch.tensor(arrays.train_inputs))
    writable = _arrays()
    assert federated_dataset_from_arrays(writable).train_inputs.data_ptr() == writable.train_inputs.ctypes.data


# ---------------------------------------------------------------- dict items (Hugging Face datasets) and no client ids


def _hf_items(arrays, label_name="label"):
    """What a Hugging Face Dataset's ``ds.with_format("numpy")[i]`` gives: a dict per item."""
    return [{"image": x, label_name: y} for x, y in zip(arrays.train_inputs, arrays.train_targets, strict=True)]


def test_hugging_face_dict_items_round_trip():
    arrays = _arrays()
    test = [{"image": x, "label": y} for x, y in zip(arrays.test_inputs, arrays.test_targets, strict=True)]
    read = FederatedArrays.from_datasets(_hf_items(arrays), arrays.train_client_ids, test)
    assert federated_dataset_from_arrays(read).digest == federated_dataset_from_arrays(arrays).digest
    named = FederatedArrays.from_datasets(
        _hf_items(arrays, "fine"),
        arrays.train_client_ids,
        test=[{"image": [0.0] * 3, "fine": 0}],
        input_key="image",
        label_key="fine",
    )
    assert torch.equal(named.train_targets, torch.as_tensor(arrays.train_targets))
    # a label key among the known names and one other key: that key is the input
    pixels = [{"pixels": [1.0, 2.0], "label": 1}, {"pixels": [3.0, 4.0], "label": 0}]
    guessed = FederatedArrays.from_datasets(pixels, test=pixels)
    assert guessed.train_inputs.tolist() == [[1.0, 2.0], [3.0, 4.0]] and guessed.train_targets.tolist() == [1, 0]
    assert guessed.train_client_ids is None


def test_an_ambiguous_dict_is_refused_with_its_keys_listed():
    cifar100 = [{"img": [0.0, 1.0], "fine_label": 3, "coarse_label": 1}]
    listed = r"keys 'img', 'fine_label', 'coarse_label'.*input_key=\.\.\., label_key=\.\.\."
    with pytest.raises(ConfigError, match=listed):
        FederatedArrays.from_datasets(cifar100, test=cifar100)
    with pytest.raises(ConfigError, match=r"label_key='label' is not a key.*'img', 'fine_label', 'coarse_label'"):
        FederatedArrays.from_datasets(cifar100, test=cifar100, label_key="label")
    chosen = FederatedArrays.from_datasets(cifar100, test=cifar100, label_key="coarse_label")
    assert chosen.train_targets.tolist() == [1] and chosen.train_inputs.tolist() == [[0.0, 1.0]]
    with pytest.raises(ConfigError, match=r"item 1 of the train Dataset has no key 'label'"):
        items = [{"image": [0.0], "label": 0}, {"image": [1.0]}]
        FederatedArrays.from_datasets(items, test=cifar100, input_key="image")


def test_arrays_without_client_ids_are_one_placeholder_client_marked_unassigned():
    arrays = _arrays(train_client_ids=None)
    dataset = federated_dataset_from_arrays(arrays)
    assert dataset.clients_unassigned and [idx.tolist() for idx in dataset.client_indices] == [list(range(6))]
    assert dataset.digest != federated_dataset_from_arrays(_arrays(train_client_ids=np.zeros(6, np.int64))).digest
    with pytest.raises(ConfigError, match=r"test_client_ids are given but train_client_ids are not"):
        federated_dataset_from_arrays(_arrays(train_client_ids=None, test_client_ids=np.zeros(4, np.int64)))
    with pytest.raises(ConfigError, match=r"test_inputs and test_targets missing"):
        federated_dataset_from_arrays(FederatedArrays(arrays.train_inputs, arrays.train_targets))
