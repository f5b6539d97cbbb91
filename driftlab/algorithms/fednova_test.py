"""FedNova: the normaliser a_k, hand-computed rounds, FedAvg at equal steps (bit for bit), the objective-inconsistency
fixed points on quadratics, both backends, compression and bad input."""

from __future__ import annotations

import pytest
import torch

import driftlab
from driftlab.algorithms import fednova
from driftlab.algorithms.shared_test import TINY, Quadratics, build_algorithm, heterogeneous_quadratics, run_quadratic
from driftlab.errors import ConfigError
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.local_training import LocalSettings, corrected_step
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate, RoundContext

F64 = torch.float64


def vector(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- the normaliser a_k


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("steps", [0, 1, 2, 7])
def test_normaliser_is_the_papers_closed_form(steps: int, momentum: float) -> None:
    # ‖a_k‖₁ = [τ − ρ(1 − ρ^τ)/(1 − ρ)]/(1 − ρ); τ for ρ = 0.
    closed = (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)
    assert fednova.normaliser(steps, momentum) == pytest.approx(closed, rel=1e-14, abs=1e-14)


def test_normaliser_by_hand() -> None:
    assert fednova.normaliser(4, 0.0) == 4.0
    assert fednova.normaliser(3, 0.5) == 1 + 1.5 + 1.75


# ---------------------------------------------------------------- rounds by hand


def hand_round(
    algorithm: Algorithm, steps: list[int], sizes: list[int], momentum: float = 0.0
) -> tuple[fednova.ServerState, dict[str, float]]:
    """Clients f_k = ½‖θ − b_k‖², b_0 = (2, 0), b_1 = (0, 4), θ^0 = 0, η_l = 0.5, client k doing ``steps[k]`` steps."""
    targets = [vector(2, 0), vector(0, 4)]
    server = algorithm.server_init(vector(0, 0))
    messages = []
    for client in range(2):
        context = ClientContext(client, 1, sizes[client], 2.0, 4, max(steps), 0.5, available_steps=steps[client])
        view = algorithm.broadcast(server)
        objective = algorithm.client_objective(view, None, context)
        theta = view.params
        if momentum == 0:
            for _ in range(steps[client]):
                theta = corrected_step(theta, theta - targets[client], objective, LocalSettings(0.5))
        else:
            state = objective.local_step.initial_state
            for _ in range(steps[client]):
                theta, state = objective.local_step.function(theta, theta - targets[client], state, 0.5)
        _, message = algorithm.client_finish(view, None, context, ClientUpdate(view.params, theta, steps[client]))
        messages.append(message)
    return algorithm.server_update(server, messages, RoundContext(1, 4, 2, 1.0))


def test_heterogeneous_steps_by_hand() -> None:
    # Client 0 (n = 1) does 1 step: θ_0 = (1, 0), a_0 = 1; client 1 (n = 3) does 2: (0, 2) → (0, 3), a_1 = 2.
    # p = (¼, ¾); d_0 = (−1, 0), d_1 = (0, −3)/2; τ_eff = ¼·1 + ¾·2 = 1.75;
    # θ^1 = −τ_eff Σ p_k d_k = 1.75·(0.25, 1.125) = (0.4375, 1.96875).  FedAvg (keep) would give (0.25, 2.25).
    server, metrics = hand_round(build_algorithm("fednova"), steps=[1, 2], sizes=[1, 3])
    assert torch.allclose(server.params, vector(0.4375, 1.96875), rtol=0, atol=1e-15)
    assert metrics["effective_steps"] == 1.75
    # uniform p = (½, ½): τ_eff = 1.5, θ^1 = 1.5·(0.5, 0.75) = (0.75, 1.125)
    server, metrics = hand_round(build_algorithm("fednova", aggregation="uniform"), steps=[1, 2], sizes=[1, 3])
    assert torch.allclose(server.params, vector(0.75, 1.125), rtol=0, atol=1e-15)
    assert metrics["effective_steps"] == 1.5


def test_local_momentum_by_hand() -> None:
    # ρ = 0.5, uniform.  Client 0, 2 steps: g = (−2, 0), v = (−2, 0), θ = (1, 0); g = (−1, 0), v = (−2, 0), θ = (2, 0);
    # a_0 = 1 + 1.5 = 2.5.  Client 1, 1 step: v = (0, −4), θ = (0, 2); a_1 = 1.
    # d = (−0.8, 0), (0, −2); τ_eff = 1.75; θ^1 = 1.75·½(0.8, 2) = (0.7, 1.75).
    server, metrics = hand_round(
        build_algorithm("fednova", aggregation="uniform", momentum=0.5), steps=[2, 1], sizes=[1, 3], momentum=0.5
    )
    assert torch.allclose(server.params, vector(0.7, 1.75), rtol=0, atol=1e-15)
    assert metrics["effective_steps"] == pytest.approx(1.75, rel=1e-15)


def test_a_client_that_did_no_step_counts_in_the_weights_only() -> None:
    # Client 0 did 0 steps (θ_0 = θ), client 1 one step to (0, 2): p = (¼, ¾) still, τ_eff = ¾·1,
    # θ^1 = τ_eff·¾·(0, 2)/1 = (0, 1.125).  Nobody moving leaves θ as it is.
    server, metrics = hand_round(build_algorithm("fednova"), steps=[0, 1], sizes=[1, 3])
    assert torch.equal(server.params, vector(0, 1.125)) and metrics["effective_steps"] == 0.75
    server, metrics = hand_round(build_algorithm("fednova"), steps=[0, 0], sizes=[1, 3])
    assert torch.equal(server.params, vector(0, 0)) and metrics["effective_steps"] == 0.0


def test_server_optimizer_steps_on_the_normalised_pseudo_gradient() -> None:
    # The heterogeneous round above has q = (−0.4375, −1.96875); SGD at η_g = 0.5 moves half of it.
    algorithm = fednova.build(make_server_optimizer("sgd"))
    server = algorithm.server_init(vector(0, 0))
    messages = [fednova.ClientMessage(vector(1, 0), 1, 1, 1), fednova.ClientMessage(vector(0, 3), 2, 3, 1)]
    new_server, _ = algorithm.server_update(server, messages, RoundContext(1, 4, 2, 0.5))
    assert torch.allclose(new_server.params, vector(0.21875, 0.984375), rtol=0, atol=1e-15)


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).
# Both clients do K = 2 steps, so a_k = 2 = τ_eff and FedNova is weighted FedAvg bit for bit: fedavg_test's
# numbers, θ^1 = (0.375, 2.25), θ^2 = (0.46875, 2.8125).
HAND_CASE = {
    "config": {},
    "params": [(0.375, 2.25), (0.46875, 2.8125)],
    "drift": None,
    "metrics": [{"effective_steps": 2.0}, {"effective_steps": 2.0}],
}


