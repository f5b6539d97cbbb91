"""FedDyn: the λ form against the paper's h form, the mean over ALL registered clients, α_k, convergence, drift recording."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.algorithms import feddyn
from driftlab.algorithms.shared_test import TINY, build_algorithm, heterogeneous_quadratics, run_quadratic
from driftlab.simulation.seam import ClientContext, ClientUpdate, RoundContext

F64 = torch.float64


def test_correction_and_client_alpha_by_size() -> None:
    server = feddyn.ServerState(torch.tensor([1.0, 2.0], dtype=F64), torch.zeros(2, dtype=F64))
    view = feddyn.build(alpha=0.1).broadcast(server)
    client = feddyn.ClientState(torch.tensor([0.5, -1.0], dtype=F64))
    small = ClientContext(0, 3, 25, 100.0, 10, 5, 0.1)  # n_k = 25, n̄ = 100: α_k = 0.1·100/25 = 0.4
    correction = build_algorithm("feddyn", alpha=0.1).client_objective(view, client, small)
    assert correction.quadratic == pytest.approx(0.4, rel=1e-15)
    assert torch.allclose(correction.linear, torch.tensor([0.2, -0.4], dtype=F64), rtol=1e-15)
    assert torch.equal(correction.reference, server.params)
    constant = build_algorithm("feddyn", alpha=0.1, balance="none").client_objective(view, client, small)
    assert constant.quadratic == 0.1
    balanced = ClientContext(0, 3, 100, 100.0, 10, 5, 0.1)
    assert build_algorithm("feddyn", alpha=0.1).client_objective(view, client, balanced).quadratic == 0.1


def test_client_dual_update() -> None:
    algorithm = feddyn.build(alpha=0.1)
    server = feddyn.ServerState(torch.tensor([1.0, 2.0], dtype=F64), torch.zeros(2, dtype=F64))
    client = feddyn.ClientState(torch.tensor([0.5, -1.0], dtype=F64))
    context = ClientContext(0, 3, 10, 10.0, 10, 5, 0.1)
    view = algorithm.broadcast(server)
    assert view == feddyn.ClientView(server.params)  # θ^{t−1} only: Σ λ stays on the server
    state, message = algorithm.client_finish(
        view, client, context, ClientUpdate(view.params, torch.tensor([0.0, 4.0], dtype=F64), 5)
    )
    # λ_k ← λ_k + (θ_k − θ^{t−1}) = (0.5, −1) + (−1, 2) = (−0.5, 1); the upload is θ_k (one model)
    assert torch.equal(state.dual, torch.tensor([-0.5, 1.0], dtype=F64))
    assert torch.equal(message.params, torch.tensor([0.0, 4.0], dtype=F64))


def test_server_mean_of_duals_runs_over_all_registered_clients() -> None:
    # N = 10 registered, Σ_S λ before = (2, 0); two report θ_k = (1, 1), (3, 1) from θ^{t−1} = (1, 0):
    # Σλ ← (2,0) + (0,1) + (2,1) = (4, 2);  θ^t = mean θ_k + Σλ/N = (2, 1) + (0.4, 0.2) = (2.4, 1.2)
    algorithm = feddyn.build(alpha=0.1)
    server = feddyn.ServerState(torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([2.0, 0.0], dtype=F64))
    messages = [
        feddyn.ClientMessage(torch.tensor([1.0, 1.0], dtype=F64), 1),
        feddyn.ClientMessage(torch.tensor([3.0, 1.0], dtype=F64), 1),
    ]
    server, metrics = algorithm.server_update(server, messages, RoundContext(4, 10, 2, 1.0))
    assert torch.equal(server.dual_sum, torch.tensor([4.0, 2.0], dtype=F64))
    assert torch.allclose(server.params, torch.tensor([2.4, 1.2], dtype=F64), rtol=1e-15)
    assert metrics["drift_norm"] == pytest.approx(float(torch.linalg.vector_norm(torch.tensor([0.4, 0.2]))), rel=1e-7)


def test_lambda_form_equals_the_papers_h_form_under_partial_participation() -> None:
    # Paper (balanced data): h^t = h^{t−1} − α/N Σ_P (θ_k − θ^{t−1}),  θ^t = mean_P θ_k − h^t/α,
    # with the client's ∇L_k(θ_k^{t−1}) = −α λ_k.  Replay the recorded client models through it.
    alpha, num_clients = 0.2, 8
    problem = heterogeneous_quadratics(num_clients=num_clients, seed=3)
    initial = torch.zeros(3, dtype=F64)
    schedule = [[0, 3, 5], [1, 2, 3], [4, 6, 7], [0, 5, 6], [2, 7, 1], [3, 4, 0]]
    recorded: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    class Recording:
        """Wraps FedDyn to capture θ^{t−1} and the uploaded θ_k of every round."""

        algorithm = build_algorithm("feddyn", alpha=alpha)

        def __getattr__(self, name):
            return getattr(self.algorithm, name)

        def server_update(self, server, messages, context):
            recorded.append((server.params, [m.params for m in messages]))
            return self.algorithm.server_update(server, messages, context)

    run = run_quadratic(
        Recording(), problem, initial, len(schedule), steps=4, learning_rate=0.1, participants=lambda t: schedule[t - 1]
    )
    h = torch.zeros(3, dtype=F64)
    theta = initial
    for (previous, client_models), metrics in zip(recorded, run.metrics, strict=True):
        assert torch.allclose(previous, theta, rtol=0, atol=1e-13)
        h = h - alpha / num_clients * sum(model - previous for model in client_models)
        theta = sum(client_models) / len(client_models) - h / alpha
        assert metrics["drift_norm"] == pytest.approx(float(torch.linalg.vector_norm(h)) / alpha, rel=1e-12)
    assert torch.allclose(run.server.params, theta, rtol=0, atol=1e-13)
    # and Σ_S λ in the server state is the sum of the stored client λ_k (never-sampled clients hold 0)
    stored = sum(state.dual for state in run.client_states.values())
    assert torch.allclose(run.server.dual_sum, stored, rtol=0, atol=1e-13)


def test_converges_to_the_global_minimiser_on_heterogeneous_quadratics() -> None:
    problem = heterogeneous_quadratics()
    initial = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    run = run_quadratic(build_algorithm("feddyn", alpha=0.3), problem, initial, rounds=300, steps=10, learning_rate=0.1)
    assert torch.allclose(run.server.params, problem.minimiser(), rtol=0, atol=1e-6)
    # at the fixed point λ_k = −∇f_k(x*)/α and mean_S λ_k = 0
    assert run.metrics[-1]["drift_norm"] < 1e-6
    for k in range(problem.num_clients):
        assert torch.allclose(
            0.3 * run.client_states[k].dual, -problem.gradient(k, problem.minimiser()), rtol=0, atol=1e-6
        )


def test_low_participation_records_the_drift_norm_every_round(tmp_path) -> None:
    # AdaBest's Figure 1 setting in miniature: many clients, 4% participation.  The test pins the recording
    # (one finite ‖mean_S λ_k‖ per round, equal to the checkpointed state), not the claim that it grows.
    config = {
        **TINY,
        "rounds": 6,
        "data": {"num_clients": 50},
        "sampling": {"participation": 0.04},
        "algorithm": {"name": "feddyn", "alpha": 0.01},
    }
    config["keep_checkpoint"] = True  # its server state is read below
    result = driftlab.run(config, tmp_path)
    norms = [record["drift_norm"] for record in result.records]
    assert len(norms) == 6 and all(norm > 0 and norm == norm for norm in norms)
    assert all(record["num_selected"] == 2 for record in result.records)
    dual_sum = load_file(str(tmp_path / "checkpoint.safetensors"))["server/dual_sum"]
    assert norms[-1] == pytest.approx(float(torch.linalg.vector_norm(dual_sum / 50)), rel=1e-6)
    assert result.records[-1]["upload_bits"] == 2 * 32 * result.num_parameters  # one model up per client


@pytest.mark.parametrize("alpha", [0, -0.1])
def test_non_positive_alpha_is_rejected_with_the_key(alpha: float) -> None:
    with pytest.raises(driftlab.ConfigError, match=r"algorithm\.alpha: Input should be greater than 0"):
        driftlab.load_config({"algorithm": {"name": "feddyn", "alpha": alpha}})
    with pytest.raises(ValueError, match="alpha > 0"):
        feddyn.build(alpha=alpha)


def test_server_optimizers_are_refused() -> None:
    with pytest.raises(driftlab.ConfigError, match="server.optimizer: feddyn has its own server step"):
        driftlab.run({**TINY, "algorithm": {"name": "feddyn"}, "server": {"optimizer": "adam"}})


@pytest.mark.parametrize("name", ["feddyn", "adabest"])
@pytest.mark.parametrize(
    "lr, shown",
    [
        (0.5, "0.5"),
        ({"kind": "exponential", "initial": 1.0, "decay": 0.99}, "ExponentialSchedule"),
        ({"kind": "inverse_time", "a": 2.0, "b": 1}, "InverseTimeSchedule"),
    ],
)
def test_a_server_lr_other_than_one_is_refused_by_config_validation(name: str, lr: object, shown: str) -> None:
    with pytest.raises(
        driftlab.ConfigError, match=rf"server\.lr: {name} has its own server step; set server\.lr = 1 \(got {shown}"
    ):
        driftlab.load_config({"algorithm": {"name": name}, "server": {"lr": lr}})


@pytest.mark.parametrize("lr", [1, 1.0, {"kind": "exponential", "initial": 1.0, "decay": 1.0}])
def test_a_server_lr_of_one_in_every_round_is_accepted(lr: object) -> None:
    for name in ("feddyn", "adabest"):
        assert driftlab.load_config({"algorithm": {"name": name}, "server": {"lr": lr}}).algorithm.name == name


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).
#
# FedDyn (α = 0.75, by_size: α_0 = 0.75·2/1 = 1.5, α_1 = 0.75·2/3 = 0.5).  Round 1, λ = 0:
#   client 0: → (1,0), then g = (−1,0) + 1.5(1,0) = (0.5,0) → (0.75,0); client 1: → (0,2),
#   then g = (0,−2) + 0.5(0,2) = (0,−1) → (0,2.5).  λ_0 = (0.75,0), λ_1 = (0,2.5);
#   θ^1 = mean θ_k + Σλ/4 = (0.375,1.25) + (0.1875,0.625) = (0.5625,1.875), drift ‖(0.1875,0.625)‖.
#   Round 2: client 0, α_0λ_0 = (1.125,0): → (0.71875,0.9375) → (0.6796875,1.171875),
#   λ_0 = (0.8671875,−0.703125); client 1, α_1λ_1 = (0,1.25): → (0.28125,2.3125)
#   → (0.2109375,2.421875), λ_1 = (−0.3515625,3.046875).
#   θ^2 = (0.4453125,1.796875) + ¼(0.515625,2.34375) = (0.57421875, 2.3828125).
HAND_CASE = {
    "config": {"alpha": 0.75},
    "params": [(0.5625, 1.875), (0.57421875, 2.3828125)],
    "drift": [math.hypot(0.1875, 0.625), math.hypot(0.12890625, 0.5859375)],
}


def test_an_own_server_step_that_uses_the_rate_keeps_server_lr(monkeypatch) -> None:
    """``uses_server_lr`` (not ``owns_server_step``) decides the server.lr check: a plugin's own step may take η_g."""
    from driftlab.algorithms import registry

    own_step_with_rate = dataclasses.replace(registry.ALGORITHMS["adabest"], uses_server_lr=True)
    monkeypatch.setitem(registry.ALGORITHMS, "adabest", own_step_with_rate)
    assert driftlab.load_config({"algorithm": {"name": "adabest"}, "server": {"lr": 0.5}}).server.lr == 0.5
    with pytest.raises(driftlab.ConfigError, match="server.optimizer: adabest has its own server step"):
        driftlab.load_config({"algorithm": {"name": "adabest"}, "server": {"optimizer": "adam"}})


