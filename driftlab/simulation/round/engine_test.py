"""Engine features: γ-inexact solver, dissimilarity, evaluated models, stragglers, quadratic convergence."""

import dataclasses
import json

import numpy as np
import pytest
import torch

import driftlab
from driftlab.data.quadratic import scalar_quadratic_clients, surrogate_minimizer
from driftlab.experiments.run.runner import build_simulation
from driftlab.simulation import evaluation as evaluation_module
from driftlab.simulation.evaluation import dissimilarity, divergence, evaluate, norm_growth, reference_losses
from driftlab.simulation.round import engine as engine_module
from driftlab.simulation.round.engine import run_round
from driftlab.simulation.round.setup import norm_scale

QUADRATIC = {
    "data": {"name": "quadratic1d", "num_clients": 8},
    "model": {"name": "quadratic"},
    "client": {"lr": 0.1, "batch_size": 1000},
    "sampling": {"participation": 1.0},
    "precision": "float64",
}


def quadratic(**sections):
    config = {key: dict(value) if isinstance(value, dict) else value for key, value in QUADRATIC.items()}
    for key, value in sections.items():
        if isinstance(value, dict):
            config.setdefault(key, {}).update(value)
        else:
            config[key] = value
    return config


def z_and_p(num_clients):
    data = scalar_quadratic_clients(num_clients)
    return np.linspace(1, 3, num_clients), data.client_sizes / data.client_sizes.sum(), data.known_minimizer[0]


def test_fedavg_with_many_local_steps_converges_to_the_surrogate_not_the_minimiser():
    result = driftlab.run(quadratic(rounds=150, client={"steps": 10}, evaluation={"every": 150}))
    z, p, x_star = z_and_p(8)
    surrogate = surrogate_minimizer(z, p, 0.1, 10)
    assert float(result.final_params[0]) == pytest.approx(surrogate, abs=1e-9)
    assert abs(surrogate - x_star) > 0.03  # measurably away from the true minimiser


def test_fedavg_with_one_local_step_converges_to_the_minimiser():
    result = driftlab.run(quadratic(rounds=400, client={"steps": 1}, evaluation={"every": 400}))
    assert result.records[-1]["distance_to_minimizer"] < 1e-9


def test_decaying_local_steps_approach_the_minimiser():
    constant = driftlab.run(quadratic(rounds=120, client={"steps": 10}, evaluation={"every": 120}))
    decaying = driftlab.run(
        quadratic(
            rounds=120,
            client={"steps": {"kind": "exponential", "initial": 10, "decay": 0.95}},
            evaluation={"every": 120},
        )
    )
    assert decaying.records[-1]["distance_to_minimizer"] < 1e-3
    assert decaying.records[-1]["distance_to_minimizer"] < constant.records[-1]["distance_to_minimizer"] / 20
    # K_t = max(1, ⌈10·0.95^(t−1)⌉) steps for each of the 8 clients
    expected = [8 * max(1, int(np.ceil(10 * 0.95 ** (t - 1)))) for t in range(1, 121)]
    assert [r["local_steps"] for r in decaying.records] == expected


def test_inexact_solver_stops_at_the_first_epoch_meeting_the_tolerance():
    # One client f(x) = ½ z x² − x, full-batch GD from x=0: the gradient z x − 1 shrinks by (1 − γ z) per step.
    config = quadratic(
        rounds=1, data={"num_clients": 1}, client={"epochs": 10, "inexact_gamma": 0.5}, evaluation={"every": 1}
    )
    result = driftlab.run(config)
    # z = 1 (the grid has one point at low=1): |1 − 0.1|^s ≤ 0.5  ⇔  s ≥ log 0.5 / log 0.9 = 6.58 → 7 epochs of one step
    assert result.records[0]["local_steps"] == 7
    assert float(result.final_params[0]) == pytest.approx(1 - 0.9**7, abs=1e-12)
    never = driftlab.run(quadratic(rounds=1, data={"num_clients": 1}, client={"epochs": 10, "inexact_gamma": 0.0}))
    assert never.records[0]["local_steps"] == 10


