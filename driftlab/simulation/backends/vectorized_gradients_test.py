"""Which models the hand-written batched layers take (vectorized_gradients.py); the gradients themselves are checked
against the sequential backend in vectorized_test.py."""

from __future__ import annotations

import torch
from torch import nn

from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.vectorized_gradients import LinearReluStack
from driftlab.simulation.backends.vectorized_test import _model


def test_only_linear_relu_stacks_under_cross_entropy_take_the_batched_layers():
    assert LinearReluStack.match(_model("mlr", torch.float32)) is not None
    assert LinearReluStack.match(_model("mlp", torch.float32)) is not None
    assert LinearReluStack.match(_model("conv", torch.float32)) is None
    sequential = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))
    assert LinearReluStack.match(FlatModel.wrap(sequential)) is not None
    assert (
        LinearReluStack.match(
            FlatModel.wrap(nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)))
        )
        is None
    )
