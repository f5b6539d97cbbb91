"""Per-client views (``Algorithm.client_view``) through the engine: each client's local SGD starts from its own view's
``params`` on both backends, download bits are counted per view, and an algorithm that only broadcasts is trained
exactly as before (no per-client start; its runs are pinned in experiments/pinned_runs_test.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from driftlab.algorithms import fedavg
from driftlab.data.federated import FederatedDataset
from driftlab.experiments.run.runner import BACKENDS
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.round.engine import run_round
from driftlab.simulation.round.setup import Simulation, SimulationState
from driftlab.simulation.seam import Algorithm, GradientCorrection
from driftlab.simulation.state.state_store import InMemoryClientStore
from driftlab.simulation.testing import seeded_model, small_plan

NUM_CLIENTS = 6


@dataclass(frozen=True)
class Server:
    params: torch.Tensor


@dataclass(frozen=True)
class View:
    params: torch.Tensor
    tag: torch.Tensor  # k + 1 entries for client k: views of different sizes, so download bits are per view


@dataclass(frozen=True)
class Message:
    client_id: int
    start: torch.Tensor
    final: torch.Tensor
    expected: torch.Tensor  # the client's own data path trained from view.params (ClientComputation.train, "local")


def offset(client_id: int) -> float:
    return 0.05 * (client_id + 1)


def toy_algorithm(seen: list[Message]) -> Algorithm:
    """Client k starts from θ + 0.05(k+1) with a proximal pull towards that start; the server averages."""

    def client_view(server: Server, client_id: int, states: Any) -> View:
        assert list(states()) == []  # the store's committed states (this algorithm keeps none)
        return View(server.params + offset(client_id), torch.zeros(client_id + 1))

    def broadcast(server: Server) -> View:
        return View(server.params, torch.zeros(0))

    def client_objective(view: View, client: Any, context: Any) -> GradientCorrection:
        return GradientCorrection(quadratic=0.5, reference=view.params)

    def client_finish(view: View, client: Any, context: Any, update: Any) -> tuple[None, Message]:
        correction = client_objective(view, client, context)
        expected, _ = update.computation.train(view.params, correction, update.steps_done, "local")
        return None, Message(context.client_id, update.start_params, update.final_params, expected)

    def server_update(server: Server, messages: list[Message], context: Any) -> tuple[Server, dict[str, float]]:
        seen.extend(messages)
        return Server(torch.stack([m.final for m in messages]).mean(0)), {}

    return Algorithm(
        "toy-views", Server, client_objective, client_finish, server_update, broadcast, client_view=client_view
    )


def simulation(algorithm: Algorithm, backend: str) -> tuple[Simulation, SimulationState]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(60, 6, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (60,), generator=generator)
    clients = tuple(np.arange(k * 10, k * 10 + 10) for k in range(NUM_CLIENTS))
    data = FederatedDataset("vectors", inputs, labels, inputs[:10], labels[:10], clients, 3)
    model = seeded_model("mlp", (6,), hidden=(8,))
    theta = model.initial_parameters()
    plan = small_plan()
    sim = Simulation(model, data, algorithm, BACKENDS[backend](), plan, torch.device("cpu"), torch.float64, theta)
    return sim, SimulationState(0, algorithm.server_init(theta), InMemoryClientStore(None))


def two_rounds(backend: str) -> tuple[list[Message], list[dict[str, Any]]]:
    seen: list[Message] = []
    sim, state = simulation(toy_algorithm(seen), backend)
    records = []
    for _ in range(2):
        state, record = run_round(sim, state)
        records.append(record)
    return seen, records


def test_each_client_trains_from_its_own_view_on_both_backends():
    sequential, _ = two_rounds("sequential")
    vectorized, _ = two_rounds("vectorized")
    assert len(sequential) == len(vectorized) == 2 * NUM_CLIENTS // 2
    for first, second in zip(sequential, vectorized, strict=True):
        assert first.client_id == second.client_id
        # the final model is what training from the client's own start gives, not from the shared model
        torch.testing.assert_close(first.final, first.expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(second.final, second.expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(first.final, second.final, rtol=0, atol=1e-12)
    # the starts really differ by client: the offsets are in the finals (one round's clients, same server model)
    first_round = sequential[: NUM_CLIENTS // 2]
    starts = torch.stack([m.start for m in first_round])
    assert torch.unique(starts[:, 0]).numel() == len(first_round)


def test_download_bits_sum_each_clients_own_view():
    seen, records = two_rounds("sequential")
    size = seen[0].final.numel()
    for round_index, record in enumerate(records):
        ids = [m.client_id for m in seen[round_index * 3 : round_index * 3 + 3]]
        assert record["download_bits"] == sum(32 * (size + k + 1) for k in ids)


def test_a_view_reads_the_client_states_committed_before_its_round():
    # A toy whose client state is its final model: round 2's views see round 1's clients' states, in id order.
    base = toy_algorithm([])
    seen: list[tuple[int, list[int], list[torch.Tensor]]] = []

    def client_view(server: Server, client_id: int, states: Any) -> View:
        stored = list(states())
        seen.append((client_id, [k for k, _ in stored], [state for _, state in stored]))
        return base.client_view(server, client_id, lambda: iter(()))

    def client_finish(view: View, client: Any, context: Any, update: Any) -> tuple[torch.Tensor, Message]:
        return update.final_params, base.client_finish(view, client, context, update)[1]

    algorithm = dataclasses.replace(base, client_view=client_view, client_finish=client_finish)
    sim, state = simulation(algorithm, "sequential")
    state, _ = run_round(sim, state)
    first = dict(state.clients.items())
    assert {client for client, _, _ in seen} == set(first)  # (the engine builds views to train and to count bits)
    assert all(ids == [] for _, ids, _ in seen)
    seen.clear()
    run_round(sim, state)
    assert len(seen) >= NUM_CLIENTS // 2
    for _, ids, states in seen:
        assert ids == sorted(first)
        assert all(torch.equal(stored, first[k]) for k, stored in zip(ids, states, strict=True))


class RecordingBackend:
    """A backend that notes every task's own start before the real backend trains it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.starts: list[Any] = []

    def train(self, model, start_params, tasks, settings, data):
        self.starts.extend(task.start_params for task in tasks)
        return self.inner.train(model, start_params, tasks, settings, data)


def test_a_broadcast_only_algorithm_gives_no_per_client_start_and_counts_one_view_per_client():
    algorithm = fedavg.build(make_server_optimizer("sgd"))
    for backend in ("sequential", "vectorized"):
        sim, state = simulation(algorithm, backend)
        recorder = RecordingBackend(sim.backend)
        sim.backend = recorder
        state, record = run_round(sim, state)
        assert recorder.starts and all(start is None for start in recorder.starts)
        assert record["download_bits"] == 32 * state.server.params.numel() * record["num_selected"]
