"""FedGATE (Haddadpour, Kamani, Mokhtari and Mahdavi, "Federated Learning with Compression: Unified Analysis and
Sharp Guarantees", AISTATS 2021, Algorithm 2): local SGD with gradient tracking.

As the sheet (docs/update-rules.md, "FedGATE") states it, in model-difference
units as the authors' FedTorch code keeps them.  State: the server model θ and
the last round's average change ``D``; per client the correction δ_k (0 at start)
and ``s_k = 1/(η_l τ_k)`` of its last report (0 when none is pending).

    client k, round t:  δ_k ← δ_k − s_k D^{t−1}                     (settle the last report)
                        τ_k steps of  θ ← θ − η_l (∇f_k(θ) − δ_k)  from θ^{t−1}
                        → GradientCorrection(linear = −δ_k)
                        D_k = θ^{t−1} − θ_k;  send Q(D_k) (as θ_k)
                        δ_k ← δ_k + Q(D_k)/(η_l τ_k),   s_k ← 1/(η_l τ_k)
    server:             D^t = mean_P Q(D_k)                           (uniform)
                        θ^t = ServerOpt(θ^{t−1}, q = D^t, γ)          (SGD: θ^{t−1} − γ D^t)
                        broadcast (θ^t, D^t)

A client reporting in rounds t and t+1 thus gets Algorithm 2's
``δ_k^{t+1} = δ_k^t + (Q(D_k^t) − D^t)/(η_l τ_k)`` before its next steps: the
round's mean exists only once every client of the round reported, and the seam's
one downlink is the next view, so the settlement waits for it.  A client that
skips rounds settles with the latest ``D`` it receives (its own round's mean is
not kept: that would need every round's mean until each client returns).  Under
full participation ``Σ_k (D_k − D) = 0``, so ``Σ_k δ_k = 0`` for ever and the fixed
point is the minimiser of the mean objective; identical clients keep δ = 0 and
FedGATE is uniform FedAvg with server lr γ.

``η_l`` is the round's client lr (``ClientContext.client_lr``) and ``τ_k`` the
steps done.  ``Q`` is the identity unless ``compression.ratio < 1``: then the
ternary compressor with error feedback (``driftlab.compress.error_feedback``)
wraps the upload, the final model this module sees is what the server
reconstructs, and δ_k uses the same ``Q(D_k)`` the server averages.

Partial work and dropouts: a straggler's message is dropped (its ``D_k`` is not
τ_k full steps and would bias ``D`` and every δ); it still settles its pending
report.  A client that does not report keeps its state.  Multiplicity counts in
the mean; the client updates δ_k once.

Communication: one model up (θ_k), two down (θ, D).

Under ``[privacy]``: a message reveals ``θ_k − θ^{t−1}`` (``model_change_form``);
the uniform mean divides by the public ``RoundContext.mean_denominator``, so the
noise on the sum reaches θ as σ/m (times γ) and ``D`` is broadcast as
post-processing.  The client's own δ_k uses its unclipped ``D_k``.

Example (a pending report settles with the mean change D the client receives: δ_k − s_k D):
    >>> import torch
    >>> from driftlab.algorithms import fedgate
    >>> view = fedgate.ClientView(params=torch.zeros(2), mean_change=torch.tensor([1.0, -1.0]))
    >>> fedgate.settled_correction(view, fedgate.ClientState(torch.tensor([0.5, 0.5]), pending_scale=0.25))
    tensor([0.2500, 0.7500])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from driftlab.algorithms.aggregation import ModelSums, averaging_parts, model_change_form, model_mean_fold, server_step
from driftlab.algorithms.section import named_section
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, lacking, synchronous_only
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate, GradientCorrection, RoundContext

# Why FedBuff cannot run FedGATE (Algorithm.asynchronous_refusal; docs/algorithms.md, "Asynchronous").
ASYNCHRONOUS_REASON = synchronous_only(
    "fedgate",
    why=(
        "FedGATE updates δ_k by (Q(D_k) − D)/(η τ) with D the mean of the round the client reported in, which "
        "keeps Σ_k δ_k = 0: FedBuff folds stale, s(τ)-weighted changes into buffers that are no round's mean, so "
        "that sum would drift and the fixed point would leave the minimiser (no asynchronous FedGATE rule is "
        "published)"
    ),
)


Config = named_section(
    "fedgate",
    """``[algorithm]`` section for FedGATE; ``η_l``, ``τ`` come from ``[client]`` and ``γ`` is ``server.lr``.""",
    __name__,
)


@dataclass(frozen=True)
class ServerState:
    params: torch.Tensor  # θ^t
    mean_change: torch.Tensor  # D^t = mean_P Q(θ^{t−1} − θ_k), 0 before the first round
    optimizer_state: Any


@dataclass(frozen=True)
class ClientView:
    """What a selected client receives: θ^{t−1} and the last round's mean change D^{t−1}."""

    params: torch.Tensor
    mean_change: torch.Tensor


