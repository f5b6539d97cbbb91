"""FedGATE: the tracking arithmetic by hand, its timing, the FedAvg equivalence, convergence, runs, traffic, privacy."""

from __future__ import annotations

import pytest
import torch

import driftlab
from driftlab.algorithms import asynchronous_declarations_test as declarations
from driftlab.algorithms import fedgate
from driftlab.algorithms.shared_test import TINY, Quadratics, build_algorithm, heterogeneous_quadratics, run_quadratic
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.seam import ClientContext, ClientUpdate, RoundContext

F64 = torch.float64


def vector(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def sgd_fedgate():
    return fedgate.build(make_server_optimizer("sgd"))


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).
#
# FedGATE (γ = 1, η_l τ = 0.5·2 = 1).  Round 1, δ = 0, as uniform FedAvg: θ_0 = (1.5,0), θ_1 = (0,3);
#   θ^1 = mean = (0.75,1.5); D^1 = θ^0 − θ^1 = (−0.75,−1.5); own D_0 = (−1.5,0), D_1 = (0,−3).
#   Round 2 settles δ_k = (D_k − D^1)/1: δ_0 = (−0.75,1.5), δ_1 = (0.75,−1.5) (sum 0).
#   client 0, ∇ − δ_0 = (θ − (2,0)) − δ_0: (0.75,1.5) → (1,1.5) → (1.125,1.5)
#   client 1, ∇ − δ_1 = (θ − (0,4)) − δ_1: (0.75,1.5) → (0.75,2) → (0.75,2.25)
#   θ^2 = mean = (0.9375,1.875).  FedAvg's clients end at (1.6875,0.375) and (0.1875,3.375), with the same mean:
#   with equal unit curvatures local GD is affine with one slope, so corrections summing to 0 cancel in the mean.
HAND_CASE = {"config": {}, "params": [(0.75, 1.5), (0.9375, 1.875)], "drift": None}


def test_round_two_corrections_are_the_own_change_minus_the_mean_over_eta_tau() -> None:
    algorithm = sgd_fedgate()
    server = algorithm.server_init(vector(0, 0))
    view = algorithm.broadcast(server)
    states, messages = [], []
    for client, final in enumerate((vector(1.5, 0), vector(0, 3))):
        context = ClientContext(client, 1, 10, 10.0, 4, 2, 0.5)
        state, message = algorithm.client_finish(
            view, algorithm.client_state_init(vector(0, 0)), context, ClientUpdate(view.params, final, 2)
        )
        states.append(state)
        messages.append(message)
    assert states[0].pending_scale == 1.0 and torch.equal(states[0].correction, vector(-1.5, 0))
    server, metrics = algorithm.server_update(server, messages, RoundContext(1, 4, 2, 1.0))
    assert metrics == {}
    assert torch.equal(server.params, vector(0.75, 1.5)) and torch.equal(server.mean_change, vector(-0.75, -1.5))
    view = algorithm.broadcast(server)
    context = ClientContext(0, 2, 10, 10.0, 4, 2, 0.5)
    assert torch.equal(fedgate.settled_correction(view, states[0]), vector(-0.75, 1.5))
    assert torch.equal(fedgate.settled_correction(view, states[1]), vector(0.75, -1.5))
    correction = algorithm.client_objective(view, states[0], context)
    assert torch.equal(correction.linear, vector(0.75, -1.5)) and correction.quadratic is None  # ∇ − δ_0


def test_scale_uses_actual_steps_and_learning_rate_and_a_straggler_only_settles() -> None:
    # pending δ = (1, 2) with s = 0.5; the view's D = (2, 0): settled δ = (0, 2).  3 steps of η = 0.25 move
    # θ = (1, 1) to (0.25, 1.75): D_k = (0.75, −0.75), s' = 1/0.75, δ ← (0, 2) + (1, −1) = (1, 1).
    algorithm = sgd_fedgate()
    view = fedgate.ClientView(vector(1, 1), vector(2, 0))
    client = fedgate.ClientState(vector(1, 2), 0.5)
    context = ClientContext(3, 7, 10, 10.0, 10, 3, 0.25)
    state, message = algorithm.client_finish(view, client, context, ClientUpdate(view.params, vector(0.25, 1.75), 3))
    assert torch.equal(state.correction, vector(1, 1)) and state.pending_scale == 1 / 0.75
    assert torch.equal(message.params, vector(0.25, 1.75)) and message.multiplicity == 1
    # a straggler (2 of 3 steps available): dropped, settled, nothing pending
    straggler = ClientContext(3, 7, 10, 10.0, 10, 3, 0.25, available_steps=2)
    state, message = algorithm.client_finish(view, client, straggler, ClientUpdate(view.params, vector(0.5, 1.5), 2))
    assert message is None and state.pending_scale == 0.0 and torch.equal(state.correction, vector(0, 2))
    # nothing pending: the view's D is not subtracted
    assert torch.equal(fedgate.settled_correction(view, fedgate.ClientState(vector(1, 2), 0.0)), vector(1, 2))


