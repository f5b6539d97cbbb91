"""Local objectives beyond affine corrections: an extra loss term, and a local step of the algorithm's own.

Most algorithms change the local objective by an affine gradient correction
(``seam.GradientCorrection``), and that stays the fast path.  An algorithm
whose local loss is not affine returns a ``LocalObjective`` from
``client_objective`` instead; each local step then computes

    ℓ(θ)  = Σ_i w_i loss(model(θ; x_i), y_i) + term(LocalBatch(θ, outputs, x, y, w, forward, loss), *tensors)
    g     = ∇ℓ(θ) + a_k,  clipped,  + D_k ⊙ (θ − θ_ref) + wd · θ        (local_training.corrected_gradient)
    θ, s  = local_step(θ, g, s, η_l)            (default: θ − η_l g; s starts at local_step.initial_state)

``w_i`` is ``1/|batch|`` on the batch's real examples (and 0 on the padding
the vectorized backend adds), so the first sum is the usual mean batch loss.

* ``LossTerm`` (MOON's contrastive term, a distillation loss, FedProx's
  ``μ/2 ‖θ − θ_g‖²`` written as a loss): its gradient is added to the loss
  gradient *before* clipping.  The per-client tensors it reads (MOON's global
  and previous models) are explicit arguments, not closure variables, so the
  vectorized backend can stack them and ``torch.func.vmap`` the term; the
  function itself must be vmappable (no ``.item()``, no Python branch on
  tensor values) and is best defined once in ``build``: clients whose terms
  share a function are trained together.
* ``LocalStep`` (client momentum, a local Adam): replaces ``θ ← θ − η_l g``,
  with a state that starts from ``initial_state`` every round.  It sees one
  client's flat ``[P]`` tensors; the vectorized backend calls it once per
  client row, so it need not be vmappable.

The sequential backend takes the term's gradient with ``torch.func.grad``
through ``functional_call`` (slower than the affine path's bound module); the
vectorized backend with ``vmap(grad(...))`` of the same function, so both
agree to rounding.

FedAvg with client (local) momentum, heavy-ball SGD on each client with its
velocity restarted every round, as a ``LocalStep`` (Hsu, Qi, Brown 2019 put
momentum on the server instead: FedAvgM, ``server.optimizer = "momentum"``)::

    def heavy_ball(params, gradient, state, learning_rate):
        (velocity,) = state
        velocity = beta * velocity + gradient
        return params - learning_rate * velocity, (velocity,)

    def client_objective(view, client_state, context):
        return LocalObjective(local_step=LocalStep(heavy_ball, (torch.zeros_like(view.params),)))

Example:
    >>> import torch
    >>> prox = LossTerm(lambda batch, anchor: 0.5 * torch.sum((batch.params - anchor) ** 2), (torch.zeros(2),))
    >>> as_local_objective(prox).loss_term is prox
    True
    >>> as_local_objective(NO_CORRECTION).is_affine
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from driftlab.simulation.seam import NO_CORRECTION, GradientCorrection


class LocalBatch(NamedTuple):
    """What a loss term sees at one local step of one client (all tensors of that client alone)."""

    params: torch.Tensor  # θ, the flat [P] parameters being trained (differentiable)
    outputs: torch.Tensor  # model(θ; inputs), [B, ...] (differentiable)
    inputs: torch.Tensor  # the step's minibatch, augmented when augmentation is on, [B, ...]
    targets: torch.Tensor  # [B, ...]
    weights: torch.Tensor  # [B]: 1/|batch| on real examples, 0 on padding; a batch mean of h is Σ_i weights_i h_i
    forward: Callable[
        [torch.Tensor, torch.Tensor], torch.Tensor
    ]  # (flat params [P], inputs) -> outputs: another model's view
    # The model's per-example loss (outputs, targets) -> [B], for a term that evaluates the loss at another model (Mime's
    # ∇f_k(x̃; ζ) at its snapshot x̃); None where a caller builds a batch without a model.
    example_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def _check_function_and_tensors(owner: str, function: Any, tensors_field: str, tensors: Any) -> None:
    """A part of a local objective an algorithm supplies is a callable and a tuple of tensors (what the vectorized
    backend batches over clients); ``owner`` and ``tensors_field`` name them in the message."""
    if not callable(function):
        raise TypeError(f"{owner}.function must be callable, got {type(function).__name__}")
    if not isinstance(tensors, tuple) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{owner}.{tensors_field} must be a tuple of tensors")


@dataclass(frozen=True)
class LossTerm:
    """An extra differentiable loss ``function(batch: LocalBatch, *tensors) -> scalar`` added at every local step.

    ``tensors`` are the client's own inputs to the term (for MOON, the global
    model and the client's previous one), passed as arguments so the vectorized
    backend can batch them.  Average over examples with ``batch.weights`` (not
    ``.mean()``), so padded examples count for nothing; a term of that form
    (a weighted batch mean plus a function of θ alone) also has an exact
    full-data value, which γ-inexact stopping uses.
    """

    function: Callable[..., torch.Tensor]
    tensors: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        _check_function_and_tensors("LossTerm", self.function, "tensors", self.tensors)


@dataclass(frozen=True)
class LocalStep:
    """The algorithm's own local update ``function(params, gradient, state, learning_rate) -> (params, state)``.

    ``params`` and ``gradient`` are one client's flat ``[P]`` tensors (the
    gradient corrected and clipped as for the default step), ``state`` a tuple
    of tensors that starts as ``initial_state`` every round, ``learning_rate``
    the round's η_l.  Return new tensors; do not modify the arguments.
    """

    function: Callable[
        [torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], float], tuple[torch.Tensor, tuple[torch.Tensor, ...]]
    ]
    initial_state: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        _check_function_and_tensors("LocalStep", self.function, "initial_state", self.initial_state)


@dataclass(frozen=True)
class LocalObjective:
    """A client's local objective: an affine correction, an optional loss term and an optional step of its own."""

    correction: GradientCorrection = NO_CORRECTION
    loss_term: LossTerm | None = None
    local_step: LocalStep | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.correction, GradientCorrection):
            raise TypeError(
                f"LocalObjective.correction must be a GradientCorrection, got {type(self.correction).__name__}"
            )

    @property
    def is_affine(self) -> bool:
        """No loss term and the default step: the backends' fast path applies."""
        return self.loss_term is None and self.local_step is None


