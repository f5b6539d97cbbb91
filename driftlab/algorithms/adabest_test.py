"""AdaBest: β = μ = 0 is uniform FedAvg bit for bit, h_k/(t − t'_k), the server's θ̄ and h, β schedules, its limit point."""

from __future__ import annotations

import math

import pytest
import torch

import driftlab
from driftlab.algorithms import adabest
from driftlab.algorithms.shared_test import (
    TINY,
    build_algorithm,
    heterogeneous_quadratics,
    run_quadratic,
    without_wall_time,
)
from driftlab.optim.schedules import ExponentialSchedule
from driftlab.simulation.seam import NO_CORRECTION, ClientContext, ClientUpdate, RoundContext

F64 = torch.float64


def vector(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


@pytest.mark.parametrize(
    "overrides", [(), ("sampling.mode=weighted",), ("client.clip_norm=0.5", "client.weight_decay=0.001")]
)
def test_beta_and_mu_zero_is_uniform_fedavg_bit_for_bit(overrides: tuple[str, ...]) -> None:
    best = driftlab.run({**TINY, "algorithm": {"name": "adabest", "mu": 0.0, "beta": 0.0}}, overrides=list(overrides))
    avg = driftlab.run({**TINY, "algorithm": {"name": "fedavg", "aggregation": "uniform"}}, overrides=list(overrides))
    assert torch.equal(best.final_params, avg.final_params)
    drop = ("drift_norm",)
    assert [
        {k: v for k, v in r.items() if k not in drop} for r in without_wall_time(best.records)
    ] == without_wall_time(avg.records)
    assert all(record["drift_norm"] == 0.0 for record in best.records)


def test_client_drift_is_damped_by_rounds_since_last_report() -> None:
    # h_k = (3, −6) last reported in round 2, reports again in round 5: h_k ← h_k/3 + μ(θ^{t−1} − θ_k)
    # = (1, −2) + 0.5((1, 1) − (0, 3)) = (1.5, −3);  t'_k ← 5.
    algorithm = adabest.build(mu=0.5, beta=0.9)
    server = adabest.ServerState(vector(1, 1), vector(0, 0))
    client = adabest.ClientState(vector(3, -6), 2)
    context = ClientContext(4, 5, 10, 10.0, 10, 5, 0.1)
    view = algorithm.broadcast(server)
    correction = algorithm.client_objective(view, client, context)
    assert torch.equal(correction.linear, vector(-3, 6)) and correction.quadratic is None
    state, message = algorithm.client_finish(view, client, context, ClientUpdate(view.params, vector(0, 3), 5))
    assert torch.equal(state.drift, vector(1.5, -3)) and state.last_round == 5
    assert torch.equal(message.params, vector(0, 3))
    # first participation (t'_k = 0, h_k = 0): only the new term
    first, _ = algorithm.client_finish(
        view, algorithm.client_state_init(vector(1, 1)), context, ClientUpdate(view.params, vector(0, 3), 5)
    )
    assert torch.equal(first.drift, vector(0.5, -1)) and first.last_round == 5
    assert adabest.build(mu=0.0, beta=0.5).client_objective(view, client, context) is NO_CORRECTION


def test_server_step_with_a_beta_schedule() -> None:
    # β_t = 0.8 · 0.5^(t−1): β_3 = 0.2.  θ̄^{t−1} = (1, 1); clients (0, 2) and (2, 4): θ̄^t = (1, 3);
    # h^t = 0.2 ((1,1) − (1,3)) = (0, −0.4);  θ^t = θ̄^t − h^t = (1, 3.4).
    algorithm = adabest.build(mu=0.1, beta=ExponentialSchedule(initial=0.8, decay=0.5))
    server = adabest.ServerState(vector(5, 5), vector(1, 1))
    messages = [adabest.ClientMessage(vector(0, 2), 1, 1), adabest.ClientMessage(vector(2, 4), 3, 1)]
    server, metrics = algorithm.server_update(server, messages, RoundContext(3, 100, 2, 1.0))
    assert torch.allclose(server.params, vector(1, 3.4), rtol=1e-15)
    assert torch.equal(server.client_average, vector(1, 3))
    assert metrics["drift_norm"] == pytest.approx(0.4, rel=1e-15)
    # weighted aggregation: θ̄ = ¼(0,2) + ¾(2,4) = (1.5, 3.5)
    weighted = adabest.build(mu=0.1, beta=0.0, aggregation="weighted")
    server, _ = weighted.server_update(
        adabest.ServerState(vector(5, 5), vector(1, 1)), messages, RoundContext(3, 100, 2, 1.0)
    )
    assert torch.equal(server.params, vector(1.5, 3.5))


def test_limit_point_is_the_proximal_point_anchored_at_the_initial_model() -> None:
    # Module docstring: with full participation and constant β < 1, mean_k h_k^t telescopes to
    # μ[(θ̄^0 − θ̄^t) − β(θ̄^0 − θ̄^{t−1})], and at a fixed point ∇f_k(θ) = h_k for every k, so
    #     ∇F(θ^∞) = μ(1 − β)(θ^0 − θ^∞)   ⇔   θ^∞ = (Ā + μ(1−β) I)^{-1} (b̄ + μ(1−β) θ^0)   (diagonal Ā).
    problem = heterogeneous_quadratics()
    initial = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    mu, beta = 0.1, 0.5
    run = run_quadratic(
        build_algorithm("adabest", mu=mu, beta=beta), problem, initial, rounds=1000, steps=10, learning_rate=0.1
    )
    shrink = mu * (1 - beta)
    predicted = (problem.targets.mean(0) + shrink * initial) / (problem.curvatures.mean(0) + shrink)
    assert torch.allclose(run.server.params, predicted, rtol=0, atol=1e-10)
    assert torch.linalg.vector_norm(predicted - problem.minimiser()) > 0.02  # measurably not the global minimiser
    assert run.metrics[-1]["drift_norm"] < 1e-10  # θ̄ has stopped moving, so h^t → 0
    for k in range(problem.num_clients):
        assert torch.allclose(run.client_states[k].drift, problem.gradient(k, predicted), rtol=0, atol=1e-9)
    # a different starting point gives a different limit: the anchor is θ^0
    other = run_quadratic(
        build_algorithm("adabest", mu=mu, beta=beta),
        problem,
        torch.zeros(3, dtype=F64),
        rounds=1000,
        steps=10,
        learning_rate=0.1,
    )
    assert torch.allclose(
        other.server.params, problem.targets.mean(0) / (problem.curvatures.mean(0) + shrink), rtol=0, atol=1e-10
    )


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"name": "adabest", "mu": -0.1}, r"algorithm\.mu: Input should be greater than or equal to 0"),
        ({"name": "adabest", "beta": 1.5}, r"algorithm\.beta: must be in \[0, 1\]"),
        ({"name": "adabest", "beta": -0.5}, r"algorithm\.beta: must be in \[0, 1\]"),
        (
            {"name": "adabest", "beta": {"kind": "exponential", "initial": 2.0, "decay": 0.9}},
            r"algorithm\.beta: an exponential β schedule must start in \[0, 1\]",
        ),
        (
            {"name": "adabest", "beta": {"kind": "inverse_time", "a": 5.0, "b": 1}},
            r"algorithm\.beta: an inverse_time β schedule must stay ≤ 1",
        ),
        ({"name": "adabest", "beta": "high"}, r"algorithm\.beta: expected a number in \[0, 1\] or a schedule table"),
    ],
)
def test_out_of_range_hyperparameters_are_rejected_with_the_key(algorithm: dict, message: str) -> None:
    with pytest.raises(driftlab.ConfigError, match=message):
        driftlab.load_config({"algorithm": algorithm})


