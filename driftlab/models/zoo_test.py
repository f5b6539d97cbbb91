"""The model zoo: parameter counts against hand computations, output shapes, both training backends."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from driftlab.models import MODEL_NAMES, build_model
from driftlab.models.zoo import (
    CharGRU,
    CharLSTM,
    FedDynCNN,
    FemnistCNN,
    femnist_cnn_module,
    resnet18_batchnorm,
    resnet18_groupnorm,
    vgg11,
)
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import (
    ClientTask,
    LocalSettings,
    SequentialBackend,
    TrainingData,
    batch_plan,
)
from driftlab.simulation.backends.vectorized import VectorizedBackend
from driftlab.simulation.seam import NO_CORRECTION, GradientCorrection


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def _conv(c_in: int, c_out: int, k: int, bias: bool = True) -> int:
    return c_in * c_out * k * k + (c_out if bias else 0)


# ------------------------------------------------------------------ parameter counts


def test_mlp_emnist_l_parameter_count():
    # 784-100-100-10 (FedDyn EMNIST-L)
    expected = (784 * 100 + 100) + (100 * 100 + 100) + (100 * 10 + 10)
    assert expected == 89_610
    assert _count(build_model("mlp", (1, 28, 28), 10, hidden=(100, 100))) == expected


def test_feddyn_cnn_parameter_count():
    # conv 3->64 5x5: 3*64*25 + 64 = 4,864; conv 64->64 5x5: 64*64*25 + 64 = 102,464
    # fc 1600->384: 614,784; 384->192: 73,920; 192->10: 1,930
    expected = (3 * 64 * 25 + 64) + (64 * 64 * 25 + 64) + (1600 * 384 + 384) + (384 * 192 + 192) + (192 * 10 + 10)
    assert expected == 797_962
    assert _count(FedDynCNN(10)) == expected
    assert _count(build_model("cnn", (3, 32, 32), 10)) == expected
    assert _count(FedDynCNN(100)) == expected - (192 * 10 + 10) + (192 * 100 + 100)


def test_femnist_cnn_parameter_count():
    # 28x28, no padding: 26 -> pool 13 -> 11 -> pool 5, flattened 64*5*5 = 1600
    # conv 1->32 3x3: 1*32*9 + 32 = 320; conv 32->64 3x3: 32*64*9 + 64 = 18,496
    # fc 1600->512: 819,712; fc 512->62: 31,806
    expected = (1 * 32 * 9 + 32) + (32 * 64 * 9 + 64) + (1600 * 512 + 512) + (512 * 62 + 62)
    assert expected == 870_334
    assert _count(FemnistCNN()) == expected
    assert _count(build_model("femnist_cnn", (784,), 62)) == expected
    assert _count(build_model("femnist_cnn", (1, 28, 28), 62)) == expected
    # "same" padding: 28 -> 14 -> 7, flattened 64*7*7 = 3136
    assert _count(FemnistCNN(padding=1)) == expected - 1600 * 512 + 3136 * 512


@pytest.mark.parametrize("hidden, expected", [(100, 133_520), (256, 819_920)])
def test_char_lstm_parameter_count(hidden, expected):
    # embedding 80x8; LSTM layer: 4h(in + h) + 8h (PyTorch keeps two bias vectors); fc h->80
    embedding = 80 * 8
    layer1 = 4 * hidden * (8 + hidden) + 8 * hidden
    layer2 = 4 * hidden * (hidden + hidden) + 8 * hidden
    fc = hidden * 80 + 80
    assert embedding + layer1 + layer2 + fc == expected
    assert _count(CharLSTM(hidden=hidden)) == expected
    assert _count(build_model("lstm", (80,), 80, rnn_hidden=hidden)) == expected


def test_build_model_lstm_defaults_to_feddyn_hidden_100_and_gru_to_256():
    assert build_model("lstm", (80,), 80).rnn.hidden_size == 100
    assert build_model("gru", (80,), 80).rnn.hidden_size == 256


def test_char_gru_parameter_count():
    # embedding 80x8; GRU layer: 3h(in + h) + 6h; two layers of 256; fc 256->80
    h = 256
    expected = 80 * 8 + (3 * h * (8 + h) + 6 * h) + (3 * h * (h + h) + 6 * h) + (h * 80 + 80)
    assert expected == 620_240
    assert _count(CharGRU()) == expected
    assert _count(build_model("gru", (80,), 80)) == expected
    # the decaying-K paper's 77-character vocabulary
    assert _count(CharGRU(vocab_size=77)) == expected - 3 * 8 - 3 * 256 - 3


def _resnet18_expected(num_classes: int, stem_kernel: int, width: int = 64) -> int:
    gn = lambda c: 2 * c  # noqa: E731 - GroupNorm: a weight and a bias per channel
    stem = _conv(3, width, stem_kernel, bias=False) + gn(width)
    total = stem
    c_in = width
    for c_out in (width, 2 * width, 4 * width, 8 * width):
        first = _conv(c_in, c_out, 3, False) + gn(c_out) + _conv(c_out, c_out, 3, False) + gn(c_out)
        if c_in != c_out:  # 1x1 stride-2 projection shortcut with its norm
            first += _conv(c_in, c_out, 1, False) + gn(c_out)
        second = 2 * (_conv(c_out, c_out, 3, False) + gn(c_out))
        total += first + second
        c_in = c_out
    return total + _linear(8 * width, num_classes)


def test_resnet18_groupnorm_parameter_count():
    # layer by layer: stem 1,728 + 128; layer1 147,968; layer2 525,568; layer3 2,099,712; layer4 8,393,728; fc 5,130
    assert 1728 + 128 + 147_968 + 525_568 + 2_099_712 + 8_393_728 + 5_130 == 11_173_962
    assert _resnet18_expected(10, 3) == 11_173_962
    model = resnet18_groupnorm(10)
    assert _count(model) == 11_173_962
    # FedDyn's torchvision layout: the 7x7 stem adds 3*64*(49 - 9) = 7,680 parameters (torchvision resnet18 with a 10-way fc)
    assert _count(resnet18_groupnorm(10, stem="imagenet")) == _resnet18_expected(10, 7) == 11_181_642
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 20 and all(m.num_groups == 2 for m in norms)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert _count(build_model("resnet18_gn", (3, 32, 32), 10)) == 11_173_962


def test_resnet18_batchnorm_parameter_count_and_buffers():
    # BatchNorm has a weight and a bias per channel, as GroupNorm: torchvision's resnet18 with a 10-way head.
    model = resnet18_batchnorm(10)
    assert _count(model) == _resnet18_expected(10, 3) == 11_173_962
    assert _count(resnet18_batchnorm(10, stem="imagenet")) == _resnet18_expected(10, 7) == 11_181_642
    assert _count(build_model("resnet18_bn", (3, 32, 32), 10)) == 11_173_962
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 20 and not any(isinstance(m, nn.GroupNorm) for m in model.modules())
    # Buffers: a running mean and variance per channel of each norm, and its num_batches_tracked.
    channels = sum(m.num_features for m in norms)
    assert sum(b.numel() for b in model.buffers()) == 2 * channels + 20
    # The layers' names are torchvision's, norms under ``bn``: a torchvision state_dict's keys.
    assert {"bn1.running_mean", "layer2.0.downsample.1.running_var", "fc.weight"} <= set(model.state_dict())


def test_both_resnets_build_the_same_convolutions_from_a_seed():
    torch.manual_seed(0)
    grouped = resnet18_groupnorm(10, width=8)
    torch.manual_seed(0)
    batched = resnet18_batchnorm(10, width=8)
    for (name, theirs), (other, ours) in zip(grouped.named_parameters(), batched.named_parameters(), strict=True):
        assert name == other and torch.equal(theirs, ours)


def test_vgg11_parameter_count():
    # features: 3->64, 64->128, 128->256, 256->256, 256->512, 512->512 x 3 (3x3, with biases)
    features = (
        _conv(3, 64, 3)
        + _conv(64, 128, 3)
        + _conv(128, 256, 3)
        + _conv(256, 256, 3)
        + _conv(256, 512, 3)
        + 3 * _conv(512, 512, 3)
    )
    assert features == 1_792 + 73_856 + 295_168 + 590_080 + 1_180_160 + 3 * 2_359_808 == 9_220_480
    classifier = _linear(512, 512) + _linear(512, 512) + _linear(512, 100)
    assert features + classifier == 9_797_092
    assert _count(vgg11(100)) == 9_797_092
    assert _count(build_model("vgg11", (3, 32, 32), 10)) == 9_797_092 - _linear(512, 100) + _linear(512, 10)
    assert not any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout)) for m in vgg11(10).modules())


# ------------------------------------------------------------------ forward shapes


@pytest.mark.parametrize(
    "name, input_shape, num_classes, kwargs, dtype",
    [
        ("cnn", (3, 32, 32), 10, {}, torch.float32),
        ("cnn", (3, 32, 32), 100, {}, torch.float32),
        ("femnist_cnn", (784,), 62, {}, torch.float32),
        ("lstm", (80,), 80, {}, torch.long),
        ("lstm", (80,), 80, dict(rnn_hidden=256), torch.long),
        ("gru", (80,), 80, {}, torch.long),
        ("resnet18_gn", (3, 32, 32), 10, dict(width=8), torch.float32),
        ("resnet18_gn", (3, 32, 32), 10, dict(width=8, resnet_stem="imagenet"), torch.float32),
        ("vgg11", (3, 32, 32), 100, dict(width=4), torch.float32),
    ],
)
def test_forward_shapes(name, input_shape, num_classes, kwargs, dtype):
    torch.manual_seed(0)
    model = build_model(name, input_shape, num_classes, **kwargs)
    if dtype == torch.long:
        inputs = torch.randint(0, 80, (3, *input_shape))
    else:
        inputs = torch.randn(3, *input_shape)
    outputs = model(inputs)
    assert outputs.shape == (3, num_classes)
    assert torch.isfinite(outputs).all()


def test_femnist_cnn_with_same_padding_keeps_its_shapes():
    # "same" padding is not a config key (the papers' FEMNIST CNN is "valid"): the stacked layers' tests build it
    torch.manual_seed(0)
    outputs = femnist_cnn_module((1, 28, 28), 62, padding=1)(torch.randn(3, 1, 28, 28))
    assert outputs.shape == (3, 62) and torch.isfinite(outputs).all()


def test_char_models_accept_floating_ids_and_use_the_last_step():
    torch.manual_seed(0)
    model = CharLSTM(vocab_size=10, hidden=6)
    ids = torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(model(ids), model(ids.float()))
    # the output depends on the last character (no bidirectional or pooled readout)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 10
    assert not torch.allclose(model(ids), model(changed))


def test_model_names_and_existing_models_unchanged():
    assert MODEL_NAMES == (
        "mlr",
        "mlp",
        "cnn",
        "femnist_cnn",
        "lstm",
        "gru",
        "resnet18_gn",
        "resnet18_bn",
        "vgg11",
        "quadratic",
    )
    assert _count(build_model("mlr", (1, 28, 28), 10)) == 784 * 10 + 10
    assert _count(build_model("mlp", (1, 28, 28), 10)) == (784 * 200 + 200) + (200 * 200 + 200) + (200 * 10 + 10)
    assert _count(build_model("quadratic", (2,), 1)) == 1


@pytest.mark.parametrize(
    "name, input_shape, kwargs, message",
    [
        ("cnn", (784,), {}, "needs image inputs of shape"),
        ("cnn", (3, 8, 8), {}, "at least 16x16"),
        ("vgg11", (3, 28, 28), {}, "multiples of 32"),
        ("femnist_cnn", (783,), {}, "flat square images"),
        ("lstm", (1, 80), {}, "sequences of character ids"),
        ("resnet18_gn", (3, 32, 32), dict(resnet_stem="tiny"), "stem must be"),
        ("resnet18_gn", (3, 32, 32), dict(width=7), "groups=2 to divide"),
        ("resnet18_bn", (3, 32, 32), dict(resnet_stem="tiny"), "stem must be"),
        ("resnet18_bn", (32, 32), {}, "needs image inputs of shape"),
        ("lstm", (80,), dict(rnn_hidden=-1), "hidden must be a positive integer"),
        ("transformer", (80,), {}, "unknown model 'transformer'"),
    ],
)
def test_build_model_errors(name, input_shape, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_model(name, input_shape, 10, **kwargs)


# ------------------------------------------------------------------ both training backends

# Small versions of every model: (name, input shape, classes, knobs, integer inputs?)
BACKEND_CASES = [
    ("mlp", (1, 6, 6), 5, dict(hidden=(7, 6)), False),
    ("cnn", (3, 16, 16), 5, {}, False),
    ("femnist_cnn", (100,), 5, {}, False),
    ("lstm", (6,), 7, dict(rnn_hidden=5), True),
    ("gru", (6,), 7, dict(rnn_hidden=5), True),
    ("resnet18_gn", (3, 8, 8), 5, dict(width=4), False),
    ("resnet18_gn", (3, 16, 16), 5, dict(width=4, resnet_stem="imagenet"), False),
    ("vgg11", (3, 32, 32), 5, dict(width=2), False),
]
CLIENT_SIZES = (7, 5)


def _round(name, input_shape, num_classes, kwargs, integer_inputs):
    torch.manual_seed(0)
    model = FlatModel.wrap(build_model(name, input_shape, num_classes, **kwargs)).to("cpu", torch.float64)
    generator = torch.Generator().manual_seed(1)
    n = sum(CLIENT_SIZES)
    if integer_inputs:
        inputs = torch.randint(0, num_classes, (n, *input_shape), generator=generator)
    else:
        inputs = torch.randn(n, *input_shape, generator=generator, dtype=torch.float64)
    data = TrainingData(inputs, torch.randint(0, num_classes, (n,), generator=generator))
    start = model.initial_parameters()
    corrections = [
        NO_CORRECTION,
        GradientCorrection(linear=torch.full_like(start, 0.01), quadratic=0.1, reference=start),
    ]
    tasks, offset = [], 0
    for client_id, (size, correction) in enumerate(zip(CLIENT_SIZES, corrections, strict=True)):
        rows = torch.arange(offset, offset + size)
        tasks.append(
            ClientTask(client_id, rows, batch_plan(3, 1, client_id, size, 4, 2), correction)
        )  # 2 steps of batch 4
        offset += size
    return model, start, tasks, LocalSettings(client_lr=0.05), data


@pytest.mark.parametrize("case", BACKEND_CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in BACKEND_CASES])
def test_one_round_agrees_on_both_backends(case, caplog):
    model, start, tasks, settings, data = _round(*case)
    expected = {
        p: (theta.clone(), done) for p, theta, done in SequentialBackend().train(model, start, tasks, settings, data)
    }
    with caplog.at_level(logging.WARNING, logger="driftlab.simulation.backends.vectorized"):
        actual = {
            p: (theta.clone(), done)
            for p, theta, done in VectorizedBackend().train(model, start, tasks, settings, data)
        }
    # Every zoo model takes the vectorized path itself (batched layers: LinearReluStack for the MLP,
    # stacked.StackedNetwork for the rest), so there is no sequential fallback.
    assert not any("sequential" in record.getMessage() for record in caplog.records)
    assert sorted(actual) == sorted(expected) == [0, 1]
    for position, (theta, done) in expected.items():
        assert actual[position][1] == done == 2
        assert not torch.equal(theta, start)  # the round did train
        torch.testing.assert_close(actual[position][0], theta, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("stem", ["cifar", "imagenet"])
def test_resnet18_batchnorm_agrees_on_both_backends_buffers_included(stem, caplog):
    # Its running statistics are state (backends/buffers.py): each client's from the round's, vmapped per client.
    from driftlab.simulation.backends.buffers import RoundBuffers, module_buffers

    size = 16 if stem == "cifar" else 32  # layer4 at 2x2 (cifar) or 1x1 (imagenet)
    knobs = dict(width=4, resnet_stem=stem)
    model, start, tasks, settings, data = _round("resnet18_bn", (3, size, size), 5, knobs, False)
    if stem == "imagenet":  # at 1x1 a batch of one image has one value per channel, which BatchNorm refuses
        tasks = [t for t in tasks if t.num_steps and (t.batches != -1).sum(axis=1).min() > 1]
    results = []
    for backend in (SequentialBackend(), VectorizedBackend()):
        buffers = RoundBuffers(module_buffers(model.module))
        with caplog.at_level(logging.WARNING, logger="driftlab.simulation.backends.vectorized"):
            finals = {p: theta.clone() for p, theta, _ in backend.train(model, start, tasks, settings, data, buffers)}
        results.append((finals, buffers.final))
    assert not caplog.records  # no fallback to the sequential backend
    (finals, buffers), (finals2, buffers2) = results
    for position, theta in finals.items():
        assert not torch.equal(theta, start)
        torch.testing.assert_close(finals2[position], theta, rtol=1e-10, atol=1e-10)
        assert buffers[position]["bn1.num_batches_tracked"].item() == 2
        for name, value in buffers[position].items():
            torch.testing.assert_close(buffers2[position][name], value, rtol=1e-10, atol=1e-10)
