"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, "Personalized Cross-Silo Federated Learning on Non-IID Data",
AAAI 2021, arXiv 2007.03797): federated attentive message passing.

Every client k keeps a personalized model w_k; the objective is

    min_W  G(W) = Σ_k F_k(w_k) + λ Σ_{k<j} A(‖w_k − w_j‖²),     A(x) = 1 − e^{−x/σ},  A'(x) = e^{−x/σ}/σ,

solved by alternating a gradient step on the attention term (server) with a proximal step on F (clients):

    server:  u_k = Σ_j ξ_kj w_j,   ξ_kj = α A'(‖w_k − w_j‖²)  (j ≠ k),   ξ_kk = 1 − Σ_{j≠k} ξ_kj
             (computed as u_k = w_k + Σ_{j≠k} ξ_kj (w_j − w_k), the same sum)
    client k: w_k ← argmin_w F_k(w) + λ/(2α) ‖w − u_k‖²,  K local SGD steps from u_k:
               ∇ += (λ/α)(w − u_k)  → GradientCorrection(quadratic = λ/α, reference = u_k);  keep w_k (its
               client state), send w_k − w_k^old
    server:  S ← S + Σ_k (w_k − w_k^old),  S = Σ_j w_j;  the evaluated model S/N

The ξ form drops the factor 2 of ∇A(‖w_k − w_j‖²) (as every implementation read does), so a fixed point is a
stationary point of Σ_k F_k + (λ/2) Σ_{k<j} A(‖w_k − w_j‖²): ∇F_k(w_k) + λ Σ_j A'(‖w_k − w_j‖²)(w_k − w_j) = 0 (tested on quadratics).

What the server keeps is every client's latest model, and those are the client states: client k's state is w_k
(``ClientState``; ``client_state_init(θ⁰) = θ⁰``, the paper's W⁰ for a client that never trained), held by the
client-state store the engine owns (in memory, or in the disk store's row files with ``state.store = "disk"``, or
"auto" when N models exceed the memory budget: memory stays bounded whatever N).  In a deployment the server would
hold these rows itself; FedAMP stays refused there (``check_deployable``: one broadcast view per round).  The cloud
model u_k is client k's own (``Algorithm.client_view``), computed for the m selected clients only from the store's
committed states (``states()``, in client-id order; a client without a state counts as θ⁰, kept in the server
state): one walk to client k's own row w_k, then one pass over every client's row, summed over blocks of rows
(``cloud_model``) so a cloud model costs about 5·N·P flops and a block of memory.  The blocks are the rows of the
N-row matrix W, θ⁰ where a client has no state, so the numbers are those of the sum over an ``[N, P]`` W.  The view
sends u_k only (one model down, counted per client), computed when first read: counting a view's bits or reading a
client's own model (the personalized evaluation builds every client's view) costs nothing.