def test_only_feddyn_adabest_and_fedamp_fix_the_server_lr() -> None:
    from driftlab.algorithms import registry

    # FedAMP's server keeps the clients' models and has no server step at all.
    assert {name for name in registry.BUILT_IN if not registry.ALGORITHMS[name].uses_server_lr} == {
        "feddyn",
        "adabest",
        "fedamp",
    }


def test_feddyn_private_round_means_changes_over_the_denominator_and_sums_them_once_into_the_lambda_sum():
    algorithm = feddyn.build(alpha=0.1)
    server = feddyn.ServerState(params=torch.tensor([1.0, 1.0]), dual_sum=torch.tensor([0.0, 4.0]))
    # A client drawn twice counts twice in the mean but once in Σλ (so the form's promise is for multiplicity 1).
    messages = [feddyn.ClientMessage(torch.tensor([3.0, 1.0]), 2), feddyn.ClientMessage(torch.tensor([1.0, 5.0]), 1)]
    new_server, _ = algorithm.server_update(server, messages, RoundContext(1, 4, 2, 1.0, mean_denominator=4.0))
    # mean = (1, 1) + (2·(2, 0) + (0, 4))/4 = (2, 2); Σλ = (0, 4) + (2, 0) + (0, 4) = (2, 8); θ = (2, 2) + (0.5, 2)
    assert torch.equal(new_server.dual_sum, torch.tensor([2.0, 8.0]))
    assert torch.equal(new_server.params, torch.tensor([2.5, 4.0]))
    view = algorithm.broadcast(server)
    assert torch.equal(algorithm.release.release(view, messages[0]), torch.tensor([2.0, 0.0]))
