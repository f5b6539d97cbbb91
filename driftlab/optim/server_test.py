"""Tests for driftlab.optim.server.

Two layers: a shared list every server optimizer must pass, then per optimizer
small cases computed by hand with plain Python floats (float64, mirroring the
order of operations, so float64 results agree to the last few ulps).
"""

from __future__ import annotations

import doctest
import math
from dataclasses import fields

import pytest
import safetensors.torch
import torch

from driftlab.optim import server
from driftlab.optim.server import (
    SERVER_OPTIMIZER_NAMES,
    AdagradState,
    AdamState,
    MomentumState,
    SgdState,
    YogiState,
    adagrad,
    adam,
    make_server_optimizer,
    momentum,
    sgd,
    yogi,
)
from driftlab.simulation.state.checkpoint import state_from_tensors, state_to_tensors

# float64 hand computations mirror the implementation's order of operations;
# allow a few ulps so a different but correct SIMD path cannot fail the test.
HAND_RTOL = 1e-15

OPTIMIZER_FACTORIES = {
    "sgd": sgd,
    "momentum": momentum,
    "momentum_nesterov": lambda: momentum(beta=0.8, nesterov=True),
    "adam": adam,
    "adam_no_bias_correction": lambda: adam(bias_correction=False),
    "adagrad": adagrad,
    "adagrad_momentum": lambda: adagrad(beta1=0.9),
    "yogi": yogi,
}
DTYPES = [torch.float32, torch.float64]


def _params_and_pseudo_gradients(dtype: torch.dtype, steps: int = 3):
    generator = torch.Generator().manual_seed(1234)
    params = torch.randn(17, generator=generator, dtype=torch.float64).to(dtype)
    pseudo_gradients = [torch.randn(17, generator=generator, dtype=torch.float64).to(dtype) for _ in range(steps)]
    return params, pseudo_gradients


def _run(optimizer, params, pseudo_gradients, learning_rate=0.1):
    state = optimizer.init(params)
    for pseudo_gradient in pseudo_gradients:
        params, state = optimizer.update(state, params, pseudo_gradient, learning_rate)
    return params, state


def _state_tensor_fields(state):
    return {
        field.name: getattr(state, field.name)
        for field in fields(state)
        if isinstance(getattr(state, field.name), torch.Tensor)
    }


def _assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    # torch.equal is False for NaN, which we never expect here.
    assert torch.equal(actual, expected), (actual, expected)


def _assert_hand(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=HAND_RTOL, atol=0.0)


