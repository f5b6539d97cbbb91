"""Local objectives beyond affine corrections: loss terms and local steps on both backends.

Every backend comparison is in float64, where the backends differ only in
summation order (1e-12); the sequential backend is the reference.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from driftlab.models import build_model
from driftlab.simulation.backends.flat import FlatModel, objective_per_example
from driftlab.simulation.backends.local_training import ClientTask, LocalSettings, SequentialBackend, TrainingData
from driftlab.simulation.backends.objectives import LocalBatch, LocalObjective, LocalStep, LossTerm, as_local_objective
from driftlab.simulation.backends.testing import client_tasks
from driftlab.simulation.backends.vectorized import VectorizedBackend
from driftlab.simulation.seam import NO_CORRECTION, GradientCorrection

TOLERANCE = dict(rtol=1e-12, atol=1e-12)
CLIENT_SIZES = (37, 50, 7, 23)  # 7 < B: narrow batches; unequal sizes give unequal step counts
BATCH_SIZE = 10
DTYPE = torch.float64


def _model(name: str) -> FlatModel:
    torch.manual_seed(0)
    if name == "cnn":  # the batched (StackedNetwork) layers for local steps, vmap for loss terms
        module = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(27, 10))
    else:  # the Linear/ReLU stack
        module = build_model("mlp", (1, 8, 8), 10, hidden=(16, 12))
    return FlatModel.wrap(module).to("cpu", DTYPE)


def _data() -> TrainingData:
    generator = torch.Generator().manual_seed(1)
    n = sum(CLIENT_SIZES)
    return TrainingData(
        torch.randn(n, 1, 8, 8, generator=generator, dtype=DTYPE), torch.randint(0, 10, (n,), generator=generator)
    )


def _tasks(objectives: list, epochs: int = 2, stop_gamma: float | None = None) -> list[ClientTask]:
    return client_tasks(
        CLIENT_SIZES,
        BATCH_SIZE,
        3,
        objectives,
        steps=lambda client_id, per_epoch: epochs * per_epoch - client_id % 2,  # unequal, not always whole epochs
        stop_gamma=stop_gamma,
    )


def _run(
    backend, model, start, tasks, settings, data, fallback_expected: bool = False
) -> dict[int, tuple[torch.Tensor, int]]:
    logger = logging.getLogger("driftlab.simulation.backends.vectorized")
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger.addHandler(handler)
    try:
        results = {
            position: (params.clone(), done)
            for position, params, done in backend.train(model, start, tasks, settings, data)
        }
    finally:
        logger.removeHandler(handler)
    assert sorted(results) == list(range(len(tasks)))
    # The vectorized paths really ran: their sequential fallback would agree with the sequential backend too.
    assert fallback_expected or not any("cannot be vmapped" in warning for warning in warnings), warnings
    return results


def _assert_agree(expected: dict, actual: dict) -> None:
    for position, (params, done) in expected.items():
        assert actual[position][1] == done
        torch.testing.assert_close(actual[position][0], params, **TOLERANCE)


def _vector(start: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    return start + scale * torch.randn(start.shape, generator=torch.Generator().manual_seed(seed), dtype=start.dtype)


# ------------------------------------------------------------------ the objectives a test writes, as an algorithm would


def proximal_term(batch: LocalBatch, anchor: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """FedProx's μ/2 ‖θ − θ_g‖² as a loss term (μ as a tensor argument, so it may differ per client)."""
    return 0.5 * mu * torch.sum((batch.params - anchor) ** 2)


def contrastive_term(batch: LocalBatch, global_params: torch.Tensor, previous_params: torch.Tensor) -> torch.Tensor:
    """MOON's model-contrastive loss, on the outputs (the paper uses a projection head's representation), μ = 0.7, τ = 0.5."""
    z = batch.outputs
    z_global = batch.forward(global_params, batch.inputs)
    z_previous = batch.forward(previous_params, batch.inputs)
    positive = F.cosine_similarity(z, z_global, dim=-1) / 0.5
    negative = F.cosine_similarity(z, z_previous, dim=-1) / 0.5
    per_example = -positive + torch.logsumexp(torch.stack([positive, negative]), dim=0)
    return 0.7 * (batch.weights * per_example).sum()


def heavy_ball(beta: float):
    def step(params, gradient, state, learning_rate):
        (velocity,) = state
        velocity = beta * velocity + gradient
        return params - learning_rate * velocity, (velocity,)

    return step


def plain_sgd(params, gradient, state, learning_rate):
    return params - learning_rate * gradient, state


# ------------------------------------------------------------------ the types


