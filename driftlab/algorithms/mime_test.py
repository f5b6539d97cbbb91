"""MimeLite: a two-round hand case, the statistic's input, β = 0 is FedAvg, K = 1 is heavy-ball GD, the fixed point on
quadratics, partial work, privacy and bad input.  Mime: its hand case (with its loss term evaluated), round 1 is
MimeLite, K = 1 is heavy ball on a delayed gradient, convergence to the minimiser, one engine step, both backends."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import driftlab
from driftlab.algorithms import fedavg, mime
from driftlab.algorithms.shared_test import Quadratics, heterogeneous_quadratics, run_quadratic
from driftlab.algorithms.testing import TINY
from driftlab.compress import with_compression
from driftlab.models import build_model
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import (
    BoundModule,
    ClientTask,
    LocalSettings,
    TrainingData,
    corrected_step,
    train_one_client,
)
from driftlab.simulation.backends.objectives import as_local_objective, objective_loss
from driftlab.simulation.round.client import ClientData, ClientDataComputation
from driftlab.simulation.seam import ClientContext, ClientUpdate, GradientCorrection, RoundContext

SGD = make_server_optimizer("sgd")


def vector(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@dataclass(frozen=True)
class QuadraticGradient:
    """A ``ClientComputation`` with the full-batch gradient of ``f(θ) = ½ θᵀ diag(a) θ − bᵀ θ``."""

    curvature: torch.Tensor
    target: torch.Tensor

    def full_gradient(self, params: torch.Tensor) -> torch.Tensor:
        return self.curvature * params - self.target


def objective_gradient(objective, theta: torch.Tensor, curvature: torch.Tensor, target: torch.Tensor):
    """``(correction, ∇[f_k + term](θ))`` of a client objective on the quadratic client (a, b)."""
    local = as_local_objective(objective)
    if local.loss_term is None:
        return local.correction, curvature * theta - target
    loss = objective_loss(quadratic_outputs, quadratic_example_loss, local.loss_term.function)
    inputs, targets, weights = (
        torch.zeros(1, 1, dtype=theta.dtype),
        torch.cat((curvature, target))[None],
        torch.ones(1, dtype=theta.dtype),
    )
    return local.correction, torch.func.grad(loss)(theta, inputs, targets, weights, *local.loss_term.tensors)


def run_with_gradients(
    algorithm,
    problem: Quadratics,
    initial: torch.Tensor,
    rounds: int,
    steps: int,
    learning_rate: float,
    num_samples=None,
):
    """``shared_test.run_quadratic`` with each client's full-batch gradient available to ``client_finish``, the client
    objective's loss term evaluated (``objective_gradient``), and the round's first phase (``Algorithm.prelude``, Mime's)
    run as the engine runs it."""
    sizes = list(num_samples) if num_samples is not None else [10] * problem.num_clients
    settings = LocalSettings(learning_rate)
    server, history = algorithm.server_init(initial), []
    for t in range(1, rounds + 1):
        if algorithm.prelude is not None:
            first, total, weights = algorithm.broadcast(server), 0.0, 0.0
            for client in range(problem.num_clients):
                context = ClientContext(
                    client, t, sizes[client], sum(sizes) / len(sizes), problem.num_clients, steps, learning_rate
                )
                computation = QuadraticGradient(problem.curvatures[client], problem.targets[client])
                total = total + algorithm.prelude.weight(context) * algorithm.prelude.compute(
                    first, context, computation
                )
                weights += algorithm.prelude.weight(context)
            server = algorithm.prelude.apply(server, total / weights)
        view = algorithm.broadcast(server)
        messages = []
        for client in range(problem.num_clients):
            context = ClientContext(
                client, t, sizes[client], sum(sizes) / len(sizes), problem.num_clients, steps, learning_rate
            )
            objective = algorithm.client_objective(view, None, context)
            theta = view.params
            for _ in range(steps):
                correction, gradient = objective_gradient(
                    objective, theta, problem.curvatures[client], problem.targets[client]
                )
                theta = corrected_step(theta, gradient, correction, settings)
            computation = QuadraticGradient(problem.curvatures[client], problem.targets[client])
            messages.append(
                algorithm.client_finish(view, None, context, ClientUpdate(view.params, theta, steps, computation))[1]
            )
        server, metrics = algorithm.server_update(
            server, messages, RoundContext(t, problem.num_clients, problem.num_clients, 1.0)
        )
        history.append(metrics)
    return server, history


# ---------------------------------------------------------------- the shared two-client case, by hand
#
# f_k(θ) = ½‖θ − b_k‖², b_0 = (2, 0), b_1 = (0, 4), θ^0 = 0, K = 2 steps of η = 0.5, β = 0.5, uniform weights.
# Round 1 (m = 0, plain GD): client 0: (1, 0), (1.5, 0); client 1: (0, 2), (0, 3).  x^1 = (0.75, 1.5).
#   g_0 = ∇f_0(0) = (−2, 0), g_1 = (0, −4): m^1 = 0.5·0 + (−1, −2) = (−1, −2), ‖m^1‖ = √5
#   (the full-batch gradients at x, not the pseudo-gradient x − ȳ = (−0.75, −1.5)).
# Round 2, correction β m^1 = (−0.5, −1):
#   client 0: ∇ = (−1.25, 1.5) + (−0.5, −1) = (−1.75, 0.5) → (1.625, 1.25);
#             ∇ = (−0.375, 1.25) + (−0.5, −1) = (−0.875, 0.25) → (2.0625, 1.125)
#   client 1: ∇ = (0.75, −2.5) + (−0.5, −1) = (0.25, −3.5) → (0.625, 3.25);
#             ∇ = (0.625, −0.75) + (−0.5, −1) = (0.125, −1.75) → (0.5625, 4.125)
#   x^2 = ((2.0625 + 0.5625)/2, (1.125 + 4.125)/2) = (1.3125, 2.625)
#   g_0 = ∇f_0(x^1) = (−1.25, 1.5), g_1 = (0.75, −2.5): m^2 = 0.5·(−1, −2) + (−0.25, −0.5) = (−0.75, −1.5), ‖m^2‖ = 0.75√5.
HAND_CASE = {
    "config": {"momentum": 0.5, "aggregation": "uniform"},
    "params": [(0.75, 1.5), (1.3125, 2.625)],
    "drift": None,
    "metrics": [{"momentum_norm": math.sqrt(5)}, {"momentum_norm": 0.75 * math.sqrt(5)}],
}
HAND_TARGETS = (vector(2.0, 0.0), vector(0.0, 4.0))
HAND_PROBLEM = Quadratics(torch.ones(2, 2, dtype=torch.float64), torch.stack(HAND_TARGETS))


def test_two_hand_rounds_move_the_model_and_the_momentum_as_computed_by_hand():
    algorithm = mime.build(SGD, momentum=0.5, aggregation="uniform")
    server, history = run_with_gradients(
        algorithm, HAND_PROBLEM, torch.zeros(2, dtype=torch.float64), rounds=1, steps=2, learning_rate=0.5
    )
    assert torch.equal(server.params, vector(0.75, 1.5))
    assert torch.equal(server.momentum, vector(-1.0, -2.0))  # mean ∇f_k(x^0), not x^0 − ȳ = (−0.75, −1.5)
    assert history[0]["momentum_norm"] == pytest.approx(math.sqrt(5), rel=1e-15)
    server, history = run_with_gradients(
        algorithm, HAND_PROBLEM, torch.zeros(2, dtype=torch.float64), rounds=2, steps=2, learning_rate=0.5
    )
    assert torch.equal(server.params, vector(1.3125, 2.625))
    assert torch.equal(server.momentum, vector(-0.75, -1.5))
    assert history[1]["momentum_norm"] == pytest.approx(0.75 * math.sqrt(5), rel=1e-15)


def test_weighted_aggregation_weighs_the_models_and_the_gradients_by_n_k():
    # Round 1 of the hand case with n = (1, 3): x^1 = (1.5, 0)/4 + 3(0, 3)/4 = (0.375, 2.25),
    # m^1 = ((−2, 0) + 3(0, −4))/4 = (−0.5, −3).
    algorithm = mime.build(SGD, momentum=0.5, aggregation="weighted")
    server, _ = run_with_gradients(
        algorithm,
        HAND_PROBLEM,
        torch.zeros(2, dtype=torch.float64),
        rounds=1,
        steps=2,
        learning_rate=0.5,
        num_samples=[1, 3],
    )
    assert torch.equal(server.params, vector(0.375, 2.25))
    assert torch.equal(server.momentum, vector(-0.5, -3.0))


def _uniform_round(start: torch.Tensor, sent: list, context: RoundContext) -> tuple:
    """Uniform MimeLite with β = 0.5 from x = ``start`` (m = 0): the algorithm, its server, the messages (y_k, g_k) of
    ``sent`` with unit weight each, and the server after one round of them under ``context``."""
    algorithm = mime.build(SGD, momentum=0.5, aggregation="uniform")
    server = algorithm.server_init(start)
    messages = [mime.ClientMessage(params, gradient, 1, 1) for params, gradient in sent]
    return algorithm, server, messages, algorithm.server_update(server, messages, context)[0]


def test_the_server_rate_scales_the_model_step_but_not_the_momentum():
    sent = [(vector(2.0, 0.0), vector(1.0, 1.0)), (vector(0.0, 2.0), vector(3.0, 1.0))]
    *_, new_server = _uniform_round(vector(0.0, 0.0), sent, RoundContext(1, 4, 2, 0.5))
    assert torch.equal(new_server.params, vector(0.5, 0.5))  # x − 0.5(x − ȳ), ȳ = (1, 1)
    assert torch.equal(new_server.momentum, vector(2.0, 1.0))


# ---------------------------------------------------------------- equivalences and convergence on quadratics


@pytest.mark.parametrize("aggregation", ["weighted", "uniform"])
def test_momentum_zero_is_fedavg_bit_for_bit(aggregation: str):
    problem = heterogeneous_quadratics()
    initial = vector(1.0, -1.0, 0.5)
    chosen = lambda t: [t % 5, (t + 2) % 5]  # noqa: E731 - partial participation, changing each round
    sizes = [3, 7, 1, 4, 9]
    lite = run_quadratic(
        mime.build(SGD, momentum=0.0, aggregation=aggregation), problem, initial, 20, 4, 0.1, chosen, sizes
    )
    plain = run_quadratic(
        fedavg.build(SGD, aggregation=aggregation, incomplete="keep"), problem, initial, 20, 4, 0.1, chosen, sizes
    )
    assert torch.equal(lite.server.params, plain.server.params)
    assert algorithm_sends_no_momentum(mime.build(SGD, momentum=0.0))


def algorithm_sends_no_momentum(algorithm) -> bool:
    view = algorithm.broadcast(algorithm.server_init(vector(1.0)))
    _, message = algorithm.client_finish(
        view, None, ClientContext(0, 1, 1, 1.0, 1, 1, 0.1), ClientUpdate(view.params, vector(2.0), 1)
    )
    return view.momentum is None and message.gradient is None


def test_one_local_step_with_every_client_is_heavy_ball_gradient_descent_on_the_mean():
    # K = 1: y_k = x − η(∇f_k(x) + βm), so x⁺ = x − η(∇F(x) + βm) and m⁺ = βm + ∇F(x): x⁺ = x − η m⁺ (PyTorch's SGD momentum).
    problem = heterogeneous_quadratics()
    initial, beta, rate = vector(1.0, -1.0, 0.5), 0.7, 0.1
    server, _ = run_with_gradients(mime.build(SGD, momentum=beta, aggregation="uniform"), problem, initial, 60, 1, rate)
    x, buffer = initial, torch.zeros(3, dtype=torch.float64)
    for _ in range(60):
        buffer = beta * buffer + (problem.curvatures.mean(0) * x - problem.targets.mean(0))
        x = x - rate * buffer
    assert torch.allclose(server.params, x, rtol=0, atol=1e-12)
    long, _ = run_with_gradients(mime.build(SGD, momentum=beta, aggregation="uniform"), problem, initial, 600, 1, rate)
    assert torch.allclose(long.params, problem.minimiser(), rtol=0, atol=1e-10)


def test_several_local_steps_converge_to_the_predicted_fixed_point_nearer_the_minimiser_than_fedavg():
    # Per coordinate, K steps with the constant correction c = βm map x to y_k* + (1 − η a_k)^K (x − y_k*),
    # y_k* = (b_k − c)/a_k.  At a fixed point m = ∇F(x)/(1 − β), so with φ_k = 1 − (1 − η a_k)^K and ρ = β/(1 − β):
    #   x (Σ φ_k + ρ ā Σ φ_k/a_k) = Σ φ_k b_k/a_k + ρ b̄ Σ φ_k/a_k       (ā, b̄ the means over clients)
    # which tends to the minimiser b̄/ā as β → 1 and is FedAvg's surrogate at β = 0.
    problem = heterogeneous_quadratics()
    a, b = problem.curvatures, problem.targets
    steps, rate, beta = 5, 0.05, 0.5
    server, _ = run_with_gradients(
        mime.build(SGD, momentum=beta, aggregation="uniform"), problem, vector(1.0, -1.0, 0.5), 400, steps, rate
    )
    phi = 1 - (1 - rate * a) ** steps
    rho = beta / (1 - beta)
    fixed_point = ((phi * b / a).sum(0) + rho * b.mean(0) * (phi / a).sum(0)) / (
        phi.sum(0) + rho * a.mean(0) * (phi / a).sum(0)
    )
    assert torch.allclose(server.params, fixed_point, rtol=0, atol=1e-10)
    surrogate = (phi * b / a).sum(0) / phi.sum(0)
    minimiser = problem.minimiser()
    assert torch.linalg.vector_norm(fixed_point - minimiser) < 0.6 * torch.linalg.vector_norm(surrogate - minimiser)


# ---------------------------------------------------------------- partial work, a client without its data, compression


def test_a_client_that_did_no_step_sends_the_start_model_and_its_full_gradient():
    algorithm = mime.build(SGD, momentum=0.5)
    view = algorithm.broadcast(algorithm.server_init(vector(1.0, 1.0)))
    context = ClientContext(0, 1, 5, 5.0, 4, 3, 0.1, available_steps=0)
    computation = QuadraticGradient(vector(1.0, 1.0), vector(2.0, 0.0))
    _, message = algorithm.client_finish(view, None, context, ClientUpdate(view.params, view.params, 0, computation))
    assert torch.equal(message.params, vector(1.0, 1.0)) and torch.equal(message.gradient, vector(-1.0, 1.0))


def test_a_client_update_without_its_data_says_what_is_missing_and_the_fix():
    algorithm = mime.build(SGD, momentum=0.5)
    view = algorithm.broadcast(algorithm.server_init(vector(1.0)))
    with pytest.raises(RuntimeError, match=r"full_gradient.*algorithm.momentum = 0"):
        algorithm.client_finish(
            view, None, ClientContext(0, 1, 1, 1.0, 1, 1, 0.1), ClientUpdate(view.params, vector(2.0), 1)
        )


def test_compression_replaces_the_uploaded_model_and_leaves_the_gradient_whole():
    algorithm = with_compression(mime.build(SGD, momentum=0.5), 0.5, [4])
    server = algorithm.server_init(torch.zeros(4))
    state = algorithm.client_state_init(torch.zeros(4))
    view = algorithm.broadcast(server)
    computation = QuadraticGradient(torch.ones(4), torch.tensor([1.0, -2.0, 3.0, -4.0]))
    update = ClientUpdate(torch.zeros(4), torch.tensor([0.1, -0.2, 0.3, -0.4]), 2, computation)
    _, message = algorithm.client_finish(view, state, ClientContext(0, 1, 1, 1.0, 1, 2, 0.1), update)
    sent = message.payload if hasattr(message, "payload") else message
    assert torch.equal(sent.gradient, torch.tensor([-1.0, 2.0, -3.0, 4.0]))  # ∇f at the start model, uncompressed
    assert int((sent.params != 0).sum()) == 2  # ST keeps half the entries of the change
    new_server, metrics = algorithm.server_update(server, [message], RoundContext(1, 1, 1, 1.0))
    assert torch.equal(new_server.inner.momentum, sent.gradient) and metrics["momentum_norm"] > 0


# ---------------------------------------------------------------- privacy, asynchrony, bad input


def test_private_round_divides_both_means_by_the_public_denominator():
    sent = [(vector(3.0, 1.0), vector(4.0, 0.0)), (vector(1.0, 5.0), vector(0.0, 8.0))]
    context = RoundContext(1, 8, 2, 1.0, mean_denominator=4.0)
    algorithm, server, messages, private = _uniform_round(vector(1.0, 1.0), sent, context)
    assert torch.equal(private.params, vector(1.5, 2.0))  # x + ((2, 0) + (0, 4))/4
    assert torch.equal(private.momentum, vector(1.0, 2.0))  # ((4, 0) + (0, 8))/4
    view = algorithm.broadcast(server)
    assert torch.equal(algorithm.release.release(view, messages[0]), vector(2.0, 0.0, 4.0, 0.0))
    carrier = algorithm.release.restore(view, None, vector(-1.0, 1.0, 2.0, 3.0))
    assert torch.equal(carrier.params, vector(0.0, 2.0)) and torch.equal(carrier.gradient, vector(2.0, 3.0))
    assert carrier.multiplicity == 1 and algorithm.release.size(view) == 4


def test_weighted_aggregation_has_no_release_form_and_no_asynchronous_rule():
    weighted = mime.build(SGD, momentum=0.5, aggregation="weighted")
    assert weighted.release is None and 'aggregation = "uniform"' in weighted.release_refusal
    assert not weighted.asynchronous and "remove [asynchronous]" in weighted.asynchronous_problem()


@pytest.mark.parametrize("momentum", [-0.1, 1.0, 1.5])
def test_momentum_outside_zero_to_one_is_refused_before_any_work(momentum: float):
    with pytest.raises(ValidationError, match="momentum"):
        mime.Config(momentum=momentum)
    with pytest.raises(ValueError, match=r"momentum \(β\) must be in \[0, 1\)"):
        mime.build(SGD, momentum=momentum)


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValidationError):
        mime.Config(aggregation="median")
    with pytest.raises(ValueError, match="unknown aggregation"):
        mime.build(SGD, aggregation="median")


# ---------------------------------------------------------------- whole runs

RUN = {**TINY, "algorithm": {"name": "mimelite", "momentum": 0.5}}


def mlr_problem(seed: int, examples: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor, FlatModel]:
    """Seeded 2-feature inputs, their 3-class targets and a float64 MLR model, with the generator for more draws."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(examples, 2, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 3, (examples,), generator=generator)
    return generator, inputs, targets, FlatModel.wrap(build_model("mlr", (2,), 3)).to("cpu", torch.float64)


def test_the_engine_full_gradient_is_the_mean_loss_gradient_over_the_client_data():
    generator, inputs, targets, model = mlr_problem(seed=0, examples=9)
    params = torch.randn(model.initial_parameters().numel(), generator=generator, dtype=torch.float64)
    rows = torch.tensor([0, 2, 3, 5, 8])
    training = TrainingData(inputs, targets)
    computed = ClientDataComputation(ClientData(model, training, rows), seed=0, round=1, client_id=0).full_gradient(
        params
    )
    expected = BoundModule(model, params).full_gradient(params, rows, training)  # the engine's backward-pass gradient
    assert torch.allclose(computed, expected, rtol=0, atol=1e-14) and float(torch.linalg.vector_norm(expected)) > 0


def _agrees_across_backends(run: dict, metric: str) -> Any:
    """The sequential run of ``run``, after checking that the vectorized one gives its model and per-round ``metric``
    to float32 rounding, and that every reporting client uploaded two models (y_k and g_k)."""
    sequential = driftlab.run({**run, "backend": "sequential"})
    vectorized = driftlab.run({**run, "backend": "vectorized"})
    assert torch.allclose(sequential.final_params, vectorized.final_params, rtol=1e-4, atol=1e-5)
    for first, second in zip(sequential.records, vectorized.records, strict=True):
        assert first[metric] == pytest.approx(second[metric], rel=1e-4)
    last = sequential.records[-1]
    assert last["upload_bits"] == 2 * 32 * sequential.num_parameters * last["num_reporting"]
    return sequential


def test_both_backends_agree_to_float32_rounding():
    _agrees_across_backends(RUN, "momentum_norm")


def test_momentum_zero_runs_are_fedavg_runs_bit_for_bit():
    lite = driftlab.run({**RUN, "algorithm": {"name": "mimelite", "momentum": 0.0}})
    plain = driftlab.run({**RUN, "algorithm": {"name": "fedavg", "incomplete": "keep"}})
    assert torch.equal(lite.final_params, plain.final_params)


# ================================================================ Mime (the control variate c)
#
# The quadratic clients f_k(θ) = ½ θᵀ diag(a_k) θ − b_kᵀ θ as a model: the output is θ itself and the example loss of
# a target row (a_k, b_k) is ½ Σ a_k out² − b_k · out, so Mime's real loss term (minus_anchor_gradient, through
# objectives.objective_loss, the backends' function) runs on them, and ∇f_k(y; ζ) − ∇f_k(x; ζ) = a_k ⊙ (y − x).


def quadratic_outputs(params: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return params.expand(len(inputs), -1)


def quadratic_example_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    curvature, target = targets.chunk(2, dim=1)
    return (0.5 * curvature * outputs**2 - target * outputs).sum(1)


def mime_build(momentum: float = 0.5, aggregation: str = "uniform"):
    return mime.build(SGD, momentum=momentum, aggregation=aggregation, control_variate=True)


# The hand case of MimeLite above, with Mime.  Round 1: no snapshot yet, so MimeLite's round: x^1 = (0.75, 1.5),
#   ḡ_1 = (−1, −2) = c^1 = m^1 at the snapshot x̃ = x^0 = 0.
# Round 2: every step adds c^1 + β m^1 = (−1.5, −3), and ∇f_k(y) − ∇f_k(x̃) = y − 0 (identity curvature), so both
#   clients take the same steps (no client drift):  y = (0.75, 1.5) − 0.5((0.75, 1.5) + (−1.5, −3)) = (1.125, 2.25),
#   y = (1.125, 2.25) − 0.5((1.125, 2.25) + (−1.5, −3)) = (1.3125, 2.625) = x^2 (MimeLite's mean, without its spread).
#   ḡ_2 = mean((−1.25, 1.5), (0.75, −2.5)) = (−0.25, −0.5) = c^2 at x̃ = x^1;  m^2 = 0.5(−1, −2) + ḡ_2 = (−0.75, −1.5).
MIME_HAND_CASE = {
    "config": {"momentum": 0.5, "aggregation": "uniform"},
    "params": [(0.75, 1.5), (1.3125, 2.625)],
    "drift": None,
    "metrics": [
        {"momentum_norm": math.sqrt(5), "control_variate_norm": math.sqrt(5)},
        {"momentum_norm": 0.75 * math.sqrt(5), "control_variate_norm": 0.25 * math.sqrt(5)},
    ],
}
HAND_CASES = {"mimelite": HAND_CASE, "mime": MIME_HAND_CASE}  # shared_test's hand case per algorithm of this module


def test_mime_two_hand_rounds_as_computed_by_hand_and_without_client_drift():
    initial = torch.zeros(2, dtype=torch.float64)
    for rounds in (1, 2):
        server, history = run_with_gradients(
            mime_build(), HAND_PROBLEM, initial, rounds=rounds, steps=2, learning_rate=0.5
        )
        assert torch.equal(server.params, vector(*MIME_HAND_CASE["params"][rounds - 1]))
        for key, value in MIME_HAND_CASE["metrics"][rounds - 1].items():
            assert history[-1][key] == pytest.approx(value, rel=1e-15)
    assert torch.equal(server.momentum, vector(-0.75, -1.5)) and torch.equal(
        server.control_variate, vector(-0.25, -0.5)
    )
    view = mime_build().broadcast(server)
    assert torch.equal(view.snapshot, vector(0.75, 1.5)) and torch.equal(
        view.correction, vector(-0.625, -1.25)
    )  # c² + β m²
    # Round 2's clients, one by one: both end at x^2 (MimeLite's end at (2.0625, 1.125) and (0.5625, 4.125)).
    round_two = mime_build().broadcast(run_with_gradients(mime_build(), HAND_PROBLEM, initial, 1, 2, 0.5)[0])
    for client in range(2):
        objective, theta = (
            mime_build().client_objective(round_two, None, ClientContext(client, 2, 1, 1.0, 2, 2, 0.5)),
            round_two.params,
        )
        for _ in range(2):
            correction, gradient = objective_gradient(
                objective, theta, torch.ones(2, dtype=torch.float64), HAND_TARGETS[client]
            )
            theta = corrected_step(theta, gradient, correction, LocalSettings(0.5))
        assert torch.equal(theta, vector(1.3125, 2.625))


def test_mime_sends_the_control_variate_only_once_it_is_known_and_round_one_is_mimelite():
    algorithm = mime_build(momentum=0.0)
    first = algorithm.broadcast(algorithm.server_init(vector(1.0, 2.0)))
    assert not first.controlled and torch.equal(first.correction, vector(0.0, 0.0))  # no snapshot yet: a FedAvg step
    assert algorithm.client_objective(first, None, ClientContext(0, 1, 1, 1.0, 1, 1, 0.1)) == GradientCorrection()
    problem = heterogeneous_quadratics()
    initial = vector(1.0, -1.0, 0.5)
    lite, _ = run_with_gradients(mime.build(SGD, momentum=0.5, aggregation="uniform"), problem, initial, 1, 4, 0.1)
    mime_one, _ = run_with_gradients(mime_build(0.5), problem, initial, 1, 4, 0.1)
    assert torch.equal(lite.params, mime_one.params) and torch.equal(lite.momentum, mime_one.momentum)
    assert torch.equal(mime_one.snapshot, initial)  # the model the round's gradients were taken at


def test_mime_one_local_step_with_every_client_is_the_centralized_heavy_ball():
    # K = 1: y_k = x − η(∇f_k(x) − ∇f_k(x̃) + c + βm) and the mean over every client of ∇f_k(x̃) is c, so
    # x⁺ = x − η(∇F(x) + βm), m⁺ = βm + ∇F(x): centralized SGD with momentum, MimeLite's K = 1 rounds (the paper's point).
    problem = heterogeneous_quadratics()
    initial, beta, rate = vector(1.0, -1.0, 0.5), 0.7, 0.1
    server, _ = run_with_gradients(mime_build(beta), problem, initial, 40, 1, rate)
    lite, _ = run_with_gradients(mime.build(SGD, momentum=beta, aggregation="uniform"), problem, initial, 40, 1, rate)
    assert torch.allclose(server.params, lite.params, rtol=0, atol=1e-13)
    assert torch.allclose(server.momentum, lite.momentum, rtol=0, atol=1e-13)


@pytest.mark.parametrize(("beta", "rounds"), [(0.0, 100), (0.5, 200)])
def test_mime_with_several_local_steps_converges_to_the_minimiser_where_mimelite_does_not(beta: float, rounds: int):
    # At a fixed point x̃ = x, c = ∇F(x) and m = ∇F(x)/(1 − β), and the steps move y − x = −M_k (c + β m) with M_k ≻ 0 per
    # coordinate, so Σ_k (y_k − x) = 0 forces ∇F(x)/(1 − β) = 0: the minimiser, whatever K (MimeLite and FedAvg: a surrogate).
    problem = heterogeneous_quadratics()
    initial, steps, rate = vector(1.0, -1.0, 0.5), 5, 0.05
    server, _ = run_with_gradients(mime_build(beta), problem, initial, rounds, steps, rate)
    assert torch.allclose(server.params, problem.minimiser(), rtol=0, atol=1e-8)
    lite, _ = run_with_gradients(
        mime.build(SGD, momentum=beta, aggregation="uniform"), problem, initial, rounds, steps, rate
    )
    assert torch.linalg.vector_norm(lite.params - problem.minimiser()) > 1e-3


def test_mime_local_step_on_a_model_is_the_loss_gradient_difference_plus_the_correction():
    # One engine step (train_one_client, the sequential backend) against its rule computed from two loss gradients.
    generator, inputs, targets, model = mlr_problem(seed=3, examples=8)
    snapshot = torch.randn(model.initial_parameters().numel(), generator=generator, dtype=torch.float64)
    start = snapshot + 0.3 * torch.randn(snapshot.shape, generator=generator, dtype=torch.float64)
    correction = torch.randn(snapshot.shape, generator=generator, dtype=torch.float64)
    objective = mime_build().client_objective(
        mime.MimeView(start, snapshot, correction, True), None, ClientContext(0, 2, 8, 8.0, 1, 1, 0.1)
    )
    rows = torch.arange(8)
    task = ClientTask(0, rows, np.array([[0, 2, 5, 7]]), objective)
    bound = BoundModule(model, snapshot)
    stepped, done = train_one_client(bound, start, task, LocalSettings(0.1), TrainingData(inputs, targets))
    batch = rows[[0, 2, 5, 7]]
    difference = bound.loss_gradient(start, inputs[batch], targets[batch]) - bound.loss_gradient(
        snapshot, inputs[batch], targets[batch]
    )
    assert done == 1 and torch.allclose(stepped, start - 0.1 * (difference + correction), rtol=0, atol=1e-14)
    assert float(torch.linalg.vector_norm(difference)) > 0.01


def test_mime_release_form_releases_the_change_and_the_gradient_also_at_beta_zero():
    algorithm = mime_build(momentum=0.0)
    server = algorithm.server_init(vector(1.0, 1.0))
    messages = [
        mime.ClientMessage(vector(3.0, 1.0), vector(4.0, 0.0), 1, 1),
        mime.ClientMessage(vector(1.0, 5.0), vector(0.0, 8.0), 1, 1),
    ]
    private, _ = algorithm.server_update(server, messages, RoundContext(1, 8, 2, 1.0, mean_denominator=4.0))
    assert torch.equal(private.params, vector(1.5, 2.0)) and torch.equal(private.control_variate, vector(1.0, 2.0))
    assert torch.equal(private.snapshot, vector(1.0, 1.0))
    view = algorithm.broadcast(server)
    assert torch.equal(algorithm.release.release(view, messages[0]), vector(2.0, 0.0, 4.0, 0.0))
    weighted = mime_build(aggregation="weighted")
    assert weighted.release is None and 'aggregation = "uniform"' in weighted.release_refusal


def test_mime_refuses_asynchrony_and_a_client_without_its_data():
    algorithm = mime_build()
    # the one template
    refused = f'[asynchronous] with algorithm.name = "{algorithm.name}": {mime.MIME_ASYNCHRONOUS_REASON.text}'
    assert not algorithm.asynchronous and algorithm.asynchronous_problem() == refused
    assert "remove [asynchronous]" in mime.MIME_ASYNCHRONOUS_REASON.text
    view = algorithm.broadcast(algorithm.server_init(vector(1.0)))
    with pytest.raises(RuntimeError, match=r"Mime needs.*full_gradient"):
        algorithm.client_finish(
            view, None, ClientContext(0, 1, 1, 1.0, 1, 1, 0.1), ClientUpdate(view.params, vector(2.0), 1)
        )


MIME_RUN = {**RUN, "algorithm": {"name": "mime", "momentum": 0.5, "control_variate": "previous"}}


def test_mime_both_backends_agree_to_float32_rounding():
    sequential = _agrees_across_backends(MIME_RUN, "control_variate_norm")
    lite = driftlab.run({**RUN, "backend": "sequential"})
    assert not torch.equal(lite.final_params, sequential.final_params)  # from round 2 on, c changes the steps
    for record, lite_record in zip(sequential.records, lite.records, strict=True):  # down x, x̃, c + βm: three models
        assert 2 * record["download_bits"] == 3 * lite_record["download_bits"] > 0


def test_mime_round_one_runs_are_mimelite_and_fedavg_runs_bit_for_bit():
    one = {**MIME_RUN, "rounds": 1}
    result = driftlab.run(one)
    assert torch.equal(
        result.final_params, driftlab.run({**one, "algorithm": {"name": "mimelite", "momentum": 0.5}}).final_params
    )
    plain = driftlab.run({**one, "algorithm": {"name": "fedavg", "incomplete": "keep"}})
    zero = {"name": "mime", "momentum": 0.0, "control_variate": "previous"}
    assert torch.equal(driftlab.run({**one, "algorithm": zero}).final_params, plain.final_params)


# MimeLite's and Mime's runs, each with the metric that shows its server momentum or control variate at work
VARIANTS = {"mimelite": (RUN, "momentum_norm"), "mime": (MIME_RUN, "control_variate_norm")}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_compressed_uploads_run(name):
    run, metric = VARIANTS[name]
    result = driftlab.run({**run, "compression": {"ratio": 0.2}})
    assert all(record[metric] > 0 for record in result.records)
    assert result.records[-1]["upload_bits"] < 2 * 32 * result.num_parameters * result.records[-1]["num_reporting"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_errors_name_the_key_before_any_work(name):
    with pytest.raises(driftlab.ConfigError, match=r"algorithm\.momentum"):
        driftlab.load_config({"algorithm": {"name": name, "momentum": 1.0}})
    with pytest.raises(driftlab.ConfigError, match=f"server.optimizer: {name} has its own server step"):
        driftlab.run({**VARIANTS[name][0], "server": {"optimizer": "adam"}})


def test_a_private_mime_run_trains_and_a_weighted_or_asynchronous_one_is_refused():
    private = {
        **MIME_RUN,
        "sampling": {"participation": 0.5, "mode": "poisson"},
        "privacy": {"clip": 1.0, "noise_multiplier": 0.5},
    }
    result = driftlab.run(
        {
            **private,
            "algorithm": {"name": "mime", "momentum": 0.5, "aggregation": "uniform", "control_variate": "previous"},
        }
    )
    assert all(math.isfinite(record["train_loss"]) for record in result.records)
    assert any(record["control_variate_norm"] > 0 for record in result.records)
    with pytest.raises(driftlab.ConfigError, match='aggregation = "uniform"'):
        driftlab.run(private)
    with pytest.raises(driftlab.ConfigError, match=r"Mime corrects every local step.*remove \[asynchronous\]"):
        driftlab.run({**MIME_RUN, "system": {}, "asynchronous": {"buffer": 2}})


# ------------------------------------------------------------------ the paper's Mime: c of this round, in a first phase


def mime_current(momentum: float = 0.5, aggregation: str = "uniform"):
    return mime.build(SGD, momentum=momentum, aggregation=aggregation, control_variate="current")


MIME_CURRENT_RUN = {**RUN, "algorithm": {"name": "mime", "momentum": 0.5}}  # the default: control_variate = "current"


def test_the_papers_mime_two_hand_rounds():
    # Round 1: c¹ = mean(∇f_k(0)) = mean(−(2, 0), −(0, 4)) = (−1, −2) before training; the clients step
    #   y ← y − 0.5((y − x) + c¹) (identity curvature: ∇f_k(y) − ∇f_k(x) = y − x): y = (0.5, 1), then (0.75, 1.5) = x¹;
    #   m¹ = c¹ = (−1, −2).
    # Round 2: c² = mean((−1.25, 1.5), (0.75, −2.5)) = (−0.25, −0.5) at x¹; c² + β m¹ = (−0.75, −1.5);
    #   y = (0.75, 1.5) + (0.375, 0.75) = (1.125, 2.25), then (1.125, 2.25) − 0.5((0.375, 0.75) − (0.75, 1.5)) = (1.3125, 2.625) = x²;
    #   m² = 0.5 m¹ + c² = (−0.75, −1.5).  (The same numbers as the one-phase rule here: identity curvature.)
    initial = torch.zeros(2, dtype=torch.float64)
    for rounds, expected in ((1, vector(0.75, 1.5)), (2, vector(1.3125, 2.625))):
        server, history = run_with_gradients(
            mime_current(), HAND_PROBLEM, initial, rounds=rounds, steps=2, learning_rate=0.5
        )
        assert torch.equal(server.params, expected)
    assert torch.equal(server.momentum, vector(-0.75, -1.5)) and torch.equal(
        server.control_variate, vector(-0.25, -0.5)
    )
    assert history[-1]["control_variate_norm"] == pytest.approx(0.25 * math.sqrt(5), rel=1e-15)


def test_the_papers_mime_uses_this_rounds_control_variate_from_round_one():
    # On curved quadratics the one-phase rule's round 1 is MimeLite's; the paper's already corrects the steps.
    problem = heterogeneous_quadratics()
    initial = vector(1.0, -1.0, 0.5)
    current, _ = run_with_gradients(mime_current(0.5), problem, initial, 1, 4, 0.1)
    previous, _ = run_with_gradients(mime_build(0.5), problem, initial, 1, 4, 0.1)
    assert not torch.equal(current.params, previous.params)
    mean_gradient = torch.stack([problem.gradient(k, initial) for k in range(problem.num_clients)]).mean(0)
    assert torch.allclose(current.control_variate, mean_gradient, rtol=0, atol=1e-15)


def test_the_papers_mime_with_one_local_step_is_heavy_ball_on_the_current_gradient():
    # K = 1: y_k = x − η(∇f_k(x) − ∇f_k(x) + c + βm) = x − η(∇F(x) + βm) for every client: centralized SGD with momentum.
    problem = heterogeneous_quadratics()
    x, m, beta, rate = vector(1.0, -1.0, 0.5), torch.zeros(3, dtype=torch.float64), 0.7, 0.1
    server, _ = run_with_gradients(mime_current(beta), problem, x, 30, 1, rate)
    for _ in range(30):
        gradient = torch.stack([problem.gradient(k, x) for k in range(problem.num_clients)]).mean(0)
        x, m = x - rate * (gradient + beta * m), beta * m + gradient
    assert torch.allclose(server.params, x, rtol=0, atol=1e-13) and torch.allclose(
        server.momentum, m, rtol=0, atol=1e-13
    )


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_the_papers_mime_with_several_local_steps_converges_to_the_minimiser(beta: float):
    problem = heterogeneous_quadratics()
    server, _ = run_with_gradients(mime_current(beta), problem, vector(1.0, -1.0, 0.5), 150, 5, 0.05)
    assert torch.allclose(server.params, problem.minimiser(), rtol=0, atol=1e-8)


def test_the_papers_mime_runs_its_first_phase_in_the_engine_on_both_backends():
    sequential = driftlab.run({**MIME_CURRENT_RUN, "backend": "sequential"})
    vectorized = driftlab.run({**MIME_CURRENT_RUN, "backend": "vectorized"})
    assert torch.allclose(sequential.final_params, vectorized.final_params, rtol=1e-4, atol=1e-5)
    previous = driftlab.run(MIME_RUN)
    assert not torch.equal(sequential.final_params, previous.final_params)
    lite = driftlab.run(RUN)
    for record, lite_record in zip(sequential.records, lite.records, strict=True):
        assert record["control_variate_norm"] > 0
        # up ∇f_k(x) (first phase, every client with work) and y_k; down x and c + βm: MimeLite's traffic
        assert (
            record["upload_bits"] == lite_record["upload_bits"]
            and record["download_bits"] == lite_record["download_bits"]
        )


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"compression": {"ratio": 0.2}}, "compression would leave uncompressed"),
        (
            {"sampling": {"participation": 0.5, "mode": "poisson"}, "privacy": {"clip": 1.0, "noise_multiplier": 0.5}},
            "client-level DP",
        ),
        ({"system": {}}, "which the simulated clock does not time"),
    ],
)
def test_the_papers_mime_refuses_what_its_first_phase_cannot_do_and_names_the_one_phase_rule(extra, message):
    algorithm = {"name": "mime", "momentum": 0.5, "aggregation": "uniform"}
    with pytest.raises(driftlab.ConfigError, match=message) as raised:
        driftlab.run({**MIME_CURRENT_RUN, **extra, "algorithm": algorithm})
    assert 'control_variate = "previous"' in str(raised.value)


def test_a_deployment_refuses_the_papers_mime():
    from driftlab.deploy.messages import check_config_deployable

    with pytest.raises(driftlab.ConfigError, match="one request and one reply per client and round"):
        check_config_deployable(driftlab.load_config(MIME_CURRENT_RUN))
    check_config_deployable(driftlab.load_config(MIME_RUN))  # the one-phase rule deploys
