"""FedProx: μ = 0 is FedAvg bit for bit, the proximal term's arithmetic, FedAvg's server step, config validation."""

from __future__ import annotations

import pytest
import torch

import driftlab
from driftlab.algorithms import fedprox
from driftlab.algorithms.shared_test import TINY, without_wall_time
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.local_training import LocalSettings, corrected_step
from driftlab.simulation.seam import NO_CORRECTION, ClientContext, ClientUpdate, RoundContext


def run_with(algorithm: dict, *overrides: str) -> driftlab.RunResult:
    return driftlab.run({**TINY, "algorithm": algorithm}, overrides=list(overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("sampling.mode=weighted", "algorithm.aggregation=uniform"),  # FedProx Algorithm 2: draws ∝ n_k, simple average
        ("server.optimizer=adam", "server.lr=0.01"),  # FedProx composes with server optimizers
        ("client.clip_norm=0.5", "client.weight_decay=0.001"),
    ],
)
def test_mu_zero_is_fedavg_bit_for_bit(overrides: tuple[str, ...]) -> None:
    aggregation = "uniform" if "algorithm.aggregation=uniform" in overrides else "weighted"
    rest = tuple(o for o in overrides if not o.startswith("algorithm."))
    prox = run_with({"name": "fedprox", "mu": 0.0, "aggregation": aggregation}, *rest)
    avg = run_with({"name": "fedavg", "aggregation": aggregation}, *rest)
    assert torch.equal(prox.final_params, avg.final_params)
    assert without_wall_time(prox.records) == without_wall_time(avg.records)


def test_positive_mu_changes_the_run() -> None:
    prox = run_with({"name": "fedprox", "mu": 1.0})
    avg = run_with({"name": "fedavg"})
    assert not torch.equal(prox.final_params, avg.final_params)
    # one model each way per client, like FedAvg
    assert prox.records[0]["upload_bits"] == 32 * prox.num_parameters * prox.records[0]["num_selected"]


def test_correction_is_absent_at_mu_zero_and_proximal_otherwise() -> None:
    theta0 = torch.tensor([1.0, -2.0], dtype=torch.float64)
    context = ClientContext(0, 1, 10, 10.0, 4, 2, 0.1)
    zero = fedprox.build(make_server_optimizer("sgd"), mu=0.0)
    assert zero.client_objective(zero.broadcast(zero.server_init(theta0)), None, context) is NO_CORRECTION
    algorithm = fedprox.build(make_server_optimizer("sgd"), mu=0.5)
    correction = algorithm.client_objective(algorithm.broadcast(algorithm.server_init(theta0)), None, context)
    assert correction.linear is None and correction.quadratic == 0.5 and torch.equal(correction.reference, theta0)
    # θ = (3, 0), ∇f = (1, 1): g = (1,1) + 0.5((3,0) − (1,−2)) = (2, 2);  θ − 0.1 g = (2.8, −0.2)
    theta = torch.tensor([3.0, 0.0], dtype=torch.float64)
    stepped = corrected_step(theta, torch.ones(2, dtype=torch.float64), correction, LocalSettings(0.1))
    assert torch.allclose(stepped, torch.tensor([2.8, -0.2], dtype=torch.float64), rtol=0, atol=1e-15)


def test_server_step_is_fedavgs_with_the_server_learning_rate() -> None:
    # θ^0 = (0, 0); clients return (4, 0) with n = 1 and (0, 4) with n = 3; θ̄ = (1, 3);
    # SGD server at η_g = 0.5: θ^1 = θ^0 − 0.5 (θ^0 − θ̄) = (0.5, 1.5).
    algorithm = fedprox.build(make_server_optimizer("sgd"), mu=0.1)
    server = algorithm.server_init(torch.zeros(2, dtype=torch.float64))
    messages = []
    for client, (final, size) in enumerate([((4.0, 0.0), 1), ((0.0, 4.0), 3)]):
        context = ClientContext(client, 1, size, 2.0, 2, 5, 0.1)
        update = ClientUpdate(server.params, torch.tensor(final, dtype=torch.float64), 3)  # partial work is kept
        state, message = algorithm.client_finish(algorithm.broadcast(server), None, context, update)
        assert state is None
        messages.append(message)
    server, metrics = algorithm.server_update(server, messages, RoundContext(1, 2, 2, 0.5))
    assert torch.equal(server.params, torch.tensor([0.5, 1.5], dtype=torch.float64))
    assert metrics == {}


@pytest.mark.parametrize("mu", [-1, -0.001])
def test_negative_mu_is_rejected_with_the_key(mu: float) -> None:
    with pytest.raises(driftlab.ConfigError, match=r"algorithm\.mu: Input should be greater than or equal to 0"):
        driftlab.load_config({"algorithm": {"name": "fedprox", "mu": mu}})
    with pytest.raises(ValueError, match="mu >= 0"):
        fedprox.build(make_server_optimizer("sgd"), mu=mu)


def test_unknown_key_is_rejected() -> None:
    with pytest.raises(
        driftlab.ConfigError, match=r"algorithm\.alpha: unknown key; valid keys here: name, mu, aggregation"
    ):
        driftlab.load_config({"algorithm": {"name": "fedprox", "alpha": 0.1}})


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).
#
# FedProx (μ = 1, weighted).  Each local problem ½‖θ−b‖² + ½‖θ−θ^{t−1}‖² has curvature 2,
#   so one step of η = 0.5 lands on its minimiser (b + θ^{t−1})/2 and the second stays.
#   θ^1 = ¼(1,0) + ¾(0,2) = (0.25, 1.5); round 2: (1.125,0.75), (0.125,2.75);
#   θ^2 = ¼(1.125,0.75) + ¾(0.125,2.75) = (0.375, 2.25).
HAND_CASE = {"config": {"mu": 1.0}, "params": [(0.25, 1.5), (0.375, 2.25)], "drift": None}


def test_fedprox_has_fedavgs_release_form_with_uniform_aggregation():
    uniform = fedprox.build(make_server_optimizer("sgd"), mu=0.1, aggregation="uniform")
    view = uniform.broadcast(uniform.server_init(torch.tensor([1.0, 2.0])))
    message = uniform.release.restore(view, None, torch.tensor([1.0, 1.0]))
    assert torch.equal(uniform.release.release(view, message), torch.tensor([1.0, 1.0]))
    assert uniform.name == "fedprox" and uniform.release_refusal is None
    weighted = fedprox.build(make_server_optimizer("sgd"), mu=0.1)  # the authors' weighted average, the default
    assert weighted.release is None and 'set algorithm.aggregation = "uniform"' in weighted.release_refusal