# ---------------------------------------------------------------------------
# Shared list: every optimizer.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("optimizer_key", OPTIMIZER_FACTORIES)
class TestEveryServerOptimizer:
    def test_init_preserves_shape_dtype_device(self, optimizer_key, dtype):
        optimizer = OPTIMIZER_FACTORIES[optimizer_key]()
        params, _ = _params_and_pseudo_gradients(dtype)
        state = optimizer.init(params)
        assert state.step == 0
        for name, tensor in _state_tensor_fields(state).items():
            assert tensor.shape == params.shape, name
            assert tensor.dtype == dtype, name
            assert tensor.device == params.device, name
            assert tensor.data_ptr() != params.data_ptr(), name

    def test_update_preserves_shape_dtype_device_and_counts_steps(self, optimizer_key, dtype):
        optimizer = OPTIMIZER_FACTORIES[optimizer_key]()
        params, pseudo_gradients = _params_and_pseudo_gradients(dtype)
        new_params, state = _run(optimizer, params, pseudo_gradients)
        assert new_params.shape == (17,)
        assert new_params.dtype == dtype
        assert new_params.device == params.device
        assert state.step == 3
        assert not torch.equal(new_params, params)
        for name, tensor in _state_tensor_fields(state).items():
            assert (tensor.shape, tensor.dtype, tensor.device) == (params.shape, dtype, params.device), name

    def test_update_does_not_mutate_or_alias_inputs(self, optimizer_key, dtype):
        optimizer = OPTIMIZER_FACTORIES[optimizer_key]()
        params, pseudo_gradients = _params_and_pseudo_gradients(dtype)
        # Step twice first so the state holds non-trivial tensors.
        params, state = _run(optimizer, params, pseudo_gradients[:2])
        pseudo_gradient = pseudo_gradients[2]
        params_copy = params.clone()
        pseudo_gradient_copy = pseudo_gradient.clone()
        state_copies = {name: t.clone() for name, t in _state_tensor_fields(state).items()}

        new_params, new_state = optimizer.update(state, params, pseudo_gradient, 0.1)

        _assert_bitwise_equal(params, params_copy)
        _assert_bitwise_equal(pseudo_gradient, pseudo_gradient_copy)
        assert state.step == 2
        for name, tensor in _state_tensor_fields(state).items():
            _assert_bitwise_equal(tensor, state_copies[name])
        inputs = [params.data_ptr(), pseudo_gradient.data_ptr()]
        inputs += [t.data_ptr() for t in state_copies.values()]
        inputs += [t.data_ptr() for t in _state_tensor_fields(state).values()]
        assert new_params.data_ptr() not in inputs
        for name, tensor in _state_tensor_fields(new_state).items():
            assert tensor.data_ptr() not in inputs, name

    def test_deterministic(self, optimizer_key, dtype):
        params, pseudo_gradients = _params_and_pseudo_gradients(dtype)
        first, first_state = _run(OPTIMIZER_FACTORIES[optimizer_key](), params, pseudo_gradients)
        second, second_state = _run(OPTIMIZER_FACTORIES[optimizer_key](), params, pseudo_gradients)
        _assert_bitwise_equal(first, second)
        assert first_state.step == second_state.step == 3
        second_fields = _state_tensor_fields(second_state)
        for name, tensor in _state_tensor_fields(first_state).items():
            _assert_bitwise_equal(tensor, second_fields[name])

    def test_state_round_trips_through_safetensors(self, optimizer_key, dtype):
        optimizer = OPTIMIZER_FACTORIES[optimizer_key]()
        params, pseudo_gradients = _params_and_pseudo_gradients(dtype, steps=4)
        params, state = _run(optimizer, params, pseudo_gradients[:3])

        tensors = state_to_tensors(state, "optimizer")
        assert tensors["optimizer/step"].dtype == torch.int64
        assert tensors["optimizer/step"].dim() == 0
        assert int(tensors["optimizer/step"]) == 3
        blob = safetensors.torch.save(tensors)
        restored = state_from_tensors(optimizer.init(params), safetensors.torch.load(blob), "optimizer", params.device)

        assert type(restored) is type(state)
        assert restored.step == state.step == 3
        restored_fields = _state_tensor_fields(restored)
        assert set(restored_fields) == set(_state_tensor_fields(state))
        for name, tensor in _state_tensor_fields(state).items():
            _assert_bitwise_equal(restored_fields[name], tensor)

        # Resuming from the checkpoint continues bit for bit.
        continued, continued_state = optimizer.update(state, params, pseudo_gradients[3], 0.1)
        resumed, resumed_state = optimizer.update(restored, params, pseudo_gradients[3], 0.1)
        _assert_bitwise_equal(resumed, continued)
        assert resumed_state.step == continued_state.step == 4

    def test_zero_pseudo_gradient_from_init_leaves_params_unchanged(self, optimizer_key, dtype):
        optimizer = OPTIMIZER_FACTORIES[optimizer_key]()
        params, _ = _params_and_pseudo_gradients(dtype)
        state = optimizer.init(params)
        new_params, new_state = optimizer.update(state, params, torch.zeros_like(params), 0.7)
        _assert_bitwise_equal(new_params, params)
        assert new_state.step == 1

    def test_converges_on_a_quadratic(self, optimizer_key, dtype):
        # f(θ) = ½ Σ a_i (θ_i − c_i)², pseudo-gradient = ∇f(θ): ill-conditioned
        # on purpose so the adaptive methods are exercised.
        optimizer = OPTIMIZER_FACTORIES[optimizer_key]()
        curvature = torch.tensor([0.5, 1.0, 2.0, 0.25], dtype=dtype)
        target = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=dtype)
        params = torch.zeros(4, dtype=dtype)
        # Adagrad's effective rate shrinks as v accumulates, so it gets a larger η.
        learning_rate = 0.5 if optimizer_key.startswith(("sgd", "adagrad")) else 0.05
        state = optimizer.init(params)
        initial_distance = float(torch.linalg.vector_norm(params - target))
        for _ in range(400):
            params, state = optimizer.update(state, params, curvature * (params - target), learning_rate)
        final_distance = float(torch.linalg.vector_norm(params - target))
        assert final_distance < 0.05 * initial_distance

    def test_rejects_mismatched_inputs(self, optimizer_key, dtype):
        optimizer = OPTIMIZER_FACTORIES[optimizer_key]()
        params, _ = _params_and_pseudo_gradients(dtype)
        state = optimizer.init(params)
        with pytest.raises(ValueError, match="pseudo_gradient"):
            optimizer.update(state, params, torch.zeros(16, dtype=dtype), 0.1)
        other_dtype = torch.float64 if dtype == torch.float32 else torch.float32
        with pytest.raises(ValueError, match="pseudo_gradient"):
            optimizer.update(state, params, torch.zeros(17, dtype=other_dtype), 0.1)
        with pytest.raises(ValueError, match="params"):
            optimizer.init(params.reshape(1, 17))
        with pytest.raises(ValueError, match="learning_rate"):
            optimizer.update(state, params, torch.zeros_like(params), -0.1)
        with pytest.raises(ValueError, match="learning_rate"):
            optimizer.update(state, params, torch.zeros_like(params), math.nan)
        with pytest.raises(TypeError, match="expects"):
            optimizer.update(object(), params, torch.zeros_like(params), 0.1)


# ---------------------------------------------------------------------------
# Registry and checkpoint helpers.
# ---------------------------------------------------------------------------


