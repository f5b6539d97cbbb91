"""Weighted means of client vectors: the only arithmetic every algorithm shares.

No paper owns these, so they live here; everything paper-specific stays in the
algorithm's own module.

A mean is kept as a running sum, ``Σ_k r_k v_k`` and ``Σ_k r_k``, divided once
at the end (``RunningMean``): the server can fold each message in as it
arrives, in sample order, and a round never holds its messages together.  The
list form (``weighted_mean``) is the same fold, so both give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

AGGREGATIONS = ("weighted", "uniform")


def check_aggregation(mode: str) -> str:
    """``mode`` if it names an aggregation, else a ``ValueError`` listing the valid ones."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    return mode


def client_weight(num_samples: int, multiplicity: int, mode: str) -> float:
    """``r_k``: ``n_k`` ("weighted") or 1 ("uniform"), times ``multiplicity``; the mean weighs by ``r_k / Σ_P r_j``.

    A client drawn twice by with-replacement sampling (FedProx Algorithm 2)
    weighs twice, as if it were two draws.
    """
    if check_aggregation(mode) == "weighted":
        return float(num_samples) * multiplicity
    return float(multiplicity)


@dataclass(frozen=True)
class RunningMean:
    """``Σ_k r_k v_k`` and ``Σ_k r_k`` over the vectors added so far, accumulated in the order they were added."""

    total: torch.Tensor | None = None
    weight: float = 0.0

    def add(self, vector: torch.Tensor, weight: float) -> "RunningMean":
        term = vector * weight
        return RunningMean(term if self.total is None else self.total + term, self.weight + weight)

    def value(self) -> torch.Tensor:
        """``Σ_k r_k v_k / Σ_k r_k``."""
        if self.total is None:
            raise ValueError("cannot average zero vectors")
        if self.weight <= 0:
            raise ValueError("aggregation weights sum to zero: no client reported any work")
        return self.total / self.weight


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``Σ_k r_k v_k / Σ_k r_k`` for unnormalised weights ``r_k``, summed in the given order (the order fixes the rounding)."""
    mean = RunningMean()
    for vector, weight in zip(vectors, weights, strict=True):
        mean = mean.add(vector, weight)
    return mean.value()
