"""FedAMP (fedamp.py): the cloud models u_k by hand, the same numbers as the sum over an [N, P] matrix W (the
module's arithmetic before its models moved into the client-state store), the fixed point on quadratics, the engine
on both backends and with the disk store, per-client download bits, the models in the checkpoint, and the refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.algorithms import fedamp
from driftlab.algorithms.shared_test import Quadratics, build_algorithm, heterogeneous_quadratics, run_quadratic
from driftlab.errors import ConfigError
from driftlab.metrics.communication import payload_bits
from driftlab.simulation.backends.local_training import LocalSettings, corrected_step
from driftlab.simulation.seam import ClientContext, ClientUpdate, GradientCorrection, RoundContext

F64 = torch.float64


def stored(models: torch.Tensor, skip: tuple[int, ...] = ()):
    """The states of a store holding row k of ``models`` for every client k not in ``skip`` (``Algorithm.client_view``)."""
    return lambda: iter([(k, fedamp.ClientState(models[k])) for k in range(len(models)) if k not in skip])


# The shared two-client case (shared_test.hand_round: N = 4, clients 0 and 1 report, b_0 = (2, 0), b_1 = (0, 4),
# K = 2 steps of η = 0.5 from u_k).  σ = 2^60 makes every e^{−d/σ} exactly 1.0 in float64 (d ≤ 5), so ξ_kj = α/σ = 1/8
# (flat attention, u_k = w_k + (1/8) Σ_{j≠k} (w_j − w_k)), and λ = α gives the proximal coefficient λ/α = 1; a step
# is then θ ← (b_k + u_k)/2 whatever θ.
# Round 1: W = 0, u_k = 0, w_0 = (1, 0), w_1 = (0, 2); rows 2, 3 stay 0: mean (1/4, 1/2).
# Round 2: u_0 = (1, 0) + (1/8)(−3, 2) = (5/8, 1/4), u_1 = (0, 2) + (1/8)(1, −6) = (1/8, 5/4);
#          w_0 = ((2 + 5/8)/2, (0 + 1/4)/2) = (21/16, 1/8), w_1 = (1/16, 21/8): mean (11/32, 11/16).
HAND_CASE = {
    "config": {"sigma": 2.0**60, "alpha": 2.0**57, "lam": 2.0**57},
    "params": [[0.25, 0.5], [0.34375, 0.6875]],
    "drift": None,
}


def test_cloud_models_of_three_clients_by_hand():
    # W = [(0, 0), (1, 0), (0, 2)], σ = 2, α = 1/2 (≤ σ/(N−1) = 1): squared distances d_01 = 1, d_02 = 4, d_12 = 5.
    # Client 0 has no state: it counts with θ⁰ = (0, 0).
    models = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]], dtype=F64)
    algorithm = fedamp.build(num_clients=3, sigma=2.0, alpha=0.5)
    server = algorithm.server_init(torch.zeros(2, dtype=F64))
    states = stored(models, skip=(0,))

    def xi(d: float) -> float:  # α A'(d) = α e^{−d/σ}/σ
        return 0.5 * math.exp(-d / 2.0) / 2.0

    weights = [[None, xi(1), xi(4)], [xi(1), None, xi(5)], [xi(4), xi(5), None]]
    for k in range(3):
        weights[k][k] = 1 - sum(w for j, w in enumerate(weights[k]) if j != k)  # ξ_kk = 1 − Σ_{j≠k} ξ_kj
        expected = sum(weights[k][j] * models[j] for j in range(3))
        view = algorithm.client_view(server, k, states)
        torch.testing.assert_close(view.params, expected, rtol=0, atol=1e-15)
        # the client's own model is its state w_k, for its personalized evaluation
        assert torch.equal(algorithm.personalization.model(view, fedamp.ClientState(models[k])), models[k])
    # u_1 written out: (1 − ξ(1) − ξ(5), 0) + ξ(5)·(0, 2)
    u1 = algorithm.client_view(server, 1, states).params
    assert u1.tolist() == pytest.approx([1 - xi(1) - xi(5), 2 * xi(5)], abs=1e-15)


def reference_cloud_model(models: torch.Tensor, client_id: int, alpha: float, sigma: float) -> torch.Tensor:
    """The module's sum before the models moved into the store: over the rows of W = ``models`` ([N, P]), in blocks."""
    own = models[client_id]
    block = max(1, fedamp.BLOCK_ENTRIES // max(1, models.shape[1]))
    total = torch.zeros_like(own)
    for start in range(0, models.shape[0], block):
        differences = models[start : start + block] - own
        weights = fedamp.attention_weights((differences * differences).sum(1), alpha, sigma)
        total = total + weights @ differences
    return own + total


def reference_run(
    problem: Quadratics,
    initial: torch.Tensor,
    participants,
    rounds: int,
    steps: int,
    learning_rate: float,
    alpha: float,
    sigma: float,
    lam: float,
) -> torch.Tensor:
    """FedAMP as the module computed it before: W = [N, P] in the server state (θ⁰ rows), row k ← w_k after a round."""
    models = initial.unsqueeze(0).repeat(problem.num_clients, 1)
    settings = LocalSettings(learning_rate)
    for t in range(1, rounds + 1):
        rows = {}
        for k in participants(t):
            cloud = reference_cloud_model(models, k, alpha, sigma)
            correction = GradientCorrection(quadratic=lam / alpha, reference=cloud)
            theta = cloud
            for _ in range(steps):
                theta = corrected_step(theta, problem.gradient(k, theta), correction, settings)
            rows[k] = theta
        ids = sorted(rows)
        models = models.index_copy(0, torch.tensor(ids), torch.stack([rows[k] for k in ids]))
    return models


@pytest.mark.parametrize("block_entries", [fedamp.BLOCK_ENTRIES, 6], ids=["one-block", "two-rows-a-block"])
def test_the_store_gives_the_numbers_of_the_sum_over_the_whole_matrix(monkeypatch, block_entries):
    # 5 clients, 2 a round (client 4 never trains: it stays θ⁰ ≠ 0), 6 rounds: every client's model is bit for bit
    # the row of W the [N, P] arithmetic gives, and the mean model the mean of W (kept as a float64 sum: to rounding).
    monkeypatch.setattr(fedamp, "BLOCK_ENTRIES", block_entries)
    problem = heterogeneous_quadratics(num_clients=5, dim=3)
    initial = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    sigma, alpha, lam = 4.0, 0.5, 0.75

    def participants(t: int) -> list[int]:
        return [t % 4, (2 * t + 1) % 4] if t % 4 != (2 * t + 1) % 4 else [t % 4]

    algorithm = build_algorithm("fedamp", num_clients=5, sigma=sigma, alpha=alpha, lam=lam)
    run = run_quadratic(algorithm, problem, initial, rounds=6, steps=3, learning_rate=0.2, participants=participants)
    reference = reference_run(problem, initial, participants, 6, 3, 0.2, alpha, sigma, lam)
    assert sorted(run.client_states) == [0, 1, 2, 3]
    for k in range(4):
        assert torch.equal(run.client_states[k].model, reference[k])
    assert torch.equal(reference[4], initial)
    torch.testing.assert_close(run.server.params, reference.mean(0), rtol=0, atol=1e-15)
    states = lambda: iter(sorted(run.client_states.items()))  # noqa: E731
    for k in range(5):
        view = algorithm.client_view(run.server, k, states)
        assert torch.equal(view.params, reference_cloud_model(reference, k, alpha, sigma))


def test_the_blocked_sum_is_the_same_sum():
    generator = torch.Generator().manual_seed(0)
    models = torch.randn(7, 5, generator=generator, dtype=F64)
    models[4] = 0.0  # θ⁰ = 0: client 4 has no state
    states = stored(models, skip=(4,))
    whole = fedamp.cloud_model(states(), models[3], 3, torch.zeros(5, dtype=F64), 7, alpha=0.1, sigma=4.0)
    old = fedamp.BLOCK_ENTRIES
    try:
        fedamp.BLOCK_ENTRIES = 10  # two rows a block
        blocked = fedamp.cloud_model(states(), models[3], 3, torch.zeros(5, dtype=F64), 7, alpha=0.1, sigma=4.0)
    finally:
        fedamp.BLOCK_ENTRIES = old
    torch.testing.assert_close(blocked, whole, rtol=0, atol=1e-15)
    assert torch.equal(whole, reference_cloud_model(models, 3, 0.1, 4.0))


def test_client_objective_is_the_proximal_term_towards_its_own_cloud_model():
    algorithm = fedamp.build(num_clients=3, sigma=2.0, alpha=0.5, lam=0.25)
    models = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]], dtype=F64)
    view = algorithm.client_view(algorithm.server_init(torch.zeros(2, dtype=F64)), 2, stored(models))
    correction = algorithm.client_objective(
        view, fedamp.ClientState(models[2]), ClientContext(2, 1, 10, 10.0, 3, 5, 0.1)
    )
    assert correction.quadratic == 0.5 and correction.linear is None  # λ/α
    assert correction.reference is view.params


