"""SCAFFOLD option II: control-variate arithmetic, the |P|/N factor, convergence on quadratics, traffic."""

from __future__ import annotations

import math

import torch

import driftlab
from driftlab.algorithms import scaffold
from driftlab.algorithms.shared_test import TINY, build_algorithm, heterogeneous_quadratics, run_quadratic
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.seam import ClientContext, ClientUpdate, RoundContext

F64 = torch.float64


def vector(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def test_option_two_uses_actual_steps_and_learning_rate() -> None:
    # c = (1, 0), c_k = (0, 2), θ^{t−1} = (1, 1), y = (0.5, 2) after 4 steps (5 planned) of η_l = 0.25:
    # c_k⁺ = c_k − c + (θ − y)/(K η_l) = (0,2) − (1,0) + (0.5,−1)/1 = (−0.5, 1);  Δc = (−0.5, −1);  Δy = (−0.5, 1)
    algorithm = scaffold.build(make_server_optimizer("sgd"))
    server = scaffold.ServerState(vector(1, 1), vector(1, 0), make_server_optimizer("sgd").init(vector(1, 1)))
    client = scaffold.ClientState(vector(0, 2))
    context = ClientContext(3, 7, 10, 10.0, 10, 5, 0.25)
    view = algorithm.broadcast(server)
    correction = algorithm.client_objective(view, client, context)
    assert torch.equal(correction.linear, vector(1, -2)) and correction.quadratic is None
    state, message = algorithm.client_finish(view, client, context, ClientUpdate(view.params, vector(0.5, 2), 4))
    assert torch.equal(state.control, vector(-0.5, 1))
    assert torch.equal(message.control_delta, vector(-0.5, -1))
    assert torch.equal(message.params_delta, vector(-0.5, 1))
    # no step done: no information, c_k kept
    state, message = algorithm.client_finish(view, client, context, ClientUpdate(view.params, view.params, 0))
    assert torch.equal(state.control, client.control) and torch.equal(message.control_delta, vector(0, 0))


def test_server_control_moves_by_sum_over_n_and_model_by_server_lr() -> None:
    # N = 8 registered, two report Δc = (8, 0), (0, 16): c ← c + (|P|/N) mean Δc = (0,0) + (1, 2);
    # Δy = (2, 0), (0, 4): θ ← θ + η_g mean Δy = (1,1) + 0.5 (1, 2) = (1.5, 2).
    algorithm = scaffold.build(make_server_optimizer("sgd"))
    server = algorithm.server_init(vector(1, 1))
    messages = [
        scaffold.ClientMessage(vector(2, 0), vector(8, 0), 1),
        scaffold.ClientMessage(vector(0, 4), vector(0, 16), 1),
    ]
    server, metrics = algorithm.server_update(server, messages, RoundContext(1, 8, 2, 0.5))
    assert torch.equal(server.control, vector(1, 2))
    assert torch.equal(server.params, vector(1.5, 2))
    assert metrics["drift_norm"] == float(torch.linalg.vector_norm(vector(1, 2)))


def test_server_control_is_the_mean_of_all_client_controls_under_partial_participation() -> None:
    problem = heterogeneous_quadratics(num_clients=6)
    initial = torch.zeros(3, dtype=F64)
    rounds = [[0, 1], [2, 3], [0, 4], [1, 2]]  # client 5 never trains: its c_k = 0 still counts in the mean
    run = run_quadratic(
        build_algorithm("scaffold"),
        problem,
        initial,
        len(rounds),
        steps=5,
        learning_rate=0.1,
        participants=lambda t: rounds[t - 1],
    )
    all_controls = [
        run.client_states[k].control if k in run.client_states else torch.zeros(3, dtype=F64) for k in range(6)
    ]
    assert torch.allclose(run.server.control, torch.stack(all_controls).mean(0), rtol=0, atol=1e-14)
    assert torch.linalg.vector_norm(run.server.control) > 0.1


def test_converges_to_the_global_minimiser_on_heterogeneous_quadratics() -> None:
    problem = heterogeneous_quadratics()
    initial = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    run = run_quadratic(build_algorithm("scaffold"), problem, initial, rounds=200, steps=10, learning_rate=0.1)
    assert torch.allclose(run.server.params, problem.minimiser(), rtol=0, atol=1e-6)
    # at the fixed point c = ∇F(x*) = 0 and every c_k = ∇f_k(x*)
    assert run.metrics[-1]["drift_norm"] < 1e-6
    for k in range(problem.num_clients):
        assert torch.allclose(run.client_states[k].control, problem.gradient(k, problem.minimiser()), rtol=0, atol=1e-6)


def test_composes_with_a_server_optimizer() -> None:
    # Adam's first step moves every coordinate by η_g (bias-corrected m/√v = sign(−q)): θ^1 = θ^0 + 0.1·sign(mean Δy).
    algorithm = build_algorithm("scaffold", server_optimizer="adam")
    server = algorithm.server_init(vector(0, 0))
    messages = [
        scaffold.ClientMessage(vector(2, -1), vector(0, 0), 1),
        scaffold.ClientMessage(vector(0, -3), vector(0, 0), 1),
    ]
    server, _ = algorithm.server_update(server, messages, RoundContext(1, 2, 2, 0.1))
    assert torch.allclose(server.params, vector(0.1, -0.1), rtol=1e-6)


def test_traffic_is_two_models_each_way_per_client() -> None:
    result = driftlab.run({**TINY, "algorithm": {"name": "scaffold"}})
    model_bits = 32 * result.num_parameters
    for record in result.records:
        assert record["num_selected"] == 3
        assert record["upload_bits"] == 2 * model_bits * 3
        assert record["download_bits"] == 2 * model_bits * 3
        assert record["drift_norm"] > 0


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).
#
# SCAFFOLD (η_g = 1).  Round 1 as FedAvg: y_0 = (1.5,0), y_1 = (0,3); c_k⁺ = (θ^0 − y_k)/(Kη)
#   = (−1.5,0), (0,−3); θ^1 = (0,0) + mean Δy = (0.75,1.5); c = ¼ Σ Δc = (−0.375,−0.75), ‖c‖ = 0.375√5.
#   Round 2: client 0, c − c_0 = (1.125,−0.75): → (0.8125,1.125) → (0.84375,0.9375);
#   c_0⁺ = c_0 − c + (θ^1 − y_0) = (−1.21875,1.3125), Δc_0 = (0.28125,1.3125).
#   client 1, c − c_1 = (−0.375,2.25): → (0.5625,1.625) → (0.46875,1.6875);
#   c_1⁺ = (0.65625,−2.4375), Δc_1 = (0.65625,0.5625).
#   θ^2 = θ^1 + mean Δy = (0.75,1.5) + (−0.09375,−0.1875) = (0.65625, 1.3125);
#   c = (−0.375,−0.75) + ¼(0.9375,1.875) = (−0.140625,−0.28125), ‖c‖ = 0.140625√5.
HAND_CASE = {
    "config": {},
    "params": [(0.75, 1.5), (0.65625, 1.3125)],
    "drift": [0.375 * math.sqrt(5), 0.140625 * math.sqrt(5)],
}


