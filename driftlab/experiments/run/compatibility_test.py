"""Pre-flight checks: sizes refused before allocation, and model/data mismatches found by one forward pass."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

import driftlab
from driftlab.data.federated import FederatedDataset
from driftlab.experiments.config import ConfigError, load_config
from driftlab.experiments.run.assembly import build_model
from driftlab.experiments.run.compatibility import check_plan_size, check_sizes, checked_model, models_that_fit
from driftlab.experiments.run.datasets import build_dataset
from driftlab.experiments.run.real_data import needs_real_data
from driftlab.simulation.backends.flat import FlatModel

SMALL = {"rounds": 1, "data": {"num_clients": 5}}


def _run_error(*overrides, model=None, out=None) -> str:
    with pytest.raises(ConfigError) as info:
        driftlab.run(SMALL, out, overrides=list(overrides), model=model)
    return str(info.value)


# ------------------------------------------------------------------ model/data mismatches


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["model.name=lstm"],
            [
                "model 'lstm'",
                "'synthetic'",
                "(60,)",
                "float32",
                "10 classes",
                "mlr or mlp",
                "lstm/gru need token sequences",
            ],
        ),
        (["model.name=gru"], ["model 'gru'", "(60,)", "mlr or mlp"]),
        (
            ["model.name=cnn"],
            ["model 'cnn'", "needs image inputs", "(60,)", "cnn, resnet18_gn, resnet18_bn and vgg11 need images"],
        ),
        (["model.name=resnet18_gn"], ["model 'resnet18_gn'", "(60,)", "mlr or mlp"]),
        (["model.name=vgg11"], ["model 'vgg11'", "(60,)"]),
        (
            ["data.name=quadratic", "model.name=mlp"],
            ["model 'mlp'", "'quadratic'", "quadratic objectives", "model.name=quadratic only"],
        ),
        (["data.name=quadratic1d", "model.name=mlr"], ["model 'mlr'", "'quadratic1d'", "model.name=quadratic only"]),
        (["model.name=quadratic"], ["model 'quadratic'", "'synthetic'", "quadratic data sets only", "mlr or mlp"]),
    ],
)
def test_model_data_mismatch_is_a_config_error_before_training(tmp_path, overrides, fragments, built_ins_only):
    out = tmp_path / "run"
    message = _run_error(*overrides, out=out)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert "\n" not in message and len(message) < 1000
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoint.safetensors").exists()


def _token_data(num_classes: int = 7, length: int = 5) -> FederatedDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, num_classes, (12, length), generator=generator)
    targets = torch.randint(0, num_classes, (12,), generator=generator)
    return FederatedDataset(
        name="tokens",
        train_inputs=inputs,
        train_targets=targets,
        test_inputs=inputs[:4],
        test_targets=targets[:4],
        client_indices=(np.arange(6), np.arange(6, 12)),
        num_classes=num_classes,
    )


def _check(config, data, model=None):
    return checked_model(
        config,
        data,
        lambda: build_model(config, data, model).to("cpu", torch.float32),
        torch.device("cpu"),
        torch.float32,
        model,
    )


def test_token_sequences_with_an_mlp_name_what_fits():
    config = load_config(SMALL, ["model.name=mlp", "data.name=shakespeare"])
    message = str(pytest.raises(ConfigError, _check, config, _token_data()).value)
    for fragment in (
        "model 'mlp'",
        "'shakespeare'",
        "(5,)",
        "int64",
        "7 classes",
        "forward pass on 4 training examples failed",
        "lstm or gru",
        "for vector data (synthetic, mnist, stackoverflow) use mlr or mlp",
    ):
        assert fragment in message, fragment
    assert isinstance(
        _check(load_config(SMALL, ["model.name=lstm", "data.name=shakespeare"]), _token_data()), FlatModel
    )


@needs_real_data("shakespeare")
def test_real_shakespeare_with_an_mlp():
    message = _run_error("data.name=shakespeare", "model.name=mlp", "data.max_clients=3", "data.samples_per_client=20")
    assert (
        "model 'mlp'" in message
        and "'shakespeare'" in message
        and "(80,)" in message
        and "int64" in message
        and "lstm or gru" in message
    )


def test_user_module_with_the_wrong_output_size():
    message = _run_error(model=nn.Linear(60, 3))
    assert "Linear (your module)" in message and "outputs of shape (4, 3)" in message and "expected (4, 10)" in message

    def factory(shape, classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(7, classes))

    message = _run_error(model=factory)
    assert (
        "factory" in message and "(your model factory)" in message and "forward pass" in message and "(60,)" in message
    )


def test_output_shape_matches_the_classes_for_a_fitting_model():
    config = load_config(SMALL)
    data = build_dataset(config.data, config.seed)
    flat = _check(config, data)
    assert flat.forward(flat.initial_parameters(), data.train_inputs[:2]).shape == (2, data.num_classes)


def test_probe_draws_no_random_numbers_and_keeps_results(tmp_path):
    config = load_config(SMALL, ["model.name=mlp", "model.hidden=[8]"])
    data = build_dataset(config.data, config.seed)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    flat = _check(config, data)
    assert torch.equal(torch.get_rng_state(), state)
    reference = build_model(config, data, None).initial_parameters()
    assert torch.equal(flat.initial_parameters(), reference)


def test_models_that_fit_by_input_kind():
    data = _token_data()
    assert "lstm or gru" in models_that_fit("sent140", data)
    images = FederatedDataset(
        name="img",
        train_inputs=torch.zeros(2, 3, 8, 8),
        train_targets=torch.tensor([0, 1]),
        test_inputs=torch.zeros(1, 3, 8, 8),
        test_targets=torch.tensor([0]),
        client_indices=(np.array([0]), np.array([1])),
        num_classes=2,
    )
    assert "resnet18_gn" in models_that_fit("cifar10", images)
    flat_square = FederatedDataset(
        name="v",
        train_inputs=torch.zeros(2, 784),
        train_targets=torch.tensor([0, 1]),
        test_inputs=torch.zeros(1, 784),
        test_targets=torch.tensor([0]),
        client_indices=(np.array([0]), np.array([1])),
        num_classes=2,
    )
    assert "femnist_cnn" in models_that_fit("mnist", flat_square)


# ------------------------------------------------------------------ sizes before allocation


def test_huge_epochs_are_refused_before_the_plan_is_built():
    started = time.perf_counter()
    message = _run_error("client.epochs=1000000000")
    assert time.perf_counter() - started < 30
    for fragment in (
        "client.epochs",
        "batch plan of the largest client",
        "1,000,000,000 epochs",
        "TiB",
        "of memory",
        "use at most about",
    ):
        assert fragment in message, fragment


def test_huge_step_counts_are_refused_before_anything_is_built():
    message = _run_error("client.steps=1000000000000")
    assert "client.steps" in message and "7.28 TiB" in message and "use fewer local steps" in message
    message = _run_error('client.steps={kind="inverse_time", a=1e300, b=0}')
    assert "client.steps" in message and "e+" in message


def test_huge_client_counts_are_refused_before_the_data_is_generated():
    message = _run_error("data.num_clients=1000000000")
    assert "data.num_clients" in message and "1,000,000,000 clients" in message and "use at most about" in message


def test_size_limits_follow_the_machine_memory():
    config = load_config(SMALL, ["data.num_clients=100"])
    check_sizes(config, memory_bytes=2**40)
    with pytest.raises(
        ConfigError, match=r"data.num_clients: .* than this machine's 1 MiB of memory; use at most about 2 clients"
    ):
        check_sizes(config, memory_bytes=2**20)
    steps = load_config(
        SMALL, ["data.name=mnist", "client.steps=1000"]
    )  # mnist: 200 bytes a client, nothing built here
    check_sizes(steps, memory_bytes=8000)
    with pytest.raises(ConfigError, match="client.steps"):
        check_sizes(steps, memory_bytes=7999)


def test_plan_estimate_uses_the_largest_client():
    config = load_config(SMALL, ["client.epochs=3", "client.batch_size=10"])
    data = build_dataset(config.data, config.seed)
    largest = int(data.client_sizes.max())
    needed = 3 * -(-largest // 10) * (10 * 48 + 48)  # rows x (entries x 48 bytes + 48 bytes a step): plan and schedule
    check_plan_size(config, data, memory_bytes=needed)
    with pytest.raises(ConfigError, match=f"largest client \\({largest:,} examples: 3 epochs"):
        check_plan_size(config, data, memory_bytes=needed - 1)


def test_plan_estimate_counts_every_client_a_round_trains_together():
    """A wave builds its clients' plans together: steps=10**8 passed a 23.5 GiB machine as one client's 7.45 GiB plan, and
    a round of three was killed at 23.2 GiB of RSS."""
    config = load_config(
        SMALL, ["client.epochs=3", "client.batch_size=10", "sampling.participation=0.6"]
    )  # 3 of 5 a round
    data = build_dataset(config.data, config.seed)
    largest = int(data.client_sizes.max())
    one = 3 * -(-largest // 10) * (10 * 48 + 48)
    check_plan_size(config, data, memory_bytes=3 * one)
    with pytest.raises(ConfigError, match=r"3 epochs x .*\) for each of the 3 clients a round trains together"):
        check_plan_size(config, data, memory_bytes=3 * one - 1)


def test_model_memory_is_counted_without_allocating_it():
    started = time.perf_counter()
    message = _run_error("model.name=mlp", "model.hidden=[60000, 60000, 60000]")
    assert time.perf_counter() - started < 30
    assert "model 'mlp'" in message and "7,204,380,010 parameters" in message and "model.hidden" in message


def test_capped_synthetic_clients_are_sized_by_their_cap():
    uncapped = load_config(SMALL, ["data.name=synthetic", "data.num_clients=100000"])
    capped = load_config(SMALL, ["data.name=synthetic", "data.num_clients=100000", "data.samples_per_client=10"])
    with pytest.raises(ConfigError, match="data.num_clients"):
        check_sizes(uncapped, memory_bytes=24 * 2**30)
    check_sizes(capped, memory_bytes=24 * 2**30)  # 100,000 devices of at most 10 samples: about 1.4 GB
    with pytest.raises(ConfigError, match="data.num_clients"):
        check_sizes(capped, memory_bytes=2**30)
