"""Reduced-precision local steps: bf16 on both backends, float32 state and aggregation, tf32 refused off CUDA."""

from __future__ import annotations

import pytest
import torch

import driftlab
from driftlab.experiments.config import ConfigError
from driftlab.models import build_model
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import (
    ClientTask,
    LocalSettings,
    SequentialBackend,
    TrainingData,
    batch_plan,
)
from driftlab.simulation.backends.precision import PRECISIONS, check_precision, local_arithmetic, parameter_dtype
from driftlab.simulation.backends.vectorized import VectorizedBackend
from driftlab.simulation.seam import NO_CORRECTION

CPU = torch.device("cpu")


def test_parameters_are_float64_only_under_float64():
    assert parameter_dtype("float64") == torch.float64
    assert {parameter_dtype(p) for p in PRECISIONS if p != "float64"} == {torch.float32}
    with pytest.raises(ValueError, match="precision must be one of"):
        parameter_dtype("fp16")


def test_tf32_is_refused_off_cuda_with_the_way_out():
    message = check_precision("tf32", CPU)
    assert "needs a CUDA device" in message and "precision=bf16" in message
    assert check_precision("bf16", CPU) is None and check_precision("float32", CPU) is None
    with pytest.raises(ConfigError, match="precision=tf32 needs a CUDA device"):
        driftlab.run(None, overrides=["precision=tf32", "rounds=1", "data.num_clients=4"])


def test_bf16_autocasts_products_and_float32_leaves_them_alone():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with local_arithmetic("bf16", CPU):
        assert (a @ b).dtype == torch.bfloat16
    with local_arithmetic("float32", CPU):
        assert (a @ b).dtype == torch.float32
    assert (a @ b).dtype == torch.float32  # nothing leaks out of the context


def test_tf32_flags_are_restored_after_local_steps():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with local_arithmetic("tf32", torch.device("cuda")):  # only flags: no CUDA work is done here
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    with local_arithmetic("float32", torch.device("cuda")):
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def _cnn_round():
    torch.manual_seed(0)
    model = FlatModel.wrap(build_model("cnn", (3, 16, 16), 5))
    generator = torch.Generator().manual_seed(1)
    data = TrainingData(
        torch.randn(24, 3, 16, 16, generator=generator), torch.randint(0, 5, (24,), generator=generator)
    )
    start = model.initial_parameters()
    # One step each: over several steps float32 and bf16 trajectories drift apart on random data, so compare one gradient.
    tasks = [
        ClientTask(k, torch.arange(8 * k, 8 * k + 8), batch_plan(0, 1, k, 8, 4, 1), NO_CORRECTION) for k in range(3)
    ]
    return model, start, tasks, LocalSettings(client_lr=0.1), data


def _train(backend, model, start, tasks, settings, data) -> dict[int, torch.Tensor]:
    return {p: theta.clone() for p, theta, _ in backend.train(model, start, tasks, settings, data)}


@pytest.mark.parametrize("backend_class", [SequentialBackend, VectorizedBackend])
def test_bf16_local_steps_keep_float32_parameters_and_stay_near_float32(backend_class):
    model, start, tasks, settings, data = _cnn_round()
    full = _train(backend_class(), model, start, tasks, settings, data)
    reduced = _train(backend_class(precision="bf16"), model, start, tasks, settings, data)
    for position in full:
        assert reduced[position].dtype == torch.float32
        assert not torch.equal(reduced[position], full[position])  # bf16 did change the arithmetic
        step_full, step_reduced = full[position] - start, reduced[position] - start
        # bf16 keeps 8 bits of mantissa: the step agrees to several percent.
        assert torch.linalg.vector_norm(step_reduced - step_full) < 0.1 * torch.linalg.vector_norm(step_full)


def test_bf16_is_the_same_on_both_backends_to_bf16_rounding():
    model, start, tasks, settings, data = _cnn_round()
    sequential = _train(SequentialBackend(precision="bf16"), model, start, tasks, settings, data)
    vectorized = _train(VectorizedBackend(precision="bf16"), model, start, tasks, settings, data)
    for position in sequential:
        step = sequential[position] - start
        assert torch.linalg.vector_norm(vectorized[position] - sequential[position]) < 0.1 * torch.linalg.vector_norm(
            step
        )


def test_a_bf16_run_aggregates_in_float32_and_is_repeatable():
    overrides = ["precision=bf16", "rounds=2", "data.num_clients=4", "client.epochs=1"]
    first, second = driftlab.run(None, overrides=overrides), driftlab.run(None, overrides=overrides)
    assert first.final_params.dtype == torch.float32
    assert torch.equal(first.final_params, second.final_params)
    plain = driftlab.run(None, overrides=[o for o in overrides if not o.startswith("precision")])
    assert not torch.equal(first.final_params, plain.final_params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["float32", "tf32", "bf16"])
def test_on_cuda_each_precision_trains_near_the_cpu_float32_round(precision):
    model, start, tasks, settings, data = _cnn_round()
    expected = _train(VectorizedBackend(), model, start, tasks, settings, data)
    cuda = torch.device("cuda")
    model.to(cuda, torch.float32)
    moved = [ClientTask(t.client_id, t.sample_indices.to(cuda), t.batches, t.correction) for t in tasks]
    data_cuda = TrainingData(data.inputs.to(cuda), data.targets.to(cuda))
    actual = _train(VectorizedBackend(precision=precision), model, start.to(cuda), moved, settings, data_cuda)
    tolerance = 1e-4 if precision == "float32" else 0.1
    for position, theta in expected.items():
        step = theta - start
        assert torch.linalg.vector_norm(actual[position].cpu() - theta) <= tolerance * torch.linalg.vector_norm(step)
