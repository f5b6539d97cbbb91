"""SCAFFOLD, option II (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020).

As algorithms.md states it.  State: the server control variate ``c`` and one
per client ``c_k``, model-sized, all starting at 0.

    client k:  y ← θ^{t−1};  K steps of  y ← y − η_l (∇f_k(y) + c − c_k)
               → GradientCorrection(linear = c − c_k)
               c_k⁺ = c_k − c + (θ^{t−1} − y) / (K η_l)                (option II)
               send Δy_k = y − θ^{t−1}  and  Δc_k = c_k⁺ − c_k
    server:    θ^t = θ^{t−1} + η_g mean_P Δy_k
               c   ← c + (|P|/N) mean_P Δc_k  =  c + (1/N) Σ_P Δc_k

``η_l`` is the round's actual client learning rate (``ClientContext.client_lr``,
so a decaying schedule is honoured) and ``K`` the number of steps the client
actually did (``ClientUpdate.steps_done``).  ``N`` is the number of registered
clients (``RoundContext.num_registered``), so ``c`` stays the mean of all
clients' ``c_k`` (clients that never trained count with ``c_k = 0``).

The θ-update goes through the server optimizer: its pseudo-gradient is
``q = −mean_P Δy_k`` and SGD computes ``θ − η_g q``, which is the line above
exactly (``server.lr`` is ``η_g``); Adam, momentum, ... apply to it as to
FedAvg's.  ``c`` is always updated as written, whatever the optimizer.

Sampling with replacement (``sampling.mode = "weighted"``): a client drawn
twice counts twice in ``mean_P Δy_k`` but trains once and updates its ``c_k``
once, so it adds its ``Δc_k`` once (keeping ``c = mean_S c_k``).

Partial work and dropouts: a client that did ``s < K`` steps uses ``s`` in its
``c_k⁺`` (the mean gradient over the steps it did) and is averaged like the
others; a client that reported after 0 steps keeps its ``c_k`` (``Δc_k = 0``,
``Δy_k = 0``).  A client that does not report sends nothing and keeps ``c_k``.

Communication: two model-sized vectors each way per client (``Δy_k, Δc_k`` up;
``θ, c`` down), counted as two models per direction.

Metric ``drift_norm`` = ``‖c‖`` after the update.

Under ``[privacy]``: a message reveals ``x_k = cat(Δy_k, Δc_k)`` (both fields,
clipped together to norm C: one client changes ``Σ_P x_k`` by at most C).  The
server update is linear in ``Σ_P x_k`` with unit weight per message:
``mean_P Δy_k = Σ_P Δy_k / m`` with the public expected cohort m
(``RoundContext.mean_denominator``) and ``c += Σ_P Δc_k / N`` as ever, so noise
N(0, σ²) on the sum reaches θ as σ/m (times η_g) and c as σ/N.  The promise
holds for multiplicity 1 (a client drawn twice counts twice in ``Σ Δy_k`` but
once in ``Σ Δc_k``).  ``c_k`` itself never leaves the client.

Example (a message releases cat(Δy_k, Δc_k), of twice the model's size):
    >>> import torch
    >>> from driftlab.algorithms import scaffold
    >>> view = scaffold.ClientView(params=torch.zeros(2), control=torch.zeros(2))
    >>> message = scaffold.ClientMessage(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), multiplicity=1)
    >>> form = scaffold.release_form()
    >>> form.release(view, message), form.size(view)
    (tensor([1., 2., 3., 4.]), 4)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from driftlab.algorithms.aggregation import RunningMean, folded, registered_mean_step, running_sum
from driftlab.algorithms.section import named_section
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, lacking, synchronous_only
from driftlab.simulation import seam

# Why FedBuff cannot run SCAFFOLD as it stands (Algorithm.asynchronous_refusal; docs/algorithms.md, "Asynchronous").
ASYNCHRONOUS_REASON = synchronous_only(
    "scaffold",
    why=(
        "SCAFFOLD keeps c = mean_S c_k by adding Σ_P Δc_k / N, the very changes the clients made to their c_k, "
        "and its option II c_k⁺ and correction c − c_k use the c the client received: FedBuff weights a stale "
        "message by s(τ), so c would gain s(τ)Δc_k where c_k moved by Δc_k, and a stale client corrects with an "
        "old c (no asynchronous SCAFFOLD rule is implemented; CA2FL's cached-update calibration of FedBuff, Wang "
        "et al., ICLR 2024, is a candidate)"
    ),
)


Config = named_section(
    "scaffold",
    """``[algorithm]`` section for SCAFFOLD (option II); the server optimizer and ``η_g`` are chosen in ``[server]``.""",
    __name__,
)


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # θ^t
    control: torch.Tensor  # c, the mean over registered clients of c_k
    optimizer_state: Any  # the server optimizer's state (for the θ-update)


@dataclass(frozen=True)
class ClientView:
    """What the server sends a selected client: θ^{t−1} and the server control variate c."""

    params: torch.Tensor
    control: torch.Tensor


@dataclass(frozen=True)
class ClientState:
    control: torch.Tensor  # c_k


@dataclass(frozen=True)
class ClientMessage:
    params_delta: torch.Tensor  # Δy_k = y − θ^{t−1}
    control_delta: torch.Tensor  # Δc_k = c_k⁺ − c_k
    multiplicity: int


@dataclass(frozen=True)
class RoundSums:
    """The server's running sums over a round's messages: ``Σ_P Δy_k`` (by multiplicity) and ``Σ_P Δc_k``."""

    params_delta: RunningMean
    control_delta_sum: torch.Tensor | None


def release_form() -> seam.ReleaseForm:
    """SCAFFOLD's ``ReleaseForm``: a message releases ``cat(Δy_k, Δc_k)``; the carrier counts once (multiplicity 1)."""

    def release(view: ClientView, message: ClientMessage) -> torch.Tensor:
        return torch.cat((message.params_delta, message.control_delta))

    def restore(view: ClientView, message: ClientMessage | None, vector: torch.Tensor) -> ClientMessage:
        params_delta, control_delta = vector.split(view.params.numel())
        if message is None:
            return ClientMessage(params_delta, control_delta, multiplicity=1)
        return ClientMessage(params_delta, control_delta, message.multiplicity)

    def size(view: ClientView) -> int:
        return 2 * view.params.numel()

    return seam.ReleaseForm(release, restore, size=size)


