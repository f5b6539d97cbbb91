"""Applying a server optimizer to the average of the clients' models."""

from __future__ import annotations

from typing import Any

import torch


def apply_server_optimizer(
    optimizer: Any, state: Any, params: torch.Tensor, client_average: torch.Tensor, learning_rate: float
) -> tuple[torch.Tensor, Any]:
    """One server step on the pseudo-gradient ``q = θ^{t−1} − client_average``.

    Returns ``(θ^t, new optimizer state)``.  SGD (a chain of
    ``scale_by_learning_rate()`` alone, ``optimizer.plain_step``) with ``η_g = 1`` is FedAvg:
    ``θ − 1·(θ − θ̄) = θ̄``.  In floating point the subtraction and its undoing
    round twice, so that case returns ``θ̄`` itself: FedAvg is then exactly the
    textbook average, and algorithms whose server step is a plain mean (AdaBest
    with β = 0) agree with it bit for bit.
    """
    pseudo_gradient = params - client_average
    new_params, new_state = optimizer.update(state, params, pseudo_gradient, learning_rate)
    if optimizer.plain_step and learning_rate == 1.0:
        new_params = client_average
    return new_params, new_state