def test_registry_names_and_state_types():
    assert SERVER_OPTIMIZER_NAMES == ("sgd", "momentum", "adam", "adagrad", "yogi")
    params = torch.zeros(3)
    expected_types = [SgdState, MomentumState, AdamState, AdagradState, YogiState]
    for name, state_type in zip(SERVER_OPTIMIZER_NAMES, expected_types, strict=True):
        optimizer = make_server_optimizer(name)
        assert optimizer.name == name
        assert type(optimizer.init(params)) is state_type


def test_make_server_optimizer_passes_hyperparameters():
    q = torch.tensor([0.5, -2.0], dtype=torch.float64)
    params = torch.tensor([1.0, -1.0], dtype=torch.float64)
    built = make_server_optimizer("adam", beta1=0.5, beta2=0.75, epsilon=0.25, bias_correction=False)
    direct = adam(beta1=0.5, beta2=0.75, epsilon=0.25, bias_correction=False)
    built_params, _ = built.update(built.init(params), params, q, 0.1)
    direct_params, _ = direct.update(direct.init(params), params, q, 0.1)
    _assert_bitwise_equal(built_params, direct_params)
    # m = 0.5 q, v = 0.25 q², θ − 0.1 m/(√v + 0.25): q = 0.5 → 0.25/(0.25+0.25)
    _assert_hand(built_params, [1.0 - 0.1 * (0.25 / (0.25 + 0.25)), -1.0 - 0.1 * (-1.0 / (1.0 + 0.25))])


def test_make_server_optimizer_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as error:
        make_server_optimizer("adamw")
    message = str(error.value)
    assert "adamw" in message
    for name in SERVER_OPTIMIZER_NAMES:
        assert name in message


def test_make_server_optimizer_unknown_hyperparameter():
    with pytest.raises(ValueError, match=r"beta.*valid: beta1, beta2, epsilon, bias_correction"):
        make_server_optimizer("adam", beta=0.9)
    with pytest.raises(ValueError, match="learning_rate"):
        make_server_optimizer("sgd", learning_rate=1.0)


def test_states_are_frozen():
    state = adam().init(torch.zeros(2))
    with pytest.raises(AttributeError):
        state.step = 5  # type: ignore[misc]


