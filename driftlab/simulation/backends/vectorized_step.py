"""One chunk's local training on the ``[C, P]`` stack ``Θ`` of its clients' parameters.

algorithms.md ("Local training") and the seam (``seam.py``): client ``k`` runs
``K_k`` steps of

    g_k = ∇ℓ(θ_k; batch_k,s) + a_k                       (linear correction)
    g_k ← g_k · min(1, c / (‖g_k‖ + 1e-6))                (optional clipping, per client)
    g_k ← g_k + D_k ⊙ (θ_k − θ_ref,k) + wd · θ_k          (quadratic term, weight decay)
    θ_k ← θ_k − η_l g_k

from ``θ_k = θ^{t−1}``, every step a handful of batched operations on ``Θ``
(``vectorized.py`` explains the layout).  Without clipping, on the
``LinearReluStack``, the update is fused into the weight-gradient GEMM and the
correction terms ``E = a + D ⊙ (θ − θ_ref) + wd · θ`` (``correction_terms``) are
applied after it; otherwise the gradient is written to a buffer and corrected in
place in the order of ``local_training.corrected_step`` (``corrected_step_``).
FedProx's γ-inexact stopping (``InexactStopping``) watches clients that ask for it,
with full gradients taken in evaluation mode; local steps run in training mode,
a model's dropout masks drawn from each client's step key (``modes.step_keys``),
the sequential backend's masks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from driftlab.randomness import example_keys
from driftlab.simulation.backends.local_training import ClientTask, LocalSettings, TrainingData, corrected_gradient_norm
from driftlab.simulation.backends.modes import step_keys
from driftlab.simulation.backends.objectives import as_local_objective
from driftlab.simulation.backends.vectorized_gradients import LinearReluStack
from driftlab.simulation.backends.vectorized_layout import (
    BatchSchedule,
    StackedCorrection,
    affine_correction,
    gather_rows,
    to_device,
)
from driftlab.simulation.seam import GradientCorrection

FULL_GRADIENT_ROWS = (
    4096  # examples per piece of a full local gradient (γ-inexact stopping), as in the sequential backend
)


def corrected_step_(
    theta: torch.Tensor, g: torch.Tensor, correction: StackedCorrection, settings: LocalSettings, scratch: torch.Tensor
) -> None:
    """``local_training.corrected_step`` for a stack of clients, in place (``g`` is overwritten), same operation order."""
    theta.sub_(corrected_gradient_(theta, g, correction, settings, scratch).mul_(settings.client_lr))


def corrected_gradient_(
    theta: torch.Tensor, g: torch.Tensor, correction: StackedCorrection, settings: LocalSettings, scratch: torch.Tensor
) -> torch.Tensor:
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


def correction_terms(
    theta: torch.Tensor, correction: StackedCorrection, weight_decay: float, out: torch.Tensor
) -> torch.Tensor | None:
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


def train_chunk(
    engine, start_params: torch.Tensor, tasks: Sequence[ClientTask], settings: LocalSettings, data: TrainingData
) -> tuple[torch.Tensor, list[int]]:
    """Local SGD for one chunk (sorted by descending step count); the ``[C, P]`` final parameters and steps done."""
    num_clients = len(tasks)
    if any(task.start_params is not None for task in tasks):  # per-client views: each row starts from its own model
        theta = torch.stack([task.start(start_params) for task in tasks])
    else:
        theta = start_params.unsqueeze(0).repeat(num_clients, 1)  # a fresh matrix: the yielded rows are never reused
    steps_done = [task.num_steps for task in tasks]
    if max(steps_done) == 0:
        return theta, steps_done
    schedule = BatchSchedule.build(tasks, start_params.dtype, start_params.device)
    correction = StackedCorrection.stack([affine_correction(task) for task in tasks], start_params)
    local_steps = [
        None if isinstance(task.correction, GradientCorrection) else as_local_objective(task.correction).local_step
        for task in tasks
    ]
    if all(step is None for step in local_steps):
        local_steps = None
    else:
        step_states = [
            None if step is None else tuple(t.to(start_params.device) for t in step.initial_state)
            for step in local_steps
        ]
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
    dropout = getattr(engine, "draws_dropout", False)
    if augment is not None or dropout:
        base_keys = to_device(
            torch.tensor([task.augment_key for task in tasks], dtype=torch.int64), schedule.rows.device
        ).unsqueeze(1)  # [C, 1]
        slots = torch.arange(width, device=schedule.rows.device).unsqueeze(0)  # [1, W]
    stopping = InexactStopping(engine, theta, tasks, correction, settings, data)

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
        keys = step_keys(base_keys[:active, 0], step) if dropout else None
        block = theta[:active]
        block_correction = correction.head(active)
        if fused:
            extra = (
                correction_terms(block, block_correction, settings.weight_decay, scratch[:active])
                if scratch is not None
                else None
            )
            engine.sgd_step_(block, x, targets, weights, settings.client_lr)
            if extra is not None:
                block.sub_(extra.mul_(settings.client_lr))
        elif local_steps is None:
            g = engine.loss_gradient(block, x, targets, weights, gradient[:active], keys)
            corrected_step_(block, g, block_correction, settings, scratch[:active])
        else:
            g = engine.loss_gradient(block, x, targets, weights, gradient[:active], keys)
            corrected_gradient_(block, g, block_correction, settings, scratch[:active])
            for k in range(active):  # the algorithm's own step, client by client on its [P] rows (objectives.LocalStep)
                if local_steps[k] is None:
                    block[k].sub_(g[k].mul_(settings.client_lr))
                else:
                    # Fresh tensors, as the sequential backend passes: a state that keeps its gradient must not alias the buffer.
                    params, step_states[k] = local_steps[k].function(
                        block[k].clone(), g[k].clone(), step_states[k], settings.client_lr
                    )
                    block[k].copy_(params)
        stopping.after_step(step + 1, active, steps_done)
    return stopping.finals(theta), steps_done


class InexactStopping:
    """FedProx's γ-inexact local solver (algorithms.md): a client stops once ``‖∇h_k(θ)‖ ≤ γ ‖∇h_k(θ^{t−1})‖``,
    with full local gradients (a loss term included, ``local_training.objective_gradient_norm``), checked after each of
    its epochs; as ``local_training.train_one_client``.

    A stopped client keeps computing with the others (it is in the middle of the
    stack); its parameters at the stop are kept aside and returned instead.
    """

    def __init__(
        self, engine, theta: torch.Tensor, tasks: Sequence[ClientTask], correction: StackedCorrection, settings, data
    ) -> None:
        self.engine, self.theta, self.tasks, self.correction, self.settings, self.data = (
            engine,
            theta,
            tasks,
            correction,
            settings,
            data,
        )
        self.watched = [k for k, task in enumerate(tasks) if task.stop_gamma is not None and task.steps_per_epoch > 0]
        self.stopped: dict[int, torch.Tensor] = {}
        self.thresholds = {k: tasks[k].stop_gamma * self._norm(k) for k in self.watched}

    def _norm(self, k: int) -> float:
        theta = self.theta[k : k + 1]
        rows = self.tasks[k].sample_indices
        total = torch.zeros_like(theta)
        piece_gradient = torch.empty_like(theta)
        # An engine with per-client rows (a loss term's tensors, a client's buffers) measures client k on its own.
        engine = self.engine.client(k) if hasattr(self.engine, "client") else self.engine
        for start in range(0, len(rows), FULL_GRADIENT_ROWS):
            part = rows[start : start + FULL_GRADIENT_ROWS]
            weights = torch.full((1, len(part)), 1.0 / len(part), dtype=theta.dtype, device=theta.device)
            inputs = self.engine.flat_inputs(self.data.batch(part)).unsqueeze(0)
            engine.loss_gradient(
                theta, inputs, self.data.targets[part].unsqueeze(0), weights, piece_gradient, training=False
            )
            total += piece_gradient * (len(part) / len(rows))
        return corrected_gradient_norm(theta[0], total[0], affine_correction(self.tasks[k]), self.settings)

    def after_step(self, done: int, active: int, steps_done: list[int]) -> None:
        for k in self.watched:
            task = self.tasks[k]
            if k in self.stopped or k >= active or done % task.steps_per_epoch or done >= task.num_steps:
                continue
            if self._norm(k) <= self.thresholds[k]:
                self.stopped[k] = self.theta[k].clone()
                if hasattr(self.engine, "freeze"):  # its buffers too: it keeps computing with the others
                    self.engine.freeze(k)
                steps_done[k] = done

    def finals(self, theta: torch.Tensor) -> torch.Tensor:
        for k, params in self.stopped.items():
            theta[k] = params
        return theta