The client's new state is its w_k; its message is the change w_k − w_k^old (one model up: the client knows its old
w_k, its state), from which the server keeps Σ_j w_j, in float64 (as the engine's ``latest_models`` sum): the
evaluated "server" model is (1/N) Σ_j w_j, with no pass over the store.

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
  * Partial participation, stragglers (their partial w_k is kept), dropouts and late messages (no new state: the
    row stays) and clients leaving the registered set (their row stays in every sum) all follow from "the server's
    latest w_j" being the store's committed states.
  * The evaluated "server" model ``ServerState.params`` (and ``broadcast``'s view, sent to nobody) is the mean of
    the N rows, (1/N) Σ_j w_j: FedAMP has no global model.  Each client's own model (``Personalization``) is its
    state w_k: the client holds it already (it trained it), so it is not counted as sent.

Refused: compression (one downlink residual per server, the seam), [asynchronous] (the seam), a deployment
(deploy/messages.check_deployable), [privacy] (``RELEASE_REASON``).

Cost (N clients, P parameters, m selected): the store holds N·P floats (the rows of clients that trained; on disk
when large, checkpointed incrementally by the disk store); the server state is four models (Σ_j w_j in float64, the
mean, θ⁰); per round m cloud models of about 5·N·P flops each (each reads every stored row, and the walk to w_k up
to half of them again).  A cross-silo method (the paper: tens of clients); docs/performance.md has what it costs at
N = 100,000.

Example:
    >>> import torch
    >>> from driftlab.algorithms import fedamp
    >>> algorithm = fedamp.build(num_clients=3)
    >>> server = algorithm.server_init(torch.zeros(2))
    >>> trained = {2: fedamp.ClientState(torch.tensor([1.0, 0.0]))}  # only client 2 has a state: the others are θ⁰
    >>> algorithm.client_view(server, 2, lambda: iter(trained.items())).params  # 1 − 2·(½e^{−1}): σ = 1, α = ½
    tensor([0.6321, 0.0000])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
from pydantic import Field

from driftlab.algorithms.aggregation import folded
from driftlab.algorithms.section import AlgorithmConfig, options
from driftlab.errors import ConfigError
from driftlab.features.capabilities import RELEASE_FORM, Reason, lacking
from driftlab.metrics.communication import BITS_PER_ENTRY
from driftlab.simulation.seam import (
    Algorithm,
    ClientContext,
    ClientUpdate,
    GradientCorrection,
    Personalization,
    RoundContext,
)

RELEASE_REASON = Reason(
    why=(
        "FedAMP's server keeps each client's own model w_k and mixes the models one by one into every client's "
        "cloud model u_k, so a client's upload is used on its own, not through a clipped sum that noise can hide"
    ),
    fix=(
        'no client-level DP form exists for it; remove [privacy], or use fedavg or fedprox with aggregation = "uniform"'
    ),
)

# Rows of W per block of a cloud-model sum: about 16 Mi entries (64 MiB of float32) whatever the model size.
BLOCK_ENTRIES = 1 << 24

# (client id, ClientState) over every client with a state, in client-id order (the store's ``items``)
States = Callable[[], Iterator[tuple[int, "ClientState"]]]


class Config(AlgorithmConfig):
    """``[algorithm]`` section for FedAMP (no server optimizer: the server keeps the clients' models)."""

    name: Literal["fedamp"] = "fedamp"
    sigma: float = Field(
        1.0, gt=0, description="σ > 0 of A(x) = 1 − e^{−x/σ}: the squared distance at which attention fades"
    )
    alpha: float | None = Field(
        None,
        gt=0,
        description="message-passing step α > 0, ξ_kj = α e^{−‖w_k − w_j‖²/σ}/σ; at most σ/(N−1); unset: σ/(N−1)",
    )
    lam: float | None = Field(
        None,
        gt=0,
        description="λ > 0: the client's proximal coefficient is λ/α (local ∇ += (λ/α)(w − u_k)); unset: λ = α",
    )


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # (1/N) Σ_j w_j: the evaluated "server" model
    total: torch.Tensor  # Σ_j w_j over all N clients (θ⁰ for those without a state), float64
    initial: torch.Tensor  # θ⁰: the model of every client that has not trained


@dataclass(frozen=True)
class ClientState:
    model: torch.Tensor  # w_k: the client's latest model, its personalized one (θ⁰ until it trains)


@dataclass(frozen=True)
class ClientView:
    """What client k receives: its cloud model u_k = ``params`` (the start of local SGD and the proximal reference).

    Computed on first read and kept (``cached_property``): the engine also builds views only to count their bits
    (``bits``, one model: u_k alone) or to read a client's own model (evaluation, from the client's state), and
    neither needs the N·P-flop sum.  ``states`` gives the store's rows (``Algorithm.client_view``)."""

    states: States
    initial: torch.Tensor  # θ⁰, for the clients without a state
    num_clients: int
    client_id: int
    alpha: float
    sigma: float

    @cached_property
    def params(self) -> torch.Tensor:
        own = own_model(self.states(), self.client_id, self.initial)
        return cloud_model(self.states(), own, self.client_id, self.initial, self.num_clients, self.alpha, self.sigma)

    @property
    def bits(self) -> int:
        return BITS_PER_ENTRY * self.initial.numel()


@dataclass(frozen=True)
class MeanView:
    """``broadcast``'s view: the mean model (1/N) Σ_j w_j, which no client is sent (every client gets its ``ClientView``)."""

    params: torch.Tensor


@dataclass(frozen=True)
class ClientMessage:
    change: torch.Tensor  # w_k − w_k^old in float64 (no float32 rounding of the change), one model up


def attention_weights(distances: torch.Tensor, alpha: float, sigma: float) -> torch.Tensor:
    """``ξ_kj = α A'(d_kj) = α e^{−d_kj/σ}/σ`` for squared distances ``d``."""
    return alpha * torch.exp(-distances / sigma) / sigma


def own_model(states: Iterable[tuple[int, ClientState]], client_id: int, initial: torch.Tensor) -> torch.Tensor:
    """w_k from the states in client-id order (read up to client k's, no further), θ⁰ when k has none."""
    for stored_id, state in states:
        if stored_id >= client_id:
            return state.model if stored_id == client_id else initial
    return initial


def cloud_model(
    states: Iterable[tuple[int, ClientState]],
    own: torch.Tensor,
    client_id: int,
    initial: torch.Tensor,
    num_clients: int,
    alpha: float,
    sigma: float,
) -> torch.Tensor:
    """``u_k = w_k + Σ_{j≠k} ξ_kj (w_j − w_k)`` over the N clients' models w_j (= Σ_j ξ_kj w_j with ξ_kk = 1 − Σ_{j≠k}
    ξ_kj), ``own`` = w_k, ``states`` the stored w_j in client-id order, θ⁰ for a client without one.

    Summed over blocks of rows of W = [w_0 … w_{N−1}] (``BLOCK_ENTRIES``), in a fixed order, so memory is one block,
    not [N, P]; row k contributes w_k − w_k = 0 whatever its weight.  A block's differences w_j − w_k are written
    row by row from the states it covers and θ⁰ − w_k elsewhere: one write per entry, the same numbers as the block
    of an [N, P] W minus w_k (a subtraction rounds each entry alone)."""
    block = max(1, BLOCK_ENTRIES // max(1, initial.numel()))
    untrained = initial - own  # w_j − w_k of every client j without a state
    rows = iter(states)
    pending = next(rows, None)
    total = torch.zeros_like(own)
    for start in range(0, num_clients, block):
        stop = min(start + block, num_clients)
        differences = torch.empty((stop - start, own.numel()), dtype=own.dtype, device=own.device)
        filled = start
        while pending is not None and pending[0] < stop:
            differences[filled - start : pending[0] - start] = untrained
            torch.sub(pending[1].model, own, out=differences[pending[0] - start])
            filled = pending[0] + 1
            pending = next(rows, None)
        differences[filled - start :] = untrained
        weights = attention_weights((differences * differences).sum(1), alpha, sigma)
        total = total + weights @ differences
    if pending is not None:
        raise ValueError(
            f"fedamp was built for {num_clients} clients but client {pending[0]} has a state: build(num_clients=N) with every client"
        )
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


def build(
    num_clients: int | None = None, sigma: float = 1.0, alpha: float | None = None, lam: float | None = None
) -> Algorithm:
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
            raise ValueError(
                "fedamp keeps one model per client and was built without the number of clients: build(num_clients=N)"
            )
        return ServerState(initial_params, num_clients * initial_params.to(torch.float64), initial_params)

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        return ClientState(initial_params)  # W⁰: w_k = θ⁰; states are never changed in place

    def client_view(server: ServerState, client_id: int, states: States) -> ClientView:
        return ClientView(states, server.initial, num_clients, client_id, alpha, sigma)

    def broadcast(server: ServerState) -> MeanView:
        return MeanView(server.params)

    def client_objective(view: ClientView, client: ClientState, context: ClientContext) -> GradientCorrection:
        return GradientCorrection(quadratic=proximal, reference=view.params)

    def client_finish(
        view: ClientView, client: ClientState, context: ClientContext, update: ClientUpdate
    ) -> tuple[ClientState, ClientMessage]:
        new = update.final_params.to(client.model.dtype)
        return ClientState(new), ClientMessage(new.to(torch.float64) - client.model.to(torch.float64))

    def aggregation_start(server: ServerState, context: RoundContext) -> torch.Tensor:
        return torch.zeros_like(server.total)

    def aggregation_add(changes: torch.Tensor, message: ClientMessage) -> torch.Tensor:
        return changes.add_(message.change)  # the accumulator is the fold's own, made by start(); sample order

    def aggregation_finish(
        server: ServerState, changes: torch.Tensor, context: RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        total = server.total + changes
        return ServerState((total / num_clients).to(server.params.dtype), total, server.initial), {}

    def personal_model(view: ClientView, client: ClientState) -> torch.Tensor:
        return client.model

    return Algorithm(
        "fedamp",
        server_init,
        client_objective,
        client_finish,
        broadcast=broadcast,
        client_state_init=client_state_init,
        **folded(aggregation_start, aggregation_add, aggregation_finish),
        lacks=lacking(RELEASE_FORM, RELEASE_REASON),
        client_view=client_view,
        personalization=Personalization(personal_model, "FedAMP's personalized model w_k"),
    )


def from_config(config: Config, server_optimizer: Any, num_clients: int | None = None) -> Algorithm:
    """Build from ``config`` for ``num_clients`` clients (the registry entry's ``needs_num_clients``: assembly passes
    the data's N).  FedAMP has no server step: ``server_optimizer`` is not used (``owns_server_step``)."""
    try:
        return build(num_clients, **options(config))
    except ValueError as error:
        raise ConfigError(str(error)) from None
