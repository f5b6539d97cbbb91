"""Whole runs on a GPU: every registered algorithm and every feature that moves tensors, with ``device=cuda``.

CUDA only (CI has no GPU: every test here skips without one; their CPU twins are the
per-feature tests, which run the same configs on the CPU).  ``benchmarks/gpu_check.py``
runs this file on the device machine.  Each case checks what a user meets first on
a GPU: the run finishes, its numbers are finite, it repeats bit for bit on the same
GPU (the determinism driftlab promises for a fixed device layout), and it lands
near the same run on the CPU (float32 on both: the GPU's kernels add and reduce in
other orders, so the models agree to rounding grown over a few rounds, not exactly).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import driftlab
from driftlab.algorithms.registry import BUILT_IN

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY = [
    "rounds=3",
    "data.num_clients=8",
    "sampling.participation=0.5",
    "client.epochs=1",
    "evaluation.every=1",
    "seed=2",
]
# A few rounds of float32 on another device: the models differ by accumulated rounding only.
RELATIVE_TOLERANCE = 1e-3

# Per feature, overrides added to TINY: the paths that place tensors on the run's device (or must not).
FEATURES: dict[str, list[str]] = {
    "sequential": ["backend=sequential"],
    "vectorized": ["backend=vectorized"],
    "privacy": [
        "algorithm.aggregation=uniform",
        "privacy.clip=1",
        "privacy.noise_multiplier=1",
        "privacy.delta=1e-3",
        "sampling.mode=poisson",
    ],
    "compression": ["compression.ratio=0.2"],
    "dropouts": ["availability.inactive_probability=0.25", "availability.incomplete_probability=0.5"],
    "system-time": ["system.speed_median=50"],
    "asynchronous": [
        "system.profiles=lognormal",
        "asynchronous.concurrency=4",
        "asynchronous.buffer=2",
        "algorithm.aggregation=uniform",
    ],
    "disk-state": ["algorithm.name=scaffold", "state.store=disk"],
    "personal": ["algorithm.name=ditto", "algorithm.lam=0.5", "evaluation.personal=true"],
    "finetune": ["evaluation.personal=true", "evaluation.finetune_steps=2"],
    "validation": ["data.validation_fraction=0.2"],
    "all-clients-mean": ["algorithm.name=feddyn", "evaluation.model=all_clients_mean"],
}


def _run(overrides: list[str], out: Path | None = None, resume: bool = False) -> driftlab.RunResult:
    return driftlab.run(None, out, overrides=overrides, resume=resume)


def _without_wall_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]


def _check_against_cpu(overrides: list[str]) -> None:
    on_gpu = _run([*overrides, "device=cuda"])
    again = _run([*overrides, "device=cuda"])
    on_cpu = _run([*overrides, "device=cpu"])
    gpu, cpu = on_gpu.final_params.detach().cpu(), on_cpu.final_params.detach().cpu()
    assert torch.isfinite(gpu).all()
    assert torch.equal(gpu, again.final_params.detach().cpu()), "two runs on one GPU differ"
    assert _without_wall_time(on_gpu.records) == _without_wall_time(again.records)
    distance = torch.linalg.vector_norm(gpu - cpu) / torch.linalg.vector_norm(cpu)
    assert distance <= RELATIVE_TOLERANCE, f"GPU and CPU models differ by {distance:.2e} (relative)"
    assert [r["round"] for r in on_gpu.records] == [r["round"] for r in on_cpu.records]
    for key in ("test_accuracy", "train_loss"):
        gpu_values = [r[key] for r in on_gpu.records if key in r]
        assert all(math.isfinite(v) for v in gpu_values), key


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_every_algorithm_runs_on_a_gpu_as_on_the_cpu(name: str) -> None:
    _check_against_cpu([*TINY, f"algorithm.name={name}"])


@pytest.mark.slow
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_every_feature_runs_on_a_gpu_as_on_the_cpu(feature: str) -> None:
    _check_against_cpu([*TINY, *FEATURES[feature]])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_reduced_precision_runs_on_a_gpu_and_repeats(precision: str) -> None:
    overrides = [*TINY, "backend=vectorized", f"precision={precision}", "device=cuda"]
    first, second = _run(overrides), _run(overrides)
    assert torch.isfinite(first.final_params).all()
    assert torch.equal(first.final_params.cpu(), second.final_params.cpu())


@pytest.mark.slow
def test_a_gpu_run_resumes_exactly(tmp_path: Path) -> None:
    overrides = [*TINY, "algorithm.name=scaffold", "device=cuda", "checkpoint_every=1", "keep_checkpoint=true"]
    straight = _run([*overrides, "rounds=4"], tmp_path / "straight")
    _run([*overrides, "rounds=2"], tmp_path / "resumed")
    resumed = _run([*overrides, "rounds=4"], tmp_path / "resumed", resume=True)
    assert torch.equal(straight.final_params.cpu(), resumed.final_params.cpu())
    assert _without_wall_time(straight.records) == _without_wall_time(resumed.records)


@pytest.mark.slow
def test_unfold_convolutions_train_a_cnn_on_a_gpu_as_grouped_ones_do_and_repeat() -> None:
    # convolution=unfold (im2col and a matrix product per client) against the grouped convolution: on a GPU a chunk
    # holds every client of the round, so this is where the key acts (docs/performance.md, "convolution").
    from driftlab.experiments.config import load_config
    from driftlab.experiments.run.datasets import data_location

    cifar = [
        "rounds=2",
        "seed=2",
        "data.name=cifar10_folder",
        "data.limit_per_class=20",
        "data.num_clients=4",
        "data.augment=false",
        "sampling.participation=1.0",
        "model.name=cnn",
        "client.epochs=1",
        "client.batch_size=10",
        "evaluation.every=1",
        "backend=vectorized",
        "device=cuda",
    ]
    if data_location(load_config(None, cifar).data) is None:
        pytest.skip("CIFAR-10 is not on this machine (set DRIFTLAB_DATA)")
    grouped, unfold, again = _run(cifar), _run([*cifar, "convolution=unfold"]), _run([*cifar, "convolution=unfold"])
    assert torch.equal(unfold.final_params.cpu(), again.final_params.cpu()), "two unfold runs on one GPU differ"
    reference = grouped.final_params.cpu()
    distance = torch.linalg.vector_norm(unfold.final_params.cpu() - reference) / torch.linalg.vector_norm(reference)
    assert distance <= RELATIVE_TOLERANCE, f"unfold and grouped models differ by {distance:.2e} (relative)"
