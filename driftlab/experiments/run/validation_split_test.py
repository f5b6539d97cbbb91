"""``data.validation_fraction``: each client's validation rows, held out of its training rows, never trained on,
evaluated apart from the test set; unset, every run is as before."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import driftlab
from driftlab.data.federated import FederatedDataset
from driftlab.errors import ConfigError
from driftlab.experiments.config import load_config
from driftlab.experiments.run.datasets import build_dataset, with_validation_split

SMALL = ["rounds=2", "data.name=synthetic", "data.num_clients=6", "model.name=mlr", "sampling.participation=1"]


def _dataset(sizes=(7, 10, 4, 12)) -> FederatedDataset:
    generator = torch.Generator().manual_seed(0)
    total = sum(sizes)
    inputs = torch.randn(total, 3, generator=generator)
    labels = torch.randint(0, 2, (total,), generator=generator)
    bounds = np.cumsum((0,) + tuple(sizes))
    rows = tuple(np.arange(bounds[k], bounds[k + 1], dtype=np.int64) for k in range(len(sizes)))
    return FederatedDataset("toy", inputs, labels, inputs[:5], labels[:5], rows, 2)


def test_each_client_holds_out_the_ceiling_of_its_share_and_keeps_the_rest():
    data = _dataset()
    split = with_validation_split(data, 0.25, seed=3)
    for before, train, held in zip(
        data.client_indices, split.client_indices, split.client_validation_indices, strict=True
    ):
        assert len(held) == math.ceil(0.25 * len(before)) and len(train) == len(before) - len(held)
        assert np.array_equal(np.sort(np.concatenate([train, held])), before)  # a partition of the client's rows
        assert not np.intersect1d(train, held).size


def test_a_clients_validation_rows_depend_on_the_seed_and_that_client_alone():
    data = _dataset()
    other = _dataset(sizes=(7, 10, 4, 12))
    other = FederatedDataset(
        "toy",
        other.train_inputs,
        other.train_targets,
        other.test_inputs,
        other.test_targets,
        (other.client_indices[0], other.client_indices[1][:6], other.client_indices[2], other.client_indices[3]),
        2,
    )
    a, b = with_validation_split(data, 0.3, seed=3), with_validation_split(other, 0.3, seed=3)
    for client_id in (0, 2, 3):  # client 1 changed in `other`; the others' splits do not move
        assert np.array_equal(a.client_validation_indices[client_id], b.client_validation_indices[client_id])
    c = with_validation_split(data, 0.3, seed=4)
    assert any(
        not np.array_equal(x, y) for x, y in zip(a.client_validation_indices, c.client_validation_indices, strict=True)
    )


def test_validation_rows_never_train_and_are_evaluated_apart_from_the_test_set():
    config = load_config(None, overrides=[*SMALL, "data.validation_fraction=0.2"])
    dataset = build_dataset(config.data, config.seed)
    held_out = FederatedDataset(
        dataset.name,
        dataset.train_inputs,
        dataset.train_targets,
        dataset.test_inputs,
        dataset.test_targets,
        dataset.client_indices,
        dataset.num_classes,
        client_test_indices=dataset.client_test_indices,
        global_test_size=dataset.global_test_size,
    )
    base = load_config(None, overrides=[*SMALL, "data.validation_fraction=0.2"]).to_dict()
    with_split = driftlab.run(base)
    base["data"] = {"name": "custom"}
    without_split = driftlab.run(base, data=held_out)
    # Same training rows: the same model bit for bit, whether or not the held-out rows sit in the tensors.
    assert torch.equal(with_split.final_params, without_split.final_params)
    record = with_split.records[-1]
    assert "validation_accuracy" in record and "validation_accuracy" not in without_split.records[-1]
    assert record["test_accuracy"] == without_split.records[-1]["test_accuracy"]
    # Multinomial logistic regression by hand (weights [10, 60], then biases) on exactly the held-out training rows.
    rows = torch.as_tensor(np.concatenate(dataset.client_validation_indices))
    params = with_split.final_params.to(torch.float64)
    weights, bias = params[:600].reshape(10, 60), params[600:]
    logits = dataset.train_inputs[rows].to(torch.float64) @ weights.T + bias
    targets = dataset.train_targets[rows]
    assert record["validation_accuracy"] == pytest.approx(
        float((logits.argmax(1) == targets).double().mean()), abs=1e-12
    )
    assert record["validation_loss"] == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits, targets)), rel=1e-5
    )


def test_the_test_splits_do_not_move_when_a_validation_split_is_added():
    plain = build_dataset(load_config(None, overrides=SMALL).data, 0)
    split = build_dataset(load_config(None, overrides=[*SMALL, "data.validation_fraction=0.1"]).data, 0)
    assert all(np.array_equal(a, b) for a, b in zip(plain.client_test_indices, split.client_test_indices, strict=True))
    assert split.digest != plain.digest and plain.client_validation_indices is None


def test_a_fraction_that_leaves_a_client_nothing_to_train_on_is_refused_naming_the_client():
    with pytest.raises(ValueError, match=r"client 2's 4 training rows and leaves it none"):
        with_validation_split(_dataset(sizes=(7, 10, 4, 12)), 0.8, seed=0)
    with pytest.raises(ConfigError, match="less than 1"):
        load_config(None, overrides=[*SMALL, "data.validation_fraction=1"])


def test_a_fraction_of_zero_is_no_split_and_the_same_run():
    zero = load_config(None, overrides=[*SMALL, "data.validation_fraction=0"])
    assert (
        zero.data.validation_fraction is None and zero.fingerprint() == load_config(None, overrides=SMALL).fingerprint()
    )
