"""A wrapper's state shows the wrapped algorithm's θ as its own and keeps ``inner`` its first field."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from driftlab.features.wrapping import Wrapping


@dataclasses.dataclass(frozen=True)
class Clipped(Wrapping):
    clip: float


def test_a_wrappers_params_are_the_wrapped_ones_and_inner_comes_first():
    theta = torch.tensor([1.0, 2.0])
    state = Clipped(SimpleNamespace(params=theta), 0.5)
    assert state.params is theta
    assert [field.name for field in dataclasses.fields(state)] == ["inner", "clip"]
    assert dataclasses.replace(state, clip=1.0) == Clipped(state.inner, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.inner = None