def test_beta_schedule_round_trips_through_the_config() -> None:
    config = driftlab.load_config(
        {"algorithm": {"name": "adabest"}}, ["algorithm.beta={kind='exponential', initial=0.98, decay=0.99}"]
    )
    assert config.algorithm.beta == ExponentialSchedule(initial=0.98, decay=0.99)
    assert driftlab.load_config(config.to_dict()).fingerprint() == config.fingerprint()
    assert driftlab.load_config({"algorithm": {"name": "adabest", "beta": 1}}).algorithm.beta == 1.0


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).
#
# AdaBest (μ = 1, β = 0.5, uniform).  Round 1 as FedAvg's clients: θ_0 = (1.5,0), θ_1 = (0,3);
#   h_0 = μ(θ^0 − θ_0) = (−1.5,0), h_1 = (0,−3); θ̄^1 = (0.75,1.5); h^1 = β(θ̄^0 − θ̄^1) =
#   (−0.375,−0.75); θ^1 = θ̄^1 − h^1 = (1.125,2.25).  Round 2: client 0, −h_0 = (1.5,0):
#   → (0.8125,1.125) → (0.65625,0.5625); client 1, −h_1 = (0,3): → (0.5625,1.625)
#   → (0.28125,1.3125).  θ̄^2 = (0.46875,0.9375); h^2 = 0.5(0.28125,0.5625) = (0.140625,0.28125);
#   θ^2 = (0.328125, 0.65625); h_0 = (−1.5,0) + (0.46875,1.6875) = (−1.03125,1.6875),
#   h_1 = (0,−3) + (0.84375,0.9375) = (0.84375,−2.0625).
HAND_CASE = {
    "config": {"mu": 1.0, "beta": 0.5},
    "params": [(1.125, 2.25), (0.328125, 0.65625)],
    "drift": [0.375 * math.sqrt(5), 0.140625 * math.sqrt(5)],
}


