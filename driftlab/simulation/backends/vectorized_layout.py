"""What the vectorized backend's chunk of clients brings, laid out as rows on the chunk's device.

* ``StackedCorrection``: the clients' ``GradientCorrection``s as ``[C, P]`` rows
  (a tensor every client shares kept once as ``[1, P]``);
* ``BatchSchedule``: every step's minibatch of every client as a ``[S, C, W]``
  table of sample rows and weights, built on the host and sent in one copy;
* ``gather_rows``: a step's inputs gathered into a reused buffer;
* the objective helpers that group a round's clients (affine; a loss term;
  a local step alone) and take each client's affine part.

The backend (``vectorized.py``) and the chunk's training loop
(``vectorized_step.py``) read these; nothing here computes a gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from driftlab.simulation.backends.local_training import PAD, ClientTask
from driftlab.simulation.backends.objectives import LocalObjective, LossTerm, as_local_objective
from driftlab.simulation.seam import GradientCorrection


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
            quadratic = to_device(
                torch.tensor([[0.0 if q is None else float(q)] for q in quadratics], dtype=like.dtype), like.device
            )
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
        rows = samples[to_device(torch.from_numpy(positions), device)]
        active = tuple(sum(1 for task in tasks if task.num_steps > s) for s in range(steps))
        return BatchSchedule(rows, to_device(weights, device), active)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory and without waiting, when ``device`` is a GPU."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def gather_rows(source: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[k, i] = source[rows[k, i]]`` with one ``index_select`` into a reused buffer (no allocation per step)."""
    torch.index_select(source, 0, rows.reshape(-1), out=out.view(-1, *source.shape[1:]))
    return out


# ---------------------------------------------------------------- objectives of a chunk


def normalized_objective(task: ClientTask) -> ClientTask:
    """``task`` with a ``GradientCorrection`` (an affine objective) or a non-affine ``LocalObjective``."""
    if isinstance(task.correction, GradientCorrection):
        return task
    objective = as_local_objective(task.correction)
    return dataclasses.replace(task, correction=objective.correction if objective.is_affine else objective)


def loss_term_of(task: ClientTask) -> LossTerm | None:
    return None if isinstance(task.correction, GradientCorrection) else as_local_objective(task.correction).loss_term


def affine_correction(task: ClientTask) -> GradientCorrection:
    """The affine part of a task's objective."""
    return (
        task.correction
        if isinstance(task.correction, GradientCorrection)
        else as_local_objective(task.correction).correction
    )


def group_key(objective: GradientCorrection | LocalObjective) -> tuple:
    """Clients with equal keys are trained together: affine ones; a loss term (same function, same tensor shapes,
    so they stack); a local step alone (applied row by row, any step).  ``objective`` is ``normalized_objective``."""
    if isinstance(objective, GradientCorrection):
        return ("affine",)
    term = objective.loss_term
    if term is None:
        return ("step",)
    return ("term", id(term.function), tuple((tuple(t.shape), t.dtype, t.device) for t in term.tensors))