# ---------------------------------------------------------------- equal steps: FedAvg bit for bit


@pytest.mark.parametrize("aggregation", ["weighted", "uniform"])
def test_equal_steps_is_fedavg_bit_for_bit_on_quadratics(aggregation: str) -> None:
    problem = heterogeneous_quadratics()
    initial = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    sizes = [3, 7, 1, 5, 11]
    runs = [
        run_quadratic(
            build_algorithm(name, aggregation=aggregation),
            problem,
            initial,
            rounds=30,
            steps=7,
            learning_rate=0.1,
            participants=lambda t: [(t + j) % 5 for j in range(3)],
            num_samples=sizes,
        )
        for name in ("fedavg", "fednova")
    ]
    assert torch.equal(runs[0].server.params, runs[1].server.params)
    assert all(metrics["effective_steps"] == 7.0 for metrics in runs[1].metrics)


FIXED_STEPS = {**TINY, "client": {"steps": 4}, "precision": "float64"}


def test_equal_steps_is_fedavg_bit_for_bit_through_driftlab_run() -> None:
    nova = driftlab.run({**FIXED_STEPS, "algorithm": {"name": "fednova"}})
    avg = driftlab.run({**FIXED_STEPS, "algorithm": {"name": "fedavg"}})
    assert torch.equal(nova.final_params, avg.final_params)
    for ours, theirs in zip(nova.records, avg.records, strict=True):
        assert ours.pop("effective_steps") == 4.0
        assert {k: v for k, v in ours.items() if k != "round_seconds"} == {
            k: v for k, v in theirs.items() if k != "round_seconds"
        }


