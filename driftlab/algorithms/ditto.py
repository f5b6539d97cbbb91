"""Ditto (Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021;
arXiv 2012.04221, Algorithm 1; the authors' code github.com/litian96/ditto, ``flearn/trainers_MTL/ditto.py``).

Every client k keeps a personal model ``v_k`` beside the global model ``w``, which is trained as usual::

    global:    min_w G(w) = Σ_k p_k F_k(w)                               (FedAvg here)
    personal:  min_{v_k} h_k(v_k; w*) = F_k(v_k) + λ/2 ‖v_k − w*‖²       (w* the global model)

Algorithm 1, round t, each selected client k given ``w^t``::

    w_k = K steps of local SGD on F_k from w^t                        (FedAvg's client; w_k is what it sends)
    s steps of  v_k ← v_k − η (∇F_k(v_k; ξ) + λ (v_k − w^t))          (v_k is its client state; never sent)
    server:    w^{t+1} = FedAvg's aggregate of the w_k                 (``fedavg.build``: aggregation, server optimizer,
                                                                        stragglers rule, release form: all FedAvg's)

The personal pass is ``ClientUpdate.computation.train(v_k, GradientCorrection(quadratic=λ, reference=w^t), s,
"personal")`` in ``client_finish``: the round's η_l, weight decay, clipping (of ∇F_k alone; the λ term is added after
it), augmentation and precision, minibatches from (seed, round, client, "personal").  As in the paper and the code:

* the proximal reference is ``w^t``, the model the client received this round (the code's ``self.global_model``,
  fixed while the client trains), not its own updated ``w_k``;
* ``s`` = the steps of the client's global pass (the code's ``local_iters`` for both) unless ``personal_steps`` is
  set; the step size is the global pass's (the code's one ``learning_rate``);
* ``v_k`` and ``w_k`` do not depend on each other within a round (the reference is ``w^t``), so doing the personal
  pass after the global one (the code interleaves them, step by step) changes only which minibatches it reads:
  the code's step j of each reads the same minibatch, here each pass draws its own;
* what a client predicts with is ``v_k`` (``Personalization``; the code's ``test(self.local_models)``), ``θ⁰`` for a
  client that has never been selected (the code starts every local model at the initial global model).

``λ = 0``: ``v_k`` is trained on the client's data alone (the code's README: "ditto with lam=0 corresponds to
training separate local models"); no correction at all is applied.  ``λ → ∞``: ``v_k → w^t``; with explicit SGD the
pass is stable for ``η (L + λ) < 2``, and ``η λ = 1`` sets each step to ``v_k ← w^t − η ∇F_k(v_k; ξ)``.  For a
convex ``F_k`` the pass's fixed point ``v_k*`` satisfies ``‖v_k* − w^t‖ ≤ ‖∇F_k(w^t)‖ / λ``.

Partial work and dropouts: a straggler (``ClientContext.is_incomplete``) does at most as many personal steps as it
did global ones; FedAvg's rule (``incomplete``, default "drop") decides only whether its ``w_k`` is sent; its
``v_k`` is updated either way.  A client that did no step keeps ``v_k``; an inactive client does nothing.
``personal_steps = 0`` trains no personal model (every ``v_k`` stays ``θ⁰``: the global half alone, for harnesses
whose client updates carry no ``train``).

Communication: FedAvg's, one model each way (``v_k`` never leaves the client).  Under ``[privacy]`` the message is
FedAvg's and so is the form (``aggregation = "uniform"`` only).  Asynchronously: refused (``ASYNCHRONOUS_REASON``).
A deployment runs it: the personal pass runs in ``client_finish`` on the node, and ``v_k`` stays there.

Example:
    >>> from driftlab.algorithms import ditto
    >>> from driftlab.optim.server import make_server_optimizer
    >>> import torch
    >>> algorithm = ditto.build(make_server_optimizer("sgd"), lam=0.5)
    >>> state = algorithm.client_state_init(torch.zeros(3))
    >>> view = algorithm.broadcast(algorithm.server_init(torch.ones(3)))
    >>> algorithm.personalization.model(view, state).tolist()  # a client never selected predicts with θ⁰
    [0.0, 0.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field

from driftlab.algorithms import fedavg
from driftlab.algorithms.section import Aggregation, AlgorithmConfig, Incomplete, options
from driftlab.features.capabilities import ASYNCHRONOUS_RULE, synchronous_only, with_lack
from driftlab.simulation.seam import (
    NO_CORRECTION,
    Algorithm,
    ClientContext,
    ClientUpdate,
    GradientCorrection,
    Personalization,
)

ClientView = fedavg.ClientView  # w^t: the global model, the personal pass's proximal reference too
ClientMessage = fedavg.ClientMessage

MISSING_COMPUTATION = (
    "Ditto trains each client's personal model v_k on the client's own data in client_finish "
    "(ClientUpdate.computation.train), and this client update carries no computation on the client's data: train it "
    "through driftlab.simulation.round.client (every backend and deployment does), or run fedavg"
)

# Why FedBuff cannot run Ditto (Algorithm.asynchronous_refusal; docs/algorithms.md, "Asynchronous").
ASYNCHRONOUS_REASON = synchronous_only(
    "ditto",
    why=(
        "Ditto's server model is FedAvg's, and what Ditto adds, each client's personal model v_k, is evaluated "
        "only after synchronous rounds (an asynchronous run evaluates the server model alone), and Algorithm 1 "
        "of Li et al. 2021 is synchronous"
    ),
    alternative='fedavg with aggregation = "uniform" for the same server model under FedBuff',
)

DESCRIPTION = "Ditto's personal model v_k (s proximal steps toward the received w per round)"


class Config(AlgorithmConfig):
    """``[algorithm]`` section for Ditto (the global model's server optimizer is chosen in ``[server]``)."""

    name: Literal["ditto"] = "ditto"
    lam: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="λ ≥ 0: the personal step adds λ(v_k − w^t); 0 trains separate local models, large λ keeps v_k "
        "near w (1 is the authors' scripts'; the paper picks per device from {0.1, 1, 2})",
    )
    personal_steps: int | None = Field(
        None,
        ge=0,
        description="s, the personal model's local steps per round; unset: as many as the client's global pass did "
        "(the authors' local_iters for both); 0 trains no personal model (v_k stays θ⁰)",
    )
    aggregation: Aggregation = Field(
        "weighted",
        description="the global model's (FedAvg's): w_k = n_k / Σ n_j (default) or uniform over reporting clients",
    )
    incomplete: Incomplete = Field(
        "drop",
        description="the global model's (FedAvg's): a straggler's w_k is dropped or averaged; v_k is updated either way",
    )


