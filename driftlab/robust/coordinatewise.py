"""Coordinate-wise robust statistics: the median and the trimmed mean (Yin, Chen, Ramchandran and Bartlett,
"Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018).

For each coordinate j, with the n values x_{1j} ≤ … ≤ x_{nj} sorted (ties kept in client order)::

    median:        med_j = x_{(n+1)/2, j}                      (n odd)
                         = (x_{n/2, j} + x_{n/2+1, j}) / 2      (n even)
    trimmed mean:  k = ⌊βn⌋,   trmean_j = (1 / (n − 2k)) Σ_{r=k+1}^{n−k} x_{rj}

Both count clients, not samples: the given weights are not used (a Byzantine
client could claim any sample count and so buy the aggregate).  ``kept[i]`` is
the share of coordinates in which client i's value is among the values
averaged (for the median, the one or two middle values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from driftlab.robust.result import RobustResult, check_updates, ones


@dataclass(frozen=True)
class Median:
    """Coordinate-wise median (no parameters)."""

    name: ClassVar[str] = "median"


@dataclass(frozen=True)
class TrimmedMean:
    """Coordinate-wise β-trimmed mean: drop the ⌊βn⌋ largest and the ⌊βn⌋ smallest values of each coordinate."""

    beta: float
    name: ClassVar[str] = "trimmed_mean"

    def __post_init__(self) -> None:
        if not 0 <= self.beta < 0.5:
            raise ValueError(
                f"trimmed_mean: beta (the fraction trimmed from each side) must be in [0, 0.5), got {self.beta}"
            )


def _kept_share(indices: torch.Tensor, n: int) -> torch.Tensor:
    """Per client, the share of coordinates in which it occupies one of the given sorted positions ([r, d] indices)."""
    counts = torch.bincount(indices.reshape(-1), minlength=n).to(torch.float64)
    return counts / indices.shape[1]


def sorted_columns(updates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each coordinate's values sorted ascending, ties in client order (a stable sort), with the clients' indices."""
    return torch.sort(updates, dim=0, stable=True)


def middle(values: torch.Tensor) -> torch.Tensor:
    """The median of each column of a sorted [n, d] tensor: the middle value, or the mean of the two middle ones."""
    n = values.shape[0]
    if n % 2 == 1:
        return values[n // 2]
    return (values[n // 2 - 1] + values[n // 2]) / 2


def median(
    settings: Median,  # noqa: ARG001 (every rule takes its settings first; the median has none to read)
    updates: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> RobustResult:
    check_updates(updates, weights)
    n = updates.shape[0]
    values, indices = sorted_columns(updates)
    rows = slice(n // 2, n // 2 + 1) if n % 2 == 1 else slice(n // 2 - 1, n // 2 + 1)
    return RobustResult(aggregate=middle(values), kept=_kept_share(indices[rows], n), scale=ones(n, updates.device))


def trim_count(beta: float, n: int) -> int:
    """k = ⌊βn⌋, robust to β·n landing a hair below an integer in floating point (0.29 · 100 = 28.999…)."""
    return math.floor(beta * n + 1e-9)


def trimmed_mean(settings: TrimmedMean, updates: torch.Tensor, weights: torch.Tensor | None = None) -> RobustResult:
    check_updates(updates, weights)
    n = updates.shape[0]
    k = trim_count(settings.beta, n)
    if n - 2 * k < 1:  # unreachable for β < 1/2, kept as the statement of the requirement
        raise ValueError(f"trimmed_mean with beta={settings.beta} trims all {n} updates; lower beta")
    values, indices = sorted_columns(updates)
    return RobustResult(
        aggregate=values[k : n - k].mean(dim=0), kept=_kept_share(indices[k : n - k], n), scale=ones(n, updates.device)
    )
