"""Seeded client sampling: which registered clients are asked to train in round t.

Two modes (FedProx paper and authors' code, algorithms.md "FedProx"):

* ``uniform``: ``m`` clients uniformly without replacement (the authors' code,
  used with ``n_k``-weighted averaging);
* ``weighted``: ``m`` independent draws with probability ``p_k = n_k / n``
  (FedProx Algorithm 2, used with a simple average).  A client drawn twice is
  trained once and counts twice (``multiplicity``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from driftlab.simulation.round.randomness import Stream, generator

SAMPLING_MODES = ("uniform", "weighted")


@dataclass(frozen=True)
class ClientSample:
    client_ids: np.ndarray  # sorted, unique
    multiplicity: np.ndarray  # how often each was drawn (all ones for "uniform")


def clients_per_round(participation: float, num_registered: int) -> int:
    """``max(1, ⌊participation · N + ½⌋)`` (halves round up, unlike Python's ``round``)."""
    return max(1, math.floor(participation * num_registered + 0.5))


def sample_clients(
    seed: int, round_index: int, registered: np.ndarray, sizes: np.ndarray, participation: float, mode: str
) -> ClientSample:
    """Draw round ``round_index``'s clients from ``registered`` (ids) with sample counts ``sizes``."""
    if len(registered) == 0:
        raise ValueError(f"round {round_index}: no registered clients to sample from")
    rng = generator(seed, Stream.CLIENT_SAMPLING, round_index)
    count = clients_per_round(participation, len(registered))
    if mode == "uniform":
        chosen = np.sort(rng.choice(registered, size=count, replace=False))
        return ClientSample(chosen.astype(np.int64), np.ones(len(chosen), dtype=np.int64))
    if mode == "weighted":
        probabilities = sizes / sizes.sum()
        draws = rng.choice(registered, size=count, replace=True, p=probabilities)
        ids, counts = np.unique(draws, return_counts=True)
        return ClientSample(ids.astype(np.int64), counts.astype(np.int64))
    raise ValueError(f"unknown sampling mode {mode!r}; valid modes: {', '.join(SAMPLING_MODES)}")