def test_module_docstring_example_runs():
    result = doctest.testmod(server, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 10
    assert result.failed == 0


# ---------------------------------------------------------------------------
# sgd.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_sgd_unit_rate_returns_the_average_bit_for_bit(dtype):
    # Few significant bits: params − average is exact, so params − q is too.
    params = torch.tensor([1.5, -2.25, 8.0, 0.0, 3.0], dtype=dtype)
    average = torch.tensor([0.75, 3.125, -1.0, 0.0625, 3.0], dtype=dtype)
    pseudo_gradient = params - average
    optimizer = sgd()
    new_params, state = optimizer.update(optimizer.init(params), params, pseudo_gradient, 1.0)
    _assert_bitwise_equal(new_params, average)
    assert state.step == 1


def test_sgd_unit_rate_is_one_rounding_not_always_the_average():
    # Documents the limit of "FedAvg == FedSGD(η=1)": when params − average
    # rounds, params − q is within one rounding of the average, not equal.
    params = torch.tensor([1.0], dtype=torch.float32)
    average = torch.tensor([1e-20], dtype=torch.float32)
    pseudo_gradient = params - average  # rounds to exactly 1.0 in float32
    assert float(pseudo_gradient) == 1.0
    optimizer = sgd()
    new_params, _ = optimizer.update(optimizer.init(params), params, pseudo_gradient, 1.0)
    assert float(new_params) == 0.0
    assert float(average) != 0.0


def test_sgd_by_hand():
    params = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    optimizer = sgd()
    state = optimizer.init(params)
    params, state = optimizer.update(state, params, torch.tensor([0.5, -1.0, 4.0], dtype=torch.float64), 0.25)
    _assert_bitwise_equal(params, torch.tensor([0.875, -1.75, -0.5], dtype=torch.float64))
    params, state = optimizer.update(state, params, torch.tensor([0.3, 0.0, -0.1], dtype=torch.float64), 0.1)
    _assert_hand(params, [0.875 - 0.1 * 0.3, -1.75, -0.5 - 0.1 * -0.1])
    assert state.step == 2


# ---------------------------------------------------------------------------
# momentum.
# ---------------------------------------------------------------------------


def test_momentum_two_steps_by_hand():
    beta, eta = 0.9, 0.5
    q1, q2 = [1.0, -2.0], [0.5, 0.5]
    optimizer = momentum(beta=beta)
    params = torch.tensor([0.0, 1.0], dtype=torch.float64)
    state = optimizer.init(params)

    params, state = optimizer.update(state, params, torch.tensor(q1, dtype=torch.float64), eta)
    # v1 = q1; θ1 = θ0 − η v1
    _assert_hand(state.velocity, [1.0, -2.0])
    _assert_hand(params, [0.0 - 0.5 * 1.0, 1.0 - 0.5 * -2.0])  # [-0.5, 2.0]

    params, state = optimizer.update(state, params, torch.tensor(q2, dtype=torch.float64), eta)
    v2 = [beta * 1.0 + 0.5, beta * -2.0 + 0.5]  # [1.4, -1.3]
    _assert_hand(state.velocity, v2)
    _assert_hand(params, [-0.5 - eta * v2[0], 2.0 - eta * v2[1]])  # [-1.2, 2.65]
    assert params.tolist() == pytest.approx([-1.2, 2.65], abs=1e-15)
    assert state.step == 2


def test_momentum_nesterov_two_steps_by_hand():
    beta, eta = 0.9, 0.5
    optimizer = momentum(beta=beta, nesterov=True)
    params = torch.tensor([0.0, 1.0], dtype=torch.float64)
    state = optimizer.init(params)

    params, state = optimizer.update(state, params, torch.tensor([1.0, -2.0], dtype=torch.float64), eta)
    # v1 = q1; θ1 = θ0 − η (q1 + β v1) = θ0 − η (1+β) q1
    d1 = [1.0 + beta * 1.0, -2.0 + beta * -2.0]
    p1 = [0.0 - eta * d1[0], 1.0 - eta * d1[1]]  # [-0.95, 2.9]
    _assert_hand(params, p1)

    params, state = optimizer.update(state, params, torch.tensor([0.5, 0.5], dtype=torch.float64), eta)
    v2 = [beta * 1.0 + 0.5, beta * -2.0 + 0.5]
    d2 = [0.5 + beta * v2[0], 0.5 + beta * v2[1]]  # [1.76, -0.67]
    _assert_hand(state.velocity, v2)
    _assert_hand(params, [p1[0] - eta * d2[0], p1[1] - eta * d2[1]])  # [-1.83, 3.235]
    assert params.tolist() == pytest.approx([-1.83, 3.235], abs=1e-15)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_matches_torch_sgd(nesterov):
    # torch.optim.SGD(momentum=β, dampening=0) keeps the same buffer v.
    params, pseudo_gradients = _params_and_pseudo_gradients(torch.float64, steps=5)
    ours, _ = _run(momentum(beta=0.7, nesterov=nesterov), params, pseudo_gradients, learning_rate=0.3)
    reference = params.clone().requires_grad_(True)
    torch_optimizer = torch.optim.SGD([reference], lr=0.3, momentum=0.7, nesterov=nesterov)
    for pseudo_gradient in pseudo_gradients:
        reference.grad = pseudo_gradient.clone()
        torch_optimizer.step()
    torch.testing.assert_close(ours, reference.detach(), rtol=1e-13, atol=1e-13)


def test_momentum_with_zero_beta_is_sgd_bit_for_bit():
    params, pseudo_gradients = _params_and_pseudo_gradients(torch.float32, steps=4)
    with_momentum, _ = _run(momentum(beta=0.0), params, pseudo_gradients, learning_rate=0.3)
    plain, _ = _run(sgd(), params, pseudo_gradients, learning_rate=0.3)
    _assert_bitwise_equal(with_momentum, plain)


# ---------------------------------------------------------------------------
# adam.
# ---------------------------------------------------------------------------

ADAM_Q1 = [0.5, -2.0]
ADAM_Q2 = [-1.0, 0.25]
ADAM_PARAMS = [1.0, -1.0]


def _adam_by_hand(bias_correction, beta1=0.9, beta2=0.999, epsilon=1e-8, eta=0.1):
    """Two Adam steps in plain Python floats, same operation order as the code."""
    params, m, v = list(ADAM_PARAMS), [0.0, 0.0], [0.0, 0.0]
    history = []
    for t, q in enumerate([ADAM_Q1, ADAM_Q2], start=1):
        m = [beta1 * m_i + (1.0 - beta1) * q_i for m_i, q_i in zip(m, q, strict=True)]
        v = [beta2 * v_i + (1.0 - beta2) * (q_i * q_i) for v_i, q_i in zip(v, q, strict=True)]
        step_size = eta * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t) if bias_correction else eta
        params = [p - step_size * (m_i / (math.sqrt(v_i) + epsilon)) for p, m_i, v_i in zip(params, m, v, strict=True)]
        history.append((list(params), list(m), list(v)))
    return history


@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_two_steps_by_hand(bias_correction):
    expected = _adam_by_hand(bias_correction)
    optimizer = adam(bias_correction=bias_correction)
    params = torch.tensor(ADAM_PARAMS, dtype=torch.float64)
    state = optimizer.init(params)
    for (expected_params, expected_m, expected_v), q in zip(expected, [ADAM_Q1, ADAM_Q2], strict=True):
        params, state = optimizer.update(state, params, torch.tensor(q, dtype=torch.float64), 0.1)
        _assert_hand(state.first_moment, expected_m)
        _assert_hand(state.second_moment, expected_v)
        _assert_hand(params, expected_params)
    assert state.step == 2


