"""Training augmentation from per-example keys: the same draws on every backend, chunking and round.

The draws of the example in column ``i`` of local step ``s`` of client ``k`` in
round ``t`` come from ``example_keys(augmentation_key(seed, t, k), s, i)``, so
the sequential and vectorized backends (batched layers or vmap, any chunk
size) augment every example identically, and a resumed round repeats them.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

from driftlab.models import build_model
from driftlab.randomness import augmentation_key, example_keys, mix64
from driftlab.simulation.backends.augmentation import flip_crop_from_keys
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import ClientTask, LocalSettings, SequentialBackend, TrainingData
from driftlab.simulation.backends.testing import client_tasks
from driftlab.simulation.backends.vectorized import LinearReluStack, VectorizedBackend
from driftlab.simulation.backends.vectorized_test import assert_agree, run_backend
from driftlab.simulation.seam import NO_CORRECTION, GradientCorrection

CLIENT_SIZES = (37, 50, 23, 7, 64)  # 7 < B: batches narrower than the others'; 37, 23: short last batches
BATCH_SIZE = 10
SEED, ROUND = 11, 3
SHAPE = (3, 8, 8)
AUGMENT = functools.partial(flip_crop_from_keys, padding=2)

MASK64 = (1 << 64) - 1


# ------------------------------------------------------------------ keys


def _splitmix_finaliser(z: int) -> int:
    """splitmix64's finaliser on unsigned Python integers, the reference for the int64 version."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _reference_key(base: int, step: int, slot: int) -> int:
    gamma = 0x9E3779B97F4A7C15
    per_step = _splitmix_finaliser((base + (step + 1) * gamma) & MASK64)
    return _splitmix_finaliser((per_step + (slot + 1) * gamma) & MASK64)


def _unsigned(values: torch.Tensor) -> list[int]:
    return [v & MASK64 for v in values.tolist()]


