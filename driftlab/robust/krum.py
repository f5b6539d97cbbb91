"""Distance-based selection: Krum and multi-Krum (Blanchard, El Mhamdi, Guerraoui and Stainer, "Machine Learning
with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017) and Bulyan (El Mhamdi, Guerraoui and
Rouault, "The Hidden Vulnerability of Distributed Learning in Byzantium", ICML 2018).

With n updates of which at most f are Byzantine, and ``i → j`` meaning j is among
the n − f − 2 updates closest to x_i (squared Euclidean distance, ties in client
order, i itself excluded)::

    Krum:        score(i) = Σ_{i → j} ‖x_i − x_j‖²,        aggregate = x_{i*},  i* = argmin_i score(i)
    multi-Krum:  S = the m clients of lowest score,         aggregate = Σ_{i∈S} w_i x_i / Σ_{i∈S} w_i
    Bulyan:      S = θ = n − 2f clients picked by Krum one at a time, each pick removed before the next
                 (scores recomputed on the remaining set R with |R| − f − 2 neighbours, at least 1);
                 per coordinate j, with M_j the median of {x_ij : i ∈ S}, average the β = θ − 2f values
                 of S closest to M_j

Krum needs n > 2f + 2 (n − f − 2 ≥ f + 1 neighbours); Bulyan needs n ≥ 4f + 3.
Ties (equal scores, equal distances to the median) are broken by client
order, so the result depends on the updates and their order only.

Our choices where the papers leave room (docs/update-rules.md, "Robust
aggregation and attacks"): multi-Krum's default m is n − f; multi-Krum
averages the selected updates with the algorithm's weights renormalised over
them (Flower's ``Krum`` strategy does the same; the paper's average is uniform,
equal to this with uniform weights); Bulyan's coordinate-wise step counts
clients, unweighted, as the paper's; Bulyan's recursion reaches sets of size
down to 2f + 1 where |R| − f − 2 < 1, so its neighbour count is floored at 1
(zero neighbours would give every update the score 0 and pick by order).
The requirement is the paper's strict n > 2f + 2; the epfml code of
Karimireddy et al. also accepts n = 2f + 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from driftlab.robust.coordinatewise import middle, sorted_columns
from driftlab.robust.result import (
    RobustResult,
    check_byzantine,
    check_positive_integer,
    check_updates,
    ones,
    weighted_sum,
)


@dataclass(frozen=True)
class _Tolerating:
    """A rule's settings for at most ``byzantine`` = f attackers, a count its ``name`` checks."""

    byzantine: int
    name: ClassVar[str]

    def __post_init__(self) -> None:
        check_byzantine(self.byzantine, self.name)


@dataclass(frozen=True)
class Krum(_Tolerating):
    """Krum: the single update of lowest score, for at most ``byzantine`` = f attackers."""

    name: ClassVar[str] = "krum"


@dataclass(frozen=True)
class MultiKrum(_Tolerating):
    """Multi-Krum: the weighted mean of the ``selected`` = m updates of lowest Krum score (None: m = n − f)."""

    selected: int | None = None
    name: ClassVar[str] = "multi_krum"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.selected is not None:
            check_positive_integer(self.selected, self.name, "selected (m, how many updates to average)")


@dataclass(frozen=True)
class Bulyan(_Tolerating):
    """Bulyan over Krum, for at most ``byzantine`` = f attackers."""

    name: ClassVar[str] = "bulyan"


def squared_distances(updates: torch.Tensor) -> torch.Tensor:
    """[n, n] float64 ‖x_i − x_j‖², row by row: exact differences (no cancellation in ‖x‖² + ‖y‖² − 2xᵀy), O(n·d)
    memory."""
    n = updates.shape[0]
    rows = [((updates - updates[i]).to(torch.float64) ** 2).sum(dim=1) for i in range(n)]
    return torch.stack(rows)


