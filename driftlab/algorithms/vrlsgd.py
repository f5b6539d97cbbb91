"""VRL-SGD (Liang, Shen, Liu, Pan, Chen and Cheng, "Variance Reduced Local SGD with Lower Communication Complexity",
IJCAI 2019, arXiv 1912.12844; the authors' code: github zerolxf/VRL-SGD, ``DistributedSgd.DSGD`` with ``vrl``).

The paper's rule (all N workers every period): worker i steps ``x_i ← x_i − γ(∇f_i(x_i; ξ) − Δ_i)``; after k
steps ``x̂ = mean_i x_i`` and ``Δ_i ← Δ_i + (x̂ − x_i)/(kγ)`` (the new average; ``Δ_i = 0`` at the start, so the
first period is local SGD).  ``Σ_i Δ_i = 0`` for ever, and ``Δ_i = ḡ_i − ḡ``: the client's mean gradient of the
last period minus the mean over clients.

x̂ exists only after the round, so ``Δ_k = c_k − c`` is split between the client (``c_k``) and the server
(``c``, the mean of all registered clients' ``c_k``), and a client combines them from the view when it next
trains (docs/update-rules.md, "VRL-SGD").  State: server ``c``, client ``c_k``, both model-sized, starting at 0.

    client k:  Δ_k = c_k − c;   K_k steps of  y ← y − η_l (∇f_k(y) − Δ_k)   → GradientCorrection(linear = c − c_k)
               d_k = (θ^{t−1} − y) / (K_k η_l);   c_k⁺ = Δ_k + d_k
               send y and the number K_k η_l
    server:    x̂ = mean_P y_k;   θ^t = ServerOpt(θ^{t−1}, θ^{t−1} − x̂, η_g)
               c ← c + (1/N) Σ_P (c_k⁺ − c_k) = c + (1/N) Σ_P (d_k − c)      (the server knows d_k from y_k, K_k η_l)

Under full participation ``c = mean_S d_k`` after every round, so next round ``c_k⁺ − c = Δ_k + d_k − mean d_j``,
which with equal K is ``Δ_k + (x̂ − y_k)/(Kη_l)``: the paper's update.  SGD with ``η_g = 1`` gives ``θ^t = x̂``
(the paper); other server optimizers step on ``θ^{t−1} − x̂`` as for FedAvg.  With one client, or identical
clients, ``Δ_k = 0`` and this is FedAvg with uniform weights, bit for bit.  Its arithmetic is SCAFFOLD option II
with ``η_g = 1`` (``scaffold.py``); what differs is the traffic (one model up, since ``Δc_k = d_k − c`` needs no
upload of its own) and that the paper defines it for full participation.

Partial participation (the paper has none): ``c`` is the mean over all N registered clients of ``c_k``
(``RoundContext.num_registered``; clients that never trained count with ``c_k = 0``, and a first-time client
corrects by ``c − 0``), which keeps the paper's ``Σ_S Δ_k = 0`` in every round; a returning client uses the
newest ``c``.  Means of models are uniform over the reporting clients (the paper's 1/N Σ_i), counted by
multiplicity; ``Σ_P (d_k − c)`` counts each reporting client once.  ``K_k`` is the number of steps the client
did and ``η_l`` the round's client learning rate (``ClientContext.client_lr``).

Partial work: kept, with its own ``K_k``; a client that did 0 steps sends nothing and keeps ``c_k`` (``d_k``
would divide by 0).  A client that does not report keeps ``c_k``.  Under compression ``y`` is what the server
received, so ``c_k`` and ``c`` stay consistent.

Communication: θ and c down (two models), y up (one model; the number is free).  Metric ``drift_norm`` = ``‖c‖``.

Privacy is refused (``RELEASE_REASON``) and so is asynchronous training (``ASYNCHRONOUS_REASON``).

Example (a client's direction d_k = (θ^{t−1} − y_k)/(K_k η_l), here after K_k η_l = 0.5):
    >>> import torch
    >>> from driftlab.algorithms import vrlsgd
    >>> vrlsgd.direction(torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.0]), step_scale=0.5)
    tensor([1., 2.])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from driftlab.algorithms.aggregation import RunningMean, folded, registered_mean_step, running_sum, server_step
from driftlab.algorithms.section import named_section
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, RELEASE_FORM, Reason, lacking, synchronous_only
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate, GradientCorrection, RoundContext

RELEASE_REASON = Reason(
    why=(
        "VRL-SGD's server direction c moves by (1/N) Σ_P ((θ^{t−1} − θ_k)/(K_k η_l) − c), dividing each client's "
        "change by its own steps K_k, which are private (a straggler's): one client moves c by up to C/(N K_k "
        "η_l), which no clip on θ_k − θ^{t−1} bounds"
    ),
    fix=("remove [privacy], or use scaffold (whose Δc_k is released and clipped with Δy_k)"),
)
ASYNCHRONOUS_REASON = synchronous_only(
    "vrlsgd",
    why=(
        "VRL-SGD's c changes by (1/N) Σ_P (d_k − c) with the c each client received, and every client's "
        "correction Δ_k = c_k − c is taken from it: a stale client's direction d_k, from an older model and an "
        "older c, would move c by a wrong amount and with it every client's next correction (no asynchronous "
        "VRL-SGD rule is implemented)"
    ),
)


Config = named_section(
    "vrlsgd",
    """``[algorithm]`` section for VRL-SGD: no hyperparameters of its own (γ is ``client.lr``, k the local steps;
the server optimizer and ``η_g`` are chosen in ``[server]``, SGD with lr 1 being the paper).""",
    __name__,
)


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # θ^t
    direction: torch.Tensor  # c, the mean over registered clients of c_k
    optimizer_state: Any  # the server optimizer's state


@dataclass(frozen=True)
class ClientView:
    """What the server sends a selected client: θ^{t−1} and c."""

    params: torch.Tensor
    direction: torch.Tensor


@dataclass(frozen=True)
class ClientState:
    direction: torch.Tensor  # c_k = Δ_k + d_k of the last round it reported (0 before)


@dataclass(frozen=True)
class ClientMessage:
    params: torch.Tensor  # y_k, one model up
    step_scale: float  # K_k η_l
    multiplicity: int


@dataclass(frozen=True)
class RoundSums:
    """The server's running sums over a round's messages: ``Σ_P y_k`` (by multiplicity) and ``Σ_P (d_k − c)``."""

    start: ServerState  # θ^{t−1} and the c every client received
    params: RunningMean
    direction_change_sum: torch.Tensor | None


def direction(start_params: torch.Tensor, final_params: torch.Tensor, step_scale: float) -> torch.Tensor:
    """``d_k = (θ^{t−1} − y_k)/(K_k η_l)``: the client's mean step direction (its mean of ∇f_k − Δ_k)."""
    return (start_params - final_params) / step_scale