def test_as_local_objective_wraps_each_kind_and_rejects_anything_else():
    correction = GradientCorrection(linear=torch.ones(2))
    term = LossTerm(proximal_term, (torch.zeros(2), torch.tensor(0.1)))
    step = LocalStep(plain_sgd)
    assert as_local_objective(correction) == LocalObjective(correction=correction)
    assert as_local_objective(term) == LocalObjective(loss_term=term)
    assert as_local_objective(step) == LocalObjective(local_step=step)
    objective = LocalObjective(correction, term, step)
    assert as_local_objective(objective) is objective
    assert as_local_objective(NO_CORRECTION).is_affine and not objective.is_affine
    with pytest.raises(TypeError, match="GradientCorrection or a LocalObjective"):
        as_local_objective(torch.ones(2))


def test_bad_fields_are_refused_with_what_is_wrong():
    with pytest.raises(TypeError, match="LossTerm.tensors must be a tuple of tensors"):
        LossTerm(proximal_term, [torch.zeros(2)])
    with pytest.raises(TypeError, match="LocalStep.function must be callable"):
        LocalStep(None)
    with pytest.raises(TypeError, match="LocalStep.initial_state"):
        LocalStep(plain_sgd, (1.0,))
    with pytest.raises(TypeError, match="LocalObjective.correction must be a GradientCorrection"):
        LocalObjective(correction=None)


# ------------------------------------------------------------------ hand-computed client momentum