def krum_scores(distances: torch.Tensor, neighbours: int) -> torch.Tensor:
    """score(i) = the sum of the ``neighbours`` smallest ‖x_i − x_j‖², j ≠ i, over the [r, r] distance matrix."""
    r = distances.shape[0]
    others = distances.masked_fill(torch.eye(r, dtype=torch.bool, device=distances.device), float("inf"))
    nearest = torch.sort(others, dim=1, stable=True).values[:, :neighbours]
    return nearest.sum(dim=1)


def _require_krum(n: int, f: int, rule: str) -> None:
    if n <= 2 * f + 2:
        raise ValueError(
            f"{rule} with f = {f} Byzantine clients needs n > 2f + 2 = {2 * f + 2} updates, got n = {n}: "
            f"sample at least {2 * f + 3} clients per round "
            f"or lower {rule}'s byzantine to at most {max((n - 3) // 2, 0)}"
            if n >= 3
            else f"{rule} needs at least 3 updates, got n = {n}: sample more clients per round"
        )


def _lowest(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the ``count`` lowest scores, ties in client order."""
    return torch.sort(scores, stable=True).indices[:count]


def krum(settings: Krum, updates: torch.Tensor, weights: torch.Tensor | None = None) -> RobustResult:
    return multi_krum(MultiKrum(settings.byzantine, selected=1), updates, weights)


def multi_krum(settings: MultiKrum, updates: torch.Tensor, weights: torch.Tensor | None = None) -> RobustResult:
    alphas = check_updates(updates, weights)
    n, f = updates.shape[0], settings.byzantine
    rule = "krum" if settings.selected == 1 else "multi_krum"
    _require_krum(n, f, rule)
    m = n - f if settings.selected is None else settings.selected
    if m > n:
        raise ValueError(f"multi_krum: selected m = {m} exceeds the n = {n} updates of the round; lower selected")
    scores = krum_scores(squared_distances(updates), n - f - 2)
    chosen = _lowest(scores, m)
    kept = torch.zeros(n, dtype=torch.float64, device=updates.device)
    kept[chosen] = 1.0
    if m == 1:  # Krum: the chosen update itself, whatever its weight
        aggregate = updates[chosen[0]].clone()
    else:
        mass = (alphas * kept).sum()
        if not float(mass) > 0:
            raise ValueError(f"{rule}: every selected update has weight 0; give the clients positive weights")
        aggregate = weighted_sum(updates, alphas * kept / mass)
    return RobustResult(aggregate=aggregate, kept=kept, scale=ones(n, updates.device), scores=scores)


def bulyan(settings: Bulyan, updates: torch.Tensor, weights: torch.Tensor | None = None) -> RobustResult:
    check_updates(updates, weights)
    n, f = updates.shape[0], settings.byzantine
    if n < 4 * f + 3:
        raise ValueError(
            f"bulyan with f = {f} Byzantine clients needs n ≥ 4f + 3 = {4 * f + 3} updates, got n = {n}: "
            f"sample at least {4 * f + 3} clients per round "
            f"or lower bulyan's byzantine to at most {max((n - 3) // 4, 0)}"
        )
    theta = n - 2 * f
    distances = squared_distances(updates)
    remaining = list(range(n))
    picked: list[int] = []
    first_scores = None
    for _ in range(theta):
        index = torch.tensor(remaining, device=updates.device)
        scores = krum_scores(distances[index][:, index], max(len(remaining) - f - 2, 1))
        if first_scores is None:
            first_scores = scores
        picked.append(remaining.pop(int(_lowest(scores, 1))))
    picked.sort()  # client order, so that the coordinate-wise ties below go to the earlier client
    selected = updates[picked]
    beta = theta - 2 * f
    values, _ = sorted_columns(selected)
    centre = middle(values)
    closest = torch.sort((selected - centre).abs(), dim=0, stable=True).indices[:beta]  # [β, d] rows of `selected`
    aggregate = torch.gather(selected, 0, closest).mean(dim=0)
    counts = torch.bincount(closest.reshape(-1), minlength=theta).to(torch.float64) / updates.shape[1]
    kept = torch.zeros(n, dtype=torch.float64, device=updates.device)
    kept[picked] = counts
    return RobustResult(aggregate=aggregate, kept=kept, scale=ones(n, updates.device), scores=first_scores)