def test_dissimilarity_matches_a_hand_computation():
    sim, state = build_simulation(driftlab.load_config(quadratic(data={"num_clients": 3})))
    z, p, _ = z_and_p(3)
    x = 0.3
    gradients = z * x - 1  # ∇f_i(x) = z_i x − 1
    mean_square = (p * gradients**2).sum()
    global_gradient = (p * gradients).sum()
    metrics = dissimilarity(sim, torch.tensor([x], dtype=torch.float64))
    assert metrics["dissimilarity_b2"] == pytest.approx(mean_square / global_gradient**2, rel=1e-9)
    assert metrics["gradient_variance"] == pytest.approx((p * (gradients - global_gradient) ** 2).sum(), rel=1e-6)


def test_dissimilarity_is_recorded_every_n_rounds():
    result = driftlab.run(quadratic(rounds=4, client={"steps": 2}, evaluation={"dissimilarity_every": 2}))
    assert ["dissimilarity_b2" in r for r in result.records] == [False, True, False, True]


def test_reporting_mean_and_all_clients_mean_are_the_models_evaluated():
    base = {"rounds": 1, "data": {"num_clients": 4}, "sampling": {"participation": 0.5}, "precision": "float64"}
    config = driftlab.load_config(base | {"evaluation": {"model": "all_clients_mean"}})
    sim, state = build_simulation(config)
    state, record = run_round(sim, state, evaluate_after=True)
    trained = dict(state.latest_models.items())
    assert len(trained) == 2
    expected = (sum(trained.values()) + 2 * sim.initial_params) / 4  # the two untrained clients count as θ⁰
    assert record["test_loss"] == pytest.approx(evaluate(sim, expected)["test_loss"], rel=1e-12)

    config = driftlab.load_config(
        base | {"evaluation": {"model": "reporting_mean"}, "algorithm": {"name": "fedavg", "aggregation": "uniform"}}
    )
    sim, state = build_simulation(config)
    state, record = run_round(sim, state, evaluate_after=True)
    # uniform FedAvg's server model is the mean of the reporting clients, so both evaluations agree
    assert record["test_loss"] == pytest.approx(evaluate(sim, state.server.params)["test_loss"], rel=1e-12)


def _six_clients(rounds: int, participation: float, **availability: float) -> dict:
    """A run of 6 synthetic clients under the availability model ``availability`` (its probabilities)."""
    return {
        "rounds": rounds,
        "data": {"num_clients": 6},
        "sampling": {"participation": participation},
        "availability": availability,
    }


def test_fedavg_drops_stragglers_unless_told_to_keep_them():
    base = _six_clients(3, 1.0, incomplete_probability=0.5) | {"client": {"epochs": 3}}
    dropped = driftlab.run(base)
    kept = driftlab.run(base | {"algorithm": {"name": "fedavg", "incomplete": "keep"}})
    for drop_record, keep_record in zip(dropped.records, kept.records, strict=True):
        assert keep_record["num_reporting"] == 6
        assert drop_record["num_reporting"] == 6 - drop_record["num_incomplete"]
        assert drop_record["upload_bits"] == keep_record["upload_bits"] * drop_record["num_reporting"] // 6
    assert sum(r["num_incomplete"] for r in dropped.records) > 0


def test_inactive_clients_send_nothing_but_received_the_model():
    result = driftlab.run(_six_clients(5, 1.0, inactive_probability=0.5))
    for record in result.records:
        assert record["num_reporting"] == 6 - record["num_inactive"]
        assert record["download_bits"] == 6 * 32 * result.num_parameters
        assert record["upload_bits"] == record["num_reporting"] * 32 * result.num_parameters


# ------------------------------------------------------------------ clients joining and leaving

MEMBERSHIP = {
    "rounds": 6,
    "precision": "float64",
    "data": {"num_clients": 10},
    "client": {"steps": 2},
    "sampling": {"participation": 1.0},
    "availability": {
        "initially_registered": 5,
        "events": [{"round": 3, "join_range": [5, 10]}, {"round": 5, "leave": [0, 1, 2]}],
    },
}


def test_only_registered_clients_are_sampled_and_n_follows_the_registered_set():
    result = driftlab.run(MEMBERSHIP)
    assert [r["reporting_clients"] for r in result.records] == [
        [0, 1, 2, 3, 4],
        [0, 1, 2, 3, 4],
        list(range(10)),
        list(range(10)),
        [3, 4, 5, 6, 7, 8, 9],
        [3, 4, 5, 6, 7, 8, 9],
    ]


