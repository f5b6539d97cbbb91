"""What a robust aggregator returns, and the input checks every aggregator shares.

``RobustResult.aggregate`` is the ``[d]`` vector that replaces the mean of the
round's reported changes; ``kept`` and ``scale`` are the per-client record a
report shows (who was dropped, who was down-weighted):

* ``kept[i]``: the share of coordinates in which client i's value entered the
  aggregate (1 for rules that use every update whole, 0 for a client a
  selection rule dropped, a fraction for coordinate-wise rules);
* ``scale[i]``: the factor the rule put on client i's update relative to the
  plain weighted mean (its clip factor for norm bounding and centered
  clipping, its Weiszfeld weight over its given weight for the geometric
  median; 1 where the rule does not reweight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RobustResult:
    aggregate: torch.Tensor  # [d], in the updates' dtype
    kept: torch.Tensor  # [n] float64 in [0, 1]
    scale: torch.Tensor  # [n] float64 ≥ 0
    state: Any = None  # what the aggregator carries to the next round (centered clipping), else None
    scores: torch.Tensor | None = None  # [n] float64 Krum scores (Krum, multi-Krum, Bulyan's first pick), else None

    @property
    def dropped(self) -> torch.Tensor:
        """[n] bool: clients none of whose coordinates entered the aggregate."""
        return self.kept == 0

    @property
    def down_weighted(self) -> torch.Tensor:
        """[n] bool: clients the rule scaled below their plain weight, or kept only in part."""
        return (self.scale < 1) | ((self.kept > 0) & (self.kept < 1))


def check_updates(updates: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The weights normalised to sum 1 (uniform when None), after checking both inputs; float64, on the updates'
    device."""
    if not isinstance(updates, torch.Tensor) or updates.dim() != 2 or not updates.is_floating_point():
        raise ValueError(
            "robust aggregation takes the round's updates as a floating-point [n, d] tensor, one row a client"
        )
    n = updates.shape[0]
    if n == 0:
        raise ValueError("robust aggregation needs at least one update; a round in which nobody reported has none")
    if updates.shape[1] == 0:
        raise ValueError("robust aggregation got updates with no coordinates (d = 0); there is nothing to aggregate")
    if not bool(torch.isfinite(updates).all()):
        raise ValueError(
            "robust aggregation got a non-finite update (inf or NaN): drop such replies before aggregating"
        )
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=torch.float64, device=updates.device)
    weights = torch.as_tensor(weights, dtype=torch.float64, device=updates.device)
    if weights.shape != (n,):
        raise ValueError(
            f"robust aggregation needs one weight per update: {n} updates, weights of shape {tuple(weights.shape)}"
        )
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()) or not float(weights.sum()) > 0:
        raise ValueError("robust aggregation weights must be finite, non-negative and not all zero")
    return weights / weights.sum()


def check_byzantine(f: int, rule: str) -> None:
    if not isinstance(f, int) or isinstance(f, bool) or f < 0:
        raise ValueError(f"{rule}: the number of Byzantine clients f must be a non-negative integer, got {f!r}")


def check_positive_integer(value: int, rule: str, what: str) -> None:
    """``value``, a count of ``rule``'s named ``what`` in the message, must be an integer of at least 1."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{rule}: {what} must be a positive integer, got {value!r}")


def ones(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float64, device=device)


def weighted_sum(updates: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """Σ_i c_i x_i in the updates' dtype (coefficients computed in float64)."""
    return (coefficients.to(updates.dtype).unsqueeze(1) * updates).sum(dim=0)