def test_mix64_is_splitmix64_with_wraparound():
    values = [0, 1, 2, 12345, 2**62, 2**63 - 1, -1, -(2**63), -987654321987654321]
    expected = [_splitmix_finaliser(v & MASK64) for v in values]
    assert _unsigned(mix64(torch.tensor(values, dtype=torch.int64))) == expected
    # A known splitmix64 output: the first number of the generator seeded with 0 is mix(0 + γ).
    assert _splitmix_finaliser(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_example_keys_match_the_reference_and_broadcast():
    bases = torch.tensor(
        [[augmentation_key(SEED, ROUND, k)] for k in range(4)] + [[-1], [0]], dtype=torch.int64
    )  # [6, 1]
    slots = torch.arange(7).unsqueeze(0)  # [1, 7]
    for step in (0, 1, 5, 10_000):
        keys = example_keys(bases, step, slots)
        assert keys.shape == (6, 7) and keys.dtype == torch.int64
        expected = [[_reference_key(b & MASK64, step, i) for i in range(7)] for b in bases[:, 0].tolist()]
        assert [_unsigned(row) for row in keys] == expected
    # A Python int base and a subset of slots give the same numbers as the full table.
    base = int(bases[2, 0])
    assert torch.equal(example_keys(base, 5, torch.tensor([0, 3, 6])), example_keys(bases, 5, slots)[2, [0, 3, 6]])


def test_augmentation_key_depends_on_seed_round_and_client_only():
    key = augmentation_key(SEED, ROUND, 2)
    assert isinstance(key, int) and -(2**63) <= key < 2**63
    assert augmentation_key(SEED, ROUND, 2) == key
    others = {
        augmentation_key(SEED + 1, ROUND, 2),
        augmentation_key(SEED, ROUND + 1, 2),
        augmentation_key(SEED, ROUND, 3),
    }
    assert key not in others and len(others) == 3


def test_keys_differ_across_rounds_clients_steps_and_slots_and_flip_half_the_time():
    rounds, clients, steps, slots = 8, 25, 50, 10
    table = torch.stack(
        [
            torch.stack(
                [
                    example_keys(
                        augmentation_key(SEED, t, k), torch.arange(steps).unsqueeze(1), torch.arange(slots).unsqueeze(0)
                    )
                    for k in range(clients)
                ]
            )
            for t in range(1, rounds + 1)
        ]
    )  # [rounds, clients, steps, slots]
    count = table.numel()  # 100,000 keys
    assert len(torch.unique(table)) == count  # no two examples share a key
    flips = (table & 1).to(torch.float64)
    assert abs(float(flips.mean()) - 0.5) < 0.01  # 5 standard deviations is 0.008
    crops = (((table >> 8) & 0xFFFFFF) < 2**23).to(torch.float64)
    assert abs(float(crops.mean()) - 0.5) < 0.01
    offsets = (((table >> 32) & 0xFFFF) * 9) >> 16
    frequencies = torch.bincount(offsets.reshape(-1), minlength=9).to(torch.float64) / count
    assert len(frequencies) == 9 and float((frequencies - 1 / 9).abs().max()) < 0.006
    # The same (step, slot) in another round, for another client or at another step flips independently.
    for a, b in ((flips[0], flips[1]), (flips[:, 0], flips[:, 1]), (flips[:, :, 0], flips[:, :, 1])):
        assert abs(float((a == b).to(torch.float64).mean()) - 0.5) < 0.03
    # Bits across the word are balanced (no stuck bits from the signed arithmetic).
    bits = torch.stack([((table >> b) & 1).to(torch.float64).mean() for b in range(64)])
    assert float((bits - 0.5).abs().max()) < 0.01


# ------------------------------------------------------------------ training with augmentation on both backends


def _model(dtype: torch.dtype, hidden=(16, 12)) -> FlatModel:
    torch.manual_seed(0)
    return FlatModel.wrap(build_model("mlp", SHAPE, 10, hidden=hidden)).to("cpu", dtype)


def _data(dtype: torch.dtype, augment=AUGMENT) -> TrainingData:
    generator = torch.Generator().manual_seed(1)
    n = sum(CLIENT_SIZES) + 5
    inputs = torch.randn(n, *SHAPE, generator=generator, dtype=torch.float64).to(dtype)
    return TrainingData(inputs, torch.randint(0, 10, (n,), generator=generator), augment=augment)


def _tasks(round_index: int = ROUND, fixed_steps: dict[int, int] | None = None, corrections=None) -> list[ClientTask]:
    """Unequal clients, 2 epochs each (unequal step counts) unless ``fixed_steps`` overrides; keys from (seed, round, client)."""
    return client_tasks(
        CLIENT_SIZES,
        BATCH_SIZE,
        SEED,
        corrections,
        steps=lambda client_id, per_epoch: (fixed_steps or {}).get(client_id, 2 * per_epoch),
        round_index=round_index,
        first_row=5,
        shuffled=True,
        augment_key=lambda client_id: augmentation_key(SEED, round_index, client_id),
    )


def _assert_identical(expected: dict, actual: dict) -> None:
    for position, (params, done) in expected.items():
        assert actual[position][1] == done and torch.equal(actual[position][0], params)


def _max_difference(a: dict, b: dict) -> float:
    return max(float((a[p][0] - b[p][0]).abs().max()) for p in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("clip_norm", [None, 0.5], ids=["noclip", "clip"])
def test_backends_agree_with_augmentation(dtype, clip_norm):
    model, data = _model(dtype), _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks(fixed_steps={2: 3, 4: 1})  # two clients stop early
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=clip_norm)
    expected = run_backend(SequentialBackend(), model, start, tasks, settings, data)
    assert_agree(expected, run_backend(VectorizedBackend(), model, start, tasks, settings, data), dtype)
    # Augmentation did change training: the models differ clearly from un-augmented ones.
    plain = run_backend(SequentialBackend(), model, start, tasks, settings, _data(dtype, augment=None))
    assert _max_difference(expected, plain) > 1e-3


def test_vmap_path_agrees_with_augmentation_and_corrections():
    dtype = torch.float64
    model, data = _model(dtype), _data(dtype)
    start = model.initial_parameters()
    generator = torch.Generator().manual_seed(2)
    vector = lambda scale: torch.randn(start.numel(), generator=generator, dtype=dtype) * scale  # noqa: E731
    corrections = [
        NO_CORRECTION,
        GradientCorrection(linear=vector(0.05)),
        GradientCorrection(quadratic=0.5, reference=start),
        GradientCorrection(linear=vector(0.05), quadratic=vector(0.2).abs(), reference=start + vector(0.01)),
        NO_CORRECTION,
    ]
    tasks = _tasks(corrections=corrections)
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01)
    expected = run_backend(SequentialBackend(), model, start, tasks, settings, data)
    assert_agree(
        expected, run_backend(VectorizedBackend(batched_layers=False), model, start, tasks, settings, data), dtype
    )
    assert_agree(expected, run_backend(VectorizedBackend(), model, start, tasks, settings, data), dtype)


def test_chunking_does_not_change_augmented_training():
    dtype = torch.float64
    model, data = _model(dtype), _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks()
    settings = LocalSettings(client_lr=0.1, clip_norm=0.5)
    one_chunk = VectorizedBackend(max_chunk_clients=len(tasks), parallel_chunks=False)
    tiny_budget = VectorizedBackend(memory_budget_bytes=1)  # one client per chunk, chunks in parallel threads
    engine = LinearReluStack.match(model)
    assert one_chunk.chunk_size(engine, model, start, tasks, data) == len(tasks)
    assert tiny_budget.chunk_size(engine, model, start, tasks, data) == 1
    together = run_backend(one_chunk, model, start, tasks, settings, data)
    assert_agree(together, run_backend(tiny_budget, model, start, tasks, settings, data), dtype)
    # A client trained alone gets the same model as in the round (its keys do not depend on its companions).
    alone = run_backend(one_chunk, model, start, tasks[3:4], settings, data)
    assert_agree({0: together[3]}, alone, dtype)