def test_adam_first_step_closed_form():
    # With bias correction, step 1 is θ − η q / (|q| + ε/√(1−β2)): a signed step
    # of almost exactly η per coordinate.
    optimizer = adam()
    params = torch.tensor(ADAM_PARAMS, dtype=torch.float64)
    new_params, state = optimizer.update(
        optimizer.init(params), params, torch.tensor(ADAM_Q1, dtype=torch.float64), 0.1
    )
    scaled_epsilon = 1e-8 / math.sqrt(1.0 - 0.999)
    closed_form = [p - 0.1 * q / (abs(q) + scaled_epsilon) for p, q in zip(ADAM_PARAMS, ADAM_Q1, strict=True)]
    torch.testing.assert_close(new_params, torch.tensor(closed_form, dtype=torch.float64), rtol=1e-14, atol=0.0)
    assert new_params.tolist() == pytest.approx([0.9, -0.9], abs=1e-6)
    # m1 = 0.1 q, v1 = 0.001 q²
    _assert_hand(state.first_moment, [0.1 * 0.5, 0.1 * -2.0])
    _assert_hand(state.second_moment, [(1.0 - 0.999) * 0.25, (1.0 - 0.999) * 4.0])

    # Without bias correction the same step is √(1−β2)/(1−β1) ≈ 0.316 times larger.
    uncorrected = adam(bias_correction=False)
    new_params, _ = uncorrected.update(
        uncorrected.init(params), params, torch.tensor(ADAM_Q1, dtype=torch.float64), 0.1
    )
    ratio = (1.0 - 0.9) / math.sqrt(1.0 - 0.999)
    assert new_params.tolist() == pytest.approx([1.0 - 0.1 * ratio, -1.0 + 0.1 * ratio], abs=1e-6)


def test_adam_epsilon_is_outside_the_root():
    # Large ε separates m/(√v + ε) from m/√(v + ε): q = 1, β1 = β2 = 0, ε = 3.
    optimizer = adam(beta1=0.0, beta2=0.0, epsilon=3.0)
    params = torch.zeros(1, dtype=torch.float64)
    new_params, _ = optimizer.update(optimizer.init(params), params, torch.ones(1, dtype=torch.float64), 1.0)
    assert new_params.item() == -0.25  # −1/(1 + 3), not −1/√4 = −0.5


# ---------------------------------------------------------------------------
# adagrad and yogi.
# ---------------------------------------------------------------------------


def test_adagrad_one_step_by_hand():
    tau, eta = 1e-3, 0.1
    q = [0.5, -2.0, 0.0]
    optimizer = adagrad(epsilon=tau)
    params = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    new_params, state = optimizer.update(optimizer.init(params), params, torch.tensor(q, dtype=torch.float64), eta)
    # β1 = 0: m = q; v = 0 + q²; θ − η q/(|q| + τ)
    _assert_hand(state.first_moment, q)
    _assert_hand(state.second_moment, [0.25, 4.0, 0.0])
    _assert_hand(new_params, [1.0 - eta * (0.5 / (0.5 + tau)), -1.0 - eta * (-2.0 / (2.0 + tau)), 2.0])


def test_adagrad_with_initial_accumulator_and_momentum_two_steps_by_hand():
    tau, eta, beta1, v0 = 0.01, 0.5, 0.9, 0.75
    optimizer = adagrad(epsilon=tau, initial_accumulator=v0, beta1=beta1)
    params = torch.tensor([0.0, 0.0], dtype=torch.float64)
    state = optimizer.init(params)
    _assert_hand(state.second_moment, [v0, v0])
    p, m, v = [0.0, 0.0], [0.0, 0.0], [v0, v0]
    for q in ([0.5, -1.0], [1.5, 0.25]):
        params, state = optimizer.update(state, params, torch.tensor(q, dtype=torch.float64), eta)
        m = [beta1 * m_i + (1.0 - beta1) * q_i for m_i, q_i in zip(m, q, strict=True)]
        v = [v_i + q_i * q_i for v_i, q_i in zip(v, q, strict=True)]
        p = [p_i - eta * (m_i / (math.sqrt(v_i) + tau)) for p_i, m_i, v_i in zip(p, m, v, strict=True)]
        _assert_hand(state.first_moment, m)
        _assert_hand(state.second_moment, v)
        _assert_hand(params, p)
    # Step 1 with these numbers: v = [1.0, 1.75], m = [0.05, -0.1]
    assert state.step == 2


def test_yogi_one_step_by_hand_default_accumulator():
    beta1, beta2, tau, eta, v0 = 0.9, 0.99, 1e-3, 0.1, 1e-6
    q = [0.5, -2.0]
    optimizer = yogi()
    params = torch.tensor([1.0, -1.0], dtype=torch.float64)
    new_params, state = optimizer.update(optimizer.init(params), params, torch.tensor(q, dtype=torch.float64), eta)
    # v0 < q² so sign(v0 − q²) = −1 and v grows: v = v0 + (1−β2) q²
    m = [(1.0 - beta1) * q_i for q_i in q]
    v = [v0 - (1.0 - beta2) * (q_i * q_i) * -1.0 for q_i in q]
    _assert_hand(state.first_moment, m)
    _assert_hand(state.second_moment, v)
    _assert_hand(
        new_params, [p - eta * (m_i / (math.sqrt(v_i) + tau)) for p, m_i, v_i in zip([1.0, -1.0], m, v, strict=True)]
    )


