"""The vectorized training backend: all clients of a round do local SGD together.

algorithms.md ("Local training") and the seam (``seam.py``): client ``k`` runs
``K_k`` steps of

    g_k = ∇ℓ(θ_k; batch_k,s) + a_k                       (linear correction)
    g_k ← g_k · min(1, c / (‖g_k‖ + 1e-6))                (optional clipping, per client)
    g_k ← g_k + D_k ⊙ (θ_k − θ_ref,k) + wd · θ_k          (quadratic term, weight decay)
    θ_k ← θ_k − η_l g_k

from ``θ_k = θ^{t−1}``.  Here the ``C`` clients of a chunk are stacked into a
``[C, P]`` matrix ``Θ`` and every step is a handful of batched operations on
``Θ`` whatever ``C`` is:

* the step's minibatch of every client is gathered with one index operation
  (``rows[s]``, a ``[C, B]`` table of sample rows), and augmented, when
  ``TrainingData.augment`` is set, in one call with the ``[C, B]`` keys
  ``example_keys(augment_key_k, s, i)``, the same keys the sequential backend
  uses (padding slots get keys too; their weight is 0);
* a short last batch is padded; the loss is the masked mean
  ``ℓ_k = Σ_i w_ki ℓ(θ_k; x_i)`` with ``w_ki = 1/|batch_k|`` on real examples and
  ``0`` on padding, which is the sequential per-batch mean;
* clients are sorted by descending step count, so the clients still training at
  step ``s`` are a prefix ``Θ[:n_s]``; finished clients keep their parameters
  and cost nothing (grouping by step count comes for free);
* the loss gradient comes from batched layers (``bmm``, a hand-written backward)
  for stacks of ``Linear``/``ReLU`` with cross-entropy, and from
  ``torch.func.vmap(grad(...))`` of ``functional_call`` for any other module.
  A module that ``vmap`` cannot handle falls back to the sequential backend with
  a logged warning.

Without clipping the update is fused into the weight-gradient GEMM
(``W ← W − η_l δᵀh`` is one ``baddbmm_``), so the parameters are read and written
once per step and no ``[C, P]`` gradient is materialised; the correction terms
``E = a + D ⊙ (θ − θ_ref) + wd · θ`` (taken at the step's starting ``θ``) are
then applied as ``θ ← θ − η_l E``.  With clipping the gradient must be complete
before its norm is known, so it is written to a ``[C, P]`` buffer and the step
above is applied in place, in the same order as ``local_training.corrected_step``.

Non-affine local objectives (``objectives.LocalObjective``) take a general
path: clients with a loss term get their gradient from
``vmap(grad(objectives.objective_loss))`` (the term's per-client tensors
stacked as rows, or shared), and a local step of the algorithm's own is applied
client by client to the stack's rows after ``corrected_gradient_``.  A round's
clients are split into groups (affine; a given loss-term function; local step
only) and each group is chunked and trained on its own, so affine clients run
exactly the code above.

Chunks of clients are sized from a memory budget, so a round of 1,000 clients
never holds more than a chunk's parameters, gradients and activations per
worker.  On a CPU the chunks (batched layers or ``vmap``) run on one thread
each, as many at once as torch has intra-op threads (``_map_chunks``): a
client's GEMMs are too small to split well over threads, and single-threaded
kernels are not starved when other processes load the machine.  Every chunk is deterministic, so the
results do not depend on the chunking or the threads (up to GEMM summation
order); docs/performance.md has the measurements behind these choices.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from driftlab.simulation.flat import FlatModel, cross_entropy_per_example
from driftlab.simulation.local_training import (
    PAD,
    ClientTask,
    LocalSettings,
    SequentialBackend,
    TrainingData,
    corrected_gradient_norm,
    map_on_threads,
)
from driftlab.simulation.objectives import LocalObjective, LossTerm, as_local_objective, objective_loss
from driftlab.simulation.randomness import example_keys
from driftlab.simulation.precision import local_arithmetic
from driftlab.simulation.seam import GradientCorrection
from driftlab.simulation.stacked import StackedNetwork, has_convolutions, has_recurrent_layers, module_for_this_thread

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30
# On a CPU the per-step working set of more than ~16 MLP clients spills out of the
# last-level cache and every elementwise pass becomes a trip to DRAM; measured in
# docs/performance.md.  GPUs have no such knee, so they use the memory budget alone.
CPU_CHUNK_CLIENTS = 16
FULL_GRADIENT_ROWS = 4096  # examples per piece of a full local gradient (γ-inexact stopping), as in the sequential backend

# ---------------------------------------------------------------- per-chunk data


@dataclass(frozen=True)
class StackedCorrection:
    """The chunk's ``GradientCorrection``s as rows: ``linear [C,P]``, ``quadratic [C,1]`` or ``[C,P]``, ``reference [C,P]``.

    A term that no client has is ``None``; a client without a term gets a zero
    row (``a_k = 0``, ``D_k = 0``), which leaves its step unchanged.  A tensor
    every client shares (FedProx's and FedDyn's ``θ_ref = θ^{t−1}``) is kept
    once as a ``[1, P]`` row and broadcast.
    """

    linear: torch.Tensor | None
    quadratic: torch.Tensor | None
    reference: torch.Tensor | None

    @property
    def is_empty(self) -> bool:
        return self.linear is None and self.quadratic is None

    @staticmethod
    def stack(corrections: Sequence[GradientCorrection], like: torch.Tensor) -> "StackedCorrection":
        linear = _stack_rows([c.linear for c in corrections], like)
        quadratics = [c.quadratic for c in corrections]
        if all(q is None for q in quadratics):
            return StackedCorrection(linear, None, None)
        if all(q is None or not isinstance(q, torch.Tensor) for q in quadratics):
            quadratic = _to_device(torch.tensor([[0.0 if q is None else float(q)] for q in quadratics], dtype=like.dtype), like.device)
        else:
            quadratic = _stack_rows([_as_row(q, like) for q in quadratics], like)
        # A client without a quadratic term has D_k = 0, so any finite reference row serves it.
        references = [c.reference for c in corrections]
        present = next(r for r in references if r is not None)
        reference = _stack_rows([present if r is None else r for r in references], like)
        return StackedCorrection(linear, quadratic, reference)

    def head(self, n: int) -> "StackedCorrection":
        """The rows of the first ``n`` clients (shared ``[1, P]`` rows stay shared)."""
        return StackedCorrection(_head(self.linear, n), _head(self.quadratic, n), _head(self.reference, n))


def _as_row(value: float | torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    if value is None or isinstance(value, torch.Tensor):
        return value
    return torch.full_like(like, float(value))


def _stack_rows(rows: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor | None:
    """``[C, P]`` from per-client rows (``None`` → zeros), or ``[1, P]`` when every client has the same tensor."""
    if all(row is None for row in rows):
        return None
    first = rows[0]
    if first is not None and all(row is first for row in rows):
        return first.to(like.device, like.dtype).reshape(1, -1)
    zeros = torch.zeros_like(like)
    return torch.stack([zeros if row is None else row.to(like.device, like.dtype).reshape(-1) for row in rows])


def _head(rows: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return rows if rows is None or rows.shape[0] == 1 else rows[:n]


@dataclass(frozen=True)
class BatchSchedule:
    """Every step's minibatch for every client of a chunk, on the data's device.

    ``rows[s, k, i]`` is the global sample row of example ``i`` of client ``k``
    at step ``s``, ``weights[s, k, i]`` its weight in the masked mean loss
    (``1/|batch|``, ``0`` for padding, whose row points at a real sample so the
    gather stays in bounds).  Clients are sorted by descending step count, so
    ``active[s]`` clients (a prefix) still train at step ``s``.
    """

    rows: torch.Tensor  # [S, C, W] int64
    weights: torch.Tensor  # [S, C, W]
    active: tuple[int, ...]  # [S]

    @staticmethod
    def build(tasks: Sequence[ClientTask], dtype: torch.dtype, device: torch.device) -> "BatchSchedule":
        """Built on the host and sent to ``device`` in one (pinned, asynchronous) copy per table: no sync per client."""
        steps = max(task.num_steps for task in tasks)
        width = max((task.batches.shape[1] for task in tasks if task.num_steps), default=1)
        positions = np.zeros((steps, len(tasks), width), dtype=np.int64)  # into the concatenated sample indices
        counts = np.ones((steps, len(tasks), 1), dtype=np.int64)
        valid = np.zeros((steps, len(tasks), width), dtype=bool)
        offset = 0
        for k, task in enumerate(tasks):
            if task.num_steps:
                batches = task.batches
                mask = batches != PAD
                # Padding reads the row's first (real) example, so the gather stays in bounds; its weight is 0.
                positions[: task.num_steps, k, : batches.shape[1]] = offset + np.where(mask, batches, batches[:, :1])
                valid[: task.num_steps, k, : batches.shape[1]] = mask
                counts[: task.num_steps, k, 0] = mask.sum(axis=1)
            offset += len(task.sample_indices)
        # 1/|batch| in the training dtype, as the sequential backend's mean computes it.
        reciprocal = torch.from_numpy(counts).to(dtype).reciprocal()
        weights = torch.where(torch.from_numpy(valid), reciprocal, torch.zeros((), dtype=dtype))
        samples = torch.cat([task.sample_indices.to(device) for task in tasks])
        rows = samples[_to_device(torch.from_numpy(positions), device)]
        active = tuple(sum(1 for task in tasks if task.num_steps > s) for s in range(steps))
        return BatchSchedule(rows, _to_device(weights, device), active)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory and without waiting, when ``device`` is a GPU."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# ---------------------------------------------------------------- gradients of a stack of clients


class LinearReluStack:
    """Batched layers for ``Flatten → Linear → (ReLU → Linear)*`` under cross-entropy.

    For client ``k`` with weights ``W_l``, biases ``b_l`` and batch ``X``
    (``h_0 = X``): ``z_l = h_{l−1} W_lᵀ + b_l``, ``h_l = relu(z_l)``; with
    ``p = softmax(z_L)`` and weights ``w_i``, the masked mean cross-entropy has

        δ_L = w ⊙ (p − onehot(y)),   ∇W_l = δ_lᵀ h_{l−1},   ∇b_l = Σ_i δ_l,i,
        δ_{l−1} = (δ_l W_l) ⊙ [h_{l−1} > 0].

    Each product is one ``bmm`` over the ``[C, ...]`` stack; the parameters are
    ``[C, out, in]`` views of the rows of ``Θ``, so nothing is copied.
    """

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
        offsets = dict(zip(model.names, (sum(model.numels[:i]) for i in range(len(model.names)))))
        names = {id(p): name for name, p in model.module.named_parameters()}
        layers = []
        for linear in linears:
            weight_name = names.get(id(linear.weight))
            bias_name = names.get(id(linear.bias)) if linear.bias is not None else None
            if weight_name not in offsets or (linear.bias is not None and bias_name not in offsets):
                return None  # a frozen parameter is not in θ; the generic path handles it
            layers.append((offsets[weight_name], (linear.out_features, linear.in_features), offsets[bias_name] if bias_name else None))
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

    def _backpropagate(self, theta: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, visit) -> None:
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

    def loss_gradient(self, theta: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[k] = ∇_θ Σ_i w_ki ℓ(θ_k; x_ki, y_ki)``, written into the rows of ``out`` ([n, P])."""

        def write(layer: int, delta: torch.Tensor, below: torch.Tensor) -> None:
            torch.bmm(delta.transpose(1, 2), below, out=self._weight(out, layer))
            bias = self._bias(out, layer)
            if bias is not None:
                torch.sum(delta, dim=1, out=bias)

        self._backpropagate(theta, x, targets, weights, write)
        return out

    def sgd_step_(self, theta: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, learning_rate: float) -> None:
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
    elif type(module) is nn.Sequential and len(module) and type(module[0]) is nn.Flatten and (module[0].start_dim, module[0].end_dim) == (1, -1):
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