def test_feddyn_mean_of_lambda_runs_over_the_current_registered_set():
    config = driftlab.load_config(MEMBERSHIP | {"algorithm": {"name": "feddyn", "alpha": 0.1}})
    sim, state = build_simulation(config)
    for _ in range(6):
        state, record = run_round(sim, state)
        registered = sim.registered_at(state.round).tolist()
        duals = dict(state.clients.items())
        expected = sum((duals[c].dual for c in registered if c in duals), torch.zeros_like(sim.initial_params))
        torch.testing.assert_close(state.server.dual_sum, expected, rtol=0, atol=1e-12)
        assert record["drift_norm"] == pytest.approx(
            float(torch.linalg.vector_norm(expected / len(registered))), rel=1e-12
        )


def test_resume_across_membership_changes_is_exact(tmp_path):
    config = MEMBERSHIP | {"algorithm": {"name": "feddyn", "alpha": 0.1}, "checkpoint_every": 1}
    straight = driftlab.run(config)
    driftlab.run(config | {"rounds": 4}, tmp_path / "run")
    resumed = driftlab.run(config, tmp_path / "run", resume=True)
    assert torch.equal(straight.final_params, resumed.final_params)
    strip = lambda records: [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]  # noqa: E731
    assert strip(straight.records) == strip(resumed.records)


def test_membership_naming_a_missing_client_is_a_config_error():
    bad = MEMBERSHIP | {"availability": {"events": [{"round": 2, "join": [12]}]}}
    with pytest.raises(driftlab.ConfigError, match="client 12 does not exist"):
        driftlab.run(bad)


# ------------------------------------------------------------------ augmentation through the engine


def _image_simulation(backend_name: str, augment: bool):
    import numpy as np

    from driftlab.algorithms import fedavg
    from driftlab.data.federated import FederatedDataset
    from driftlab.experiments.run.runner import BACKENDS
    from driftlab.optim.server import make_server_optimizer
    from driftlab.simulation.round.setup import Simulation, SimulationState
    from driftlab.simulation.state.state_store import InMemoryClientStore
    from driftlab.simulation.testing import seeded_model, small_plan

    generator = torch.Generator().manual_seed(0)
    images = torch.randn(40, 3, 8, 8, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (40,), generator=generator)
    data = FederatedDataset(
        "images", images, labels, images[:10], labels[:10], tuple(np.arange(i * 10, i * 10 + 10) for i in range(4)), 3
    )
    model = seeded_model("mlp", (3, 8, 8), hidden=(16,))
    theta = model.initial_parameters()
    plan = small_plan(augment=augment)
    algorithm = fedavg.build(make_server_optimizer("sgd"))
    sim = Simulation(model, data, algorithm, BACKENDS[backend_name](), plan, torch.device("cpu"), torch.float64, theta)
    return sim, SimulationState(0, algorithm.server_init(theta), InMemoryClientStore(None))


def _two_rounds(backend_name: str, augment: bool) -> torch.Tensor:
    sim, state = _image_simulation(backend_name, augment)
    for _ in range(2):
        state, _ = run_round(sim, state)
    return state.server.params


def test_augmented_training_is_the_same_on_both_backends_and_repeatable():
    sequential = _two_rounds("sequential", augment=True)
    vectorized = _two_rounds("vectorized", augment=True)
    torch.testing.assert_close(sequential, vectorized, rtol=0, atol=1e-12)
    assert torch.equal(sequential, _two_rounds("sequential", augment=True))
    assert (sequential - _two_rounds("sequential", augment=False)).abs().max() > 1e-3


def test_augmentation_of_non_image_data_is_a_config_error():
    with pytest.raises(driftlab.ConfigError, match="data.augment needs image inputs"):
        driftlab.run({"rounds": 1, "data": {"augment": True}})


# ------------------------------------------------------------------ divergence


