"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, "Personalized Cross-Silo Federated Learning on Non-IID Data",
AAAI 2021, arXiv 2007.03797): federated attentive message passing.

Every client k keeps a personalized model w_k; the objective is

    min_W  G(W) = Σ_k F_k(w_k) + λ Σ_{k<j} A(‖w_k − w_j‖²),     A(x) = 1 − e^{−x/σ},  A'(x) = e^{−x/σ}/σ,

solved by alternating a gradient step on the attention term (server) with a proximal step on F (clients):

    server:  u_k = Σ_j ξ_kj w_j,   ξ_kj = α A'(‖w_k − w_j‖²)  (j ≠ k),   ξ_kk = 1 − Σ_{j≠k} ξ_kj
             (computed as u_k = w_k + Σ_{j≠k} ξ_kj (w_j − w_k), the same sum)
    client k: w_k ← argmin_w F_k(w) + λ/(2α) ‖w − u_k‖²,  K local SGD steps from u_k:
               ∇ += (λ/α)(w − u_k)  → GradientCorrection(quadratic = λ/α, reference = u_k);  send w_k
    server:  row k of W ← w_k

The ξ form drops the factor 2 of ∇A(‖w_k − w_j‖²) (as every implementation read does), so a fixed point is a
stationary point of Σ_k F_k + (λ/2) Σ_{k<j} A(‖w_k − w_j‖²): ∇F_k(w_k) + λ Σ_j A'(‖w_k − w_j‖²)(w_k − w_j) = 0 (tested on quadratics).

