"""Buffers as state: the average of hand-computed cases, and what the backends record for each client."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from driftlab.simulation.backends.buffers import (
    ModuleBuffersExtra,
    RoundBuffers,
    average_buffers,
    load_buffers,
    module_buffers,
)
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import (
    ClientTask,
    LocalSettings,
    SequentialBackend,
    TrainingData,
    batch_plan,
)
from driftlab.simulation.backends.testing import client_tasks
from driftlab.simulation.backends.vectorized import VectorizedBackend
from driftlab.simulation.seam import NO_CORRECTION

SIZES = (7, 12, 6)  # 7 and 6 with B = 4: short last batches (never of 1: BatchNorm refuses those)
BATCH = 4
MOMENTUM = 0.1  # BatchNorm's default


def test_float_buffers_are_the_weighted_mean_and_counts_the_maximum():
    server = {"mean": torch.tensor([0.0, 1.0], dtype=torch.float64), "count": torch.tensor(4)}
    clients = [
        {"mean": torch.tensor([1.0, 2.0], dtype=torch.float64), "count": torch.tensor(6)},
        {"mean": torch.tensor([3.0, 4.0], dtype=torch.float64), "count": torch.tensor(9)},
    ]
    averaged = average_buffers(server, clients, [1.0, 3.0])
    # 0 + ¼·(1 − 0) + ¾·(3 − 0) = 2.5;  1 + ¼·(2 − 1) + ¾·(4 − 1) = 3.5
    torch.testing.assert_close(averaged["mean"], torch.tensor([2.5, 3.5], dtype=torch.float64), rtol=0, atol=1e-15)
    assert averaged["count"].item() == 9 and averaged["count"].dtype == torch.int64
    assert average_buffers(server, [], []) == server  # nobody reported: the server's


def test_a_buffer_no_client_changed_stays_bit_for_bit():
    table = torch.tensor([0.1, 1 / 3, 7e-8], dtype=torch.float32)
    averaged = average_buffers({"table": table}, [{"table": table.clone()}] * 3, [0.3, 1 / 7, 5.0])
    assert torch.equal(averaged["table"], table)


def test_the_average_refuses_mismatched_weights():
    with pytest.raises(ValueError, match="2 clients' buffers but 1 weights"):
        average_buffers({}, [{}, {}], [1.0])
    with pytest.raises(ValueError, match="positive sum"):
        average_buffers({}, [{}], [0.0])


def test_loading_buffers_of_another_model_names_them():
    with pytest.raises(KeyError, match="no buffers named running_sum"):
        load_buffers(nn.BatchNorm1d(2), {"running_sum": torch.zeros(2)})


def _norm_first() -> FlatModel:
    """BatchNorm as the first layer: its running mean depends on the data alone, so it can be computed by hand."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 4), nn.Tanh(), nn.BatchNorm1d(4), nn.Linear(4, 2))
    return FlatModel.wrap(module.double())


def _problem():
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(sum(SIZES), 3, generator=generator, dtype=torch.float64) * 2 + 0.5
    targets = torch.randint(0, 2, (sum(SIZES),), generator=generator)
    data = TrainingData(inputs, targets)
    return data, client_tasks(SIZES, BATCH, 5, augment_key=lambda client_id: 100 + client_id)  # two epochs each


def _train(backend, model: FlatModel, data, tasks, buffers: RoundBuffers):
    finals = {
        position: final
        for position, final, _ in backend.train(
            model, model.initial_parameters(), tasks, LocalSettings(0.05), data, buffers
        )
    }
    return [finals[p] for p in range(len(tasks))], [buffers.final[p] for p in range(len(tasks))]


def test_each_client_updates_the_round_buffers_with_its_own_batches():
    model = _norm_first()
    start = module_buffers(model.module)
    start["0.running_mean"] = torch.tensor([0.3, -0.2, 1.0], dtype=torch.float64)  # the server's, not the module's
    data, tasks = _problem()
    _, recorded = _train(SequentialBackend(), model, data, tasks, RoundBuffers(start))
    for task, buffers in zip(tasks, recorded, strict=True):
        # r ← (1 − m)·r + m·mean(batch), from the server's r, one update per step
        expected = start["0.running_mean"].clone()
        for row in task.batches:
            expected = (1 - MOMENTUM) * expected + MOMENTUM * data.inputs[task.sample_indices[row[row >= 0]]].mean(0)
        torch.testing.assert_close(buffers["0.running_mean"], expected, rtol=0, atol=1e-13)
        assert buffers["0.num_batches_tracked"].item() == task.num_steps
    # The shared module (the server's buffers) is left alone: the engine averages and writes them.
    assert model.module[0].num_batches_tracked.item() == 0 and not model.module[0].running_mean.any()
    weights = [float(size) for size in SIZES]
    averaged = average_buffers(start, recorded, weights)
    by_hand = sum(w * b["0.running_mean"] for w, b in zip(weights, recorded, strict=True)) / sum(weights)
    torch.testing.assert_close(averaged["0.running_mean"], by_hand, rtol=0, atol=1e-14)
    assert averaged["0.num_batches_tracked"].item() == max(task.num_steps for task in tasks)


