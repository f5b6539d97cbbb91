"""Local SGD on one client, and the sequential training backend.

algorithms.md: local training is plain minibatch SGD without momentum, a fresh
optimizer every round,

    g = ∇loss(θ; batch) + a_k                      (linear correction)
    g ← g · min(1, c / (‖g‖ + 1e-6))               (optional clipping by global norm c)
    g ← g + D_k ⊙ (θ − θ_ref) + wd · θ             (quadratic term and weight decay after clipping)
    θ ← θ − η_l g

Clipping leaves the proximal/quadratic term and weight decay out, as the
FedDyn authors' code does through the optimizer's ``weight_decay``.

A client's minibatches are fixed before training by ``batch_plan`` from
(seed, round, client id), so every backend sees the same batches.  Data
augmentation (``TrainingData.augment``), when on, is applied to each step's
batch right after it is gathered; the draws of the example in column ``i`` of
step ``s`` come from its key ``example_keys(task.augment_key, s, i)``
(``randomness.py``), so they depend neither on the backend nor on how it
groups clients.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from driftlab.simulation.flat import FlatModel
from driftlab.simulation.precision import local_arithmetic
from driftlab.simulation.randomness import Stream, example_keys, generator
from driftlab.simulation.seam import GradientCorrection

PAD = -1


def steps_for_epochs(num_samples: int, batch_size: int, epochs: int) -> int:
    """``E · ⌈n_k / B⌉`` local steps (algorithms.md, FedAvg)."""
    return epochs * math.ceil(num_samples / batch_size)


def batch_plan(seed: int, round_index: int, client_id: int, num_samples: int, batch_size: int, num_steps: int) -> np.ndarray:
    """The positions (``0..n_k−1``) each local step reads, as ``[num_steps, B]`` padded with ``-1``.

    Epochs are fresh permutations; an epoch is cut into ``⌈n_k/B⌉`` batches,
    the last one short when ``B`` does not divide ``n_k``.  A fixed step count
    ``K`` takes the first ``K`` batches of that endless sequence, so partial
    work is a prefix of full work.  Depends only on (seed, round, client id).
    """
    if num_samples <= 0 or batch_size <= 0 or num_steps < 0:
        raise ValueError(f"need num_samples > 0, batch_size > 0, num_steps >= 0; got {num_samples}, {batch_size}, {num_steps}")
    rng = generator(seed, Stream.MINIBATCHES, round_index, client_id)
    width = min(batch_size, num_samples)
    per_epoch = math.ceil(num_samples / width)
    epochs = math.ceil(num_steps / per_epoch)
    plan = np.full((epochs * per_epoch, width), PAD, dtype=np.int64)
    padded_length = per_epoch * width
    for epoch in range(epochs):
        order = np.full(padded_length, PAD, dtype=np.int64)
        order[:num_samples] = rng.permutation(num_samples)
        plan[epoch * per_epoch : (epoch + 1) * per_epoch] = order.reshape(per_epoch, width)
    return plan[:num_steps]


@dataclass(frozen=True)
class LocalSettings:
    """Hyperparameters of one round's local SGD, shared by its clients."""

    learning_rate: float
    weight_decay: float = 0.0
    clip_norm: float | None = None


@dataclass(frozen=True)
class ClientTask:
    """One client's local work in a round."""

    client_id: int
    sample_indices: torch.Tensor  # global indices of the client's training samples, on the data's device
    batches: np.ndarray  # [steps, B] positions into sample_indices, PAD-padded (see batch_plan)
    correction: GradientCorrection
    # γ-inexact local solver (FedProx): stop once the full corrected local gradient norm is at most
    # stop_gamma times its value at the start, checked every steps_per_epoch steps.  None: run all steps.
    stop_gamma: float | None = None
    steps_per_epoch: int = 0
    # Base key of the client's augmentation draws this round, ``randomness.augmentation_key(seed, round, client id)``;
    # used only when ``TrainingData.augment`` is set.
    augment_key: int = 0

    @property
    def num_steps(self) -> int:
        return int(self.batches.shape[0])


@dataclass(frozen=True)
class TrainingData:
    inputs: torch.Tensor
    targets: torch.Tensor
    # Training augmentation ``(inputs [M, ...], keys [M] int64) -> inputs [M, ...]``, applied to every local step's
    # minibatch; each output example must depend only on its own input and key (e.g. ``images.flip_crop_from_keys``).
    # Full local gradients (γ-inexact stopping) and evaluation use the inputs as they are.  None: off.
    augment: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


class TrainingBackend(Protocol):
    """Runs a round's local training; yields ``(task position, final θ_k, steps done)`` in any order."""

    def train(
        self, model: FlatModel, start_params: torch.Tensor, tasks: Sequence[ClientTask], settings: LocalSettings, data: TrainingData
    ) -> Iterator[tuple[int, torch.Tensor, int]]: ...