@dataclass(frozen=True)
class ClientState:
    personal: torch.Tensor  # v_k


def personal_steps_of(update: ClientUpdate, context: ClientContext, personal_steps: int | None) -> int:
    """``s`` for this client this round: ``personal_steps``, or the steps of its global pass when unset; a straggler
    does at most as many as its global pass did (the availability model cut its work)."""
    if personal_steps is None:
        return update.steps_done
    return min(personal_steps, update.steps_done) if context.is_incomplete else personal_steps


def personal_model(view: ClientView, state: ClientState) -> torch.Tensor:
    """What client k predicts with: ``v_k`` (``θ⁰`` until it is first selected), whatever the server holds now."""
    return state.personal


def build(
    server_optimizer: Any,
    lam: float = 1.0,
    personal_steps: int | None = None,
    aggregation: str = "weighted",
    incomplete: str = "drop",
) -> Algorithm:
    """Ditto with proximal coefficient ``lam`` (λ ≥ 0) and ``personal_steps`` (s ≥ 0, None: the global pass's steps)
    over FedAvg's global model (``server_optimizer``, ``aggregation``, ``incomplete``)."""
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"ditto needs a finite lam (λ) >= 0, got {lam}")
    if personal_steps is not None and personal_steps < 0:
        raise ValueError(f"ditto needs personal_steps >= 0 (or None: the global pass's steps), got {personal_steps}")
    global_half = fedavg.build(server_optimizer, aggregation=aggregation, incomplete=incomplete)

    def client_state_init(initial_params: torch.Tensor) -> ClientState:
        return ClientState(initial_params)  # v_k^0 = θ⁰; states are never changed in place

    def personal_correction(view: ClientView) -> GradientCorrection:
        if lam == 0:
            return NO_CORRECTION  # no term at all: separate local models, with no extra arithmetic
        return GradientCorrection(quadratic=lam, reference=view.params)

    def client_finish(
        view: ClientView, state: ClientState, context: ClientContext, update: ClientUpdate
    ) -> tuple[ClientState, Any]:
        _, message = global_half.client_finish(view, None, context, update)
        steps = personal_steps_of(update, context, personal_steps)
        if steps == 0:
            return state, message
        if update.computation is None:
            raise RuntimeError(MISSING_COMPUTATION)
        personal, _ = update.computation.train(state.personal, personal_correction(view), steps, "personal")
        return ClientState(personal), message

    return dataclasses.replace(
        global_half,
        name="ditto",
        client_state_init=client_state_init,
        client_finish=client_finish,
        asynchronous=False,
        lacks=with_lack(global_half.lacks, ASYNCHRONOUS_RULE, ASYNCHRONOUS_REASON),  # fedavg's privacy lack kept
        personalization=Personalization(personal_model, DESCRIPTION),
    )


def from_config(config: Config, server_optimizer: Any) -> Algorithm:
    return build(server_optimizer, **options(config))
