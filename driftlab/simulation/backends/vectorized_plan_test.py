"""Clients per chunk of the vectorized backend, from the memory budget (vectorized_plan.py)."""

from __future__ import annotations

import torch

from driftlab.simulation.backends.objectives import LossTerm
from driftlab.simulation.backends.vectorized import VectorizedBackend
from driftlab.simulation.backends.vectorized_gradients import LinearReluStack, VmappedGradient
from driftlab.simulation.backends.vectorized_plan import CPU_CHUNK_CLIENTS, chunk_clients, default_cap
from driftlab.simulation.backends.vectorized_test import (
    CLIENT_SIZES,
    _corrections,
    _data,
    _model,
    _output_norm_term,
    _tasks,
)


def test_chunk_clients_divide_the_budget_between_the_chunks_in_flight():
    assert chunk_clients(per_client=1_000, budget_bytes=100_000, num_tasks=1_000) == 100
    assert chunk_clients(per_client=1_000, budget_bytes=100_000, num_tasks=1_000, workers=4) == 25  # 4 chunks at once
    assert chunk_clients(per_client=1_000, budget_bytes=100_000, num_tasks=1_000, cap=16) == 16
    assert chunk_clients(per_client=1_000, budget_bytes=100_000, num_tasks=30, workers=2) == 15  # split evenly
    assert chunk_clients(per_client=1_000, budget_bytes=10, num_tasks=30) == 1  # never empty


def test_the_default_cap_is_per_device_and_model():
    model = _model("mlp", torch.float32)
    engine = LinearReluStack.match(model)
    assert default_cap(engine, model, torch.device("cpu")) == CPU_CHUNK_CLIENTS
    assert default_cap(engine, model, torch.device("cuda:0")) is None  # a GPU: the budget alone


def test_chunk_size_follows_the_memory_budget():
    model, data = _model("mlp", torch.float32), _data(torch.float32)
    start = model.initial_parameters()
    tasks = _tasks(_corrections("none", start)) * 200  # 1,200 clients
    engine = LinearReluStack.match(model)
    small = VectorizedBackend(memory_budget_bytes=200_000, max_chunk_clients=10_000).chunk_size(
        engine, model, start, tasks, data
    )
    large = VectorizedBackend(memory_budget_bytes=20_000_000, max_chunk_clients=10_000).chunk_size(
        engine, model, start, tasks, data
    )
    assert 1 <= small < large <= len(tasks)


def test_chunks_hold_fewer_clients_when_each_brings_its_own_loss_term_tensors():
    model, data = _model("mlp", torch.float32), _data(torch.float32)
    start = model.initial_parameters()
    shared = _tasks([LossTerm(_output_norm_term, (start,))] * len(CLIENT_SIZES)) * 50
    own = (
        _tasks([LossTerm(_output_norm_term, (torch.zeros(20, *start.shape),))] * len(CLIENT_SIZES)) * 50
    )  # 20 models each
    backend = VectorizedBackend(memory_budget_bytes=2_000_000, max_chunk_clients=10_000)
    engine = VmappedGradient(model)
    assert backend.chunk_size(engine, model, start, own, data) < backend.chunk_size(engine, model, start, shared, data)
