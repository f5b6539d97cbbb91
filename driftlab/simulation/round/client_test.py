"""The one client code path: ``run_client`` is what the engine computes for a client, the client halves see only
the view, and ``plan_round``/``finish_round`` aggregate in sample order whatever order clients finish in."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest
import torch

from driftlab.algorithms import efl, feddyn, scaffold
from driftlab.compress import with_compression
from driftlab.data.federated import FederatedDataset
from driftlab.models import build_model
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import LocalSettings, SequentialBackend, TrainingData
from driftlab.simulation.evaluation import evaluate
from driftlab.simulation.round.client import (
    ClientData,
    ClientRound,
    ClientSettings,
    client_end,
    client_start,
    run_client,
)
from driftlab.simulation.round.engine import client_data, finish_round, plan_round, run_round
from driftlab.simulation.round.setup import EvaluationPlan, Simulation, SimulationState, make_client_stores
from driftlab.simulation.seam import ServerFold
from driftlab.simulation.testing import small_plan

F64 = torch.float64
CLIENT_SIZES = (7, 10, 13, 18)  # unequal, so FedDyn's α_k and the batch plans differ per client


def _algorithm(name: str, model: FlatModel) -> Any:
    sgd = make_server_optimizer("sgd")
    if name in ("scaffold", "scaffold_dropout"):
        return scaffold.build(sgd)
    if name == "feddyn":
        return feddyn.build(alpha=0.1)
    if name == "efl":
        return efl.build(sgd, elastic=0.5, fisher_examples=5)  # fewer than a client's rows: the Fisher pass samples
    if name == "efl_compressed":
        return with_compression(efl.build(sgd, elastic=0.5, fisher_examples=5), 0.3, model.numels)
    raise ValueError(name)


def _simulation(
    name: str, participation: float = 0.75, seed: int = 3, evaluated: str = "server"
) -> tuple[Simulation, SimulationState]:
    generator = torch.Generator().manual_seed(0)
    total = sum(CLIENT_SIZES)
    inputs = torch.randn(total, 5, generator=generator, dtype=F64)
    labels = torch.randint(0, 3, (total,), generator=generator)
    bounds = np.cumsum((0,) + CLIENT_SIZES)
    rows = tuple(np.arange(bounds[k], bounds[k + 1], dtype=np.int64) for k in range(len(CLIENT_SIZES)))
    data = FederatedDataset("toy", inputs, labels, inputs[:8], labels[:8], rows, 3)
    torch.manual_seed(0)
    if name.endswith("_dropout"):  # masks keyed by (seed, round, client, step): a node draws the engine's (modes.py)
        module = torch.nn.Sequential(
            torch.nn.Linear(5, 8), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        )
    else:
        module = build_model("mlp", (5,), 3, hidden=(8,))
    model = FlatModel.wrap(module).to("cpu", F64)
    theta = model.initial_parameters()
    plan = small_plan(seed=seed, participation=participation)
    algorithm = _algorithm(name, model)
    sim = Simulation(
        model,
        data,
        algorithm,
        SequentialBackend(),
        plan,
        torch.device("cpu"),
        F64,
        theta,
        EvaluationPlan(model=evaluated),
    )
    clients, _ = make_client_stores("memory", data.num_clients, theta, algorithm.client_state_init, False, lambda: None)
    return sim, SimulationState(0, algorithm.server_init(theta), clients)


def _assert_identical(expected: Any, actual: Any, where: str) -> None:
    """The same tensors bit for bit (torch.equal) and the same numbers, through dataclasses and sequences."""
    assert type(expected) is type(actual), where
    if isinstance(expected, torch.Tensor):
        assert torch.equal(expected, actual), where
    elif dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            _assert_identical(getattr(expected, field.name), getattr(actual, field.name), f"{where}.{field.name}")
    elif isinstance(expected, (tuple, list)):
        assert len(expected) == len(actual), where
        for index, (a, b) in enumerate(zip(expected, actual, strict=True)):
            _assert_identical(a, b, f"{where}[{index}]")
    else:
        assert expected == actual, where


def _recording_server_update(sim: Simulation, seen: list) -> None:
    """Make the simulation's algorithm record the messages its server fold receives, in the order given."""
    fold = sim.algorithm.fold()

    def recording(accumulator, message):
        seen.append(message)
        return fold.add(accumulator, message)

    recording_fold = ServerFold(fold.start, recording, fold.finish)
    sim.algorithm = dataclasses.replace(
        sim.algorithm, server_update=recording_fold.server_update, server_fold=recording_fold
    )


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "efl", "efl_compressed", "scaffold_dropout"])
def test_run_client_reproduces_the_engines_sequential_round_bit_for_bit(name):
    sim, state = _simulation(name)
    algorithm = sim.algorithm
    state, _ = run_round(sim, state)  # round 1: from here the client and server states are no longer zero
    work = plan_round(sim, state)
    before = {context.client_id: state.clients.get(context.client_id) for context in work.contexts}
    messages: list = []
    _recording_server_update(sim, messages)
    after, record = run_round(sim, state)
    assert record["reporting_clients"] == [context.client_id for context in work.contexts] and len(messages) == 3
    for context, engine_message in zip(work.contexts, messages, strict=True):
        client_id = context.client_id
        new_state, message, steps_done = run_client(
            ClientRound(algorithm, work.view, before[client_id], context, client_data(sim, client_id), work.settings)
        )
        assert steps_done == context.planned_steps
        _assert_identical(after.clients.get(client_id), new_state, f"client {client_id} state")
        _assert_identical(engine_message, message, f"client {client_id} message")
    if name == "scaffold":
        assert float(torch.linalg.vector_norm(work.view.control)) > 0  # the round really used a non-zero c


