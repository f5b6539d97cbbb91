"""The personalized evaluation (``evaluation.evaluate_personal``): each client's own model on its own test split.

Equivalences with the server model's columns, a store on disk against one in memory, fine-tuning that depends only
on (seed, round, client id), and the config's refusals before any work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import driftlab
from driftlab.algorithms import fedavg
from driftlab.data.federated import FederatedDataset
from driftlab.errors import ConfigError
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.local_training import SequentialBackend
from driftlab.simulation.evaluation import _loss_and_correct, evaluate_personal
from driftlab.simulation.round.client import ClientData, ClientDataComputation
from driftlab.simulation.round.engine import run_round
from driftlab.simulation.round.setup import EvaluationPlan, Simulation, SimulationState, make_client_stores
from driftlab.simulation.seam import NO_CORRECTION, Personalization
from driftlab.simulation.testing import seeded_model, small_plan

F64 = torch.float64
SIZES = (9, 12, 15, 6, 10)  # training rows per client
TEST_SIZES = (4, 0, 5, 3, 6)  # client 1 has no test split: it is left out of the means


@dataclass(frozen=True)
class KeptModel:
    """A toy client state: the model the client trained last (its "personal" model)."""

    params: torch.Tensor


def _keeping_last_model(algorithm):
    """FedAvg whose clients keep their last local model as their personal model."""

    def client_finish(view, state, context, update):
        _, message = algorithm.client_finish(view, None, context, update)
        return KeptModel(update.final_params), message

    return dataclasses.replace(
        algorithm,
        client_state_init=lambda params: KeptModel(params.clone()),
        client_finish=client_finish,
        personalization=Personalization(lambda view, state: state.params, "each client's last local model"),
    )


def _simulation(
    algorithm_of, store: str = "memory", directory: Path | None = None, evaluation: EvaluationPlan | None = None
):
    generator = torch.Generator().manual_seed(1)
    total, tests = sum(SIZES), sum(TEST_SIZES)
    inputs = torch.randn(total, 4, generator=generator, dtype=F64)
    labels = torch.randint(0, 3, (total,), generator=generator)
    test_inputs = torch.randn(tests, 4, generator=generator, dtype=F64)
    test_labels = torch.randint(0, 3, (tests,), generator=generator)
    bounds, test_bounds = np.cumsum((0,) + SIZES), np.cumsum((0,) + TEST_SIZES)
    rows = tuple(np.arange(bounds[k], bounds[k + 1], dtype=np.int64) for k in range(len(SIZES)))
    test_rows = tuple(np.arange(test_bounds[k], test_bounds[k + 1], dtype=np.int64) for k in range(len(SIZES)))
    data = FederatedDataset("toy", inputs, labels, test_inputs, test_labels, rows, 3, client_test_indices=test_rows)
    model = seeded_model("mlp", (4,), hidden=(6,), dtype=F64)
    theta = model.initial_parameters()
    plan = small_plan(seed=5, participation=0.6, client_lr=0.2)
    algorithm = algorithm_of(fedavg.build(make_server_optimizer("sgd")))
    evaluation = evaluation or EvaluationPlan(personal=True)
    sim = Simulation(model, data, algorithm, SequentialBackend(), plan, torch.device("cpu"), F64, theta, evaluation)
    clients, _ = make_client_stores(
        store, data.num_clients, theta, algorithm.client_state_init, False, lambda: directory
    )
    return sim, SimulationState(0, algorithm.server_init(theta), clients)


def _run(sim, state, rounds: int = 3):
    records = []
    for _ in range(rounds):
        state, record = run_round(sim, state, evaluate_after=True)
        records.append(record)
    return state, records


def test_the_server_model_as_personal_model_gives_the_server_models_client_columns():
    sim, state = _simulation(
        lambda algorithm: dataclasses.replace(
            algorithm, personalization=Personalization(lambda view, state: view.params)
        )
    )
    _, records = _run(sim, state)
    for record in records:
        assert record["personal_test_accuracy_mean"] == record["client_test_accuracy_mean"]
        assert record["personal_test_accuracy_std"] == record["client_test_accuracy_std"]


def test_each_client_is_tested_with_its_own_model_on_its_own_split():
    sim, state = _simulation(_keeping_last_model)
    state, records = _run(sim, state)
    expected = []
    for client_id, rows in enumerate(sim.client_test_rows):
        if not len(rows):
            continue
        own = state.clients.get(client_id).params  # θ⁰ for a client never drawn
        _, correct = _loss_and_correct(sim.model, own, sim.test_data, rows, 64)
        expected.append(correct / len(rows))
    assert records[-1]["personal_test_accuracy_mean"] == pytest.approx(float(np.mean(expected)), abs=0, rel=1e-15)
    assert records[-1]["personal_test_accuracy_std"] == pytest.approx(float(np.std(expected)), abs=1e-15)
    assert len(expected) == 4  # the client without a test split is not counted


def test_personal_models_read_from_a_disk_store_give_the_same_numbers(tmp_path):
    memory_sim, memory_state = _simulation(_keeping_last_model)
    disk_sim, disk_state = _simulation(_keeping_last_model, "disk", tmp_path)
    _, in_memory = _run(memory_sim, memory_state)
    _, on_disk = _run(disk_sim, disk_state)
    for a, b in zip(in_memory, on_disk, strict=True):
        assert a["personal_test_accuracy_mean"] == b["personal_test_accuracy_mean"]
        assert a["personal_test_accuracy_std"] == b["personal_test_accuracy_std"]


def test_fine_tuning_is_the_client_code_path_on_the_server_model_with_its_own_minibatches():
    sim, state = _simulation(lambda algorithm: algorithm, evaluation=EvaluationPlan(personal=True, finetune_steps=3))
    state, record = run_round(sim, state, evaluate_after=True)
    from driftlab.simulation.round.engine import client_settings

    settings = client_settings(sim.plan, 1, "float32")
    accuracies = []
    for client_id, rows in enumerate(sim.client_test_rows):
        if not len(rows):
            continue
        data = ClientData(sim.model, sim.training_data, sim.client_rows[client_id])
        tuned, steps = ClientDataComputation(data, 5, 1, client_id, settings).train(
            state.server.params, NO_CORRECTION, 3, "finetune"
        )
        assert steps == 3 and not torch.equal(tuned, state.server.params)
        _, correct = _loss_and_correct(sim.model, tuned, sim.test_data, rows, 64)
        accuracies.append(correct / len(rows))
    assert record["personal_test_accuracy_mean"] == float(np.mean(accuracies))
    again = evaluate_personal(sim, state.server, None, settings, 1)
    assert again["personal_test_accuracy_mean"] == record["personal_test_accuracy_mean"]


def test_fine_tuning_draws_minibatches_apart_from_the_global_models():
    sim, _ = _simulation(lambda algorithm: algorithm)
    from driftlab.simulation.round.engine import client_settings

    data = ClientData(sim.model, sim.training_data, sim.client_rows[2])
    computation = ClientDataComputation(data, 5, 1, 2, client_settings(sim.plan, 1, "float32"))
    local = [targets for _, targets in computation.minibatches(4, "local")]
    finetune = [targets for _, targets in computation.minibatches(4, "finetune")]
    personal = [targets for _, targets in computation.minibatches(4, "personal")]
    assert any(not torch.equal(a, b) for a, b in zip(local, finetune, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(finetune, personal, strict=True))
    with pytest.raises(ValueError, match="unknown purpose"):
        computation.minibatches(1, "global")


SMALL = ["rounds=1", "data.name=synthetic", "data.num_clients=6", "model.name=mlr"]


def test_the_personal_evaluation_of_fedavg_plus_fine_tuning_runs_from_a_config():
    record = driftlab.run(None, overrides=[*SMALL, "evaluation.finetune_steps=2"]).records[-1]
    assert {"personal_test_accuracy_mean", "personal_test_accuracy_std", "client_test_accuracy_std"} <= set(record)
    plain = driftlab.run(None, overrides=SMALL).records[-1]
    assert "personal_test_accuracy_mean" not in plain and "client_test_accuracy_std" not in plain
    spread = driftlab.run(None, overrides=[*SMALL, "evaluation.client_spread=true"]).records[-1]
    assert (
        spread["client_test_accuracy_std"] == record["client_test_accuracy_std"]
        and "personal_test_accuracy_mean" not in spread
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["evaluation.personal=true"], "keeps no per-client models"),
        (["evaluation.finetune_steps=2", "evaluation.personal=false"], "turns the personal evaluation off"),
        (["evaluation.finetune_steps=0"], "greater than or equal to 1"),
    ],
)
def test_a_personal_evaluation_that_cannot_be_made_is_refused_before_any_round(overrides, message):
    with pytest.raises(ConfigError, match=message):
        driftlab.run(None, overrides=[*SMALL, *overrides])


def test_a_personal_evaluation_needs_the_clients_test_splits():
    from types import SimpleNamespace

    from driftlab.experiments.config import load_config
    from driftlab.features.run import feature_plan
    from driftlab.simulation.personal_evaluation import personal_evaluation

    config = load_config(None, overrides=[*SMALL, "evaluation.finetune_steps=2"])
    sim = SimpleNamespace(
        algorithm=fedavg.build(make_server_optimizer("sgd")), client_test_rows=None, asynchronous=None
    )
    with pytest.raises(ConfigError, match="the clients have none: set data.client_test_fraction"):
        personal_evaluation(feature_plan(config, "personal"), sim)
    unset = load_config(None, overrides=SMALL)
    assert personal_evaluation(feature_plan(unset, "personal"), sim) is False  # nothing asked for: no column, no error


def test_a_deployment_refuses_the_personal_evaluation_whose_models_stay_on_the_nodes():
    from driftlab.deploy.messages import check_config_deployable
    from driftlab.experiments.config import load_config

    for extra in (["evaluation.finetune_steps=2"], ["evaluation.personal=true"]):
        with pytest.raises(ConfigError, match="stay on the nodes"):
            check_config_deployable(load_config(None, overrides=[*SMALL, *extra]))
