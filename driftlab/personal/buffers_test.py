"""FedBN's per-client running statistics (``buffers.py``): which buffers stay local, the record and its checkpoint."""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn

from driftlab.personal import buffers
from driftlab.personal.buffers import CHECKPOINT_PREFIX, ClientBuffers, personal_buffer_names
from driftlab.personal.selection import parameter_kinds, select


def _bn_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.BatchNorm1d(3, affine=False), nn.Linear(3, 1)
    )


def _part(module: nn.Module, keep: tuple[str, ...]):
    names = tuple(name for name, _ in module.named_parameters())
    sizes = tuple(p.numel() for _, p in module.named_parameters())
    return select(names, sizes, keep, parameter_kinds(module, names))


def test_a_layers_statistics_are_local_where_its_affine_parameters_are() -> None:
    module = _bn_mlp()
    assert personal_buffer_names(module, _part(module, ("batchnorm",))) == (
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    )  # the affine-free BatchNorm (3) has no parameters to keep: its statistics stay shared
    assert personal_buffer_names(module, _part(module, ("1.weight",))) == ()  # half of layer 1's parameters: shared
    assert personal_buffer_names(module, _part(module, ("head",))) == ()


def test_each_client_starts_from_its_own_statistics_and_the_server_keeps_its_initial_ones() -> None:
    module = _bn_mlp()
    names = personal_buffer_names(module, _part(module, ("batchnorm",)))
    initial = {name: value for name, value in module.named_buffers() if name in names}
    record = ClientBuffers(initial)
    assert record.names == names
    module.train()
    module(torch.tensor([[1.0, 2.0], [3.0, -1.0]]))  # a training-mode forward moves every running statistic
    after = dict(module.named_buffers())
    record.keep(1, after)
    assert torch.equal(record.start_of(1)["1.running_mean"], after["1.running_mean"])
    assert int(record.start_of(1)["1.num_batches_tracked"]) == 1
    assert torch.equal(record.start_of(0)["1.running_mean"], torch.zeros(3))  # not trained: the server's initial
    after["1.running_mean"].add_(5.0)  # the record holds copies
    assert not torch.equal(record.start_of(1)["1.running_mean"], after["1.running_mean"])
    averaged = {name: value + 1 for name, value in after.items()}
    shared = record.shared(averaged)
    assert torch.equal(shared["1.running_mean"], torch.zeros(3))  # never averaged
    assert torch.equal(shared["3.running_mean"], averaged["3.running_mean"])  # a shared layer's: the average
    with pytest.raises(KeyError, match="lack 1.running_var"):
        record.keep(2, {"1.running_mean": torch.ones(3), "1.num_batches_tracked": torch.tensor(1)})


def test_a_checkpoint_round_trip_gives_every_clients_own_statistics_back() -> None:
    initial = {"bn.running_mean": torch.zeros(2, dtype=torch.float64), "bn.num_batches_tracked": torch.tensor(0)}
    record = ClientBuffers(initial)
    record.keep(
        4,
        {"bn.running_mean": torch.tensor([0.5, -0.25], dtype=torch.float64), "bn.num_batches_tracked": torch.tensor(3)},
    )
    record.keep(
        0, {"bn.running_mean": torch.tensor([1.0, 2.0], dtype=torch.float64), "bn.num_batches_tracked": torch.tensor(1)}
    )
    tensors = {**record.engine_tensors(None, {}), "buffers/other": torch.ones(1)}  # beside the server's buffers
    assert sorted(name for name in tensors if name.startswith(CHECKPOINT_PREFIX)) == [
        "personal_buffers/0/bn.num_batches_tracked",
        "personal_buffers/0/bn.running_mean",
        "personal_buffers/4/bn.num_batches_tracked",
        "personal_buffers/4/bn.running_mean",
    ]
    resumed = ClientBuffers(initial)
    assert resumed.restored(None, None, tensors) == {}
    for client in (0, 4, 7):
        for name in initial:
            assert torch.equal(resumed.start_of(client)[name], record.start_of(client)[name])
    assert resumed.start_of(4)["bn.running_mean"].dtype == torch.float64
    with pytest.raises(KeyError, match="names no personal buffer"):
        ClientBuffers({"bn.running_var": torch.ones(2)}).restored(None, None, tensors)
    assert ClientBuffers(initial).engine_tensors(None, {}) == {}  # nothing trained: nothing written


def test_docstring_example() -> None:
    assert doctest.testmod(buffers, extraglobs={"torch": torch}).failed == 0