def test_run_client_trains_a_clients_own_tensors_as_the_engine_trains_its_rows():
    # A node holds only its own examples (rows = arange); same numbers as the shared tensors with its global rows.
    sim, state = _simulation("scaffold")
    state, _ = run_round(sim, state)
    work = plan_round(sim, state)
    context = work.contexts[0]
    client_state = state.clients.get(context.client_id)
    shared = client_data(sim, context.client_id)
    own_rows = shared.rows
    own = ClientData(
        sim.model,
        TrainingData(sim.training_data.inputs[own_rows], sim.training_data.targets[own_rows]),
        torch.arange(len(own_rows)),
    )
    expected = run_client(ClientRound(sim.algorithm, work.view, client_state, context, shared, work.settings))
    actual = run_client(ClientRound(sim.algorithm, work.view, client_state, context, own, work.settings))
    _assert_identical(expected, actual, "node")


def test_the_engine_gives_the_client_halves_the_view_not_the_server_state():
    sim, state = _simulation("scaffold")
    received = []
    objective, finish = sim.algorithm.client_objective, sim.algorithm.client_finish

    def watching_objective(view, client_state, context):
        received.append(type(view))
        return objective(view, client_state, context)

    def watching_finish(view, client_state, context, update):
        received.append(type(view))
        return finish(view, client_state, context, update)

    sim.algorithm = dataclasses.replace(
        sim.algorithm, client_objective=watching_objective, client_finish=watching_finish
    )
    run_round(sim, state)
    assert received == [scaffold.ClientView] * 6  # three clients, two halves each
    assert {field.name for field in dataclasses.fields(scaffold.ClientView)} == {"params", "control"}


def test_a_client_half_reaching_for_server_state_fails_on_the_view():
    # Written against the server state (it reads the server optimizer's state), the half cannot run as a client.
    sim, state = _simulation("scaffold")
    work = plan_round(sim, state)
    assert hasattr(state.server, "optimizer_state") and not hasattr(work.view, "optimizer_state")
    objective = sim.algorithm.client_objective

    def server_reading_objective(view, client_state, context):
        view.optimizer_state  # noqa: B018 - what a half given the server state could read
        return objective(view, client_state, context)

    algorithm = dataclasses.replace(sim.algorithm, client_objective=server_reading_objective)
    context = work.contexts[0]
    with pytest.raises(AttributeError, match="optimizer_state"):
        run_client(
            ClientRound(
                algorithm,
                work.view,
                state.clients.get(context.client_id),
                context,
                client_data(sim, context.client_id),
                work.settings,
            )
        )


