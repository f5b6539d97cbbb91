"""APFL (Deng, Kamani and Mahdavi, "Adaptive Personalized Federated Learning", arXiv 2003.13461, Algorithm 1;
the authors' code: FedTorch, ``fedtorch/comms/trainings/federated/apfl.py``).

Each client k keeps a local model ``v_k`` and a mixing weight ``α_k``; the global model ``w`` is FedAvg's.  Client
k's own (personalized) model is the mixture of parameters

    v̄_k = α_k v_k + (1 − α_k) w.

Local step t of a round, on minibatch ξ_t (the paper's rule: every variable moves from its value at t − 1)::

    w^t   = w^{t−1} − η_l ∇f_k(w^{t−1}; ξ_t)                          (FedAvg's local step: the message is FedAvg's)
    v̄     = α^{t−1} v^{t−1} + (1 − α^{t−1}) w^{t−1}
    v^t   = v^{t−1} − η_l ∇_v f_k(v̄; ξ_t) = v^{t−1} − η_l α^{t−1} ∇f_k(v̄; ξ_t)
    α^t   = Π_[0,1]( α^{t−1} − η_α ⟨v^{t−1} − w^{t−1}, ∇f_k(v̄; ξ_t)⟩ )   (adaptive only; ∇_α f_k(v̄) by the chain rule)

The server averages the clients' ``w`` as FedAvg does (its ``aggregation``, ``incomplete`` and server optimizer).

On the seam: the backend trains ``w`` as FedAvg's client (no correction); ``client_finish`` replays the very
minibatches that training read (``ClientComputation.minibatches(K_k, "local")``) beside a replica of ``w`` stepped
with the round's settings (``corrected_step``: η_l, weight decay, clipping), so ``v`` and ``α`` see the ``w^{t−1}``
of every step.  The replica's gradients are ``ClientComputation.loss_gradient`` and so do not depend on the backend:
``v`` and ``α`` are the same on every backend; the replica equals the sequential backend's ``w`` bit for bit
(apfl_test).  ``v``'s step is a local step with the round's settings too: ``g = clip(α ∇f_k(v̄)) + wd · v``.

Choices (docs/update-rules.md, "APFL"):

* parameter mixing (the paper, and the only mixture ``Personalization`` can express as one flat model), not the
  authors' code's output mixing ``α h_v(x) + (1 − α) h_w(x)``;
* ``v̄`` mixes ``w^{t−1}`` (the paper), not the ``w^t`` after its own step (the code);
* ``α`` learned at every local step (the paper) with ``η_α = alpha_lr`` (None: the round's η_l, as the code's
  ``lr``); the code learns it once a round, at the first step, with an L2 term ``0.02 α`` on its gradient, which is
  left out here (the paper has none);
* the evaluated model is ``v̄_k`` with the server's current ``w`` (the paper's ``v̄`` after synchronisation);
* ``v_k`` starts at θ⁰ (the code's copy of the initial model), ``α_k`` at ``alpha``; a client keeps both between
  rounds; a straggler steps ``v`` and ``α`` on the steps it did, also when ``incomplete = "drop"`` discards its ``w``.

Equivalences: α = 0 fixed: ``v̄ = w`` (the server model, exactly: ``v`` is then never read, so never stepped) and the
global model is FedAvg's bit for bit; α = 1 fixed: ``v̄ = v``, plain local SGD on the client's own data (no replica).

Privacy: the message is FedAvg's, and so is its form (``aggregation = "uniform"``).  Asynchronous training is refused
(``ASYNCHRONOUS_REASON``).  Communication: FedAvg's (one model each way; ``v`` and ``α`` never leave the client).

Example:
    >>> import torch
    >>> from driftlab.algorithms import apfl
    >>> from driftlab.optim.server import make_server_optimizer
    >>> algorithm = apfl.build(make_server_optimizer("sgd"), alpha=0.25)
    >>> state = algorithm.client_state_init(torch.zeros(2))
    >>> view = algorithm.broadcast(algorithm.server_init(torch.ones(2)))
    >>> algorithm.personalization.model(view, state).tolist()
    [0.75, 0.75]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import torch
from pydantic import Field

from driftlab.algorithms import fedavg
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, Incomplete, options
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, synchronous_only, with_lack
from driftlab.simulation.backends.local_training import LocalSettings, corrected_gradient, corrected_step
from driftlab.simulation.seam import NO_CORRECTION, Algorithm, ClientContext, ClientUpdate, Personalization

ASYNCHRONOUS_REASON = synchronous_only(
    "apfl",
    why=(
        "APFL steps each client's v_k and α_k beside the w it trains, and its personal model mixes v_k with the "
        "server's w; under FedBuff a stale client's v_k would be fit beside an old w and mixed with a newer one "
        "(the paper states no asynchronous rule)"
    ),
    alternative="",
)
DESCRIPTION = "APFL's mixed model α_k v_k + (1 − α_k) w"


class Config(AlgorithmConfig):
    """``[algorithm]`` section for APFL (the server optimizer is chosen in ``[server]``, SGD with lr 1 being the paper)."""

    name: Literal["apfl"] = "apfl"
    alpha: float = Field(
        0.25, ge=0.0, le=1.0, description="α_k at the start, in [0, 1]: the weight of the local model v_k in v̄_k"
    )
    adaptive: bool = Field(
        True, description="learn each α_k by projected SGD at every local step (the paper); false: α fixed"
    )
    alpha_lr: float | None = Field(
        None, gt=0, description="η_α, the step size of α's update; unset: the round's client lr η_l"
    )
    aggregation: Aggregation = Field(
        "weighted", description="of the global model w, as FedAvg: weighted (n_k / Σ n_j) or uniform"
    )
    incomplete: Incomplete = Field("drop", description="a straggler's w: drop it (FedAvg) or keep it")


@dataclass(frozen=True)
class ClientState:
    personal: torch.Tensor  # v_k
    alpha: float  # α_k


def mixed(alpha: float, personal: torch.Tensor, global_params: torch.Tensor) -> torch.Tensor:
    """``v̄ = α v + (1 − α) w``; exactly ``w`` at α = 0 and exactly ``v`` at α = 1."""
    if alpha == 0.0:
        return global_params
    if alpha == 1.0:
        return personal
    return alpha * personal + (1.0 - alpha) * global_params


def personal_steps(
    state: ClientState,
    start: torch.Tensor,
    batches: Iterable[tuple[Any, Any]],
    loss_gradient: Callable[[torch.Tensor, Any, Any], torch.Tensor],
    settings: LocalSettings,
    adaptive: bool,
    alpha_lr: float | None,
) -> tuple[ClientState, torch.Tensor]:
    """The paper's local steps of ``v`` and ``α`` (module docstring) on ``batches``, beside ``w`` from ``start``.

    Returns the new state and the replica's final ``w`` (the backend's ``w``, for a check).  ``α`` fixed at 1 needs no
    ``w``: the replica is then not stepped and ``start`` is returned.
    """
    personal, alpha = state.personal, state.alpha
    needs_w = adaptive or alpha != 1.0
    eta_alpha = settings.client_lr if alpha_lr is None else alpha_lr
    w = start
    for inputs, targets in batches:
        gradient = loss_gradient(mixed(alpha, personal, w), inputs, targets)  # ∇f_k(v̄^{t−1}; ξ_t)
        new_alpha = alpha
        if adaptive:
            slope = float(torch.dot(personal - w, gradient))  # ∂f_k(v̄)/∂α = ⟨v − w, ∇f_k(v̄)⟩
            new_alpha = min(1.0, max(0.0, alpha - eta_alpha * slope))
        if needs_w:
            w = corrected_step(w, loss_gradient(w, inputs, targets), NO_CORRECTION, settings)
        personal = personal - settings.client_lr * corrected_gradient(
            personal, alpha * gradient, NO_CORRECTION, settings
        )
        alpha = new_alpha
    return ClientState(personal, float(alpha)), w


def build(
    server_optimizer: Any,
    alpha: float = 0.25,
    adaptive: bool = True,
    alpha_lr: float | None = None,
    aggregation: str = "weighted",
    incomplete: str = "drop",
) -> Algorithm:
    """APFL over FedAvg with ``server_optimizer``; ``alpha`` the initial α_k in [0, 1], ``adaptive`` whether α_k is
    learned, ``alpha_lr`` its step size (None: η_l)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"APFL's alpha (the weight of the local model) must be in [0, 1], got {alpha!r}")
    if alpha_lr is not None and not alpha_lr > 0:
        raise ValueError(f"APFL's alpha_lr must be positive (or None for the client lr), got {alpha_lr!r}")
    base = fedavg.build(server_optimizer, aggregation=aggregation, incomplete=incomplete)
    frozen_at_zero = alpha == 0.0 and not adaptive  # v̄ = w for ever: v is never read

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        return ClientState(initial_params, float(alpha))

    def client_finish(
        view: Any, client: ClientState, context: ClientContext, update: ClientUpdate
    ) -> tuple[ClientState, Any]:
        _, message = base.client_finish(view, None, context, update)
        if frozen_at_zero or update.steps_done == 0:
            return client, message
        computation = update.computation
        batches = computation.minibatches(update.steps_done, "local")  # exactly the batches w was trained on
        state, _ = personal_steps(
            client, view.params, batches, computation.loss_gradient, computation.settings, adaptive, alpha_lr
        )
        return state, message

    def model(view: Any, client: ClientState) -> torch.Tensor:
        return mixed(client.alpha, client.personal, view.params)

    return dataclasses.replace(
        base,
        name="apfl",
        client_state_init=client_state_init,
        client_finish=client_finish,
        personalization=Personalization(model, DESCRIPTION),
        asynchronous=False,
        lacks=with_lack(base.lacks, ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON),  # fedavg's privacy lack kept
    )


def from_config(config: Config, server_optimizer: Any) -> Algorithm:
    return build(server_optimizer, **options(config))