class _HalfSquaredDistance(nn.Module):
    """Per-example objective ½‖w − x‖²: the gradient of a batch mean is w − mean(x)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=DTYPE))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((self.w - inputs) ** 2).sum(dim=1)


@pytest.mark.parametrize("backend", [SequentialBackend(), VectorizedBackend()], ids=["sequential", "vectorized"])
def test_client_momentum_two_steps_by_hand(backend):
    # x = 0, η = 0.1, β = 0.9, w0 = (1, 2), v0 = 0:
    #   g1 = (1, 2),     v1 = (1, 2),                 w1 = (1, 2) − 0.1 (1, 2)     = (0.9, 1.8)
    #   g2 = (0.9, 1.8), v2 = 0.9 (1, 2) + (0.9, 1.8) = (1.8, 3.6),  w2 = (0.9, 1.8) − 0.1 (1.8, 3.6) = (0.72, 1.44)
    model = FlatModel.wrap(_HalfSquaredDistance(), example_loss=objective_per_example, is_classifier=False)
    data = TrainingData(torch.zeros(1, 2, dtype=DTYPE), torch.zeros(1))
    start = model.initial_parameters()
    momentum = LocalStep(heavy_ball(0.9), (torch.zeros(2, dtype=DTYPE),))
    (task,) = client_tasks([1], 1, 0, [LocalObjective(local_step=momentum)])  # one example, two steps
    for _ in range(2):  # the buffer starts from initial_state every round
        [(_, final, done)] = list(backend.train(model, start, [task], LocalSettings(0.1), data))
        assert done == 2
        torch.testing.assert_close(final, torch.tensor([0.72, 1.44], dtype=DTYPE), rtol=0, atol=1e-15)


# ------------------------------------------------------------------ a local step that is SGD is the default step


@pytest.mark.parametrize("clip_norm", [None, 0.5], ids=["noclip", "clip"])
def test_a_plain_sgd_local_step_equals_the_default_step_bit_for_bit(clip_norm):
    model, data = _model("mlp"), _data()
    start = model.initial_parameters()
    corrections = [
        NO_CORRECTION,
        GradientCorrection(linear=_vector(start, 0.05, 1) - start),
        GradientCorrection(quadratic=0.3, reference=_vector(start, 0.01, 2)),
        NO_CORRECTION,
    ]
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=clip_norm)
    default = _run(SequentialBackend(), model, start, _tasks(corrections), settings, data)
    stepped = _run(
        SequentialBackend(),
        model,
        start,
        _tasks([LocalObjective(c, local_step=LocalStep(plain_sgd)) for c in corrections]),
        settings,
        data,
    )
    for position, (params, done) in default.items():
        assert stepped[position][1] == done
        assert torch.equal(stepped[position][0], params)


# ------------------------------------------------------------------ FedProx as a loss term equals FedProx's correction


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_fedprox_as_a_loss_term_equals_its_affine_correction(backend, model_name):
    model, data = _model(model_name), _data()
    start = model.initial_parameters()
    anchor = _vector(start, 0.01, 3)
    mus = [0.1, 0.3, 0.5, 1.0]
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01)  # no clipping: the correction's term is never clipped
    affine = _tasks([GradientCorrection(quadratic=mu, reference=anchor) for mu in mus])
    as_terms = _tasks(
        [LocalObjective(loss_term=LossTerm(proximal_term, (anchor, torch.tensor(mu, dtype=DTYPE)))) for mu in mus]
    )
    run = (lambda: SequentialBackend()) if backend == "sequential" else (lambda: VectorizedBackend())
    _assert_agree(
        _run(run(), model, start, affine, settings, data), _run(run(), model, start, as_terms, settings, data)
    )


# ------------------------------------------------------------------ sequential against vectorized


def _term_objectives(start: torch.Tensor) -> list:
    """MOON-like terms: one shared global model, a previous model per client; one client also has an affine part."""
    global_params = _vector(start, 0.02, 4)
    objectives = [
        LocalObjective(loss_term=LossTerm(contrastive_term, (global_params, _vector(start, 0.05, 10 + k))))
        for k in range(4)
    ]
    objectives[1] = dataclasses.replace(
        objectives[1], correction=GradientCorrection(linear=_vector(start, 0.05, 5) - start)
    )
    return objectives


def _step_objectives(start: torch.Tensor) -> list:
    """Client momentum with different β and non-zero starting buffers; one client also has a quadratic correction."""
    objectives = [
        LocalObjective(local_step=LocalStep(heavy_ball(0.5 + 0.1 * k), (_vector(start, 0.01, 20 + k) - start,)))
        for k in range(4)
    ]
    objectives[2] = dataclasses.replace(
        objectives[2], correction=GradientCorrection(quadratic=0.2, reference=_vector(start, 0.01, 6))
    )
    return objectives


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("clip_norm", [None, 0.5], ids=["noclip", "clip"])
@pytest.mark.parametrize("kind", ["term", "step", "term_and_step"])
def test_the_vectorized_backend_agrees_with_the_sequential_one(model_name, clip_norm, kind):
    model, data = _model(model_name), _data()
    start = model.initial_parameters()
    if kind == "term":
        objectives = _term_objectives(start)
    elif kind == "step":
        objectives = _step_objectives(start)
    else:
        objectives = [
            dataclasses.replace(t, local_step=s.local_step)
            for t, s in zip(_term_objectives(start), _step_objectives(start), strict=True)
        ]
    tasks = _tasks(objectives)
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=clip_norm)
    expected = _run(SequentialBackend(), model, start, tasks, settings, data)
    assert len({done for _, done in expected.values()}) > 1  # unequal step counts
    _assert_agree(expected, _run(VectorizedBackend(), model, start, tasks, settings, data))


def test_a_round_mixing_affine_term_and_step_clients_agrees_in_any_chunking():
    model, data = _model("mlp"), _data()
    start = model.initial_parameters()
    objectives = [
        GradientCorrection(linear=_vector(start, 0.05, 7) - start),
        _term_objectives(start)[1],
        _step_objectives(start)[2],
        NO_CORRECTION,
    ]
    tasks = _tasks(objectives)
    settings = LocalSettings(client_lr=0.1, clip_norm=0.5)
    expected = _run(SequentialBackend(), model, start, tasks, settings, data)
    for backend in (
        VectorizedBackend(),
        VectorizedBackend(max_chunk_clients=1),
        VectorizedBackend(batched_layers=False, parallel_chunks=False),
    ):
        _assert_agree(expected, _run(backend, model, start, tasks, settings, data))


def test_gamma_inexact_stopping_counts_the_loss_term_on_both_backends():
    model, data = _model("mlp"), _data()
    start = model.initial_parameters()
    anchor = _vector(start, 0.01, 3)
    term = LossTerm(proximal_term, (anchor, torch.tensor(0.5, dtype=DTYPE)))
    settings = LocalSettings(client_lr=0.3)
    with_term = _tasks([LocalObjective(loss_term=term)] * 4, epochs=6, stop_gamma=0.9)
    with_correction = [
        dataclasses.replace(task, correction=GradientCorrection(quadratic=0.5, reference=anchor)) for task in with_term
    ]
    expected = _run(SequentialBackend(), model, start, with_term, settings, data)
    assert any(
        done < task.num_steps for (_, done), task in zip(expected.values(), with_term, strict=True)
    )  # some client did stop early
    _assert_agree(expected, _run(VectorizedBackend(), model, start, with_term, settings, data))
    # The term's full gradient is the correction's: the same clients stop at the same steps.
    _assert_agree(expected, _run(SequentialBackend(), model, start, with_correction, settings, data))


def test_a_loss_term_vmap_cannot_handle_trains_sequentially_with_a_warning(caplog):
    def branching_term(batch: LocalBatch, anchor: torch.Tensor) -> torch.Tensor:
        distance = torch.sum((batch.params - anchor) ** 2)
        return distance if distance > 0 else 0 * distance  # a Python branch on a tensor: not vmappable

    model, data = _model("mlp"), _data()
    start = model.initial_parameters()
    tasks = _tasks([LocalObjective(loss_term=LossTerm(branching_term, (_vector(start, 0.01, 8),)))] * 4)
    settings = LocalSettings(client_lr=0.1)
    expected = _run(SequentialBackend(), model, start, tasks, settings, data)
    with caplog.at_level("WARNING", logger="driftlab.simulation.backends.vectorized"):
        actual = _run(VectorizedBackend(), model, start, tasks, settings, data, fallback_expected=True)
    assert "branching_term" in caplog.text and "cannot be vmapped" in caplog.text
    for position, (params, done) in expected.items():
        assert actual[position][1] == done and torch.equal(actual[position][0], params)
