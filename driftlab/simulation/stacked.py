"""Batched layers for a stack of clients: convolutions, GroupNorm, pooling, residual blocks, embeddings, LSTM/GRU.

The vectorized backend (``vectorized.py``) trains the ``C`` clients of a chunk
as one ``[C, P]`` matrix ``Θ``.  For Linear/ReLU stacks it has hand-written
layers; for every other model of the zoo this module runs *one* forward pass
for all ``C`` clients, each with its own parameters, and lets autograd take
the gradient of the summed masked losses (the clients' parameters are
disjoint, so row ``k`` of the gradient is client ``k``'s own):

* images are kept as ``[B, C·ch, H, W]``, client ``k``'s channels in block
  ``k``, so a convolution of every client is one grouped convolution
  (``groups = C·g``, weights ``[C·out, in/g, kh, kw]``), GroupNorm is one
  ``group_norm`` with ``C·G`` groups, and pooling, ReLU and residual additions
  act channel by channel as they are;
* feature rows are ``[C, B, F]`` and a Linear layer is one ``baddbmm``;
* an embedding of every client is one lookup in the ``[C·V, E]`` table with
  ids offset by ``k·V``;
* an LSTM or GRU layer projects every time step's input with one ``bmm`` and
  runs its recurrence as one ``baddbmm`` per step over all clients (PyTorch's
  gate order and two-bias layout, ``i f g o`` and ``r z n``).

Compared with ``torch.func.vmap`` this needs no batching rules (an LSTM has
none on CPU) and has no per-operation transform overhead; the arithmetic is
the module's own, so it agrees with the sequential backend to rounding.
A chunk of one client runs the module's own forward instead (through
``functional_call`` on a copy of the module per thread), so fused kernels such as
oneDNN's LSTM do the work; on a CPU convolutional and recurrent networks train
that way, one client per single-threaded worker.
Only the zoo's classes (and ``nn.Sequential`` of the layers above) are
recognised, by exact type: a subclass may change ``forward``.
Whether this path is faster than training clients one by one depends on the
device: docs/performance.md has the measurements, and ``backend=auto``
follows them.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from driftlab.simulation.flat import FlatModel


def module_for_this_thread(copies: threading.local, module: nn.Module, device: torch.device) -> nn.Module:
    """This thread's copy of ``module`` on ``device``, kept in ``copies``: ``functional_call`` swaps a module's
    parameters while it runs, so chunks trained at once on several threads must not share one.  Made on first
    use, which must be outside ``torch.func`` transforms (copying a module sets ``.data``, which they refuse)."""
    made = getattr(copies, "modules", None)
    if made is None:
        made = copies.modules = {}
    if device not in made:
        made[device] = copy.deepcopy(module).to(device)
    return made[device]


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


class _Parameters:
    """A module's parameters for the chunk, ``[C, *shape]`` leaves looked up by qualified name."""

    def __init__(self, leaves: dict[str, torch.Tensor], clients: int) -> None:
        self.leaves, self.clients = leaves, clients

    def get(self, prefix: str, name: str, module: nn.Module) -> torch.Tensor | None:
        if getattr(module, name, None) is None:
            return None
        return self.leaves[prefix + name]


# ---------------------------------------------------------------- layers


def _conv(x: Images, module: nn.Conv2d, params: _Parameters, prefix: str) -> Images:
    weight = params.get(prefix, "weight", module)
    bias = params.get(prefix, "bias", module)
    clients = x.clients
    out = F.conv2d(
        x.tensor,
        weight.reshape(clients * module.out_channels, *module.weight.shape[1:]),
        None if bias is None else bias.reshape(-1),
        stride=module.stride,
        padding=module.padding,
        dilation=module.dilation,
        groups=clients * module.groups,
    )
    return Images(out, clients)


def _group_norm(x: Images, module: nn.GroupNorm, params: _Parameters, prefix: str) -> Images:
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


