"""The running sum of every client's latest model: equal to the sum over the store, in sample order, membership-aware."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from safetensors import safe_open

import driftlab
from driftlab.simulation.round.latest_models import (
    COUNT,
    FIX_INDEX,
    FIX_VALUE,
    SUM,
    LatestModels,
    LatestModelsUpdate,
    all_clients_mean,
    checkpoint_tensors,
    from_checkpoint_tensors,
    summed_store,
)
from driftlab.simulation.state.state_store import InMemoryClientStore


def _models(count: int, size: int = 50, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=generator) * 10 ** float(k % 5 - 2) for k in range(count)]


def test_the_running_sum_is_the_sum_of_every_clients_latest_model():
    first, second = _models(6), _models(6, seed=1)
    store = InMemoryClientStore(None)
    start = summed_store(store, first[0])
    update = LatestModelsUpdate(start, [0, 1, 2, 3])
    for k in (0, 1, 2, 3):
        update.add(k, first[k], None)
        store.put(k, first[k])
    store.commit()
    latest = update.result()
    update = LatestModelsUpdate(latest, [2, 3, 5])  # 2 and 3 train again, 5 for the first time
    for k in (2, 3, 5):
        update.add(k, second[k], store.get(k))
        store.put(k, second[k])
    store.commit()
    latest = update.result()
    direct = summed_store(store, first[0])
    assert latest.count == direct.count == 5
    torch.testing.assert_close(latest.total, direct.total, rtol=1e-13, atol=1e-13)  # float64: rounding only
    assert start.count == 0 and not start.total.any()  # the update never touched the state it started from


@pytest.mark.parametrize("completion", list(itertools.permutations(range(3))))
def test_the_sum_follows_sample_order_whatever_order_clients_finish_in(completion):
    models = _models(3)
    order = [4, 0, 7]
    reference = LatestModelsUpdate(LatestModels(torch.zeros(50, dtype=torch.float64), 0), order)
    for k, client_id in enumerate(order):
        reference.add(client_id, models[k], None)
    shuffled = LatestModelsUpdate(LatestModels(torch.zeros(50, dtype=torch.float64), 0), order)
    for k in completion:
        shuffled.add(order[k], models[k], None)
    assert torch.equal(shuffled.result().total, reference.result().total)


def test_the_mean_counts_untrained_clients_at_theta0_and_leaves_out_unregistered_ones():
    theta0 = torch.tensor([1.0, -1.0])
    store = InMemoryClientStore(None)
    models = {0: torch.tensor([3.0, 3.0]), 2: torch.tensor([5.0, 1.0]), 3: torch.tensor([100.0, 100.0])}
    for client_id, params in models.items():
        store.put(client_id, params)
    store.commit()
    latest = summed_store(store, theta0)
    registered = np.array([0, 1, 2])  # client 3 left (its model stays stored, out of the mean); client 1 never trained
    mean = all_clients_mean(latest, store, registered, 4, theta0)
    assert torch.equal(mean, (models[0] + theta0 + models[2]) / 3)
    everyone = all_clients_mean(latest, store, np.arange(4), 4, theta0)
    assert torch.equal(everyone, (models[0] + theta0 + models[2] + models[3]) / 4)


@pytest.mark.slow
def test_a_resumed_all_clients_mean_run_continues_with_the_same_bits(tmp_path):
    overrides = [
        "rounds=4",
        "data.num_clients=8",
        "sampling.participation=0.5",
        "algorithm.name=feddyn",
        "evaluation.model=all_clients_mean",
        "checkpoint_every=2",
    ]
    whole = driftlab.run(None, overrides=overrides)
    driftlab.run(None, tmp_path / "run", overrides=[*overrides[1:], "rounds=2", "keep_checkpoint=true"])
    with safe_open(str(tmp_path / "run" / "checkpoint.safetensors"), framework="pt") as checkpoint:
        # float32 models: the sum is stored as its few differences from a fresh sum of the stored models, not whole
        assert {f"engine/{COUNT}", f"engine/{FIX_INDEX}", f"engine/{FIX_VALUE}"} <= set(checkpoint.keys())
        assert f"engine/{SUM}" not in checkpoint.keys()
    resumed = driftlab.run(None, tmp_path / "run", resume=True, overrides=overrides)
    strip = lambda records: [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]  # noqa: E731
    assert strip(resumed.records) == strip(whole.records)
    assert torch.equal(resumed.final_params, whole.final_params)


def _running_sum_with_a_rounding(entries: int) -> tuple[LatestModels, InMemoryClientStore]:
    """Clients 0 and 1, then client 0 again: 1e30 + 1 rounds to 1e30 in float64, so the running sum of the entries
    below ``entries`` ends at 0 where a fresh sum of the latest models is 1; the rest is exact."""
    size = 40
    first = torch.ones(size) * 3.0
    first[:entries] = 1e30
    other, again = torch.ones(size), torch.full((size,), 0.5)
    again[:entries] = 0.0
    store = InMemoryClientStore(None)
    update = LatestModelsUpdate(LatestModels(torch.zeros(size, dtype=torch.float64), 0), [0, 1])
    update.add(0, first, None)
    update.add(1, other, None)
    store.put(0, first)
    store.put(1, other)
    store.commit()
    update = LatestModelsUpdate(update.result(), [0])
    update.add(0, again, store.get(0))
    store.put(0, again)
    store.commit()
    return update.result(), store


def test_the_checkpointed_sum_keeps_only_its_differences_from_a_fresh_sum_and_restores_bit_for_bit():
    latest, store = _running_sum_with_a_rounding(3)
    fresh = summed_store(store, latest.total)
    assert latest.total[:3].tolist() == [0.0] * 3 and fresh.total[:3].tolist() == [1.0] * 3  # the rounding kept
    assert torch.equal(latest.total[3:], fresh.total[3:])
    tensors = checkpoint_tensors(latest, store)
    assert sorted(tensors) == sorted([COUNT, FIX_INDEX, FIX_VALUE])
    assert (
        tensors[FIX_INDEX].tolist() == [0, 1, 2]
        and tensors[FIX_VALUE].tolist() == [0.0] * 3
        and int(tensors[COUNT]) == 2
    )
    restoring = InMemoryClientStore(None)  # as a resume fills it: staged, not yet committed
    for client_id, params in store.items():
        restoring.put(client_id, params)
    restored = from_checkpoint_tensors(tensors, restoring, torch.zeros(40))
    assert restored.count == 2 and restored.total.dtype == torch.float64
    assert torch.equal(restored.total.view(torch.int64), latest.total.view(torch.int64))


def test_a_sum_far_from_a_fresh_one_or_beside_a_disk_store_is_checkpointed_whole():
    dense, store = _running_sum_with_a_rounding(
        30
    )  # 30 of 40 entries differ: indices and values would outweigh the sum
    tensors = checkpoint_tensors(dense, store)
    assert sorted(tensors) == sorted([SUM, COUNT]) and torch.equal(tensors[SUM], dense.total)
    exact, _ = _running_sum_with_a_rounding(0)
    assert sorted(checkpoint_tensors(exact, None)) == sorted([SUM, COUNT])  # None: the models are not in the file
    restored = from_checkpoint_tensors(checkpoint_tensors(dense, store), InMemoryClientStore(None), torch.zeros(40))
    assert torch.equal(restored.total, dense.total) and restored.count == 2
    assert from_checkpoint_tensors({}, store, torch.zeros(40)) is None  # an older checkpoint: summed from the store
