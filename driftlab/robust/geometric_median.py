"""The geometric median by smoothed Weiszfeld iterations: RFA (Pillutla, Kakade and Harchaoui, "Robust Aggregation
for Federated Learning", IEEE Transactions on Signal Processing 2022).

The weighted geometric median minimises g(v) = Σ_i α_i ‖v − x_i‖ (α the given
weights, normalised).  The smoothed Weiszfeld step, from v⁰ = Σ_i α_i x_i::

    β_i = α_i / max(ν, ‖v^t − x_i‖),     v^{t+1} = Σ_i β_i x_i / Σ_i β_i

runs for at most T iterations, stopping early once the objective settles,
|g(v^t) − g(v^{t+1})| < tolerance · g(v^{t+1}) (tolerance 0: always T steps).
ν > 0 keeps a step defined when v lands on an update.  ``scale[i]`` is client
i's share in the last step over its given share, (β_i / Σβ) / α_i: below 1 for
the clients far from the median.  The start at the weighted mean, the
stopping rule and the defaults ν = 1e-5, T = 4, tolerance 1e-6 are the
authors' code's (krishnap25/RFA, ``ServerModel.geometric_median_update``:
``eps``, ``maxiter``, ``ftol``); the epfml code of Karimireddy et al. starts
at 0 instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from driftlab.robust.result import RobustResult, check_positive_integer, check_updates, weighted_sum


@dataclass(frozen=True)
class GeometricMedian:
    smoothing: float = 1e-5  # ν
    iterations: int = 4  # T
    tolerance: float = 1e-6
    name: ClassVar[str] = "geometric_median"

    def __post_init__(self) -> None:
        if not self.smoothing > 0:
            raise ValueError(f"geometric_median: smoothing ν must be positive, got {self.smoothing}")
        check_positive_integer(self.iterations, self.name, "iterations T")
        if not self.tolerance >= 0:
            raise ValueError(f"geometric_median: tolerance must be ≥ 0, got {self.tolerance}")


def _objective(updates: torch.Tensor, alphas: torch.Tensor, point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    distances = torch.linalg.vector_norm((updates - point).to(torch.float64), dim=1)
    return (alphas * distances).sum(), distances


def geometric_median(
    settings: GeometricMedian, updates: torch.Tensor, weights: torch.Tensor | None = None
) -> RobustResult:
    alphas = check_updates(updates, weights)
    point = weighted_sum(updates, alphas)
    value, distances = _objective(updates, alphas, point)
    coefficients = alphas
    for _ in range(settings.iterations):
        betas = alphas / distances.clamp(min=settings.smoothing)
        coefficients = betas / betas.sum()
        candidate = weighted_sum(updates, coefficients)
        new_value, new_distances = _objective(updates, alphas, candidate)
        point, distances, change, value = candidate, new_distances, abs(value - new_value), new_value
        if change < settings.tolerance * new_value:
            break
    scale = torch.where(
        alphas > 0, coefficients / alphas.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(alphas)
    )
    return RobustResult(aggregate=point, kept=torch.ones_like(alphas), scale=scale)
