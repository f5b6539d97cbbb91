"""The vectorized backend against the sequential reference: same clients, same batches, same start → same models.

Agreement is to fp32 rounding in float32 and to 1e-12 in float64 (the
operations differ only in summation order), after a full round of unequal
clients: different sample counts (short, padded last batches), different step
counts, clipping, weight decay and every kind of gradient correction.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from torch import nn

import driftlab
from driftlab.algorithms.registry import BUILT_IN
from driftlab.models import build_model
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import ClientTask, LocalSettings, SequentialBackend, TrainingData
from driftlab.simulation.backends.objectives import LocalObjective, LocalStep, LossTerm
from driftlab.simulation.backends.testing import client_tasks
from driftlab.simulation.backends.vectorized import LinearReluStack, VectorizedBackend
from driftlab.simulation.seam import NO_CORRECTION, GradientCorrection
from driftlab.simulation.state.memory_budget import MemoryBudget

# float32: a few ulps of parameters of size ~0.1 after tens of steps; float64: the 1e-12.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=2e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}
CLIENT_SIZES = (37, 50, 120, 7, 64, 23)  # 7 < B: a client whose batches are narrower than B
BATCH_SIZE = 10
CORRECTION_KINDS = ("none", "linear", "quadratic_scalar", "quadratic_tensor", "mixed")


def _model(name: str, dtype: torch.dtype, seed: int = 0) -> FlatModel:
    torch.manual_seed(seed)
    if name == "conv":  # not a Linear/ReLU stack: exercises the vmap path
        module = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 6 * 6, 10))
    else:
        module = build_model(name, (1, 8, 8), 10, hidden=(16, 12))
    return FlatModel.wrap(module).to("cpu", dtype)


def _data(dtype: torch.dtype) -> TrainingData:
    generator = torch.Generator().manual_seed(1)
    n = sum(CLIENT_SIZES) + 5
    return TrainingData(
        torch.randn(n, 1, 8, 8, generator=generator, dtype=dtype), torch.randint(0, 10, (n,), generator=generator)
    )


def _corrections(kind: str, start: torch.Tensor) -> list[GradientCorrection]:
    generator = torch.Generator().manual_seed(2)
    p, dtype = start.numel(), start.dtype

    def vector(scale: float) -> torch.Tensor:
        return (torch.randn(p, generator=generator, dtype=torch.float64) * scale).to(dtype)

    count = len(CLIENT_SIZES)
    if kind == "none":
        return [NO_CORRECTION] * count
    if kind == "linear":  # SCAFFOLD / AdaBest
        return [GradientCorrection(linear=vector(0.05)) for _ in range(count)]
    if kind == "quadratic_scalar":  # FedProx: a number and one shared reference
        reference = start + vector(0.01)
        return [GradientCorrection(quadratic=0.3 + 0.1 * k, reference=reference) for k in range(count)]
    if kind == "quadratic_tensor":  # EFL-like D_k ⊙ (θ − θ_ref) with per-client references
        return [GradientCorrection(quadratic=vector(0.2).abs(), reference=start + vector(0.01)) for _ in range(count)]
    # mixed: some clients have no correction, others linear, scalar or tensor quadratics (FedDyn: both)
    return [
        NO_CORRECTION,
        GradientCorrection(linear=vector(0.05)),
        GradientCorrection(quadratic=0.5, reference=start),
        GradientCorrection(linear=vector(0.05), quadratic=vector(0.2).abs(), reference=start + vector(0.01)),
        NO_CORRECTION,
        GradientCorrection(linear=vector(0.05), quadratic=0.1, reference=start),
    ]


def _tasks(
    corrections: list[GradientCorrection],
    fixed_steps: dict[int, int] | None = None,
    epochs: int = 2,
    stop_gamma: float | None = None,
) -> list[ClientTask]:
    """Clients with unequal sizes; ``epochs`` each (unequal step counts) unless ``fixed_steps`` overrides."""
    return client_tasks(
        CLIENT_SIZES,
        BATCH_SIZE,
        7,
        corrections,
        steps=lambda client_id, per_epoch: (fixed_steps or {}).get(client_id, epochs * per_epoch),
        first_row=5,
        shuffled=True,
        stop_gamma=stop_gamma,
    )


def run_backend(backend, model, start, tasks, settings, data) -> dict[int, tuple[torch.Tensor, int]]:
    """Train ``tasks`` on ``backend``: {task position: (final parameters, steps done)}, every task answered once.

    Shared with augmentation_test.py."""
    results = {
        position: (params.clone(), done)
        for position, params, done in backend.train(model, start, tasks, settings, data)
    }
    assert sorted(results) == list(range(len(tasks)))
    return results


def assert_agree(expected: dict, actual: dict, dtype: torch.dtype) -> None:
    """The same steps done and the same parameters up to ``dtype``'s TOLERANCE, task by task."""
    for position, (params, done) in expected.items():
        assert actual[position][1] == done
        torch.testing.assert_close(actual[position][0], params, **TOLERANCE[dtype])


