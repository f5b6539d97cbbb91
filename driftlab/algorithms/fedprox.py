"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

Seed paper 001, as algorithms.md states it:

    client k:  h_k(θ) = f_k(θ) + μ/2 ‖θ − θ^{t−1}‖²
               K steps of SGD on h_k from θ^{t−1}:  ∇ += μ (θ − θ^{t−1})
               → GradientCorrection(linear=None, quadratic=μ, reference=θ^{t−1})
    server:    exactly FedAvg: θ̄ = Σ_{k∈P} w_k θ_k,  θ^t = ServerOpt(θ^{t−1}, θ^{t−1} − θ̄, η_g)

with ``w_k = n_k / Σ_P n_j`` ("weighted", default, the authors' code) or
``1/|P|`` ("uniform").  The server half is FedAvg's own (``fedavg.build``,
keeping stragglers) with the client objective replaced, so FedProx composes
with every server optimizer (FedAdam + proximal clients, ...).

``μ = 0`` is FedAvg bit for bit: the client then gets no correction at all
(not a zero one), so its local step does exactly FedAvg's arithmetic.

Client sampling: both of the paper's modes are the engine's
(``sampling.mode``): "uniform" without replacement with the weighted average
(the authors' code), or "weighted", ``K`` draws with ``p_k = n_k/n`` (FedProx
Algorithm 2) — use it with ``aggregation = "uniform"`` for the paper's simple
average; a client drawn twice counts twice.

Partial work and dropouts: FedProx keeps partial work.  A client that reports
after fewer steps than planned (a straggler, or the γ-inexact solver stopping
it early — both engine features) is averaged like any other; a client that
does not report sends nothing and is left out of the average.

Under ``[privacy]``: the server half is FedAvg's, and so is the form
(``aggregation.model_change_form``): a message reveals ``θ_k − θ^{t−1}``, clipped to
C it has sensitivity C on the sum, and the noise reaches ``θ̄`` divided by the
expected cohort m.  Only ``aggregation = "uniform"`` has a form (the n_k weights
are private and unbounded), and only for multiplicity 1 (poisson or uniform
sampling, not Algorithm 2's draws with replacement).

Asynchronously (``[asynchronous]``, FedBuff): the server half, and with it its
declaration, is FedAvg's (``fedavg`` module docstring): ``aggregation =
"uniform"`` only.  A client's proximal reference is the model ``θ^{v_k}`` it was
dispatched with, the one its change ``Δ_k`` is measured from.

Example:
    >>> from driftlab.algorithms import fedprox
    >>> from driftlab.optim.server import make_server_optimizer
    >>> algorithm = fedprox.build(make_server_optimizer("sgd"), mu=0.01)
    >>> import torch
    >>> view = algorithm.broadcast(algorithm.server_init(torch.zeros(3)))
    >>> algorithm.client_objective(view, None, None).quadratic
    0.01
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field

from driftlab.algorithms import fedavg
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, options
from driftlab.simulation.seam import NO_CORRECTION, Algorithm, ClientContext, GradientCorrection

ClientView = fedavg.ClientView  # FedAvg's server half broadcasts θ^{t−1}, the proximal reference too


class Config(AlgorithmConfig):
    """``[algorithm]`` section for FedProx (the server optimizer is chosen in ``[server]``)."""

    name: Literal["fedprox"] = "fedprox"
    mu: float = Field(
        0.01,
        ge=0,
        description="proximal coefficient μ ≥ 0: the local gradient adds μ(θ − θ^{t−1}); 0 is FedAvg exactly",
    )
    aggregation: Aggregation = Field(
        "weighted",
        description="weighted: w_k = n_k / Σ n_j (default, authors' code); uniform: mean over reporting clients (Algorithm 2)",
    )


def build(server_optimizer: Any, mu: float = 0.01, aggregation: str = "weighted") -> Algorithm:
    """FedProx with proximal coefficient ``mu`` ≥ 0: FedAvg's server half (``server_optimizer``,
    ``aggregation``, stragglers kept) with the proximal client objective."""
    if mu < 0:
        raise ValueError(f"fedprox needs mu >= 0, got {mu}")
    server_half = fedavg.build(server_optimizer, aggregation=aggregation, incomplete="keep")

    def client_objective(view: ClientView, client_state: None, context: ClientContext) -> GradientCorrection:
        if mu == 0:
            return NO_CORRECTION  # no term at all, so the step is FedAvg's to the bit
        return GradientCorrection(quadratic=mu, reference=view.params)

    return dataclasses.replace(server_half, name="fedprox", client_objective=client_objective)


def from_config(config: Config, server_optimizer: Any) -> Algorithm:
    return build(server_optimizer, **options(config))