def test_divergence_names_every_non_finite_number_of_a_record():
    healthy = {"round": 3, "model_norm": 12.5, "test_loss": 0.4, "reporting_clients": [1, 2], "dissimilarity_b2": None}
    assert divergence(healthy, {"test_loss": 2.3, "train_loss": 2.3}, 1000.0) is None
    problem = divergence(healthy | {"model_norm": float("inf"), "test_loss": float("nan")}, None, 0.0)
    assert problem.startswith("non-finite values model_norm=inf, test_loss=nan;") and "lower client.lr" in problem
    assert "drift_norm=[1.0, -inf]" in divergence(healthy | {"drift_norm": [1.0, float("-inf")]}, None, 0.0)


def test_divergence_compares_evaluated_losses_with_the_initial_models():
    initial = {"train_loss": 2.0, "test_loss": 2.5}
    problem = divergence({"round": 1, "train_loss": 2500.0, "test_loss": 2000.0}, initial, 1000.0)
    assert problem.startswith(
        "train_loss is 2500, 1.25e+03 times the initial model's 2 (more than evaluation.divergence_factor=1000)"
    )
    assert "raise evaluation.divergence_factor (0 = off)" in problem
    assert divergence({"round": 1, "train_loss": 1999.0, "test_loss": 2499.0}, initial, 1000.0) is None
    assert divergence({"round": 1, "train_loss": 2500.0}, initial, 0.0) is None  # 0: the loss test is off
    assert divergence({"round": 1}, initial, 1000.0) is None  # rounds without evaluation have no loss to compare
    # an objective that starts at 0 or below (the quadratic clients') has no scale to compare with
    assert divergence({"round": 1, "train_loss": 1e300}, {"train_loss": 0.0, "test_loss": -1.0}, 1000.0) is None


def test_the_norm_test_compares_with_the_starting_scale_floored_at_parameters_of_size_1():
    assert norm_scale(torch.zeros(4)) == 2.0  # √4: a model that starts at 0 (the quadratic clients' x⁰)
    assert norm_scale(torch.full((4,), 3.0)) == 6.0  # its own norm when that is larger
    assert norm_growth(2000.0, 2.0, 1000.0) is None  # at most the factor: healthy
    problem = norm_growth(2002.0, 2.0, 1000.0)
    assert problem.startswith(
        "model_norm is 2002, 1e+03 times the model's starting scale 2 (the larger of the initial model's norm and √(number of parameters)), "
        "more than evaluation.norm_growth_factor=1000; lower client.lr"
    )
    assert problem.endswith("or raise evaluation.norm_growth_factor (0 = off) if so large a model is expected")
    assert norm_growth(1e300, 2.0, 0.0) is None  # 0: off


def test_the_norm_test_runs_in_rounds_without_evaluation():
    # GD with step 0.9 on curvatures in [1, 3] from x⁰ = 0, 10 steps a round: |x| passes 1000 = 1000·√1 in round 3.
    config = driftlab.load_config("quadratic-constant-k", ["client.lr=0.9", "evaluation.every=100"])
    sim, state = build_simulation(config)
    assert sim.norm_scale == 1.0
    for _ in range(2):
        state, record = run_round(sim, state, evaluate_after=False)
        assert "train_loss" not in record and record["model_norm"] <= 1000
    with pytest.raises(FloatingPointError, match=r"^the run diverged in round 3: model_norm is 1816, 1\.82e\+03 times"):
        run_round(sim, state, evaluate_after=False, commit=False)
    unchecked, _ = build_simulation(
        driftlab.load_config("quadratic-constant-k", ["client.lr=0.9", "evaluation.norm_growth_factor=0"])
    )
    assert unchecked.evaluation.norm_growth_factor == 0.0 and sim.evaluation.norm_growth_factor == 1000.0


def test_a_round_whose_loss_overflows_raises_and_returns_no_record():
    # 25 GD steps of size 1e5 on curvatures in [1, 3]: |x| grows ~(3e5)^25 ≈ 1e137 per round; x stays finite in round 2, ½ z x² does not
    # (the norm test, which stops this run in round 1, is off: this is the finiteness test)
    config = driftlab.load_config(
        quadratic(
            rounds=3,
            backend="sequential",
            data={"num_clients": 2},
            client={"lr": 1e5, "steps": 25},
            evaluation={"norm_growth_factor": 0},
        )
    )
    sim, state = build_simulation(config)
    state, record = run_round(sim, state, evaluate_after=True)
    assert record["round"] == 1 and np.isfinite(record["test_loss"])
    with pytest.raises(
        FloatingPointError,
        match=r"^the run diverged in round 2: non-finite values test_loss=inf, train_loss=inf; lower client.lr",
    ):
        run_round(sim, state, evaluate_after=True, commit=False)
    assert torch.isfinite(state.server.params).all()