def test_augmented_training_is_repeatable_and_keys_matter():
    dtype = torch.float64
    model, data = _model(dtype), _data(dtype)
    start = model.initial_parameters()
    settings = LocalSettings(client_lr=0.1)
    first = run_backend(SequentialBackend(), model, start, _tasks(), settings, data)
    _assert_identical(
        first, run_backend(SequentialBackend(), model, start, _tasks(), settings, data)
    )  # a resumed round: bit for bit
    _assert_identical(
        run_backend(VectorizedBackend(), model, start, _tasks(), settings, data),
        run_backend(VectorizedBackend(), model, start, _tasks(), settings, data),
    )
    # Same batches, other keys (the next round's): other augmentations, other models.
    rekeyed = [
        ClientTask(
            t.client_id,
            t.sample_indices,
            t.batches,
            t.correction,
            augment_key=augmentation_key(SEED, ROUND + 1, t.client_id),
        )
        for t in _tasks()
    ]
    assert _max_difference(first, run_backend(SequentialBackend(), model, start, rekeyed, settings, data)) > 1e-3


def test_partial_work_is_a_prefix_of_full_work():
    """A straggler's K' < K steps see the same augmented batches as the first K' steps of full work."""
    dtype = torch.float64
    model, data = _model(dtype), _data(dtype)
    start = model.initial_parameters()
    settings = LocalSettings(client_lr=0.1)
    full = _tasks()[1]
    partial = ClientTask(
        full.client_id, full.sample_indices, full.batches[:3], full.correction, augment_key=full.augment_key
    )
    short_plan = _tasks(fixed_steps={1: 3})[1]
    assert np.array_equal(short_plan.batches, partial.batches) and short_plan.augment_key == partial.augment_key
    backend = SequentialBackend()
    _assert_identical(
        run_backend(backend, model, start, [partial], settings, data),
        run_backend(backend, model, start, [short_plan], settings, data),
    )


@pytest.mark.parametrize("backend_kind", ["sequential", "vectorized", "vmap"])
def test_augmentation_off_leaves_training_bit_identical(backend_kind):
    """``augment=None`` ignores the keys, and the identity augmentation changes no bit of the result."""
    dtype = torch.float32
    make = {
        "sequential": SequentialBackend,
        "vectorized": lambda: VectorizedBackend(parallel_chunks=False),
        "vmap": lambda: VectorizedBackend(batched_layers=False),
    }[backend_kind]
    model = _model(dtype)
    start = model.initial_parameters()
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=0.5)
    off = _data(dtype, augment=None)
    unkeyed = [ClientTask(t.client_id, t.sample_indices, t.batches, t.correction) for t in _tasks()]
    reference = run_backend(make(), model, start, unkeyed, settings, off)
    _assert_identical(reference, run_backend(make(), model, start, _tasks(), settings, off))
    _assert_identical(
        reference, run_backend(make(), model, start, _tasks(), settings, _data(dtype, augment=lambda x, keys: x))
    )


def test_augment_receives_each_example_with_its_own_key():
    """What an augmentation sees: the gathered [M, C, H, W] batch and int64 keys, one per example, the same on both backends."""
    dtype = torch.float64
    model = _model(dtype)
    start = model.initial_parameters()
    seen: dict[str, dict[int, torch.Tensor]] = {"sequential": {}, "vectorized": {}}

    def recorder(name):
        def augment(images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
            assert images.shape[1:] == SHAPE and keys.dtype == torch.int64 and keys.shape == images.shape[:1]
            for image, key in zip(images, keys.tolist(), strict=True):
                seen[name].setdefault(key, image.clone())
            return images

        return augment

    tasks = _tasks()
    data = _data(dtype, augment=None)
    for name, backend in (
        ("sequential", SequentialBackend()),
        ("vectorized", VectorizedBackend(parallel_chunks=False)),
    ):
        run_backend(
            backend,
            model,
            start,
            tasks,
            LocalSettings(client_lr=0.1),
            TrainingData(data.inputs, data.targets, recorder(name)),
        )
    real_examples = sum(int((t.batches != -1).sum()) for t in tasks)
    assert len(seen["sequential"]) == real_examples
    # The vectorized backend also augments padding slots (weight 0); every real example has the same key and image.
    assert len(seen["vectorized"]) > real_examples
    for key, image in seen["sequential"].items():
        assert torch.equal(seen["vectorized"][key], image)


@pytest.mark.parametrize("clip_norm", [None, 0.5], ids=["noclip", "clip"])
def test_the_stacked_convolution_path_agrees_with_augmentation(clip_norm):
    dtype = torch.float64
    torch.manual_seed(0)
    channels = SHAPE[0]
    module = nn.Sequential(
        nn.Conv2d(channels, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * (SHAPE[1] // 2) * (SHAPE[2] // 2), 10),
    )
    model = FlatModel.wrap(module).to("cpu", dtype)
    data = _data(dtype)
    start = model.initial_parameters()
    tasks = _tasks(fixed_steps={2: 3, 4: 1})
    settings = LocalSettings(client_lr=0.1, weight_decay=0.01, clip_norm=clip_norm)
    expected = run_backend(SequentialBackend(), model, start, tasks, settings, data)
    for backend in (VectorizedBackend(), VectorizedBackend(max_chunk_clients=len(tasks), parallel_chunks=False)):
        assert_agree(expected, run_backend(backend, model, start, tasks, settings, data), dtype)
