"""FedBN through the engine (``personal/buffers.py`` with ``[personal_layers] keep = ["batchnorm"]``): each client's
BatchNorm parameters and running statistics stay its own, the shared layers are FedAvg's, both backends agree, a
run continues from every client's statistics exactly, and the personal evaluation reads each client's own."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import driftlab
from driftlab.algorithms import fedavg
from driftlab.data.federated import FederatedDataset
from driftlab.experiments.run.loading import load_model
from driftlab.experiments.run.runner import BACKENDS
from driftlab.optim.server import make_server_optimizer
from driftlab.personal import feature
from driftlab.personal.buffers import ClientBuffers
from driftlab.personal.selection import parameter_kinds, select
from driftlab.personal.wrapping import with_personal_layers
from driftlab.simulation.backends.buffers import ModuleBuffersExtra, module_buffers, own_buffers_record
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import batch_plan, steps_for_epochs
from driftlab.simulation.evaluation import evaluate_personal
from driftlab.simulation.round.engine import run_round
from driftlab.simulation.round.setup import RoundPlan, Simulation, SimulationState
from driftlab.simulation.state.state_store import InMemoryClientStore

BOUNDS = (0, 7, 17)  # two clients of 7 and 10 rows: with B = 4, short last batches of 3 and 2
BATCH, SEED, LR = 4, 5, 0.1


def _bn_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(2), nn.Linear(2, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))


def _simulation(backend: str) -> tuple[Simulation, SimulationState]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(25, 2, generator=generator, dtype=torch.float64)
    inputs[BOUNDS[1] : BOUNDS[2]] = inputs[BOUNDS[1] : BOUNDS[2]] * 3 - 2  # client 1's features shifted (FedBN's case)
    targets = torch.randint(0, 2, (25,), generator=generator)
    clients = tuple(np.arange(start, end) for start, end in itertools.pairwise(BOUNDS))
    tests = (np.arange(0, 4), np.arange(4, 8))
    data = FederatedDataset(
        "vectors", inputs[:17], targets[:17], inputs[17:], targets[17:], clients, 2, client_test_indices=tests
    )
    model = FlatModel.wrap(_bn_mlp()).to("cpu", torch.float64)
    theta = model.initial_parameters()
    part = select(tuple(model.names), tuple(model.numels), ("batchnorm",), parameter_kinds(model.module, model.names))
    plan = RoundPlan(SEED, 1.0, "uniform", BATCH, LR, 1.0, local_epochs=1, steps=None)
    algorithm = with_personal_layers(fedavg.build(make_server_optimizer("sgd"), aggregation="uniform"), part)
    sim = Simulation(model, data, algorithm, BACKENDS[backend](), plan, torch.device("cpu"), torch.float64, theta)
    feature.finish(sim, feature.PersonalLayersPlan(part, 0))
    return sim, SimulationState(
        0, algorithm.server_init(theta), InMemoryClientStore(lambda: algorithm.client_state_init(theta))
    )


def _local_sgd(module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, client: int, round_index: int) -> None:
    """Client ``client``'s local epoch by hand: SGD on the mean cross-entropy of each of its batches, training mode."""
    size = len(inputs)
    module.train()
    for row in batch_plan(SEED, round_index, client, size, BATCH, steps_for_epochs(size, BATCH, 1)):
        rows = row[row >= 0]
        module.zero_grad()
        F.cross_entropy(module(inputs[rows]), targets[rows]).backward()
        with torch.no_grad():
            for parameter in module.parameters():
                parameter -= LR * parameter.grad


def test_two_clients_keep_their_batchnorm_and_share_fedavgs_linear_layers() -> None:
    sim, state = _simulation("sequential")
    names = tuple(sim.model.names)
    shared = [name for name in names if name.startswith(("1.", "4."))]
    local = [name for name in names if name.startswith(("0.", "2."))]
    server = _bn_mlp().double()
    own = [copy.deepcopy(server) for _ in BOUNDS[1:]]  # each client's module: its BN parameters and statistics
    for round_index in (1, 2):
        state, _ = run_round(sim, state, evaluate_after=False)
        for client, (start, end) in enumerate(itertools.pairwise(BOUNDS)):
            with torch.no_grad():
                for name, parameter in own[client].named_parameters():
                    if name in shared:
                        parameter.copy_(dict(server.named_parameters())[name])
            x, y = sim.data.train_inputs[start:end], sim.data.train_targets[start:end]
            _local_sgd(own[client], x, y, client, round_index)
        with torch.no_grad():
            for name, parameter in server.named_parameters():
                if name in shared:  # uniform FedAvg over the two clients
                    parameter.copy_(sum(dict(m.named_parameters())[name] for m in own) / 2)
    params = sim.model.unflatten(state.server.params)
    for name in shared:
        torch.testing.assert_close(params[name], dict(server.named_parameters())[name], rtol=0, atol=1e-12)
    record = own_buffers_record(sim)
    assert record.names == tuple(n for n, _ in server.named_buffers())  # every buffer is a BatchNorm's: all local
    for client, module in enumerate(own):
        mine = sim.model.unflatten(
            sim.algorithm.personalization.model(sim.algorithm.broadcast(state.server), state.clients.get(client))
        )
        for name in local:
            torch.testing.assert_close(mine[name], dict(module.named_parameters())[name], rtol=0, atol=1e-12)
        for name, value in module.named_buffers():
            torch.testing.assert_close(record.start_of(client)[name], value, rtol=0, atol=1e-12)
    assert not torch.equal(record.start_of(0)["0.running_mean"], record.start_of(1)["0.running_mean"])
    # the server's own statistics are never averaged: still the initial ones
    assert torch.equal(sim.model.module[0].running_mean, torch.zeros(2, dtype=torch.float64))
    assert int(sim.model.module[0].num_batches_tracked) == 0
    # The personal evaluation: each client's model in evaluation mode with its own statistics, on its own test rows.
    expected = []
    for client, module in enumerate(own):
        rows = torch.tensor(sim.data.client_test_indices[client])
        predicted = module.eval()(sim.data.test_inputs[rows]).argmax(1)
        expected.append(float((predicted == sim.data.test_targets[rows]).double().mean()))
    before = module_buffers(sim.model.module)
    columns = evaluate_personal(sim, state.server, state.clients, None, 2)
    assert columns["personal_test_accuracy_mean"] == pytest.approx(np.mean(expected), abs=1e-12)
    for name, value in module_buffers(sim.model.module).items():
        assert torch.equal(value, before[name])  # the server's statistics are put back


