"""Modes and keyed dropout: masks from (key, call, position) alone, the same on both backends and on reruns."""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from driftlab.randomness import augmentation_key, example_keys
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import ClientTask, LocalSettings, SequentialBackend, TrainingData
from driftlab.simulation.backends.modes import has_dropout, keyed_dropout, module_mode, step_keys
from driftlab.simulation.backends.objectives import LossTerm
from driftlab.simulation.backends.testing import client_tasks
from driftlab.simulation.backends.vectorized import VectorizedBackend
from driftlab.simulation.seam import GradientCorrection

SIZES = (23, 40, 7, 31)  # 7 < B and 23, 31 not multiples of B: narrow and padded last batches
BATCH = 10


def _module(dropout: float = 0.4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(6, 12),
        nn.Dropout(dropout),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Dropout(dropout),
        nn.Linear(12, 3),
    )


def _data() -> TrainingData:
    generator = torch.Generator().manual_seed(1)
    n = sum(SIZES)
    return TrainingData(
        torch.randn(n, 6, generator=generator, dtype=torch.float64), torch.randint(0, 3, (n,), generator=generator)
    )


def _tasks(corrections=None, stop_gamma=None) -> list[ClientTask]:
    return client_tasks(
        SIZES,
        BATCH,
        3,
        corrections,
        steps=lambda k, per_epoch: 2 * per_epoch - k % 2,  # unequal step counts
        augment_key=lambda k: augmentation_key(3, 1, k),
        stop_gamma=stop_gamma,
    )


SETTINGS = LocalSettings(0.2)


def _train(backend, model: FlatModel, tasks, settings=SETTINGS) -> tuple[torch.Tensor, list[int]]:
    start = model.initial_parameters()
    finals = {
        position: (params, done) for position, params, done in backend.train(model, start, tasks, settings, _data())
    }
    if isinstance(backend, VectorizedBackend):
        assert backend._fallback is None  # vmap drew the masks: no fallback to the sequential backend
    return torch.stack([finals[p][0] for p in range(len(tasks))]), [finals[p][1] for p in range(len(tasks))]


def test_a_mask_is_a_function_of_key_call_and_position_hand_checked():
    x = torch.ones(2, 5, dtype=torch.float64)
    key = torch.tensor(12345)
    with keyed_dropout(key):
        first, second = F.dropout(x, 0.5), F.dropout(x, 0.5)
    # call j keeps element i when the top 53 bits of example_keys(key, j, i), as a fraction, are >= p
    for call, out in enumerate((first, second)):
        bits = example_keys(12345, call, torch.arange(10)).tolist()
        kept = [((b >> 11) & ((1 << 53) - 1)) * 2.0**-53 >= 0.5 for b in bits]
        assert out.reshape(-1).tolist() == [2.0 if keep else 0.0 for keep in kept]
    assert not torch.equal(first, second)  # a second call of the same step draws a new mask
    # A row's mask does not depend on the rows after it: a padded batch gives its real rows the same masks.
    with keyed_dropout(key):
        padded = F.dropout(torch.ones(4, 5, dtype=torch.float64), 0.5)
    assert torch.equal(padded[:2], first)
    with keyed_dropout(key):
        many = F.dropout(torch.ones(20000, dtype=torch.float64), 0.25)
    assert abs(float((many != 0).double().mean()) - 0.75) < 0.01


def test_channel_dropout_zeroes_whole_channels_and_eval_mode_none():
    x = torch.ones(3, 8, 4, 4)
    with keyed_dropout(torch.tensor(7)):
        out = F.dropout2d(x, 0.5)
    per_channel = out.reshape(3, 8, 16)
    assert torch.all((per_channel == 0).all(-1) | (per_channel == 2.0).all(-1))
    with keyed_dropout(torch.tensor(7)):
        assert torch.equal(F.dropout(x, 0.5, training=False), x)


def test_step_keys_of_a_stack_equal_each_clients_own():
    bases = [augmentation_key(0, 2, k) for k in range(5)]
    stacked = step_keys(torch.tensor(bases), 3)
    assert stacked.tolist() == [int(step_keys(b, 3)) for b in bases]
    assert len(set(stacked.tolist())) == 5 and int(step_keys(bases[0], 3)) != int(step_keys(bases[0], 4))


def test_module_mode_sets_every_submodule_and_restores_each_ones_own():
    module = _module()
    module[2].eval()  # a user's deliberate choice for one layer
    with module_mode(module, training=False):
        assert not any(sub.training for sub in module.modules())
    assert module.training and not module[2].training and module[5].training
    with module_mode(module, training=True):
        assert all(sub.training for sub in module.modules())
    assert not module[2].training


def test_flat_model_forward_evaluates_without_dropout_and_leaves_the_mode_alone():
    model = FlatModel.wrap(_module(0.9).double())
    assert model.dropout and has_dropout(model.module)
    theta = model.initial_parameters()
    x = torch.randn(50, 6, dtype=torch.float64)
    first = model.forward(theta, x)
    assert torch.equal(first, model.forward(theta, x))  # deterministic: no mask
    expected = model.module.eval()(x)
    model.module.train()
    assert torch.allclose(first, expected, rtol=0, atol=1e-15)
    assert model.module.training  # restored


