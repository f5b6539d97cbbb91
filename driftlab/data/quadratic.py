"""Heterogeneous quadratic clients whose global minimiser is known in closed form.

Decaying-K paper (Section 3): client ``i`` has

    f_i(x) = ½ z_i x² − x,     z_i on a grid over [1, 3],    selected with p_i ∝ 1/√z_i,

so ``F(x) = Σ_i p_i f_i(x)`` is minimised at ``x* = Σ p_i / Σ p_i z_i``
(``x* = 3(√3 − 1)/(3√3 − 1) ≈ 0.523`` for the continuous density).  K steps of
gradient descent with step ``γ`` from ``x`` give
``x_i − 1/z_i = (1 − γ z_i)^K (x − 1/z_i)``, so FedAvg's fixed point is the
surrogate ``x̃ = E_p[φ_i / z_i] / E_p[φ_i]`` with ``φ_i = 1 − (1 − γ z_i)^K``,
which differs from ``x*`` unless ``K = 1``.

The multi-dimensional family has diagonal curvatures:
``f_i(x) = ½ Σ_j a_ij x_j² − b_iᵀ x`` with minimiser
``x*_j = Σ_i p_i b_ij / Σ_i p_i a_ij``.

Encoding as a federated data set: every example of client ``i`` is the row
``[a_i, b_i]`` and ``QuadraticObjective`` returns ``½ Σ a x² − bᵀx`` for it.
Client ``i`` holds ``n_i`` identical rows with ``n_i ∝ p_i`` (rounded to
integers), so n_k-weighted aggregation and ``sampling.mode = weighted`` use
exactly the probabilities ``p_i = n_i / Σ n_j``; ``known_minimizer`` is
computed from those integer weights.  A batch of ``max n_i`` rows is the full
local gradient.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from driftlab.data.federated import FederatedDataset

CONTINUOUS_MINIMIZER = 3 * (3**0.5 - 1) / (3 * 3**0.5 - 1)  # ≈ 0.5234 for z ~ density ∝ 1/√z on [1, 3]


class QuadraticObjective(nn.Module):
    """``x ∈ R^d``; ``forward([a, b]) = ½ Σ_j a_j x_j² − Σ_j b_j x_j`` per row (the objective, not logits).

    ``x`` starts at ``start`` in every coordinate (the decaying-K paper's x_1 = 0.4; 0 by default)."""

    def __init__(self, dimension: int, start: float = 0.0) -> None:
        super().__init__()
        self.dimension = dimension
        self.x = nn.Parameter(torch.full((dimension,), float(start)))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        curvature, linear = rows[:, : self.dimension], rows[:, self.dimension :]
        return 0.5 * (curvature * self.x**2).sum(dim=1) - (linear * self.x).sum(dim=1)


def quadratic_federated(
    curvatures: np.ndarray, linear: np.ndarray, weights: np.ndarray, name: str, rows_per_unit_weight: int = 1000
) -> FederatedDataset:
    """Clients ``f_i(x) = ½ Σ_j A[i,j] x_j² − B[i]ᵀx`` with probabilities ``∝ weights``."""
    curvatures = np.atleast_2d(np.asarray(curvatures, dtype=np.float64))
    linear = np.atleast_2d(np.asarray(linear, dtype=np.float64))
    weights = np.asarray(weights, dtype=np.float64)
    if curvatures.shape != linear.shape or curvatures.shape[0] != len(weights):
        raise ValueError(
            "need curvatures and linear terms of one shape [clients, dim] and one weight per client; "
            f"got {curvatures.shape}, {linear.shape}, {weights.shape}"
        )
    if (curvatures <= 0).any():
        raise ValueError("curvatures must be > 0 so every client's objective is strongly convex")
    if (weights <= 0).any():
        raise ValueError("client weights must be > 0")
    counts = np.maximum(1, np.rint(weights / weights.max() * rows_per_unit_weight)).astype(np.int64)
    rows = np.repeat(np.concatenate([curvatures, linear], axis=1), counts, axis=0)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    client_indices = tuple(np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(len(counts)))
    probabilities = counts / counts.sum()
    minimizer = (probabilities[:, None] * linear).sum(0) / (probabilities[:, None] * curvatures).sum(0)
    # float64 so the known minimiser is exact for float64 runs (float32 runs round the rows once)
    inputs = torch.tensor(rows, dtype=torch.float64)
    targets = torch.zeros(len(rows), dtype=torch.int64)
    test_rows = torch.tensor(np.concatenate([curvatures, linear], axis=1), dtype=torch.float64)
    return FederatedDataset(
        name=name,
        train_inputs=inputs,
        train_targets=targets,
        test_inputs=test_rows,
        test_targets=torch.zeros(len(test_rows), dtype=torch.int64),
        client_indices=client_indices,
        num_classes=1,
        known_minimizer=minimizer,
    )


def scalar_quadratic_clients(num_clients: int = 20, low: float = 1.0, high: float = 3.0) -> FederatedDataset:
    """The decaying-K paper's 1-D family: ``f_i(x) = ½ z_i x² − x``, ``z_i`` on a grid over ``[low, high]``, ``p_i ∝ 1/√z_i``."""
    if num_clients < 1 or not 0 < low <= high:
        raise ValueError(f"need num_clients >= 1 and 0 < low <= high; got {num_clients}, {low}, {high}")
    z = np.linspace(low, high, num_clients)
    return quadratic_federated(
        z[:, None], np.ones((num_clients, 1)), 1 / np.sqrt(z), name=f"quadratic1d({num_clients})"
    )


def surrogate_minimizer(z: np.ndarray, probabilities: np.ndarray, learning_rate: float, local_steps: int) -> float:
    """FedAvg's fixed point on the 1-D family: ``E_p[φ/z] / E_p[φ]``, ``φ = 1 − (1 − γ z)^K``."""
    phi = 1 - (1 - learning_rate * np.asarray(z)) ** local_steps
    return float((probabilities * phi / z).sum() / (probabilities * phi).sum())


def random_quadratic_clients(
    num_clients: int, dimension: int, seed: int, heterogeneity: float = 1.0
) -> FederatedDataset:
    """A multi-dimensional heterogeneous family: ``a_ij ~ U[1, 1 + 4h]``, ``b_ij ~ N(0, h²) + 1``, equal weights."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence((seed, 0x9A7))))
    curvatures = rng.uniform(1.0, 1.0 + 4.0 * heterogeneity, size=(num_clients, dimension))
    linear = 1.0 + heterogeneity * rng.standard_normal((num_clients, dimension))
    return quadratic_federated(curvatures, linear, np.ones(num_clients), name=f"quadratic({num_clients}x{dimension})")
