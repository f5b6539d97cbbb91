r"""Server optimizers for FedSGD / FedOpt: optax-style ``init`` / ``update`` pairs, built as chains.

A server optimizer turns the aggregated pseudo-gradient of a round into the
next global model. FedAvg, FedAdam, FedAvgM, ... differ only in this step
(``docs/update-rules.md``, section "FedSGD / FedOpt").

Each is a :func:`chain` of update transformations: a stage takes the update
(the pseudo-gradient ``q`` at the start) and its own state and returns the
transformed update and new state; the chain subtracts the result from the
model. The stages are :func:`scale_by_momentum`, :func:`scale_by_second_moment`
(the code Adam, Adagrad and Yogi share; they differ only in the rule for
``v``: :func:`exponential_average`, :func:`running_sum`, :func:`yogi_step`)
and :func:`scale_by_learning_rate` (the rate of this round, optionally with
:func:`adam_bias_correction`). ``sgd = chain(scale_by_learning_rate())``,
``adam = chain(scale_by_second_moment(exponential_average(β2), β1, ε),
scale_by_learning_rate(adam_bias_correction(β1, β2)))``, and so on; each
named optimizer computes exactly the floating-point operations it always did.
:func:`clip_by_global_norm` is a stage no named optimizer uses, for chains of
your own. A config names an optimizer, or states a chain stage by stage, through
the registry (``driftlab.optim.registry``, ``[server] optimizer = "chain"``).

References:
  * "Faster Federated Learning with Decaying Number of Local SGD Steps"
    (``papers/003_*.txt``): FedSGD with a server learning rate, and FedAdam
    as its Algorithm 3.
  * S. J. Reddi, Z. Charles, M. Zaheer, Z. Garrett, K. Rush, J. Konečný,
    S. Kumar, H. B. McMahan, "Adaptive Federated Optimization", 2020
    (arXiv:2003.00295), Algorithm 2 (FedAdagrad, FedYogi, FedAdam).
  * T.-M. H. Hsu, H. Qi, M. Brown, "Measuring the Effects of Non-Identical
    Data Distribution for Federated Visual Classification", 2019 (FedAvgM).

Everything works on FLAT parameter vectors: ``params`` is one 1-D floating
tensor holding the whole model, and ``pseudo_gradient`` has the same shape,
dtype and device. Computation happens in the dtype and on the device of
``params``. Inputs are never modified in place; ``update`` returns new
tensors, and no returned tensor shares memory with an input.

Sign convention. The pseudo-gradient points *uphill*, like a gradient:

    q = θ^{t-1} − Σ_k w_k θ_k          (old model minus aggregated client models)

so every optimizer *subtracts*. Reddi et al. use the client delta
``Δ = Σ_k w_k θ_k − θ^{t-1} = −q`` and *add*; their first moment is the
negative of ours, their second moment is identical (it only sees ``q²``), and
the updates are the same. ``η`` is the learning rate passed to ``update``
(a schedule, if any, is evaluated by the caller). ``t`` counts updates from 1.
All products and powers of vectors are elementwise.

Updates (state starts at ``m = 0``, ``v = 0`` unless noted):

  sgd (FedSGD; FedAvg is ``η = 1``)::

      θ ← θ − η q

  momentum (FedAvgM; ``nesterov=True`` uses the PyTorch form)::

      v ← β v + q
      θ ← θ − η v                       (plain)
      θ ← θ − η (q + β v)               (Nesterov, with the updated v)

  adam (paper 003, Algorithm 3, as cleaned up in ``algorithms.md``)::

      m ← β1 m + (1 − β1) q
      v ← β2 v + (1 − β2) q²
      η_t = η √(1 − β2^t) / (1 − β1^t)  (η_t = η when bias_correction=False)
      θ ← θ − η_t m / (√v + ε)

    The extracted text of Algorithm 3 reads ``m / √(v + ε)``; the design sheet
    (which wins over the garbled extraction) and Kingma & Ba's "ε̂" form put
    ε outside the root, as here. Reddi's Algorithm 2 has no bias correction:
    use ``bias_correction=False`` and ``epsilon=τ`` for their FedAdam.

  adagrad (Reddi et al., Algorithm 2, FedAdagrad; ``v`` starts at
  ``initial_accumulator``)::

      m ← β1 m + (1 − β1) q             (β1 = 0 by default, so m = q)
      v ← v + q²
      θ ← θ − η m / (√v + τ)

  yogi (Reddi et al., Algorithm 2, FedYogi; ``v`` starts at
  ``initial_accumulator``)::

      m ← β1 m + (1 − β1) q
      v ← v − (1 − β2) q² sign(v − q²)  (sign of the *previous* v; sign(0) = 0)
      θ ← θ − η m / (√v + τ)

  Here τ is the ``epsilon`` argument. Reddi et al. require ``v_0 ≥ τ²``; the
  Yogi default ``initial_accumulator = 1e-6 = (1e-3)²`` meets it.

State is one small frozen dataclass per optimizer holding only tensors and
ints, so it checkpoints as it is (``driftlab.simulation.state.checkpoint``): a
chain's state holds ``step`` and its stages' fields (``velocity``,
``first_moment``, ``second_moment``), the checkpoint keys the named
optimizers have always had.

Bit-exactness of FedAvg as FedSGD: ``sgd`` computes ``params − η·q``. With
``η = 1.0`` the multiply is exact, so the result is ``params − q`` rounded
once. When ``q = params − average`` was itself computed exactly (Sterbenz, or
few significant bits), the result is the average bit for bit; in general it
is within one rounding of it, not necessarily equal.

Example:

>>> import torch
>>> from driftlab.optim.server import make_server_optimizer, sgd
>>> optimizer = sgd()
>>> params = torch.tensor([1.0, 2.0])
>>> client_average = torch.tensor([0.5, 3.0])
>>> state = optimizer.init(params)
>>> params, state = optimizer.update(state, params, params - client_average, 1.0)
>>> params
tensor([0.5000, 3.0000])
>>> state.step
1
>>> fedadam = make_server_optimizer("adam", beta1=0.9, beta2=0.99)
>>> state = fedadam.init(params)
>>> params, state = fedadam.update(state, params, torch.tensor([0.5, -2.0]), 0.1)
>>> params
tensor([0.4000, 3.1000])
>>> state.step
1
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, make_dataclass
from typing import Union

import torch

__all__ = [
    "AdagradState",
    "AdamState",
    "CONSTRUCTORS",
    "MomentumState",
    "SERVER_OPTIMIZER_NAMES",
    "ServerOptimizer",
    "ServerOptimizerState",
    "SgdState",
    "UpdateTransformation",
    "YogiState",
    "adagrad",
    "adam",
    "adam_bias_correction",
    "chain",
    "clip_by_global_norm",
    "exponential_average",
    "make_server_optimizer",
    "momentum",
    "running_sum",
    "scale_by_learning_rate",
    "scale_by_momentum",
    "scale_by_second_moment",
    "sgd",
    "yogi",
    "yogi_step",
]

# ---------------------------------------------------------------------------
# State types. eq=False: dataclass equality would compare tensors with `==`
# and raise on multi-element tensors; compare fields explicitly instead.
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SgdState:
    """State of :func:`sgd`.

    Attributes:
      step: number of updates applied so far.
    """

    step: int


@dataclass(frozen=True, eq=False)
class MomentumState:
    """State of :func:`momentum`.

    Attributes:
      step: number of updates applied so far.
      velocity: ``v``, the momentum buffer (same shape/dtype/device as params).
    """

    step: int
    velocity: torch.Tensor


@dataclass(frozen=True, eq=False)
class _MomentsState:
    """The fields of the adaptive optimizers' states: ``step``, the number of updates applied so far (``t`` of the
    next update is ``step + 1``); ``first_moment``, ``m``; ``second_moment``, ``v``.  Each optimizer has its own
    subclass, so a state handed to another optimizer is refused."""

    step: int
    first_moment: torch.Tensor
    second_moment: torch.Tensor


@dataclass(frozen=True, eq=False)
class AdamState(_MomentsState):
    """State of :func:`adam`: ``m`` and ``v`` the exponential averages of the pseudo-gradient and of its square."""


@dataclass(frozen=True, eq=False)
class AdagradState(_MomentsState):
    """State of :func:`adagrad`: ``m`` (the last pseudo-gradient when ``beta1 = 0``) and ``v``, the running sum of
    squared pseudo-gradients plus the initial accumulator."""


@dataclass(frozen=True, eq=False)
class YogiState(_MomentsState):
    """State of :func:`yogi`: ``m`` and ``v`` as Yogi's additive update of the second moment leaves them."""


