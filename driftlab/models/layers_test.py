"""``layers.conv`` under every ``layers.convolution`` choice (``conv_unfold``, channels-last tensors, ``mixed``) against
the grouped convolution: the same function, values and gradients, on random inputs and through FedDyn's CNN; and
``layers.convolution`` itself, which says which layers ``conv`` unfolds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from driftlab.models import batched, build_model, layers

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


def values_and_gradients(kind, module, leaves, inputs, cotangent):
    """``layers.conv`` under ``convolution(kind)`` for the stacked clients and the gradients of ``<output, cotangent>``
    (input, parameters)."""
    x = inputs.detach().requires_grad_()
    clients = inputs.shape[1] // module.in_channels
    with layers.convolution(kind):
        out = layers.conv(layers.Images(x, clients), module, layers.Parameters(leaves, clients), "")
    grads = torch.autograd.grad((out.tensor * cotangent).sum(), [x, *leaves.values()])
    return out, grads


def assert_close(value, reference, dtype: torch.dtype) -> None:
    """Outputs ``(tensor, gradients)`` agree to ``TOLERANCE[dtype]`` relative, leaf by leaf."""
    assert value[0].shape == reference[0].shape
    assert relative_error(value[0], reference[0]) < TOLERANCE[dtype]
    for index, (grad, expected) in enumerate(zip(value[1], reference[1], strict=True)):
        assert grad.shape == expected.shape, index
        assert relative_error(grad, expected) < TOLERANCE[dtype], index


@pytest.mark.parametrize("kind", [kind for kind in layers.CONVOLUTIONS if kind != "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda shape: f"{shape[0]}to{shape[1]}-k{shape[2]}-s{shape[3]}-p{shape[4]}"
)
def test_every_convolution_choice_equals_the_grouped_convolution_in_values_and_gradients(shape, dtype, kind):
    channels, out_channels, kernel, stride, padding, dilation, bias, image = shape
    module = nn.Conv2d(channels, out_channels, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias)
    clients, batch = 3, 2
    generator = torch.Generator().manual_seed(sum(channels * size for size in image))
    leaves = stacked(module, clients, dtype, generator)
    inputs = torch.randn(batch, clients * channels, *image, generator=generator, dtype=dtype)
    grouped = layers.conv(layers.Images(inputs, clients), module, layers.Parameters(leaves, clients), "")
    cotangent = torch.randn(grouped.tensor.shape, generator=generator, dtype=dtype)

    reference = values_and_gradients("grouped", module, leaves, inputs, cotangent)
    variant = values_and_gradients(kind, module, leaves, inputs, cotangent)

    assert variant[0].clients == clients
    assert_close((variant[0].tensor, variant[1]), (reference[0].tensor, reference[1]), dtype)
    if kind == "channels_last":  # computed in that layout, not converted back
        assert variant[0].tensor.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
@pytest.mark.parametrize("kind", layers.CONVOLUTIONS[1:])
def test_feddyns_cnn_computes_the_same_under_every_convolution_choice(kind, device):
    """The whole batched forward (pooling, ReLU, the flatten into the linear layers) and its gradients in float64."""
    module = build_model("cnn", (3, 16, 16), 10).double().to(device)
    clients, generator = 2, torch.Generator().manual_seed(11)
    leaves = {
        name: leaf.detach().to(device).requires_grad_()
        for name, leaf in stacked(module, clients, torch.float64, generator).items()
    }
    inputs = torch.randn(clients, 3, 3, 16, 16, generator=generator, dtype=torch.float64).to(device)
    cotangent = torch.randn(clients, 3, 10, generator=generator, dtype=torch.float64).to(device)
    results = {}
    for choice in ("grouped", kind):
        with layers.convolution(choice):
            out = batched.feddyn_cnn(module, layers.Parameters(leaves, clients), inputs)
        results[choice] = out, torch.autograd.grad((out * cotangent).sum(), list(leaves.values()))
    assert_close(results[kind], results["grouped"], torch.float64)


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


PLAIN, RGB, GROUPED = (
    nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64),
    nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64),
    nn.Conv2d(4, 4, 3, groups=2, dtype=torch.float64),
)


@pytest.mark.parametrize(
    "kind, unfolded",
    [("grouped", []), ("unfold", [PLAIN, RGB]), ("channels_last", []), ("mixed", [RGB])],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_conv_unfolds_the_layers_its_convolution_choice_names_and_no_others(monkeypatch, kind, unfolded):
    calls = []
    real = layers.conv_unfold
    monkeypatch.setattr(layers, "conv_unfold", lambda *args: calls.append(args[1]) or real(*args))
    generator = torch.Generator().manual_seed(3)
    for module in (PLAIN, RGB, GROUPED):
        leaves = stacked(module, 2, torch.float64, generator)
        x = layers.Images(torch.randn(3, 2 * module.in_channels, 6, 6, generator=generator, dtype=torch.float64), 2)
        arguments = (x, module, layers.Parameters(leaves, 2), "")
        outside = layers.conv(*arguments).tensor
        with layers.convolution(kind):
            inside = layers.conv(*arguments).tensor
            assert layers.unfolds(module) == (module in unfolded) == layers.unfolds(module, kind)
        assert relative_error(inside, outside) < 1e-12
    # each named layer was unfolded once, inside the context; the grouped one (groups=2 per client) never
    assert calls == unfolded


def test_the_convolution_setting_is_this_threads_own_and_refuses_unknown_kinds():
    import threading

    seen = []
    with layers.convolution("unfold"):
        worker = threading.Thread(target=lambda: seen.append(layers._CONVOLUTION.get()))
        worker.start()
        worker.join()
        seen.append(layers._CONVOLUTION.get())
    assert seen == ["grouped", "unfold"] and layers._CONVOLUTION.get() == "grouped"
    with pytest.raises(
        ValueError, match="convolution must be one of grouped, unfold, channels_last, mixed, got 'im2col'"
    ):
        with layers.convolution("im2col"):
            pass