def test_yogi_one_step_by_hand_both_signs():
    beta1, beta2, tau, eta, v0 = 0.5, 0.75, 0.25, 1.0, 1.0
    optimizer = yogi(beta1=beta1, beta2=beta2, epsilon=tau, initial_accumulator=v0)
    params = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.5, -2.0, 0.0], dtype=torch.float64)
    new_params, state = optimizer.update(optimizer.init(params), params, q, eta)
    # q² = [0.25, 4, 0]; v0 − q² = [0.75, −3, 1] → signs [+1, −1, +1]
    # v = [1 − 0.25·0.25, 1 + 0.25·4, 1 − 0] = [0.9375, 2.0, 1.0]
    # m = [0.25, −1.0, 0.0]; θ = −m/(√v + 0.25)
    _assert_bitwise_equal(state.second_moment, torch.tensor([0.9375, 2.0, 1.0], dtype=torch.float64))
    _assert_bitwise_equal(state.first_moment, torch.tensor([0.25, -1.0, 0.0], dtype=torch.float64))
    _assert_hand(new_params, [-(0.25 / (math.sqrt(0.9375) + 0.25)), -(-1.0 / (math.sqrt(2.0) + 0.25)), 0.0])


# ---------------------------------------------------------------------------
# Hyperparameter validation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, hyperparameters, parameter_name",
    [
        (momentum, {"beta": 1.0}, "beta"),
        (momentum, {"beta": -0.1}, "beta"),
        (momentum, {"beta": math.nan}, "beta"),
        (adam, {"beta1": 1.0}, "beta1"),
        (adam, {"beta1": -0.5}, "beta1"),
        (adam, {"beta2": 1.5}, "beta2"),
        (adam, {"epsilon": 0.0}, "epsilon"),
        (adam, {"epsilon": -1e-8}, "epsilon"),
        (adam, {"epsilon": math.inf}, "epsilon"),
        (adagrad, {"epsilon": 0.0}, "epsilon"),
        (adagrad, {"initial_accumulator": -1.0}, "initial_accumulator"),
        (adagrad, {"beta1": 1.0}, "beta1"),
        (yogi, {"beta1": 1.0}, "beta1"),
        (yogi, {"beta2": -0.01}, "beta2"),
        (yogi, {"epsilon": -1e-3}, "epsilon"),
        (yogi, {"initial_accumulator": -1e-6}, "initial_accumulator"),
    ],
)
def test_bad_hyperparameters_raise_value_error_naming_the_parameter(factory, hyperparameters, parameter_name):
    with pytest.raises(ValueError) as error:
        factory(**hyperparameters)
    message = str(error.value)
    assert message.startswith(parameter_name + " must")
    assert "[0, 1)" in message or "> 0" in message or ">= 0" in message


def test_bad_hyperparameters_through_registry():
    with pytest.raises(ValueError, match=r"^beta2 must be in \[0, 1\)"):
        make_server_optimizer("yogi", beta2=1.0)


@pytest.mark.parametrize(
    "factory, hyperparameters, parameter_name",
    [
        (momentum, {"nesterov": 1}, "nesterov"),
        (adam, {"bias_correction": "yes"}, "bias_correction"),
        (adam, {"beta1": "0.9"}, "beta1"),
        (yogi, {"epsilon": True}, "epsilon"),
    ],
)
def test_wrong_hyperparameter_types_raise_type_error(factory, hyperparameters, parameter_name):
    with pytest.raises(TypeError, match=f"^{parameter_name} must"):
        factory(**hyperparameters)


def test_boundary_hyperparameters_are_accepted():
    params = torch.tensor([1.0, 2.0], dtype=torch.float64)
    q = torch.tensor([0.5, -0.5], dtype=torch.float64)
    for optimizer in [
        momentum(beta=0.0),
        adam(beta1=0.0, beta2=0.0),
        yogi(beta1=0.0, beta2=0.0),
        adagrad(initial_accumulator=0.0),
    ]:
        new_params, _ = optimizer.update(optimizer.init(params), params, q, 0.1)
        assert torch.isfinite(new_params).all()
        assert not torch.equal(new_params, params)


# ---------------------------------------------------------------------------
# Update transformations and chains.
# ---------------------------------------------------------------------------

