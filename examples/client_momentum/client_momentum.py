"""FedAvg whose clients run heavy-ball momentum over their local steps: a non-affine local step, as a driftlab plugin.

Each selected client starts from θ^{t−1} with a zero momentum buffer and runs
K steps of SGD with heavy-ball momentum (PyTorch's ``SGD(momentum=β)``, no
dampening); the server is FedAvg's, server optimizer included:

    client k:  v_0 = 0,  θ_0 = θ^{t−1}
               v_{s+1} = β v_s + g_s,     θ_{s+1} = θ_s − η_l v_{s+1}        (s = 0 … K−1)
               g_s = the usual local gradient: ∇f_k(θ_s; batch) clipped, plus weight decay
    server:    θ^t = ServerOpt(θ^{t−1}, θ^{t−1} − Σ_{k∈P} w_k θ_k, η_g)       (FedAvg, w_k = n_k / Σ_P n_j)

This is local momentum SGD with periodic averaging: the base optimizer of
SlowMo (Wang, Tantia, Ballas, Rabbat, "SlowMo: Improving Communication-Efficient
Distributed SGD with Slow Momentum", ICLR 2020) with its slow momentum off
(α = 1, β_slow = 0), and the local momentum SGD analysed by Yu, Jin, Yang (ICML
2019).  Here the buffer restarts at zero every round, so clients keep no state
between rounds.  (FedAvgM of Hsu, Qi, Brown 2019 is momentum on the *server*:
``server.optimizer = "sgd"`` with ``server.momentum`` in driftlab.)  At β = 0 this
is FedAvg step for step.

The momentum is a ``LocalStep`` (``driftlab.simulation.backends.objectives``): the
algorithm's own local update in place of ``θ ← θ − η_l g``; both training
backends run it.  Nothing of driftlab is edited: a config or sweep names this
file under ``plugins`` and importing it registers the algorithm::

    plugins = ["client_momentum.py"]
    [algorithm]
    name = "fedavg_client_momentum"
    momentum = 0.5

Example:
    >>> import torch
    >>> step = heavy_ball(0.5)
    >>> params, (velocity,) = step(torch.tensor([1.0]), torch.tensor([2.0]), (torch.tensor([1.0]),), 0.1)
    >>> velocity, params   # v = 0.5·1 + 2, θ = 1 − 0.1·2.5
    (tensor([2.5000]), tensor([0.7500]))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from pydantic import Field

from driftlab.algorithms import AlgorithmEntry, fedavg, register
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, Incomplete, options
from driftlab.simulation.backends.objectives import LocalObjective, LocalStep
from driftlab.simulation.seam import Algorithm, ClientContext

NAME = "fedavg_client_momentum"


class Config(AlgorithmConfig):
    """``[algorithm]`` section (the server optimizer is chosen in ``[server]``, as for FedAvg)."""

    name: Literal["fedavg_client_momentum"] = NAME
    momentum: float = Field(
        0.9, ge=0, lt=1, description="β, the clients' heavy-ball momentum (buffer reset every round)"
    )
    aggregation: Aggregation = Field("weighted", description="w_k = n_k / Σ n_j (weighted) or 1/|P| (uniform)")
    incomplete: Incomplete = Field("drop", description="a straggler's partial work: drop it (FedAvg) or keep it")


def heavy_ball(beta: float):
    """The local step ``v ← β v + g;  θ ← θ − η v`` on one client's flat tensors (state: ``(v,)``)."""

    def step(params: torch.Tensor, gradient: torch.Tensor, state: tuple[torch.Tensor, ...], learning_rate: float):
        (velocity,) = state
        velocity = beta * velocity + gradient
        return params - learning_rate * velocity, (velocity,)

    return step


def build(
    server_optimizer: Any, momentum: float = 0.9, aggregation: str = "weighted", incomplete: str = "drop"
) -> Algorithm:
    """FedAvg (``fedavg.build``) whose clients take heavy-ball steps of momentum ``momentum`` (β)."""
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    base = fedavg.build(server_optimizer, aggregation=aggregation, incomplete=incomplete)
    step = heavy_ball(momentum)  # one function for every client (the backends group clients by it)

    def client_objective(view: Any, client_state: None, context: ClientContext) -> LocalObjective:
        return LocalObjective(local_step=LocalStep(step, initial_state=(torch.zeros_like(view.params),)))

    return dataclasses.replace(base, name=NAME, client_objective=client_objective)


def from_config(config: Config, server_optimizer: Any) -> Algorithm:
    return build(server_optimizer, **options(config))


register(AlgorithmEntry(NAME, Config, from_config, label="FedAvg + client momentum", keeps_partial_work=False))