@pytest.mark.parametrize("inexact", [False, True], ids=["all-steps", "gamma-inexact"])
def test_both_backends_train_and_record_the_same_buffers(inexact, caplog):
    model = _norm_first()
    data, tasks = _problem()
    if inexact:  # a client that stops early keeps the buffers of its stop, while its row computes on in the stack
        tasks = [
            dataclasses.replace(t, stop_gamma=0.9, steps_per_epoch=-(-n // BATCH))
            for t, n in zip(tasks, SIZES, strict=True)
        ]
    sequential = _train(SequentialBackend(), model, data, tasks, RoundBuffers(module_buffers(model.module)))
    with caplog.at_level(logging.WARNING, logger="driftlab.simulation.backends.vectorized"):
        vectorized = _train(VectorizedBackend(), model, data, tasks, RoundBuffers(module_buffers(model.module)))
    assert not caplog.records  # vmapped with each client's buffers, no fallback to the sequential backend
    for one, other in zip(sequential[0], vectorized[0], strict=True):
        torch.testing.assert_close(one, other, rtol=0, atol=1e-12)
    for one, other in zip(sequential[1], vectorized[1], strict=True):
        assert one.keys() == other.keys()
        for name in one:
            torch.testing.assert_close(one[name], other[name], rtol=0, atol=1e-12)
    if inexact:
        done = [b["0.num_batches_tracked"].item() for b in sequential[1]]
        assert done != [task.num_steps for task in tasks]  # some client did stop early


def test_a_client_starts_from_the_round_buffers_whatever_its_thread_trained_before():
    model = _norm_first()
    data, tasks = _problem()
    backend = SequentialBackend(parallel_clients=False)  # one bound copy serves every client, round after round
    first = _train(backend, model, data, tasks, RoundBuffers(module_buffers(model.module)))
    again = _train(backend, model, data, tasks[::-1], RoundBuffers(module_buffers(model.module)))
    for position in range(len(tasks)):
        assert torch.equal(first[0][position], again[0][len(tasks) - 1 - position])
        for name, value in first[1][position].items():
            assert torch.equal(value, again[1][len(tasks) - 1 - position][name])


def test_a_model_without_buffers_trains_bit_for_bit_as_without_a_record():
    torch.manual_seed(0)
    model = FlatModel.wrap(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    assert module_buffers(model.module) == {}
    assert ModuleBuffersExtra(model.module).engine_tensors(None, {}) == {}  # its checkpoints are the files of before
    data, tasks = _problem()
    plain = list(SequentialBackend().train(model, model.initial_parameters(), tasks, LocalSettings(0.05), data))
    recorded = _train(SequentialBackend(), model, data, tasks, RoundBuffers({}))
    for position, final, _ in plain:
        assert torch.equal(final, recorded[0][position]) and recorded[1][position] == {}


def test_a_batch_of_one_for_batchnorm_names_the_client_and_the_fix():
    model = _norm_first()
    data, tasks = _problem()
    task = ClientTask(9, torch.arange(5), batch_plan(5, 1, 9, 5, BATCH, 2), NO_CORRECTION)  # 5 = 4 + 1
    with pytest.raises(ValueError, match=r"client 9's local step 1 has a batch of one example.*has 5 examples"):
        list(SequentialBackend().train(model, model.initial_parameters(), [task], LocalSettings(0.05), data))


def test_a_model_with_dropout_and_batchnorm_agrees_on_both_backends():
    # Keyed dropout masks (modes.py) inside the per-client buffered vmap, short batches computed on their real rows.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3), nn.Linear(6, 2))
    model = FlatModel.wrap(module.double())
    data, tasks = _problem()
    sequential = _train(SequentialBackend(), model, data, tasks, RoundBuffers(module_buffers(model.module)))
    vectorized = _train(VectorizedBackend(), model, data, tasks, RoundBuffers(module_buffers(model.module)))
    for one, other in zip(sequential[0], vectorized[0], strict=True):
        torch.testing.assert_close(one, other, rtol=0, atol=1e-12)
    for one, other in zip(sequential[1], vectorized[1], strict=True):
        torch.testing.assert_close(one["1.running_var"], other["1.running_var"], rtol=0, atol=1e-12)


def test_a_client_with_buffers_of_its_own_starts_from_them_on_both_backends():
    # FedBN's seam: a client keeps its BatchNorm statistics; the others start from the round's.
    model = _norm_first()
    data, tasks = _problem()
    own = {1: {"0.running_mean": torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)}}
    results = []
    for backend in (SequentialBackend(), VectorizedBackend()):
        results.append(_train(backend, model, data, tasks, RoundBuffers(module_buffers(model.module), own))[1])
    for recorded in results:
        for position, task in enumerate(tasks):
            expected = own[position]["0.running_mean"] if position in own else torch.zeros(3, dtype=torch.float64)
            for row in task.batches:
                batch = data.inputs[task.sample_indices[row[row >= 0]]]
                expected = (1 - MOMENTUM) * expected + MOMENTUM * batch.mean(0)
            torch.testing.assert_close(recorded[position]["0.running_mean"], expected, rtol=0, atol=1e-13)
    for name, value in results[0][2].items():
        torch.testing.assert_close(results[1][2][name], value, rtol=0, atol=1e-12)