def test_stragglers_make_fednova_differ_from_fedavg_keeping_their_work() -> None:
    stragglers = {**FIXED_STEPS, "availability": {"incomplete_probability": 0.5}}
    nova = driftlab.run({**stragglers, "algorithm": {"name": "fednova"}})
    keep = driftlab.run({**stragglers, "algorithm": {"name": "fedavg", "incomplete": "keep"}})
    assert sum(record["num_incomplete"] for record in nova.records) > 0
    assert [r["num_reporting"] for r in nova.records] == [
        r["num_reporting"] for r in keep.records
    ]  # both keep the work
    assert not torch.equal(nova.final_params, keep.final_params)
    assert any(record["effective_steps"] < 4.0 for record in nova.records)


# ---------------------------------------------------------------- objective inconsistency on quadratics


def run_heterogeneous(
    algorithm: Algorithm, problem: Quadratics, steps: list[int], sizes: list[int], learning_rate: float, rounds: int
) -> torch.Tensor:
    """Full participation, full-batch GD, client k doing ``steps[k]`` steps every round; the final server model."""
    settings = LocalSettings(learning_rate)
    server = algorithm.server_init(torch.zeros(problem.curvatures.shape[1], dtype=F64))
    mean_size = sum(sizes) / len(sizes)
    for t in range(1, rounds + 1):
        messages = []
        for client in range(problem.num_clients):
            context = ClientContext(
                client, t, sizes[client], mean_size, problem.num_clients, steps[client], learning_rate
            )
            view = algorithm.broadcast(server)
            correction = algorithm.client_objective(view, None, context)
            theta = view.params
            for _ in range(steps[client]):
                theta = corrected_step(theta, problem.gradient(client, theta), correction, settings)
            messages.append(
                algorithm.client_finish(view, None, context, ClientUpdate(view.params, theta, steps[client]))[1]
            )
        server, _ = algorithm.server_update(
            server, messages, RoundContext(t, problem.num_clients, problem.num_clients, 1.0)
        )
    return server.params


