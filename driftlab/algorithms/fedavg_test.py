"""FedAvg and FedSGD/FedOpt checked against hand computations (algorithms.md, "FedAvg", "FedSGD / FedOpt")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import driftlab
from driftlab.algorithms import fedavg
from driftlab.algorithms.testing import every_client_plan
from driftlab.data.federated import FederatedDataset
from driftlab.experiments.run import runner as runner_module
from driftlab.models import build_model
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import SequentialBackend
from driftlab.simulation.round.engine import run_round
from driftlab.simulation.round.setup import Simulation, SimulationState
from driftlab.simulation.seam import RoundContext
from driftlab.simulation.state.state_store import InMemoryClientStore

# ------------------------------------------------------------------ a round by hand

# Two clients, one feature, two classes. Client 0 holds rows 0, 1; client 1 holds row 2.
TRAIN_X = [1.0, 2.0, -1.0]
TRAIN_Y = [0, 1, 1]
CLIENTS = ([0, 1], [2])
# MLR parameters in the flat order of nn.Linear(1, 2): weight [w0, w1], then bias [b0, b1].
THETA0 = [0.5, -0.5, 0.1, 0.0]
LR = 0.1


def _softmax(z: list[float]) -> list[float]:
    top = max(z)
    e = [math.exp(v - top) for v in z]
    return [v / sum(e) for v in e]


def _hand_gradient(theta: list[float], rows: list[int]) -> list[float]:
    """∇ of the mean softmax cross-entropy of the 1-feature MLR over ``rows``, in plain Python."""
    w, b = theta[:2], theta[2:]
    grad = [0.0, 0.0, 0.0, 0.0]
    for row in rows:
        x, y = TRAIN_X[row], TRAIN_Y[row]
        p = _softmax([w[0] * x + b[0], w[1] * x + b[1]])
        for c in range(2):
            residual = p[c] - (1.0 if c == y else 0.0)
            grad[c] += residual * x / len(rows)  # d/dw_c
            grad[2 + c] += residual / len(rows)  # d/db_c
    return grad


def _hand_client_model(rows: list[int]) -> list[float]:
    g = _hand_gradient(THETA0, rows)
    return [t - LR * gi for t, gi in zip(THETA0, g, strict=True)]


def _tiny_simulation(
    aggregation: str, server_optimizer: str = "sgd", server_lr: float = 1.0
) -> tuple[Simulation, SimulationState]:
    data = FederatedDataset(
        name="two-clients",
        train_inputs=torch.tensor(TRAIN_X, dtype=torch.float64).reshape(-1, 1),
        train_targets=torch.tensor(TRAIN_Y, dtype=torch.int64),
        test_inputs=torch.tensor([[0.5]], dtype=torch.float64),
        test_targets=torch.tensor([0]),
        client_indices=tuple(np.array(rows, dtype=np.int64) for rows in CLIENTS),
        num_classes=2,
    )
    model = FlatModel.wrap(build_model("mlr", (1,), 2)).to("cpu", torch.float64)
    assert model.names == ("linear.weight", "linear.bias")
    algorithm = fedavg.build(make_server_optimizer(server_optimizer), aggregation=aggregation)
    plan = every_client_plan(1, client_lr=LR, server_lr=server_lr)  # one step: a full-batch gradient step
    theta0 = torch.tensor(THETA0, dtype=torch.float64)
    sim = Simulation(
        model, data, algorithm, SequentialBackend(), plan, torch.device("cpu"), torch.float64, initial_params=theta0
    )
    return sim, SimulationState(0, algorithm.server_init(theta0), InMemoryClientStore(None))


def test_fedavg_round_on_two_clients_matches_hand_computation():
    sim, state = _tiny_simulation("weighted")
    new_state, record = run_round(sim, state)

    client0, client1 = _hand_client_model([0, 1]), _hand_client_model([2])
    # w_k = n_k / Σ n_j = 2/3 and 1/3
    expected = [2 / 3 * a + 1 / 3 * b for a, b in zip(client0, client1, strict=True)]
    assert new_state.round == 1
    assert new_state.server.params.tolist() == pytest.approx(expected, abs=1e-12)
    # sanity: the hand numbers are not trivially the start point
    assert max(abs(e - t) for e, t in zip(expected, THETA0, strict=True)) > 1e-3
    assert record["round"] == 1
    assert record["reporting_clients"] == [0, 1]
    assert record["num_reporting"] == 2
    assert record["local_steps"] == 2
    assert record["upload_bits"] == 2 * 32 * 4
    assert record["download_bits"] == 2 * 32 * 4


def test_fedavg_uniform_aggregation_is_plain_mean():
    sim, state = _tiny_simulation("uniform")
    new_state, _ = run_round(sim, state)
    client0, client1 = _hand_client_model([0, 1]), _hand_client_model([2])
    expected = [(a + b) / 2 for a, b in zip(client0, client1, strict=True)]
    assert new_state.server.params.tolist() == pytest.approx(expected, abs=1e-12)


def test_fedsgd_server_lr_scales_the_pseudo_gradient():
    """θ^t = θ^{t−1} − η_g q with q = θ^{t−1} − Σ w_k θ_k."""
    sim, state = _tiny_simulation("weighted", server_lr=0.5)
    new_state, record = run_round(sim, state)
    client0, client1 = _hand_client_model([0, 1]), _hand_client_model([2])
    average = [2 / 3 * a + 1 / 3 * b for a, b in zip(client0, client1, strict=True)]
    expected = [t - 0.5 * (t - m) for t, m in zip(THETA0, average, strict=True)]
    assert new_state.server.params.tolist() == pytest.approx(expected, abs=1e-12)
    assert record["server_lr"] == 0.5


# ------------------------------------------------------------------ FedSGD with η_g = 1 is FedAvg, bit for bit

TINY = ["rounds=4", "data.num_clients=6", "sampling.participation=0.5", "client.steps=3", "seed=3"]


def _without_wall_time(records):
    return [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]


def test_fedsgd_with_server_lr_one_equals_fedavg_bit_for_bit():
    default = driftlab.run(None, overrides=TINY)
    explicit = driftlab.run(None, overrides=[*TINY, "server.optimizer=sgd", "server.lr=1.0"])
    scheduled = driftlab.run(None, overrides=[*TINY, 'server.lr={kind="exponential", initial=1.0, decay=1.0}'])
    for other in (explicit, scheduled):
        assert torch.equal(default.final_params, other.final_params)
        assert _without_wall_time(default.records) == _without_wall_time(other.records)
    # and a server lr that is not 1 does change the model
    damped = driftlab.run(None, overrides=[*TINY, "server.lr=0.5"])
    assert not torch.equal(default.final_params, damped.final_params)


class _RecordingBackend:
    """Wraps a training backend and keeps every client's final model."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rounds: list[dict[int, torch.Tensor]] = []

    def train(self, model, start_params, tasks, settings, data):
        finals: dict[int, torch.Tensor] = {}
        self.rounds.append(finals)
        for item in self.inner.train(model, start_params, tasks, settings, data):
            finals[tasks[item[0]].client_id] = item[1].clone()
            yield item


