r"""Server optimizers for FedSGD / FedOpt: optax-style ``init`` / ``update`` pairs.

A server optimizer turns the aggregated pseudo-gradient of a round into the
next global model. FedAvg, FedAdam, FedAvgM, ... differ only in this step
(``design/algorithms.md``, section "FedSGD / FedOpt").

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
ints, so it checkpoints as it is (``driftlab.simulation.checkpoint``).

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
from dataclasses import dataclass, fields
from typing import Union

import torch

__all__ = [
    "AdagradState",
    "AdamState",
    "MomentumState",
    "SERVER_OPTIMIZER_NAMES",
    "ServerOptimizer",
    "ServerOptimizerState",
    "SgdState",
    "YogiState",
    "adagrad",
    "adam",
    "make_server_optimizer",
    "momentum",
    "sgd",
    "yogi",
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
class AdamState:
    """State of :func:`adam`.

    Attributes:
      step: number of updates applied so far (``t`` of the next update is
        ``step + 1``).
      first_moment: ``m``.
      second_moment: ``v``.
    """

    step: int
    first_moment: torch.Tensor
    second_moment: torch.Tensor


@dataclass(frozen=True, eq=False)
class AdagradState:
    """State of :func:`adagrad`.

    Attributes:
      step: number of updates applied so far.
      first_moment: ``m`` (equals the last pseudo-gradient when ``beta1 = 0``).
      second_moment: ``v``, the running sum of squared pseudo-gradients plus
        the initial accumulator.
    """

    step: int
    first_moment: torch.Tensor
    second_moment: torch.Tensor


@dataclass(frozen=True, eq=False)
class YogiState:
    """State of :func:`yogi`.

    Attributes:
      step: number of updates applied so far.
      first_moment: ``m``.
      second_moment: ``v``.
    """

    step: int
    first_moment: torch.Tensor
    second_moment: torch.Tensor


ServerOptimizerState = Union[SgdState, MomentumState, AdamState, AdagradState, YogiState]

_STATE_TYPES: dict[str, type] = {
    "sgd": SgdState,
    "momentum": MomentumState,
    "adam": AdamState,
    "adagrad": AdagradState,
    "yogi": YogiState,
}

SERVER_OPTIMIZER_NAMES: tuple[str, ...] = tuple(_STATE_TYPES)


@dataclass(frozen=True)
class ServerOptimizer:
    """A server optimizer as a pair of pure functions.

    Attributes:
      name: registry name (``"sgd"``, ``"momentum"``, ``"adam"``,
        ``"adagrad"`` or ``"yogi"``); pass it to :func:`state_from_tensors`.
      init: ``init(params) -> state``.
      update: ``update(state, params, pseudo_gradient, learning_rate) ->
        (new_params, new_state)``, where ``pseudo_gradient = θ^{t-1} −
        aggregate(θ_k)``.
    """

    name: str
    init: Callable[[torch.Tensor], ServerOptimizerState]
    update: Callable[
        [ServerOptimizerState, torch.Tensor, torch.Tensor, float],
        tuple[torch.Tensor, ServerOptimizerState],
    ]


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
            "params must be a flat 1-D floating tensor, "
            f"got shape {tuple(params.shape)} and dtype {params.dtype}"
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
    state: object,
    params: torch.Tensor,
    pseudo_gradient: torch.Tensor,
    learning_rate: float,
) -> None:
    state_type = _STATE_TYPES[optimizer_name]
    if not isinstance(state, state_type):
        raise TypeError(
            f"server optimizer {optimizer_name!r} expects a {state_type.__name__}, "
            f"got {type(state).__name__}"
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


# ---------------------------------------------------------------------------
# Optimizers.
# ---------------------------------------------------------------------------


def sgd() -> ServerOptimizer:
    """FedSGD server step ``θ ← θ − η q``; FedAvg is ``η = 1``.

    Computes ``params - learning_rate * pseudo_gradient``. With
    ``learning_rate = 1.0`` the multiply is exact, so the result is
    ``params − q`` with a single rounding; if ``q = params − average`` was
    exact, that is ``average`` bit for bit.

    Returns:
      A :class:`ServerOptimizer` named ``"sgd"`` with :class:`SgdState`.
    """

    def init(params: torch.Tensor) -> SgdState:
        _check_params(params)
        return SgdState(step=0)

    def update(
        state: SgdState, params: torch.Tensor, pseudo_gradient: torch.Tensor, learning_rate: float
    ) -> tuple[torch.Tensor, SgdState]:
        _check_update_inputs("sgd", state, params, pseudo_gradient, learning_rate)
        new_params = params - learning_rate * pseudo_gradient
        return new_params, SgdState(step=state.step + 1)

    return ServerOptimizer(name="sgd", init=init, update=update)


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
      A :class:`ServerOptimizer` named ``"momentum"`` with :class:`MomentumState`.

    Raises:
      ValueError: if ``beta`` is outside [0, 1).
    """
    beta = _check_decay("beta", beta)
    nesterov = _check_bool("nesterov", nesterov)

    def init(params: torch.Tensor) -> MomentumState:
        _check_params(params)
        return MomentumState(step=0, velocity=torch.zeros_like(params))

    def update(
        state: MomentumState, params: torch.Tensor, pseudo_gradient: torch.Tensor, learning_rate: float
    ) -> tuple[torch.Tensor, MomentumState]:
        _check_update_inputs("momentum", state, params, pseudo_gradient, learning_rate)
        velocity = beta * state.velocity + pseudo_gradient
        if nesterov:
            direction = pseudo_gradient + beta * velocity
        else:
            direction = velocity
        new_params = params - learning_rate * direction
        return new_params, MomentumState(step=state.step + 1, velocity=velocity)

    return ServerOptimizer(name="momentum", init=init, update=update)


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
      A :class:`ServerOptimizer` named ``"adam"`` with :class:`AdamState`.

    Raises:
      ValueError: if a β is outside [0, 1) or ε is not > 0.
    """
    beta1 = _check_decay("beta1", beta1)
    beta2 = _check_decay("beta2", beta2)
    epsilon = _check_positive("epsilon", epsilon)
    bias_correction = _check_bool("bias_correction", bias_correction)

    def init(params: torch.Tensor) -> AdamState:
        _check_params(params)
        return AdamState(
            step=0, first_moment=torch.zeros_like(params), second_moment=torch.zeros_like(params)
        )

    def update(
        state: AdamState, params: torch.Tensor, pseudo_gradient: torch.Tensor, learning_rate: float
    ) -> tuple[torch.Tensor, AdamState]:
        _check_update_inputs("adam", state, params, pseudo_gradient, learning_rate)
        step = state.step + 1
        first_moment = beta1 * state.first_moment + (1.0 - beta1) * pseudo_gradient
        second_moment = beta2 * state.second_moment + (1.0 - beta2) * pseudo_gradient.square()
        if bias_correction:
            # Python floats (double) for the scalar, whatever the params dtype.
            step_size = learning_rate * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
        else:
            step_size = learning_rate
        new_params = params - step_size * (first_moment / (second_moment.sqrt() + epsilon))
        return new_params, AdamState(step=step, first_moment=first_moment, second_moment=second_moment)

    return ServerOptimizer(name="adam", init=init, update=update)


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
      A :class:`ServerOptimizer` named ``"adagrad"`` with :class:`AdagradState`.

    Raises:
      ValueError: if ε is not > 0, the initial accumulator is negative, or
        β1 is outside [0, 1).
    """
    epsilon = _check_positive("epsilon", epsilon)
    initial_accumulator = _check_non_negative("initial_accumulator", initial_accumulator)
    beta1 = _check_decay("beta1", beta1)

    def init(params: torch.Tensor) -> AdagradState:
        _check_params(params)
        return AdagradState(
            step=0,
            first_moment=torch.zeros_like(params),
            second_moment=torch.full_like(params, initial_accumulator),
        )

    def update(
        state: AdagradState, params: torch.Tensor, pseudo_gradient: torch.Tensor, learning_rate: float
    ) -> tuple[torch.Tensor, AdagradState]:
        _check_update_inputs("adagrad", state, params, pseudo_gradient, learning_rate)
        first_moment = beta1 * state.first_moment + (1.0 - beta1) * pseudo_gradient
        second_moment = state.second_moment + pseudo_gradient.square()
        new_params = params - learning_rate * (first_moment / (second_moment.sqrt() + epsilon))
        return new_params, AdagradState(
            step=state.step + 1, first_moment=first_moment, second_moment=second_moment
        )

    return ServerOptimizer(name="adagrad", init=init, update=update)


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
      A :class:`ServerOptimizer` named ``"yogi"`` with :class:`YogiState`.

    Raises:
      ValueError: if a β is outside [0, 1), ε is not > 0, or the initial
        accumulator is negative.
    """
    beta1 = _check_decay("beta1", beta1)
    beta2 = _check_decay("beta2", beta2)
    epsilon = _check_positive("epsilon", epsilon)
    initial_accumulator = _check_non_negative("initial_accumulator", initial_accumulator)

    def init(params: torch.Tensor) -> YogiState:
        _check_params(params)
        return YogiState(
            step=0,
            first_moment=torch.zeros_like(params),
            second_moment=torch.full_like(params, initial_accumulator),
        )

    def update(
        state: YogiState, params: torch.Tensor, pseudo_gradient: torch.Tensor, learning_rate: float
    ) -> tuple[torch.Tensor, YogiState]:
        _check_update_inputs("yogi", state, params, pseudo_gradient, learning_rate)
        first_moment = beta1 * state.first_moment + (1.0 - beta1) * pseudo_gradient
        squared = pseudo_gradient.square()
        second_moment = state.second_moment - (1.0 - beta2) * squared * torch.sign(
            state.second_moment - squared
        )
        new_params = params - learning_rate * (first_moment / (second_moment.sqrt() + epsilon))
        return new_params, YogiState(
            step=state.step + 1, first_moment=first_moment, second_moment=second_moment
        )

    return ServerOptimizer(name="yogi", init=init, update=update)


_CONSTRUCTORS: dict[str, Callable[..., ServerOptimizer]] = {
    "sgd": sgd,
    "momentum": momentum,
    "adam": adam,
    "adagrad": adagrad,
    "yogi": yogi,
}


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
    if name not in _CONSTRUCTORS:
        raise ValueError(
            f"unknown server optimizer {name!r}; valid names: {', '.join(SERVER_OPTIMIZER_NAMES)}"
        )
    constructor = _CONSTRUCTORS[name]
    accepted = list(inspect.signature(constructor).parameters)
    unknown = sorted(set(hyperparameters) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown hyperparameter(s) {', '.join(unknown)} for server optimizer {name!r}; "
            f"valid: {', '.join(accepted) if accepted else '(none)'}"
        )
    return constructor(**hyperparameters)
