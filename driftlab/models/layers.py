"""Batched layers: one forward pass of a layer for a stack of ``C`` clients, each with its own parameters.

The vectorized backend (``driftlab.simulation.backends.stacked``) trains the ``C`` clients of a chunk as one
``[C, P]`` matrix ``Θ``.  A model's *batched forward* (``ModelEntry.batched_forward``, the zoo's in
``driftlab.models.batched``) is written with the layers here, and autograd takes the gradient of the
summed masked losses (the clients' parameters are disjoint, so row ``k`` of the gradient is client ``k``'s own):

* images are kept as ``[B, C·ch, H, W]``, client ``k``'s channels in block ``k``, so a convolution of every
  client is one grouped convolution (``groups = C·g``, weights ``[C·out, in/g, kh, kw]``), or, inside
  ``convolution("unfold")`` (the config's ``convolution = "unfold"``), im2col and one matrix product per client
  (``conv_unfold``), with ``"channels_last"`` and ``"mixed"`` beside them (``convolution``); GroupNorm is one
  ``group_norm`` with ``C·G`` groups, and pooling, ReLU and residual additions act channel by channel as they are;
* feature rows are ``[C, B, F]`` and a Linear layer is one ``baddbmm``;
* an embedding of every client is one lookup in the ``[C·V, E]`` table with ids offset by ``k·V``;
* an LSTM or GRU layer projects every time step's input with one ``bmm`` and runs its recurrence as one
  ``baddbmm`` per step over all clients (PyTorch's gate order and two-bias layout, ``i f g o`` and ``r z n``); the
  LSTM's recurrence is one autograd function with a hand-written backward (``LSTMRecurrence``: few kernels a step,
  one weight-gradient product per layer), or inside ``recurrence("steps")`` autograd's operations step by step.

Compared with ``torch.func.vmap`` this needs no batching rules (an LSTM has none on CPU) and has no
per-operation transform overhead; the arithmetic is the module's own, so it agrees with the sequential
backend to rounding.  These functions live with the models (not in ``simulation``) because models are
below the simulation: the zoo's batched forwards and a plugin's use them, and the simulation finds them
through the model registry.

A ``nn.Sequential`` is read layer by layer (``sequential``) when every layer is one of those here or a block
registered with ``register_block`` (the zoo's ResNet block); ``supported`` says whether a module's layers
all have an exact batched form in the settings they use.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Images:
    """Activations of ``clients`` clients as ``[B, clients·channels, H, W]``."""

    tensor: torch.Tensor
    clients: int

    def rows(self) -> "Rows":
        """``flatten(1)`` of each client's ``[channels, H, W]`` example, as ``[clients, B, channels·H·W]``."""
        batch = self.tensor.shape[0]
        return Rows(self.tensor.reshape(batch, self.clients, -1).transpose(0, 1))


@dataclass(frozen=True)
class Rows:
    """Activations as ``[clients, B, ...]``."""

    tensor: torch.Tensor


class Parameters:
    """A module's parameters for the chunk, ``[C, *shape]`` leaves looked up by qualified name."""

    def __init__(self, leaves: dict[str, torch.Tensor], clients: int) -> None:
        self.leaves, self.clients = leaves, clients

    def get(self, prefix: str, name: str, module: nn.Module) -> torch.Tensor | None:
        """The stacked ``prefix + name`` parameter, or None where ``module`` has none (a layer built with ``bias=False``)."""
        if getattr(module, name, None) is None:
            return None
        return self.leaves[prefix + name]


def images(inputs: torch.Tensor) -> Images:
    """``[C, B, ch, H, W]`` inputs → ``[B, C·ch, H, W]``."""
    clients, batch = inputs.shape[:2]
    return Images(inputs.transpose(0, 1).reshape(batch, clients * inputs.shape[2], *inputs.shape[3:]), clients)


# ---------------------------------------------------------------- layers