@pytest.mark.parametrize("name", ["scaffold", "efl_compressed"])
def test_finish_round_aggregates_in_sample_order_whatever_the_completion_order(name):
    reference_sim, reference_state = _simulation(name, participation=1.0)
    reference_state, _ = run_round(reference_sim, reference_state)
    expected_state, expected_record = run_round(reference_sim, reference_state)

    sim, state = _simulation(name, participation=1.0)
    state, _ = run_round(sim, state)
    work = plan_round(sim, state)
    order = list(range(len(work.contexts)))
    random.Random(7).shuffle(order)
    assert order != sorted(order)
    messages, steps_done = {}, {}
    for position in order:  # clients finish, and their messages arrive, in a shuffled order
        context = work.contexts[position]
        client_id = context.client_id
        client = ClientRound(
            sim.algorithm, work.view, state.clients.get(client_id), context, client_data(sim, client_id), work.settings
        )
        _, messages[client_id], steps_done[client_id] = run_client(client)
    assert list(messages) != [context.client_id for context in work.contexts]
    server, record = finish_round(sim, work, messages, steps_done)
    assert server.params.numpy().tobytes() == expected_state.server.params.numpy().tobytes()
    _assert_identical(expected_state.server, server, "server state")
    without_time = lambda r: {k: v for k, v in r.items() if k != "round_seconds"}  # noqa: E731
    assert without_time(record) == without_time(expected_record)


def test_finish_round_without_messages_keeps_the_server_and_counts_the_download():
    sim, state = _simulation("feddyn")
    work = plan_round(sim, state)
    server, record = finish_round(sim, work, {}, {})
    assert server is work.server
    assert record["num_reporting"] == 0 and record["upload_bits"] == 0 and record["local_steps"] == 0
    assert record["download_bits"] == 32 * sim.model.num_parameters * len(work.selected)


def test_finish_round_asks_for_the_client_models_the_evaluated_model_needs():
    sim, state = _simulation("feddyn", evaluated="reporting_mean")
    work = plan_round(sim, state)
    messages, steps_done, finals = {}, {}, {}
    for context in work.contexts:
        client_id = context.client_id
        finals[client_id] = work.view.params + 0.01 * client_id  # a final model of our own: no training needed here
        steps_done[client_id] = context.planned_steps
        client = ClientRound(
            sim.algorithm, work.view, state.clients.get(client_id), context, client_data(sim, client_id), work.settings
        )
        _, messages[client_id] = client_end(client, finals[client_id], context.planned_steps)
    with pytest.raises(ValueError, match="reporting_models"):
        finish_round(sim, work, messages, steps_done, evaluate_after=True)
    _, record = finish_round(sim, work, messages, steps_done, evaluate_after=True, reporting_models=finals)
    mean = sum(finals[context.client_id] for context in work.contexts) / len(work.contexts)
    assert record["test_loss"] == pytest.approx(evaluate(sim, mean)["test_loss"], rel=1e-12)


def test_client_start_and_end_are_the_halves_of_run_client():
    sim, state = _simulation("feddyn")
    work = plan_round(sim, state)
    context = work.contexts[1]
    client_state = state.clients.get(context.client_id)
    client = ClientRound(
        sim.algorithm, work.view, client_state, context, client_data(sim, context.client_id), work.settings
    )
    task = client_start(client)
    assert task.client_id == context.client_id and task.num_steps == context.planned_steps == -(
        -CLIENT_SIZES[context.client_id] // 4
    )
    assert torch.equal(task.correction.reference, work.view.params)  # FedDyn's pull towards θ^{t−1}, from the view
    # a client that did no step: the state moves by nothing, the message is the start model
    new_state, message = client_end(client, work.view.params, 0)
    assert torch.equal(new_state.dual, client_state.dual) and torch.equal(message.params, work.view.params)
    settings = ClientSettings(seed=3, batch_size=4, local=LocalSettings(0.1))
    assert settings == dataclasses.replace(
        work.settings, local=LocalSettings(0.1)
    )  # the round's settings, as a node gets them
