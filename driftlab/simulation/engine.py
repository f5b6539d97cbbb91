"""The round loop: sample clients, train them, let the algorithm aggregate, evaluate.

The engine owns *how* clients run (sampling, minibatches, the training
backend, client-state storage, bit accounting, evaluation); the algorithm owns
*what* they compute, through the five functions of ``seam.Algorithm``.  The
engine never looks at which algorithm it runs.

A round is a pure step ``(state, round t) -> (state, record)``: all randomness
comes from (seed, round, client id), so ``run_round`` on a restored state
repeats an uninterrupted run bit for bit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from driftlab.data.federated import FederatedDataset
from driftlab.metrics.communication import payload_bits
from driftlab.optim.schedules import steps_at, value_at
from driftlab.simulation.flat import FlatModel
from driftlab.simulation.local_training import (
    ClientTask,
    LocalSettings,
    TrainingBackend,
    TrainingData,
    batch_plan,
    steps_for_epochs,
)
from driftlab.simulation.sampling import sample_clients
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate, RoundContext
from driftlab.simulation.state_store import ClientStateStore


@dataclass(frozen=True)
class RoundPlan:
    """How clients are asked to work; rates and counts are constants or schedules of the round."""

    seed: int
    participation: float
    sampling: str
    batch_size: int
    client_lr: Any
    server_lr: Any
    local_epochs: int | None
    local_steps: Any  # int or a schedule, used when local_epochs is None
    weight_decay: float = 0.0
    clip_norm: float | None = None

    def planned_steps(self, num_samples: int, round_index: int) -> int:
        if self.local_epochs is not None:
            return steps_for_epochs(num_samples, self.batch_size, self.local_epochs)
        return steps_at(self.local_steps, round_index)


@dataclass
class Simulation:
    """Everything a round needs that does not change from round to round."""

    model: FlatModel
    data: FederatedDataset
    algorithm: Algorithm
    backend: TrainingBackend
    plan: RoundPlan
    device: torch.device
    dtype: torch.dtype
    _training_data: TrainingData = field(init=False, repr=False)
    _test_data: TrainingData = field(init=False, repr=False)
    _client_rows: list[torch.Tensor] = field(init=False, repr=False)
    _union_rows: torch.Tensor = field(init=False, repr=False)
    client_sizes: np.ndarray = field(init=False, repr=False)
    registered: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._training_data = TrainingData(
            self.data.train_inputs.to(self.device, self.dtype), self.data.train_targets.to(self.device)
        )
        self._test_data = TrainingData(self.data.test_inputs.to(self.device, self.dtype), self.data.test_targets.to(self.device))
        self._client_rows = [torch.tensor(rows, dtype=torch.long, device=self.device) for rows in self.data.client_indices]
        self._union_rows = torch.cat(self._client_rows)
        self.client_sizes = self.data.client_sizes
        self.registered = np.arange(self.data.num_clients, dtype=np.int64)


@dataclass(frozen=True)
class SimulationState:
    round: int  # last completed round (0 before training)
    server: Any
    clients: ClientStateStore


def run_round(sim: Simulation, state: SimulationState) -> tuple[SimulationState, dict[str, Any]]:
    """Run round ``state.round + 1``; returns the new state and the round's metrics record."""
    started = time.perf_counter()
    t = state.round + 1
    plan = sim.plan
    sizes = sim.client_sizes[sim.registered]
    sample = sample_clients(plan.seed, t, sim.registered, sizes, plan.participation, plan.sampling)
    learning_rate = value_at(plan.client_lr, t)
    server_lr = value_at(plan.server_lr, t)
    num_registered = len(sim.registered)
    mean_samples = float(sizes.mean())

    contexts: list[ClientContext] = []
    tasks: list[ClientTask] = []
    client_states = []
    for client_id, multiplicity in zip(sample.client_ids.tolist(), sample.multiplicity.tolist()):
        num_samples = int(sim.client_sizes[client_id])
        steps = plan.planned_steps(num_samples, t)
        context = ClientContext(
            client_id=client_id,
            round=t,
            num_samples=num_samples,
            mean_num_samples=mean_samples,
            num_registered=num_registered,
            planned_steps=steps,
            learning_rate=learning_rate,
            multiplicity=multiplicity,
        )
        client_state = state.clients.get(client_id)
        correction = sim.algorithm.client_objective(state.server, client_state, context)
        batches = batch_plan(plan.seed, t, client_id, num_samples, plan.batch_size, steps)
        contexts.append(context)
        client_states.append(client_state)
        tasks.append(ClientTask(client_id, sim._client_rows[client_id], batches, correction))

    start_params = state.server.params
    settings = LocalSettings(learning_rate, plan.weight_decay, plan.clip_norm)
    messages: list[Any] = [None] * len(tasks)
    new_client_states: list[Any] = [None] * len(tasks)
    upload_bits = 0
    for position, final_params in sim.backend.train(sim.model, start_params, tasks, settings, sim._training_data):
        update = ClientUpdate(start_params, final_params, tasks[position].num_steps)
        new_client_states[position], messages[position] = sim.algorithm.client_finish(
            state.server, client_states[position], contexts[position], update
        )
        upload_bits += payload_bits(messages[position])
    for task, client_state in zip(tasks, new_client_states):
        state.clients.put(task.client_id, client_state)

    round_context = RoundContext(round=t, num_registered=num_registered, num_selected=len(tasks), server_learning_rate=server_lr)
    download_bits = payload_bits(sim.algorithm.broadcast(state.server)) * len(tasks)
    server, algorithm_metrics = sim.algorithm.server_update(state.server, messages, round_context)
    if not torch.isfinite(server.params).all():
        raise FloatingPointError(
            f"round {t}: the server model has non-finite entries (the run diverged); "
            "lower client.lr or server.lr, or enable client.clip_norm"
        )
    record: dict[str, Any] = {
        "round": t,
        "num_selected": len(tasks),
        "num_reporting": len(tasks),
        "reporting_clients": [task.client_id for task in tasks],
        "local_steps": int(sum(task.num_steps * ctx.multiplicity for task, ctx in zip(tasks, contexts))),
        "upload_bits": int(upload_bits),
        "download_bits": int(download_bits),
        "client_lr": learning_rate,
        "server_lr": server_lr,
        "model_norm": float(torch.linalg.vector_norm(server.params)),
        **algorithm_metrics,
    }
    record["round_seconds"] = time.perf_counter() - started
    return SimulationState(t, server, state.clients), record