@pytest.mark.slow
def test_the_loss_reference_is_the_initial_model_and_computing_it_changes_no_result():
    base = {"rounds": 3, "data": {"num_clients": 4}, "client": {"steps": 2}, "sampling": {"participation": 0.5}}
    sim, _ = build_simulation(driftlab.load_config(base))
    metrics = evaluate(sim, sim.initial_params)
    assert reference_losses(sim) == {"test_loss": metrics["test_loss"], "train_loss": metrics["train_loss"]}
    checked = driftlab.run(base)
    unchecked = driftlab.run(base | {"evaluation": {"divergence_factor": 0}})
    assert torch.equal(checked.final_params, unchecked.final_params)
    strip = lambda records: [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]  # noqa: E731
    assert strip(checked.records) == strip(unchecked.records)


def test_dissimilarity_is_none_where_the_global_gradient_vanishes():
    # one client f(x) = ½ x² − x (z = 1): the gradient x − 1 vanishes at x = 1, where B(θ)² = 0/0
    sim, _ = build_simulation(driftlab.load_config(quadratic(data={"num_clients": 1})))
    metrics = dissimilarity(sim, torch.tensor([1.0], dtype=torch.float64))
    assert metrics == {"dissimilarity_b2": None, "gradient_variance": 0.0}


def test_train_loss_is_over_a_fixed_seeded_sample_of_clients_unless_all_are_asked_for():
    base = {"data": {"num_clients": 12}, "precision": "float64"}
    sampled, _ = build_simulation(driftlab.load_config(base | {"evaluation": {"train_loss_clients": 3}}))
    again, _ = build_simulation(driftlab.load_config(base | {"evaluation": {"train_loss_clients": 3}}))
    every, _ = build_simulation(driftlab.load_config(base | {"evaluation": {"train_loss_clients": 0}}))
    more, _ = build_simulation(driftlab.load_config(base | {"evaluation": {"train_loss_clients": 100}}))
    assert torch.equal(sampled.train_loss_rows, again.train_loss_rows)
    assert torch.equal(every.train_loss_rows, every.union_rows) and torch.equal(more.train_loss_rows, more.union_rows)
    chosen = [k for k, rows in enumerate(sampled.client_rows) if bool(torch.isin(rows, sampled.train_loss_rows).all())]
    assert len(chosen) == 3 and len(sampled.train_loss_rows) == sum(len(sampled.client_rows[k]) for k in chosen)
    params = sampled.initial_params
    total, _ = evaluation_module._loss_and_correct(
        sampled.model, params, sampled.training_data, sampled.train_loss_rows, 4096
    )
    assert evaluate(sampled, params)["train_loss"] == pytest.approx(total / len(sampled.train_loss_rows), rel=1e-12)
    assert evaluate(every, params)["train_loss"] != evaluate(sampled, params)["train_loss"]


def test_a_round_stages_each_client_state_as_its_client_finishes():
    # The states go to the store as clients finish, not in a list kept until the round ends.
    import dataclasses

    config = driftlab.load_config(
        {"rounds": 1, "data": {"num_clients": 6}, "algorithm": {"name": "scaffold"}, "state": {"store": "memory"}}
    )
    sim, state = build_simulation(config)
    staged_when_finishing = []
    finish = sim.algorithm.client_finish

    def watching_finish(*args):
        staged_when_finishing.append(len(state.clients._staged))
        return finish(*args)

    sim.algorithm = dataclasses.replace(sim.algorithm, client_finish=watching_finish)
    state, record = run_round(sim, state, evaluate_after=False)
    assert staged_when_finishing == list(range(record["num_reporting"]))
    assert [c for c, _ in state.clients.items()] == sorted(record["reporting_clients"])