CONVOLUTIONS = ("grouped", "unfold", "channels_last", "mixed")
RECURRENCES = ("fused", "steps")
# How ``conv`` and ``lstm_layer`` compute: set per thread (the vectorized backend trains chunks on worker threads) by
# ``convolution`` and ``recurrence``.
_CONVOLUTION: contextvars.ContextVar[str] = contextvars.ContextVar("convolution", default="grouped")
_RECURRENCE: contextvars.ContextVar[str] = contextvars.ContextVar("recurrence", default="fused")


@contextlib.contextmanager
def _chosen(setting: contextvars.ContextVar[str], kinds: tuple[str, ...], kind: str) -> Iterator[None]:
    if kind not in kinds:
        raise ValueError(f"{setting.name} must be one of {', '.join(kinds)}, got {kind!r}")
    token = setting.set(kind)
    try:
        yield
    finally:
        setting.reset(token)


def convolution(kind: str) -> contextlib.AbstractContextManager[None]:
    """Inside this context (in this thread), ``conv`` computes ``kind``: ``"grouped"`` (one grouped convolution, the
    default), ``"unfold"`` (``conv_unfold`` wherever it applies), ``"channels_last"`` (the grouped convolution on
    channels-last tensors, the layout cuDNN's tensor-core kernels read) or ``"mixed"`` (``conv_unfold`` for the
    layers reading 3 channels per client, an image's first layer, whose grouped form has tiny groups; grouped
    elsewhere). The same function to rounding; which one is faster depends on the device and its kernels
    (``benchmarks/layer_variants.py`` times them all)."""
    return _chosen(_CONVOLUTION, CONVOLUTIONS, kind)


def recurrence(kind: str) -> contextlib.AbstractContextManager[None]:
    """Inside this context (in this thread), ``lstm_layer`` runs ``kind``: ``"fused"`` (the default: the recurrence
    as one autograd function with a hand-written backward, ``LSTMRecurrence``) or ``"steps"`` (the cell written
    with autograd's operations, step by step). The same function to rounding (``recurrence_test.py``)."""
    return _chosen(_RECURRENCE, RECURRENCES, kind)


# Per-client input channels that ``convolution("mixed")`` unfolds: an RGB image's first layer.
MIXED_UNFOLD_CHANNELS = 3


def unfoldable(module: nn.Conv2d) -> bool:
    """Whether ``conv_unfold`` computes ``module``: one group per client and zero padding given as numbers."""
    return module.groups == 1 and module.padding_mode == "zeros" and not isinstance(module.padding, str)


def unfolds(module: nn.Conv2d, kind: str | None = None) -> bool:
    """Whether ``conv`` computes ``module`` as ``conv_unfold`` under ``convolution(kind)`` (default: this thread's)."""
    kind = _CONVOLUTION.get() if kind is None else kind
    if not unfoldable(module):
        return False
    return kind == "unfold" or (kind == "mixed" and module.in_channels == MIXED_UNFOLD_CHANNELS)


def conv(x: Images, module: nn.Conv2d, params: Parameters, prefix: str) -> Images:
    """Every client's ``Conv2d`` as one grouped convolution (on channels-last tensors inside
    ``convolution("channels_last")``), or as ``conv_unfold`` where ``unfolds`` says so."""
    if unfolds(module):
        return conv_unfold(x, module, params, prefix)
    weight = params.get(prefix, "weight", module)
    bias = params.get(prefix, "bias", module)
    clients = x.clients
    inputs, kernels = x.tensor, weight.reshape(clients * module.out_channels, *module.weight.shape[1:])
    if _CONVOLUTION.get() == "channels_last":
        # The output comes out channels-last too, and ReLU, pooling and GroupNorm keep the layout: only the first
        # layer's input is copied (and Images.rows' flatten, which copies back to the channel-major order).
        inputs = inputs.contiguous(memory_format=torch.channels_last)
        kernels = kernels.contiguous(memory_format=torch.channels_last)
    out = F.conv2d(
        inputs,
        kernels,
        None if bias is None else bias.reshape(-1),
        stride=module.stride,
        padding=module.padding,
        dilation=module.dilation,
        groups=clients * module.groups,
    )
    return Images(out, clients)