def test_fedavg_new_params_are_exactly_the_weighted_average_of_client_models(monkeypatch):
    recorders = []

    def recording(factory):
        def make(**options):
            recorders.append(_RecordingBackend(factory(**options)))
            return recorders[-1]

        return make

    for name, factory in list(runner_module.BACKENDS.items()):  # whichever backend the default config picks
        monkeypatch.setitem(runner_module.BACKENDS, name, recording(factory))
    config = driftlab.load_config(None, [*TINY, "rounds=1"])
    sim, state = runner_module.build_simulation(config)
    new_state, record = run_round(sim, state)

    (backend,) = recorders
    finals = backend.rounds[0]
    ids = record["reporting_clients"]
    assert sorted(finals) == ids and len(ids) == 3
    sizes = [int(sim.data.client_sizes[k]) for k in ids]
    assert len(set(sizes)) > 1  # unequal n_k, so weighted differs from uniform
    # Σ_P n_k θ_k summed in sample order, then divided once by Σ_P n_k (the server's running sum).
    weighted = float(sizes[0]) * finals[ids[0]]
    for k, n in zip(ids[1:], sizes[1:], strict=True):
        weighted = weighted + float(n) * finals[k]
    expected = weighted / float(sum(sizes))
    assert torch.equal(new_state.server.params, expected)
    uniform = sum(finals[k] for k in ids) / len(ids)
    assert not torch.allclose(new_state.server.params, uniform)


# ------------------------------------------------------------------ FedAdam's first step by hand