def test_state_store_auto_goes_to_disk_beyond_the_memory_budget(tmp_path):
    from driftlab.simulation.state.state_store import DiskClientStore, InMemoryClientStore

    base = {"data": {"num_clients": 6}, "algorithm": {"name": "scaffold"}, "state": {"store": "auto"}}
    _, small = build_simulation(driftlab.load_config(base))
    _, large = build_simulation(driftlab.load_config(base | {"memory_budget": 100}), state_dir=tmp_path)
    assert isinstance(small.clients, InMemoryClientStore) and isinstance(large.clients, DiskClientStore)
    assert large.clients.directory == tmp_path / "clients"


def test_the_reporting_mean_does_not_depend_on_the_order_clients_finish_in(monkeypatch):
    import driftlab
    from driftlab.experiments.run import runner as runner_module

    class Reversed:
        """Yields the inner backend's clients in reverse, as parallel chunks finishing out of order may."""

        def __init__(self, inner) -> None:
            self.inner, self.name = inner, inner.name

        def train(self, *args):
            yield from reversed([(p, t.clone(), d) for p, t, d in self.inner.train(*args)])

    overrides = ["rounds=2", "data.num_clients=6", "sampling.participation=1.0", "evaluation.model=reporting_mean"]
    in_order = driftlab.run(None, overrides=overrides)
    original = dict(runner_module.BACKENDS)
    for name, factory in original.items():
        monkeypatch.setitem(runner_module.BACKENDS, name, lambda _f=factory, **options: Reversed(_f(**options)))
    reversed_order = driftlab.run(None, overrides=overrides)
    assert [r["test_loss"] for r in reversed_order.records] == [r["test_loss"] for r in in_order.records]
    assert torch.equal(reversed_order.final_params, in_order.final_params)


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_a_round_in_waves_matches_one_wave(backend):
    # SCAFFOLD's state is 3,306 floats (13 KB), so a 200 KB budget leaves one eighth, 25 KB: one client per wave.
    overrides = [
        "rounds=3",
        "data.num_clients=8",
        "sampling.participation=0.75",
        "algorithm.name=scaffold",
        f"backend={backend}",
    ]
    one_wave = driftlab.run(None, overrides=overrides)
    config = driftlab.load_config(None, [*overrides, "memory_budget=200KB"])
    sim, state = build_simulation(config)
    assert engine_module.wave_size(sim, sim.algorithm.client_state_init(sim.initial_params)) == 1
    sizes = count_wave_sizes(sim)
    records = []
    for _ in range(3):
        state, record = run_round(sim, state, evaluate_after=True)
        records.append(record)
    assert sizes == [1] * 18  # 6 clients a round, one at a time
    if backend == "sequential":  # every client trains on its own: the waves change nothing
        assert torch.equal(state.server.params, one_wave.final_params)
        strip = lambda rs: [{k: v for k, v in r.items() if k != "round_seconds"} for r in rs]  # noqa: E731
        assert strip(records) == strip(one_wave.records)
    else:  # batched kernels over chunks of 1 instead of 3 clients: the same to rounding
        torch.testing.assert_close(state.server.params, one_wave.final_params, rtol=1e-5, atol=1e-6)


def test_wave_size_follows_the_memory_budget_and_not_the_machine():
    sim, _ = build_simulation(driftlab.load_config(None, ["memory_budget=80MB"]))
    params = sim.initial_params.numel() * 4
    state = torch.zeros(sim.initial_params.numel())
    assert engine_module.wave_size(sim, None) == 80_000_000 // 8 // (5 * params)
    assert engine_module.wave_size(sim, state) == 80_000_000 // 8 // (7 * params)
    default, _ = build_simulation(driftlab.load_config(None))
    assert engine_module.wave_size(default, state) == 2**30 // (7 * params)