def test_adabest_private_round_with_beta_zero_returns_the_mean_of_changes_over_the_denominator():
    algorithm = adabest.build(mu=0.0, beta=0.0)
    server = algorithm.server_init(vector(2.0, 2.0))
    messages = [adabest.ClientMessage(vector(4.0, 2.0), 5, 1), adabest.ClientMessage(vector(2.0, 6.0), 7, 1)]
    new_server, metrics = algorithm.server_update(server, messages, RoundContext(1, 10, 2, 1.0, mean_denominator=8.0))
    # θ̄ = (2, 2) + ((2, 0) + (0, 4))/8 = (2.25, 2.5); β = 0: θ = θ̄ itself
    assert torch.equal(new_server.params, vector(2.25, 2.5)) and new_server.params is new_server.client_average
    assert metrics == {"drift_norm": 0.0}
    refused = adabest.build(aggregation="weighted")
    assert refused.release is None and 'set algorithm.aggregation = "uniform"' in refused.release_refusal


# ---------------------------------------------------------------- β's decay when ‖h‖ plateaus


def test_beta_decays_when_the_server_drift_norm_plateaus_by_hand() -> None:
    # β = 0.5, factor 0.5, patience 1, threshold 0; θ̄^0 = 0, one client per round moves θ̄ by −d_t, h^t = β_t d_t:
    #   round 1: d = 1, n = 0.5, not below n_0 = 0: test off;          θ^1 = −1 − 0.5 = −1.5
    #   round 2: d = 2, n = 1, not below 0.5: ‖h‖ still growing, off;  θ^2 = −3 − 1 = −4
    #   round 3: d = 1, n = 0.5 < 1: on; 0.5 < b = ∞: b = 0.5, c = 0;   θ^3 = −4.5
    #   round 4: n = 0.5, not below b: c = 1 (≤ patience);               θ^4 = −5.5
    #   round 5: n = 0.5, c would be 2 > 1: s = 0.5, c = 0;              θ^5 = −6.5
    #   round 6: β_6 = 0.25, n = 0.25 < 0.5: b = 0.25;                   θ^6 = −7 − 0.25 = −7.25
    algorithm = adabest.build(mu=0.1, beta=0.5, beta_plateau={"factor": 0.5, "patience": 1, "threshold": 0.0})
    server = algorithm.server_init(vector(0.0))
    expected = [
        (1.0, -1.5, 0.5, 0.5, adabest.PlateauState(1.0, math.inf, 0, 0.5, False)),
        (2.0, -4.0, 1.0, 0.5, adabest.PlateauState(1.0, math.inf, 0, 1.0, False)),
        (1.0, -4.5, 0.5, 0.5, adabest.PlateauState(1.0, 0.5, 0, 0.5, True)),
        (1.0, -5.5, 0.5, 0.5, adabest.PlateauState(1.0, 0.5, 1, 0.5, True)),
        (1.0, -6.5, 0.5, 0.5, adabest.PlateauState(0.5, 0.5, 0, 0.5, True)),
        (1.0, -7.25, 0.25, 0.25, adabest.PlateauState(0.5, 0.25, 0, 0.25, True)),
    ]
    average = 0.0
    for t, (step, params, drift_norm, beta_t, plateau) in enumerate(expected, start=1):
        average -= step
        message = adabest.ClientMessage(vector(average), 1, 1)
        server, metrics = algorithm.server_update(server, [message], RoundContext(t, 10, 1, 1.0))
        assert torch.equal(server.params, vector(params)) and torch.equal(server.client_average, vector(average))
        assert metrics == {"drift_norm": drift_norm, "beta": beta_t}
        assert server.plateau == plateau