def test_the_client_keeps_its_model_and_the_server_the_sum_of_every_clients_model():
    # N = 3 from θ⁰ = (1, 1): Σ_j w_j = (3, 3).  Client 2 trains to (3, 6): its state is w_2, its message the change
    # (2, 5), and the mean becomes ((1, 1) + (1, 1) + (3, 6))/3 = (5/3, 8/3).
    algorithm = fedamp.build(num_clients=3)
    initial = torch.ones(2, dtype=F64)
    server = algorithm.server_init(initial)
    assert torch.equal(server.total, torch.tensor([3.0, 3.0], dtype=F64)) and torch.equal(server.params, initial)
    state = algorithm.client_state_init(initial)
    view = algorithm.client_view(server, 2, lambda: iter(()))
    new = torch.tensor([3.0, 6.0], dtype=F64)
    context = ClientContext(2, 1, 10, 10.0, 3, 5, 0.1)
    new_state, message = algorithm.client_finish(view, state, context, ClientUpdate(view.params, new, 5))
    assert torch.equal(new_state.model, new) and torch.equal(message.change, torch.tensor([2.0, 5.0], dtype=F64))
    assert payload_bits(message) == 32 * 2  # one model up
    server, metrics = algorithm.server_update(server, [message], RoundContext(1, 3, 1, 1.0))
    assert torch.equal(server.total, torch.tensor([5.0, 8.0], dtype=F64))
    assert torch.equal(server.params, torch.tensor([5.0, 8.0], dtype=F64) / 3)
    assert metrics == {}
    # personalized models: client 2's own w_2, a client that never trained θ⁰ (its client_state_init)
    assert torch.equal(algorithm.personalization.model(view, new_state), new)
    assert torch.equal(
        algorithm.personalization.model(algorithm.client_view(server, 0, lambda: iter(())), state), initial
    )
    # a float32 client sends its change in float64: old + change gives its new model back, no float32 rounding
    state32 = fedamp.ClientState(torch.tensor([0.1, 1e-8]))
    _, message = algorithm.client_finish(view, state32, context, ClientUpdate(view.params, torch.tensor([1e8, 0.3]), 5))
    assert message.change.dtype == F64
    assert (message.change + state32.model.double()).tolist() == torch.tensor([1e8, 0.3]).double().tolist()