def fixed_points(
    problem: Quadratics, steps: list[int], weights: torch.Tensor, learning_rate: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FedAvg's, FedNova's) fixed points: τ_k GD steps map x to x_k* + (1 − η a)^τ_k (x − x_k*) per coordinate, so
    FedAvg stops at Σ p_k φ_k x_k* / Σ p_k φ_k and FedNova at Σ p_k (φ_k/τ_k) x_k* / Σ p_k (φ_k/τ_k)."""
    tau = torch.tensor(steps, dtype=F64)[:, None]
    p = weights[:, None]
    phi = 1 - (1 - learning_rate * problem.curvatures) ** tau
    optima = problem.targets / problem.curvatures
    fedavg = (p * phi * optima).sum(0) / (p * phi).sum(0)
    fednova_ = (p * phi / tau * optima).sum(0) / (p * phi / tau).sum(0)
    return fedavg, fednova_


def test_fednova_reaches_the_minimiser_of_the_weighted_objective_where_fedavg_does_not() -> None:
    problem = heterogeneous_quadratics()
    sizes = [2, 4, 6, 8, 10]
    steps = [1, 2, 3, 4, 5]  # one epoch each: τ_k ∝ n_k, the paper's setting
    p = torch.tensor(sizes, dtype=F64) / sum(sizes)
    minimiser = (p[:, None] * problem.targets).sum(0) / (p[:, None] * problem.curvatures).sum(0)  # argmin Σ p_k f_k
    inconsistent = (p[:, None] * torch.tensor(steps, dtype=F64)[:, None] * problem.targets).sum(0) / (
        p[:, None] * torch.tensor(steps, dtype=F64)[:, None] * problem.curvatures
    ).sum(0)  # argmin Σ p_k τ_k f_k

    learning_rate = 0.01
    avg_point, nova_point = fixed_points(problem, steps, p, learning_rate)
    nova = run_heterogeneous(build_algorithm("fednova"), problem, steps, sizes, learning_rate, rounds=1500)
    avg = run_heterogeneous(
        build_algorithm("fedavg", incomplete="keep"), problem, steps, sizes, learning_rate, rounds=1500
    )
    assert torch.allclose(nova, nova_point, rtol=0, atol=1e-10)
    assert torch.allclose(avg, avg_point, rtol=0, atol=1e-10)
    # FedNova's distance to the true minimiser is O(η) (0.0095 here); FedAvg's tends to that of Σ p_k τ_k f_k's (0.27).
    nova_error = float(torch.linalg.vector_norm(nova - minimiser))
    avg_error = float(torch.linalg.vector_norm(avg - minimiser))
    assert avg_error > 10 * nova_error
    small_avg, small_nova = fixed_points(problem, steps, p, learning_rate / 100)
    assert float(torch.linalg.vector_norm(small_nova - minimiser)) < nova_error / 50
    assert torch.allclose(small_avg, inconsistent, rtol=0, atol=1e-3)
    assert float(torch.linalg.vector_norm(small_avg - minimiser)) > 0.9 * avg_error


def test_one_local_step_is_gradient_descent_and_finds_the_minimiser() -> None:
    problem = heterogeneous_quadratics()
    run = run_quadratic(
        build_algorithm("fednova", aggregation="uniform"),
        problem,
        torch.zeros(3, dtype=F64),
        rounds=400,
        steps=1,
        learning_rate=0.1,
    )
    assert torch.allclose(run.server.params, problem.minimiser(), rtol=0, atol=1e-10)


# ---------------------------------------------------------------- full runs: backends, compression, bad input


MOMENTUM_RUN = {
    **TINY,
    "algorithm": {"name": "fednova", "momentum": 0.9},
    "availability": {"incomplete_probability": 0.5},
}


def test_sequential_and_vectorized_backends_agree_to_rounding() -> None:
    sequential = driftlab.run({**MOMENTUM_RUN, "backend": "sequential"})
    vectorized = driftlab.run({**MOMENTUM_RUN, "backend": "vectorized"})
    assert sum(record["num_incomplete"] for record in sequential.records) > 0
    assert torch.allclose(sequential.final_params, vectorized.final_params, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(sequential.records, vectorized.records, strict=True):
        assert ours["effective_steps"] == theirs["effective_steps"]
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-4)


def test_momentum_changes_the_run() -> None:
    plain = driftlab.run({**TINY, "algorithm": {"name": "fednova"}})
    heavy = driftlab.run({**TINY, "algorithm": {"name": "fednova", "momentum": 0.9}})
    assert not torch.equal(plain.final_params, heavy.final_params)
    # a_k grows faster than τ_k with momentum: the same steps give a larger τ_eff
    assert all(h["effective_steps"] > p["effective_steps"] for h, p in zip(heavy.records, plain.records, strict=True))


def test_compressed_uploads_run_and_cost_less() -> None:
    plain = driftlab.run({**TINY, "algorithm": {"name": "fednova"}})
    compressed = driftlab.run({**TINY, "algorithm": {"name": "fednova"}, "compression": {"ratio": 0.1}})
    assert torch.isfinite(compressed.final_params).all()
    assert not torch.equal(plain.final_params, compressed.final_params)
    assert all(c["upload_bits"] < p["upload_bits"] for c, p in zip(compressed.records, plain.records, strict=True))


@pytest.mark.parametrize(
    "algorithm, words",
    [
        ({"name": "fednova", "momentum": 1.0}, "momentum"),
        ({"name": "fednova", "momentum": -0.1}, "momentum"),
        ({"name": "fednova", "aggregation": "median"}, "aggregation"),
        ({"name": "fednova", "mu": 0.1}, "mu"),
    ],
)
def test_bad_hyperparameters_are_config_errors_before_any_work(algorithm: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        driftlab.load_config({**TINY, "algorithm": algorithm})


def test_build_refuses_bad_values_with_value_errors() -> None:
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        fednova.build(make_server_optimizer("sgd"), momentum=1.0)
    with pytest.raises(ValueError, match="weighted, uniform"):
        fednova.build(make_server_optimizer("sgd"), aggregation="median")


def test_privacy_and_asynchronous_training_are_refused_with_the_fix() -> None:
    for aggregation in ("weighted", "uniform"):
        algorithm = build_algorithm("fednova", aggregation=aggregation)
        assert algorithm.release is None and 'use fedavg with aggregation = "uniform"' in algorithm.release_refusal
        assert not algorithm.asynchronous
        assert "remove [asynchronous]" in algorithm.asynchronous_problem()


def test_a_private_fednova_config_is_refused() -> None:
    private = {
        **TINY,
        "sampling": {"participation": 0.5, "mode": "poisson"},
        "privacy": {"clip": 1.0, "noise_multiplier": 1.0},
    }
    with pytest.raises(ConfigError, match="FedNova scales each client's change by τ_eff/a_k"):
        driftlab.run({**private, "algorithm": {"name": "fednova", "aggregation": "uniform"}})