def _linear(x: Images | Rows, module: nn.Linear, params: _Parameters, prefix: str) -> Rows:
    rows = x.rows() if isinstance(x, Images) else x
    weight = params.get(prefix, "weight", module)
    bias = params.get(prefix, "bias", module)
    flat = rows.tensor.reshape(rows.tensor.shape[0], -1, rows.tensor.shape[-1])
    if bias is None:
        out = torch.bmm(flat, weight.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))
    return Rows(out.reshape(*rows.tensor.shape[:-1], module.out_features))


def _map(x: Images | Rows, function: Callable[[torch.Tensor], torch.Tensor]) -> Images | Rows:
    return Images(function(x.tensor), x.clients) if isinstance(x, Images) else Rows(function(x.tensor))


def _relu(x: Images | Rows) -> Images | Rows:
    return _map(x, torch.relu)


def _max_pool(x: Images, module: nn.MaxPool2d) -> Images:
    return _map(
        x,
        lambda t: F.max_pool2d(t, module.kernel_size, module.stride, module.padding, module.dilation, ceil_mode=module.ceil_mode),
    )


def _sequential(x, module: nn.Sequential, params: _Parameters, prefix: str):
    for name, child in module.named_children():
        x = _layer(x, child, params, f"{prefix}{name}.")
    return x


def _layer(x, module: nn.Module, params: _Parameters, prefix: str):
    """One module of a recognised network (``_supported`` has checked every type and setting beforehand)."""
    kind = type(module)
    if kind is nn.Conv2d:
        return _conv(x, module, params, prefix)
    if kind is nn.GroupNorm:
        return _group_norm(x, module, params, prefix)
    if kind is nn.Linear:
        if isinstance(x, Images):  # nn.Linear on [B, C, H, W] acts on W: no batched form here (the zoo flattens first)
            raise TypeError("a Linear layer applied to image activations without a Flatten before it")
        return _linear(x, module, params, prefix)
    if kind is nn.ReLU:
        return _relu(x)
    if kind is nn.MaxPool2d:
        return _max_pool(x, module)
    if kind is nn.Identity:
        return x
    if kind is nn.Flatten:
        return x.rows() if isinstance(x, Images) else Rows(x.tensor.reshape(*x.tensor.shape[:2], -1))
    if kind is nn.AdaptiveAvgPool2d:
        return _map(x, lambda t: t.mean(dim=(2, 3), keepdim=True))
    if kind is nn.Sequential:
        return _sequential(x, module, params, prefix)
    if kind is _basic_block_type():
        return _basic_block(x, module, params, prefix)
    raise TypeError(f"no batched form for {kind.__name__}")  # unreachable after _supported


def _basic_block(x: Images, block, params: _Parameters, prefix: str) -> Images:
    out = _relu(_group_norm(_conv(x, block.conv1, params, prefix + "conv1."), block.bn1, params, prefix + "bn1."))
    out = _group_norm(_conv(out, block.conv2, params, prefix + "conv2."), block.bn2, params, prefix + "bn2.")
    shortcut = x if block.downsample is None else _sequential(x, block.downsample, params, prefix + "downsample.")
    return Images(torch.relu(out.tensor + shortcut.tensor), x.clients)


def _embedding(ids: torch.Tensor, module: nn.Embedding, params: _Parameters, prefix: str) -> torch.Tensor:
    """``[C, B, T]`` ids → ``[C, B, T, E]``: client ``k`` reads rows ``k·V + id`` of the stacked tables."""
    table = params.get(prefix, "weight", module)
    clients, vocabulary = table.shape[0], table.shape[1]
    offsets = torch.arange(clients, device=ids.device).mul_(vocabulary).view(clients, *([1] * (ids.dim() - 1)))
    return F.embedding(ids + offsets, table.reshape(clients * vocabulary, -1))