@torch.no_grad()
def evaluate(sim: Simulation, params: torch.Tensor, batch_size: int = 4096) -> dict[str, float]:
    """Test accuracy and loss on the global test set; train loss over the union of the clients' data."""
    test_loss, test_correct = _loss_and_correct(sim.model, params, sim._test_data.inputs, sim._test_data.targets, batch_size)
    rows = sim._union_rows
    train_loss_sum = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        logits = sim.model.forward(params, sim._training_data.inputs[chunk])
        train_loss_sum += float(F.cross_entropy(logits, sim._training_data.targets[chunk], reduction="sum"))
    num_test = len(sim._test_data.targets)
    return {
        "test_accuracy": test_correct / num_test,
        "test_loss": test_loss / num_test,
        "train_loss": train_loss_sum / len(rows),
    }


def _loss_and_correct(model: FlatModel, params: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> tuple[float, int]:
    loss_sum, correct = 0.0, 0
    for start in range(0, len(targets), batch_size):
        logits = model.forward(params, inputs[start : start + batch_size])
        batch_targets = targets[start : start + batch_size]
        loss_sum += float(F.cross_entropy(logits, batch_targets, reduction="sum"))
        correct += int((logits.argmax(dim=1) == batch_targets).sum())
    return loss_sum, correct
