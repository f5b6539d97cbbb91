"""Weighted means of client vectors: the only arithmetic every algorithm shares.

No paper owns these, so they live here; everything paper-specific stays in the
algorithm's own module.
"""

from __future__ import annotations

from typing import Sequence

import torch

AGGREGATIONS = ("weighted", "uniform")


def aggregation_weights(num_samples: Sequence[int], multiplicity: Sequence[int], mode: str) -> list[float]:
    """``w_k = n_k / Σ_P n_j`` ("weighted") or ``1/|P|`` ("uniform"), each counted ``multiplicity`` times.

    A client drawn twice by with-replacement sampling (FedProx Algorithm 2)
    weighs twice, as if it were two draws.
    """
    if mode == "weighted":
        raw = [float(n) * m for n, m in zip(num_samples, multiplicity)]
    elif mode == "uniform":
        raw = [float(m) for m in multiplicity]
    else:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    total = sum(raw)
    if total <= 0:
        raise ValueError("aggregation weights sum to zero: no client reported any work")
    return [r / total for r in raw]


def weighted_sum(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``Σ_k w_k v_k`` accumulated in the given order (the order fixes the rounding)."""
    if not vectors:
        raise ValueError("cannot average zero vectors")
    total = weights[0] * vectors[0]
    for weight, vector in zip(weights[1:], vectors[1:]):
        total = total + weight * vector
    return total


def mean(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``mean_P v_k``, summed in order then divided once."""
    if not vectors:
        raise ValueError("cannot average zero vectors")
    total = vectors[0]
    for vector in vectors[1:]:
        total = total + vector
    return total / len(vectors)