def test_the_view_counts_only_the_cloud_model_as_sent():
    algorithm = fedamp.build(num_clients=4)
    server = algorithm.server_init(torch.zeros(5))
    assert (
        payload_bits(algorithm.client_view(server, 1, lambda: iter(()))) == 32 * 5
    )  # u_k; the client's own w_k is not sent
    assert payload_bits(algorithm.broadcast(server)) == 32 * 5


# ---------------------------------------------------------------- quadratics


def stationarity_residual(problem: Quadratics, models: torch.Tensor, lam: float, sigma: float) -> torch.Tensor:
    """``∇f_k(w_k) + λ Σ_j A'(‖w_k − w_j‖²)(w_k − w_j)`` per client: zero at a stationary point of
    Σ_k f_k(w_k) + (λ/2) Σ_{k<j} A(‖w_k − w_j‖²), FedAMP's fixed point when the prox step is exact."""
    rows = []
    for k in range(problem.num_clients):
        differences = models[k] - models
        attention = torch.exp(-(differences * differences).sum(1) / sigma) / sigma
        rows.append(problem.gradient(k, models[k]) + lam * attention @ differences)
    return torch.stack(rows)


def test_on_quadratics_fedamp_reaches_a_stationary_point_of_its_objective():
    # 60 GD steps of η = 0.2 solve each client's prox problem (curvature + λ/α ≥ 2) to float precision, so the
    # alternation's fixed point satisfies ∇f_k(w_k) = (λ/α)(u_k − w_k) = λ Σ_j A'(d_kj)(w_j − w_k).
    problem = heterogeneous_quadratics(num_clients=4, dim=3)
    sigma, alpha, lam = 8.0, 0.5, 0.5
    algorithm = build_algorithm("fedamp", num_clients=4, sigma=sigma, alpha=alpha, lam=lam)
    run = run_quadratic(algorithm, problem, torch.zeros(3, dtype=F64), rounds=300, steps=60, learning_rate=0.2)
    models = torch.stack([run.client_states[k].model for k in range(4)])
    residual = stationarity_residual(problem, models, lam, sigma)
    assert residual.abs().max() < 1e-9
    # personalized: each model sits between its own minimiser and the others', not on a common model
    own = problem.targets / problem.curvatures
    assert torch.cdist(models, models).max() > 1.0
    assert (models - own).norm(dim=1).max() < (models.mean(0) - own).norm(dim=1).min()