def build(server_optimizer: Any) -> seam.Algorithm:
    """SCAFFOLD option II whose θ-update applies ``server_optimizer`` to ``q = −mean_P Δy_k``."""

    def server_init(initial_params: torch.Tensor) -> ServerState:
        return ServerState(
            params=initial_params,
            control=torch.zeros_like(initial_params),
            optimizer_state=server_optimizer.init(initial_params),
        )

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        return ClientState(control=torch.zeros_like(initial_params))

    def client_objective(view: ClientView, client: ClientState, context: seam.ClientContext) -> seam.GradientCorrection:
        return seam.GradientCorrection(linear=view.control - client.control)

    def client_finish(
        view: ClientView, client: ClientState, context: seam.ClientContext, update: seam.ClientUpdate
    ) -> tuple[ClientState, ClientMessage]:
        params_delta = update.final_params - view.params
        if update.steps_done == 0:
            # No step, no gradient information: keep c_k (option II would divide by zero).
            new_control = client.control
        else:
            step_scale = update.steps_done * context.client_lr  # K η_l with the round's actual values
            new_control = client.control - view.control + (view.params - update.final_params) / step_scale
        message = ClientMessage(params_delta, new_control - client.control, context.multiplicity)
        return ClientState(new_control), message

    def aggregation_start(server: ServerState, context: seam.RoundContext) -> RoundSums:
        return RoundSums(RunningMean(), None)

    def aggregation_add(sums: RoundSums, message: ClientMessage) -> RoundSums:
        # Σ_P Δc_k counts each reporting client once, whatever its multiplicity.
        control = running_sum(sums.control_delta_sum, message.control_delta)
        return RoundSums(sums.params_delta.add(message.params_delta, float(message.multiplicity)), control)

    def aggregation_finish(
        server: ServerState, sums: RoundSums, context: seam.RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        # mean_P Δy_k; a private round divides by its public expected cohort (RoundContext.mean_denominator).
        mean_params_delta = sums.params_delta.value(context.mean_denominator)
        params, optimizer_state = server_optimizer.update(
            server.optimizer_state, server.params, -mean_params_delta, context.server_learning_rate
        )
        # (|P|/N) mean_P Δc_k = (1/N) Σ_P Δc_k.
        control, metrics = registered_mean_step(server.control, sums.control_delta_sum, context.num_registered)
        return ServerState(params, control, optimizer_state), metrics

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params, server.control)

    return seam.Algorithm(
        "scaffold",
        server_init,
        client_objective,
        client_finish,
        broadcast=broadcast,
        client_state_init=client_state_init,
        **folded(aggregation_start, aggregation_add, aggregation_finish),
        release=release_form(),
        lacks=lacking(ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON),
    )


def from_config(config: Config, server_optimizer: Any) -> seam.Algorithm:
    return build(server_optimizer)
