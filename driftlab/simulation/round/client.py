"""One client's round, with explicit inputs and outputs: the one client code path.

Every backend and every deployment runs a client through these functions::

    client = ClientRound(algorithm, view, client_state, context, client_data, settings)
    task = client_start(client)
    ... local SGD of task from view.params (a backend trains many tasks at once) ...
    new_state, message = client_end(client, final_params, steps_done)

``run_client`` is the three in a row for one client, with the sequential
backend's local SGD (``local_training.train_one_client``); a deployment client
and the tests call it.  The engine calls ``client_start`` for every active
client of a round, lets its backend train the tasks (one by one, or many
clients per chunk), and calls ``client_end`` for each client as it finishes,
so every backend runs the same client code.

A client sees only what a real one would: the algorithm's client view (what
the server broadcast), its own state, its ``ClientContext``, its data and the
round's settings.  All its random draws (minibatches, augmentation, dropout
masks, EFL's Fisher sample) derive from (seed, round, client id).  Its local
steps run the model in training mode; the measurements a
``ClientDataComputation`` offers the algorithm (``loss_gradient``,
``full_gradient``, ``diagonal_fisher``) go through ``FlatModel.forward``, in
evaluation mode (``backends/modes.py``): deterministic, no dropout mask, which
also holds for the personal steps APFL replays with ``loss_gradient``.

Example (one SCAFFOLD client with ten examples of its own):
    >>> import torch
    >>> from driftlab.algorithms import scaffold
    >>> from driftlab.optim.server import make_server_optimizer
    >>> from driftlab.simulation.backends.flat import FlatModel
    >>> from driftlab.simulation.backends.local_training import LocalSettings, TrainingData
    >>> from driftlab.simulation.seam import ClientContext
    >>> model = FlatModel.wrap(torch.nn.Linear(4, 3))
    >>> data = ClientData(model, TrainingData(torch.randn(10, 4), torch.randint(0, 3, (10,))), rows=torch.arange(10))
    >>> algorithm = scaffold.build(make_server_optimizer("sgd"))
    >>> view = algorithm.broadcast(algorithm.server_init(model.initial_parameters()))
    >>> context = ClientContext(client_id=0, round=1, num_samples=10, mean_num_samples=10.0, num_registered=1, planned_steps=6, client_lr=0.1)
    >>> settings = ClientSettings(seed=0, batch_size=4, local=LocalSettings(0.1))
    >>> client = ClientRound(algorithm, view, algorithm.client_state_init(view.params), context, data, settings)
    >>> state, message, steps = run_client(client)
    >>> steps, tuple(message.control_delta.shape)
    (6, (15,))
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from driftlab.randomness import Stream, augmentation_key, example_keys, generator
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import (
    PAD,
    BoundModule,
    ClientTask,
    LocalSettings,
    TrainingData,
    batch_plan,
    single_threaded_clients,
    steps_for_epochs,
    train_one_client,
)
from driftlab.simulation.backends.precision import local_arithmetic
from driftlab.simulation.seam import NO_CORRECTION, Algorithm, ClientContext, ClientUpdate


@dataclass(frozen=True)
class ClientData:
    """What a client holds: the model it trains (architecture and loss) and its training examples.

    ``rows`` are the client's rows of ``training``: a simulation shares one
    ``TrainingData`` among all clients, a node passes its own tensors with
    ``rows = torch.arange(n)``.
    """

    model: FlatModel
    training: TrainingData
    rows: torch.Tensor  # int64, on the data's device

    @property
    def num_samples(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class ClientSettings:
    """What a client needs of the round besides the view and its context: the same for every client of the round."""

    seed: int  # the run's seed: a client's draws derive from (seed, round, client id)
    batch_size: int
    local: LocalSettings  # η_l of the round, weight decay, clipping
    inexact_gamma: float | None = None  # FedProx's γ-inexact local solver; None: always do the steps asked for
    augment: bool = False  # draw augmentation keys (the augmentation itself is ``ClientData.training.augment``)
    precision: str = (
        "float32"  # run_client's local arithmetic (precision.PRECISIONS); the engine's backends have their own
    )


# One bound copy of the model per thread, reused by every client computation's ``train`` on that thread (Ditto's personal
# pass runs for every client of every round, fine-tuning for every client at every evaluation): a copy per call would
# copy the module each time.  A bound module keeps no state between calls (train_one_client writes its θ each step).
_BOUND = threading.local()


def _bound_module(model: FlatModel, like: torch.Tensor) -> BoundModule:
    bound = getattr(_BOUND, "module", None)
    if (
        bound is None
        or bound.source is not model.module
        or bound.theta.dtype != like.dtype
        or bound.theta.device != like.device
    ):
        bound = _BOUND.module = BoundModule(model, like)
    return bound


PURPOSES = {
    "local": Stream.MINIBATCHES,
    "personal": Stream.PERSONAL_MINIBATCHES,
    "finetune": Stream.FINETUNE_MINIBATCHES,
}


@dataclass(frozen=True)
class ClientDataComputation:
    """``seam.ClientComputation`` on one client's data; its samples derive from (seed, round, client id).

    ``round_settings`` (the round's ``ClientSettings``) is needed by ``train``, ``minibatches`` and ``settings``
    only: a caller that asks for the Fisher or a full gradient alone may leave it out."""

    data: ClientData
    seed: int
    round: int
    client_id: int
    round_settings: ClientSettings | None = None

    @property
    def settings(self) -> LocalSettings:
        return self._round_settings().local

    def _round_settings(self) -> ClientSettings:
        if self.round_settings is None:
            raise RuntimeError(
                "this client computation was made without the round's settings (ClientDataComputation.round_settings)"
            )
        return self.round_settings

    def _stream(self, purpose: str) -> Stream:
        if purpose not in PURPOSES:
            raise ValueError(f"unknown purpose {purpose!r} of a client's local steps; valid: {', '.join(PURPOSES)}")
        return PURPOSES[purpose]

    def _task(self, steps: int, purpose: str, correction: Any = NO_CORRECTION) -> ClientTask:
        settings = self._round_settings()
        stream = self._stream(purpose)
        num_samples = self.data.num_samples
        batches = batch_plan(settings.seed, self.round, self.client_id, num_samples, settings.batch_size, steps, stream)
        augment_key = (
            augmentation_key(settings.seed, self.round, self.client_id, stream)
            if _keyed(settings, self.data.model)
            else 0
        )
        per_epoch = steps_for_epochs(num_samples, settings.batch_size, 1)
        return ClientTask(self.client_id, self.data.rows, batches, correction, None, per_epoch, augment_key)

    def train(
        self, params: torch.Tensor, correction: Any, steps: int, purpose: str = "personal"
    ) -> tuple[torch.Tensor, int]:
        settings = self._round_settings()
        task = self._task(steps, purpose, correction)
        with single_threaded_clients(params.device):
            bound = _bound_module(self.data.model, params)
            with local_arithmetic(settings.precision, params.device):
                return train_one_client(bound, params, task, settings.local, self.data.training)

    def minibatches(self, steps: int, purpose: str = "local") -> list[tuple[torch.Tensor, torch.Tensor]]:
        task = self._task(steps, purpose)
        training = self.data.training
        device = task.sample_indices.device
        out = []
        for step in range(task.num_steps):
            positions = task.batches[step]
            rows = task.sample_indices[torch.as_tensor(positions[positions != PAD], device=device)]
            inputs = training.batch(rows)
            if training.augment is not None:
                inputs = training.augment(
                    inputs, example_keys(task.augment_key, step, torch.arange(len(rows), device=device))
                )
            out.append((inputs, training.targets[rows]))
        return out

    def loss_gradient(self, params: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model = self.data.model

        def mean_loss(theta: torch.Tensor) -> torch.Tensor:
            return model.example_loss(model.forward(theta, inputs), targets).mean()

        return torch.func.grad(mean_loss)(params)

    def diagonal_fisher(self, params: torch.Tensor, max_examples: int, chunk: int = 256) -> torch.Tensor:
        rows = self.data.rows
        if max_examples < len(rows):
            rng = generator(self.seed, Stream.FISHER_SAMPLE, self.round, self.client_id)
            chosen = np.sort(rng.choice(len(rows), size=max_examples, replace=False))
            rows = rows[torch.as_tensor(chosen, device=rows.device)]
        model = self.data.model
        training = self.data.training

        def example_loss(theta: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return model.example_loss(model.forward(theta, inputs[None]), target[None])[0]

        per_example_gradients = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0, 0))
        total = torch.zeros_like(params)
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            gradients = per_example_gradients(params, training.batch(part), training.targets[part])
            total += (gradients**2).sum(0)
        return total / len(rows)

    def full_gradient(self, params: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        rows = self.data.rows
        model = self.data.model
        training = self.data.training

        def loss_sum(theta: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return model.example_loss(model.forward(theta, inputs), targets).sum()

        gradient = torch.func.grad(loss_sum)
        total = torch.zeros_like(params)
        for start in range(0, len(rows), chunk):  # chunks bound the activations one backward pass holds
            part = rows[start : start + chunk]
            total += gradient(params, training.batch(part), training.targets[part])
        return total / max(1, len(rows))


def _keyed(settings: ClientSettings, model: FlatModel) -> bool:
    """Whether a client's local steps draw from per-step keys: augmentation, or a model with dropout (``modes.py``)."""
    return settings.augment or model.dropout


def client_data(sim: Any, client_id: int) -> ClientData:
    """Client ``client_id``'s data in the simulation ``sim`` (a ``Simulation``): the shared training tensors and its
    rows."""
    return ClientData(sim.model, sim.training_data, sim.client_rows[client_id])


def steps_to_train(context: ClientContext) -> int:
    """The steps the client is asked for this round: all planned ones unless the availability model cut them."""
    return context.planned_steps if context.available_steps is None else context.available_steps


@dataclass(frozen=True)
class ClientRound:
    """One client's round as it starts: everything ``client_start``, ``client_end`` and ``run_client`` read.

    ``view`` is the view this client receives (``Algorithm.view_for``: the broadcast, or a view of its own), and
    ``client_state`` its state (``client_state_init(θ⁰)`` before its first round; None for a stateless algorithm).
    """

    algorithm: Algorithm
    view: Any
    client_state: Any
    context: ClientContext
    data: ClientData
    settings: ClientSettings


def client_start(client: ClientRound) -> ClientTask:
    """The client's local work this round: the algorithm's local objective, its minibatch plan and augmentation key."""
    algorithm, view, context, settings = client.algorithm, client.view, client.context, client.settings
    correction = algorithm.client_objective(view, client.client_state, context)
    num_samples = client.data.num_samples
    batches = batch_plan(
        settings.seed, context.round, context.client_id, num_samples, settings.batch_size, steps_to_train(context)
    )
    per_epoch = steps_for_epochs(num_samples, settings.batch_size, 1)
    augment_key = (
        augmentation_key(settings.seed, context.round, context.client_id) if _keyed(settings, client.data.model) else 0
    )
    start = view.params if algorithm.client_view is not None else None  # a view of its own: local SGD starts from it
    return ClientTask(
        context.client_id, client.data.rows, batches, correction, settings.inexact_gamma, per_epoch, augment_key, start
    )


def client_end(client: ClientRound, final_params: torch.Tensor, steps_done: int) -> tuple[Any, Any]:
    """The client's new state and its message (None: it sends nothing) after local training ended at ``final_params``."""
    context, settings = client.context, client.settings
    computation = ClientDataComputation(client.data, settings.seed, context.round, context.client_id, settings)
    update = ClientUpdate(client.view.params, final_params, steps_done, computation)
    return client.algorithm.client_finish(client.view, client.client_state, context, update)


def run_client(client: ClientRound) -> tuple[Any, Any, int]:
    """One client's whole round: ``client_start``, its local SGD from ``view.params``, ``client_end``.

    Returns the new client state, the message (None: nothing sent) and the
    local steps done; bit for bit what the engine's sequential backend
    computes for this client.
    """
    params, data = client.view.params, client.data
    # Single-threaded on a CPU, start to end, as the sequential backend runs a client and its client_end.
    with single_threaded_clients(params.device):
        task = client_start(client)
        bound = BoundModule(data.model, params)
        with local_arithmetic(client.settings.precision, params.device):
            final_params, steps_done = train_one_client(bound, params, task, client.settings.local, data.training)
        new_state, message = client_end(client, final_params, steps_done)
    return new_state, message, steps_done
