"""The vectorized backend's gradient engine for models with a batched forward: one forward pass for a stack of clients.

The vectorized backend (``vectorized.py``) trains the ``C`` clients of a chunk
as one ``[C, P]`` matrix ``Θ``.  For Linear/ReLU stacks it has hand-written
layers; for every other model with a *batched forward* (a model registry entry's
``batched_forward``, found by the module's exact type, or the layer-by-layer
reading of an ``nn.Sequential``: ``driftlab.models.registry.batched_form``)
this module runs *one* forward pass for all ``C`` clients, each with its own
parameters, and lets autograd take the gradient of the summed masked losses
(the clients' parameters are disjoint, so row ``k`` of the gradient is client
``k``'s own).  The batched layers themselves (grouped convolutions, GroupNorm,
``baddbmm`` linear layers, embeddings, LSTM/GRU recurrences) are in
``driftlab.models.layers``, and the zoo's forwards in ``driftlab.models.batched``:
models sit below the simulation, which finds them through the registry.

A chunk of one client runs the module's own forward instead (through
``functional_call`` on a copy of the module per thread), so fused kernels such as
oneDNN's LSTM do the work; on a CPU convolutional and recurrent networks train
that way, one client per single-threaded worker.
Whether this path is faster than training clients one by one depends on the
device: docs/performance.md has the measurements, and ``backend=auto``
follows them.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn

from driftlab.models.layers import Parameters, unfoldable, unfolds
from driftlab.models.registry import batched_form
from driftlab.simulation.backends.flat import FlatModel, copy_module
from driftlab.simulation.backends.modes import set_mode
from driftlab.simulation.backends.vectorized_engine import GradientEngine, StepBatch


def module_for_this_thread(
    copies: threading.local, module: nn.Module, device: torch.device, training: bool = True
) -> nn.Module:
    """This thread's copy of ``module`` on ``device``, kept in ``copies``, in training mode (local steps) or not
    (measurements, ``modes.py``): ``functional_call`` swaps a module's parameters while it runs, so chunks trained at
    once on several threads must not share one.  Made on first use, which must be outside ``torch.func`` transforms
    (copying a module sets ``.data``, which they refuse)."""
    made = getattr(copies, "modules", None)
    if made is None:
        made = copies.modules = {}
        copies.training = {}
    if device not in made:
        made[device] = copy_module(module).to(device)
    if copies.training.get(device) is not training:
        set_mode(made[device], training, module)
        copies.training[device] = training
    return made[device]


class StackedNetwork(GradientEngine):
    """The gradient engine of the vectorized backend for modules with a batched forward (module docstring)."""

    draws_dropout = False  # match refuses models with dropout

    def __init__(self, model: FlatModel, forward: Callable) -> None:
        self._model = model
        self._forward = forward
        self._activations_per_example: int | None = None
        self._unfold_columns: list[tuple[nn.Conv2d, int]] | None = None
        self._copies = threading.local()

    @staticmethod
    def match(model: FlatModel) -> "StackedNetwork | None":
        """The batched form of ``model``, or ``None`` when its module has none (``registry.batched_form``)."""
        module = model.module
        forward = batched_form(module)
        if forward is None:
            return None
        if type(module) is nn.Sequential and len(module) == 0:
            return None
        trainable = {name for name, p in module.named_parameters() if p.requires_grad}
        if trainable != set(model.names) or len(trainable) != len(list(module.parameters())):
            return None  # a frozen parameter is not in θ: the generic path handles it
        if any(b is not None and b.numel() for b in module.buffers()):
            return None  # buffers (running statistics) have no per-client form here
        if model.dropout:
            return None  # the batched layers draw no dropout masks; vmap draws them from per-step keys
        return StackedNetwork(model, forward)

    def _module_for_this_thread(self, device: torch.device, training: bool = True) -> nn.Module:
        return module_for_this_thread(self._copies, self._model.module, device, training)

    def outputs(
        self, theta: torch.Tensor, x: torch.Tensor, training: bool = True
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``[n, B, classes]`` outputs of ``n`` clients on their own ``[n, B, ...]`` inputs, and the parameter leaves.
        ``training``: the mode of the module's own forward (one client); the batched layers have no mode-dependent
        layer (no dropout, no running statistics: ``match``)."""
        clients = theta.shape[0]
        leaves = []
        named = {}
        offset = 0
        for name, shape, numel in zip(self._model.names, self._model.shapes, self._model.numels, strict=True):
            # A detached view shares Θ's storage; its own leaf keeps autograd from building [n, P] slice gradients.
            leaf = theta[:, offset : offset + numel].detach().view(clients, *shape).requires_grad_()
            named[name] = leaf
            leaves.append(leaf)
            offset += numel
        if clients == 1:
            # One client: the module's own forward, so its fused kernels (oneDNN's LSTM, say) do the work.
            single = {name: leaf[0] for name, leaf in named.items()}
            return torch.func.functional_call(
                self._module_for_this_thread(theta.device, training), single, (x[0],)
            ).unsqueeze(0), leaves
        return self._forward(self._model.module, Parameters(named, clients), x), leaves

    def write_gradient(self, theta: torch.Tensor, batch: StepBatch, out: torch.Tensor) -> None:
        """``out[k] = ∇_θ Σ_i w_ki ℓ(θ_k; x_ki, y_ki)`` for the ``n`` rows of ``theta`` (``[n, P]``); no dropout here
        (``match``), so the batch's keys play no role."""
        weights = batch.weights
        with torch.enable_grad():
            outputs, leaves = self.outputs(theta, batch.inputs, batch.training)
            flat_outputs = outputs.reshape(-1, *outputs.shape[2:])
            flat_targets = batch.targets.reshape(-1, *batch.targets.shape[2:])
            loss = (self._model.example_loss(flat_outputs, flat_targets).to(weights.dtype) * weights.reshape(-1)).sum()
            gradients = torch.autograd.grad(loss, leaves)
        offset = 0
        for gradient, numel in zip(gradients, self._model.numels, strict=True):
            out[:, offset : offset + numel].copy_(gradient.reshape(gradient.shape[0], -1))
            offset += numel

    def activation_elements(self, example: torch.Tensor, theta: torch.Tensor) -> int:
        """Floats kept per example for the backward pass (leaf outputs x 3; recurrent layers: their gates and states per step)."""
        if self._activations_per_example is None:
            self._count_elements(example, theta)
        return self._activations_per_example

    def unfold_elements(self, example: torch.Tensor, theta: torch.Tensor, kind: str = "unfold") -> int:
        """Floats per example that ``layers.conv_unfold`` keeps beyond ``activation_elements`` under
        ``convolution(kind)``: for each convolution that choice unfolds (``layers.unfolds``: every unfoldable one for
        ``unfold``, the 3-channel first layer for ``mixed``, none otherwise), the patch columns ``in·kh·kw`` per output
        position, twice (``F.unfold``'s and the per-client copy the matrix product saves for the backward pass)."""
        if self._unfold_columns is None:
            self._count_elements(example, theta)
        return sum(columns for module, columns in self._unfold_columns if unfolds(module, kind))

    def _count_elements(self, example: torch.Tensor, theta: torch.Tensor) -> None:
        """Both counts above, from one forward pass of one example with hooks on the leaves (once per model)."""
        total, columns = [example.numel()], []

        def count(module, _inputs, output):
            if isinstance(module, (nn.LSTM, nn.GRU)):
                steps = output[0].shape[1]
                gates = 4 if isinstance(module, nn.LSTM) else 3
                total.append(steps * module.num_layers * module.hidden_size * (gates + 4))
            elif isinstance(output, torch.Tensor):
                total.append(output.numel())
            if isinstance(module, nn.Conv2d) and unfoldable(module):
                positions = output.numel() // module.out_channels  # one example: output is [1, out, H', W']
                columns.append(
                    (module, 2 * module.in_channels * module.kernel_size[0] * module.kernel_size[1] * positions)
                )

        leaves = [
            leaf
            for leaf in self._model.module.modules()
            if not list(leaf.children()) or isinstance(leaf, (nn.LSTM, nn.GRU))
        ]
        hooks = [leaf.register_forward_hook(count) for leaf in leaves]
        try:
            with torch.no_grad():
                self._model.forward(theta[0] if theta.dim() == 2 else theta, example.unsqueeze(0))
        finally:
            for hook in hooks:
                hook.remove()
        self._activations_per_example, self._unfold_columns = 3 * sum(total), columns


def has_convolutions(module: nn.Module) -> bool:
    """Whether ``module`` has a convolution: its clients' products are already large, so on a CPU a chunk is one client."""
    return any(isinstance(sub, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) for sub in module.modules())


def has_recurrent_layers(module: nn.Module) -> bool:
    """Whether ``module`` has an LSTM or GRU: on a CPU one client per chunk runs oneDNN's fused recurrent kernels."""
    return any(isinstance(sub, nn.RNNBase) for sub in module.modules())


__all__ = ["StackedNetwork", "has_convolutions", "has_recurrent_layers"]