def conv_unfold(x: Images, module: nn.Conv2d, params: Parameters, prefix: str) -> Images:
    """``conv`` computed as im2col and one batched matrix product per client (``convolution("unfold")``).

    ``F.unfold`` gives each client's patches ``[B, C, ch·kh·kw, L]`` (``L`` output positions); client ``k``'s
    output is ``W_k [out, ch·kh·kw]`` times its patches, plus its bias, folded back to ``[B, C·out, H', W']``.
    The same function as ``conv`` (to rounding), a candidate where one grouped convolution of ``C·ch`` channels
    finds no fast kernel: ``benchmarks/layer_variants.py`` times the two.  Per-client ``groups == 1`` and zero
    padding given as numbers only.
    """
    if module.groups != 1:
        raise ValueError(
            f"conv_unfold handles ungrouped convolutions only (groups=1 per client), got groups={module.groups}; "
            "use layers.conv for a grouped convolution"
        )
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        raise ValueError(
            f"conv_unfold needs zero padding given as numbers, got padding={module.padding!r}, "
            f"padding_mode={module.padding_mode!r}; use layers.conv, or give padding as integers"
        )
    weight = params.get(prefix, "weight", module)
    bias = params.get(prefix, "bias", module)
    clients, batch = x.clients, x.tensor.shape[0]
    height, width = x.tensor.shape[2:]
    kernel_h, kernel_w = module.kernel_size
    out_h, out_w = (
        (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
        for size, pad, dilation, kernel, stride in zip(
            (height, width), module.padding, module.dilation, module.kernel_size, module.stride, strict=True
        )
    )
    # unfold orders a patch's rows channel-major, so client k's rows are block k, in the order of weight[k].flatten()
    patches = F.unfold(x.tensor, module.kernel_size, module.dilation, module.padding, module.stride)
    patch_size = module.in_channels * kernel_h * kernel_w
    # [B, C, J, L] → [C, J, B·L]: one [out, J] x [J, B·L] product per client
    columns = patches.view(batch, clients, patch_size, -1).permute(1, 2, 0, 3).reshape(clients, patch_size, -1)
    kernels = weight.reshape(clients, module.out_channels, patch_size)
    if bias is None:
        out = torch.bmm(kernels, columns)
    else:
        out = torch.baddbmm(bias.unsqueeze(2), kernels, columns)
    out = out.view(clients, module.out_channels, batch, out_h * out_w).permute(2, 0, 1, 3)
    return Images(out.reshape(batch, clients * module.out_channels, out_h, out_w), clients)


def group_norm(x: Images, module: nn.GroupNorm, params: Parameters, prefix: str) -> Images:
    """Every client's ``GroupNorm`` as one ``group_norm`` with ``C·G`` groups."""
    weight = params.get(prefix, "weight", module)
    bias = params.get(prefix, "bias", module)
    out = F.group_norm(
        x.tensor,
        x.clients * module.num_groups,
        None if weight is None else weight.reshape(-1),
        None if bias is None else bias.reshape(-1),
        module.eps,
    )
    return Images(out, x.clients)


def linear(x: Images | Rows, module: nn.Linear, params: Parameters, prefix: str) -> Rows:
    """Every client's ``Linear`` as one ``baddbmm`` (images are flattened first, as ``flatten(1)``)."""
    rows = x.rows() if isinstance(x, Images) else x
    weight = params.get(prefix, "weight", module)
    bias = params.get(prefix, "bias", module)
    flat = rows.tensor.reshape(rows.tensor.shape[0], -1, rows.tensor.shape[-1])
    if bias is None:
        out = torch.bmm(flat, weight.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))
    return Rows(out.reshape(*rows.tensor.shape[:-1], module.out_features))


def elementwise(x: Images | Rows, function: Callable[[torch.Tensor], torch.Tensor]) -> Images | Rows:
    """``function`` applied to the activations, which keep their layout (ReLU, pooling, a residual's sum)."""
    return Images(function(x.tensor), x.clients) if isinstance(x, Images) else Rows(function(x.tensor))


def relu(x: Images | Rows) -> Images | Rows:
    return elementwise(x, torch.relu)