def batch_loss(model: FlatModel, theta: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model.batch_loss(theta, inputs, targets)


def corrected_step(
    theta: torch.Tensor, loss_gradient: torch.Tensor, correction: GradientCorrection, settings: LocalSettings
) -> torch.Tensor:
    """One SGD step with the algorithm's correction (module docstring)."""
    g = loss_gradient
    if correction.linear is not None:
        g = g + correction.linear
    if settings.clip_norm is not None:
        # Same coefficient as torch.nn.utils.clip_grad_norm_, written without branches so it vmaps.
        g = g * torch.clamp(settings.clip_norm / (torch.linalg.vector_norm(g) + 1e-6), max=1.0)
    if correction.quadratic is not None:
        g = g + correction.quadratic * (theta - correction.reference)
    if settings.weight_decay:
        g = g + settings.weight_decay * theta
    return theta - settings.learning_rate * g


class BoundModule:
    """A private copy of the model whose parameters and gradients are views of two flat buffers.

    ``loss.backward()`` then writes the gradient straight into one flat
    vector, with none of the per-step cost of ``functional_call``/``torch.func``
    (about 3x faster for small models, where per-op overhead dominates).  One
    copy serves every client of the simulation; nothing is copied per client.
    """

    def __init__(self, model: FlatModel, like: torch.Tensor) -> None:
        self.source = model.module  # the module this is a copy of
        self.module = copy.deepcopy(model.module).to(device=like.device, dtype=like.dtype)
        self.example_loss = model.example_loss
        self.theta = torch.zeros_like(like)
        self.gradient = torch.zeros_like(like)
        parameters = dict(self.module.named_parameters())
        for name, theta_view, grad_view in zip(model.names, model.unflatten(self.theta).values(), model.unflatten(self.gradient).values()):
            parameters[name].data = theta_view
            parameters[name].grad = grad_view

    def loss_gradient(self, theta: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``∇ cross_entropy(model(θ; inputs), targets)``, a fresh tensor."""
        with torch.no_grad():
            self.theta.copy_(theta)
            self.gradient.zero_()
        self.example_loss(self.module(inputs), targets).mean().backward()
        return self.gradient.clone()

    def full_gradient(self, theta: torch.Tensor, rows: torch.Tensor, data: TrainingData, chunk: int = 4096) -> torch.Tensor:
        """``∇f_k(θ)``: the mean loss gradient over all of ``rows``, in chunks of ``chunk`` examples."""
        total = torch.zeros_like(theta)
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            total += self.loss_gradient(theta, data.inputs[part], data.targets[part]) * (len(part) / len(rows))
        return total


def corrected_gradient_norm(theta: torch.Tensor, loss_gradient: torch.Tensor, correction: GradientCorrection, settings: LocalSettings) -> float:
    """``‖∇h_k(θ)‖`` of the corrected local objective (no clipping: it is the objective's gradient)."""
    g = loss_gradient
    if correction.linear is not None:
        g = g + correction.linear
    if correction.quadratic is not None:
        g = g + correction.quadratic * (theta - correction.reference)
    if settings.weight_decay:
        g = g + settings.weight_decay * theta
    return float(torch.linalg.vector_norm(g))


def train_one_client(
    bound: BoundModule, start_params: torch.Tensor, task: ClientTask, settings: LocalSettings, data: TrainingData
) -> tuple[torch.Tensor, int]:
    """Local SGD for one client from ``start_params``; returns the final flat parameters and the steps done."""
    theta = start_params
    device = task.sample_indices.device
    # PAD only ever ends a row (batch_plan), so each step's batch is a prefix whose length the host knows: no device sync.
    sizes = (task.batches != PAD).sum(axis=1).tolist()
    batches = torch.as_tensor(task.batches)
    batches = batches.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else batches.to(device)
    inexact = task.stop_gamma is not None and task.steps_per_epoch > 0
    if inexact:
        threshold = task.stop_gamma * _objective_gradient_norm(bound, theta, task, settings, data)
    slots = torch.arange(batches.shape[1], device=device)
    for step in range(task.num_steps):
        size = sizes[step]
        rows = task.sample_indices[batches[step, :size]]
        inputs = data.inputs[rows]
        if data.augment is not None:
            inputs = data.augment(inputs, example_keys(task.augment_key, step, slots[:size]))
        gradient = bound.loss_gradient(theta, inputs, data.targets[rows])
        with torch.no_grad():
            theta = corrected_step(theta, gradient, task.correction, settings)
        done = step + 1
        if inexact and done % task.steps_per_epoch == 0 and done < task.num_steps:
            if _objective_gradient_norm(bound, theta, task, settings, data) <= threshold:
                return theta, done
    return theta, task.num_steps


def _objective_gradient_norm(bound: BoundModule, theta: torch.Tensor, task: ClientTask, settings: LocalSettings, data: TrainingData) -> float:
    return corrected_gradient_norm(theta, bound.full_gradient(theta, task.sample_indices, data), task.correction, settings)


class SequentialBackend:
    """The reference backend: clients one after another, one minibatch at a time."""

    name = "sequential"

    def __init__(self, precision: str = "float32") -> None:
        self.precision = precision  # precision.PRECISIONS: tf32 and bf16 change the local gradients only
        self._bound: BoundModule | None = None

    def train(
        self, model: FlatModel, start_params: torch.Tensor, tasks: Sequence[ClientTask], settings: LocalSettings, data: TrainingData
    ) -> Iterator[tuple[int, torch.Tensor, int]]:
        if (
            self._bound is None
            or self._bound.source is not model.module
            or self._bound.theta.dtype != start_params.dtype
            or self._bound.theta.device != start_params.device
        ):
            self._bound = BoundModule(model, start_params)
        for position, task in enumerate(tasks):
            with local_arithmetic(self.precision, start_params.device):
                final_params, steps_done = train_one_client(self._bound, start_params, task, settings, data)
            yield position, final_params, steps_done