def test_server_steps_on_the_mean_change_with_the_server_lr_and_counts_multiplicity() -> None:
    # θ = (1, 1); θ_k = (0, 1) drawn twice and (1, 4): mean = (1/3, 2), D = (2/3, −1); γ = 0.5: θ − γD = (2/3, 1.5).
    algorithm = sgd_fedgate()
    server = algorithm.server_init(vector(1, 1))
    messages = [fedgate.ClientMessage(vector(0, 1), 2), fedgate.ClientMessage(vector(1, 4), 1)]
    server, _ = algorithm.server_update(server, messages, RoundContext(1, 8, 2, 0.5))
    assert torch.allclose(server.mean_change, vector(2 / 3, -1), rtol=0, atol=1e-15)
    assert torch.allclose(server.params, vector(2 / 3, 1.5), rtol=0, atol=1e-15)


def test_composes_with_a_server_optimizer() -> None:
    # Adam's first step moves each coordinate by η_g against sign(q), q = D = θ − mean θ_k = (−1, 2).
    algorithm = build_algorithm("fedgate", server_optimizer="adam")
    server = algorithm.server_init(vector(0, 0))
    server, _ = algorithm.server_update(server, [fedgate.ClientMessage(vector(1, -2), 1)], RoundContext(1, 2, 1, 0.1))
    assert torch.allclose(server.params, vector(0.1, -0.1), rtol=1e-6)
    assert torch.equal(server.mean_change, vector(-1, 2))


# ---------------------------------------------------------------- equivalences and convergence on quadratics


def test_identical_clients_keep_zero_corrections_and_equal_uniform_fedavg_bit_for_bit() -> None:
    one = heterogeneous_quadratics(num_clients=1)
    identical = Quadratics(one.curvatures.repeat(4, 1), one.targets.repeat(4, 1))
    initial = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    gate = run_quadratic(build_algorithm("fedgate"), identical, initial, rounds=6, steps=5, learning_rate=0.1)
    avg = run_quadratic(
        build_algorithm("fedavg", aggregation="uniform"), identical, initial, rounds=6, steps=5, learning_rate=0.1
    )
    assert torch.equal(gate.server.params, avg.server.params)
    view = fedgate.ClientView(gate.server.params, gate.server.mean_change)
    for state in gate.client_states.values():
        assert not torch.any(fedgate.settled_correction(view, state))


def test_converges_to_the_global_minimiser_on_heterogeneous_quadratics() -> None:
    problem = heterogeneous_quadratics()
    initial = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    run = run_quadratic(build_algorithm("fedgate"), problem, initial, rounds=200, steps=10, learning_rate=0.1)
    minimiser = problem.minimiser()
    assert torch.allclose(run.server.params, minimiser, rtol=0, atol=1e-8)
    # at the fixed point every δ_k = ∇f_k(x*), and they sum to 0 (Σ_k (D_k − D) = 0 every round)
    view = fedgate.ClientView(run.server.params, run.server.mean_change)
    corrections = [fedgate.settled_correction(view, run.client_states[k]) for k in range(problem.num_clients)]
    assert torch.allclose(torch.stack(corrections).sum(0), torch.zeros(3, dtype=F64), rtol=0, atol=1e-12)
    for k, correction in enumerate(corrections):
        assert torch.allclose(correction, problem.gradient(k, minimiser), rtol=0, atol=1e-8)
    # FedAvg with the same steps stops at a surrogate far from it (shared_test's contrast)
    fedavg = run_quadratic(build_algorithm("fedavg"), problem, initial, rounds=200, steps=10, learning_rate=0.1)
    assert torch.linalg.vector_norm(fedavg.server.params - minimiser) > 0.05


def test_consecutive_pairs_settle_exactly_and_skipping_clients_settle_with_the_latest_mean() -> None:
    # Clients 0, 1 report in rounds 1 and 2 (exact); client 2 reports in round 1 only and client 3 in round 2.
    problem = heterogeneous_quadratics(num_clients=4)
    initial = torch.zeros(3, dtype=F64)
    rounds = [[0, 1, 2], [0, 1, 3]]
    run = run_quadratic(
        build_algorithm("fedgate"),
        problem,
        initial,
        2,
        steps=3,
        learning_rate=0.2,
        participants=lambda t: rounds[t - 1],
    )
    assert all(run.client_states[k].pending_scale == 1 / (3 * 0.2) for k in range(4))
    # Round 2's reporters, settled with D^2, minus their δ at the start of round 2 (client 3: 0) is
    # Σ_k (D_k − D^2)/(η τ) = 0 over the round's reporters.
    view = fedgate.ClientView(run.server.params, run.server.mean_change)
    own_terms = [fedgate.settled_correction(view, run.client_states[k]) for k in (0, 1, 3)]
    first = run_quadratic(
        build_algorithm("fedgate"), problem, initial, 1, steps=3, learning_rate=0.2, participants=lambda t: rounds[0]
    )
    first_view = fedgate.ClientView(first.server.params, first.server.mean_change)
    settled_in_round_two = [fedgate.settled_correction(first_view, first.client_states[k]) for k in (0, 1)]
    assert torch.allclose(
        sum(own_terms) - settled_in_round_two[0] - settled_in_round_two[1],
        torch.zeros(3, dtype=F64),
        rtol=0,
        atol=1e-12,
    )
    # client 2 skipped round 2: it would settle with D^2, the latest mean, not D^1 (documented choice)
    assert not torch.equal(run.server.mean_change, first.server.mean_change)