def test_client_test_accuracies_are_each_clients_own_in_one_pass():
    sim, state = build_simulation(driftlab.load_config(None, ["data.num_clients=12"]))
    sim.evaluation = dataclasses.replace(sim.evaluation, batch_size=7)  # batches that cut across clients
    params = state.server.params + 0.3 * torch.randn(
        state.server.params.shape, generator=torch.Generator().manual_seed(1)
    )
    expected = []
    for rows in sim.client_test_rows:  # one client at a time, as a reader would compute it
        if len(rows):
            outputs = sim.model.forward(params, sim.test_data.inputs[rows])
            expected.append(int((outputs.argmax(dim=1) == sim.test_data.targets[rows]).sum()) / len(rows))
    accuracies = evaluation_module._client_test_accuracies(sim, params)
    assert accuracies == expected and len(set(accuracies)) > 1
    assert evaluate(sim, params)["client_test_accuracy_mean"] == float(np.mean(expected))


def test_clients_without_test_rows_are_left_out_of_the_mean_wherever_they_are():
    sim, state = build_simulation(driftlab.load_config(None, ["data.num_clients=6"]))
    empty = torch.zeros(0, dtype=torch.long)
    rows = sim.client_test_rows
    sim.client_test_rows = [empty, rows[0], empty, rows[1], rows[2], empty]  # the first and last clients too
    sim.client_test_union = torch.cat(sim.client_test_rows)
    full = evaluation_module._client_test_accuracies(sim, state.server.params)
    sim.client_test_rows, sim.client_test_union = rows[:3], torch.cat(rows[:3])
    assert full == evaluation_module._client_test_accuracies(sim, state.server.params) and len(full) == 3


# ------------------------------------------------------------------ rounds that select nobody (poisson sampling)

# seed 0, 10 clients, q = 0.08: rounds 5, 7 and 8 select nobody (the sampling test pins the draw itself)
SPARSE = {
    "rounds": 8,
    "seed": 0,
    "precision": "float64",
    "data": {"num_clients": 10},
    "client": {"steps": 2},
    "sampling": {"participation": 0.08, "mode": "poisson"},
    "evaluation": {"model": "reporting_mean"},
}
SPARSE_EMPTY_ROUNDS = [5, 7, 8]


def _strip(records):
    return [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]


def _check_empty_rounds_recorded_honestly(records, num_parameters):
    assert [r["round"] for r in records if r["num_selected"] == 0] == SPARSE_EMPTY_ROUNDS
    view_bits = 2 * 32 * num_parameters  # SCAFFOLD's view: θ and c, at 32 bits an entry whatever the precision
    for before, record in zip(records, records[1:], strict=False):
        if record["num_selected"] == 0:
            assert record["num_reporting"] == 0 and record["reporting_clients"] == []
            assert record["upload_bits"] == 0 and record["download_bits"] == 0 and record["local_steps"] == 0
            assert record["num_inactive"] == 0 and record["num_incomplete"] == 0
            # nobody reported: the server model stays, and the evaluation (scheduled every round) is of that model
            assert record["model_norm"] == before["model_norm"]
            assert record["test_loss"] == before["test_loss"] and "train_loss" in record
        else:
            assert record["num_reporting"] == record["num_selected"] > 0
            assert record["download_bits"] == record["num_selected"] * view_bits


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_rounds_that_select_nobody_run_and_are_recorded_as_such_on_both_backends(backend):
    result = driftlab.run(SPARSE | {"backend": backend, "algorithm": {"name": "scaffold"}})
    _check_empty_rounds_recorded_honestly(result.records, result.num_parameters)
    assert len(result.records) == 8


def test_the_mean_of_every_clients_model_is_evaluated_in_rounds_that_select_nobody():
    result = driftlab.run(SPARSE | {"evaluation": {"model": "all_clients_mean"}})
    losses = {r["round"]: r["test_loss"] for r in result.records}
    for t in SPARSE_EMPTY_ROUNDS:  # nobody's latest model changed: the same mean, the same loss
        assert losses[t] == losses[t - 1]
    assert len(set(losses.values())) > 1


def test_a_run_with_empty_rounds_resumes_bit_for_bit(tmp_path):
    config = SPARSE | {"algorithm": {"name": "scaffold"}, "checkpoint_every": 1, "keep_checkpoint": True}
    straight = driftlab.run(config)
    driftlab.run(config | {"rounds": 5}, tmp_path / "run")  # stops after round 5, which selected nobody
    resumed = driftlab.run(config, tmp_path / "run", resume=True)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["resumed_from_round"] == 5
    assert torch.equal(straight.final_params, resumed.final_params)
    assert _strip(straight.records) == _strip(resumed.records)
    _check_empty_rounds_recorded_honestly(resumed.records, resumed.num_parameters)


