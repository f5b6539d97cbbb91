"""Local SGD on one client, the training backends' interface (``TrainingBackend``), and the sequential backend.

algorithms.md: local training is plain minibatch SGD without momentum, a fresh
optimizer every round,

    g = ∇loss(θ; batch) + a_k                      (linear correction)
    g ← g · min(1, c / (‖g‖ + 1e-6))               (optional clipping by global norm c)
    g ← g + D_k ⊙ (θ − θ_ref) + wd · θ             (quadratic term and weight decay after clipping)
    θ ← θ − η_l g

Clipping leaves the proximal/quadratic term and weight decay out, as the
FedDyn authors' code does through the optimizer's ``weight_decay``.

An algorithm whose local objective is not affine gives a ``LocalObjective``
(``objectives.py``): a loss term's gradient joins ``∇loss`` before the
correction and clipping, and a local step of its own replaces the last line
(``θ, s ← step(θ, g, s, η_l)``).  Tasks with a plain ``GradientCorrection``
run exactly the code above.

A client's minibatches are fixed before training by ``batch_plan`` from
(seed, round, client id), so every backend sees the same batches.  Data
augmentation (``TrainingData.augment``), when on, is applied to each step's
batch right after it is gathered (and normalised, for uint8 images kept with a
``TrainingData.normalisation``); the draws of the example in column ``i`` of
step ``s`` come from its key ``example_keys(task.augment_key, s, i)``
(``randomness.py``), so they depend neither on the backend nor on how it
groups clients.

Modes (``modes.py``): local steps run the module in training mode, a model's
dropout masks drawn from the step's key ``modes.step_keys(task.augment_key, s)``;
γ-inexact stopping's full local gradient is a measurement and runs in
evaluation mode.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from driftlab.data.pixels import PixelNormalisation
from driftlab.randomness import Stream, example_keys, generator
from driftlab.simulation.backends.buffers import RoundBuffers, load_buffers
from driftlab.simulation.backends.flat import FlatModel, copy_module
from driftlab.simulation.backends.modes import keyed_dropout, set_mode, step_keys
from driftlab.simulation.backends.objectives import LocalObjective, LossTerm, as_local_objective, objective_loss
from driftlab.simulation.backends.precision import local_arithmetic
from driftlab.simulation.seam import GradientCorrection

PAD = -1


def steps_for_epochs(num_samples: int, batch_size: int, epochs: int) -> int:
    """``E · ⌈n_k / B⌉`` local steps (algorithms.md, FedAvg)."""
    return epochs * math.ceil(num_samples / batch_size)


def batch_plan(
    seed: int,
    round_index: int,
    client_id: int,
    num_samples: int,
    batch_size: int,
    num_steps: int,
    stream: Stream = Stream.MINIBATCHES,
) -> np.ndarray:
    """The positions (``0..n_k−1``) each local step reads, as ``[num_steps, B]`` padded with ``-1``.

    Epochs are fresh permutations; an epoch is cut into ``⌈n_k/B⌉`` batches,
    the last one short when ``B`` does not divide ``n_k``.  A fixed step count
    ``K`` takes the first ``K`` batches of that endless sequence, so partial
    work is a prefix of full work.  Depends only on (seed, round, client id) and
    ``stream`` (a personalized model's own steps draw from their own stream).
    """
    if num_samples <= 0 or batch_size <= 0 or num_steps < 0:
        raise ValueError(
            f"need num_samples > 0, batch_size > 0, num_steps >= 0; got {num_samples}, {batch_size}, {num_steps}"
        )
    rng = generator(seed, stream, round_index, client_id)
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

    client_lr: float  # η_l of the round (config client.lr)
    weight_decay: float = 0.0
    clip_norm: float | None = None


@dataclass(frozen=True)
class ClientTask:
    """One client's local work in a round."""

    client_id: int
    sample_indices: torch.Tensor  # global indices of the client's training samples, on the data's device
    batches: np.ndarray  # [steps, B] positions into sample_indices, PAD-padded (see batch_plan)
    # What the algorithm's client_objective returned: an affine correction (the fast path), or a LocalObjective
    # with a loss term and/or a local step of its own (objectives.py).
    correction: GradientCorrection | LocalObjective
    # γ-inexact local solver (FedProx): stop once the full local objective's gradient norm (loss term included,
    # see objective_gradient_norm) is at most stop_gamma times its value at the start, checked every
    # steps_per_epoch steps.  None: run all steps.
    stop_gamma: float | None = None
    steps_per_epoch: int = 0
    # Base key of the client's per-step draws this round, ``randomness.augmentation_key(seed, round, client id)``:
    # augmentation (when ``TrainingData.augment`` is set) and dropout masks (``modes.step_keys``, for a model with dropout).
    augment_key: int = 0
    # This client's own start model (an algorithm with per-client views, ``Algorithm.client_view``); None: the
    # round's start model every backend is given.
    start_params: torch.Tensor | None = None

    def start(self, round_start: torch.Tensor) -> torch.Tensor:
        """The model this client's local SGD starts from."""
        return round_start if self.start_params is None else self.start_params.to(round_start.device)

    @property
    def num_steps(self) -> int:
        return int(self.batches.shape[0])


@dataclass(frozen=True)
class TrainingData:
    inputs: torch.Tensor
    targets: torch.Tensor
    # Training augmentation ``(inputs [M, ...], keys [M] int64) -> inputs [M, ...]``, applied to every local step's
    # minibatch; each output example must depend only on its own input and key (e.g. ``augmentation.flip_crop_from_keys``).
    # Full local gradients (γ-inexact stopping) and evaluation use the inputs as they are.  None: off.
    augment: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # uint8 image inputs normalised batch by batch (``data.pixels``): every gathered batch goes through
    # ``model_inputs`` before the model (and before augmentation, which pads the normalised image with zeros).
    # None: the inputs are the model's inputs as they are.
    normalisation: PixelNormalisation | None = None

    def model_inputs(self, gathered: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows gathered from ``inputs`` as the model takes them: normalised when the inputs are pixels, else as they are
        (``out``: a float32 buffer for the normalised values)."""
        return gathered if self.normalisation is None else self.normalisation(gathered, out)

    def batch(self, rows: torch.Tensor) -> torch.Tensor:
        """The model's inputs of ``rows`` (``model_inputs`` of ``inputs[rows]``)."""
        return self.model_inputs(self.inputs[rows])


@dataclass(frozen=True)
class LocalWork:
    """A round's local training as a backend is given it: ``TrainingBackend.train``'s arguments."""

    model: FlatModel
    start_params: torch.Tensor  # the round's start model (a task may bring its own: ClientTask.start)
    tasks: Sequence[ClientTask]
    settings: LocalSettings
    data: TrainingData
    buffers: RoundBuffers | None = None


class TrainingBackend(ABC):
    """Runs a round's local training; yields ``(task position, final θ_k, steps done)`` in any order.

    ``buffers`` (given for a model with buffers, ``buffers.py``): every client trains from ``buffers.start`` and its
    final buffers are recorded with ``buffers.record`` before its result is yielded.  A backend trains the round in
    ``train_round``, from the arguments of ``train`` as one ``LocalWork``."""

    def train(
        self,
        model: FlatModel,
        start_params: torch.Tensor,
        tasks: Sequence[ClientTask],
        settings: LocalSettings,
        data: TrainingData,
        buffers: RoundBuffers | None = None,
    ) -> Iterator[tuple[int, torch.Tensor, int]]:
        return self.train_round(LocalWork(model, start_params, tasks, settings, data, buffers))

    @abstractmethod
    def train_round(self, work: LocalWork) -> Iterator[tuple[int, torch.Tensor, int]]:
        """The round's clients (``train``)."""


def corrected_gradient(
    theta: torch.Tensor, loss_gradient: torch.Tensor, correction: GradientCorrection, settings: LocalSettings
) -> torch.Tensor:
    """``g`` of the module docstring: the loss gradient corrected, clipped, plus the quadratic term and weight decay."""
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
    return g


def corrected_step(
    theta: torch.Tensor, loss_gradient: torch.Tensor, correction: GradientCorrection, settings: LocalSettings
) -> torch.Tensor:
    """One SGD step with the algorithm's correction (module docstring)."""
    return theta - settings.client_lr * corrected_gradient(theta, loss_gradient, correction, settings)


class BoundModule:
    """A private copy of the model whose parameters and gradients are views of two flat buffers.

    ``loss.backward()`` then writes the gradient straight into one flat
    vector, with none of the per-step cost of ``functional_call``/``torch.func``
    (about 3x faster for small models, where per-op overhead dominates).  One
    copy per thread serves every client that thread trains; nothing is copied per client.

    Local steps (``loss_gradient``, ``term_gradient`` and a term's ``forward``) run the copy in training mode,
    its dropout masks drawn from the step's ``key`` (``modes.keyed_dropout``); the full gradients of γ-inexact
    stopping (``full_gradient``, ``full_term_gradient``) are measurements, in evaluation mode.
    """

    def __init__(self, model: FlatModel, like: torch.Tensor) -> None:
        self.source = model.module  # the module this is a copy of
        self.module = copy_module(model.module).to(device=like.device, dtype=like.dtype)
        self.example_loss = model.example_loss
        self.unflatten = model.unflatten
        self.dropout = model.dropout
        self._training: bool | None = None  # the copy's mode, set by _mode (the copy is this thread's alone)
        # True while the copy trains a client from the round's buffers (``start_buffers``): its running statistics are
        # then that client's, and a switch to evaluation mode keeps them (else it takes the shared module's).
        self._own_buffers = False
        self.theta = torch.zeros_like(like)
        self.gradient = torch.zeros_like(like)
        parameters = dict(self.module.named_parameters())
        for name, theta_view, grad_view in zip(
            model.names, model.unflatten(self.theta).values(), model.unflatten(self.gradient).values(), strict=True
        ):
            parameters[name].data = theta_view
            parameters[name].grad = grad_view

    def _mode(self, training: bool) -> None:
        if self._training is not training:
            set_mode(self.module, training, None if self._own_buffers else self.source)
            self._training = training

    def start_buffers(self, buffers: RoundBuffers | None, position: int) -> None:
        """The client of task ``position``, about to train, starts from its buffers of the round
        (``buffers.start_of``); None: buffers are not state (a caller that tracks none), the copy's mode switches take
        the shared module's as before."""
        self._own_buffers = buffers is not None
        if buffers is not None:
            load_buffers(self.module, buffers.start_of(position))

    def loss_gradient(
        self,
        theta: torch.Tensor,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        key: torch.Tensor | None = None,
        training: bool = True,
    ) -> torch.Tensor:
        """``∇ cross_entropy(model(θ; inputs), targets)``, a fresh tensor; in training mode (dropout masks from ``key``,
        see ``modes.py``) unless ``training`` is False."""
        with torch.no_grad():
            self.theta.copy_(theta)
            self.gradient.zero_()
        self._mode(training)
        with keyed_dropout(key if training and self.dropout else None):
            self.example_loss(self.module(inputs), targets).mean().backward()
        return self.gradient.clone()

    def full_gradient(
        self, theta: torch.Tensor, rows: torch.Tensor, data: TrainingData, chunk: int = 4096
    ) -> torch.Tensor:
        """``∇f_k(θ)``: the mean loss gradient over all of ``rows``, in chunks of ``chunk`` examples, in evaluation mode."""
        total = torch.zeros_like(theta)
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            total += self.loss_gradient(theta, data.batch(part), data.targets[part], training=False) * (
                len(part) / len(rows)
            )
        return total

    def forward(self, theta: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The module's outputs at any flat ``theta`` (a loss term's ``batch.forward``), in the copy's current mode."""
        return torch.func.functional_call(self.module, self.unflatten(theta), (inputs,))

    def term_gradient(
        self,
        theta: torch.Tensor,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        term: LossTerm,
        key: torch.Tensor | None = None,
        training: bool = True,
    ) -> torch.Tensor:
        """``∇[mean loss + term]`` on one batch (``objectives.objective_loss``), by ``torch.func.grad``; modes as ``loss_gradient``."""
        weights = torch.full((len(targets),), 1.0 / len(targets), dtype=theta.dtype, device=theta.device)
        loss = objective_loss(self.forward, self.example_loss, term.function)
        self._mode(training)
        with keyed_dropout(key if training and self.dropout else None):
            return torch.func.grad(loss)(theta, inputs, targets, weights, *term.tensors)

    def full_term_gradient(
        self, theta: torch.Tensor, rows: torch.Tensor, data: TrainingData, term: LossTerm, chunk: int = 4096
    ) -> torch.Tensor:
        """``∇[f_k + term]`` over all of ``rows``: pieces of ``chunk`` examples weighted by their share of the rows
        (exact for a term that is a weighted batch mean plus a function of θ alone)."""
        total = torch.zeros_like(theta)
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            total += self.term_gradient(theta, data.batch(part), data.targets[part], term, training=False) * (
                len(part) / len(rows)
            )
        return total


def corrected_gradient_norm(
    theta: torch.Tensor, loss_gradient: torch.Tensor, correction: GradientCorrection, settings: LocalSettings
) -> float:
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
    objective = as_local_objective(task.correction)
    correction, term, local_step = objective.correction, objective.loss_term, objective.local_step
    step_state = None if local_step is None else local_step.initial_state
    theta = start_params
    device = task.sample_indices.device
    # PAD only ever ends a row (batch_plan), so each step's batch is a prefix whose length the host knows: no device sync.
    sizes = (task.batches != PAD).sum(axis=1).tolist()
    batches = torch.as_tensor(task.batches)
    batches = batches.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else batches.to(device)
    inexact = task.stop_gamma is not None and task.steps_per_epoch > 0
    if inexact:
        threshold = task.stop_gamma * objective_gradient_norm(bound, theta, task, settings, data)
    slots = torch.arange(batches.shape[1], device=device)
    for step in range(task.num_steps):
        size = sizes[step]
        rows = task.sample_indices[batches[step, :size]]
        inputs = data.batch(rows)
        if data.augment is not None:
            inputs = data.augment(inputs, example_keys(task.augment_key, step, slots[:size]))
        key = step_keys(task.augment_key, step).to(device) if bound.dropout else None
        try:
            if term is None:
                gradient = bound.loss_gradient(theta, inputs, data.targets[rows], key)
            else:
                gradient = bound.term_gradient(theta, inputs, data.targets[rows], term, key)
        except ValueError as error:
            if size != 1 or "more than 1 value per channel" not in str(error):
                raise
            raise ValueError(
                f"client {task.client_id}'s local step {step} has a batch of one example ({error}): BatchNorm in "
                f"training mode needs two; pick client.batch_size so that no client's size leaves a remainder of 1 "
                f"(this client has {len(task.sample_indices)} examples), or use GroupNorm"
            ) from None
        with torch.no_grad():
            if local_step is None:
                theta = corrected_step(theta, gradient, correction, settings)
            else:
                theta, step_state = local_step.function(
                    theta, corrected_gradient(theta, gradient, correction, settings), step_state, settings.client_lr
                )
        done = step + 1
        if inexact and done % task.steps_per_epoch == 0 and done < task.num_steps:
            if objective_gradient_norm(bound, theta, task, settings, data) <= threshold:
                return theta, done
    return theta, task.num_steps


def objective_gradient_norm(
    bound: BoundModule, theta: torch.Tensor, task: ClientTask, settings: LocalSettings, data: TrainingData
) -> float:
    """``‖∇h_k(θ)‖`` over the client's whole data, for γ-inexact stopping: ``h_k = f_k + term + correction terms``.

    A loss term is included, evaluated on all of the client's examples as one
    batch (``BoundModule.full_term_gradient``); a local step of the algorithm's
    own is not part of the objective and plays no role here.
    """
    objective = as_local_objective(task.correction)
    if objective.loss_term is None:
        gradient = bound.full_gradient(theta, task.sample_indices, data)
    else:
        gradient = bound.full_term_gradient(theta, task.sample_indices, data, objective.loss_term)
    return corrected_gradient_norm(theta, gradient, objective.correction, settings)


class SequentialBackend(TrainingBackend):
    """The reference backend: each client on its own, one minibatch at a time.

    On a CPU every client trains with single-threaded kernels
    (``single_threaded_clients``), on as many threads as torch has intra-op
    threads (``map_on_threads``, as the vectorized backend's chunks): a
    client's kernels are too small to split over threads, single-threaded
    ones are not starved when other processes load the machine, and a
    client's numbers then never depend on the thread count or on how many
    clients the round has, so ``client.run_client`` (a deployment's client)
    computes exactly what this backend computes.  Clients with a loss term
    (``torch.func`` through this backend's bound module) train one by one
    after the others, single-threaded too.

    Args:
        precision: ``precision.PRECISIONS``; tf32 and bf16 change the local gradients only.
        parallel_clients: train several clients at once on a CPU (above); ``False``: one
            after another.  The same numbers either way.
    """

    name = "sequential"

    def __init__(self, precision: str = "float32", parallel_clients: bool = True) -> None:
        self.precision = precision
        self.parallel_clients = parallel_clients
        self._free: list[BoundModule] = []  # one bound copy per client training at once, reused across rounds
        self._lock = threading.Lock()

    def workers(self, start_params: torch.Tensor, num_tasks: int) -> int:
        """Clients trained at once: one per intra-op thread on a CPU (each single-threaded), else one."""
        if not self.parallel_clients or start_params.device.type != "cpu":
            return 1
        return max(1, min(torch.get_num_threads(), num_tasks))

    def train_round(self, work: LocalWork) -> Iterator[tuple[int, torch.Tensor, int]]:
        """The round's clients (``TrainingBackend``); with ``work.buffers``, each from the round's and recorded after."""
        start_params, buffers = work.start_params, work.buffers

        def train_position(position: int) -> tuple[int, torch.Tensor, int]:
            bound = self._acquire(work.model, start_params)
            try:
                bound.start_buffers(buffers, position)
                with local_arithmetic(self.precision, start_params.device):
                    task = work.tasks[position]
                    final_params, steps_done = train_one_client(
                        bound, task.start(start_params), task, work.settings, work.data
                    )
                if buffers is not None:
                    buffers.record(position, bound.module)
            finally:
                self._release(bound)
            return position, final_params, steps_done

        with_term = [p for p, task in enumerate(work.tasks) if _has_loss_term(task)]
        threaded = [p for p, task in enumerate(work.tasks) if not _has_loss_term(task)]
        workers = self.workers(start_params, len(threaded))  # read before the threads are set to one
        with single_threaded_clients(start_params.device):
            yield from map_on_threads(train_position, threaded, workers)
            yield from map(train_position, with_term)

    def _acquire(self, model: FlatModel, like: torch.Tensor) -> BoundModule:
        with self._lock:
            # A copy of another model (or dtype, device) is dropped: a run trains one model.
            self._free = [
                b
                for b in self._free
                if b.source is model.module and b.theta.dtype == like.dtype and b.theta.device == like.device
            ]
            if self._free:
                return self._free.pop()
        return BoundModule(model, like)

    def _release(self, bound: BoundModule) -> None:
        with self._lock:
            self._free.append(bound)


def _has_loss_term(task: ClientTask) -> bool:
    return (
        not isinstance(task.correction, GradientCorrection)
        and as_local_objective(task.correction).loss_term is not None
    )


@contextmanager
def single_threaded_clients(device: torch.device) -> Iterator[None]:
    """One intra-op thread (a process-wide setting) while clients train on a CPU, restored after.

    Whether a kernel splits its work over threads can change the last bits of
    its result; a client trained with one thread gives the same numbers on
    any machine, in any round, alone or beside others, in the simulator and
    on a deployment's node.
    """
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def map_on_threads(function: Callable, items: list, workers: int) -> Iterator:
    """``function`` over ``items``, in order with one worker, else as they finish on ``workers`` threads.

    Item-level parallelism beats intra-op parallelism for the backends' work
    items (one client, one chunk of clients): their kernels are too small to
    split well over threads, and single-threaded kernels cannot be starved by a
    thread pool oversubscribed by other processes.  Intra-op threads are set to
    one while the items run (a process-wide setting) and restored after; at
    most ``workers`` items are in flight, so their results never pile up.
    """
    if workers == 1:
        yield from map(function, items)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="driftlab-train") as pool:
            pending = [pool.submit(function, item) for item in items[:workers]]
            upcoming = iter(items[workers:])
            while pending:
                finished = next(as_completed(pending))
                pending.remove(finished)
                item = next(upcoming, None)
                if item is not None:
                    pending.append(pool.submit(function, item))
                yield finished.result()
    finally:
        torch.set_num_threads(threads)