@dataclass(frozen=True)
class ClientState:
    correction: torch.Tensor  # δ_k with its last report's own term added, the mean's term still pending
    pending_scale: float  # s_k = 1/(η_l τ_k) of that report; 0.0: nothing pending


@dataclass(frozen=True)
class ClientMessage:
    params: torch.Tensor  # θ_k (the server forms D_k = θ^{t−1} − θ_k)
    multiplicity: int


def settled_correction(view: ClientView, client: ClientState) -> torch.Tensor:
    """δ_k for this round: the pending report settled with the mean change the client received, δ_k − s_k D."""
    if client.pending_scale == 0.0:
        return client.correction
    return client.correction - client.pending_scale * view.mean_change


def build(server_optimizer: Any) -> Algorithm:
    """FedGATE whose server step applies ``server_optimizer`` to ``q = D^t`` with rate ``γ`` (``server.lr``)."""

    def server_init(initial_params: torch.Tensor) -> ServerState:
        return ServerState(initial_params, torch.zeros_like(initial_params), server_optimizer.init(initial_params))

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        return ClientState(torch.zeros_like(initial_params), 0.0)

    def client_objective(view: ClientView, client: ClientState, context: ClientContext) -> GradientCorrection:
        return GradientCorrection(linear=-settled_correction(view, client))

    def client_finish(
        view: ClientView, client: ClientState, context: ClientContext, update: ClientUpdate
    ) -> tuple[ClientState, ClientMessage | None]:
        correction = settled_correction(view, client)
        if context.is_incomplete or update.steps_done == 0:
            # A straggler's Δ is not τ full steps: dropped, nothing pending (its settlement above still holds).
            return ClientState(correction, 0.0), None
        scale = 1.0 / (update.steps_done * context.client_lr)  # 1/(η_l τ_k) with the round's actual values
        own_change = view.params - update.final_params  # Q(D_k): final_params is what the server reconstructs
        return ClientState(correction + scale * own_change, scale), ClientMessage(
            update.final_params, context.multiplicity
        )

    def aggregation_finish(
        server: ServerState, client_models: ModelSums, context: RoundContext
    ) -> tuple[ServerState, dict[str, float]]:
        client_average = client_models.value(context.mean_denominator)
        # D^t = θ^{t−1} − mean_P θ_k = mean_P D_k, the pseudo-gradient the server optimizer steps on.
        params, optimizer_state = server_step(server_optimizer, server, client_average, context)
        return ServerState(params, server.params - client_average, optimizer_state), {}

    def broadcast(server: ServerState) -> ClientView:
        return ClientView(server.params, server.mean_change)

    form = model_change_form(lambda params: ClientMessage(params, multiplicity=1))
    fold = model_mean_fold("uniform", aggregation_finish)  # mean_P θ_k, each client counted by its multiplicity
    parts = averaging_parts("uniform", fold, form, *lacking(ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON))
    return Algorithm(
        "fedgate",
        server_init,
        client_objective,
        client_finish,
        broadcast=broadcast,
        client_state_init=client_state_init,
        **parts,
    )


def from_config(config: Config, server_optimizer: Any) -> Algorithm:
    return build(server_optimizer)
