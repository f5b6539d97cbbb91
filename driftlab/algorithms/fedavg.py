"""FedAvg (McMahan et al. 2017) with FedSGD/FedOpt server optimizers.

Decaying-K paper (Algorithm 3) and Reddi et al. 2020,
as docs/update-rules.md states them:

    client k:  θ_k = K steps of SGD on f_k from θ^{t−1}           (no correction)
    server:    q   = Σ_{k∈P} w_k (θ^{t−1} − θ_k) = θ^{t−1} − θ̄,    θ̄ = Σ_{k∈P} w_k θ_k
               θ^t = ServerOpt(θ^{t−1}, q, η_g,t)

with ``w_k = n_k / Σ_P n_j`` ("weighted", default) or ``1/|P|`` ("uniform").
The server folds each message into ``Σ_P r_k θ_k`` and ``Σ_P r_k`` (``r_k = n_k``
or 1) as it arrives and divides once (``aggregation.RunningMean``).
SGD with ``η_g = 1`` is FedAvg itself (``θ^t = θ̄``); FedAdam is this module
with the Adam server optimizer; FedAvgM with momentum.

Partial work and dropouts: by default FedAvg drops incomplete clients
(``incomplete = "drop"``: a straggler's partial work is discarded and nothing is
uploaded, as in the FedProx authors' FedAvg baseline); ``"keep"`` averages them
like everyone else.  An inactive client sends nothing.  If no client reports,
the server model stays as it is.

Under ``[privacy]`` (client-level DP, ``driftlab.privacy``): a message reveals
``x_k = θ_k − θ^{t−1}`` (``Algorithm.release``).  With ``aggregation =
"uniform"`` the fold is ``θ̄ = θ^{t−1} + Σ_P x_k / m``, linear in the released
vectors with unit weight per message, so clipping each ``x_k`` to norm C makes
the sensitivity of ``Σ_P x_k`` C (adding or removing one client) and the
server's noise N(0, σ²) on that sum is noise σ/m on ``θ̄``; ``m`` is the public
``RoundContext.mean_denominator`` (the expected cohort qN), since ``|P|`` is
itself private.  The promise holds for multiplicity 1 (poisson or uniform
sampling; a client drawn twice by ``sampling.mode = "weighted"`` would weigh
twice).  ``aggregation = "weighted"`` has no form: its weights ``n_k`` are
private and unbounded.

Asynchronously (``[asynchronous]``, FedBuff: Nguyen et al., AISTATS 2022,
Algorithm 1), with ``aggregation = "uniform"`` only: the server holds each
arriving change ``Δ_k = θ_k − θ^{v_k}`` (``v_k`` the version the client started
from, ``τ_k = v − v_k``) and, after ``B`` arrivals, runs this fold on the
carriers ``θ^v + s(τ_k) Δ_k`` with unit weight and ``mean_denominator = B``:

    θ̄ = θ^v + (1/B) Σ_buffer s(τ_k) Δ_k,    θ^{v+1} = ServerOpt(θ^v, θ^v − θ̄, η_g)

(FedBuff's ``x ← x − η_g Δ̄`` is SGD here).  ``"weighted"`` is refused: FedBuff's
buffer mean has equal weights.

Example:
    >>> from driftlab.algorithms import fedavg
    >>> from driftlab.optim.server import make_server_optimizer
    >>> algorithm = fedavg.build(make_server_optimizer("adam"), aggregation="weighted")
    >>> algorithm.name
    'fedavg'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field

from driftlab.algorithms.aggregation import (
    WEIGHTED_REFUSAL,  # noqa: F401 - read as fedavg.WEIGHTED_REFUSAL
    ModelSums,
    averaging_parts,
    check_aggregation,
    model_change_form,
    model_mean_fold,
    server_step,
)
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, Incomplete, options
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, Reason, lacking
from driftlab.simulation import seam

FEDBUFF_WEIGHTED_REASON = Reason(
    why=("FedBuff averages the buffered changes with equal weights (Nguyen et al. 2022, Algorithm 1)"),
    fix=('set algorithm.aggregation = "uniform"'),
    joint="; ",
)


class Config(AlgorithmConfig):
    """``[algorithm]`` section for FedAvg (the server optimizer is chosen in ``[server]``)."""

    name: Literal["fedavg"] = "fedavg"
    aggregation: Aggregation = Field(
        "weighted", description="weighted: w_k = n_k / Σ n_j (default); uniform: mean over reporting clients"
    )
    incomplete: Incomplete = Field(
        "drop", description="what to do with a straggler's partial work: drop it (FedAvg) or keep it"
    )


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # θ^t
    optimizer_state: Any  # the server optimizer's state (Adam's m, v, step count, ...)


@dataclass(frozen=True)
class ClientView:
    """What the server sends a selected client: the model θ^{t−1} to start from."""

    params: torch.Tensor


@dataclass(frozen=True)
class ClientMessage:
    params: torch.Tensor  # θ_k, one model up
    num_samples: int
    multiplicity: int


def build(server_optimizer: Any, aggregation: str = "weighted", incomplete: str = "drop") -> seam.Algorithm:
    """FedAvg with ``server_optimizer`` (``driftlab.optim.server``), ``aggregation`` in {"weighted", "uniform"}
    and ``incomplete`` in {"drop", "keep"}."""
    check_aggregation(aggregation)  # before any work
    if incomplete not in ("drop", "keep"):
        raise ValueError(f"incomplete must be 'drop' or 'keep', got {incomplete!r}")

    def server_init(initial_params: torch.Tensor) -> ServerState:
        return ServerState(params=initial_params, optimizer_state=server_optimizer.init(initial_params))

    def client_objective(view: ClientView, client_state: None, context: seam.ClientContext) -> seam.GradientCorrection:
        return seam.NO_CORRECTION

    def client_finish(
        view: ClientView, client_state: None, context: seam.ClientContext, update: seam.ClientUpdate
    ) -> tuple[None, ClientMessage | None]:
        if context.is_incomplete and incomplete == "drop":
            return None, None
        return None, ClientMessage(update.final_params, context.num_samples, context.multiplicity)

    def aggregation_finish(
        server: ServerState, client_models: ModelSums, context: seam.RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        client_average = client_models.value(context.mean_denominator)
        params, optimizer_state = server_step(server_optimizer, server, client_average, context)
        return ServerState(params, optimizer_state), {}

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params)

    # Unit weight: uniform aggregation counts a message by its multiplicity, 1 under poisson or uniform sampling.
    form = model_change_form(lambda params: ClientMessage(params, num_samples=1, multiplicity=1))
    uniform = aggregation == "uniform"
    fedbuff = lacking(ASYNCHRONOUS_RULE, None if uniform else FEDBUFF_WEIGHTED_REASON)
    parts = averaging_parts(aggregation, model_mean_fold(aggregation, aggregation_finish), form, *fedbuff)
    # FedBuff's server step is this fold fed the buffer's staleness-weighted changes as unit-weight carriers
    # (mean_denominator = B): θ ← ServerOpt(θ, −(1/B) Σ s(τ_k) Δ_k), its Algorithm 1 with a FedOpt server.
    return seam.Algorithm(
        "fedavg", server_init, client_objective, client_finish, broadcast=broadcast, asynchronous=uniform, **parts
    )


def from_config(config: Config, server_optimizer: Any) -> seam.Algorithm:
    return build(server_optimizer, **options(config))