def build(server_optimizer: Any) -> Algorithm:
    """VRL-SGD whose server step applies ``server_optimizer`` to ``q = θ^{t−1} − mean_P y_k``."""

    def server_init(initial_params: torch.Tensor) -> ServerState:
        return ServerState(initial_params, torch.zeros_like(initial_params), server_optimizer.init(initial_params))

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        return ClientState(torch.zeros_like(initial_params))

    def client_objective(view: ClientView, client: ClientState, context: ClientContext) -> GradientCorrection:
        return GradientCorrection(linear=view.direction - client.direction)  # −Δ_k

    def client_finish(
        view: ClientView, client: ClientState, context: ClientContext, update: ClientUpdate
    ) -> tuple[ClientState, ClientMessage | None]:
        if update.steps_done == 0:
            return client, None  # no step, no direction (d_k would divide by 0): nothing sent, c_k kept
        step_scale = update.steps_done * context.client_lr  # K_k η_l with the round's actual values
        new_direction = (client.direction - view.direction) + direction(view.params, update.final_params, step_scale)
        return ClientState(new_direction), ClientMessage(update.final_params, step_scale, context.multiplicity)

    def aggregation_start(server: ServerState, context: RoundContext) -> RoundSums:
        return RoundSums(server, RunningMean(), None)

    def aggregation_add(sums: RoundSums, message: ClientMessage) -> RoundSums:
        # c_k⁺ − c_k = d_k − c, from the message alone; it counts each reporting client once, whatever its multiplicity.
        change = direction(sums.start.params, message.params, message.step_scale) - sums.start.direction
        total = running_sum(sums.direction_change_sum, change)
        return RoundSums(sums.start, sums.params.add(message.params, float(message.multiplicity)), total)

    def aggregation_finish(
        server: ServerState, sums: RoundSums, context: RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        params, optimizer_state = server_step(server_optimizer, server, sums.params.value(), context)
        # c + (1/N) Σ_P (d_k − c)
        new_direction, metrics = registered_mean_step(
            server.direction, sums.direction_change_sum, context.num_registered
        )
        return ServerState(params, new_direction, optimizer_state), metrics

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params, server.direction)

    return Algorithm(
        "vrlsgd",
        server_init,
        client_objective,
        client_finish,
        broadcast=broadcast,
        client_state_init=client_state_init,
        **folded(aggregation_start, aggregation_add, aggregation_finish),
        lacks=lacking(RELEASE_FORM, RELEASE_REASON) + lacking(ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON),
    )


def from_config(config: Config, server_optimizer: Any) -> Algorithm:
    return build(server_optimizer)