CHAINS_OF_NAMED = {
    "sgd": (lambda: sgd(), lambda: server.chain(server.scale_by_learning_rate())),
    "momentum": (
        lambda: momentum(beta=0.8),
        lambda: server.chain(server.scale_by_momentum(0.8), server.scale_by_learning_rate()),
    ),
    "momentum_nesterov": (
        lambda: momentum(beta=0.8, nesterov=True),
        lambda: server.chain(server.scale_by_momentum(0.8, nesterov=True), server.scale_by_learning_rate()),
    ),
    "adam": (
        lambda: adam(),
        lambda: server.chain(
            server.scale_by_second_moment(server.exponential_average(0.999), beta1=0.9, epsilon=1e-8),
            server.scale_by_learning_rate(server.adam_bias_correction(0.9, 0.999)),
        ),
    ),
    "adam_no_bias_correction": (
        lambda: adam(bias_correction=False),
        lambda: server.chain(
            server.scale_by_second_moment(server.exponential_average(0.999), beta1=0.9, epsilon=1e-8),
            server.scale_by_learning_rate(),
        ),
    ),
    "adagrad": (
        lambda: adagrad(initial_accumulator=0.1, beta1=0.5),
        lambda: server.chain(
            server.scale_by_second_moment(server.running_sum, beta1=0.5, epsilon=1e-3, initial_accumulator=0.1),
            server.scale_by_learning_rate(),
        ),
    ),
    "yogi": (
        lambda: yogi(),
        lambda: server.chain(
            server.scale_by_second_moment(server.yogi_step(0.99), beta1=0.9, epsilon=1e-3, initial_accumulator=1e-6),
            server.scale_by_learning_rate(),
        ),
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key", CHAINS_OF_NAMED)
def test_a_chain_equals_the_named_optimizer_bit_for_bit(key, dtype):
    make_named, make_chain = CHAINS_OF_NAMED[key]
    params, pseudo_gradients = _params_and_pseudo_gradients(dtype, steps=4)
    named_params, named_state = _run(make_named(), params, pseudo_gradients, learning_rate=0.3)
    chain_params, chain_state = _run(make_chain(), params, pseudo_gradients, learning_rate=0.3)
    _assert_bitwise_equal(chain_params, named_params)
    assert chain_state.step == named_state.step == 4
    # same checkpoint keys, same tensors: a checkpoint of one resumes the other
    named_tensors, chain_tensors = state_to_tensors(named_state, "o"), state_to_tensors(chain_state, "o")
    assert set(named_tensors) == set(chain_tensors)
    for name, tensor in named_tensors.items():
        _assert_bitwise_equal(chain_tensors[name], tensor)


def test_named_optimizers_keep_the_checkpoint_keys_of_their_states():
    """Checkpoints written before the optimizers became chains name these entries; they must still load."""
    expected = {
        "sgd": {"o/step"},
        "momentum": {"o/step", "o/velocity"},
        "adam": {"o/step", "o/first_moment", "o/second_moment"},
        "adagrad": {"o/step", "o/first_moment", "o/second_moment"},
        "yogi": {"o/step", "o/first_moment", "o/second_moment"},
    }
    params = torch.zeros(3)
    for name, keys in expected.items():
        assert set(state_to_tensors(make_server_optimizer(name).init(params), "o")) == keys, name


def _one_stage_step(transformation, update, learning_rate=0.5, state=None, step=1):
    if state is None:
        state = transformation.init(update)
    return transformation.update(update, state, step, learning_rate)


def test_scale_by_learning_rate_by_hand():
    direction, state = _one_stage_step(server.scale_by_learning_rate(), torch.tensor([2.0, -4.0], dtype=torch.float64))
    _assert_hand(direction, [1.0, -2.0])
    assert state == {}
    # η_t = η √(1 − 0.75²)/(1 − 0.5²) at t = 2: 0.5 · √0.4375 / 0.75
    corrected = server.scale_by_learning_rate(server.adam_bias_correction(0.5, 0.75))
    direction, _ = _one_stage_step(corrected, torch.tensor([3.0], dtype=torch.float64), step=2)
    _assert_hand(direction, [3.0 * (0.5 * math.sqrt(0.4375) / 0.75)])


def test_scale_by_momentum_by_hand():
    velocity = {"velocity": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    update = torch.tensor([2.0, 0.5], dtype=torch.float64)
    direction, state = _one_stage_step(server.scale_by_momentum(0.5), update, state=velocity)
    _assert_hand(state["velocity"], [2.5, 0.0])  # 0.5·v + u
    _assert_hand(direction, [2.5, 0.0])
    direction, state = _one_stage_step(server.scale_by_momentum(0.5, nesterov=True), update, state=velocity)
    _assert_hand(direction, [2.0 + 0.5 * 2.5, 0.5 + 0.0])  # u + β·v_new


@pytest.mark.parametrize(
    "rule, expected_second_moment",
    [
        (server.exponential_average(0.75), [0.75 * 1.0 + 0.25 * 4.0, 0.75 * 4.0 + 0.25 * 1.0]),
        (server.running_sum, [1.0 + 4.0, 4.0 + 1.0]),
        (server.yogi_step(0.75), [1.0 - 0.25 * 4.0 * -1.0, 4.0 - 0.25 * 1.0 * 1.0]),  # sign(v − u²): −1, +1
    ],
)
def test_scale_by_second_moment_by_hand(rule, expected_second_moment):
    stage = server.scale_by_second_moment(rule, beta1=0.5, epsilon=0.5)
    state = {
        "first_moment": torch.tensor([1.0, 1.0], dtype=torch.float64),
        "second_moment": torch.tensor([1.0, 4.0], dtype=torch.float64),
    }
    direction, new_state = _one_stage_step(stage, torch.tensor([2.0, -1.0], dtype=torch.float64), state=state)
    _assert_hand(new_state["first_moment"], [1.5, 0.0])  # 0.5·m + 0.5·u
    _assert_hand(new_state["second_moment"], expected_second_moment)
    _assert_hand(direction, [1.5 / (math.sqrt(expected_second_moment[0]) + 0.5), 0.0])


def test_a_new_chain_has_its_own_state_that_checkpoints_and_resumes():
    nesterov_adam = server.chain(
        server.scale_by_momentum(0.5, nesterov=True),
        server.scale_by_second_moment(server.exponential_average(0.9), beta1=0.0, epsilon=1e-3),
        server.scale_by_learning_rate(),
    )
    params, pseudo_gradients = _params_and_pseudo_gradients(torch.float64, steps=3)
    params, state = _run(nesterov_adam, params, pseudo_gradients[:2])
    tensors = state_to_tensors(state, "o")
    assert set(tensors) == {"o/step", "o/velocity", "o/first_moment", "o/second_moment"}
    restored = state_from_tensors(nesterov_adam.init(params), tensors, "o", params.device)
    continued, _ = nesterov_adam.update(state, params, pseudo_gradients[2], 0.1)
    resumed, _ = nesterov_adam.update(restored, params, pseudo_gradients[2], 0.1)
    _assert_bitwise_equal(resumed, continued)
    assert not nesterov_adam.plain_step


def test_chain_refuses_stages_that_share_a_state_field():
    with pytest.raises(ValueError, match="distinct state field names"):
        server.chain(server.scale_by_momentum(0.5), server.scale_by_momentum(0.9), server.scale_by_learning_rate())
    with pytest.raises(TypeError, match="UpdateTransformation"):
        server.chain()


def test_only_the_plain_rate_chain_is_a_plain_step():
    assert sgd().plain_step and server.chain(server.scale_by_learning_rate()).plain_step
    assert not any(make_server_optimizer(name).plain_step for name in SERVER_OPTIMIZER_NAMES if name != "sgd")
    assert not server.chain(server.scale_by_learning_rate(server.adam_bias_correction(0.9, 0.999))).plain_step


def test_clip_by_global_norm_by_hand():
    clip = server.clip_by_global_norm(1.0)
    long = torch.tensor([3.0, 4.0], dtype=torch.float64)  # norm 5
    direction, state = clip.update(long, {}, 1, 0.1)
    _assert_hand(direction, [0.6, 0.8])
    assert state == {} and clip.init(long) == {}
    short = torch.tensor([0.6, 0.0], dtype=torch.float64)
    assert clip.update(short, {}, 1, 0.1)[0] is short  # within the norm: passed on untouched, no rounding
    with pytest.raises(ValueError, match="max_norm must be finite and > 0"):
        server.clip_by_global_norm(0.0)


def test_a_clipped_chain_steps_at_most_lr_times_the_norm():
    clipped = server.chain(server.clip_by_global_norm(2.0), server.scale_by_learning_rate())
    params = torch.zeros(4, dtype=torch.float64)
    new_params, state = clipped.update(clipped.init(params), params, torch.full((4,), 10.0, dtype=torch.float64), 0.5)
    _assert_hand(new_params, [-0.5] * 4)  # q = (10, 10, 10, 10) cut to norm 2 = (1, 1, 1, 1), times η = 0.5
    assert state.step == 1 and [field.name for field in fields(state)] == ["step"]


def test_a_plain_rate_chain_at_rate_one_returns_the_average_itself():
    from driftlab.optim.apply import apply_server_optimizer

    params = torch.tensor([1.0], dtype=torch.float32)
    average = torch.tensor([1e-20], dtype=torch.float32)  # params − (params − average) rounds to 0, not 1e-20
    for optimizer in (sgd(), server.chain(server.scale_by_learning_rate())):
        new_params, state = apply_server_optimizer(optimizer, optimizer.init(params), params, average, 1.0)
        assert new_params is average and state.step == 1
    momentum_params, _ = apply_server_optimizer(
        momentum(beta=0.0), momentum(beta=0.0).init(params), params, average, 1.0
    )
    assert momentum_params is not average


def test_a_schedule_attached_to_the_chain_sets_the_rate_by_update_count():
    from driftlab.optim.schedules import ExponentialSchedule

    decaying = server.chain(server.scale_by_learning_rate(schedule=ExponentialSchedule(initial=0.5, decay=0.5)))
    assert not decaying.plain_step
    params = torch.tensor([1.0], dtype=torch.float64)
    state = decaying.init(params)
    q = torch.tensor([1.0], dtype=torch.float64)
    params, state = decaying.update(state, params, q, 1.0)  # t = 1: η = 0.5 (the passed 1.0 is not used)
    _assert_hand(params, [0.5])
    params, state = decaying.update(state, params, q, 1.0)  # t = 2: η = 0.25
    _assert_hand(params, [0.25])
    # with Adam's correction the scheduled rate is what gets corrected: t = 3, η = 0.125
    corrected = server.scale_by_learning_rate(server.adam_bias_correction(0.5, 0.75), schedule=lambda t: 0.125)
    direction, _ = corrected.update(torch.tensor([1.0], dtype=torch.float64), {}, 3, 1.0)
    _assert_hand(direction, [0.125 * math.sqrt(1 - 0.75**3) / (1 - 0.5**3)])