@pytest.mark.parametrize("bias_correction", [True, False])
def test_fedadam_first_step_by_hand(bias_correction):
    beta1, beta2, eps, lr = 0.9, 0.999, 1e-8, 0.01
    optimizer = make_server_optimizer("adam", beta1=beta1, beta2=beta2, epsilon=eps, bias_correction=bias_correction)
    algorithm = fedavg.build(optimizer, aggregation="weighted")
    theta0 = [1.0, -2.0, 0.5, 0.0]
    client_a = [0.8, -1.0, 0.5, 0.3]  # n = 3
    client_b = [1.4, -2.6, 0.2, -0.3]  # n = 1
    server = algorithm.server_init(torch.tensor(theta0, dtype=torch.float64))
    messages = [
        fedavg.ClientMessage(torch.tensor(client_a, dtype=torch.float64), 3, 1),
        fedavg.ClientMessage(torch.tensor(client_b, dtype=torch.float64), 1, 1),
    ]
    new_server, _ = algorithm.server_update(
        server, messages, RoundContext(round=1, num_registered=2, num_selected=2, server_learning_rate=lr)
    )

    expected = []
    step_size = lr * math.sqrt(1 - beta2) / (1 - beta1) if bias_correction else lr
    for t, a, b in zip(theta0, client_a, client_b, strict=True):
        q = t - (0.75 * a + 0.25 * b)
        m = (1 - beta1) * q
        v = (1 - beta2) * q * q
        expected.append(t - step_size * m / (math.sqrt(v) + eps))
    assert new_server.params.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert new_server.optimizer_state.step == 1
    if bias_correction:
        # the textbook property: Adam's bias-corrected first step moves each coordinate by ≈ η against sign(q)
        moved = [abs(n - t) for n, t in zip(new_server.params.tolist(), theta0, strict=True)]
        for coordinate, distance in enumerate(moved):
            q = theta0[coordinate] - (0.75 * client_a[coordinate] + 0.25 * client_b[coordinate])
            assert distance == pytest.approx(lr if abs(q) > 1e-6 else 0.0, rel=1e-4, abs=1e-9)
    else:
        # without bias correction the step is η·(1−β1)/√(1−β2) ≈ 3.16 η
        q0 = theta0[0] - (0.75 * client_a[0] + 0.25 * client_b[0])
        assert abs(new_server.params[0].item() - theta0[0]) == pytest.approx(
            lr * (1 - beta1) / math.sqrt(1 - beta2), rel=1e-4
        )
        assert q0 != 0


def test_fedavg_counts_multiplicity_as_repeated_draws():
    algorithm = fedavg.build(make_server_optimizer("sgd"), aggregation="uniform")
    server = algorithm.server_init(torch.zeros(2, dtype=torch.float64))
    messages = [
        fedavg.ClientMessage(torch.tensor([3.0, 0.0], dtype=torch.float64), 10, 2),
        fedavg.ClientMessage(torch.tensor([0.0, 3.0], dtype=torch.float64), 10, 1),
    ]
    new_server, _ = algorithm.server_update(server, messages, RoundContext(1, 2, 2, 1.0))
    assert new_server.params.tolist() == pytest.approx([2.0, 1.0])


def test_fedavg_rejects_unknown_aggregation():
    with pytest.raises(ValueError, match="weighted, uniform"):
        fedavg.build(make_server_optimizer("sgd"), aggregation="median")


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).
#
# FedAvg (weighted, w = 1/4, 3/4).  Round 1: client 0: (0,0) → (1,0) → (1.5,0); client 1:
#   (0,0) → (0,2) → (0,3); θ^1 = ¼(1.5,0) + ¾(0,3) = (0.375, 2.25).  Round 2: client 0:
#   → (1.1875,1.125) → (1.59375,0.5625); client 1: → (0.1875,3.125) → (0.09375,3.5625);
#   θ^2 = ¼(1.59375,0.5625) + ¾(0.09375,3.5625) = (0.46875, 2.8125).
HAND_CASE = {"config": {}, "params": [(0.375, 2.25), (0.46875, 2.8125)], "drift": None}


def test_fedavg_private_round_averages_changes_over_the_public_denominator():
    # mean_denominator m: θ + Σ_P r_k (θ_k − θ) / m; a client drawn twice (multiplicity 2) still counts twice,
    # which is why the release form's promise is for multiplicity 1 (poisson or uniform sampling).
    algorithm = fedavg.build(make_server_optimizer("sgd"), aggregation="uniform")
    server = algorithm.server_init(torch.tensor([1.0, 1.0]))
    messages = [
        fedavg.ClientMessage(torch.tensor([3.0, 1.0]), 10, 2),
        fedavg.ClientMessage(torch.tensor([1.0, 5.0]), 10, 1),
    ]
    new_server, _ = algorithm.server_update(server, messages, RoundContext(1, 10, 2, 1.0, mean_denominator=4.0))
    assert torch.equal(new_server.params, torch.tensor([2.0, 2.0]))  # (1, 1) + (2·(2, 0) + (0, 4))/4
    plain, _ = algorithm.server_update(server, messages, RoundContext(1, 10, 2, 1.0))
    assert torch.equal(plain.params, torch.tensor([7.0 / 3.0, 7.0 / 3.0]))  # (2·(3, 1) + (1, 5))/3


def test_fedavg_release_form_only_with_uniform_aggregation():
    weighted = fedavg.build(make_server_optimizer("sgd"), aggregation="weighted", incomplete="keep")
    assert weighted.release is None and 'set algorithm.aggregation = "uniform"' in weighted.release_refusal
    uniform = fedavg.build(make_server_optimizer("sgd"), aggregation="uniform", incomplete="keep")
    view = uniform.broadcast(uniform.server_init(torch.tensor([1.0, 2.0])))
    carrier = uniform.release.restore(view, None, torch.tensor([0.5, -1.0]))
    assert isinstance(carrier, fedavg.ClientMessage) and carrier.multiplicity == 1
    assert torch.equal(carrier.params, torch.tensor([1.5, 1.0]))
