"""FedAvg with Nesterov momentum on the server: an algorithm of your own, as a driftlab plugin.

The clients do what FedAvg's do; the server treats the average client change
as a gradient and takes a Nesterov momentum step on it (Reddi et al. 2020's
FedOpt family, with the look-ahead form PyTorch's ``SGD(nesterov=True)`` uses):

    client k:  θ_k = K steps of SGD on f_k from θ^{t−1}           (no correction)
    server:    q^t = Σ_{k∈P} w_k (θ^{t−1} − θ_k)                  (pseudo-gradient, w_k = n_k / Σ_P n_j)
               m^t = β m^{t−1} + q^t,                 m^0 = 0
               θ^t = θ^{t−1} − η_g (q^t + β m^t)

At β = 0 and η_g = 1 this is FedAvg (θ^t = θ̄).  Every reporting client is
averaged, stragglers' partial work included; if no client reports, nothing changes.

Nothing of driftlab is edited to run it: a config names this file under
``plugins`` (a path relative to the config or sweep file), and importing it
registers the algorithm with one call at the bottom::

    plugins = ["nesterov_avg.py"]
    [algorithm]
    name = "nesterov_avg"
    momentum = 0.9

Example:
    >>> import torch
    >>> from driftlab.simulation.seam import RoundContext
    >>> algorithm = build(momentum=0.5)
    >>> server = algorithm.server_init(torch.zeros(1))
    >>> server, _ = algorithm.server_update(server, [ClientMessage(torch.ones(1), 1, 1)], RoundContext(1, 1, 1, 1.0))
    >>> server.params   # q = −1, m = −1, θ = 0 − (−1 − 0.5)
    tensor([1.5000])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from driftlab.algorithms import AlgorithmEntry, register
from driftlab.algorithms.aggregation import check_aggregation, client_weight, weighted_mean
from driftlab.algorithms.fedavg import ClientMessage, ClientView  # the clients are FedAvg's: θ^{t−1} down, θ_k up
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, options
from driftlab.simulation import seam


class Config(AlgorithmConfig):
    """``[algorithm]`` section (the server step is this module's own: keep ``server.optimizer = "sgd"``)."""

    name: Literal["nesterov_avg"] = "nesterov_avg"
    momentum: float = Field(0.9, ge=0, lt=1, description="β, the server's Nesterov momentum")
    aggregation: Aggregation = Field("weighted", description="w_k = n_k / Σ n_j (weighted) or 1/|P| (uniform)")


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # θ^t
    momentum: torch.Tensor  # m^t


def build(momentum: float = 0.9, aggregation: str = "weighted") -> seam.Algorithm:
    """FedAvg whose server takes a Nesterov momentum step of momentum ``momentum`` (β) on the pseudo-gradient."""
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    check_aggregation(aggregation)  # before any work

    def server_init(initial_params: torch.Tensor) -> ServerState:
        return ServerState(initial_params, torch.zeros_like(initial_params))

    def client_objective(view: ClientView, client_state: None, context: seam.ClientContext) -> seam.GradientCorrection:
        return seam.NO_CORRECTION

    def client_finish(
        view: ClientView, client_state: None, context: seam.ClientContext, update: seam.ClientUpdate
    ) -> tuple[None, ClientMessage]:
        return None, ClientMessage(update.final_params, context.num_samples, context.multiplicity)

    def server_update(
        server: ServerState, messages: Sequence[ClientMessage], context: seam.RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        if not messages:
            return server, {}
        weights = [client_weight(m.num_samples, m.multiplicity, aggregation) for m in messages]
        pseudo_gradient = server.params - weighted_mean([m.params for m in messages], weights)
        new_momentum = momentum * server.momentum + pseudo_gradient
        params = server.params - context.server_learning_rate * (pseudo_gradient + momentum * new_momentum)
        return ServerState(params, new_momentum), {"momentum_norm": float(torch.linalg.vector_norm(new_momentum))}

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params)

    return seam.Algorithm("nesterov_avg", server_init, client_objective, client_finish, server_update, broadcast)


def from_config(config: Config, server_optimizer: Any) -> seam.Algorithm:  # the server step is this module's own
    return build(**options(config))


register(AlgorithmEntry("nesterov_avg", Config, from_config, label="Nesterov FedAvg", owns_server_step=True))
