"""A copy of the shared module is never taken while ``FlatModel.forward`` has swapped its parameters.

The race it guards against: a client's computation on its own data (APFL's replayed steps, Ditto's personal steps,
EFL's Fisher) runs ``FlatModel.forward`` on the shared module in the engine's thread while the sequential backend's
threads make their own copies of that module; a copy taken mid-call held the swapped-in, non-leaf tensors
("Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol").
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from driftlab.simulation.backends.flat import FlatModel, copy_module

INSIDE, RELEASE = threading.Event(), threading.Event()  # module-level: a module holding locks cannot be copied


class _Pausing(nn.Module):
    """A linear layer whose forward waits, mid-call, until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        INSIDE.set()
        RELEASE.wait(timeout=10)
        return self.layer(inputs)


def test_a_copy_waits_for_a_forward_that_swapped_the_parameters():
    inside, release = INSIDE, RELEASE
    module = _Pausing()
    model = FlatModel.wrap(module)
    original = [p.detach().clone() for p in module.parameters()]
    theta = (model.initial_parameters() + 1.0).requires_grad_(True)  # swapped-in tensors: non-leaves of this graph
    copies: list[nn.Module] = []
    forward = threading.Thread(target=lambda: model.forward(theta * 2.0, torch.ones(1, 3)))
    forward.start()
    assert inside.wait(timeout=10)
    copier = threading.Thread(target=lambda: copies.append(copy_module(module)))
    copier.start()
    copier.join(timeout=0.2)
    assert copier.is_alive()  # blocked while the parameters are swapped
    release.set()
    forward.join(timeout=10)
    copier.join(timeout=10)
    assert not copier.is_alive() and len(copies) == 1
    for copied, expected in zip(copies[0].parameters(), original, strict=True):
        assert copied.is_leaf and torch.equal(copied.detach(), expected)  # the module's own parameters, not θ's