def test_plateau_step_waits_for_the_first_fall_then_counts_only_relative_improvements() -> None:
    rule = adabest.BetaPlateau(factor=0.1, patience=2, threshold=0.1)
    growing = adabest.plateau_step(adabest.PlateauState(), rule, 0.3)
    assert growing == adabest.PlateauState(1.0, math.inf, 0, 0.3, False)
    assert adabest.plateau_step(growing, rule, 0.4) == adabest.PlateauState(1.0, math.inf, 0, 0.4, False)
    state = adabest.PlateauState(1.0, 1.0, 0, 1.0, True)
    assert adabest.plateau_step(state, rule, 0.95) == adabest.PlateauState(1.0, 1.0, 1, 0.95, True)  # not 10% lower
    assert adabest.plateau_step(state, rule, 0.85) == adabest.PlateauState(1.0, 0.85, 0, 0.85, True)
    worn = adabest.plateau_step(adabest.PlateauState(1.0, 1.0, 2, 1.0, True), rule, 1.0)
    assert worn == adabest.PlateauState(0.1, 1.0, 0, 1.0, True)  # the third round without improvement decays β


def test_beta_plateau_is_off_by_default_and_round_trips_through_the_config() -> None:
    default = driftlab.load_config({"algorithm": {"name": "adabest"}})
    assert default.algorithm.beta_plateau is None and "beta_plateau" not in default.to_dict()["algorithm"]
    assert adabest.build().server_init(vector(1.0)).plateau is None
    config = driftlab.load_config(
        {"algorithm": {"name": "adabest"}}, ["algorithm.beta_plateau={factor=0.5, patience=3, threshold=0.01}"]
    )
    assert config.algorithm.beta_plateau == adabest.BetaPlateau(factor=0.5, patience=3, threshold=0.01)
    assert driftlab.load_config(config.to_dict()).fingerprint() == config.fingerprint() != default.fingerprint()
    with pytest.raises(driftlab.ConfigError, match=r"algorithm\.beta_plateau\.factor"):
        driftlab.load_config({"algorithm": {"name": "adabest", "beta_plateau": {"factor": 1.5}}})


def test_a_run_with_beta_plateau_reports_the_beta_it_used_and_its_state_checkpoints() -> None:
    from driftlab.simulation.state.checkpoint import state_from_tensors, state_to_tensors

    rule = {"factor": 0.5, "patience": 0, "threshold": 0.5}  # decays unless ‖h‖ halves every round
    result = driftlab.run({**TINY, "algorithm": {"name": "adabest", "beta": 0.9, "beta_plateau": rule}})
    betas = [record["beta"] for record in result.records if "beta" in record]
    assert betas and betas[0] == 0.9 and all(b in {0.9 * 0.5**k for k in range(len(betas))} for b in betas)
    assert all(later <= earlier for earlier, later in zip(betas[:-1], betas[1:], strict=True))
    state = adabest.ServerState(vector(1.0), vector(2.0), adabest.PlateauState(0.5, math.inf, 3, 0.25, True))
    tensors = state_to_tensors(state, "server")
    template = adabest.ServerState(vector(0.0), vector(0.0), adabest.PlateauState())
    assert state_from_tensors(template, tensors, "server", torch.device("cpu")) == state
    # a checkpoint written before beta_plateau existed restores into a run without it
    old = state_to_tensors(adabest.ServerState(vector(1.0), vector(2.0)), "server")
    assert (
        state_from_tensors(adabest.ServerState(vector(0.0), vector(0.0)), old, "server", torch.device("cpu")).plateau
        is None
    )