class VmappedGradient:
    """Any module: ``vmap`` over clients of ``grad`` of the masked mean loss through ``functional_call``.

    Each thread calls its own copy of the module: ``functional_call`` swaps a
    module's parameters while it runs, so chunks trained at once on several
    threads must not share one (``torch.func``'s transforms themselves are per thread).
    """

    def __init__(self, model: FlatModel) -> None:
        def masked_loss(theta: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return (model.example_loss(self.forward(theta, inputs), targets) * weights).sum()

        self._gradient = torch.func.vmap(torch.func.grad(masked_loss))
        self._activations_per_example: int | None = None
        self.model = model
        self._copies = threading.local()

    def module_for_this_thread(self, device: torch.device) -> nn.Module:
        """This thread's copy of the module (``stacked.module_for_this_thread``); ``loss_gradient`` asks for it
        before entering ``torch.func``."""
        return module_for_this_thread(self._copies, self.model.module, device)

    def forward(self, theta: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """``model.forward`` on this thread's copy of the module."""
        return torch.func.functional_call(self._copies.modules[theta.device], self.model.unflatten(theta), (inputs,))

    def flat_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs

    def loss_gradient(self, theta: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.module_for_this_thread(theta.device)
        out.copy_(self._gradient(theta, x, targets, weights))
        return out

    def activation_elements(self, example: torch.Tensor, theta: torch.Tensor) -> int:
        """Floats the leaf modules output for one example, times 3 for autograd's saved tensors and gradients."""
        if self._activations_per_example is None:
            total = [example.numel()]
            hooks = [
                leaf.register_forward_hook(lambda _m, _i, output: total.append(output.numel() if isinstance(output, torch.Tensor) else 0))
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


class TermGradients:
    """One chunk's gradients of the mean loss plus its clients' ``LossTerm``: ``vmap`` over clients of
    ``grad(objectives.objective_loss)``, the sequential backend's function.

    The terms share one function (``_group_key``); each of their tensors is a
    ``[C, ...]`` stack of the clients' own, or one tensor when every client
    has the same object (FedProx's or MOON's global model), not copied.
    """

    def __init__(self, engine: VmappedGradient, terms: Sequence[LossTerm], like: torch.Tensor) -> None:
        self.engine = engine
        self.tensors: list[torch.Tensor] = []
        dims: list[int | None] = []
        for column in zip(*(term.tensors for term in terms)):
            if all(tensor is column[0] for tensor in column):
                self.tensors.append(column[0].to(like.device))
                dims.append(None)
            else:
                self.tensors.append(torch.stack([tensor.to(like.device) for tensor in column]))
                dims.append(0)
        self.dims = tuple(dims)
        loss = objective_loss(engine.forward, engine.model.example_loss, terms[0].function)
        self._gradient = torch.func.vmap(torch.func.grad(loss), in_dims=(0, 0, 0, 0, *self.dims))
        self._rows = slice(None)  # which clients' rows of the stacked tensors the gradients are for (a prefix, or one)

    def flat_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs

    def client(self, k: int) -> "TermGradients":
        """The same gradients for the chunk's client ``k`` alone (its rows of the stacked tensors)."""
        single = copy.copy(self)
        single._rows = slice(k, k + 1)
        return single

    def loss_gradient(self, theta: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[k] = ∇_θ [Σ_i w_ki ℓ(θ_k; x_ki, y_ki) + term_k]`` for the ``n`` rows of ``theta``: the chunk's first ``n``
        clients (or the one client of ``client(k)``)."""
        rows = self._rows if self._rows != slice(None) else slice(0, theta.shape[0])
        tensors = [tensor if dim is None else tensor[rows] for tensor, dim in zip(self.tensors, self.dims)]
        self.engine.module_for_this_thread(theta.device)
        out.copy_(self._gradient(theta, x, targets, weights, *tensors))
        return out

    def activation_elements(self, example: torch.Tensor, theta: torch.Tensor) -> int:
        return self.engine.activation_elements(example, theta)


def _normalized(task: ClientTask) -> ClientTask:
    """``task`` with a ``GradientCorrection`` (an affine objective) or a non-affine ``LocalObjective``."""
    if isinstance(task.correction, GradientCorrection):
        return task
    objective = as_local_objective(task.correction)
    return dataclasses.replace(task, correction=objective.correction if objective.is_affine else objective)


def _loss_term(task: ClientTask) -> LossTerm | None:
    return None if isinstance(task.correction, GradientCorrection) else as_local_objective(task.correction).loss_term


def _correction(task: ClientTask) -> GradientCorrection:
    """The affine part of a task's objective."""
    return task.correction if isinstance(task.correction, GradientCorrection) else as_local_objective(task.correction).correction


def _group_key(objective: GradientCorrection | LocalObjective) -> tuple:
    """Clients with equal keys are trained together: affine ones; a loss term (same function, same tensor shapes,
    so they stack); a local step alone (applied row by row, any step).  ``objective`` is ``_normalized``."""
    if isinstance(objective, GradientCorrection):
        return ("affine",)
    term = objective.loss_term
    if term is None:
        return ("step",)
    return ("term", id(term.function), tuple((tuple(t.shape), t.dtype, t.device) for t in term.tensors))


def _objective_elements(tasks: Sequence[ClientTask]) -> int:
    """Floats per client of loss-term tensors and local-step state (an upper bound: shared tensors are counted too)."""
    most = 0
    for task in tasks:
        if not isinstance(task.correction, GradientCorrection):
            objective = as_local_objective(task.correction)
            term, step = objective.loss_term, objective.local_step
            count = sum(t.numel() for t in term.tensors) if term is not None else 0
            count += sum(t.numel() for t in step.initial_state) if step is not None else 0
            most = max(most, count)
    return most


# ---------------------------------------------------------------- the step


def corrected_step_(theta: torch.Tensor, g: torch.Tensor, correction: StackedCorrection, settings: LocalSettings, scratch: torch.Tensor) -> None:
    """``local_training.corrected_step`` for a stack of clients, in place (``g`` is overwritten), same operation order."""
    theta.sub_(corrected_gradient_(theta, g, correction, settings, scratch).mul_(settings.client_lr))


def corrected_gradient_(theta: torch.Tensor, g: torch.Tensor, correction: StackedCorrection, settings: LocalSettings, scratch: torch.Tensor) -> torch.Tensor:
    """``local_training.corrected_gradient`` for a stack of clients, written into ``g`` (returned), same operation order."""
    if correction.linear is not None:
        g.add_(correction.linear)
    if settings.clip_norm is not None:
        norms = torch.linalg.vector_norm(g, dim=1, keepdim=True)
        g.mul_(torch.clamp(settings.clip_norm / (norms + 1e-6), max=1.0))
    if correction.quadratic is not None:
        torch.sub(theta, correction.reference, out=scratch)
        g.add_(scratch.mul_(correction.quadratic))
    if settings.weight_decay:
        g.add_(torch.mul(theta, settings.weight_decay, out=scratch))
    return g


def correction_terms(theta: torch.Tensor, correction: StackedCorrection, weight_decay: float, out: torch.Tensor) -> torch.Tensor | None:
    """``E = a + D ⊙ (θ − θ_ref) + wd · θ`` (the gradient terms that do not pass through clipping), or ``None`` if zero."""
    if correction.is_empty and not weight_decay:
        return None
    out.zero_()
    if correction.linear is not None:
        out.add_(correction.linear)
    if correction.quadratic is not None:
        out.addcmul_(correction.quadratic, theta - correction.reference)
    if weight_decay:
        out.add_(theta, alpha=weight_decay)
    return out


# ---------------------------------------------------------------- the backend


class VectorizedBackend:
    """Trains a round's clients as ``[C, P]`` stacks, chunk by chunk (module docstring).

    Args:
        memory_budget_bytes: bytes one chunk may use for parameters, gradients,
            corrections, activations and its batch schedule (default 1 GiB on a
            CPU; on a GPU, 80% of the device's free memory, shared by the chunks in flight).
        max_chunk_clients: at most this many clients per chunk; default on a CPU
            ``CPU_CHUNK_CLIENTS``, or one client for convolutional and recurrent
            networks, whose per-client kernels (oneDNN's convolutions and fused
            LSTM/GRU) are already efficient (docs/performance.md); no limit beyond
            the budget on a GPU.
        batched_layers: use the batched layers (``LinearReluStack``,
            ``stacked.StackedNetwork``) where the model allows (``False`` forces
            ``vmap``; for benchmarks and tests).
        parallel_chunks: on a CPU, train one chunk per intra-op thread at once,
            each single-threaded (see ``_map_chunks``); ``False``: one chunk at a
            time with multi-threaded kernels.
        precision: ``precision.PRECISIONS``; ``tf32`` and ``bf16`` change the local
            steps' gradients only (``precision.local_arithmetic``).
        devices: train the chunks on these devices, chunk ``j`` on
            ``devices[j mod len(devices)]``, and gather the models on the device of
            the start parameters.  The assignment depends only on the chunk's
            index, so a fixed device list gives bit-identical reruns.  Default: the
            start parameters' device.
    """

    name = "vectorized"

    def __init__(
        self,
        memory_budget_bytes: int | None = None,
        max_chunk_clients: int | None = None,
        batched_layers: bool = True,
        parallel_chunks: bool = True,
        precision: str = "float32",
        devices: Sequence[torch.device | str] | None = None,
    ) -> None:
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be positive, got {memory_budget_bytes}")
        if max_chunk_clients is not None and max_chunk_clients < 1:
            raise ValueError(f"max_chunk_clients must be at least 1, got {max_chunk_clients}")
        if devices is not None and not devices:
            raise ValueError("devices must list at least one device")
        self.memory_budget_bytes = memory_budget_bytes
        self.max_chunk_clients = max_chunk_clients
        self.batched_layers = batched_layers
        self.parallel_chunks = parallel_chunks
        self.precision = precision
        self.devices = None if devices is None else tuple(torch.device(d) for d in devices)
        self._engine_of: tuple[nn.Module, object] | None = None  # (module, its engine or None), the last model trained
        self._fallback: SequentialBackend | None = None
        self._term_engines: dict[tuple, VmappedGradient | None] = {}  # (module, term function) -> engine, see _term_engine
        self._replicas: dict[torch.device, TrainingData] = {}
        self._replicated: TrainingData | None = None  # the data the replicas were made from

    def train(
        self, model: FlatModel, start_params: torch.Tensor, tasks: Sequence[ClientTask], settings: LocalSettings, data: TrainingData
    ) -> Iterator[tuple[int, torch.Tensor, int]]:
        if not tasks:
            return
        engine = self._engine(model, start_params, tasks, data)
        if engine is None:
            yield from self._fallback.train(model, start_params, tasks, settings, data)
            return
        if all(isinstance(task.correction, GradientCorrection) for task in tasks):
            yield from self._train_group(engine, model, start_params, tasks, settings, data)
            return
        tasks = [_normalized(task) for task in tasks]
        groups: dict[tuple, list[int]] = {}
        for position, task in enumerate(tasks):
            groups.setdefault(_group_key(task.correction), []).append(position)
        for key, positions in groups.items():
            group = [tasks[p] for p in positions]
            group_engine = engine
            if key[0] == "term":
                group_engine = self._term_engine(model, start_params, group, data)
                if group_engine is None:
                    for index, final, done in self._fallback.train(model, start_params, group, settings, data):
                        yield positions[index], final, done
                    continue
            for index, final, done in self._train_group(group_engine, model, start_params, group, settings, data):
                yield positions[index], final, done

    def _train_group(
        self, engine, model: FlatModel, start_params: torch.Tensor, tasks: Sequence[ClientTask], settings: LocalSettings, data: TrainingData
    ) -> Iterator[tuple[int, torch.Tensor, int]]:
        """Chunk ``tasks`` (clients whose objectives one engine serves) and train the chunks."""
        home = start_params.device
        devices = self.devices or (home,)
        # Grouping by step count: neighbours in this order finish together, so chunks waste little.
        order = sorted(range(len(tasks)), key=lambda position: -tasks[position].num_steps)
        workers = self.workers(start_params, len(tasks), devices)
        # Which clients share a chunk can change the last bits on the vmap path (not with the batched layers,
        # whose clients never mix), so there the chunks are cut as for one worker: the same on any machine.
        split = workers if isinstance(engine, (LinearReluStack, StackedNetwork)) else 1
        chunk_size = self.chunk_size(engine, model, start_params, tasks, settings, data, split)
        chunks = list(enumerate(order[start : start + chunk_size] for start in range(0, len(order), chunk_size)))
        starts = {device: start_params.to(device) for device in devices}

        def train(chunk: tuple[int, list[int]]) -> tuple[list[int], torch.Tensor, list[int]]:
            index, positions = chunk
            device = devices[index % len(devices)]
            with local_arithmetic(self.precision, device):
                chunk_engine = engine
                chunk_tasks = [tasks[p] for p in positions]
                if any(_loss_term(task) is not None for task in chunk_tasks):  # a term group: engine is the model's VmappedGradient
                    chunk_engine = TermGradients(engine, [_loss_term(task) for task in chunk_tasks], starts[device])
                finals, steps_done = _train_chunk(chunk_engine, starts[device], chunk_tasks, settings, self._data_on(data, device))
            return positions, finals.to(home), steps_done

        for positions, finals, steps_done in _map_chunks(train, chunks, workers):
            for k, position in enumerate(positions):
                yield position, finals[k], steps_done[k]

    def _data_on(self, data: TrainingData, device: torch.device) -> TrainingData:
        """``data`` on ``device``: itself on its own device, else a copy made once per data set and device."""
        if data.inputs.device == device:
            return data
        if self._replicated is not data:
            self._replicas, self._replicated = {}, data
        if device not in self._replicas:
            self._replicas[device] = dataclasses.replace(data, inputs=data.inputs.to(device), targets=data.targets.to(device))
        return self._replicas[device]

    def workers(self, start_params: torch.Tensor, num_tasks: int, devices: Sequence[torch.device] = ()) -> int:
        """Chunks trained at once: one per listed device when there are several, else one per intra-op thread on a CPU
        (each single-threaded), else one."""
        if len(devices) > 1:
            return min(len(devices), num_tasks)
        if not self.parallel_chunks or start_params.device.type != "cpu":
            return 1
        return max(1, min(torch.get_num_threads(), num_tasks))

    def chunk_size(
        self,
        engine,
        model: FlatModel,
        start_params: torch.Tensor,
        tasks: Sequence[ClientTask],
        settings: LocalSettings,
        data: TrainingData,
        workers: int = 1,
    ) -> int:
        """Clients per chunk: as many as the memory budget holds (shared by ``workers`` chunks in flight),
        capped on a CPU (see ``CPU_CHUNK_CLIENTS``) and split evenly over the workers."""
        element = start_params.element_size()
        # θ, a gradient (or correction-terms) buffer and a scratch buffer, plus the correction rows that differ per client.
        params_rows = 3 + per_client_correction_rows([_correction(task) for task in tasks])
        width = max((task.batches.shape[1] for task in tasks), default=1)
        steps = max(task.num_steps for task in tasks)
        if isinstance(engine, LinearReluStack):
            activations = engine.activation_elements(engine.flat_inputs(data.inputs[:1]).shape[1])
        else:
            activations = engine.activation_elements(data.batch(torch.zeros(1, dtype=torch.long, device=data.inputs.device))[0], start_params)
        if data.augment is not None:  # the augmented copy of the batch and the augmentation's temporaries (flip, padding)
            activations += 5 * data.inputs[0].numel()
        if data.normalisation is not None:  # the normalised copy of the gathered pixels
            activations += data.inputs[0].numel()
        per_client = element * (params_rows * model.num_parameters + width * activations + _objective_elements(tasks)) + steps * width * (8 + element)
        size = max(1, self.budget_bytes(start_params.device) // (workers * per_client))
        cap = self.max_chunk_clients or self._default_cap(engine, model, start_params.device)
        return int(min(size, cap or size, math.ceil(len(tasks) / workers)))

    def budget_bytes(self, device: torch.device) -> int:
        """The memory chunks in flight may use: the configured budget, else 1 GiB on a CPU or 80% of a GPU's free memory."""
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            return int(0.8 * free)
        return DEFAULT_MEMORY_BUDGET_BYTES

    @staticmethod
    def _default_cap(engine, model: FlatModel, device: torch.device) -> int | None:
        if device.type != "cpu":
            return None
        if isinstance(engine, StackedNetwork) and (has_convolutions(model.module) or has_recurrent_layers(model.module)):
            return 1
        return CPU_CHUNK_CLIENTS

    def _engine(self, model: FlatModel, start_params: torch.Tensor, tasks: Sequence[ClientTask], data: TrainingData):
        """The gradient engine for ``model``, or ``None`` (with a warning, once) when it cannot be batched."""
        if self._engine_of is not None and self._engine_of[0] is model.module:
            engine = self._engine_of[1]
        else:
            engine = gradient_engine(model, self.batched_layers, self.precision)
            if isinstance(engine, StackedNetwork):
                problem = _stacked_problem(engine, model, start_params, tasks[0], data)
                if problem is not None:
                    logger.warning("vectorized backend: no batched layers for %s (%s); using vmap", type(model.module).__name__, problem)
                    engine = None
            if engine is None:
                engine = VmappedGradient(model)
                problem = _vmap_problem(engine, start_params, tasks[0], data)
                if problem is not None:
                    logger.warning(
                        "vectorized backend: %s cannot be vmapped (%s); training its clients one by one with the sequential backend",
                        type(model.module).__name__,
                        problem,
                    )
                    engine = None
            self._engine_of = (model.module, engine)
        if engine is None and self._fallback is None:
            self._fallback = SequentialBackend(precision=self.precision)
        return engine


    def _term_engine(self, model: FlatModel, start_params: torch.Tensor, tasks: Sequence[ClientTask], data: TrainingData):
        """The model's ``VmappedGradient`` for clients whose loss term it can ``vmap``, or ``None`` (a warning, once per
        model and term function: those clients train with the sequential backend)."""
        function = _loss_term(tasks[0]).function
        key = (model.module, function)
        if key not in self._term_engines:
            if any(module is not model.module for module, _ in self._term_engines) or len(self._term_engines) >= 64:
                # A new model, or term functions made anew for every client (define them once in build):
                # old entries would only keep their models and closures alive.
                self._term_engines = {}
            # One VmappedGradient (and its per-thread module copies) per model, whatever the term.
            engine = next((e for e in self._term_engines.values() if e is not None), None) or VmappedGradient(model)
            problem = _vmap_problem(engine, start_params, tasks[0], data)
            if problem is None:
                probe = TermGradients(engine, [_loss_term(tasks[0])] * 2, start_params)
                problem = _vmap_problem(probe, start_params, tasks[0], data)
            if problem is not None:
                logger.warning(
                    "vectorized backend: the loss term %s on %s cannot be vmapped (%s); training its clients with the sequential backend",
                    getattr(function, "__qualname__", function),
                    type(model.module).__name__,
                    problem,
                )
                engine = None
            self._term_engines[key] = engine
        if self._term_engines[key] is None and self._fallback is None:
            self._fallback = SequentialBackend(precision=self.precision)
        return self._term_engines[key]


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


def auto_backend(model: FlatModel, device: torch.device) -> str:
    """The backend ``backend=auto`` runs: a rule backed by the measurements in docs/performance.md.

    On a GPU, vectorized for every model.  On a CPU, vectorized where the
    batched layers apply (the zoo's models, ``nn.Sequential`` of their layers):
    Linear/ReLU stacks train several times faster there, and convolutional and
    recurrent networks at least as fast as one by one (their chunks run one
    single-threaded worker per core, which also keeps them fast when other
    processes load the machine); sequential for other modules, whose
    ``vmap`` path is slower on a CPU.  A rule and not a timing, so that the
    same run always trains the same way.
    """
    if device.type != "cpu":
        return "vectorized"
    return "vectorized" if gradient_engine(model) is not None else "sequential"


def per_client_correction_rows(corrections: Sequence[GradientCorrection]) -> int:
    """How many ``[P]`` rows per client ``StackedCorrection.stack`` will hold (shared rows and scalars cost nothing)."""

    def varies(values: list) -> bool:
        present = [v for v in values if v is not None]
        return bool(present) and not all(v is present[0] and len(present) == len(values) for v in present)

    linear = varies([c.linear for c in corrections])
    quadratic = any(isinstance(c.quadratic, torch.Tensor) for c in corrections) and varies([c.quadratic for c in corrections])
    reference = varies([c.reference for c in corrections]) if any(c.reference is not None for c in corrections) else False
    return int(linear) + int(quadratic) + int(reference)


def _vmap_problem(engine: VmappedGradient, start_params: torch.Tensor, task: ClientTask, data: TrainingData) -> str | None:
    """Try the vmapped gradient on two clients' first batch; the error text if it fails."""
    positions = task.batches[:1] if task.num_steps else np.zeros((1, 1), dtype=np.int64)
    probe = dataclasses.replace(task, batches=positions)
    schedule = BatchSchedule.build([probe, probe], start_params.dtype, start_params.device)
    theta = start_params.unsqueeze(0).repeat(2, 1)
    rows = schedule.rows[0]
    try:
        engine.loss_gradient(theta, data.batch(rows), data.targets[rows], schedule.weights[0], torch.empty_like(theta))
    except Exception as error:  # noqa: BLE001 - any failure means "not vmappable"; the message is logged
        return f"{type(error).__name__}: {error}"
    return None


def _stacked_problem(engine: StackedNetwork, model: FlatModel, start_params: torch.Tensor, task: ClientTask, data: TrainingData) -> str | None:
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


def _map_chunks(train: Callable, chunks: list, workers: int) -> Iterator:
    """``train`` over ``chunks``: ``local_training.map_on_threads``, one single-threaded chunk per worker thread.

    Chunk-level parallelism beats intra-op parallelism here: a client's GEMMs
    (50 x 784 x 200 for the standard MLP) are too small to split well over
    threads, and single-threaded kernels cannot be starved by a thread pool
    oversubscribed by other processes.
    """
    return map_on_threads(train, chunks, workers)


def _train_chunk(
    engine, start_params: torch.Tensor, tasks: Sequence[ClientTask], settings: LocalSettings, data: TrainingData
) -> tuple[torch.Tensor, list[int]]:
    """Local SGD for one chunk (sorted by descending step count); the ``[C, P]`` final parameters and steps done."""
    num_clients = len(tasks)
    theta = start_params.unsqueeze(0).repeat(num_clients, 1)  # a fresh matrix: the yielded rows are never reused
    steps_done = [task.num_steps for task in tasks]
    if max(steps_done) == 0:
        return theta, steps_done
    schedule = BatchSchedule.build(tasks, start_params.dtype, start_params.device)
    correction = StackedCorrection.stack([_correction(task) for task in tasks], start_params)
    local_steps = [None if isinstance(task.correction, GradientCorrection) else as_local_objective(task.correction).local_step for task in tasks]
    if all(step is None for step in local_steps):
        local_steps = None
    else:
        step_states = [None if step is None else tuple(t.to(start_params.device) for t in step.initial_state) for step in local_steps]
    fused = settings.clip_norm is None and isinstance(engine, LinearReluStack) and local_steps is None
    needs_scratch = not fused or not correction.is_empty or bool(settings.weight_decay)
    gradient = None if fused else torch.empty_like(theta)
    scratch = torch.empty_like(theta) if needs_scratch else None
    inputs = engine.flat_inputs(data.inputs)
    width = schedule.rows.shape[2]
    augment = data.augment
    pixels = data.normalisation is not None
    # With augmentation or pixels the batch is gathered in the inputs' own shape (the augmentation's and the
    # normalisation's channels), normalised, augmented, then flattened for the engine.
    source = data.inputs if augment is not None or pixels else inputs
    batch_inputs = source.new_empty((num_clients, width, *source.shape[1:]))
    # A reused buffer for the float32 values the normalisation computes (a float64 run casts a copy of them instead).
    normalised = None
    if pixels and data.normalisation.dtype == torch.float32:
        normalised = torch.empty(batch_inputs.shape, dtype=torch.float32, device=batch_inputs.device)
    if augment is not None:
        base_keys = _to_device(torch.tensor([task.augment_key for task in tasks], dtype=torch.int64), schedule.rows.device).unsqueeze(1)  # [C, 1]
        slots = torch.arange(width, device=schedule.rows.device).unsqueeze(0)  # [1, W]
    stopping = _InexactStopping(engine, theta, tasks, correction, settings, data)

    for step, active in enumerate(schedule.active):
        rows = schedule.rows[step, :active]
        x = gather_rows(source, rows, batch_inputs[:active])
        if pixels:
            x = data.model_inputs(x, None if normalised is None else normalised[:active])
        if augment is not None:
            keys = example_keys(base_keys[:active], step, slots)  # [active, W]
            x = augment(x.view(active * width, *x.shape[2:]), keys.reshape(-1))
        if augment is not None or pixels:
            x = x.reshape(active, width, *inputs.shape[1:])
        targets, weights = data.targets[rows], schedule.weights[step, :active]
        block = theta[:active]
        block_correction = correction.head(active)
        if fused:
            extra = correction_terms(block, block_correction, settings.weight_decay, scratch[:active]) if scratch is not None else None
            engine.sgd_step_(block, x, targets, weights, settings.client_lr)
            if extra is not None:
                block.sub_(extra.mul_(settings.client_lr))
        elif local_steps is None:
            g = engine.loss_gradient(block, x, targets, weights, gradient[:active])
            corrected_step_(block, g, block_correction, settings, scratch[:active])
        else:
            g = engine.loss_gradient(block, x, targets, weights, gradient[:active])
            corrected_gradient_(block, g, block_correction, settings, scratch[:active])
            for k in range(active):  # the algorithm's own step, client by client on its [P] rows (objectives.LocalStep)
                if local_steps[k] is None:
                    block[k].sub_(g[k].mul_(settings.client_lr))
                else:
                    # Fresh tensors, as the sequential backend passes: a state that keeps its gradient must not alias the buffer.
                    params, step_states[k] = local_steps[k].function(block[k].clone(), g[k].clone(), step_states[k], settings.client_lr)
                    block[k].copy_(params)
        stopping.after_step(step + 1, active, steps_done)
    return stopping.finals(theta), steps_done


def gather_rows(source: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[k, i] = source[rows[k, i]]`` with one ``index_select`` into a reused buffer (no allocation per step)."""
    torch.index_select(source, 0, rows.reshape(-1), out=out.view(-1, *source.shape[1:]))
    return out


class _InexactStopping:
    """FedProx's γ-inexact local solver (algorithms.md): a client stops once ``‖∇h_k(θ)‖ ≤ γ ‖∇h_k(θ^{t−1})‖``,
    with full local gradients (a loss term included, ``local_training.objective_gradient_norm``), checked after each of
    its epochs; as ``local_training.train_one_client``.

    A stopped client keeps computing with the others (it is in the middle of the
    stack); its parameters at the stop are kept aside and returned instead.
    """

    def __init__(self, engine, theta: torch.Tensor, tasks: Sequence[ClientTask], correction: StackedCorrection, settings, data) -> None:
        self.engine, self.theta, self.tasks, self.correction, self.settings, self.data = engine, theta, tasks, correction, settings, data
        self.watched = [k for k, task in enumerate(tasks) if task.stop_gamma is not None and task.steps_per_epoch > 0]
        self.stopped: dict[int, torch.Tensor] = {}
        self.thresholds = {k: tasks[k].stop_gamma * self._norm(k) for k in self.watched}

    def _norm(self, k: int) -> float:
        theta = self.theta[k : k + 1]
        rows = self.tasks[k].sample_indices
        total = torch.zeros_like(theta)
        piece_gradient = torch.empty_like(theta)
        engine = self.engine.client(k) if isinstance(self.engine, TermGradients) else self.engine
        for start in range(0, len(rows), FULL_GRADIENT_ROWS):
            part = rows[start : start + FULL_GRADIENT_ROWS]
            weights = torch.full((1, len(part)), 1.0 / len(part), dtype=theta.dtype, device=theta.device)
            engine.loss_gradient(theta, self.engine.flat_inputs(self.data.batch(part)).unsqueeze(0), self.data.targets[part].unsqueeze(0), weights, piece_gradient)
            total += piece_gradient * (len(part) / len(rows))
        return corrected_gradient_norm(theta[0], total[0], _correction(self.tasks[k]), self.settings)

    def after_step(self, done: int, active: int, steps_done: list[int]) -> None:
        for k in self.watched:
            task = self.tasks[k]
            if k in self.stopped or k >= active or done % task.steps_per_epoch or done >= task.num_steps:
                continue
            if self._norm(k) <= self.thresholds[k]:
                self.stopped[k] = self.theta[k].clone()
                steps_done[k] = done

    def finals(self, theta: torch.Tensor) -> torch.Tensor:
        for k, params in self.stopped.items():
            theta[k] = params
        return theta


__all__ = [
    "BatchSchedule",
    "auto_backend",
    "gradient_engine",
    "LinearReluStack",
    "StackedCorrection",
    "VectorizedBackend",
    "VmappedGradient",
    "TermGradients",
    "corrected_gradient_",
    "corrected_step_",
    "correction_terms",
]
