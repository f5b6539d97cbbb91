"""Clipping rules: norm bounding, and centered clipping with momentum.

Norm bounding (Sun, Kairouz, Suresh and McMahan, "Can You Really Backdoor
Federated Learning?", 2019): clip each update to norm M, then take the
weighted mean (α the given weights, normalised)::

    s_i = min(1, M / ‖x_i‖),     aggregate = Σ_i α_i s_i x_i

Centered clipping (Karimireddy, He and Jaggi, "Learning from History for
Byzantine Robust Optimization", ICML 2021, Algorithm 2 with its CC rule):
each client's input is its momentum, m_i ← (1 − β) x_i + β m_i (worker
momentum, kept here at the server per client id, which is the same arithmetic
since m_i is a function of client i's own reports), and the server clips the
inputs around its last aggregate v⁰ = v_{t−1} (0 before the first round)::

    v^{l+1} = v^l + Σ_i α_i clip_τ(m_i − v^l),   clip_τ(z) = z · min(1, τ / ‖z‖),   l = 0 … L−1
    aggregate = v^L,   carried to the next round as its v⁰

With uniform α this is the paper's (1/n) Σ.  ``scale[i]`` is client i's clip
factor in the last iteration.  A client's momentum starts at its first report
(m_i = x_i then), not at 0: with client sampling a client's first report may
come late, and a zero start would shrink it by (1 − β).  β = 0 stores no
momenta.  ``CenteredClippingState`` is what the aggregator carries between
rounds; the per-client momenta make it grow with the clients seen (β > 0 only).

The authors' code (epfml/byzantine-robust-optimizer, ``WorkerWithMomentum``)
keeps undamped momentum, m_i ← β m_i + g_i (first m_i = g_i), which is
1/(1 − β) times ours in steady state: a τ tuned there is τ(1 − β) here.  Its
``Clipping`` aggregator is the loop above with uniform weights and v⁰ the
last aggregate, as here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from driftlab.robust.result import RobustResult, check_positive_integer, check_updates, ones, weighted_sum


@dataclass(frozen=True)
class NormBound:
    max_norm: float  # M
    name: ClassVar[str] = "norm_bound"

    def __post_init__(self) -> None:
        if not self.max_norm > 0:
            raise ValueError(f"norm_bound: max_norm M must be positive, got {self.max_norm}")


@dataclass(frozen=True)
class CenteredClipping:
    radius: float  # τ
    iterations: int = 1  # L
    momentum: float = 0.0  # β
    name: ClassVar[str] = "centered_clipping"

    def __post_init__(self) -> None:
        if not self.radius > 0:
            raise ValueError(f"centered_clipping: radius τ must be positive (math.inf: no clipping), got {self.radius}")
        check_positive_integer(self.iterations, self.name, "iterations L")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"centered_clipping: momentum β must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class CenteredClippingState:
    centre: torch.Tensor | None = None  # v_{t−1}, the last aggregate
    momenta: Mapping[int, torch.Tensor] = field(default_factory=dict)  # client id -> m_i (β > 0 only)


def clip_factors(vectors: torch.Tensor, bound: float) -> torch.Tensor:
    """[n] float64 min(1, bound / ‖z_i‖), 1 for a zero row."""
    norms = torch.linalg.vector_norm(vectors.to(torch.float64), dim=1)
    return torch.where(norms > bound, bound / norms.clamp(min=torch.finfo(torch.float64).tiny), torch.ones_like(norms))


def norm_bound(settings: NormBound, updates: torch.Tensor, weights: torch.Tensor | None = None) -> RobustResult:
    alphas = check_updates(updates, weights)
    factors = clip_factors(updates, settings.max_norm)
    return RobustResult(
        aggregate=weighted_sum(updates, alphas * factors), kept=ones(updates.shape[0], updates.device), scale=factors
    )


def client_momenta(
    beta: float, updates: torch.Tensor, client_ids: Sequence[int] | None, momenta: Mapping[int, torch.Tensor]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Each client's momentum m_i ← (1 − β) x_i + β m_i (m_i = x_i at its first report), as ``[n, d]`` rows in the
    updates' order, and ``momenta`` with the senders' rows replaced.  ValueError without one distinct id per update."""
    n = updates.shape[0]
    if client_ids is None or len(client_ids) != n or len(set(client_ids)) != n:
        raise ValueError("centered_clipping with momentum β > 0 needs client_ids: one distinct id per update")
    rows = []
    for row, client in zip(updates, client_ids, strict=True):
        previous = momenta.get(int(client))
        rows.append(row.clone() if previous is None else (1 - beta) * row + beta * previous)
    inputs = torch.stack(rows)
    return inputs, {**momenta, **{int(client): inputs[i] for i, client in enumerate(client_ids)}}


def centered_clipping(
    settings: CenteredClipping,
    updates: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    state: CenteredClippingState | None = None,
    client_ids: Sequence[int] | None = None,
) -> RobustResult:
    alphas = check_updates(updates, weights)
    n = updates.shape[0]
    state = CenteredClippingState() if state is None else state
    momenta = dict(state.momenta)
    inputs = updates
    if settings.momentum > 0:
        inputs, momenta = client_momenta(settings.momentum, updates, client_ids, momenta)
    centre = (
        torch.zeros_like(updates[0])
        if state.centre is None
        else state.centre.to(device=updates.device, dtype=updates.dtype)
    )
    factors = ones(n, updates.device)
    for _ in range(settings.iterations):
        differences = inputs - centre
        factors = clip_factors(differences, settings.radius)
        centre = centre + weighted_sum(differences, alphas * factors)
    return RobustResult(
        aggregate=centre, kept=ones(n, updates.device), scale=factors, state=CenteredClippingState(centre, momenta)
    )