def as_local_objective(objective: GradientCorrection | LocalObjective | LossTerm | LocalStep) -> LocalObjective:
    """What ``client_objective`` returned (or a bare term or step), as a ``LocalObjective``."""
    if isinstance(objective, LocalObjective):
        return objective
    if isinstance(objective, GradientCorrection):
        return LocalObjective(correction=objective)
    if isinstance(objective, LossTerm):
        return LocalObjective(loss_term=objective)
    if isinstance(objective, LocalStep):
        return LocalObjective(local_step=objective)
    raise TypeError(
        f"client_objective must return a GradientCorrection or a LocalObjective (driftlab.simulation.backends.objectives), got {type(objective).__name__}"
    )


def objective_loss(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    example_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    term: Callable[..., torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """``(θ, inputs, targets, weights, *tensors) -> Σ_i w_i ℓ_i + term``: one client's loss, for ``torch.func.grad``
    (and ``vmap`` over clients).  Both backends differentiate this same function."""

    def loss(
        theta: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, *tensors: torch.Tensor
    ) -> torch.Tensor:
        outputs = forward(theta, inputs)
        data_loss = (example_loss(outputs, targets).to(weights.dtype) * weights).sum()
        return data_loss + term(LocalBatch(theta, outputs, inputs, targets, weights, forward, example_loss), *tensors)

    return loss


__all__ = ["LocalBatch", "LocalObjective", "LocalStep", "LossTerm", "as_local_objective", "objective_loss"]