# ------------------------------------------------------------------ one round against the sequential backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("model_name", ["mlr", "mlp"])
@pytest.mark.parametrize("kind", CORRECTION_KINDS)
@pytest.mark.parametrize("clip_norm", [None, 0.5], ids=["noclip", "clip"])
def test_a_round_matches_the_sequential_backend(dtype, model_name, kind, clip_norm):
    model, data = _model(model_name, dtype), _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks(_corrections(kind, start), fixed_steps={2: 3, 4: 1})  # two clients stop early (incomplete work)
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=clip_norm)
    expected = run_backend(SequentialBackend(), model, start, tasks, settings, data)
    assert_agree(expected, run_backend(VectorizedBackend(), model, start, tasks, settings, data), dtype)


@pytest.mark.parametrize("model_name", ["mlp", "conv"])
@pytest.mark.parametrize("clip_norm", [None, 0.5], ids=["noclip", "clip"])
def test_the_vmap_path_matches_the_sequential_backend(model_name, clip_norm, caplog):
    dtype = torch.float64
    model, data = _model(model_name, dtype), _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks(_corrections("mixed", start))
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=clip_norm)
    expected = run_backend(SequentialBackend(), model, start, tasks, settings, data)
    with caplog.at_level(logging.WARNING, logger="driftlab.simulation.backends.vectorized"):
        assert_agree(
            expected, run_backend(VectorizedBackend(batched_layers=False), model, start, tasks, settings, data), dtype
        )
    assert "cannot be vmapped" not in caplog.text  # the vmap path really ran (its sequential fallback would agree too)


def test_without_corrections_or_weight_decay_the_step_is_plain_sgd():
    dtype = torch.float64
    model, data = _model("mlp", dtype), _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks(_corrections("none", start))
    settings = LocalSettings(client_lr=0.05)
    assert_agree(
        run_backend(SequentialBackend(), model, start, tasks, settings, data),
        run_backend(VectorizedBackend(), model, start, tasks, settings, data),
        dtype,
    )


# ------------------------------------------------------------------ chunks, early stopping, fallback


@pytest.mark.parametrize("clip_norm", [None, 0.5], ids=["noclip", "clip"])
def test_many_small_chunks_give_the_same_models_as_one_chunk(clip_norm):
    dtype = torch.float64
    model, data = _model("mlp", dtype), _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks(_corrections("mixed", start))
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=clip_norm)
    one_chunk = VectorizedBackend(max_chunk_clients=len(tasks), parallel_chunks=False)
    tiny_budget = VectorizedBackend(
        memory_budget_bytes=1
    )  # forces one client per chunk, chunks run in parallel threads
    assert one_chunk.chunk_size(LinearReluStack.match(model), model, start, tasks, data) == len(tasks)
    assert tiny_budget.chunk_size(LinearReluStack.match(model), model, start, tasks, data) == 1
    assert_agree(
        run_backend(one_chunk, model, start, tasks, settings, data),
        run_backend(tiny_budget, model, start, tasks, settings, data),
        dtype,
    )


