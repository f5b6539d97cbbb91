"""Gradients of the loss for a stack of clients: the vectorized backend's gradient engines.

An engine computes ``out[k] = ∇_θ Σ_i w_ki ℓ(θ_k; x_ki, y_ki)`` for the ``n``
rows of a ``[n, P]`` stack ``θ`` at once:

* ``LinearReluStack``: hand-written batched layers (``bmm`` and their backward)
  for ``Flatten → Linear → (ReLU → Linear)*`` under cross-entropy, which can also
  fuse the SGD update into the weight-gradient GEMM (``sgd_step_``);
* ``stacked.StackedNetwork``: the zoo's other layers, batched;
* ``VmappedGradient``: ``torch.func.vmap(grad(...))`` of ``functional_call`` for
  any other module;
* ``TermGradients``: the same with a client's ``LossTerm`` added
  (``objectives.objective_loss``).

``gradient_engine`` picks the batched layers for a model; ``vmap_problem`` and
``stacked_problem`` try an engine on one batch before the backend trusts it.

Every engine is a ``vectorized_engine.GradientEngine``: its ``loss_gradient`` takes
the step's dropout ``keys`` (``[n]``, ``modes.step_keys``) and ``training`` (False
for a measurement: γ-inexact stopping's full gradient, in evaluation mode).  Only
the ``vmap`` engines serve models with dropout (``draws_dropout``): each client's
masks come from its own key, the masks the sequential backend draws (``modes.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Sequence

import numpy as np
import torch
from torch import nn

from driftlab.simulation.backends.flat import FlatModel, cross_entropy_per_example
from driftlab.simulation.backends.local_training import PAD, ClientTask, TrainingData
from driftlab.simulation.backends.modes import keyed_dropout
from driftlab.simulation.backends.objectives import LossTerm, objective_loss
from driftlab.simulation.backends.stacked import StackedNetwork, module_for_this_thread
from driftlab.simulation.backends.vectorized_engine import GradientEngine, StepBatch
from driftlab.simulation.backends.vectorized_layout import BatchSchedule


class LinearReluStack(GradientEngine):
    """Batched layers for ``Flatten → Linear → (ReLU → Linear)*`` under cross-entropy.

    For client ``k`` with weights ``W_l``, biases ``b_l`` and batch ``X``
    (``h_0 = X``): ``z_l = h_{l−1} W_lᵀ + b_l``, ``h_l = relu(z_l)``; with
    ``p = softmax(z_L)`` and weights ``w_i``, the masked mean cross-entropy has

        δ_L = w ⊙ (p − onehot(y)),   ∇W_l = δ_lᵀ h_{l−1},   ∇b_l = Σ_i δ_l,i,
        δ_{l−1} = (δ_l W_l) ⊙ [h_{l−1} > 0].

    Each product is one ``bmm`` over the ``[C, ...]`` stack; the parameters are
    ``[C, out, in]`` views of the rows of ``Θ``, so nothing is copied.
    """

    draws_dropout = False  # a chain of Linear and ReLU only

    def __init__(self, layers: Sequence[tuple[int, tuple[int, int], int | None]]) -> None:
        # (weight offset, (out, in), bias offset or None) of each Linear, in order.
        self.layers = tuple(layers)

    @staticmethod
    def match(model: FlatModel) -> "LinearReluStack | None":
        """The batched form of ``model``, or ``None`` when it is not such a stack under cross-entropy."""
        if model.example_loss is not cross_entropy_per_example:
            return None
        linears = _linear_relu_chain(model.module)
        if linears is None:
            return None
        offsets = dict(zip(model.names, (sum(model.numels[:i]) for i in range(len(model.names))), strict=True))
        names = {id(p): name for name, p in model.module.named_parameters()}
        layers = []
        for linear in linears:
            weight_name = names.get(id(linear.weight))
            bias_name = names.get(id(linear.bias)) if linear.bias is not None else None
            if weight_name not in offsets or (linear.bias is not None and bias_name not in offsets):
                return None  # a frozen parameter is not in θ; the generic path handles it
            layers.append(
                (
                    offsets[weight_name],
                    (linear.out_features, linear.in_features),
                    offsets[bias_name] if bias_name else None,
                )
            )
        return LinearReluStack(layers)

    def _weight(self, theta: torch.Tensor, layer: int) -> torch.Tensor:
        offset, (out, inp), _ = self.layers[layer]
        return theta[:, offset : offset + out * inp].view(-1, out, inp)

    def _bias(self, theta: torch.Tensor, layer: int) -> torch.Tensor | None:
        offset, (out, _), bias = self.layers[layer]
        return None if bias is None else theta[:, bias : bias + out]

    def flat_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs.reshape(inputs.shape[0], -1)

    def _forward(self, theta: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
        """``[h_0, h_1, ..., h_{L−1}, z_L]``: each layer's input, then the logits."""
        values = [x]
        last = len(self.layers) - 1
        for layer in range(len(self.layers)):
            z = torch.bmm(values[-1], self._weight(theta, layer).transpose(1, 2))
            bias = self._bias(theta, layer)
            if bias is not None:
                z.add_(bias.unsqueeze(1))
            if layer < last:
                z.relu_()
            values.append(z)
        return values

    @staticmethod
    def _logit_gradient(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        delta = torch.softmax(logits, dim=-1)
        delta.scatter_add_(-1, targets.unsqueeze(-1), torch.full_like(delta[..., :1], -1.0))
        return delta.mul_(weights.unsqueeze(-1))

    def _backpropagate(
        self, theta: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, visit
    ) -> None:
        """Call ``visit(layer, δ_l, h_{l−1})`` from the last layer down; ``visit`` may update layer ``l`` in place,
        because ``δ_{l−1}`` is computed from the old ``W_l`` before it is called."""
        values = self._forward(theta, x)
        delta = self._logit_gradient(values[-1], targets, weights)
        for layer in reversed(range(len(self.layers))):
            below = values[layer]
            next_delta = None
            if layer > 0:
                next_delta = torch.bmm(delta, self._weight(theta, layer))
                next_delta = torch.ops.aten.threshold_backward(next_delta, below, 0)
            visit(layer, delta, below)
            delta = next_delta

    def write_gradient(self, theta: torch.Tensor, batch: StepBatch, out: torch.Tensor) -> None:
        """``out[k] = ∇_θ Σ_i w_ki ℓ(θ_k; x_ki, y_ki)``, written into the rows of ``out`` ([n, P]); no layer here has a
        mode or draws masks, so the batch's keys and mode play no role."""

        def write(layer: int, delta: torch.Tensor, below: torch.Tensor) -> None:
            torch.bmm(delta.transpose(1, 2), below, out=self._weight(out, layer))
            bias = self._bias(out, layer)
            if bias is not None:
                torch.sum(delta, dim=1, out=bias)

        self._backpropagate(theta, batch.inputs, batch.targets, batch.weights, write)

    def sgd_step_(
        self, theta: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, learning_rate: float
    ) -> None:
        """``θ_k ← θ_k − η_l ∇ℓ_k(θ_k)`` in place, the update fused into the weight-gradient GEMM."""

        def update(layer: int, delta: torch.Tensor, below: torch.Tensor) -> None:
            self._weight(theta, layer).baddbmm_(delta.transpose(1, 2), below, alpha=-learning_rate)
            bias = self._bias(theta, layer)
            if bias is not None:
                bias.sub_(delta.sum(dim=1), alpha=learning_rate)

        self._backpropagate(theta, x, targets, weights, update)

    def activation_elements(self, input_features: int) -> int:
        """Floats of activations and their gradients per example."""
        return input_features + 3 * sum(out for _, (out, _), _ in self.layers)


def _linear_relu_chain(module: nn.Module) -> list[nn.Linear] | None:
    """The Linear layers of a zoo MLR/MLP or an ``nn.Sequential(Flatten, Linear, ReLU, ..., Linear)``."""
    from driftlab.models.zoo import MLP, MultinomialLogisticRegression

    if type(module) is MultinomialLogisticRegression:
        return [module.linear]
    if type(module) is MLP:
        layers = list(module.layers)
    elif (
        type(module) is nn.Sequential
        and len(module)
        and type(module[0]) is nn.Flatten
        and (module[0].start_dim, module[0].end_dim) == (1, -1)
    ):
        layers = list(module)[1:]
    else:
        return None
    # Linear, then (ReLU, Linear) pairs.
    if not layers or len(layers) % 2 == 0:
        return None
    for position, layer in enumerate(layers):
        expected = nn.Linear if position % 2 == 0 else nn.ReLU
        if type(layer) is not expected or (expected is nn.ReLU and layer.inplace):
            return None
    return [layer for layer in layers if type(layer) is nn.Linear]


class VmappedGradient(GradientEngine):
    """Any module: ``vmap`` over clients of ``grad`` of the masked mean loss through ``functional_call``.

    Each thread calls its own copy of the module: ``functional_call`` swaps a
    module's parameters while it runs, so chunks trained at once on several
    threads must not share one (``torch.func``'s transforms themselves are per thread).
    """

    def __init__(self, model: FlatModel) -> None:
        def masked_loss(
            theta: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
        ) -> torch.Tensor:
            return (model.example_loss(self.forward(theta, inputs), targets) * weights).sum()

        def keyed_loss(
            theta: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, key: torch.Tensor
        ) -> torch.Tensor:
            with keyed_dropout(key):  # inside vmap: each client's masks from its own key
                return masked_loss(theta, inputs, targets, weights)

        self._gradient = torch.func.vmap(torch.func.grad(masked_loss))
        self._keyed_gradient = torch.func.vmap(torch.func.grad(keyed_loss))
        self._activations_per_example: int | None = None
        self.model = model
        self._copies = threading.local()

    @property
    def draws_dropout(self) -> bool:
        return self.model.dropout

    def module_for_this_thread(self, device: torch.device, training: bool = True) -> nn.Module:
        """This thread's copy of the module in the given mode (``stacked.module_for_this_thread``); ``loss_gradient``
        asks for it before entering ``torch.func``."""
        return module_for_this_thread(self._copies, self.model.module, device, training)

    def forward(self, theta: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """``model.forward`` on this thread's copy of the module."""
        return torch.func.functional_call(self._copies.modules[theta.device], self.model.unflatten(theta), (inputs,))

    def write_gradient(self, theta: torch.Tensor, batch: StepBatch, out: torch.Tensor) -> None:
        self.module_for_this_thread(theta.device, batch.training)
        keys = batch.dropout_keys(theta, self.draws_dropout)
        if keys is not None:
            out.copy_(self._keyed_gradient(theta, batch.inputs, batch.targets, batch.weights, keys))
        else:
            out.copy_(self._gradient(theta, batch.inputs, batch.targets, batch.weights))

    def activation_elements(self, example: torch.Tensor, theta: torch.Tensor) -> int:
        """Floats the leaf modules output for one example, times 3 for autograd's saved tensors and gradients."""
        if self._activations_per_example is None:
            total = [example.numel()]
            hooks = [
                leaf.register_forward_hook(
                    lambda _m, _i, output: total.append(output.numel() if isinstance(output, torch.Tensor) else 0)
                )
                for leaf in self.model.module.modules()
                if not list(leaf.children())
            ]
            try:
                with torch.no_grad():
                    self.model.forward(theta, example.unsqueeze(0))
            finally:
                for hook in hooks:
                    hook.remove()
            self._activations_per_example = 3 * sum(total)
        return self._activations_per_example


class TermGradients(GradientEngine):
    """One chunk's gradients of the mean loss plus its clients' ``LossTerm``: ``vmap`` over clients of
    ``grad(objectives.objective_loss)``, the sequential backend's function.

    The terms share one function (``group_key``); each of their tensors is a
    ``[C, ...]`` stack of the clients' own, or one tensor when every client
    has the same object (FedProx's or MOON's global model), not copied.
    """

    def __init__(self, engine: VmappedGradient, terms: Sequence[LossTerm], like: torch.Tensor) -> None:
        self.engine = engine
        self.tensors: list[torch.Tensor] = []
        dims: list[int | None] = []
        for column in zip(*(term.tensors for term in terms), strict=True):
            if all(tensor is column[0] for tensor in column):
                self.tensors.append(column[0].to(like.device))
                dims.append(None)
            else:
                self.tensors.append(torch.stack([tensor.to(like.device) for tensor in column]))
                dims.append(0)
        self.dims = tuple(dims)
        loss = objective_loss(engine.forward, engine.model.example_loss, terms[0].function)

        def keyed_loss(theta, inputs, targets, weights, key, *tensors):
            with keyed_dropout(key):
                return loss(theta, inputs, targets, weights, *tensors)

        self._gradient = torch.func.vmap(torch.func.grad(loss), in_dims=(0, 0, 0, 0, *self.dims))
        self._keyed_gradient = torch.func.vmap(torch.func.grad(keyed_loss), in_dims=(0, 0, 0, 0, 0, *self.dims))
        self._rows = slice(None)  # which clients' rows of the stacked tensors the gradients are for (a prefix, or one)

    def client(self, k: int) -> "TermGradients":
        """The same gradients for the chunk's client ``k`` alone (its rows of the stacked tensors)."""
        single = copy.copy(self)
        single._rows = slice(k, k + 1)
        return single

    @property
    def draws_dropout(self) -> bool:
        return self.engine.draws_dropout

    def write_gradient(self, theta: torch.Tensor, batch: StepBatch, out: torch.Tensor) -> None:
        """``out[k] = ∇_θ [Σ_i w_ki ℓ(θ_k; x_ki, y_ki) + term_k]`` for the ``n`` rows of ``theta``: the chunk's first ``n``
        clients (or the one client of ``client(k)``); the batch's keys are those rows' dropout keys."""
        rows = self._rows if self._rows != slice(None) else slice(0, theta.shape[0])
        tensors = [tensor if dim is None else tensor[rows] for tensor, dim in zip(self.tensors, self.dims, strict=True)]
        self.engine.module_for_this_thread(theta.device, batch.training)
        keys = batch.dropout_keys(theta, self.draws_dropout)
        if keys is not None:
            out.copy_(self._keyed_gradient(theta, batch.inputs, batch.targets, batch.weights, keys, *tensors))
        else:
            out.copy_(self._gradient(theta, batch.inputs, batch.targets, batch.weights, *tensors))

    def activation_elements(self, example: torch.Tensor, theta: torch.Tensor) -> int:
        return self.engine.activation_elements(example, theta)


def gradient_engine(model: FlatModel, batched_layers: bool = True, precision: str = "float32"):
    """The batched layers for ``model`` (``LinearReluStack`` or ``StackedNetwork``), or ``None`` (then ``vmap``).

    The hand-written Linear/ReLU layers compute in the parameters' dtype, so
    under ``precision=bf16`` those models take the autocast-able stacked layers.
    """
    if not batched_layers:
        return None
    if precision != "bf16":
        stack = LinearReluStack.match(model)
        if stack is not None:
            return stack
    return StackedNetwork.match(model)


def vmap_problem(
    engine: GradientEngine, start_params: torch.Tensor, task: ClientTask, data: TrainingData
) -> str | None:
    """Try a ``vmap`` engine (a model's, a chunk's loss terms or buffers) on two clients' first batch; the error text
    if it fails."""
    positions = task.batches[:1] if task.num_steps else np.zeros((1, 1), dtype=np.int64)
    probe = dataclasses.replace(task, batches=positions)
    schedule = BatchSchedule.build([probe, probe], start_params.dtype, start_params.device)
    theta = start_params.unsqueeze(0).repeat(2, 1)
    rows = schedule.rows[0]
    keys = torch.tensor([1, 2], dtype=torch.int64)  # two clients' dropout keys, as local steps pass them
    try:
        engine.loss_gradient(
            theta, data.batch(rows), data.targets[rows], schedule.weights[0], torch.empty_like(theta), keys
        )
    except Exception as error:  # noqa: BLE001 - any failure means "not vmappable"; the message is logged
        return f"{type(error).__name__}: {error}"
    return None


def stacked_problem(
    engine: StackedNetwork, model: FlatModel, start_params: torch.Tensor, task: ClientTask, data: TrainingData
) -> str | None:
    """Check the batched layers against the module on one client's first batch, as two different clients; why not, or ``None``.

    Guards the layer-by-layer reading of a user's ``nn.Sequential``: a layout the
    batched layers would compute differently is found here, not in the results.
    """
    positions = task.batches[0][task.batches[0] != PAD] if task.num_steps else np.zeros(1, dtype=np.int64)
    rows = task.sample_indices[torch.as_tensor(positions[:4], device=task.sample_indices.device)]
    x = data.batch(rows)
    theta = torch.stack([start_params, start_params * 0.5])  # two clients with different parameters
    try:
        with torch.no_grad():
            stacked, _ = engine.outputs(theta, x.unsqueeze(0).expand(2, *x.shape).contiguous())
            expected = torch.stack([model.forward(theta[0], x), model.forward(theta[1], x)])
    except Exception as error:  # noqa: BLE001 - any failure means "use vmap"; the message is logged
        return f"{type(error).__name__}: {error}"
    if stacked.shape != expected.shape or not torch.allclose(stacked, expected, rtol=1e-4, atol=1e-5):
        return "its batched outputs differ from the module's"
    return None
