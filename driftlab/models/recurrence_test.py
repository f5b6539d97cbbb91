"""``layers.LSTMRecurrence`` (``recurrence("fused")``, the default) against the LSTM written with autograd's operations
(``recurrence("steps")``) and against ``nn.LSTM`` itself, client by client: values and gradients in float64, a
``gradcheck``, bfloat16 autocast, and the backward's shape (one weight-gradient product per layer, whatever the
number of steps)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from driftlab.models import batched, build_model, layers

TOLERANCE = 1e-10  # float64; the orders of summation differ (measured: below 1e-15)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).norm() / reference.norm()).item()


def client_parameters(module: nn.Module, clients: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Each client's own parameters, the module's scale, ``[C, *shape]`` float64 leaves that take gradients."""
    return {
        name: (0.5 * torch.randn(clients, *p.shape, generator=generator, dtype=torch.float64)).requires_grad_()
        for name, p in module.named_parameters()
    }


def char_rnn_values_and_gradients(kind, module, leaves, ids, cotangent):
    """``batched.char_rnn`` under ``recurrence(kind)``: outputs and the gradients of ``<outputs, cotangent>``."""
    with layers.recurrence(kind):
        out = batched.char_rnn(module, layers.Parameters(leaves, ids.shape[0]), ids)
    return out, torch.autograd.grad((out * cotangent).sum(), list(leaves.values()))


def module_values_and_gradients(module, leaves, ids, cotangent):
    """``nn.LSTM``'s own network, client by client through ``functional_call``, its gradients stacked."""
    outputs, gradients = [], []
    for k in range(ids.shape[0]):
        own = {name: leaf[k].detach().requires_grad_() for name, leaf in leaves.items()}
        out = torch.func.functional_call(module, own, (ids[k],))
        gradients.append(torch.autograd.grad((out * cotangent[k]).sum(), list(own.values())))
        outputs.append(out)
    return torch.stack(outputs), [torch.stack(per_leaf) for per_leaf in zip(*gradients, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_fused_recurrence_equals_the_steps_and_the_module_in_float64(bias, device):
    module = build_model("lstm", (9,), 11, rnn_hidden=6).double()  # embedding, 2 LSTM layers, a linear head
    if not bias:
        module.rnn = nn.LSTM(8, 6, num_layers=2, batch_first=True, bias=False).double()
    generator = torch.Generator().manual_seed(5)
    clients, batch = 3, 4
    leaves = {
        name: leaf.detach().to(device).requires_grad_()
        for name, leaf in client_parameters(module, clients, generator).items()
    }
    ids = torch.randint(0, 11, (clients, batch, 9), generator=generator).to(device)
    cotangent = torch.randn(clients, batch, 11, generator=generator, dtype=torch.float64).to(device)
    module.to(device)

    fused = char_rnn_values_and_gradients("fused", module, leaves, ids, cotangent)
    steps = char_rnn_values_and_gradients("steps", module, leaves, ids, cotangent)
    own = module_values_and_gradients(module, leaves, ids, cotangent)

    for reference in (steps, own):
        assert fused[0].shape == reference[0].shape
        assert relative_error(fused[0], reference[0]) < TOLERANCE
        for name, value, expected in zip(leaves, fused[1], reference[1], strict=True):
            assert value.shape == expected.shape, name
            assert relative_error(value, expected) < TOLERANCE, name


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_fused_layer_passes_gradcheck(bias):
    module = nn.LSTM(3, 2, batch_first=True, bias=bias).double()
    generator = torch.Generator().manual_seed(2)
    leaves = client_parameters(module, 2, generator)
    x = torch.randn(2, 2, 4, 3, generator=generator, dtype=torch.float64, requires_grad=True)

    def layer(inputs, *parameters):
        with layers.recurrence("fused"):
            return layers.lstm_layer(
                inputs, module, layers.Parameters(dict(zip(leaves, parameters, strict=True)), 2), 0, ""
            )

    assert torch.autograd.gradcheck(layer, (x, *leaves.values()))


def test_under_bfloat16_autocast_the_fused_recurrence_follows_the_steps():
    module = nn.LSTM(5, 8, batch_first=True)
    generator = torch.Generator().manual_seed(4)
    leaves = {
        name: leaf.detach().float().requires_grad_() for name, leaf in client_parameters(module, 2, generator).items()
    }
    x = torch.randn(2, 3, 6, 5, generator=generator)
    results = {}
    for kind in layers.RECURRENCES:
        with torch.autocast("cpu", dtype=torch.bfloat16), layers.recurrence(kind):
            out = layers.lstm_layer(x, module, layers.Parameters(leaves, 2), 0, "")
        results[kind] = out, torch.autograd.grad(out.float().sum(), list(leaves.values()))
    (fused, fused_grads), (steps, steps_grads) = results["fused"], results["steps"]
    assert fused.dtype == steps.dtype == torch.float32  # the states in the parameters' dtype, the products in bfloat16
    assert relative_error(fused.float(), steps.float()) < 2e-2
    for name, value, expected in zip(leaves, fused_grads, steps_grads, strict=True):
        assert value.dtype == leaves[name].dtype and torch.isfinite(value).all(), name
        assert relative_error(value, expected) < 5e-2, name


class CountedOperations(TorchDispatchMode):
    """How many times each aten operation ran inside the context."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, function, types, args=(), kwargs=None):
        name = function.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return function(*args, **(kwargs or {}))


@pytest.mark.parametrize("steps", [4, 9])
def test_the_fused_backward_takes_one_product_per_weight_and_one_recurrent_product_per_step(steps):
    module = nn.LSTM(3, 2, batch_first=True).double()
    leaves = client_parameters(module, 2, torch.Generator().manual_seed(0))
    x = torch.randn(2, 2, steps, 3, dtype=torch.float64, requires_grad=True)
    out = layers.lstm_layer(x, module, layers.Parameters(leaves, 2), 0, "")  # the default: fused
    with CountedOperations() as backward:
        torch.autograd.grad(out.sum(), [x, *leaves.values()])
    # δW_hh (one product over all steps), then the input projection's backward: δW_ih and δx; the recursion's
    # δa_{t+1} W_hh for every step but the last.
    assert backward.counts["bmm"] == 3 and backward.counts["baddbmm"] == steps - 1
    assert "sigmoid_backward" not in backward.counts and "tanh_backward" not in backward.counts


def test_the_recurrence_setting_refuses_unknown_kinds_and_defaults_to_fused():
    assert layers._RECURRENCE.get() == "fused" and layers.RECURRENCES == ("fused", "steps")
    with pytest.raises(ValueError, match="recurrence must be one of fused, steps, got 'cudnn'"):
        with layers.recurrence("cudnn"):
            pass