def _lstm_layer(x: torch.Tensor, module: nn.LSTM, params: _Parameters, layer: int) -> torch.Tensor:
    """One LSTM layer over ``[C, B, T, in]`` → ``[C, B, T, H]`` (PyTorch's equations, gates ``i f g o``, zero initial state)."""
    w_ih, w_hh, b_ih, b_hh = (params.get("rnn.", f"{kind}_l{layer}", module) for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    clients, batch, steps, _ = x.shape
    hidden = module.hidden_size
    # Time-major, so each step's slice is contiguous and unbind's backward is one stack.
    inputs = x.transpose(1, 2).reshape(clients, steps * batch, -1)
    bias = None if b_ih is None else (b_ih + b_hh).unsqueeze(1)
    projected = (torch.bmm(inputs, w_ih.transpose(1, 2)) if bias is None else torch.baddbmm(bias, inputs, w_ih.transpose(1, 2)))
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


def _gru_layer(x: torch.Tensor, module: nn.GRU, params: _Parameters, layer: int) -> torch.Tensor:
    """One GRU layer (gates ``r z n``; ``n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))``, ``h' = (1−z) ⊙ n + z ⊙ h``)."""
    w_ih, w_hh, b_ih, b_hh = (params.get("rnn.", f"{kind}_l{layer}", module) for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    clients, batch, steps, _ = x.shape
    hidden = module.hidden_size
    inputs = x.transpose(1, 2).reshape(clients, steps * batch, -1)
    projected = torch.bmm(inputs, w_ih.transpose(1, 2)) if b_ih is None else torch.baddbmm(b_ih.unsqueeze(1), inputs, w_ih.transpose(1, 2))
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


# ---------------------------------------------------------------- whole networks


def _zoo():
    from driftlab.models import zoo

    return zoo


def _basic_block_type():
    return _zoo()._BasicBlockGN


def _images(inputs: torch.Tensor) -> Images:
    """``[C, B, ch, H, W]`` → ``[B, C·ch, H, W]``."""
    clients, batch = inputs.shape[:2]
    return Images(inputs.transpose(0, 1).reshape(batch, clients * inputs.shape[2], *inputs.shape[3:]), clients)


def _forward_feddyn_cnn(module, params: _Parameters, inputs: torch.Tensor) -> torch.Tensor:
    x = _images(inputs)
    x = _max_pool(_relu(_conv(x, module.conv1, params, "conv1.")), module.pool)
    x = _max_pool(_relu(_conv(x, module.conv2, params, "conv2.")), module.pool)
    x = _relu(_linear(x, module.fc1, params, "fc1."))
    x = _relu(_linear(x, module.fc2, params, "fc2."))
    return _linear(x, module.fc3, params, "fc3.").tensor


def _forward_femnist_cnn(module, params: _Parameters, inputs: torch.Tensor) -> torch.Tensor:
    clients, batch = inputs.shape[:2]
    x = _images(inputs.reshape(clients, batch, module.in_channels, *module.image_size))
    x = _max_pool(_relu(_conv(x, module.conv1, params, "conv1.")), module.pool)
    x = _max_pool(_relu(_conv(x, module.conv2, params, "conv2.")), module.pool)
    x = _relu(_linear(x, module.fc1, params, "fc1."))
    return _linear(x, module.fc2, params, "fc2.").tensor


def _forward_resnet(module, params: _Parameters, inputs: torch.Tensor) -> torch.Tensor:
    x = _images(inputs)
    x = _layer(_relu(_group_norm(_conv(x, module.conv1, params, "conv1."), module.bn1, params, "bn1.")), module.maxpool, params, "maxpool.")
    for index in range(1, 5):
        x = _sequential(x, getattr(module, f"layer{index}"), params, f"layer{index}.")
    x = Images(x.tensor.mean(dim=(2, 3), keepdim=True), x.clients)
    return _linear(x, module.fc, params, "fc.").tensor


def _forward_vgg(module, params: _Parameters, inputs: torch.Tensor) -> torch.Tensor:
    x = _sequential(_images(inputs), module.features, params, "features.")
    return _sequential(x.rows(), module.classifier, params, "classifier.").tensor


def _forward_char_rnn(module, params: _Parameters, inputs: torch.Tensor) -> torch.Tensor:
    ids = inputs.long() if inputs.is_floating_point() else inputs
    x = _embedding(ids, module.embedding, params, "embedding.")
    layer_function = _lstm_layer if type(module.rnn) is nn.LSTM else _gru_layer
    for layer in range(module.rnn.num_layers):
        x = layer_function(x, module.rnn, params, layer)
    return _linear(Rows(x[:, :, -1, :]), module.fc, params, "fc.").tensor


def _forward_mlp(module, params: _Parameters, inputs: torch.Tensor) -> torch.Tensor:
    rows = Rows(inputs.reshape(inputs.shape[0], inputs.shape[1], -1))
    zoo = _zoo()
    if type(module) is zoo.MultinomialLogisticRegression:
        return _linear(rows, module.linear, params, "linear.").tensor
    return _sequential(rows, module.layers, params, "layers.").tensor


def _forward_sequential(module, params: _Parameters, inputs: torch.Tensor) -> torch.Tensor:
    x = _images(inputs) if inputs.dim() == 5 else Rows(inputs)  # [C, B, channels, H, W] images, else feature rows
    out = _sequential(x, module, params, "")
    return out.rows().tensor if isinstance(out, Images) else out.tensor


def _forwards() -> dict[type, Callable]:
    zoo = _zoo()
    return {
        zoo.FedDynCNN: _forward_feddyn_cnn,
        zoo.FemnistCNN: _forward_femnist_cnn,
        zoo.ResNet18GN: _forward_resnet,
        zoo.VGG11: _forward_vgg,
        zoo.CharLSTM: _forward_char_rnn,
        zoo.CharGRU: _forward_char_rnn,
        zoo.MLP: _forward_mlp,
        zoo.MultinomialLogisticRegression: _forward_mlp,
        nn.Sequential: _forward_sequential,
    }


def _supported(module: nn.Module) -> bool:
    """Every submodule is a layer with a batched form here, in a setting it reproduces exactly."""
    zoo = _zoo()
    containers = {nn.Sequential, zoo._BasicBlockGN, zoo.FedDynCNN, zoo.FemnistCNN, zoo.ResNet18GN, zoo.VGG11, zoo.MLP,
                  zoo.MultinomialLogisticRegression, zoo.CharLSTM, zoo.CharGRU}
    if type(module) is nn.Sequential:
        # A user's Sequential is interpreted layer by layer: only the layers ``_layer`` knows, no zoo networks inside.
        layers = {nn.Sequential, zoo._BasicBlockGN, nn.Conv2d, nn.GroupNorm, nn.Linear, nn.ReLU, nn.MaxPool2d, nn.Identity,
                  nn.Flatten, nn.AdaptiveAvgPool2d}
        if any(type(sub) not in layers for sub in module.modules()):
            return False
    for sub in module.modules():
        kind = type(sub)
        if kind in containers or kind in (nn.ReLU, nn.Identity, nn.Linear, nn.GroupNorm):
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


class StackedNetwork:
    """The gradient engine of the vectorized backend for zoo models other than Linear/ReLU stacks (module docstring)."""

    def __init__(self, model: FlatModel, forward: Callable) -> None:
        self._model = model
        self._forward = forward
        self._activations_per_example: int | None = None
        self._copies = threading.local()

    @staticmethod
    def match(model: FlatModel) -> "StackedNetwork | None":
        """The batched form of ``model``, or ``None`` when its module is not one this module knows."""
        module = model.module
        forward = _forwards().get(type(module))
        if forward is None or not _supported(module):
            return None
        if type(module) is nn.Sequential and len(module) == 0:
            return None
        trainable = {name for name, p in module.named_parameters() if p.requires_grad}
        if trainable != set(model.names) or len(trainable) != len(list(module.parameters())):
            return None  # a frozen parameter is not in θ: the generic path handles it
        if any(b is not None and b.numel() for b in module.buffers()):
            return None  # buffers (running statistics) have no per-client form here
        return StackedNetwork(model, forward)

    def flat_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs

    def _module_for_this_thread(self, device: torch.device) -> nn.Module:
        return module_for_this_thread(self._copies, self._model.module, device)

    def outputs(self, theta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``[n, B, classes]`` outputs of ``n`` clients on their own ``[n, B, ...]`` inputs, and the parameter leaves."""
        clients = theta.shape[0]
        leaves = []
        named = {}
        offset = 0
        for name, shape, numel in zip(self._model.names, self._model.shapes, self._model.numels):
            # A detached view shares Θ's storage; its own leaf keeps autograd from building [n, P] slice gradients.
            leaf = theta[:, offset : offset + numel].detach().view(clients, *shape).requires_grad_()
            named[name] = leaf
            leaves.append(leaf)
            offset += numel
        if clients == 1:
            # One client: the module's own forward, so its fused kernels (oneDNN's LSTM, say) do the work.
            single = {name: leaf[0] for name, leaf in named.items()}
            return torch.func.functional_call(self._module_for_this_thread(theta.device), single, (x[0],)).unsqueeze(0), leaves
        return self._forward(self._model.module, _Parameters(named, clients), x), leaves

    def loss_gradient(self, theta: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[k] = ∇_θ Σ_i w_ki ℓ(θ_k; x_ki, y_ki)`` for the ``n`` rows of ``theta`` (``[n, P]``)."""
        with torch.enable_grad():
            outputs, leaves = self.outputs(theta, x)
            flat_outputs = outputs.reshape(-1, *outputs.shape[2:])
            flat_targets = targets.reshape(-1, *targets.shape[2:])
            loss = (self._model.example_loss(flat_outputs, flat_targets).to(weights.dtype) * weights.reshape(-1)).sum()
            gradients = torch.autograd.grad(loss, leaves)
        offset = 0
        for gradient, numel in zip(gradients, self._model.numels):
            out[:, offset : offset + numel].copy_(gradient.reshape(gradient.shape[0], -1))
            offset += numel
        return out

    def activation_elements(self, example: torch.Tensor, theta: torch.Tensor) -> int:
        """Floats kept per example for the backward pass (leaf outputs x 3; recurrent layers: their gates and states per step)."""
        if self._activations_per_example is None:
            total = [example.numel()]

            def count(module, _inputs, output):
                if isinstance(module, (nn.LSTM, nn.GRU)):
                    steps = output[0].shape[1]
                    gates = 4 if isinstance(module, nn.LSTM) else 3
                    total.append(steps * module.num_layers * module.hidden_size * (gates + 4))
                elif isinstance(output, torch.Tensor):
                    total.append(output.numel())

            hooks = [leaf.register_forward_hook(count) for leaf in self._model.module.modules() if not list(leaf.children()) or isinstance(leaf, (nn.LSTM, nn.GRU))]
            try:
                with torch.no_grad():
                    self._model.forward(theta[0] if theta.dim() == 2 else theta, example.unsqueeze(0))
            finally:
                for hook in hooks:
                    hook.remove()
            self._activations_per_example = 3 * sum(total)
        return self._activations_per_example


def has_convolutions(module: nn.Module) -> bool:
    """Whether ``module`` has a convolution: its clients' products are already large, so on a CPU a chunk is one client."""
    return any(isinstance(sub, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) for sub in module.modules())


def has_recurrent_layers(module: nn.Module) -> bool:
    """Whether ``module`` has an LSTM or GRU: on a CPU one client per chunk runs oneDNN's fused recurrent kernels."""
    return any(isinstance(sub, nn.RNNBase) for sub in module.modules())


__all__ = ["StackedNetwork", "has_convolutions", "has_recurrent_layers"]
