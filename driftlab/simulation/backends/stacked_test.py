"""The batched layers of ``stacked.py`` against the module itself, client by client (float64, so to 1e-12).

Each client of a stack gets its own parameters, inputs, targets and example
weights; the stacked gradient of client ``k`` must be the gradient of
``Σ_i w_ki ℓ(module(θ_k; x_ki), y_ki)`` computed with the module alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from driftlab.models import build_model
from driftlab.models.zoo import femnist_cnn_module
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import (
    ClientTask,
    LocalSettings,
    SequentialBackend,
    TrainingData,
    batch_plan,
)
from driftlab.simulation.backends.stacked import StackedNetwork, has_convolutions, has_recurrent_layers
from driftlab.simulation.backends.vectorized import VectorizedBackend, auto_backend, gradient_engine
from driftlab.simulation.backends.vectorized_plan import bytes_per_client
from driftlab.simulation.seam import NO_CORRECTION, GradientCorrection

# (id, module factory, one example's input shape or ("ids", length, vocabulary), classes)
CASES = [
    ("feddyn_cnn", lambda: build_model("cnn", (3, 16, 16), 5), (3, 16, 16), 5),
    ("femnist_cnn_flat", lambda: build_model("femnist_cnn", (144,), 6), (144,), 6),
    ("femnist_cnn_same", lambda: femnist_cnn_module((1, 12, 12), 6, padding=1), (1, 12, 12), 6),
    ("resnet18_gn_cifar", lambda: build_model("resnet18_gn", (3, 8, 8), 5, width=4), (3, 8, 8), 5),
    (
        "resnet18_gn_imagenet",
        lambda: build_model("resnet18_gn", (3, 16, 16), 5, width=4, resnet_stem="imagenet"),
        (3, 16, 16),
        5,
    ),
    ("vgg11", lambda: build_model("vgg11", (3, 32, 32), 5, width=2), (3, 32, 32), 5),
    ("lstm", lambda: build_model("lstm", (7,), 9, rnn_hidden=6), ("ids", 7, 9), 9),
    ("lstm_3_layers", lambda: build_model("lstm", (5,), 9, rnn_hidden=4, rnn_layers=3), ("ids", 5, 9), 9),
    ("gru", lambda: build_model("gru", (7,), 9, rnn_hidden=6), ("ids", 7, 9), 9),
    ("mlp", lambda: build_model("mlp", (1, 6, 6), 5, hidden=(7, 6)), (1, 6, 6), 5),
    ("mlr", lambda: build_model("mlr", (1, 6, 6), 5), (1, 6, 6), 5),
    (
        "sequential_conv_groupnorm",
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1, bias=False),
            nn.GroupNorm(2, 4),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 4, 3, stride=2, groups=2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, 5),
        ),
        (2, 8, 8),
        5,
    ),
    (
        "sequential_flatten_mlp",
        lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3)),
        (3, 4),
        3,
    ),
]


def _flat(factory) -> FlatModel:
    torch.manual_seed(0)
    return FlatModel.wrap(factory()).to("cpu", torch.float64)


def _inputs(shape, count: int, generator: torch.Generator) -> torch.Tensor:
    if shape[0] == "ids":
        return torch.randint(0, shape[2], (count, shape[1]), generator=generator)
    return torch.randn(count, *shape, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=pytest.mark.slow) if case[0].startswith("resnet") else case for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_each_clients_stacked_gradient_is_its_own_gradient(case):
    _, factory, shape, classes = case
    model = _flat(factory)
    engine = StackedNetwork.match(model)
    assert engine is not None
    generator = torch.Generator().manual_seed(1)
    clients, batch = 3, 4
    theta = model.initial_parameters().repeat(clients, 1)
    theta += 0.05 * torch.randn(theta.shape, generator=generator, dtype=torch.float64)  # every client different
    x = _inputs(shape, clients * batch, generator).reshape(clients, batch, *_inputs(shape, 1, generator).shape[1:])
    targets = torch.randint(0, classes, (clients, batch), generator=generator)
    weights = torch.rand(clients, batch, generator=generator, dtype=torch.float64)
    weights[1, -1] = 0.0  # a padding slot
    out = torch.full_like(theta, float("nan"))
    engine.loss_gradient(theta, x, targets, weights, out)
    for k in range(clients):
        theta_k = theta[k].clone().requires_grad_()
        loss = (model.example_loss(model.forward(theta_k, x[k]), targets[k]) * weights[k]).sum()
        (expected,) = torch.autograd.grad(loss, theta_k)
        torch.testing.assert_close(out[k], expected, rtol=1e-12, atol=1e-12)


def test_the_stacked_gradient_leaves_the_parameters_untouched():
    model = _flat(CASES[0][1])
    theta = model.initial_parameters().repeat(2, 1)
    before = theta.clone()
    x = torch.randn(2, 3, 3, 16, 16, dtype=torch.float64)
    StackedNetwork.match(model).loss_gradient(
        theta, x, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.float64), torch.empty_like(theta)
    )
    assert torch.equal(theta, before)


@pytest.mark.parametrize(
    "module",
    [
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3)),  # no batched Tanh
        nn.Sequential(
            nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 6 * 6, 3)
        ),  # running statistics
        nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="circular"), nn.Flatten(), nn.Linear(2 * 8 * 8, 3)),
        nn.Sequential(nn.Flatten(start_dim=2), nn.Linear(4, 3)),
    ],
    ids=["tanh", "batchnorm", "circular_padding", "partial_flatten"],
)
def test_modules_without_an_exact_batched_form_are_not_matched(module):
    assert StackedNetwork.match(FlatModel.wrap(module)) is None


def test_recurrent_settings_without_a_batched_form_and_frozen_parameters_are_not_matched():
    bidirectional = build_model("lstm", (5,), 9, rnn_hidden=4)
    bidirectional.rnn = nn.LSTM(8, 4, num_layers=2, batch_first=True, bidirectional=True)
    assert StackedNetwork.match(FlatModel.wrap(bidirectional)) is None
    dropout = build_model("gru", (5,), 9, rnn_hidden=4)
    dropout.rnn = nn.GRU(8, 4, num_layers=2, batch_first=True, dropout=0.5)
    assert StackedNetwork.match(FlatModel.wrap(dropout)) is None
    frozen = build_model("cnn", (3, 16, 16), 5)
    frozen.conv1.weight.requires_grad_(False)
    assert StackedNetwork.match(FlatModel.wrap(frozen)) is None


class _Subclass(type(build_model("cnn", (3, 16, 16), 5))):
    def forward(self, inputs):  # a subclass may compute something else: not recognised
        return super().forward(inputs) * 2


def test_a_subclass_of_a_zoo_model_is_not_matched():
    assert StackedNetwork.match(FlatModel.wrap(_Subclass(5, 3, 16))) is None


# ------------------------------------------------------------------ whole rounds on both backends

CORRECTIONS = ("none", "linear", "quadratic_scalar", "quadratic_tensor", "mixed")
SIZES = (9, 4, 13)  # unequal clients: padded last batches and unequal step counts


def _corrections(kind: str, start: torch.Tensor) -> list[GradientCorrection]:
    generator = torch.Generator().manual_seed(2)

    def vector(scale: float) -> torch.Tensor:
        return torch.randn(start.numel(), generator=generator, dtype=start.dtype) * scale

    if kind == "none":
        return [NO_CORRECTION] * 3
    if kind == "linear":
        return [GradientCorrection(linear=vector(0.05)) for _ in range(3)]
    if kind == "quadratic_scalar":
        reference = start + vector(0.01)
        return [GradientCorrection(quadratic=0.3 + 0.1 * k, reference=reference) for k in range(3)]
    if kind == "quadratic_tensor":
        return [GradientCorrection(quadratic=vector(0.2).abs(), reference=start + vector(0.01)) for _ in range(3)]
    return [
        NO_CORRECTION,
        GradientCorrection(linear=vector(0.05), quadratic=0.5, reference=start),
        GradientCorrection(quadratic=vector(0.2).abs(), reference=start),
    ]


def _round_setup(case_id: str, kind: str):
    _, factory, shape, classes = next(case for case in CASES if case[0] == case_id)
    model = _flat(factory)
    generator = torch.Generator().manual_seed(3)
    n = sum(SIZES)
    data = TrainingData(_inputs(shape, n, generator), torch.randint(0, classes, (n,), generator=generator))
    start = model.initial_parameters()
    tasks, offset = [], 0
    for client_id, (size, correction) in enumerate(zip(SIZES, _corrections(kind, start), strict=True)):
        steps = 2 * -(-size // 4) - client_id  # unequal work: client 1 and 2 stop short of two epochs
        tasks.append(
            ClientTask(
                client_id, torch.arange(offset, offset + size), batch_plan(5, 1, client_id, size, 4, steps), correction
            )
        )
        offset += size
    return model, start, tasks, data


@pytest.mark.parametrize("case_id", ["sequential_conv_groupnorm", "gru"])
@pytest.mark.parametrize(
    "kind", [kind if kind == "mixed" else pytest.param(kind, marks=pytest.mark.slow) for kind in CORRECTIONS]
)
@pytest.mark.parametrize("clip_norm", [None, 0.3], ids=["noclip", "clip"])
def test_a_round_with_corrections_clipping_and_weight_decay_matches_the_sequential_backend(case_id, kind, clip_norm):
    model, start, tasks, data = _round_setup(case_id, kind)
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=clip_norm)
    expected = {p: (t.clone(), d) for p, t, d in SequentialBackend().train(model, start, tasks, settings, data)}
    for backend in (VectorizedBackend(), VectorizedBackend(max_chunk_clients=3, parallel_chunks=False)):
        actual = {p: (t.clone(), d) for p, t, d in backend.train(model, start, tasks, settings, data)}
        assert sorted(actual) == [0, 1, 2]
        for position, (theta, done) in expected.items():
            assert actual[position][1] == done
            torch.testing.assert_close(actual[position][0], theta, rtol=1e-12, atol=1e-12)


def test_zoo_models_take_batched_layers_and_auto_follows_the_measured_rule():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for case_id, factory, _, _ in CASES:
        model = _flat(factory)
        assert gradient_engine(model) is not None, case_id
        assert auto_backend(model, cpu) == "vectorized"
        # on a GPU a recurrent network trains one client at a time (the batched recurrence lost to cuDNN per client)
        assert auto_backend(model, gpu) == ("sequential" if has_recurrent_layers(model.module) else "vectorized"), (
            case_id
        )
    assert {auto_backend(_flat(factory), gpu) for _, factory, _, _ in CASES} == {"sequential", "vectorized"}
    other = FlatModel.wrap(nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
    assert gradient_engine(other) is None
    assert auto_backend(other, cpu) == "sequential"  # its vmap path is slower than one by one on a CPU
    assert auto_backend(other, gpu) == "vectorized"
    assert has_convolutions(_flat(CASES[0][1]).module) and not has_convolutions(_flat(CASES[6][1]).module)


def test_on_a_cpu_convolutional_and_recurrent_networks_train_one_client_per_chunk_and_the_others_batch():
    backend = VectorizedBackend(parallel_chunks=False)
    for case_id in ("sequential_conv_groupnorm", "gru"):
        model, start, tasks, data = _round_setup(case_id, "none")
        assert backend.chunk_size(gradient_engine(model), model, start, tasks, data) == 1, case_id
    model, start, tasks, data = _round_setup("sequential_flatten_mlp", "none")
    engine = gradient_engine(model, precision="bf16")  # a Linear/ReLU stack on the stacked layers
    assert isinstance(engine, StackedNetwork)
    assert backend.chunk_size(engine, model, start, tasks, data) == 3


def test_one_client_chunks_on_parallel_threads_use_their_own_module_copy():
    # functional_call swaps a module's parameters while it runs; two threads sharing one module would mix clients.
    model, start, tasks, data = _round_setup("gru", "mixed")
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01)
    expected = {p: t.clone() for p, t, _ in SequentialBackend().train(model, start, tasks, settings, data)}
    backend = VectorizedBackend(max_chunk_clients=1)
    assert backend.workers(start, len(tasks)) == min(torch.get_num_threads(), len(tasks))
    for _ in range(3):
        actual = {p: t.clone() for p, t, _ in backend.train(model, start, tasks, settings, data)}
        for position, theta in expected.items():
            torch.testing.assert_close(actual[position], theta, rtol=1e-12, atol=1e-12)


def test_a_sequential_the_batched_layers_would_misread_falls_back_to_vmap_and_still_agrees(caplog):
    import logging

    # nn.Linear on [B, C, H, W] acts on the last axis: no Flatten, so the batched layers must not take it.
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Linear(8, 4), nn.Flatten(), nn.Linear(3 * 8 * 4, 5)
    )
    model = FlatModel.wrap(module).to("cpu", torch.float64)
    generator = torch.Generator().manual_seed(1)
    data = TrainingData(
        torch.randn(12, 2, 8, 8, generator=generator, dtype=torch.float64),
        torch.randint(0, 5, (12,), generator=generator),
    )
    start = model.initial_parameters()
    tasks = [
        ClientTask(k, torch.arange(6 * k, 6 * k + 6), batch_plan(0, 1, k, 6, 3, 2), NO_CORRECTION) for k in range(2)
    ]
    settings = LocalSettings(client_lr=0.1)
    backend = VectorizedBackend(max_chunk_clients=2, parallel_chunks=False)
    with caplog.at_level(logging.WARNING, logger="driftlab.simulation.backends.vectorized"):
        actual = {p: t.clone() for p, t, _ in backend.train(model, start, tasks, settings, data)}
    assert any("using vmap" in record.getMessage() for record in caplog.records)
    expected = {p: t.clone() for p, t, _ in SequentialBackend().train(model, start, tasks, settings, data)}
    for position, theta in expected.items():
        torch.testing.assert_close(actual[position], theta, rtol=1e-12, atol=1e-12)


def test_a_sequential_with_embeddings_or_recurrent_layers_is_not_read_layer_by_layer():
    assert (
        StackedNetwork.match(FlatModel.wrap(nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 3)))) is None
    )


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_the_batched_layers_are_checked_against_the_module_in_float32_whatever_the_precision(monkeypatch, precision):
    # On a GPU the check ran under cuDNN's default TF32 convolutions and ResNet-18-GN failed it (H200, issue 24, the
    # likely cause): it compares two layouts of one function, so it runs in float32 (TF32 off, no autocast).
    import contextlib

    from driftlab.simulation.backends import vectorized

    contexts, seen = [], []
    real = vectorized.local_arithmetic

    @contextlib.contextmanager
    def recorded(precision_, device):
        contexts.append(precision_)
        try:
            with real(precision_, device):
                yield
        finally:
            contexts.pop()

    def probe(*_args):
        seen.append((list(contexts), torch.is_autocast_enabled("cpu")))
        return None

    monkeypatch.setattr(vectorized, "local_arithmetic", recorded)
    monkeypatch.setattr(vectorized, "stacked_problem", probe)
    model, start, tasks, data = _round_setup("sequential_conv_groupnorm", "none")
    model.to("cpu", torch.float32)
    data = TrainingData(data.inputs.float(), data.targets)
    list(
        VectorizedBackend(precision=precision, max_chunk_clients=3).train(
            model, start.float(), tasks, LocalSettings(client_lr=0.1), data
        )
    )
    assert seen == [(["float32"], False)]


@pytest.mark.parametrize("case_id", ["feddyn_cnn", "sequential_conv_groupnorm"])
def test_unfold_convolutions_train_the_round_the_sequential_backend_does(case_id, monkeypatch):
    # convolution="unfold" (the config's convolution): chunks of several clients compute their convolutions by im2col
    # and a matrix product per client, on the chunk's own thread; a groups=2 convolution stays grouped.
    from driftlab.models import layers

    unfolded = []
    real = layers.conv_unfold
    monkeypatch.setattr(layers, "conv_unfold", lambda *args: unfolded.append(args[1]) or real(*args))
    model, start, tasks, data = _round_setup(case_id, "mixed")
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=0.3)
    expected = {p: (t.clone(), d) for p, t, d in SequentialBackend().train(model, start, tasks, settings, data)}
    for backend in (
        VectorizedBackend(max_chunk_clients=3, parallel_chunks=False, convolution="unfold"),
        VectorizedBackend(
            max_chunk_clients=2, convolution="unfold"
        ),  # chunks of 2 and 1, on worker threads where torch has 2
    ):
        unfolded.clear()
        actual = {p: (t.clone(), d) for p, t, d in backend.train(model, start, tasks, settings, data)}
        for position, (theta, done) in expected.items():
            assert actual[position][1] == done
            torch.testing.assert_close(actual[position][0], theta, rtol=1e-12, atol=1e-12)
        convolutions = [m for m in model.module.modules() if isinstance(m, nn.Conv2d)]
        assert unfolded and set(unfolded) == {m for m in convolutions if m.groups == 1}
    with pytest.raises(ValueError, match="convolution must be one of grouped, unfold"):
        VectorizedBackend(convolution="winograd")


def test_a_chunk_of_unfold_convolutions_budgets_for_their_patch_columns():
    model, start, tasks, data = _round_setup("feddyn_cnn", "none")
    engine = gradient_engine(model)
    grouped = bytes_per_client(engine, model, start, tasks, data)
    unfolded = bytes_per_client(engine, model, start, tasks, data, "unfold")
    # FedDyn's CNN on 3x16x16 inputs: conv1 (3 in, 5x5) at 12x12 positions, conv2 (64 in, 5x5) at 2x2; two copies each,
    # per example of a batch of 4, in float64
    columns = 2 * (3 * 25 * 12 * 12 + 64 * 25 * 2 * 2)
    assert unfolded - grouped == 4 * columns * 8
    mlp = _round_setup("mlp", "none")
    assert bytes_per_client(gradient_engine(mlp[0]), *mlp, "unfold") == bytes_per_client(gradient_engine(mlp[0]), *mlp)


def test_the_patch_columns_counted_are_those_of_the_layers_the_convolution_choice_unfolds():
    # FedDyn's CNN on 3x16x16 inputs: conv1 (3 -> 64, 5x5) has 12x12 outputs; after a 2x2 pool conv2 (64 -> 64, 5x5)
    # has 2x2. The chunk budget counts 2 · in · kh · kw · positions per layer that the choice computes by im2col.
    model = FlatModel.wrap(build_model("cnn", (3, 16, 16), 5))
    engine = StackedNetwork.match(model)
    theta = model.initial_parameters().unsqueeze(0)
    first, second = 2 * 3 * 25 * 12**2, 2 * 64 * 25 * 2**2
    example = torch.randn(3, 16, 16)
    assert engine.unfold_elements(example, theta, "grouped") == 0
    assert engine.unfold_elements(example, theta, "channels_last") == 0
    assert engine.unfold_elements(example, theta, "mixed") == first  # only the 3-channel first layer
    assert engine.unfold_elements(example, theta, "unfold") == first + second