The cloud model u_k is client k's own (``Algorithm.client_view``): the server computes it, for the m selected clients
only, from the latest model of EVERY client (N rows of ``ServerState.models``, one ``[N, P]`` tensor: a client not
selected keeps its last w_j, one that never trained θ⁰, the paper's W⁰); the sum runs over the row blocks of W so a
cloud model costs about 5·N·P flops and a block of memory, not another [N, P].  The view sends u_k only (one model
down, counted per client), computed when first read: counting a view's bits or reading a client's own model from it
(the personalized evaluation, which builds every client's view) costs nothing.

Choices, with where the references differ (the paper was read in excerpts; the authors' code was not found; PFLlib's
clientamp/serveramp, FLGo's and fluke's fedamp are third-party):
  * Local SGD starts from u_k, the centre of the proximal problem (FLGo).  PFLlib and fluke continue from the
    client's own w_k; an exact prox step does not depend on the start, K SGD steps do.
  * ``α`` unset: σ/(N−1), the largest step with ξ_kk ≥ 0 whatever the distances (A' ≤ 1/σ), so u_k is a convex
    combination of the models.  A larger α is refused: α(N−1)/σ > 1 lets ξ_kk go negative, and u_k then
    extrapolates past the other models (the step on the concave A overshoots).  ``λ`` unset: α, so the proximal
    coefficient λ/α is 1 (PFLlib's defaults α = λ = 1).  ``σ`` = 1 (PFLlib).  α is constant over rounds (the
    paper's α_k may decay).  The paper's heuristic variant (HeurFedAMP, cosine-similarity attention for deep
    networks) is not implemented.
  * PFLlib mixes only the models uploaded in the previous round and adds λ/(2α)‖w − u‖ unsquared; fluke mixes
    the round's clients only; this module follows the paper's full W.
  * Partial participation, stragglers (their partial w_k is kept), dropouts (the row stays) and clients leaving
    the registered set (their row stays in every sum) all follow from "the server's latest w_j".
  * The evaluated "server" model ``ServerState.params`` (and ``broadcast``'s view, sent to nobody) is the mean of
    the N rows, (1/N) Σ_j w_j: FedAMP has no global model.  Each client's own model (``Personalization``) is its
    row w_k, read through the view (``ClientView.personal``): the client holds it already (it trained it), so it
    is not counted as sent.

Refused: compression (one downlink residual per server, the seam), [asynchronous] (the seam), a deployment
(deploy/messages.check_deployable), [privacy] (``PRIVACY_REFUSAL``).

Cost (N clients, P parameters, m selected): server memory N·P floats (checkpointed); per round m cloud models of
about 5·N·P flops each (each reads all of W), and the new W written out of place (N·P copied: states are never
mutated).  A cross-silo method (the paper: tens of clients); docs/performance.md has what it costs at N = 100,000.

Example:
    >>> import torch
    >>> from driftlab.algorithms import fedamp
    >>> algorithm = fedamp.build(num_clients=3)
    >>> server = algorithm.server_init(torch.zeros(2))
    >>> server.models.shape, algorithm.client_view(server, 1).params
    (torch.Size([3, 2]), tensor([0., 0.]))
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from driftlab.errors import ConfigError
from driftlab.metrics.communication import BITS_PER_ENTRY
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate, GradientCorrection, Personalization, RoundContext, ServerFold

PRIVACY_REFUSAL = (
    "FedAMP's server keeps each client's own model w_k and mixes the models one by one into every client's cloud model "
    "u_k, so a client's upload is used on its own, not through a clipped sum that noise can hide: no client-level DP "
    "form exists for it; remove [privacy], or use fedavg or fedprox with aggregation = \"uniform\""
)

# Rows of W per block of a cloud-model sum: about 16 Mi entries (64 MiB of float32) whatever the model size.
BLOCK_ENTRIES = 1 << 24


class Config(BaseModel):
    """``[algorithm]`` section for FedAMP (no server optimizer: the server keeps the clients' models)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["fedamp"] = "fedamp"
    sigma: float = Field(1.0, gt=0, description="σ > 0 of A(x) = 1 − e^{−x/σ}: the squared distance at which attention fades")
    alpha: float | None = Field(
        None, gt=0, description="message-passing step α > 0, ξ_kj = α e^{−‖w_k − w_j‖²/σ}/σ; at most σ/(N−1); unset: σ/(N−1)"
    )
    lam: float | None = Field(
        None, gt=0, description="λ > 0: the client's proximal coefficient is λ/α (local ∇ += (λ/α)(w − u_k)); unset: λ = α"
    )


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # (1/N) Σ_j w_j: the evaluated "server" model
    models: torch.Tensor  # W, [N, P]: every client's latest w_j (θ⁰ until it trains)


@dataclass(frozen=True)
class ClientView:
    """What client k receives: its cloud model u_k = ``params`` (the start of local SGD and the proximal reference).

    Computed on first read and kept (``cached_property``): the engine also builds views only to count their bits
    (``bits``, one model: u_k alone) or to read the client's own model (``personal``, evaluation), and neither needs
    the N·P-flop sum.  ``personal`` is w_k, row k of the server's W (a view of it, not a copy): the client already
    holds it (it trained it), so it is not sent."""

    models: torch.Tensor  # the server's W, [N, P] (the state's own tensor: states are never mutated)
    client_id: int
    alpha: float
    sigma: float

    @cached_property
    def params(self) -> torch.Tensor:
        return cloud_model(self.models, self.client_id, self.alpha, self.sigma)

    @property
    def personal(self) -> torch.Tensor:
        return self.models[self.client_id]

    @property
    def bits(self) -> int:
        return BITS_PER_ENTRY * self.models.shape[1]


@dataclass(frozen=True)
class MeanView:
    """``broadcast``'s view: the mean model (1/N) Σ_j w_j, which no client is sent (every client gets its ``ClientView``)."""

    params: torch.Tensor


@dataclass(frozen=True)
class ClientMessage:
    client_id: int
    params: torch.Tensor  # w_k, one model up


def attention_weights(distances: torch.Tensor, alpha: float, sigma: float) -> torch.Tensor:
    """``ξ_kj = α A'(d_kj) = α e^{−d_kj/σ}/σ`` for squared distances ``d``."""
    return alpha * torch.exp(-distances / sigma) / sigma


def cloud_model(models: torch.Tensor, client_id: int, alpha: float, sigma: float) -> torch.Tensor:
    """``u_k = w_k + Σ_{j≠k} ξ_kj (w_j − w_k)`` over the rows of ``models`` (= Σ_j ξ_kj w_j with ξ_kk = 1 − Σ_{j≠k} ξ_kj).

    Summed over blocks of rows (``BLOCK_ENTRIES``), in a fixed order, so memory is one block, not another [N, P]; row
    k contributes w_k − w_k = 0 whatever its weight."""
    own = models[client_id]
    block = max(1, BLOCK_ENTRIES // max(1, models.shape[1]))
    total = torch.zeros_like(own)
    for start in range(0, models.shape[0], block):
        differences = models[start : start + block] - own
        weights = attention_weights((differences * differences).sum(1), alpha, sigma)
        total = total + weights @ differences
    return own + total


def default_alpha(sigma: float, num_clients: int) -> float:
    """σ/(N−1): the largest α with every ξ_kk ≥ 0 (A' ≤ 1/σ); σ for a single client (nothing to mix)."""
    return sigma / max(1, num_clients - 1)


def check_step(alpha: float, sigma: float, num_clients: int) -> None:
    """ValueError when α(N−1)/σ > 1: a client's own weight ξ_kk = 1 − Σ_{j≠k} ξ_kj could be negative."""
    bound = default_alpha(sigma, num_clients)
    if num_clients > 1 and alpha > bound:
        raise ValueError(
            f"fedamp: alpha = {alpha:g} with sigma = {sigma:g} and N = {num_clients} clients gives α(N−1)/σ = "
            f"{alpha * (num_clients - 1) / sigma:g} > 1, so a client's own weight ξ_kk = 1 − α Σ_j e^{{−‖w_k − w_j‖²/σ}}/σ "
            f"can be negative and its cloud model overshoots the others: set algorithm.alpha ≤ σ/(N−1) = {bound:g} "
            f"(or leave it unset), or algorithm.sigma ≥ α(N−1) = {alpha * (num_clients - 1):g}"
        )


def build(num_clients: int | None = None, sigma: float = 1.0, alpha: float | None = None, lam: float | None = None) -> Algorithm:
    """FedAMP over ``num_clients`` clients (module docstring).  ``num_clients`` None builds the bundle for inspection
    (its refusals, its view function); its ``server_init`` then says that N is needed."""
    if not sigma > 0:
        raise ValueError(f"fedamp needs sigma > 0, got {sigma}")
    if num_clients is not None and num_clients < 1:
        raise ValueError(f"fedamp needs at least one client, got num_clients = {num_clients}")
    if alpha is not None and not alpha > 0:
        raise ValueError(f"fedamp needs alpha > 0, got {alpha}")
    if lam is not None and not lam > 0:
        raise ValueError(f"fedamp needs lam > 0, got {lam}")
    if alpha is None:
        alpha = default_alpha(sigma, num_clients or 1)
    elif num_clients is not None:
        check_step(alpha, sigma, num_clients)
    proximal = (alpha if lam is None else lam) / alpha  # λ/α

    def server_init(initial_params: torch.Tensor) -> ServerState:
        if num_clients is None:
            raise ValueError("fedamp keeps one model per client and was built without the number of clients: build(num_clients=N)")
        return ServerState(initial_params, initial_params.unsqueeze(0).repeat(num_clients, 1))

    def client_view(server: ServerState, client_id: int) -> ClientView:
        return ClientView(server.models, client_id, alpha, sigma)

    def broadcast(server: ServerState) -> MeanView:
        return MeanView(server.params)

    def client_objective(view: ClientView, client: None, context: ClientContext) -> GradientCorrection:
        return GradientCorrection(quadratic=proximal, reference=view.params)

    def client_finish(view: ClientView, client: None, context: ClientContext, update: ClientUpdate) -> tuple[None, ClientMessage]:
        return None, ClientMessage(context.client_id, update.final_params)

    def aggregation_start(server: ServerState, context: RoundContext) -> dict[int, torch.Tensor]:
        return {}

    def aggregation_add(latest: dict[int, torch.Tensor], message: ClientMessage) -> dict[int, torch.Tensor]:
        latest[message.client_id] = message.params  # the accumulator is the fold's own, made by start()
        return latest

    def aggregation_finish(server: ServerState, latest: dict[int, torch.Tensor], context: RoundContext) -> tuple[ServerState, dict[str, float]]:
        ids = sorted(latest)
        rows = torch.stack([latest[k] for k in ids]).to(server.models.dtype)
        models = server.models.index_copy(0, torch.tensor(ids, dtype=torch.long, device=server.models.device), rows)
        return ServerState(models.mean(0), models), {}

    def personal_model(view: ClientView, client: None) -> torch.Tensor:
        return view.personal

    fold = ServerFold(aggregation_start, aggregation_add, aggregation_finish)
    return Algorithm("fedamp", server_init, client_objective, client_finish, fold.server_update, broadcast,
                     server_fold=fold, privacy_refusal=PRIVACY_REFUSAL, client_view=client_view,
                     personalization=Personalization(personal_model, "FedAMP's personalized model w_k"))


def from_config(config: Config, server_optimizer: Any, num_clients: int | None = None) -> Algorithm:
    """Build from ``config`` for ``num_clients`` clients (the registry entry's ``needs_num_clients``: assembly passes
    the data's N).  FedAMP has no server step: ``server_optimizer`` is not used (``owns_server_step``)."""
    try:
        return build(num_clients, sigma=config.sigma, alpha=config.alpha, lam=config.lam)
    except ValueError as error:
        raise ConfigError(str(error)) from None
