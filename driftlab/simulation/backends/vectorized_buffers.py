"""The vectorized backend for a model with buffers (BatchNorm's running statistics; ``buffers.py``).

Every client of a chunk has its own buffers, a ``[C, ...]`` stack of each
(``ChunkBuffers``), started from the round's; a local step is

    g_k, b_k ← vmap over k of grad(Σ_i w_ki ℓ(functional_call(module, (θ_k, b_k), x_k)))

where the training-mode forward updates ``b_k`` in place, as BatchNorm updates a
module's own buffers (``torch.func`` batches the in-place update of a stacked
buffer: each client's row moves with its own batch alone).  A client's
BatchNorm must see its own batch and nothing else, so a step where some client's
batch is short (the last batch of an epoch, padded in the stack) computes each
group of clients with one batch size on its unpadded rows: the batch
statistics are those of the sequential backend's batch, and so are the
running statistics.  Measurements (γ-inexact stopping's full gradient) run in
evaluation mode with the client's own running statistics, as the sequential
backend's copy does.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import ClientTask, TrainingData
from driftlab.simulation.backends.modes import keyed_dropout
from driftlab.simulation.backends.stacked import module_for_this_thread
from driftlab.simulation.backends.vectorized_engine import GradientEngine, StepBatch
from driftlab.simulation.backends.vectorized_gradients import VmappedGradient, vmap_problem


class BufferedGradient(VmappedGradient):
    """``vmap`` over clients of ``grad`` of the masked mean loss through ``functional_call`` with each client's
    buffers (module docstring); one per model, shared by the chunks (each thread calls its own copy of the module).
    The memory estimates (``activation_elements``) are ``VmappedGradient``'s."""

    def __init__(self, model: FlatModel) -> None:
        super().__init__(model)

        def masked_loss(theta, buffers, inputs, targets, weights):
            module = self._copies.current
            outputs = torch.func.functional_call(module, (model.unflatten(theta), buffers), (inputs,))
            return (model.example_loss(outputs, targets) * weights).sum()

        def keyed_loss(theta, buffers, inputs, targets, weights, key):
            with keyed_dropout(key):  # inside vmap: each client's masks from its own key
                return masked_loss(theta, buffers, inputs, targets, weights)

        self._buffered_gradient = torch.func.vmap(torch.func.grad(masked_loss))
        self._keyed_buffered_gradient = torch.func.vmap(torch.func.grad(keyed_loss))

    def gradient(self, theta: torch.Tensor, buffers: Mapping[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        """``[n, P]`` gradients of the ``n`` rows of ``theta`` on ``batch``, each with its row of ``buffers`` (updated in
        place in training mode)."""
        self._copies.current = module_for_this_thread(self._copies, self.model.module, theta.device, batch.training)
        keys = batch.dropout_keys(theta, self.draws_dropout)
        if keys is not None:
            return self._keyed_buffered_gradient(theta, dict(buffers), batch.inputs, batch.targets, batch.weights, keys)
        return self._buffered_gradient(theta, dict(buffers), batch.inputs, batch.targets, batch.weights)


class ChunkBuffers(GradientEngine):
    """One chunk's gradient engine: ``BufferedGradient`` with the chunk's ``[C, ...]`` buffers (module docstring), the
    interface ``vectorized_step.train_chunk`` calls."""

    def __init__(
        self, engine: BufferedGradient, starts: Sequence[Mapping[str, torch.Tensor]], like: torch.Tensor
    ) -> None:
        """``starts``: each client's buffers to start from, in the chunk's order."""
        self.engine = engine
        self.stack = {
            name: torch.stack([start[name].to(like.device) for start in starts]).contiguous() for name in starts[0]
        }
        self._row: int | None = None  # client(k): this engine computes for row k alone
        self._frozen: dict[int, dict[str, torch.Tensor]] = {}  # clients stopped early (γ-inexact): their buffers then

    @property
    def draws_dropout(self) -> bool:
        return self.engine.draws_dropout

    def client(self, k: int) -> "ChunkBuffers":
        """This chunk's engine for client ``k`` alone (a one-row ``theta``: γ-inexact stopping's measurements)."""
        single = ChunkBuffers.__new__(ChunkBuffers)
        single.engine, single.stack, single._row, single._frozen = self.engine, self.stack, k, self._frozen
        return single

    def freeze(self, k: int) -> None:
        """Client ``k`` stopped (γ-inexact): its buffers are those of now, whatever its row computes after."""
        self._frozen[k] = {name: value[k].clone() for name, value in self.stack.items()}

    def buffers_of(self, k: int) -> dict[str, torch.Tensor]:
        """Client ``k``'s final buffers (copies)."""
        if k in self._frozen:
            return self._frozen[k]
        return {name: value[k].clone() for name, value in self.stack.items()}

    def write_gradient(self, theta: torch.Tensor, batch: StepBatch, out: torch.Tensor) -> None:
        """``out[k] = ∇_θ Σ_i w_ki ℓ(θ_k, b_k; x_ki, y_ki)`` for the ``n`` rows of ``theta`` (the chunk's first ``n``
        clients, or client ``k`` of ``client(k)``), their buffers updated in training mode."""
        n = theta.shape[0]
        rows = slice(self._row, self._row + 1) if self._row is not None else slice(0, n)
        buffers = {name: value[rows] for name, value in self.stack.items()}  # views: updates land in the stack
        sizes = (batch.weights > 0).sum(dim=1)
        width = batch.weights.shape[1]
        if not batch.training or bool((sizes == width).all()):
            out.copy_(self.engine.gradient(theta, buffers, batch))
            return
        # A short batch is padded in the stack: each group of clients with one batch size on its real rows alone.
        for size in torch.unique(sizes).tolist():
            group = torch.nonzero(sizes == size).flatten()
            mine = {name: value[group] for name, value in buffers.items()}  # copies: written back below
            out[group] = self.engine.gradient(theta[group], mine, batch.part(group, size))
            for name, value in mine.items():
                buffers[name][group] = value


def buffered_problem(
    engine: BufferedGradient,
    start: Mapping[str, torch.Tensor],
    start_params: torch.Tensor,
    task: ClientTask,
    data: TrainingData,
) -> str | None:
    """Try the buffered gradient on two clients' first batch (``vmap_problem``, on copies of the buffers); the error
    text if it fails."""
    return vmap_problem(ChunkBuffers(engine, [start, start], start_params), start_params, task, data)


__all__ = ["BufferedGradient", "ChunkBuffers", "buffered_problem"]