def test_on_quadratics_similar_clients_pull_together_and_distant_ones_do_not():
    # Two groups of two clients, minimisers ±(5, 5, 5) plus small offsets; σ = 1 sees within-group distances only.
    near = torch.tensor([[0.2, 0.0, 0.0], [0.0, 0.2, 0.0]], dtype=F64)
    centres = torch.cat([5 + near, -5 - near])
    problem = Quadratics(torch.ones(4, 3, dtype=F64), centres)  # f_k(w) = ½‖w − c_k‖²
    algorithm = build_algorithm("fedamp", num_clients=4, sigma=1.0, alpha=1 / 3, lam=1 / 3)
    run = run_quadratic(algorithm, problem, torch.zeros(3, dtype=F64), rounds=200, steps=40, learning_rate=0.25)
    models = torch.stack([run.client_states[k].model for k in range(4)])
    assert (models[0] - models[1]).norm() < (centres[0] - centres[1]).norm()  # within a group: pulled together
    assert (models[2] - models[3]).norm() < (centres[2] - centres[3]).norm()
    for k in range(4):  # across groups: attention e^{−300} is nothing; each stays by its own group
        assert (models[k] - centres[k]).norm() < 0.2
    assert stationarity_residual(problem, models, 1 / 3, 1.0).abs().max() < 1e-9


# ---------------------------------------------------------------- the engine

TINY = {
    "algorithm": {"name": "fedamp"},
    "rounds": 3,
    "data": {"num_clients": 6, "client_test_fraction": 0.2},
    "client": {"epochs": 1},
    "sampling": {"participation": 0.5},
    "evaluation": {"every": 1},
}


def tiny(**top) -> driftlab.ExperimentConfig:
    return driftlab.load_config({**TINY, **top})


def test_both_backends_train_each_client_from_its_own_cloud_model():
    sequential = driftlab.run(tiny(backend="sequential"))
    vectorized = driftlab.run(tiny(backend="vectorized"))
    torch.testing.assert_close(sequential.final_params, vectorized.final_params, rtol=0, atol=1e-5)
    for first, second in zip(sequential.records, vectorized.records, strict=True):
        assert first["personal_test_accuracy_mean"] == pytest.approx(second["personal_test_accuracy_mean"], abs=1e-6)
        assert first["download_bits"] == second["download_bits"]