def _finishing_empty(algorithm, calls: list):
    """``algorithm`` whose fold ``finishes_empty``: its finish is counted (the round's num_selected), and with no
    message folded it returns the server state as it was, with a metric saying it ran."""
    fold = algorithm.fold()

    def start(server, context):
        return fold.start(server, context), 0

    def add(accumulator, message):
        inner, count = accumulator
        return fold.add(inner, message), count + 1

    def finish(server, accumulator, context):
        calls.append(context.num_selected)
        inner, count = accumulator
        return (server, {"empty_finish": 1.0}) if count == 0 else fold.finish(server, inner, context)

    folding = dataclasses.replace(fold, start=start, add=add, finish=finish, finishes_empty=True)
    return dataclasses.replace(algorithm, server_fold=folding, server_update=folding.server_update)


@pytest.mark.parametrize("finishes_empty", [True, False])
def test_an_empty_round_calls_the_folds_finish_only_when_it_finishes_empty(finishes_empty):
    sim, state = build_simulation(driftlab.load_config(SPARSE))
    calls: list = []
    if finishes_empty:
        sim.algorithm = _finishing_empty(sim.algorithm, calls)
    records = []
    for _ in range(8):
        state, record = run_round(sim, state, evaluate_after=True)
        records.append(record)
    empty = [r for r in records if r["round"] in SPARSE_EMPTY_ROUNDS]
    assert all(r["num_selected"] == 0 for r in empty)
    if finishes_empty:
        assert calls == [r["num_selected"] for r in records]  # every round finished, the empty ones too
        assert all(r["empty_finish"] == 1.0 for r in empty)
        assert not any("empty_finish" in r for r in records if r not in empty)
    else:
        assert not any("empty_finish" in r for r in records)
    plain = driftlab.run(SPARSE)
    assert torch.equal(state.server.params, plain.final_params)  # this finish changes nothing else


def test_a_round_whose_selected_clients_all_drop_out_is_recorded_and_keeps_the_model():
    # every selected client inactive: the round's sample is not empty, but nobody trains or reports
    sim, state = build_simulation(driftlab.load_config(_six_clients(3, 0.5, inactive_probability=1.0)))
    initial = state.server.params.clone()
    calls: list = []
    sim.algorithm = _finishing_empty(sim.algorithm, calls)
    state, record = run_round(sim, state, evaluate_after=True)
    assert record["num_selected"] == 3 and record["num_inactive"] == 3
    assert record["num_reporting"] == 0 and record["upload_bits"] == 0 and record["local_steps"] == 0
    assert record["download_bits"] == 3 * 32 * sim.initial_params.numel()  # they received the broadcast
    assert torch.equal(state.server.params, initial) and "test_loss" in record
    assert calls == [3]  # a fold that finishes empty is finished here too


def count_wave_sizes(sim) -> list[int]:
    """The number of clients of each wave ``sim``'s backend trains from now on, appended as they are trained."""
    sizes = []
    train = sim.backend.train

    def counting_train(model, start, tasks, *rest):
        sizes.append(len(tasks))
        return train(model, start, tasks, *rest)

    sim.backend.train = counting_train
    return sizes


def test_a_poisson_round_larger_than_its_expected_cohort_still_trains_in_waves_of_the_budget():
    # q = 0.5 of 8 clients: m = 4 expected, rounds of 2 to 7; a 200 KB budget holds one SCAFFOLD client per wave
    overrides = [
        "rounds=6",
        "data.num_clients=8",
        "sampling.participation=0.5",
        "sampling.mode=poisson",
        "algorithm.name=scaffold",
    ]
    sim, state = build_simulation(driftlab.load_config(None, [*overrides, "memory_budget=200KB"]))
    assert engine_module.wave_size(sim, sim.algorithm.client_state_init(sim.initial_params)) == 1
    sizes = count_wave_sizes(sim)
    selected = []
    for _ in range(6):
        state, record = run_round(sim, state)
        selected.append(record["num_selected"])
    assert max(selected) > 4  # a round above the expected cohort
    assert sizes == [1] * sum(selected)