def test_scaffold_private_round_divides_the_model_mean_by_the_denominator_and_the_control_sum_by_n():
    algorithm = scaffold.build(make_server_optimizer("sgd"))
    server = algorithm.server_init(vector(0.0, 0.0))
    # A client drawn twice: Δy counts twice in the mean, Δc once (so the form's promise is for multiplicity 1).
    messages = [
        scaffold.ClientMessage(vector(2.0, 0.0), vector(4.0, 0.0), 2),
        scaffold.ClientMessage(vector(0.0, 4.0), vector(0.0, 4.0), 1),
    ]
    new_server, _ = algorithm.server_update(server, messages, RoundContext(1, 8, 2, 1.0, mean_denominator=4.0))
    assert torch.equal(new_server.params, vector(1.0, 1.0))  # (2·(2, 0) + (0, 4))/4
    assert torch.equal(new_server.control, vector(0.5, 0.5))  # ((4, 0) + (0, 4))/8, as without privacy
    plain, _ = algorithm.server_update(server, messages, RoundContext(1, 8, 2, 1.0))
    assert torch.equal(plain.params, vector(4.0 / 3.0, 4.0 / 3.0))
    assert torch.equal(plain.control, vector(0.5, 0.5))


def test_scaffold_releases_both_deltas_in_field_order():
    algorithm = scaffold.build(make_server_optimizer("sgd"))
    view = algorithm.broadcast(algorithm.server_init(vector(5.0, 5.0)))
    message = scaffold.ClientMessage(vector(1.0, 2.0), vector(3.0, 4.0), 1)
    assert torch.equal(algorithm.release.release(view, message), vector(1.0, 2.0, 3.0, 4.0))
    carrier = algorithm.release.restore(view, None, vector(-1.0, -2.0, -3.0, -4.0))
    assert torch.equal(carrier.params_delta, vector(-1.0, -2.0))
    assert torch.equal(carrier.control_delta, vector(-3.0, -4.0)) and carrier.multiplicity == 1
