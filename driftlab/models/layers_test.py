"""``layers.conv_unfold`` against ``layers.conv``: the same function, values and gradients, on random inputs; and
``layers.convolution``, which makes ``conv`` compute it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from driftlab.models import layers

# (in, out, kernel, stride, padding, dilation, bias, image): FedDyn's CIFAR CNN's two convolutions on their inputs,
# then strided, padded, dilated and bias-free ones with non-square kernels and images.
SHAPES = [
    (3, 64, 5, 1, 0, 1, True, (32, 32)),
    (64, 64, 5, 1, 0, 1, True, (14, 14)),
    (4, 6, (3, 2), (2, 1), (1, 2), 1, True, (9, 7)),
    (5, 3, 3, 2, 1, (2, 1), False, (11, 8)),
    (2, 4, 1, 3, 0, 1, True, (7, 10)),
]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).norm() / reference.norm()).item()


def stacked(module: nn.Conv2d, clients: int, dtype: torch.dtype, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Each client's own random parameters, ``[C, *shape]`` leaves that take gradients."""
    return {
        name: torch.randn(clients, *p.shape, generator=generator, dtype=dtype).requires_grad_()
        for name, p in module.named_parameters()
    }


def values_and_gradients(function, module, leaves, inputs, cotangent):
    """``function``'s output for the stacked clients and gradients of ``<output, cotangent>`` (input, parameters)."""
    x = inputs.detach().requires_grad_()
    clients = inputs.shape[1] // module.in_channels
    out = function(layers.Images(x, clients), module, layers.Parameters(leaves, clients), "")
    grads = torch.autograd.grad((out.tensor * cotangent).sum(), [x, *leaves.values()])
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda shape: f"{shape[0]}to{shape[1]}-k{shape[2]}-s{shape[3]}-p{shape[4]}"
)
def test_conv_unfold_equals_the_grouped_convolution_in_values_and_gradients(shape, dtype):
    channels, out_channels, kernel, stride, padding, dilation, bias, image = shape
    module = nn.Conv2d(channels, out_channels, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias)
    clients, batch = 3, 2
    generator = torch.Generator().manual_seed(sum(channels * size for size in image))
    leaves = stacked(module, clients, dtype, generator)
    inputs = torch.randn(batch, clients * channels, *image, generator=generator, dtype=dtype)
    grouped = layers.conv(layers.Images(inputs, clients), module, layers.Parameters(leaves, clients), "")
    cotangent = torch.randn(grouped.tensor.shape, generator=generator, dtype=dtype)

    reference, reference_grads = values_and_gradients(layers.conv, module, leaves, inputs, cotangent)
    unfolded, unfolded_grads = values_and_gradients(layers.conv_unfold, module, leaves, inputs, cotangent)

    assert unfolded.clients == clients and unfolded.tensor.shape == reference.tensor.shape
    assert relative_error(unfolded.tensor, reference.tensor) < TOLERANCE[dtype]
    for name, value, expected in zip(["input", *leaves], unfolded_grads, reference_grads, strict=True):
        assert value.shape == expected.shape, name
        assert relative_error(value, expected) < TOLERANCE[dtype], name


def test_conv_unfold_computes_each_clients_own_convolution():
    """Client ``k``'s block of the output is ``nn.Conv2d`` with client ``k``'s weights on client ``k``'s channels."""
    module = nn.Conv2d(2, 3, 3, stride=2, padding=1, dtype=torch.float64)
    clients, generator = 4, torch.Generator().manual_seed(7)
    leaves = stacked(module, clients, torch.float64, generator)
    inputs = torch.randn(5, clients * 2, 9, 9, generator=generator, dtype=torch.float64)
    out = layers.conv_unfold(layers.Images(inputs, clients), module, layers.Parameters(leaves, clients), "").tensor
    for k in range(clients):
        own = torch.func.functional_call(
            module, {name: leaf[k] for name, leaf in leaves.items()}, (inputs[:, 2 * k : 2 * k + 2],)
        )
        assert relative_error(out[:, 3 * k : 3 * k + 3], own) < 1e-12


@pytest.mark.parametrize(
    "module, says",
    [
        (nn.Conv2d(4, 4, 3, groups=2), "groups=2"),
        (nn.Conv2d(2, 2, 3, padding="same"), "padding='same'"),
        (nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "padding_mode='reflect'"),
    ],
)
def test_conv_unfold_refuses_what_it_does_not_compute(module, says):
    leaves = {name: p.detach().unsqueeze(0) for name, p in module.named_parameters()}
    inputs = torch.randn(1, module.in_channels, 6, 6)
    with pytest.raises(ValueError, match="conv_unfold") as raised:
        layers.conv_unfold(layers.Images(inputs, 1), module, layers.Parameters(leaves, 1), "")
    assert says in str(raised.value) and "layers.conv" in str(raised.value)


def test_inside_convolution_unfold_conv_computes_conv_unfold_and_grouped_elsewhere(monkeypatch):
    calls = []
    real = layers.conv_unfold
    monkeypatch.setattr(layers, "conv_unfold", lambda *args: calls.append(args[1]) or real(*args))
    plain, grouped = (
        nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64),
        nn.Conv2d(4, 4, 3, groups=2, dtype=torch.float64),
    )
    generator = torch.Generator().manual_seed(3)
    arguments = {}
    for module in (plain, grouped):
        leaves = stacked(module, 2, torch.float64, generator)
        x = layers.Images(torch.randn(3, 2 * module.in_channels, 6, 6, generator=generator, dtype=torch.float64), 2)
        arguments[module] = (x, module, layers.Parameters(leaves, 2), "")
        outside = layers.conv(*arguments[module]).tensor
        with layers.convolution("unfold"):
            inside = layers.conv(*arguments[module]).tensor
        assert relative_error(inside, outside) < 1e-12
    # the plain convolution was unfolded once, inside the context; the grouped one (groups=2 per client) never
    assert calls == [plain]
    with layers.convolution("grouped"):
        layers.conv(*arguments[plain])
    assert calls == [plain]


def test_the_convolution_setting_is_this_threads_own_and_refuses_unknown_kinds():
    import threading

    seen = []
    with layers.convolution("unfold"):
        worker = threading.Thread(target=lambda: seen.append(layers._CONVOLUTION.get()))
        worker.start()
        worker.join()
        seen.append(layers._CONVOLUTION.get())
    assert seen == ["grouped", "unfold"] and layers._CONVOLUTION.get() == "grouped"
    with pytest.raises(ValueError, match="grouped, unfold, got 'im2col'"):
        with layers.convolution("im2col"):
            pass
