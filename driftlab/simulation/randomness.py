"""Every random draw of a run derives from (experiment seed, stream, round, client id).

No generator is carried from one round to the next, so a run resumed at round
``t`` draws exactly what an uninterrupted run draws there, and two algorithms
run with the same seed see the same client samples, the same minibatches and
the same availability draws (algorithms.md, "Reproducibility rule").
"""

from __future__ import annotations

import enum

import numpy as np
import torch


class Stream(enum.IntEnum):
    """Independent purposes that draw random numbers."""

    MODEL_INIT = 1
    CLIENT_SAMPLING = 2
    MINIBATCHES = 3
    AVAILABILITY = 4
    FISHER_SAMPLE = 5
    PARTITION = 6
    DATA_GENERATION = 7


NO_CLIENT = -1


def generator(seed: int, stream: Stream, round_index: int = 0, client_id: int = NO_CLIENT) -> np.random.Generator:
    """A numpy generator determined by ``(seed, stream, round, client id)`` alone.

    ``client_id=-1`` is for draws that belong to the round as a whole.
    """
    if seed < 0 or round_index < 0:
        raise ValueError(f"seed and round must be non-negative, got seed={seed}, round={round_index}")
    # SeedSequence hashes the whole tuple, so neighbouring tuples give unrelated streams.
    entropy = (int(seed), int(stream), int(round_index), int(client_id) + 1)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def torch_seed(seed: int, stream: Stream, round_index: int = 0, client_id: int = NO_CLIENT) -> int:
    """A 63-bit integer seed for ``torch.manual_seed`` from the same tuple."""
    return int(generator(seed, stream, round_index, client_id).integers(0, 2**63 - 1))


def seeded_torch_generator(seed: int, stream: Stream, round_index: int = 0, client_id: int = NO_CLIENT) -> torch.Generator:
    return torch.Generator().manual_seed(torch_seed(seed, stream, round_index, client_id))
