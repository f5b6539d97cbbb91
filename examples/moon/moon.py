"""MOON-style model-contrastive FedAvg: a non-affine loss term on the model's outputs, as a driftlab plugin.

MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021) adds to
each client's cross-entropy a contrastive term that pulls the local model's
representation of an example towards the global model's and away from the
client's own previous model's:

    client k:  min_θ  f_k(θ) + μ · mean_i ℓ_con(x_i),        from θ^{t−1}
               ℓ_con(x) = −log( e^{sim(z, z_g)/τ} / (e^{sim(z, z_g)/τ} + e^{sim(z, z_prev)/τ}) )
               z = model(θ; x),  z_g = model(θ^{t−1}; x),  z_prev = model(θ_k^{prev}; x),  sim = cosine
    server:    θ^t = ServerOpt(θ^{t−1}, θ^{t−1} − Σ_{k∈P} w_k θ_k, η_g)         (FedAvg)

**Not the paper's representation**: the paper takes ``z`` from a projection
head on top of the network's features; here ``z`` is the model's output (its
logits), so the example runs with any model of the zoo.  A module of your own
whose output is the projection (and a loss that reads the logits from it) gives
the paper's form.  The previous model is the client's last local model; a
client that has not trained yet uses the initial model θ^0.  μ = 1 and τ = 0.5
are the paper's defaults for most of its data sets (μ = 5 for CIFAR-10).

The term is a ``LossTerm`` (``driftlab.simulation.backends.objectives``): the global and
previous models are its tensors, so the vectorized backend batches the
clients' terms with ``vmap``.  A config or sweep names this file under
``plugins``::

    plugins = ["moon.py"]
    [algorithm]
    name = "moon"
    mu = 1.0

Example:
    >>> import torch
    >>> from driftlab.simulation.backends.objectives import LocalBatch
    >>> term = contrastive_term(mu=1.0, temperature=0.5)
    >>> outputs = torch.tensor([[1.0, 0.0]])
    >>> batch = LocalBatch(torch.zeros(1), outputs, torch.zeros(1, 1), torch.zeros(1), torch.ones(1), lambda p, x: p.expand(1, 2))
    >>> # z = z_g (sim 1) and z ⟂ z_prev (sim 0): ℓ = −log(e² / (e² + e⁰)) = log(1 + e⁻²)
    >>> round(float(term(batch, torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))), 4)
    0.1269
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from driftlab.algorithms import AlgorithmEntry, fedavg, register
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, Incomplete, options
from driftlab.simulation.backends.objectives import LocalBatch, LocalObjective, LossTerm
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate


class Config(AlgorithmConfig):
    """``[algorithm]`` section (the server optimizer is chosen in ``[server]``, as for FedAvg)."""

    name: Literal["moon"] = "moon"
    mu: float = Field(1.0, ge=0, description="μ, the weight of the model-contrastive term")
    temperature: float = Field(0.5, gt=0, description="τ, the temperature of the contrastive term")
    aggregation: Aggregation = Field("weighted", description="w_k = n_k / Σ n_j (weighted) or 1/|P| (uniform)")
    incomplete: Incomplete = Field("drop", description="a straggler's partial work: drop it (FedAvg) or keep it")


@dataclass(frozen=True)
class ClientState:
    previous_params: torch.Tensor  # θ_k^{prev}, the client's last local model


def contrastive_term(mu: float, temperature: float):
    """``μ · Σ_i w_i ℓ_con(x_i)`` on the batch's outputs, given the global and previous models (module docstring)."""

    def term(batch: LocalBatch, global_params: torch.Tensor, previous_params: torch.Tensor) -> torch.Tensor:
        z = batch.outputs
        positive = F.cosine_similarity(z, batch.forward(global_params, batch.inputs), dim=-1) / temperature
        negative = F.cosine_similarity(z, batch.forward(previous_params, batch.inputs), dim=-1) / temperature
        per_example = torch.logsumexp(torch.stack([positive, negative]), dim=0) - positive
        return mu * (batch.weights * per_example).sum()

    return term


def build(
    server_optimizer: Any,
    mu: float = 1.0,
    temperature: float = 0.5,
    aggregation: str = "weighted",
    incomplete: str = "drop",
) -> Algorithm:
    """FedAvg (``fedavg.build``) whose clients add MOON's contrastive term of weight ``mu`` and temperature ``temperature``."""
    if mu < 0 or temperature <= 0:
        raise ValueError(f"need mu >= 0 and temperature > 0, got mu={mu}, temperature={temperature}")
    base = fedavg.build(server_optimizer, aggregation=aggregation, incomplete=incomplete)
    term = contrastive_term(mu, temperature)  # one function for every client (the backends batch clients by it)

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        return ClientState(initial_params)

    def client_objective(view: Any, client: ClientState, context: ClientContext) -> LocalObjective:
        return LocalObjective(loss_term=LossTerm(term, (view.params, client.previous_params)))

    def client_finish(view: Any, client: ClientState, context: ClientContext, update: ClientUpdate):
        _, message = base.client_finish(view, None, context, update)
        return ClientState(update.trained_params), message

    return dataclasses.replace(
        base,
        name="moon",
        client_state_init=client_state_init,
        client_objective=client_objective,
        client_finish=client_finish,
    )


def from_config(config: Config, server_optimizer: Any) -> Algorithm:
    return build(server_optimizer, **options(config))


register(AlgorithmEntry("moon", Config, from_config, label="MOON (outputs)", keeps_partial_work=False))