# ---------------------------------------------------------------------------
# Validation helpers.
# ---------------------------------------------------------------------------


def _check_real(name: str, value: object) -> float:
    # bool is an int subclass; `beta1=True` is a bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def _check_decay(name: str, value: object) -> float:
    value = _check_real(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


def _check_positive(name: str, value: object) -> float:
    value = _check_real(name, value)
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def _check_non_negative(name: str, value: object) -> float:
    value = _check_real(name, value)
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _check_params(params: object) -> None:
    if not isinstance(params, torch.Tensor):
        raise TypeError(f"params must be a torch.Tensor, got {type(params).__name__}")
    if params.dim() != 1 or not params.is_floating_point():
        raise ValueError(
            f"params must be a flat 1-D floating tensor, got shape {tuple(params.shape)} and dtype {params.dtype}"
        )


def _check_like_params(name: str, tensor: object, params: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != params.shape or tensor.dtype != params.dtype or tensor.device != params.device:
        raise ValueError(
            f"{name} must match params (shape {tuple(params.shape)}, {params.dtype}, "
            f"{params.device}), got shape {tuple(tensor.shape)}, {tensor.dtype}, {tensor.device}"
        )


def _check_update_inputs(
    optimizer_name: str,
    state_type: type,
    state: object,
    params: torch.Tensor,
    pseudo_gradient: torch.Tensor,
    learning_rate: float,
) -> None:
    if not isinstance(state, state_type):
        raise TypeError(
            f"server optimizer {optimizer_name!r} expects a {state_type.__name__}, got {type(state).__name__}"
        )
    _check_params(params)
    _check_like_params("pseudo_gradient", pseudo_gradient, params)
    for field in fields(state):
        value = getattr(state, field.name)
        if isinstance(value, torch.Tensor):
            _check_like_params(f"state.{field.name}", value, params)
    # math.isfinite also accepts a 0-d tensor, so a tensor-valued schedule works.
    if not (math.isfinite(learning_rate) and learning_rate >= 0):
        raise ValueError(f"learning_rate must be finite and >= 0, got {learning_rate!r}")


ServerOptimizerState = Union[SgdState, MomentumState, AdamState, AdagradState, YogiState]


# ---------------------------------------------------------------------------
# Update transformations and their chain.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class UpdateTransformation:
    """One stage of a server step: an update in, a transformed update out.

    Attributes:
      init: ``init(params) -> {field: tensor}``, the stage's state (empty for a
        stateless stage); the field names become the chain state's fields.
      update: ``update(update, fields, step, learning_rate) -> (update,
        new_fields)``; ``step`` is ``t``, counting updates from 1.
      stateless_rate: True only for :func:`scale_by_learning_rate` without a
        correction or schedule, so a chain of it alone is FedSGD (see ``optim/apply.py``).
    """

    init: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    update: Callable[[torch.Tensor, dict[str, torch.Tensor], int, float], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    stateless_rate: bool = False


def scale_by_learning_rate(
    correction: Callable[[float, int], float] | None = None,
    schedule: Callable[[int], float] | None = None,
) -> UpdateTransformation:
    """``u ← η_t u``: ``η_t = η`` or ``correction(η, t)`` (a Python float, so one tensor multiply).

    ``η`` is the rate passed to the chain's ``update`` (the configured
    ``server.lr``, a schedule of the round evaluated by the engine), or, with
    ``schedule`` attached, ``schedule(t)`` of the update count ``t`` (such as a
    ``driftlab.optim.schedules`` schedule; it counts updates, so a round in
    which no client reported does not advance it).
    """

    def update(
        direction: torch.Tensor, _state: dict[str, torch.Tensor], step: int, learning_rate: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rate = learning_rate if schedule is None else float(schedule(step))
        step_size = rate if correction is None else correction(rate, step)
        return step_size * direction, {}

    plain = correction is None and schedule is None
    return UpdateTransformation(init=lambda _params: {}, update=update, stateless_rate=plain)


def adam_bias_correction(beta1: float, beta2: float) -> Callable[[float, int], float]:
    """``η_t = η √(1−β2^t)/(1−β1^t)``, for :func:`scale_by_learning_rate`."""
    beta1 = _check_decay("beta1", beta1)
    beta2 = _check_decay("beta2", beta2)

    def correction(learning_rate: float, step: int) -> float:
        # Python floats (double) for the scalar, whatever the params dtype.
        return learning_rate * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)

    return correction


def scale_by_momentum(beta: float = 0.9, nesterov: bool = False) -> UpdateTransformation:
    """``v ← β v + u``; ``u ← v`` (plain) or ``u ← u + β v`` (Nesterov, with the updated v)."""
    beta = _check_decay("beta", beta)
    nesterov = _check_bool("nesterov", nesterov)

    def update(
        direction: torch.Tensor, state: dict[str, torch.Tensor], _step: int, _learning_rate: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        velocity = beta * state["velocity"] + direction
        return (direction + beta * velocity if nesterov else velocity), {"velocity": velocity}

    return UpdateTransformation(init=lambda params: {"velocity": torch.zeros_like(params)}, update=update)


def clip_by_global_norm(max_norm: float) -> UpdateTransformation:
    """``u ← u · min(1, c / ‖u‖₂)``: the whole update (one flat vector, so its global norm) cut to norm ``c``.

    Server-side clipping of the pseudo-gradient, as in optax's ``clip_by_global_norm`` and the clipped
    aggregation of DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language Models",
    2018), here without noise. Stateless; an update within the norm passes through untouched (no multiply),
    and the factor is a Python float, so one tensor multiply when it is cut.
    """
    max_norm = _check_positive("max_norm", max_norm)

    def update(
        direction: torch.Tensor, _state: dict[str, torch.Tensor], _step: int, _learning_rate: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        norm = float(torch.linalg.vector_norm(direction))
        return (direction if norm <= max_norm else (max_norm / norm) * direction), {}

    return UpdateTransformation(init=lambda _params: {}, update=update)


def exponential_average(beta2: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Adam's second moment: ``v ← β2 v + (1 − β2) u²``."""
    beta2 = _check_decay("beta2", beta2)
    return lambda second_moment, squared: beta2 * second_moment + (1.0 - beta2) * squared


def running_sum(second_moment: torch.Tensor, squared: torch.Tensor) -> torch.Tensor:
    """Adagrad's second moment: ``v ← v + u²``."""
    return second_moment + squared


def yogi_step(beta2: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Yogi's second moment: ``v ← v − (1 − β2) u² sign(v − u²)`` (sign of the previous v)."""
    beta2 = _check_decay("beta2", beta2)
    return lambda second_moment, squared: second_moment - (1.0 - beta2) * squared * torch.sign(second_moment - squared)


def scale_by_second_moment(
    second_moment_rule: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    beta1: float,
    epsilon: float,
    initial_accumulator: float = 0.0,
) -> UpdateTransformation:
    """Adam, Adagrad and Yogi's shared stage: ``m ← β1 m + (1−β1) u``; ``v ←
    second_moment_rule(v, u²)`` (``v`` starts at ``initial_accumulator``);
    ``u ← m / (√v + ε)``."""
    beta1 = _check_decay("beta1", beta1)
    epsilon = _check_positive("epsilon", epsilon)
    initial_accumulator = _check_non_negative("initial_accumulator", initial_accumulator)

    def init(params: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"first_moment": torch.zeros_like(params), "second_moment": torch.full_like(params, initial_accumulator)}

    def update(
        direction: torch.Tensor, state: dict[str, torch.Tensor], _step: int, _learning_rate: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        first_moment = beta1 * state["first_moment"] + (1.0 - beta1) * direction
        second_moment = second_moment_rule(state["second_moment"], direction.square())
        return first_moment / (second_moment.sqrt() + epsilon), {
            "first_moment": first_moment,
            "second_moment": second_moment,
        }

    return UpdateTransformation(init=init, update=update)


@dataclass(frozen=True)
class ServerOptimizer:
    """A server optimizer as a pair of pure functions.

    Attributes:
      name: the configured name (``"sgd"``, ``"adam"``, ...) or ``"chain"``.
      init: ``init(params) -> state``.
      update: ``update(state, params, pseudo_gradient, learning_rate) ->
        (new_params, new_state)``, where ``pseudo_gradient = θ^{t-1} −
        aggregate(θ_k)``.
      plain_step: the chain is ``scale_by_learning_rate()`` alone (FedSGD),
        so at rate 1 the server step is the clients' average itself.
    """

    name: str
    init: Callable[[torch.Tensor], ServerOptimizerState]
    update: Callable[
        [ServerOptimizerState, torch.Tensor, torch.Tensor, float],
        tuple[torch.Tensor, ServerOptimizerState],
    ]
    plain_step: bool = False


def chain(
    *transformations: UpdateTransformation, name: str = "chain", state_type: type | None = None
) -> ServerOptimizer:
    """The server step ``θ ← θ − u``, with ``u`` the pseudo-gradient passed through ``transformations`` in order.

    The state is one frozen dataclass: ``step`` and every stage's fields, so it
    checkpoints as ``step``, ``velocity``, ``first_moment``, ... (the layout the
    named optimizers always had). ``state_type`` names that dataclass (the
    named optimizers pass their own); two stages may not share a field name.
    The learning rate (the server-lr schedule at this round, evaluated by the
    engine) reaches every stage; :func:`scale_by_learning_rate` applies it.
    """
    if not transformations or not all(isinstance(t, UpdateTransformation) for t in transformations):
        raise TypeError("chain takes one or more UpdateTransformation stages")
    probe = torch.zeros(1)
    stage_fields = [tuple(t.init(probe)) for t in transformations]
    names = [field for stage in stage_fields for field in stage]
    if len(set(names)) != len(names) or "step" in names:
        raise ValueError(f"the stages of a chain need distinct state field names other than 'step', got {names}")
    if state_type is None:
        state_type = make_dataclass(
            "ChainState", [("step", int), *((field, torch.Tensor) for field in names)], frozen=True, eq=False
        )
    elif [field.name for field in fields(state_type)] != ["step", *names]:
        raise ValueError(f"{state_type.__name__} must have the fields step, {', '.join(names)}")

    def init(params: torch.Tensor) -> ServerOptimizerState:
        _check_params(params)
        values: dict[str, torch.Tensor] = {}
        for transformation in transformations:
            values.update(transformation.init(params))
        return state_type(step=0, **values)

    def update(
        state: ServerOptimizerState, params: torch.Tensor, pseudo_gradient: torch.Tensor, learning_rate: float
    ) -> tuple[torch.Tensor, ServerOptimizerState]:
        _check_update_inputs(name, state_type, state, params, pseudo_gradient, learning_rate)
        step = state.step + 1
        direction = pseudo_gradient
        values: dict[str, torch.Tensor] = {}
        for transformation, own_fields in zip(transformations, stage_fields, strict=True):
            direction, new_values = transformation.update(
                direction, {field: getattr(state, field) for field in own_fields}, step, learning_rate
            )
            values.update(new_values)
        return params - direction, state_type(step=step, **values)

    plain_step = len(transformations) == 1 and transformations[0].stateless_rate
    return ServerOptimizer(name=name, init=init, update=update, plain_step=plain_step)


# ---------------------------------------------------------------------------
# The named optimizers: chains.
# ---------------------------------------------------------------------------


def sgd() -> ServerOptimizer:
    """FedSGD server step ``θ ← θ − η q``; FedAvg is ``η = 1``.

    Computes ``params - learning_rate * pseudo_gradient``. With
    ``learning_rate = 1.0`` the multiply is exact, so the result is
    ``params − q`` with a single rounding; if ``q = params − average`` was
    exact, that is ``average`` bit for bit.

    Returns:
      ``chain(scale_by_learning_rate())`` named ``"sgd"`` with :class:`SgdState`.
    """
    return chain(scale_by_learning_rate(), name="sgd", state_type=SgdState)


def momentum(beta: float = 0.9, nesterov: bool = False) -> ServerOptimizer:
    """Server momentum (FedAvgM): ``v ← β v + q``, ``θ ← θ − η v``.

    With ``nesterov=True``: ``θ ← θ − η (q + β v)`` using the updated ``v``
    (the form of ``torch.optim.SGD(nesterov=True)`` with no dampening). From
    a fresh state the first plain update equals :func:`sgd` and the first
    Nesterov update is ``θ − η (1 + β) q``; ``beta=0`` is exactly :func:`sgd`.

    Args:
      beta: momentum coefficient β in [0, 1).
      nesterov: use the Nesterov form.

    Returns:
      ``chain(scale_by_momentum(beta, nesterov), scale_by_learning_rate())``
      named ``"momentum"`` with :class:`MomentumState`.

    Raises:
      ValueError: if ``beta`` is outside [0, 1).
    """
    return chain(scale_by_momentum(beta, nesterov), scale_by_learning_rate(), name="momentum", state_type=MomentumState)


def adam(
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-8,
    bias_correction: bool = True,
) -> ServerOptimizer:
    """FedAdam server step (paper 003, Algorithm 3).

    ``m ← β1 m + (1−β1) q``; ``v ← β2 v + (1−β2) q²``;
    ``η_t = η √(1−β2^t)/(1−β1^t)`` (``η_t = η`` without bias correction);
    ``θ ← θ − η_t m / (√v + ε)``. ε sits outside the root (see the module
    docstring for why this differs from the extracted paper text).

    Args:
      beta1: first-moment decay β1 in [0, 1).
      beta2: second-moment decay β2 in [0, 1).
      epsilon: ε > 0 added to √v.
      bias_correction: scale the rate by ``√(1−β2^t)/(1−β1^t)``. Off gives
        Reddi et al.'s FedAdam (with ``epsilon`` as their τ).

    Returns:
      ``chain(scale_by_second_moment(exponential_average(β2), β1, ε),
      scale_by_learning_rate(adam_bias_correction(β1, β2)))`` named
      ``"adam"`` with :class:`AdamState`.

    Raises:
      ValueError: if a β is outside [0, 1) or ε is not > 0.
    """
    bias_correction = _check_bool("bias_correction", bias_correction)
    moments = scale_by_second_moment(exponential_average(beta2), beta1, epsilon)
    rate = scale_by_learning_rate(adam_bias_correction(beta1, beta2) if bias_correction else None)
    return chain(moments, rate, name="adam", state_type=AdamState)


def adagrad(
    epsilon: float = 1e-3,
    initial_accumulator: float = 0.0,
    beta1: float = 0.0,
) -> ServerOptimizer:
    """FedAdagrad server step (Reddi et al. 2020, Algorithm 2).

    ``m ← β1 m + (1−β1) q``; ``v ← v + q²``; ``θ ← θ − η m / (√v + τ)``, with
    ``v`` starting at ``initial_accumulator``. Reddi et al. write the update
    with ``Δ = −q`` and ``+``; the result is identical.

    The default ``beta1 = 0`` is plain Adagrad (``m = q`` exactly), the
    setting of Reddi et al.'s FedAdagrad analysis; their Algorithm 2 allows
    β1 > 0 (momentum on the pseudo-gradient), available through ``beta1``.

    Args:
      epsilon: τ > 0 added to √v.
      initial_accumulator: initial value of ``v``, ≥ 0 (Reddi et al.
        assume ≥ τ²).
      beta1: first-moment decay β1 in [0, 1).

    Returns:
      ``chain(scale_by_second_moment(running_sum, β1, τ, initial_accumulator),
      scale_by_learning_rate())`` named ``"adagrad"`` with :class:`AdagradState`.

    Raises:
      ValueError: if ε is not > 0, the initial accumulator is negative, or
        β1 is outside [0, 1).
    """
    moments = scale_by_second_moment(running_sum, beta1, epsilon, initial_accumulator)
    return chain(moments, scale_by_learning_rate(), name="adagrad", state_type=AdagradState)


def yogi(
    beta1: float = 0.9,
    beta2: float = 0.99,
    epsilon: float = 1e-3,
    initial_accumulator: float = 1e-6,
) -> ServerOptimizer:
    """FedYogi server step (Reddi et al. 2020, Algorithm 2).

    ``m ← β1 m + (1−β1) q``; ``v ← v − (1−β2) q² sign(v − q²)`` (previous
    ``v``); ``θ ← θ − η m / (√v + τ)``. ``v`` starts at
    ``initial_accumulator`` (default ``1e-6 = τ²`` for the default τ).
    Reddi et al. write the update with ``Δ = −q`` and ``+``; the result is
    identical because ``v`` only sees ``q²``.

    Args:
      beta1: first-moment decay β1 in [0, 1).
      beta2: second-moment rate β2 in [0, 1).
      epsilon: τ > 0 added to √v.
      initial_accumulator: initial value of ``v``, ≥ 0.

    Returns:
      ``chain(scale_by_second_moment(yogi_step(β2), β1, τ, initial_accumulator),
      scale_by_learning_rate())`` named ``"yogi"`` with :class:`YogiState`.

    Raises:
      ValueError: if a β is outside [0, 1), ε is not > 0, or the initial
        accumulator is negative.
    """
    moments = scale_by_second_moment(yogi_step(beta2), beta1, epsilon, initial_accumulator)
    return chain(moments, scale_by_learning_rate(), name="yogi", state_type=YogiState)


# The named optimizers by name, for code that builds one by keyword arguments (``make_server_optimizer``). A config
# names them through the registry (``driftlab.optim.registry``), whose entries read their own [server] keys.
CONSTRUCTORS: dict[str, Callable[..., ServerOptimizer]] = {
    "sgd": sgd,
    "momentum": momentum,
    "adam": adam,
    "adagrad": adagrad,
    "yogi": yogi,
}

SERVER_OPTIMIZER_NAMES: tuple[str, ...] = tuple(CONSTRUCTORS)


def make_server_optimizer(name: str, **hyperparameters: object) -> ServerOptimizer:
    """Build a server optimizer by name.

    Args:
      name: one of ``SERVER_OPTIMIZER_NAMES``: ``"sgd"``, ``"momentum"``,
        ``"adam"``, ``"adagrad"``, ``"yogi"``.
      **hyperparameters: keyword arguments of that constructor.

    Returns:
      The :class:`ServerOptimizer`.

    Raises:
      ValueError: for an unknown name, an unknown hyperparameter (both list
        the valid choices) or an out-of-range hyperparameter.
    """
    if name not in CONSTRUCTORS:
        raise ValueError(f"unknown server optimizer {name!r}; valid names: {', '.join(SERVER_OPTIMIZER_NAMES)}")
    constructor = CONSTRUCTORS[name]
    accepted = list(inspect.signature(constructor).parameters)
    unknown = sorted(set(hyperparameters) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown hyperparameter(s) {', '.join(unknown)} for server optimizer {name!r}; "
            f"valid: {', '.join(accepted) if accepted else '(none)'}"
        )
    return constructor(**hyperparameters)
