"""VRL-SGD: the client and server arithmetic by hand, the paper's Algorithm 1 as a reference, the FedAvg
equivalences, convergence on quadratics, both backends, compression, traffic and the refusals."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import driftlab
from driftlab.algorithms import vrlsgd
from driftlab.algorithms.shared_test import TINY, Quadratics, build_algorithm, heterogeneous_quadratics, run_quadratic
from driftlab.errors import ConfigError
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.seam import ClientContext, ClientUpdate, RoundContext

F64 = torch.float64


def vector(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def algorithm() -> Any:
    return vrlsgd.build(make_server_optimizer("sgd"))


# ---------------------------------------------------------------- client and server halves by hand


def test_client_corrects_by_own_minus_server_direction_and_uses_its_actual_steps() -> None:
    # c = (1, 0), c_k = (0, 2): Δ_k = c_k − c = (−1, 2), the step adds linear = −Δ_k = (1, −2).
    # y = (0.5, 2) after 4 steps (5 planned) of η_l = 0.25: d_k = (θ − y)/(K η_l) = (0.5, −1)/1;
    # c_k⁺ = Δ_k + d_k = (−0.5, 1); the message is y with K η_l = 1.
    vrl = algorithm()
    view = vrlsgd.ClientView(vector(1, 1), vector(1, 0))
    client = vrlsgd.ClientState(vector(0, 2))
    context = ClientContext(3, 7, 10, 10.0, 10, 5, 0.25)
    correction = vrl.client_objective(view, client, context)
    assert torch.equal(correction.linear, vector(1, -2)) and correction.quadratic is None
    state, message = vrl.client_finish(view, client, context, ClientUpdate(view.params, vector(0.5, 2), 4))
    assert torch.equal(state.direction, vector(-0.5, 1))
    assert torch.equal(message.params, vector(0.5, 2)) and message.step_scale == 1.0 and message.multiplicity == 1
    # no step done: nothing sent, c_k kept
    state, message = vrl.client_finish(view, client, context, ClientUpdate(view.params, view.params, 0))
    assert message is None and state is client


def test_server_averages_models_by_multiplicity_and_moves_c_by_the_sum_over_n() -> None:
    # θ = (1, 1), c = (1, 0), N = 8.  y_1 = (0, 1), K η = 1, drawn 3 times: d_1 = (1, 0), d_1 − c = (0, 0);
    # y_2 = (2, 5), K η = 2: d_2 = (−0.5, −2), d_2 − c = (−1.5, −2).
    # x̂ = (3·(0,1) + (2,5))/4 = (0.5, 2);  c ← c + (1/8)(Σ_P (d_k − c), each client once) = (0.8125, −0.25).
    vrl = algorithm()
    server = vrlsgd.ServerState(vector(1, 1), vector(1, 0), make_server_optimizer("sgd").init(vector(1, 1)))
    messages = [vrlsgd.ClientMessage(vector(0, 1), 1.0, 3), vrlsgd.ClientMessage(vector(2, 5), 2.0, 1)]
    new, metrics = vrl.server_update(server, messages, RoundContext(1, 8, 2, 1.0))
    assert torch.equal(new.params, vector(0.5, 2)) and torch.equal(new.direction, vector(0.8125, -0.25))
    assert metrics == {"drift_norm": float(torch.linalg.vector_norm(vector(0.8125, -0.25)))}
    # η_g = 0.5: θ moves half way to x̂; c does not depend on the server step
    half, _ = vrl.server_update(server, messages, RoundContext(1, 8, 2, 0.5))
    assert torch.equal(half.params, vector(0.75, 1.5)) and torch.equal(half.direction, vector(0.8125, -0.25))


def test_server_c_is_the_mean_of_all_client_cs_under_partial_participation() -> None:
    # The paper's Σ_S Δ_k = 0 (Δ_k = c_k − c), kept by c = mean_S c_k; client 5 never trains and counts with c_k = 0.
    problem = heterogeneous_quadratics(num_clients=6)
    cohorts = [[0, 1], [2, 3], [0, 4], [1, 2]]
    run = run_quadratic(
        build_algorithm("vrlsgd"),
        problem,
        torch.zeros(3, dtype=F64),
        len(cohorts),
        steps=5,
        learning_rate=0.1,
        participants=lambda t: cohorts[t - 1],
    )
    all_cs = [run.client_states[k].direction if k in run.client_states else torch.zeros(3, dtype=F64) for k in range(6)]
    assert torch.allclose(run.server.direction, torch.stack(all_cs).mean(0), rtol=0, atol=1e-14)
    assert torch.linalg.vector_norm(run.server.direction) > 0.1


# ---------------------------------------------------------------- the paper's Algorithm 1, written as the paper does


def paper_vrl_sgd(problem: Quadratics, initial: torch.Tensor, rounds: int, steps: int, gamma: float) -> torch.Tensor:
    """Algorithm 1 (and the authors' DSGD with vrl): x_i ← x_i − γ(∇f_i − Δ_i); every k steps
    x̂ = mean x_i, Δ_i ← Δ_i + (x̂ − x_i)/(kγ), x_i ← x̂."""
    workers = problem.num_clients
    deltas = [torch.zeros_like(initial) for _ in range(workers)]
    average = initial
    for _ in range(rounds):
        models = []
        for i in range(workers):
            x = average
            for _ in range(steps):
                x = x - gamma * (problem.gradient(i, x) - deltas[i])
            models.append(x)
        average = torch.stack(models).mean(0)
        deltas = [deltas[i] + (average - models[i]) / (steps * gamma) for i in range(workers)]
    return average


def test_equals_the_papers_algorithm_under_full_participation() -> None:
    # Δ_k = c_k − c is the paper's Δ_i split in two: equal in exact arithmetic, so up to float64 rounding.
    problem = heterogeneous_quadratics()
    initial = vector(1.0, -1.0, 0.5)
    for rounds in (1, 2, 5, 20):
        ours = run_quadratic(build_algorithm("vrlsgd"), problem, initial, rounds=rounds, steps=4, learning_rate=0.1)
        reference = paper_vrl_sgd(problem, initial, rounds, steps=4, gamma=0.1)
        assert torch.allclose(ours.server.params, reference, rtol=0, atol=1e-12), rounds
    # and differs from FedAvg after round 1 (the correction acts)
    fedavg = run_quadratic(
        build_algorithm("fedavg", aggregation="uniform"), problem, initial, rounds=2, steps=4, learning_rate=0.1
    )
    ours = run_quadratic(build_algorithm("vrlsgd"), problem, initial, rounds=2, steps=4, learning_rate=0.1)
    assert torch.linalg.vector_norm(ours.server.params - fedavg.server.params) > 1e-3


# ---------------------------------------------------------------- equivalences with FedAvg


def test_one_client_or_identical_clients_is_fedavg() -> None:
    # Δ_k = c_k − c is 0 in exact arithmetic (float64 leaves ~1e-16 of it), so the models are FedAvg's (uniform).
    one = heterogeneous_quadratics(num_clients=1)
    twins = Quadratics(one.curvatures.repeat(2, 1), one.targets.repeat(2, 1))
    initial = vector(1.0, -1.0, 0.5)
    for problem in (one, twins):
        fedavg = run_quadratic(
            build_algorithm("fedavg", aggregation="uniform"), problem, initial, rounds=6, steps=5, learning_rate=0.1
        )
        ours = run_quadratic(build_algorithm("vrlsgd"), problem, initial, rounds=6, steps=5, learning_rate=0.1)
        assert torch.allclose(ours.server.params, fedavg.server.params, rtol=0, atol=1e-14)
        for state in ours.client_states.values():
            assert torch.allclose(state.direction, ours.server.direction, rtol=0, atol=1e-14)
    # round 1 adds a zero correction only: bit for bit
    first = run_quadratic(build_algorithm("vrlsgd"), twins, initial, rounds=1, steps=5, learning_rate=0.1)
    fedavg = run_quadratic(
        build_algorithm("fedavg", aggregation="uniform"), twins, initial, rounds=1, steps=5, learning_rate=0.1
    )
    assert torch.equal(first.server.params, fedavg.server.params)


def cycling(name: str, problem: Any, cohorts: list[list[int]], rounds: int, steps: int, rate: float) -> Any:
    """``name`` on ``problem`` from (1, −1, ½) for ``rounds`` rounds whose participants cycle through ``cohorts``."""

    def participants(t: int) -> list[int]:
        return cohorts[(t - 1) % len(cohorts)]

    return run_quadratic(
        build_algorithm(name), problem, vector(1.0, -1.0, 0.5), rounds, steps, rate, participants=participants
    )


def test_same_arithmetic_as_scaffold_with_unit_server_rate_under_partial_participation() -> None:
    problem = heterogeneous_quadratics(num_clients=6)
    cohorts = [[0, 1, 2], [3, 4, 5], [0, 2, 4], [1, 3, 5], [5, 0]]
    ours, scaffold = (cycling(name, problem, cohorts, rounds=10, steps=4, rate=0.1) for name in ("vrlsgd", "scaffold"))
    assert torch.allclose(ours.server.params, scaffold.server.params, rtol=0, atol=1e-12)
    assert torch.allclose(ours.server.direction, scaffold.server.control, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- convergence


def test_converges_to_the_global_minimiser_where_fedavg_does_not() -> None:
    problem = heterogeneous_quadratics()
    initial = vector(1.0, -1.0, 0.5)
    run = run_quadratic(build_algorithm("vrlsgd"), problem, initial, rounds=200, steps=10, learning_rate=0.1)
    assert torch.allclose(run.server.params, problem.minimiser(), rtol=0, atol=1e-8)
    fedavg = run_quadratic(
        build_algorithm("fedavg", aggregation="uniform"), problem, initial, rounds=200, steps=10, learning_rate=0.1
    )
    assert torch.linalg.vector_norm(fedavg.server.params - problem.minimiser()) > 0.05
    # at the fixed point Δ_k = ∇f_k(x*) (and c = ∇F(x*) = 0)
    assert torch.allclose(run.server.direction, torch.zeros(3, dtype=F64), rtol=0, atol=1e-8)
    for k in range(problem.num_clients):
        delta = run.client_states[k].direction - run.server.direction
        assert torch.allclose(delta, problem.gradient(k, problem.minimiser()), rtol=0, atol=1e-8)


def test_partial_participation_still_reaches_the_minimiser() -> None:
    # c = mean_S c_k keeps Σ_S Δ_k = 0, so the fixed point is still x* (Δ_k = ∇f_k(x*), c = 0).
    problem = heterogeneous_quadratics(num_clients=6)
    cohorts = [[0, 1, 2], [3, 4, 5], [0, 2, 4], [1, 3, 5]]
    run = cycling("vrlsgd", problem, cohorts, rounds=400, steps=5, rate=0.05)
    assert torch.allclose(run.server.params, problem.minimiser(), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).
#
# VRL-SGD (η_g = 1, N = 4).  Round 1 as FedAvg (c = c_k = 0): y_0 = (1.5,0), y_1 = (0,3), θ^1 = (0.75,1.5);
#   d_0 = (θ^0 − y_0)/(Kη) = (−1.5,0), d_1 = (0,−3); c_k = d_k; c = ¼ Σ_P (d_k − 0) = (−0.375,−0.75), ‖c‖ = 0.375√5.
#   Round 2: client 0, −Δ_0 = c − c_0 = (1.125,−0.75): (0.75,1.5) → (0.8125,1.125) → (0.84375,0.9375);
#     d_0 = (−0.09375,0.5625).  Client 1, c − c_1 = (−0.375,2.25): → (0.5625,1.625) → (0.46875,1.6875);
#     d_1 = (0.28125,−0.1875).  θ^2 = mean y = (0.65625,1.3125);
#   c = c + ¼ Σ (d_k − c) = (−0.375,−0.75) + ¼ (0.9375,1.875) = (−0.140625,−0.28125), ‖c‖ = 0.140625√5.
#   (SCAFFOLD's numbers: the same arithmetic with η_g = 1; test_same_arithmetic_as_scaffold... checks it at large.)
HAND_CASE = {
    "config": {},
    "params": [(0.75, 1.5), (0.65625, 1.3125)],
    "drift": [0.375 * math.sqrt(5), 0.140625 * math.sqrt(5)],
}


# ---------------------------------------------------------------- full runs: backends, traffic, compression, refusals


def run(*overrides: str, **top: Any) -> Any:
    return driftlab.run({**TINY, **top, "algorithm": {"name": "vrlsgd"}}, overrides=list(overrides))


def test_sequential_and_vectorized_backends_agree_to_float32_rounding() -> None:
    sequential = run(backend="sequential", rounds=4)
    vectorized = run(backend="vectorized", rounds=4)
    assert torch.allclose(sequential.final_params, vectorized.final_params, rtol=1e-4, atol=1e-5)
    for a, b in zip(sequential.records, vectorized.records, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)


def test_traffic_is_two_models_down_and_one_up_per_client() -> None:
    result = run()
    model_bits = 32 * result.num_parameters
    for record in result.records:
        assert record["num_selected"] == 3
        assert record["upload_bits"] == model_bits * record["num_reporting"]
        assert record["download_bits"] == 2 * model_bits * 3


def test_compressed_uploads_run_and_cost_less() -> None:
    plain = run()
    compressed = run("compression.ratio=0.3")
    assert torch.isfinite(compressed.final_params).all()
    assert not torch.equal(plain.final_params, compressed.final_params)
    assert sum(r["upload_bits"] for r in compressed.records) < sum(r["upload_bits"] for r in plain.records)


def test_privacy_and_asynchronous_training_are_refused_with_the_reason() -> None:
    built = algorithm()
    assert built.release is None and "K_k" in built.release_refusal and "remove [privacy]" in built.release_refusal
    assert not built.asynchronous and "remove [asynchronous]" in built.asynchronous_problem()
    with pytest.raises(ConfigError, match="remove \\[privacy\\]"):
        run("privacy.clip=1", "privacy.noise_multiplier=1", "privacy.delta=1e-3", "sampling.mode=poisson")
    with pytest.raises(ConfigError, match="remove \\[asynchronous\\]"):
        run("system.profiles=lognormal", "asynchronous.concurrency=5", "asynchronous.buffer=2")


def test_unknown_hyperparameters_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="period"):
        driftlab.load_config({**TINY, "algorithm": {"name": "vrlsgd", "period": 5}})
    with pytest.raises(ConfigError):
        driftlab.load_config({**TINY, "algorithm": {"name": "vrl-sgd"}})