@pytest.mark.parametrize("objective", ["affine", "term"])
def test_vmapped_chunks_on_parallel_threads_give_the_models_of_one_chunk(objective, caplog):
    dtype = torch.float64
    model, data = _model("conv", dtype), _data(dtype)
    start = model.initial_parameters()
    corrections = _corrections("mixed", start)
    if objective == "term":
        corrections = [
            LocalObjective(c, loss_term=LossTerm(_output_norm_term, (start + 0.01 * k,)))
            for k, c in enumerate(corrections)
        ]
    tasks = _tasks(corrections)
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=0.5)
    one_chunk = VectorizedBackend(batched_layers=False, max_chunk_clients=len(tasks), parallel_chunks=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parallel = VectorizedBackend(
            batched_layers=False, max_chunk_clients=2
        )  # three chunks on two single-threaded workers
        assert parallel.workers(start, len(tasks)) == 2
        with caplog.at_level(logging.WARNING, logger="driftlab.simulation.backends.vectorized"):
            assert_agree(
                run_backend(one_chunk, model, start, tasks, settings, data),
                run_backend(parallel, model, start, tasks, settings, data),
                dtype,
            )
        assert "cannot be vmapped" not in caplog.text  # the vmap path really ran (its fallback would agree too)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_gamma_inexact_clients_stop_at_the_same_step_as_sequentially():
    dtype = torch.float64
    model, data = _model("mlr", dtype), _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks(_corrections("quadratic_scalar", start), epochs=6, stop_gamma=0.9)
    settings = LocalSettings(client_lr=0.3)
    expected = run_backend(SequentialBackend(), model, start, tasks, settings, data)
    assert any(
        done < task.num_steps for (_, done), task in zip(expected.values(), tasks, strict=True)
    )  # some client did stop early
    assert_agree(expected, run_backend(VectorizedBackend(), model, start, tasks, settings, data), dtype)


class _DataDependentBranch(nn.Module):
    """Python control flow on tensor values: ``vmap`` cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = self.linear(inputs.flatten(1))
        return outputs * 2 if outputs.sum() > 0 else outputs


def test_a_module_vmap_cannot_handle_falls_back_to_sequential_with_a_warning(caplog):
    dtype = torch.float64
    torch.manual_seed(0)
    model, data = FlatModel.wrap(_DataDependentBranch()).to("cpu", dtype), _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks(_corrections("linear", start))
    settings = LocalSettings(client_lr=0.1)
    with caplog.at_level(logging.WARNING, logger="driftlab.simulation.backends.vectorized"):
        actual = run_backend(VectorizedBackend(), model, start, tasks, settings, data)
    assert any("sequential" in record.getMessage() for record in caplog.records)
    expected = run_backend(SequentialBackend(), model, start, tasks, settings, data)
    for position, (params, done) in expected.items():
        assert torch.equal(actual[position][0], params) and actual[position][1] == done


# ------------------------------------------------------------------ non-affine objectives (objectives.py; more in objectives_test.py)


def _output_norm_term(batch, reference):
    """A loss term on the model's outputs, the (augmented) inputs and θ, with a per-client tensor."""
    return 0.1 * (
        batch.weights * (batch.outputs.pow(2).sum(dim=1) + batch.inputs.flatten(1).mean(dim=1))
    ).sum() + 0.05 * torch.sum((batch.params - reference) ** 2)


def _momentum(params, gradient, state, learning_rate):
    (velocity,) = state
    velocity = 0.8 * velocity + gradient
    return params - learning_rate * velocity, (velocity,)


def _scale_by_key(inputs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A toy augmentation: each example depends on its own input and key only."""
    return inputs * (1 + 0.1 * (keys % 3).to(inputs.dtype).view(-1, *[1] * (inputs.dim() - 1)))


@pytest.mark.parametrize("model_name", ["mlp", "conv"])
def test_loss_terms_and_local_steps_see_augmented_batches_as_sequentially(model_name):
    dtype = torch.float64
    model, data = _model(model_name, dtype), dataclasses.replace(_data(dtype), augment=_scale_by_key)
    start = model.initial_parameters()
    references = [start + 0.01 * k for k in range(len(CLIENT_SIZES))]
    objectives = [
        LocalObjective(
            loss_term=LossTerm(_output_norm_term, (references[k],)),
            local_step=LocalStep(_momentum, (torch.zeros_like(start),)) if k % 2 else None,
        )
        for k in range(len(CLIENT_SIZES))
    ]
    tasks = [
        dataclasses.replace(task, augment_key=1000 + task.client_id) for task in _tasks(objectives, fixed_steps={2: 3})
    ]
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=0.5)
    assert_agree(
        run_backend(SequentialBackend(), model, start, tasks, settings, data),
        run_backend(VectorizedBackend(), model, start, tasks, settings, data),
        dtype,
    )


def test_bare_terms_steps_and_affine_local_objectives_are_accepted_and_affine_ones_take_the_affine_path():
    dtype = torch.float64
    model, data = _model("mlp", dtype), _data(dtype)
    start = model.initial_parameters()
    corrections = _corrections("mixed", start)
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01)
    affine = run_backend(VectorizedBackend(), model, start, _tasks(corrections), settings, data)
    wrapped = run_backend(
        VectorizedBackend(), model, start, _tasks([LocalObjective(correction=c) for c in corrections]), settings, data
    )
    for position, (params, done) in affine.items():  # the same fused Linear/ReLU path, bit for bit
        assert wrapped[position][1] == done and torch.equal(wrapped[position][0], params)
    bare = [LossTerm(_output_norm_term, (start,)), LocalStep(_momentum, (torch.zeros_like(start),))] * 3
    assert_agree(
        run_backend(SequentialBackend(), model, start, _tasks(bare), settings, data),
        run_backend(VectorizedBackend(), model, start, _tasks(bare), settings, data),
        dtype,
    )


# ------------------------------------------------------------------ end to end, every algorithm


# MimeLite and Mime add the frozen server momentum β·m to each of a client's ~280 local steps here: at lr 0.05 the model
# blows up in round 2 (norm 3.7 → 139), and the backends' rounding differences grow with it. Even at lr 0.005 Mime's
# train loss jumps 8-fold in round 2 (0.39 → 3.02), which amplifies the differences 10,000-fold (4e-16 after round 1,
# 4e-12 after round 2; 1e-11 with AVX2 kernels): the comparison would then measure the instability, not the backends.
# At lr 0.002 they stay at one round's rounding (at most 7e-16 for Mime and 2e-14 for MimeLite, with AVX-512 and AVX2
# kernels alike), so the 1e-12 tolerance below leaves a margin of 50x or more on any machine.
STABLE = {
    "mimelite": ("client.lr=0.002", "algorithm.momentum=0.5"),
    "mime": ("client.lr=0.002", "algorithm.momentum=0.5"),
}


def _end_to_end(algorithm: str, backend: str, extra: tuple[str, ...] = ()):
    overrides = [
        "rounds=3",
        "seed=5",
        "precision=float64",
        f"backend={backend}",
        f"algorithm.name={algorithm}",
        "data.num_clients=8",
        "sampling.participation=0.5",
        "model.name=mlp",
        "model.hidden=[16]",
        "client.lr=0.05",
        "client.batch_size=7",
        "client.epochs=2",
        *STABLE.get(algorithm, ()),
        *extra,
    ]
    return driftlab.run(None, overrides=overrides)


@pytest.mark.parametrize("algorithm", sorted(BUILT_IN))
def test_every_algorithm_ends_with_the_same_model_on_both_backends(algorithm):
    sequential = _end_to_end(algorithm, "sequential")
    vectorized = _end_to_end(algorithm, "vectorized")
    torch.testing.assert_close(vectorized.final_params, sequential.final_params, rtol=1e-12, atol=1e-12)
    assert [r["local_steps"] for r in vectorized.records] == [r["local_steps"] for r in sequential.records]


@pytest.mark.parametrize("algorithm", sorted(BUILT_IN))
def test_every_algorithm_agrees_with_clipping_weight_decay_and_stragglers(algorithm):
    extra = ("client.clip_norm=1.0", "client.weight_decay=0.001", "availability.incomplete_probability=0.5")
    sequential = _end_to_end(algorithm, "sequential", extra)
    vectorized = _end_to_end(algorithm, "vectorized", extra)
    torch.testing.assert_close(vectorized.final_params, sequential.final_params, rtol=1e-12, atol=1e-12)


def test_auto_backend_follows_the_rule_for_the_model_and_is_recorded():
    from driftlab.experiments.run.runner import build_simulation

    sim, _ = build_simulation(driftlab.load_config(None, ["backend=auto", "data.num_clients=4"]))
    assert isinstance(sim.backend, VectorizedBackend)  # the default MLP has batched layers
    assert driftlab.load_config(None).backend == "auto"
    assert np.isfinite(_end_to_end("fedavg", "auto").final_params.numpy()).all()

    def tanh(shape, classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(shape)), 8), nn.Tanh(), nn.Linear(8, classes))

    sim, _ = build_simulation(driftlab.load_config(None, ["backend=auto", "data.num_clients=4"]), model=tanh)
    assert isinstance(sim.backend, SequentialBackend)  # vmap would be slower on a CPU


def test_run_json_records_the_backend_auto_chose(tmp_path):
    import json

    driftlab.run(None, overrides=["rounds=1", "data.num_clients=4"], out_dir=tmp_path / "run")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["machine"]["backend"] == "vectorized"


def test_two_devices_give_the_same_models_as_one_and_reruns_are_bit_identical():
    dtype = torch.float32
    model, data = _model("mlp", dtype), _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks(_corrections("mixed", start))
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01)
    one = run_backend(VectorizedBackend(max_chunk_clients=2), model, start, tasks, settings, data)
    two = run_backend(
        VectorizedBackend(max_chunk_clients=2, devices=["cpu", "cpu"]), model, start, tasks, settings, data
    )
    again = run_backend(
        VectorizedBackend(max_chunk_clients=2, devices=["cpu", "cpu"]), model, start, tasks, settings, data
    )
    for position in one:
        assert torch.equal(one[position][0], two[position][0]) and torch.equal(two[position][0], again[position][0])


def test_the_chunk_budget_comes_from_the_runs_memory_budget(monkeypatch):
    # A GPU measured now (no budget measured it): 80% of its memory split between the runs sharing it, capped by 80%
    # of what was free.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70_000_000, 80_000_000))
    assert VectorizedBackend().budget_bytes(torch.device("cuda:0")) == 56_000_000  # alone: 80% of the free 70 MB
    shared = VectorizedBackend(memory_budget=MemoryBudget(gpu_share=2))
    assert shared.budget_bytes(torch.device("cuda:0")) == 32_000_000  # one of two runs: 80% of 80 MB, halved
    assert VectorizedBackend(memory_budget_bytes=123).budget_bytes(torch.device("cuda:0")) == 123
    # On a CPU the chunks work inside the round's share: an eighth of a configured budget, else 1 GiB.
    assert VectorizedBackend().budget_bytes(torch.device("cpu")) == 1 << 30
    assert VectorizedBackend(memory_budget=MemoryBudget(80_000_000)).budget_bytes(torch.device("cpu")) == 10_000_000


# ------------------------------------------------------------------ with top-k compression
#
# Top-k keeps the k largest |entries|: where two entries are within a rounding of each other, a
# difference of one ulp between the backends picks a different entry, and the models then differ by
# a whole entry (about the size of the weights), not by a rounding. So with compression on the
# backends cannot agree to rounding; what holds is pinned here: agreement up to the compressor,
# and each backend bit-exact on its own.

EFL_TINY = (
    "rounds=3",
    "seed=5",
    "algorithm.name=efl",
    "compression.ratio=0.05",
    "data.num_clients=6",
    "sampling.participation=0.5",
    "client.steps=3",
    "client.lr=0.05",
    "evaluation.every=100",
)


def test_one_ulp_of_difference_can_flip_a_top_k_pick_by_a_whole_entry():
    from driftlab.compress.ternary import sparse_ternary

    large = torch.tensor(0.30, dtype=torch.float32)
    smaller = torch.nextafter(large, torch.tensor(0.0))  # one ulp below
    first = torch.tensor([large, -smaller, 0.01, 0.02])
    second = torch.tensor([smaller, -large, 0.01, 0.02])  # each entry within one ulp of ``first``'s
    picked_first, picked_second = sparse_ternary(first, 0.25), sparse_ternary(second, 0.25)
    assert (picked_first != 0).tolist() == [True, False, False, False]
    assert (picked_second != 0).tolist() == [False, True, False, False]
    assert float((picked_first - picked_second).abs().max()) == pytest.approx(0.30, rel=1e-6)


def _first_round_uploads(backend: str, precision: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(Δ_k before compression, what was sent) for each client of round 1 of ``EFL_TINY``, by client id."""
    from driftlab.experiments.run.runner import build_simulation
    from driftlab.simulation.round.engine import run_round

    sim, state = build_simulation(
        driftlab.load_config(None, [*EFL_TINY, f"backend={backend}", f"precision={precision}"])
    )
    finish, uploads = sim.algorithm.client_finish, {}

    def recording_finish(server, client, context, update):
        new_client, message = finish(server, client, context, update)
        uploads[context.client_id] = (
            update.final_params - update.start_params,
            message.payload.params - update.start_params,
        )
        return new_client, message

    sim.algorithm = dataclasses.replace(sim.algorithm, client_finish=recording_finish)
    run_round(sim, state)
    return [uploads[client_id] for client_id in sorted(uploads)]


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_with_compression_the_first_rounds_updates_agree_to_rounding_before_the_compressor(precision):
    tolerance = TOLERANCE[torch.float64 if precision == "float64" else torch.float32]
    sequential = _first_round_uploads("sequential", precision)
    vectorized = _first_round_uploads("vectorized", precision)
    assert len(sequential) == len(vectorized) == 3
    for (delta_s, sent_s), (delta_v, sent_v) in zip(sequential, vectorized, strict=True):
        assert float(delta_s.abs().max()) > 1e-3  # the clients really trained
        torch.testing.assert_close(delta_v, delta_s, **tolerance)
        for sent in (sent_s, sent_v):  # and what they sent really was top-k compressed
            assert int((sent != 0).sum()) < delta_s.numel() // 10


def test_with_compression_off_efl_ends_with_the_same_model_on_both_backends():
    uncompressed = [*EFL_TINY, "compression.ratio=1", "precision=float64"]
    sequential = driftlab.run(None, overrides=[*uncompressed, "backend=sequential"])
    vectorized = driftlab.run(None, overrides=[*uncompressed, "backend=vectorized"])
    torch.testing.assert_close(vectorized.final_params, sequential.final_params, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_with_compression_each_backend_is_bit_exact_from_run_to_run(backend):
    first = driftlab.run(None, overrides=[*EFL_TINY, f"backend={backend}"])
    second = driftlab.run(None, overrides=[*EFL_TINY, f"backend={backend}"])
    assert first.final_params.dtype == torch.float32
    assert torch.equal(first.final_params, second.final_params)
    strip = lambda records: [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]  # noqa: E731
    assert strip(first.records) == strip(second.records)


def test_several_devices_must_be_distinct_gpus_and_available():
    from driftlab.experiments.config import ConfigError

    assert driftlab.load_config(None, ["device=cuda:0,cuda:1"]).device == "cuda:0,cuda:1"
    for bad in ("cuda:0,cuda:0", "cpu,cuda:0", "cuda:0,"):
        with pytest.raises(ConfigError, match="distinct GPUs written cuda:N"):
            driftlab.load_config(None, [f"device={bad}"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            driftlab.run(None, overrides=["device=cuda:0,cuda:1", "rounds=1", "data.num_clients=4"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model_name", ["mlp", "conv"])
def test_a_cuda_round_has_no_host_syncs_and_matches_the_cpu(model_name):
    cuda = torch.device("cuda")
    model, data = _model(model_name, torch.float32), _data(torch.float32)
    start = model.initial_parameters()
    tasks = _tasks(_corrections("mixed", start))
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01)
    expected = run_backend(VectorizedBackend(), model, start, tasks, settings, data)
    model.to(cuda, torch.float32)

    def on_cuda(value):
        return value.to(cuda) if isinstance(value, torch.Tensor) else value

    moved = [
        dataclasses.replace(
            t,
            sample_indices=t.sample_indices.to(cuda),
            correction=GradientCorrection(
                *(on_cuda(getattr(t.correction, f)) for f in ("linear", "quadratic", "reference"))
            ),
        )
        for t in tasks
    ]
    data_cuda = TrainingData(data.inputs.to(cuda), data.targets.to(cuda))
    backend = VectorizedBackend()
    start_cuda = start.to(cuda)  # a copy from pageable host memory synchronises: made before the checked region
    run_backend(
        backend, model, start_cuda, moved, settings, data_cuda
    )  # warm-up: engine choice and vmap probe may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        actual = {p: (t, d) for p, t, d in backend.train(model, start_cuda, moved, settings, data_cuda)}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for position, (theta, done) in expected.items():
        assert actual[position][1] == done
        torch.testing.assert_close(actual[position][0].cpu(), theta, rtol=1e-4, atol=1e-5)