@pytest.mark.parametrize("parallel", [False, True])
def test_dropout_training_is_bit_identical_on_reruns_and_the_same_on_both_backends(parallel):
    model = FlatModel.wrap(_module().double())
    tasks = _tasks()
    sequential, steps = _train(SequentialBackend(parallel_clients=parallel), model, tasks)
    again, _ = _train(SequentialBackend(parallel_clients=not parallel), model, tasks)
    assert torch.equal(sequential, again)  # reruns (and thread counts) give the same bits
    vectorized, vectorized_steps = _train(
        VectorizedBackend(max_chunk_clients=3, parallel_chunks=parallel), model, tasks
    )
    assert torch.allclose(vectorized, sequential, rtol=1e-12, atol=1e-12) and vectorized_steps == steps
    assert torch.equal(
        _train(VectorizedBackend(max_chunk_clients=3, parallel_chunks=parallel), model, tasks)[0], vectorized
    )
    other_chunks, _ = _train(VectorizedBackend(max_chunk_clients=2), model, tasks)  # other clients share a vmap
    assert torch.allclose(other_chunks, sequential, rtol=1e-12, atol=1e-12)
    # The masks matter: without dropout (p = 0) the same steps end elsewhere.
    plain, _ = _train(SequentialBackend(), FlatModel.wrap(_module(0.0).double()), tasks)
    assert not torch.allclose(plain, sequential, atol=1e-6)


def test_different_clients_and_rounds_draw_different_masks():
    model = FlatModel.wrap(_module().double())
    tasks = _tasks()
    base, _ = _train(SequentialBackend(), model, tasks)
    other_round = [dataclasses.replace(t, augment_key=augmentation_key(3, 2, t.client_id)) for t in tasks]
    moved, _ = _train(SequentialBackend(), model, other_round)
    assert all(not torch.allclose(moved[k], base[k]) for k in range(len(tasks)))


def test_a_loss_term_and_inexact_stopping_agree_across_backends_with_dropout():
    model = FlatModel.wrap(_module().double())
    anchor = model.initial_parameters() * 0.9

    def distill(batch, reference):  # the term evaluates another model: its dropout draws from the same step key
        other = batch.forward(reference, batch.inputs)
        return 0.1 * (batch.weights * ((batch.outputs - other) ** 2).sum(1)).sum()

    term = LossTerm(distill, (anchor,))
    tasks = _tasks(corrections=[term] * len(SIZES))
    sequential, _ = _train(SequentialBackend(), model, tasks)
    vectorized, _ = _train(VectorizedBackend(max_chunk_clients=4), model, tasks)
    assert torch.allclose(vectorized, sequential, rtol=1e-12, atol=1e-12)
    # γ-inexact stopping measures its full gradient in evaluation mode on both backends: the same stops.
    quadratic = [GradientCorrection(quadratic=0.5, reference=anchor)] * len(SIZES)
    inexact = _tasks(corrections=quadratic, stop_gamma=0.9)
    seq_params, seq_steps = _train(SequentialBackend(), model, inexact)
    vec_params, vec_steps = _train(VectorizedBackend(max_chunk_clients=4), model, inexact)
    assert seq_steps == vec_steps and any(done < task.num_steps for done, task in zip(seq_steps, inexact, strict=True))
    assert torch.allclose(vec_params, seq_params, rtol=1e-12, atol=1e-12)


def test_a_model_without_dropout_or_buffers_trains_exactly_as_without_keys():
    # The step key is only read for a model with dropout: the same tasks with and without keys give the same bits.
    torch.manual_seed(0)
    model = FlatModel.wrap(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double())
    assert not model.dropout
    tasks = _tasks()
    unkeyed = [dataclasses.replace(t, augment_key=0) for t in tasks]
    for backend in (SequentialBackend(), VectorizedBackend()):
        assert torch.equal(_train(backend, model, tasks)[0], _train(backend, model, unkeyed)[0])


def test_keyed_dropout_is_per_thread():
    x = torch.ones(1000, dtype=torch.float64)
    results = {}

    def draw(key):
        with keyed_dropout(torch.tensor(key)):
            results[key] = F.dropout(x, 0.5)

    threads = [threading.Thread(target=draw, args=(key,)) for key in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for key in range(8):
        draw(key + 100)
        with keyed_dropout(torch.tensor(key)):
            assert torch.equal(results[key], F.dropout(x, 0.5))


def test_wrapping_a_module_with_running_statistics_no_longer_warns():
    # Buffers are state (buffers.py): BatchNorm models are trained right, so nothing is left to warn about.
    class WithNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.norm = nn.Linear(4, 3), nn.BatchNorm1d(3)

        def forward(self, x):
            return self.norm(self.linear(x))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FlatModel.wrap(WithNorm())
        FlatModel.wrap(nn.Sequential(nn.Linear(4, 3), nn.GroupNorm(1, 3), nn.BatchNorm1d(3, track_running_stats=False)))
        FlatModel.wrap(_module())


def test_evaluation_uses_the_initial_running_statistics_which_local_training_leaves_alone():
    torch.manual_seed(0)
    model = FlatModel.wrap(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double())
    x = torch.randn(30, 4, dtype=torch.float64) * 3 + 1
    theta = model.initial_parameters()
    evaluated = model.forward(theta, x)
    linear = model.module[0](x).detach()
    assert torch.allclose(evaluated, linear / math.sqrt(1 + 1e-5), atol=1e-12)  # running mean 0, variance 1
    assert model.module[1].num_batches_tracked == 0  # evaluation leaves the statistics alone
    # Without a RoundBuffers (buffers.py) local steps update their own copy's statistics: the shared module's stay.
    tasks = _tasks()[:1]
    data = TrainingData(torch.randn(SIZES[0], 4, dtype=torch.float64), torch.randint(0, 3, (SIZES[0],)))
    finals = list(SequentialBackend().train(model, theta, tasks, LocalSettings(0.1), data))
    assert np.isfinite(finals[0][1].numpy()).all() and model.module[1].num_batches_tracked == 0