def test_download_bits_count_one_cloud_model_per_selected_client_and_personal_accuracy_is_recorded():
    result = driftlab.run(tiny())
    for record in result.records:
        assert record["download_bits"] == 32 * result.num_parameters * record["num_selected"]
        assert {"personal_test_accuracy_mean", "client_test_accuracy_mean", "test_accuracy"} <= set(record)
    # the personalized models beat the mean model on the clients' own splits (label-skewed synthetic data)
    last = result.records[-1]
    assert last["personal_test_accuracy_mean"] > last["client_test_accuracy_mean"]


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_every_clients_model_is_a_checkpointed_client_state_and_a_resume_is_exact(tmp_path: Path, store: str):
    straight = driftlab.run(tiny(rounds=4, keep_checkpoint=True, state={"store": store}), tmp_path / "straight")
    driftlab.run(tiny(rounds=2, checkpoint_every=1, keep_checkpoint=True, state={"store": store}), tmp_path / "resumed")
    resumed = driftlab.run(
        tiny(rounds=4, checkpoint_every=1, keep_checkpoint=True, state={"store": store}),
        tmp_path / "resumed",
        resume=True,
    )
    assert torch.equal(straight.final_params, resumed.final_params)
    assert straight.records[-1]["personal_test_accuracy_mean"] == resumed.records[-1]["personal_test_accuracy_mean"]
    tensors = load_file(str(tmp_path / "straight" / "checkpoint.safetensors"))
    assert "server/models" not in tensors  # no [N, P] server state: the models are the clients' states
    if store == "memory":  # (the disk store's rows stay in its files, referenced by the checkpoint)
        again = load_file(str(tmp_path / "resumed" / "checkpoint.safetensors"))
        keys = [key for key in tensors if key.endswith("/state/model")]
        assert keys and all(torch.equal(tensors[key], again[key]) for key in keys)
        models = torch.stack([tensors.get(f"client/{k}/state/model", tensors["server/initial"]) for k in range(6)])
        torch.testing.assert_close(models.mean(0), straight.final_params.to(models.dtype), rtol=0, atol=1e-6)
        torch.testing.assert_close(models.double().sum(0), tensors["server/total"], rtol=0, atol=1e-6)


def test_a_run_with_the_disk_store_is_the_run_in_memory(tmp_path: Path):
    memory = driftlab.run(tiny(rounds=4))
    disk = driftlab.run(tiny(rounds=4, state={"store": "disk"}), tmp_path / "disk")
    assert torch.equal(memory.final_params, disk.final_params)
    for first, second in zip(memory.records, disk.records, strict=True):
        assert {k: v for k, v in first.items() if k != "round_seconds"} == {
            k: v for k, v in second.items() if k != "round_seconds"
        }


# ---------------------------------------------------------------- refusals


def test_a_step_that_can_give_negative_self_weights_is_refused_naming_the_bound():
    with pytest.raises(ConfigError, match=r"α\(N−1\)/σ = 1\.5 > 1.*algorithm.alpha ≤ σ/\(N−1\) = 0\.5"):
        driftlab.run(
            None, overrides=["algorithm.name=fedamp", "algorithm.alpha=0.75", "data.num_clients=3", "rounds=1"]
        )
    assert fedamp.build(num_clients=3, alpha=0.5).client_view is not None  # the bound itself is allowed


def test_without_the_number_of_clients_the_bundle_says_it_needs_it():
    algorithm = fedamp.build()
    with pytest.raises(ValueError, match="num_clients"):
        algorithm.server_init(torch.zeros(2))


@pytest.mark.parametrize(
    "top, fragment",
    [
        ({"compression": {"ratio": 0.5}}, "compression.ratio = 1"),
        (
            {"privacy": {"clip": 1.0, "noise_multiplier": 1.0}, "sampling": {"mode": "poisson", "participation": 0.5}},
            "remove [privacy]",
        ),
        ({"system": {}, "asynchronous": {"concurrency": 3, "buffer": 2}}, "remove [asynchronous]"),
    ],
    ids=["compression", "privacy", "asynchronous"],
)
def test_compression_privacy_and_asynchronous_runs_are_refused(top, fragment):
    with pytest.raises(ConfigError) as error:
        driftlab.run(tiny(**top))
    assert fragment in str(error.value)


def test_a_deployment_is_refused():
    from driftlab.deploy.messages import check_config_deployable

    with pytest.raises(ConfigError, match="client_view"):
        check_config_deployable(tiny(evaluation={"every": 1}))


def test_counting_a_views_bits_or_reading_a_clients_own_model_reads_no_store():
    algorithm = fedamp.build(num_clients=3)
    server = algorithm.server_init(torch.arange(4.0))

    def refuse(*args, **kwargs):
        raise AssertionError("the store was read")

    view = algorithm.client_view(server, 2, refuse)
    assert payload_bits(view) == 32 * 4
    assert torch.equal(
        algorithm.personalization.model(view, algorithm.client_state_init(torch.arange(4.0))), torch.arange(4.0)
    )
    with pytest.raises(AssertionError, match="the store was read"):
        view.params  # noqa: B018 - reading it is the point