def max_pool(x: Images, module: nn.MaxPool2d) -> Images:
    return elementwise(
        x,
        lambda t: F.max_pool2d(
            t, module.kernel_size, module.stride, module.padding, module.dilation, ceil_mode=module.ceil_mode
        ),
    )


def mean_pool(x: Images) -> Images:
    """``AdaptiveAvgPool2d(1)``: each channel's mean, kept as ``[B, C·ch, 1, 1]``."""
    return elementwise(x, lambda t: t.mean(dim=(2, 3), keepdim=True))


def embedding(ids: torch.Tensor, module: nn.Embedding, params: Parameters, prefix: str) -> torch.Tensor:
    """``[C, B, T]`` ids → ``[C, B, T, E]``: client ``k`` reads rows ``k·V + id`` of the stacked tables."""
    table = params.get(prefix, "weight", module)
    clients, vocabulary = table.shape[0], table.shape[1]
    offsets = torch.arange(clients, device=ids.device).mul_(vocabulary).view(clients, *([1] * (ids.dim() - 1)))
    return F.embedding(ids + offsets, table.reshape(clients * vocabulary, -1))


def _recurrent_weights(module: nn.RNNBase, params: Parameters, prefix: str, layer: int) -> list[torch.Tensor | None]:
    kinds = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    return [params.get(prefix, f"{kind}_l{layer}", module) for kind in kinds]


