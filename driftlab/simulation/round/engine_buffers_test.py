"""Buffers as state through the engine (``backends/buffers.py``): the server's running statistics are the reporting
clients' weighted mean, evaluation reads them, both backends agree, and a run continues from them exactly."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import driftlab
from driftlab.algorithms import fedavg
from driftlab.data.federated import FederatedDataset
from driftlab.experiments.run.loading import FINAL_STATE_DICT_FILE, load_model
from driftlab.experiments.run.runner import BACKENDS
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.buffers import ModuleBuffersExtra, module_buffers, refuse_running_statistics
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import batch_plan, steps_for_epochs
from driftlab.simulation.round.engine import run_round
from driftlab.simulation.round.setup import RoundPlan, Simulation, SimulationState
from driftlab.simulation.state.state_store import InMemoryClientStore

BOUNDS = (0, 13, 30, 50)  # three clients of 13, 17 and 20 rows: with B = 5, short last batches of 3 and 2
BATCH = 5
SEED = 3


def _simulation(backend: str) -> tuple[Simulation, SimulationState]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(60, 6, generator=generator, dtype=torch.float64) * 2 + 1
    targets = torch.randint(0, 3, (60,), generator=generator)
    clients = tuple(np.arange(start, end) for start, end in itertools.pairwise(BOUNDS))
    data = FederatedDataset("vectors", inputs[:50], targets[:50], inputs[50:], targets[50:], clients, 3)
    torch.manual_seed(0)
    # BatchNorm first: its running mean is a function of the data alone, so the server's can be computed by hand.
    module = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model = FlatModel.wrap(module).to("cpu", torch.float64)
    theta = model.initial_parameters()
    plan = RoundPlan(
        seed=SEED,
        participation=1.0,
        sampling="uniform",
        batch_size=BATCH,
        client_lr=0.1,
        server_lr=1.0,
        local_epochs=1,
        steps=None,
    )
    algorithm = fedavg.build(make_server_optimizer("sgd"))
    sim = Simulation(model, data, algorithm, BACKENDS[backend](), plan, torch.device("cpu"), torch.float64, theta)
    return sim, SimulationState(0, algorithm.server_init(theta), InMemoryClientStore(None))


def test_the_server_running_mean_is_the_clients_mean_weighted_by_their_sizes_and_evaluation_reads_it():
    sim, state = _simulation("sequential")
    state, record = run_round(sim, state, evaluate_after=True)
    inputs = sim.data.train_inputs
    expected, total = torch.zeros(6, dtype=torch.float64), 0
    for client_id, (start, end) in enumerate(itertools.pairwise(BOUNDS)):
        size = end - start
        plan = batch_plan(SEED, 1, client_id, size, BATCH, steps_for_epochs(size, BATCH, 1))
        running = torch.zeros(6, dtype=torch.float64)  # every client starts from the server's (the initial zeros)
        for row in plan:
            running = 0.9 * running + 0.1 * inputs[start + row[row >= 0]].mean(0)  # BatchNorm's momentum 0.1
        expected += size * running
        total += size
    norm = sim.model.module[0]
    torch.testing.assert_close(norm.running_mean, expected / total, rtol=0, atol=1e-13)
    assert norm.num_batches_tracked.item() == max(-(-(e - s) // BATCH) for s, e in itertools.pairwise(BOUNDS))
    # The round's test loss is the server model's in evaluation mode, with the averaged statistics.
    p, module = sim.model.unflatten(state.server.params), sim.model.module
    first, second = module[0], module[2]
    x = F.batch_norm(sim.data.test_inputs, first.running_mean, first.running_var, p["0.weight"], p["0.bias"], False)
    x = F.batch_norm(
        F.linear(x, p["1.weight"], p["1.bias"]), second.running_mean, second.running_var, p["2.weight"], p["2.bias"]
    )
    loss = F.cross_entropy(F.linear(torch.relu(x), p["4.weight"], p["4.bias"]), sim.data.test_targets)
    assert abs(record["test_loss"] - float(loss)) < 1e-12


def test_both_backends_give_the_same_models_buffers_and_records():
    results = []
    for backend in ("sequential", "vectorized"):
        sim, state = _simulation(backend)
        records = []
        for _ in range(3):
            state, record = run_round(sim, state, evaluate_after=True)
            records.append({k: v for k, v in record.items() if k != "round_seconds"})
        results.append((state.server.params, module_buffers(sim.model.module), records))
    (params, buffers, records), (params2, buffers2, records2) = results
    torch.testing.assert_close(params, params2, rtol=0, atol=1e-12)
    for name, value in buffers.items():
        torch.testing.assert_close(value, buffers2[name], rtol=0, atol=1e-12)
    for one, other in zip(records, records2, strict=True):
        assert one.keys() == other.keys()
        for key, value in one.items():
            if isinstance(value, float):
                assert abs(value - other[key]) < 1e-12, key
            else:
                assert value == other[key], key


def test_a_run_continued_from_the_state_and_the_server_buffers_equals_an_uninterrupted_one():
    straight, state = _simulation("sequential")
    straight_records = []
    for _ in range(3):
        state, record = run_round(straight, state, evaluate_after=True)
        straight_records.append({k: v for k, v in record.items() if k != "round_seconds"})
    first, halfway = _simulation("sequential")
    halfway, _ = run_round(first, halfway, evaluate_after=True)
    resumed, _ = _simulation("sequential")  # a fresh process: a fresh module, fresh backend copies
    saved = ModuleBuffersExtra(first.model.module).engine_tensors(halfway, {})  # a checkpoint's engine section
    assert set(saved) == {f"buffers/{name}" for name, _ in first.model.module.named_buffers()}
    assert (
        ModuleBuffersExtra(resumed.model.module).restored(resumed, halfway, {**saved, "clock": torch.zeros(())}) == {}
    )
    resumed_records = []
    for _ in range(2):
        halfway, record = run_round(resumed, halfway, evaluate_after=True)
        resumed_records.append({k: v for k, v in record.items() if k != "round_seconds"})
    assert torch.equal(state.server.params, halfway.server.params)
    for name, value in module_buffers(straight.model.module).items():
        assert torch.equal(value, module_buffers(resumed.model.module)[name]), name
    assert straight_records[1:] == resumed_records


def _normed(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(input_shape[0], 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, num_classes))


def test_a_run_saves_the_averaged_buffers_and_load_model_gives_them_back_on_both_backends(tmp_path):
    saved = {}
    for backend in ("sequential", "vectorized"):
        out = tmp_path / backend
        config = {"rounds": 2, "data": {"num_clients": 4}, "client": {"batch_size": 1000}, "precision": "float64"}
        config["backend"] = backend  # full batches: a BatchNorm in training mode refuses a batch of one
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = driftlab.run(config, out_dir=out, model=_normed)
        assert not [w for w in caught if "running statistics" in str(w.message)]  # no UntrackedBuffersWarning
        loaded = load_model(out, model=_normed)
        assert loaded[1].num_batches_tracked.item() > 0 and loaded[1].running_mean.abs().sum() > 0
        file = load_file(str(out / FINAL_STATE_DICT_FILE))
        assert torch.equal(file["1.running_var"], loaded[1].running_var.to(file["1.running_var"].dtype))
        saved[backend] = (result.final_params, module_buffers(loaded))
    for name, value in saved["sequential"][1].items():
        torch.testing.assert_close(value, saved["vectorized"][1][name], rtol=0, atol=1e-12)
    torch.testing.assert_close(saved["sequential"][0], saved["vectorized"][0], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("features", "refused"),
    [
        ({"privacy": {"clip": 1.0}, "algorithm": {"name": "fedavg", "aggregation": "uniform"}}, r"\[privacy\]"),
        (
            {"system": {}, "asynchronous": {"concurrency": 4, "buffer": 2}, "algorithm": {"aggregation": "uniform"}},
            r"\[asynchronous\]",
        ),
    ],
)
def test_a_feature_that_cannot_carry_running_statistics_refuses_a_batchnorm_model_before_any_round(
    tmp_path, features, refused
):
    config = {"rounds": 2, "data": {"num_clients": 4}, "client": {"batch_size": 1000}, **features}
    with pytest.raises(driftlab.ConfigError, match=refused + r" with a model whose normalisation layers keep running "):
        driftlab.run(config, out_dir=tmp_path / "run", model=_normed)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_refuse_running_statistics_names_the_layers_and_passes_a_model_without_them():
    refuse_running_statistics(nn.Sequential(nn.Linear(2, 2), nn.GroupNorm(1, 2)), "x", "why")  # no running statistics
    with pytest.raises(ValueError, match=r"^a deployment with a model whose .* \(1\): why; use GroupNorm"):
        refuse_running_statistics(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), "a deployment", "why")
