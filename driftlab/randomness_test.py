"""Every random draw derives from (seed, stream, round, client id) and nothing else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from driftlab.randomness import NO_CLIENT, Stream, generator, seeded_torch_generator, torch_seed


def _draw(*args):
    return generator(*args).integers(0, 2**62, size=4).tolist()


def test_same_tuple_same_numbers():
    assert _draw(3, Stream.MINIBATCHES, 5, 2) == _draw(3, Stream.MINIBATCHES, 5, 2)


def test_every_component_of_the_tuple_matters():
    reference = _draw(3, Stream.MINIBATCHES, 5, 2)
    assert _draw(4, Stream.MINIBATCHES, 5, 2) != reference
    assert _draw(3, Stream.CLIENT_SAMPLING, 5, 2) != reference
    assert _draw(3, Stream.MINIBATCHES, 6, 2) != reference
    assert _draw(3, Stream.MINIBATCHES, 5, 3) != reference
    # the round-wide stream (no client) differs from client 0
    assert _draw(3, Stream.MINIBATCHES, 5, NO_CLIENT) != _draw(3, Stream.MINIBATCHES, 5, 0)


def test_draws_do_not_depend_on_history():
    first = _draw(0, Stream.AVAILABILITY, 9, 1)
    for t in range(1, 9):  # drawing other rounds in between changes nothing
        generator(0, Stream.AVAILABILITY, t, 1).random(100)
    np.random.seed(123)
    torch.manual_seed(123)
    assert _draw(0, Stream.AVAILABILITY, 9, 1) == first


def test_negative_seed_or_round_is_rejected():
    with pytest.raises(ValueError):
        generator(-1, Stream.MODEL_INIT)
    with pytest.raises(ValueError):
        generator(0, Stream.MODEL_INIT, -2)


def test_torch_seeds():
    seed = torch_seed(1, Stream.MODEL_INIT)
    assert 0 <= seed < 2**63 - 1
    assert seed == torch_seed(1, Stream.MODEL_INIT) != torch_seed(2, Stream.MODEL_INIT)
    a = torch.randn(3, generator=seeded_torch_generator(1, Stream.FISHER_SAMPLE, 2, 3))
    b = torch.randn(3, generator=seeded_torch_generator(1, Stream.FISHER_SAMPLE, 2, 3))
    assert torch.equal(a, b)