def test_partial_participation_is_not_exact_but_far_closer_than_fedavg() -> None:
    # 5 of 10 clients a round: a client settles with the latest mean, not its own round's (the module's documented
    # choice), so Σ_k δ_k drifts from 0 and the fixed point misses the minimiser; FedAvg misses it by far more.
    problem = heterogeneous_quadratics(num_clients=10)
    initial = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    generator = torch.Generator().manual_seed(0)
    picks = [sorted(torch.randperm(10, generator=generator)[:5].tolist()) for _ in range(400)]
    errors = {}
    for name in ("fedgate", "fedavg"):
        run = run_quadratic(
            build_algorithm(name),
            problem,
            initial,
            400,
            steps=10,
            learning_rate=0.1,
            participants=lambda t: picks[t - 1],
        )
        errors[name] = float(torch.linalg.vector_norm(run.server.params - problem.minimiser()))
    assert 0.05 < errors["fedgate"] < 0.5 * errors["fedavg"], errors


# ---------------------------------------------------------------- full runs


def test_sequential_and_vectorized_backends_agree_to_fp32_rounding() -> None:
    sequential = driftlab.run({**TINY, "algorithm": {"name": "fedgate"}, "backend": "sequential"})
    vectorized = driftlab.run({**TINY, "algorithm": {"name": "fedgate"}, "backend": "vectorized"})
    assert torch.allclose(sequential.final_params, vectorized.final_params, rtol=1e-4, atol=1e-5)
    assert not torch.equal(
        sequential.final_params, driftlab.run({**TINY, "algorithm": {"name": "fedavg"}}).final_params
    )


def test_traffic_is_one_model_up_and_two_down_and_compression_shrinks_the_upload() -> None:
    plain = driftlab.run({**TINY, "algorithm": {"name": "fedgate"}})
    model_bits = 32 * plain.num_parameters
    for record in plain.records:
        assert record["upload_bits"] == model_bits * record["num_reporting"]
        assert record["download_bits"] == 2 * model_bits * record["num_selected"]
    compressed = driftlab.run({**TINY, "algorithm": {"name": "fedgate"}, "compression": {"ratio": 0.2}})
    assert all(c["upload_bits"] < p["upload_bits"] for c, p in zip(compressed.records, plain.records, strict=True))
    assert torch.isfinite(compressed.final_params).all()
    assert not torch.equal(compressed.final_params, plain.final_params)


@pytest.mark.parametrize("override", ["algorithm.gamma=0.5", "algorithm.name=fedgate2"])
def test_unknown_settings_are_config_errors_naming_the_key(override: str) -> None:
    key = override.split("=")[0] if "gamma" in override else "algorithm"
    with pytest.raises(driftlab.ConfigError, match=key.replace(".", r"\.")):
        driftlab.run(None, overrides=["rounds=1", "data.num_clients=4", "algorithm.name=fedgate", override])


def test_asynchronous_is_refused_with_the_reason_and_a_fix() -> None:
    algorithm = sgd_fedgate()
    assert algorithm.asynchronous is False and "Σ_k δ_k = 0" in algorithm.asynchronous_refusal
    problem = algorithm.asynchronous_problem()
    assert problem is not None and any(fix in problem for fix in declarations.FIXES), problem


# ---------------------------------------------------------------- privacy


def test_private_round_divides_the_change_sum_by_the_public_denominator() -> None:
    algorithm = sgd_fedgate()
    server = algorithm.server_init(vector(1, 1))
    view = algorithm.broadcast(server)
    message = fedgate.ClientMessage(vector(3, 1), 1)
    assert torch.equal(algorithm.release.release(view, message), vector(2, 0))
    carrier = algorithm.release.restore(view, None, vector(0, 4))
    assert torch.equal(carrier.params, vector(1, 5)) and carrier.multiplicity == 1
    # Σ changes = (2, 4) over m = 4: mean θ_k = (1.5, 2), D = (−0.5, −1)
    new_server, _ = algorithm.server_update(
        server, [message, carrier], RoundContext(1, 8, 2, 1.0, mean_denominator=4.0)
    )
    assert torch.equal(new_server.params, vector(1.5, 2)) and torch.equal(new_server.mean_change, vector(-0.5, -1))