class LSTMRecurrence(torch.autograd.Function):
    """The recurrence of one LSTM layer for every client, with a hand-written backward (``recurrence("fused")``).

    In: the projected inputs ``P [C, T, B, 4H]`` (``x_t W_ihᵀ + b_ih + b_hh``, time-major) and ``W_hh [C, 4H, H]``;
    out: the hidden states ``h_1 … h_T`` as ``[C, T, B, H]``, from ``h_0 = c_0 = 0``. PyTorch's equations (gates
    ``i f g o``, Hochreiter & Schmidhuber 1997 with the forget gate of Gers et al. 2000)::

        a_t = P_t + h_{t−1} W_hhᵀ                  (one baddbmm over all clients)
        i, f, o = σ(a_t^i), σ(a_t^f), σ(a_t^o);  g = tanh(a_t^g)
        c_t = f ⊙ c_{t−1} + i ⊙ g;               h_t = o ⊙ tanh(c_t)

    The forward runs without autograd's graph (one baddbmm and six pointwise kernels a step; the activations kept
    for the backward), and the backward runs the recursion with the terms that do not depend on it computed for all
    steps at once::

        δh_t = ∂L/∂h_t + δa_{t+1} W_hh             (one baddbmm a step)
        δc_t = δc_{t+1} ⊙ f_{t+1} + δh_t ⊙ o ⊙ (1 − tanh² c_t)
        δa_t = [δc_t ⊙ g ⊙ i(1−i),  δc_t ⊙ c_{t−1} ⊙ f(1−f),  δc_t ⊙ i ⊙ (1−g²),  δh_t ⊙ tanh c_t ⊙ o(1−o)]

    so a step costs one baddbmm and four pointwise kernels, against autograd's one per operation and a weight
    gradient per step. The weight gradient is ONE product over all steps, ``δW_hh = Σ_t δa_tᵀ h_{t−1}``, and the
    gradient of ``P`` (``δa``) goes back through the input projection, whose backward is one product too
    (``δW_ih = Σ_t δa_tᵀ x_t``).
    """

    @staticmethod
    def forward(ctx, projected: torch.Tensor, weight_hh: torch.Tensor) -> torch.Tensor:
        clients, steps, batch, gates = projected.shape
        hidden = gates // 4
        # Under autocast the products (and the projection) come out in bfloat16 while the states stay in the
        # parameters' float32, as in recurrence("steps"); the backward then runs in float32.
        ctx.projected_dtype = projected.dtype
        dtype = torch.promote_types(projected.dtype, weight_hh.dtype)
        recurrent = weight_hh.transpose(1, 2)
        states = projected.new_zeros(clients, steps + 1, batch, hidden, dtype=dtype)  # h_0 … h_T
        cells = projected.new_zeros(clients, steps + 1, batch, hidden, dtype=dtype)  # c_0 … c_T
        activations = projected.new_empty(clients, steps, batch, gates, dtype=dtype)  # i f g o after nonlinearities
        # Every step's views made at once: the loop then runs kernels only.
        h, c = states.unbind(1), cells.unbind(1)
        candidate_slots = activations[..., 2 * hidden : 3 * hidden].unbind(1)
        for step, (inputs, active) in enumerate(zip(projected.unbind(1), activations.unbind(1), strict=True)):
            preactivation = torch.baddbmm(inputs, h[step], recurrent)
            torch.sigmoid(preactivation, out=active)
            torch.tanh(preactivation[..., 2 * hidden : 3 * hidden], out=candidate_slots[step])
            i, f, g, o = active.chunk(4, dim=2)
            torch.addcmul(f * c[step], i, g, out=c[step + 1])
            torch.mul(o, torch.tanh(c[step + 1]), out=h[step + 1])
        ctx.save_for_backward(weight_hh, states, cells, activations)
        return states[:, 1:]

    @staticmethod
    def backward(ctx, grad_states: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        weight_hh, states, cells, activations = ctx.saved_tensors
        clients, steps, batch, gates = activations.shape
        hidden = gates // 4
        weight = weight_hh.to(activations.dtype)  # the states' dtype: a no-op unless the weight is narrower
        i, f, g, o = activations.chunk(4, dim=3)
        tanh_cells = torch.tanh(cells[:, 1:])
        # The factors of δa_t (class docstring) that do not depend on the recursion, for every step at once:
        # [g ⊙ i(1−i), c_{t−1} ⊙ f(1−f), i ⊙ (1−g²), tanh c_t ⊙ o(1−o)], and ∂c_t/∂h_t's factor o ⊙ (1 − tanh² c_t).
        factors = activations * (1 - activations)
        factor_i, factor_f, factor_g, factor_o = factors.chunk(4, dim=3)
        factor_i.mul_(g)
        factor_f.mul_(cells[:, :-1])
        torch.mul(i, 1 - g * g, out=factor_g)
        factor_o.mul_(tanh_cells)
        through_cell = (o * (1 - tanh_cells * tanh_cells)).unbind(1)
        grad_gates = torch.empty_like(activations)
        by_gate, factors_by_gate = (t.view(clients, steps, batch, 4, hidden) for t in (grad_gates, factors))
        cell_gate_grads, output_gate_grads = by_gate[..., :3, :].unbind(1), by_gate[..., 3, :].unbind(1)
        cell_gate_factors, output_gate_factors = (
            factors_by_gate[..., :3, :].unbind(1),
            factors_by_gate[..., 3, :].unbind(1),
        )
        incoming, per_step, forget = grad_states.to(activations.dtype).unbind(1), grad_gates.unbind(1), f.unbind(1)
        grad_cell_carried = None  # δc_{t+1} ⊙ f_{t+1}
        for step in reversed(range(steps)):
            if step == steps - 1:
                grad_h = incoming[step]
            else:
                grad_h = torch.baddbmm(incoming[step], per_step[step + 1], weight)
            if grad_cell_carried is None:
                grad_c = grad_h * through_cell[step]
            else:
                grad_c = torch.addcmul(grad_cell_carried, grad_h, through_cell[step])
            torch.mul(cell_gate_factors[step], grad_c.unsqueeze(2), out=cell_gate_grads[step])
            torch.mul(output_gate_factors[step], grad_h, out=output_gate_grads[step])
            grad_cell_carried = grad_c * forget[step]
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # δW_hh = Σ_t δa_tᵀ h_{t−1}: the steps stacked, one product per client.
            previous = states[:, :-1].reshape(clients, steps * batch, hidden)
            grad_weight = torch.bmm(grad_gates.view(clients, steps * batch, gates).transpose(1, 2), previous)
            grad_weight = grad_weight.to(weight_hh.dtype)
        return grad_gates.to(ctx.projected_dtype) if ctx.needs_input_grad[0] else None, grad_weight


def lstm_layer(x: torch.Tensor, module: nn.LSTM, params: Parameters, layer: int, prefix: str = "rnn.") -> torch.Tensor:
    """One LSTM layer over ``[C, B, T, in]`` → ``[C, B, T, H]`` (PyTorch's equations, gates ``i f g o``, zero initial
    state): the input projection of every step as one product, then the recurrence, ``LSTMRecurrence`` or, inside
    ``recurrence("steps")``, autograd's operations step by step."""
    w_ih, w_hh, b_ih, b_hh = _recurrent_weights(module, params, prefix, layer)
    clients, batch, steps, _ = x.shape
    hidden = module.hidden_size
    # Time-major, so each step's slice is contiguous and unbind's backward is one stack.
    inputs = x.transpose(1, 2).reshape(clients, steps * batch, -1)
    bias = None if b_ih is None else (b_ih + b_hh).unsqueeze(1)
    projected = (
        torch.bmm(inputs, w_ih.transpose(1, 2)) if bias is None else torch.baddbmm(bias, inputs, w_ih.transpose(1, 2))
    )
    if _RECURRENCE.get() == "fused":
        return LSTMRecurrence.apply(projected.view(clients, steps, batch, 4 * hidden), w_hh).transpose(1, 2)
    recurrent = w_hh.transpose(1, 2)
    h = x.new_zeros(clients, batch, hidden)
    c = x.new_zeros(clients, batch, hidden)
    outputs = []
    for step_input in projected.view(clients, steps, batch, 4 * hidden).unbind(1):
        gates = torch.baddbmm(step_input, h, recurrent)
        i, f, g, o = gates.chunk(4, dim=2)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs.append(h)
    return torch.stack(outputs, dim=2)


def gru_layer(x: torch.Tensor, module: nn.GRU, params: Parameters, layer: int, prefix: str = "rnn.") -> torch.Tensor:
    """One GRU layer (gates ``r z n``; ``n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))``, ``h' = (1−z) ⊙ n + z ⊙ h``)."""
    w_ih, w_hh, b_ih, b_hh = _recurrent_weights(module, params, prefix, layer)
    clients, batch, steps, _ = x.shape
    hidden = module.hidden_size
    inputs = x.transpose(1, 2).reshape(clients, steps * batch, -1)
    projected = (
        torch.bmm(inputs, w_ih.transpose(1, 2))
        if b_ih is None
        else torch.baddbmm(b_ih.unsqueeze(1), inputs, w_ih.transpose(1, 2))
    )
    recurrent = w_hh.transpose(1, 2)
    h = x.new_zeros(clients, batch, hidden)
    outputs = []
    for step_input in projected.view(clients, steps, batch, 3 * hidden).unbind(1):
        hidden_part = torch.bmm(h, recurrent) if b_hh is None else torch.baddbmm(b_hh.unsqueeze(1), h, recurrent)
        x_r, x_z, x_n = step_input.chunk(3, dim=2)
        h_r, h_z, h_n = hidden_part.chunk(3, dim=2)
        r = torch.sigmoid(x_r + h_r)
        z = torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        h = n + z * (h - n)
        outputs.append(h)
    return torch.stack(outputs, dim=2)


# ---------------------------------------------------------------- sequential dispatch

# Blocks with a batched form of their own that may sit inside a Sequential (the zoo's ResNet block), by exact type.
_BLOCKS: dict[type, Callable] = {}


def register_block(block_type: type, forward: Callable) -> None:
    """Let ``sequential`` run ``block_type`` (exact type) with ``forward(x, block, params, prefix)``."""
    _BLOCKS[block_type] = forward


def sequential(x, module: nn.Sequential, params: Parameters, prefix: str):
    """The children of ``module`` one after another (``layer``)."""
    for name, child in module.named_children():
        x = layer(x, child, params, f"{prefix}{name}.")
    return x


def layer(x, module: nn.Module, params: Parameters, prefix: str):
    """One module of a recognised network (``supported`` has checked every type and setting beforehand)."""
    kind = type(module)
    if kind is nn.Conv2d:
        return conv(x, module, params, prefix)
    if kind is nn.GroupNorm:
        return group_norm(x, module, params, prefix)
    if kind is nn.Linear:
        if isinstance(x, Images):  # nn.Linear on [B, C, H, W] acts on W: no batched form here (the zoo flattens first)
            raise TypeError("a Linear layer applied to image activations without a Flatten before it")
        return linear(x, module, params, prefix)
    if kind is nn.ReLU:
        return relu(x)
    if kind is nn.MaxPool2d:
        return max_pool(x, module)
    if kind is nn.Identity:
        return x
    if kind is nn.Flatten:
        return x.rows() if isinstance(x, Images) else Rows(x.tensor.reshape(*x.tensor.shape[:2], -1))
    if kind is nn.AdaptiveAvgPool2d:
        return mean_pool(x)
    if kind is nn.Sequential:
        return sequential(x, module, params, prefix)
    if kind in _BLOCKS:
        return _BLOCKS[kind](x, module, params, prefix)
    raise TypeError(f"no batched form for {kind.__name__}")  # unreachable after supported()


def forward_sequential(module: nn.Sequential, params: Parameters, inputs: torch.Tensor) -> torch.Tensor:
    """The batched forward of a user's ``nn.Sequential``: ``[C, B, ch, H, W]`` images or ``[C, B, F]`` rows in."""
    x = images(inputs) if inputs.dim() == 5 else Rows(inputs)
    out = sequential(x, module, params, "")
    return out.rows().tensor if isinstance(out, Images) else out.tensor


# Layers ``layer`` reads inside a user's Sequential (embeddings and recurrent layers need a model's own forward).
SEQUENTIAL_LAYERS = (
    nn.Sequential,
    nn.Conv2d,
    nn.GroupNorm,
    nn.Linear,
    nn.ReLU,
    nn.MaxPool2d,
    nn.Identity,
    nn.Flatten,
    nn.AdaptiveAvgPool2d,
)


def supported(module: nn.Module, containers: tuple[type, ...] = ()) -> bool:
    """Every submodule of ``module`` is one of ``containers`` (types whose batched forward reads their children
    themselves) or a layer with a batched form here, in a setting it reproduces exactly."""
    if type(module) is nn.Sequential:
        # A user's Sequential is interpreted layer by layer: only the layers ``layer`` knows, no whole networks inside.
        if any(type(sub) not in SEQUENTIAL_LAYERS and type(sub) not in _BLOCKS for sub in module.modules()):
            return False
    known = (nn.Sequential, *_BLOCKS, *containers)
    for sub in module.modules():
        kind = type(sub)
        if kind in known or kind in (nn.ReLU, nn.Identity, nn.Linear, nn.GroupNorm):
            continue
        if kind is nn.Conv2d:
            if sub.padding_mode != "zeros" or isinstance(sub.padding, str):
                return False
        elif kind is nn.MaxPool2d:
            if sub.return_indices:
                return False
        elif kind is nn.Flatten:
            if (sub.start_dim, sub.end_dim) != (1, -1):
                return False
        elif kind is nn.AdaptiveAvgPool2d:
            if tuple(torch.nn.modules.utils._pair(sub.output_size)) != (1, 1):
                return False
        elif kind is nn.Embedding:
            if sub.max_norm is not None or sub.scale_grad_by_freq or sub.sparse:
                return False
        elif kind in (nn.LSTM, nn.GRU):
            if not sub.batch_first or sub.bidirectional or sub.dropout or getattr(sub, "proj_size", 0):
                return False
        else:
            return False
    return True


__all__ = [
    "CONVOLUTIONS",
    "Images",
    "LSTMRecurrence",
    "MIXED_UNFOLD_CHANNELS",
    "RECURRENCES",
    "Parameters",
    "Rows",
    "conv",
    "conv_unfold",
    "convolution",
    "elementwise",
    "embedding",
    "forward_sequential",
    "group_norm",
    "gru_layer",
    "images",
    "layer",
    "linear",
    "lstm_layer",
    "max_pool",
    "mean_pool",
    "recurrence",
    "register_block",
    "relu",
    "sequential",
    "supported",
    "unfoldable",
    "unfolds",
]