def _rounds(sim: Simulation, state: SimulationState, count: int) -> tuple[SimulationState, list[dict]]:
    records = []
    for _ in range(count):
        state, record = run_round(sim, state, evaluate_after=True)
        records.append({k: v for k, v in record.items() if k != "round_seconds"})
    return state, records


def test_both_backends_keep_the_same_clients_statistics() -> None:
    results = {}
    for backend in ("sequential", "vectorized"):
        sim, state = _simulation(backend)
        state, records = _rounds(sim, state, 3)
        results[backend] = (sim, state, records)
    (sim, state, records), (sim2, state2, records2) = results["sequential"], results["vectorized"]
    torch.testing.assert_close(state.server.params, state2.server.params, rtol=0, atol=1e-12)
    for client in (0, 1):
        torch.testing.assert_close(
            state.clients.get(client).personal, state2.clients.get(client).personal, rtol=0, atol=1e-12
        )
        for name, value in own_buffers_record(sim).start_of(client).items():
            torch.testing.assert_close(value, own_buffers_record(sim2).start_of(client)[name], rtol=0, atol=1e-12)
    for one, other in zip(records, records2, strict=True):
        assert one.keys() == other.keys()
        for key, value in one.items():
            assert value == pytest.approx(other[key], abs=1e-12), key


def test_a_run_continued_from_every_clients_statistics_equals_an_uninterrupted_one() -> None:
    straight, state = _simulation("sequential")
    state, straight_records = _rounds(straight, state, 3)
    first, halfway = _simulation("sequential")
    halfway, _ = _rounds(first, halfway, 1)
    saved = {}
    for extra in first.checkpointed_extras():  # a checkpoint's engine section
        saved.update(extra.engine_tensors(halfway, {}))
    assert {name for name in saved if name.startswith("personal_buffers/")} == {
        f"personal_buffers/{client}/{name}" for client in (0, 1) for name, _ in first.model.module.named_buffers()
    }
    resumed, _ = _simulation("sequential")  # a fresh process: fresh module, fresh record
    for extra in resumed.checkpointed_extras():
        assert extra.restored(resumed, halfway, saved) == {}
    halfway, resumed_records = _rounds(resumed, halfway, 2)
    assert torch.equal(state.server.params, halfway.server.params)
    for client in (0, 1):
        for name, value in own_buffers_record(straight).start_of(client).items():
            assert torch.equal(value, own_buffers_record(resumed).start_of(client)[name]), name
    assert straight_records[1:] == resumed_records
    assert any(isinstance(extra, ModuleBuffersExtra) for extra in resumed.checkpointed_extras())
    assert sum(isinstance(extra, ClientBuffers) for extra in resumed.checkpointed_extras()) == 1


def _normed(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(input_shape[0], 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, num_classes))


def test_a_fedbn_run_resumes_exactly_and_load_model_gives_a_clients_own_statistics(tmp_path: Path) -> None:
    table = {
        "rounds": 3,
        "precision": "float64",
        "data": {"num_clients": 4, "client_test_fraction": 0.2},
        "client": {"steps": 3},
        "sampling": {"participation": 1.0},
        "evaluation": {"every": 1},
        "algorithm": {"name": "fedavg", "aggregation": "uniform"},
        "keep_checkpoint": True,
        "personal_layers": {"keep": ["batchnorm"]},
    }
    straight = driftlab.run(driftlab.load_config(table), tmp_path / "straight", model=_normed)
    driftlab.run(
        driftlab.load_config({**table, "rounds": 2, "checkpoint_every": 1}), tmp_path / "resumed", model=_normed
    )
    config = driftlab.load_config({**table, "checkpoint_every": 1})
    resumed = driftlab.run(config, tmp_path / "resumed", resume=True, model=_normed)
    assert torch.equal(straight.final_params, resumed.final_params)
    drop = ("round_seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in straight.records] == [
        {k: v for k, v in r.items() if k not in drop} for r in resumed.records
    ]
    assert all("personal_test_accuracy_mean" in record for record in straight.records)
    first, second = (load_model(tmp_path / "straight", model=_normed, client=k)[1] for k in (0, 1))
    assert int(first.num_batches_tracked) == int(second.num_batches_tracked) > 0  # each trained its own
    assert not torch.equal(first.running_mean, second.running_mean)
    assert int(load_model(tmp_path / "straight", model=_normed)[1].num_batches_tracked) == 0  # the server's: initial
