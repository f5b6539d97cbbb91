"""EFL (algorithms.md "EFL" and "Client availability"), checked by hand and end to end.

Hand checks drive ``efl.build``'s functions directly with ``seam`` objects;
end-to-end checks run tiny ``driftlab.run`` configs (mlr on synthetic data:
tensors of 600 and 10 entries, P = 610).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.algorithms import efl
from driftlab.algorithms.registry import BUILT_IN
from driftlab.algorithms.testing import every_client_plan
from driftlab.compress import with_compression
from driftlab.data.federated import FederatedDataset
from driftlab.metrics.communication import payload_bits
from driftlab.models import build_model
from driftlab.optim.server import make_server_optimizer
from driftlab.randomness import Stream, generator
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import LocalSettings, SequentialBackend, corrected_step
from driftlab.simulation.round.availability import AvailabilityModel, steps_to_do
from driftlab.simulation.round.client import ClientDataComputation
from driftlab.simulation.round.engine import client_data
from driftlab.simulation.round.setup import Simulation
from driftlab.simulation.seam import NO_CORRECTION, ClientContext, ClientUpdate, RoundContext

P_MLR = 610
ST_BITS_Q01 = (32 + 60 + min(600, 60 * 10)) + (32 + 1 + min(10, 1 * 4))  # 692 + 37 = 729
TINY = [
    "rounds=3",
    "data.num_clients=6",
    "sampling.participation=0.5",
    "client.steps=3",
    "seed=3",
    "evaluation.every=100",
]


def without_wall_time(records):
    return [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]


def sgd() -> object:
    return make_server_optimizer("sgd")


def context(
    client_id: int, round_index: int, num_samples: int, planned: int = 4, available: int | None = None
) -> ClientContext:
    """Client ``client_id``'s context in round ``round_index``: ``available`` local steps (``planned`` when None)
    of the ``planned`` ones, at client_lr 0.1.  Shared with compress/error_feedback_test.py."""
    return ClientContext(
        client_id=client_id,
        round=round_index,
        num_samples=num_samples,
        mean_num_samples=4.0,
        num_registered=3,
        planned_steps=planned,
        client_lr=0.1,
        available_steps=planned if available is None else available,
    )


@dataclasses.dataclass(frozen=True)
class FakeFisher:
    """A ClientComputation whose diagonal Fisher at θ is θ² + c (and which remembers where it was asked)."""

    offset: float
    calls: list = dataclasses.field(default_factory=list)

    def diagonal_fisher(self, params: torch.Tensor, max_examples: int) -> torch.Tensor:
        self.calls.append((params.clone(), max_examples))
        return params**2 + self.offset


# ------------------------------------------------------------------ incomplete clients: adaptive, plain, drop


THETA = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
THETA_1 = torch.tensor([1.5, -1.0, 0.0], dtype=torch.float64)  # client 1: complete, n = 2
THETA_2 = torch.tensor([0.0, -2.5, 2.5], dtype=torch.float64)  # client 2: s = 2 of E = 4 steps, n = 6


def _two_client_round(incomplete: str):
    algorithm = efl.build(sgd(), elastic=0.0, incomplete=incomplete)
    server = algorithm.server_init(THETA)
    messages = []
    for client_id, n, final, done in ((1, 2, THETA_1, 4), (2, 6, THETA_2, 2)):
        state = algorithm.client_state_init(THETA)
        ctx = context(client_id, 1, n, planned=4, available=done)
        _, message = algorithm.client_finish(algorithm.broadcast(server), state, ctx, ClientUpdate(THETA, final, done))
        if message is not None:
            messages.append(message)
    new_server, _ = algorithm.server_update(server, messages, RoundContext(1, 3, 2, 1.0))
    return new_server.params, messages


def test_adaptive_weights_by_hand():
    params, messages = _two_client_round("adaptive")
    # w = 2/8, 6/8; p_1 = 1/4, p_2 = 3/4 · E/s = 3/4 · 4/2 = 3/2;  θ⁺ = θ + Σ p_k (θ_k − θ)
    expected = [
        t + 0.25 * (a - t) + 1.5 * (b - t)
        for t, a, b in zip(THETA.tolist(), THETA_1.tolist(), THETA_2.tolist(), strict=True)
    ]
    assert expected == pytest.approx([-0.375, -2.5, 3.375], abs=1e-15)
    assert params.tolist() == pytest.approx(expected, abs=1e-12)
    assert [m.completed_fraction for m in messages] == [1.0, 0.5]


def test_plain_weights_by_hand():
    params, _ = _two_client_round("plain")
    expected = [0.25 * a + 0.75 * b for a, b in zip(THETA_1.tolist(), THETA_2.tolist(), strict=True)]
    assert params.tolist() == pytest.approx(expected, abs=1e-12)
    assert params.tolist() == pytest.approx([0.375, -2.125, 1.875], abs=1e-12)


def test_drop_discards_the_incomplete_client():
    params, messages = _two_client_round("drop")
    assert len(messages) == 1
    assert torch.equal(params, THETA_1)  # the only reporting client, w = 1


def test_adaptive_with_every_client_complete_is_the_weighted_average_exactly():
    algorithm = efl.build(sgd(), elastic=0.0)
    server = algorithm.server_init(THETA)
    messages = [
        algorithm.client_finish(
            algorithm.broadcast(server), None, context(k, 1, n, 4, 4), ClientUpdate(THETA, final, 4)
        )[1]
        for k, n, final in ((1, 2, THETA_1), (2, 6, THETA_2))
    ]
    new_server, metrics = algorithm.server_update(server, messages, RoundContext(1, 3, 2, 1.0))
    assert torch.equal(new_server.params, 0.25 * THETA_1 + 0.75 * THETA_2)
    assert metrics == {}


def test_adaptive_weights_in_epochs_match_steps():
    """Whole epochs: E = 3 epochs of 2 steps, s = 2 epochs → E/s = 6/4 = 3/2 all the same."""
    algorithm = efl.build(sgd(), elastic=0.0)
    server = algorithm.server_init(THETA)
    m1 = algorithm.client_finish(
        algorithm.broadcast(server), None, context(1, 1, 2, 6, 6), ClientUpdate(THETA, THETA_1, 6)
    )[1]
    m2 = algorithm.client_finish(
        algorithm.broadcast(server), None, context(2, 1, 2, 6, 4), ClientUpdate(THETA, THETA_2, 4)
    )[1]
    new_server, _ = algorithm.server_update(server, [m1, m2], RoundContext(1, 3, 2, 1.0))
    expected = THETA + 0.5 * (THETA_1 - THETA) + 0.5 * 1.5 * (THETA_2 - THETA)
    assert torch.allclose(new_server.params, expected, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ elastic correction and U, V bookkeeping


def test_client_objective_is_the_elastic_term():
    algorithm = efl.build(sgd(), elastic=0.5)
    server = algorithm.server_init(THETA)
    U = torch.tensor([2.0, 0.0, 4.0], dtype=torch.float64)
    V = torch.tensor([1.0, 0.0, -3.0], dtype=torch.float64)
    server = dataclasses.replace(server, fisher_sum=U, weighted_model_sum=V)
    correction = algorithm.client_objective(
        algorithm.broadcast(server), algorithm.client_state_init(THETA), context(0, 1, 1, 4, 4)
    )
    assert correction.linear is None  # the elastic term is all quadratic, so clipping leaves it out
    assert correction.quadratic.tolist() == [1.0, 0.0, 2.0]  # λU
    assert correction.reference.tolist() == [0.5, 0.0, -0.75]  # V/U, 0 where U = 0
    # one SGD step: θ − η (∇f + λ (U ⊙ θ − V))
    theta = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    grad = torch.tensor([0.1, 0.2, -0.4], dtype=torch.float64)
    stepped = corrected_step(theta, grad, correction, LocalSettings(0.1))
    expected = [
        t - 0.1 * (g + 0.5 * (u * t - v))
        for t, g, u, v in zip(theta.tolist(), grad.tolist(), U.tolist(), V.tolist(), strict=True)
    ]
    assert expected == pytest.approx([0.31, -1.02, 1.49], abs=1e-15)
    assert stepped.tolist() == pytest.approx(expected, abs=1e-14)


def test_lambda_zero_has_no_correction_no_fisher_pass_and_no_uv_traffic():
    algorithm = efl.build(sgd(), elastic=0.0)
    server = algorithm.server_init(THETA)
    assert (
        algorithm.client_objective(
            algorithm.broadcast(server), algorithm.client_state_init(THETA), context(0, 1, 1, 4, 4)
        )
        is NO_CORRECTION
    )
    fake = FakeFisher(1.0)
    _, message = algorithm.client_finish(
        algorithm.broadcast(server), None, context(0, 1, 1, 4, 4), ClientUpdate(THETA, THETA_1, 4, fake)
    )
    assert fake.calls == []
    assert message.fisher_change is None and message.weighted_model_change is None
    assert payload_bits(message) == 32 * 3
    assert payload_bits(algorithm.broadcast(server)) == 32 * 3


def test_positive_lambda_needs_the_clients_data():
    algorithm = efl.build(sgd(), elastic=0.5)
    server = algorithm.server_init(THETA)
    with pytest.raises(RuntimeError, match="Fisher"):
        algorithm.client_finish(
            algorithm.broadcast(server),
            algorithm.client_state_init(THETA),
            context(0, 1, 1, 4, 4),
            ClientUpdate(THETA, THETA_1, 4),
        )


def test_elastic_term_is_added_after_clipping():
    algorithm = efl.build(sgd(), elastic=0.5)
    U = torch.tensor([2.0, 1.0, 4.0], dtype=torch.float64)
    V = torch.tensor([1.0, 3.0, -3.0], dtype=torch.float64)
    server = dataclasses.replace(algorithm.server_init(THETA), fisher_sum=U, weighted_model_sum=V)
    correction = algorithm.client_objective(
        algorithm.broadcast(server), algorithm.client_state_init(THETA), context(0, 1, 1, 4, 4)
    )
    theta = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    grad = torch.tensor([3.0, 0.0, -4.0], dtype=torch.float64)  # ‖∇f‖ = 5
    stepped = corrected_step(theta, grad, correction, LocalSettings(0.1, clip_norm=1.0))
    clipped = grad * (1.0 / (5.0 + 1e-6))
    expected = theta - 0.1 * (clipped + 0.5 * (U * theta - V))
    assert torch.allclose(stepped, expected, rtol=0, atol=1e-12)


def test_u_v_are_sums_of_each_clients_latest_report():
    algorithm = efl.build(sgd(), elastic=0.5, fisher_examples=7)
    theta0 = torch.zeros(3, dtype=torch.float64)
    server = algorithm.server_init(theta0)
    store = {}
    fakes = {0: FakeFisher(1.0), 1: FakeFisher(2.0), 2: FakeFisher(0.5)}
    rounds = [
        {0: torch.tensor([1.0, 2.0, 3.0]), 1: torch.tensor([-1.0, 0.5, 0.0])},  # round 1: clients 0 and 1
        {0: torch.tensor([2.0, -1.0, 1.0]), 2: torch.tensor([0.0, 1.0, -2.0])},  # round 2: client 0 again, client 2 new
    ]
    for t, reports in enumerate(rounds, start=1):
        messages = []
        for k, local in reports.items():
            local = local.to(torch.float64)
            state = store.get(k) or algorithm.client_state_init(theta0)
            state, message = algorithm.client_finish(
                algorithm.broadcast(server),
                state,
                context(k, t, 1, 4, 4),
                ClientUpdate(server.params, local, 4, fakes[k]),
            )
            store[k] = state
            messages.append(message)
            assert payload_bits(message) == 3 * 32 * 3  # θ_k, u_k, v_k at 32 bits per entry
        server, metrics = algorithm.server_update(server, messages, RoundContext(t, 3, 2, 1.0))
    latest = {0: torch.tensor([2.0, -1.0, 1.0]), 1: torch.tensor([-1.0, 0.5, 0.0]), 2: torch.tensor([0.0, 1.0, -2.0])}
    u = {k: latest[k].double() ** 2 + fakes[k].offset for k in latest}
    U = sum(u.values())
    V = sum(u[k] * latest[k].double() for k in latest)
    assert U.tolist() == pytest.approx([8.5, 5.75, 8.5], abs=1e-15)
    assert torch.allclose(server.fisher_sum, U, rtol=0, atol=1e-12)
    assert torch.allclose(server.weighted_model_sum, V, rtol=0, atol=1e-12)
    assert metrics["fisher_sum_norm"] == pytest.approx(float(torch.linalg.vector_norm(U)), rel=1e-12)
    # client states hold their latest u_k, v_k; the Fisher pass used the client's model and the configured bound
    assert torch.equal(store[1].fisher, u[1]) and torch.equal(store[0].weighted_model, u[0] * latest[0].double())
    assert [call[1] for call in fakes[0].calls] == [7, 7]
    # broadcast: θ, U, V
    view = algorithm.broadcast(server)
    assert view == efl.ClientView(server.params, server.fisher_sum, server.weighted_model_sum)
    assert not hasattr(view, "optimizer_state")  # the server optimizer's state stays on the server
    assert payload_bits(algorithm.broadcast(server)) == 3 * 32 * 3


def test_drop_keeps_u_v_of_an_incomplete_client():
    algorithm = efl.build(sgd(), elastic=0.5, incomplete="drop")
    theta0 = torch.zeros(3, dtype=torch.float64)
    server = algorithm.server_init(theta0)
    state = algorithm.client_state_init(theta0)
    fake = FakeFisher(1.0)
    new_state, message = algorithm.client_finish(
        algorithm.broadcast(server), state, context(0, 1, 1, 4, 2), ClientUpdate(theta0, THETA_1, 2, fake)
    )
    assert message is None and new_state is state and fake.calls == []


def test_compressed_efl_computes_fisher_at_the_local_model_and_sends_reconstructed_theta():
    algorithm = with_compression(efl.build(sgd(), elastic=0.5), 0.5, (4,))
    theta0 = torch.zeros(4, dtype=torch.float64)
    local = torch.tensor([1.0, -3.0, 0.5, 2.0], dtype=torch.float64)
    server = algorithm.server_init(theta0)
    fake = FakeFisher(1.0)
    state, message = algorithm.client_finish(
        algorithm.broadcast(server),
        algorithm.client_state_init(theta0),
        context(0, 1, 1, 4, 4),
        ClientUpdate(theta0, local, 4, fake),
    )
    assert torch.equal(fake.calls[0][0], local)
    assert message.payload.params.tolist() == [0.0, -2.5, 0.0, 2.5]
    assert torch.equal(message.payload.fisher_change, local**2 + 1.0)
    assert torch.equal(message.payload.weighted_model_change, (local**2 + 1.0) * local)
    # ST of a 4-tensor at k = 2: 32 + 2 + min(4, 2·2); u and v at 32 bits per entry
    assert message.bits == (32 + 2 + 4) + 2 * 32 * 4
    assert state.residual.tolist() == [1.0, -0.5, 0.5, -0.5]


# ------------------------------------------------------------------ diagonal Fisher of softmax regression by hand

FEATURES = [[1.0, 2.0], [-1.0, 0.5], [0.0, -1.5], [2.0, 1.0], [0.5, 0.5], [-2.0, -1.0], [1.5, -0.5]]
LABELS = [0, 2, 1, 1, 0, 2, 2]
CLIENT_ROWS = ([0, 1, 2, 3, 4, 5], [6])
# nn.Linear(2, 3): weight [[w00, w01], [w10, w11], [w20, w21]] row-major, then bias [b0, b1, b2]
FISHER_THETA = [0.3, -0.2, 0.1, 0.4, -0.5, 0.2, 0.05, -0.1, 0.0]


def _fisher_simulation(seed: int = 0) -> Simulation:
    data = FederatedDataset(
        name="fisher",
        train_inputs=torch.tensor(FEATURES, dtype=torch.float64),
        train_targets=torch.tensor(LABELS, dtype=torch.int64),
        test_inputs=torch.tensor([[0.0, 0.0]], dtype=torch.float64),
        test_targets=torch.tensor([0]),
        client_indices=tuple(np.array(rows, dtype=np.int64) for rows in CLIENT_ROWS),
        num_classes=3,
    )
    model = FlatModel.wrap(build_model("mlr", (2,), 3)).to("cpu", torch.float64)
    assert model.names == ("linear.weight", "linear.bias") and model.numels == (6, 3)
    plan = every_client_plan(1, seed=seed)
    theta = torch.tensor(FISHER_THETA, dtype=torch.float64)
    algorithm = efl.build(sgd(), elastic=0.5)
    return Simulation(
        model, data, algorithm, SequentialBackend(), plan, torch.device("cpu"), torch.float64, initial_params=theta
    )


def _fisher_pass(sim: Simulation, client_id: int, round_index: int) -> ClientDataComputation:
    """The Fisher pass on one client's own data, its sample drawn from (the run's seed, round, client id)."""
    return ClientDataComputation(client_data(sim, client_id), sim.plan.seed, round_index, client_id)


def _hand_fisher(rows: list[int]) -> list[float]:
    """Mean over rows of the squared per-example gradient of the CE: ∂/∂W_cj = (p_c − y_c) x_j, ∂/∂b_c = p_c − y_c."""
    w = [FISHER_THETA[0:2], FISHER_THETA[2:4], FISHER_THETA[4:6]]
    b = FISHER_THETA[6:9]
    total = [0.0] * 9
    for row in rows:
        x, y = FEATURES[row], LABELS[row]
        z = [w[c][0] * x[0] + w[c][1] * x[1] + b[c] for c in range(3)]
        e = [math.exp(v - max(z)) for v in z]
        p = [v / sum(e) for v in e]
        for c in range(3):
            r = p[c] - (1.0 if c == y else 0.0)
            total[2 * c] += (r * x[0]) ** 2
            total[2 * c + 1] += (r * x[1]) ** 2
            total[6 + c] += r**2
    return [v / len(rows) for v in total]


def test_diagonal_fisher_of_softmax_regression_matches_hand_computation():
    sim = _fisher_simulation()
    theta = torch.tensor(FISHER_THETA, dtype=torch.float64)
    for client_id, rows in enumerate(CLIENT_ROWS):
        fisher = _fisher_pass(sim, client_id, 1).diagonal_fisher(theta, 128)
        assert fisher.dtype == torch.float64
        assert fisher.tolist() == pytest.approx(_hand_fisher(rows), abs=1e-14)
    # not the square of the mean gradient: the per-example structure matters
    mean_gradient_squared = (
        torch.func.grad(sim.model.batch_loss)(theta, sim.training_data.inputs[:6], sim.training_data.targets[:6]) ** 2
    )
    assert not torch.allclose(mean_gradient_squared, torch.tensor(_hand_fisher(CLIENT_ROWS[0]), dtype=torch.float64))
    # a chunk smaller than the client's rows gives the same numbers
    chunked = _fisher_pass(sim, 0, 1).diagonal_fisher(theta, 128, chunk=4)
    assert chunked.tolist() == pytest.approx(_hand_fisher(CLIENT_ROWS[0]), abs=1e-14)


def test_diagonal_fisher_sample_is_seeded_per_seed_round_and_client():
    theta = torch.tensor(FISHER_THETA, dtype=torch.float64)
    subsets = {
        tuple(s): torch.tensor(_hand_fisher(list(s)), dtype=torch.float64)
        for s in itertools.combinations(CLIENT_ROWS[0], 3)
    }

    def which_subset(fisher: torch.Tensor) -> tuple[int, ...]:
        matches = [s for s, value in subsets.items() if torch.allclose(fisher, value, rtol=0, atol=1e-13)]
        assert len(matches) == 1, "the Fisher must be the mean over exactly one 3-example subset"
        return matches[0]

    sim = _fisher_simulation(seed=0)
    chosen = {}
    for round_index in range(1, 7):
        first = _fisher_pass(sim, 0, round_index).diagonal_fisher(theta, 3)
        again = _fisher_pass(sim, 0, round_index).diagonal_fisher(theta, 3)
        assert torch.equal(first, again)
        chosen[round_index] = which_subset(first)
        # it is the (seed, round, client) stream's sample
        rng = generator(0, Stream.FISHER_SAMPLE, round_index, 0)
        assert list(chosen[round_index]) == sorted(
            np.array(CLIENT_ROWS[0])[rng.choice(6, size=3, replace=False)].tolist()
        )
    assert len(set(chosen.values())) > 1  # other rounds, other samples
    other_seed = _fisher_simulation(seed=1)
    other = {r: which_subset(_fisher_pass(other_seed, 0, r).diagonal_fisher(theta, 3)) for r in range(1, 7)}
    assert other != chosen
    # max_examples ≥ n uses every example
    full = _fisher_pass(sim, 0, 1).diagonal_fisher(theta, 6)
    assert full.tolist() == pytest.approx(_hand_fisher(CLIENT_ROWS[0]), abs=1e-14)


# ------------------------------------------------------------------ end to end: FedAvg equivalence, bits


def test_q1_lambda0_all_complete_is_fedavg_bit_for_bit():
    reference = driftlab.run(None, overrides=[*TINY, "precision=float64"])
    efl_run = driftlab.run(
        None, overrides=[*TINY, "precision=float64", "algorithm.name=efl", "algorithm.elastic=0", "compression.ratio=1"]
    )
    assert torch.equal(reference.final_params, efl_run.final_params)
    assert without_wall_time(reference.records) == without_wall_time(efl_run.records)
    assert reference.records[-1]["upload_bits"] == reference.records[-1]["num_reporting"] * 32 * P_MLR


@pytest.mark.parametrize("efl_incomplete, fedavg_incomplete", [("drop", "drop"), ("plain", "keep")])
def test_lambda0_with_stragglers_is_fedavg_with_the_matching_policy(efl_incomplete, fedavg_incomplete):
    common = [*TINY, "rounds=4", "availability.incomplete_probability=0.5", "availability.inactive_probability=0.1"]
    reference = driftlab.run(None, overrides=[*common, f"algorithm.incomplete={fedavg_incomplete}"])
    efl_run = driftlab.run(
        None,
        overrides=[
            *common,
            "algorithm.name=efl",
            "algorithm.elastic=0",
            "compression.ratio=1",
            f"algorithm.incomplete={efl_incomplete}",
        ],
    )
    assert sum(r["num_incomplete"] for r in reference.records) > 0
    assert torch.equal(reference.final_params, efl_run.final_params)
    assert without_wall_time(reference.records) == without_wall_time(efl_run.records)


def test_adaptive_differs_from_plain_when_clients_are_incomplete():
    common = [
        *TINY,
        "availability.incomplete_probability=0.5",
        "algorithm.name=efl",
        "algorithm.elastic=0",
        "compression.ratio=1",
    ]
    adaptive = driftlab.run(None, overrides=common)
    plain = driftlab.run(None, overrides=[*common, "algorithm.incomplete=plain"])
    assert sum(r["num_incomplete"] for r in adaptive.records) > 0
    assert not torch.equal(adaptive.final_params, plain.final_params)


def test_bits_of_an_efl_run_with_compression():
    result = driftlab.run(None, overrides=[*TINY, "algorithm.name=efl", "compression.ratio=0.1"])
    assert ST_BITS_Q01 == 729
    uv = 2 * 32 * P_MLR
    for record in result.records:
        assert record["upload_bits"] == record["num_reporting"] * (ST_BITS_Q01 + uv)
        down = 32 * P_MLR + uv if record["round"] == 1 else ST_BITS_Q01 + uv
        assert record["download_bits"] == record["num_selected"] * down
        assert record["fisher_sum_norm"] > 0
    assert result.records[0]["download_bits"] == 3 * 3 * 32 * P_MLR


def test_bits_of_an_efl_run_with_compression_and_lambda0():
    result = driftlab.run(None, overrides=[*TINY, "algorithm.name=efl", "compression.ratio=0.1", "algorithm.elastic=0"])
    for record in result.records:
        assert record["upload_bits"] == record["num_reporting"] * ST_BITS_Q01
        down = 32 * P_MLR if record["round"] == 1 else ST_BITS_Q01
        assert record["download_bits"] == record["num_selected"] * down
        assert "fisher_sum_norm" not in record


def test_efl_compresses_by_default_at_q_001():
    result = driftlab.run(None, overrides=[*TINY, "rounds=1", "algorithm.name=efl"])
    # q = 0.01: weight k = 6 → 32 + 6 + min(600, 60) = 98; bias k = 1 → 37
    assert result.records[0]["upload_bits"] == result.records[0]["num_reporting"] * (98 + 37 + 2 * 32 * P_MLR)
    assert efl.DEFAULT_COMPRESSION_RATIO == 0.01


# ------------------------------------------------------------------ determinism and resume


RESUME = [
    "rounds=6",
    "data.num_clients=6",
    "sampling.participation=0.5",
    "client.steps=4",
    "seed=7",
    "algorithm.name=efl",
    "algorithm.fisher_examples=8",
    "compression.ratio=0.1",
    "availability.incomplete_probability=0.3",
    "availability.inactive_probability=0.2",
    "checkpoint_every=1",
    "evaluation.every=2",
    "keep_checkpoint=true",  # the final checkpoints are compared below
]


def test_resume_is_exact_with_residuals_fisher_tables_and_availability(tmp_path: Path):
    straight = driftlab.run(None, tmp_path / "straight", overrides=RESUME)
    again = driftlab.run(None, overrides=RESUME)
    assert torch.equal(straight.final_params, again.final_params)
    assert without_wall_time(straight.records) == without_wall_time(again.records)

    class Interrupted(Exception):
        pass

    def interrupt_after_round_3(record):
        if record["round"] == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        driftlab.run(None, tmp_path / "interrupted", overrides=RESUME, progress=interrupt_after_round_3)
    resumed = driftlab.run(None, tmp_path / "interrupted", resume=True, overrides=RESUME)
    assert torch.equal(straight.final_params, resumed.final_params)
    assert without_wall_time(straight.records) == without_wall_time(resumed.records)
    records = straight.records
    assert sum(r["num_incomplete"] for r in records) > 0 and sum(r["num_inactive"] for r in records) > 0
    # the final checkpoints agree tensor for tensor: θ, U, V, server residual, every client's u, v and residual
    a = load_file(str(tmp_path / "straight" / "checkpoint.safetensors"))
    b = load_file(str(tmp_path / "interrupted" / "checkpoint.safetensors"))
    assert a.keys() == b.keys()
    assert any("residual" in key for key in a) and any("fisher" in key for key in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert float(a["server/residual"].abs().max()) > 0
    assert float(a["server/inner/fisher_sum"].abs().max()) > 0


# ------------------------------------------------------------------ availability statistics


def test_availability_draws_match_the_configured_distribution():
    model = AvailabilityModel(inactive_probability=0.2, incomplete_probability=0.3)
    draws = [steps_to_do(model, 42, t, k, 12, 3) for t in range(1, 201) for k in range(50)]  # E = 4 epochs of 3 steps
    n = len(draws)
    counts = {
        "inactive": sum(d == 0 for d in draws),
        "incomplete": sum(0 < d < 12 for d in draws),
        "complete": sum(d == 12 for d in draws),
    }
    for name, p in (("inactive", 0.2), ("incomplete", 0.3), ("complete", 0.5)):
        assert abs(counts[name] - n * p) < 4 * math.sqrt(n * p * (1 - p)), (name, counts)
    # incomplete work is whole epochs, uniform on {1, 2, 3} of E = 4
    partial = [d for d in draws if 0 < d < 12]
    assert set(partial) == {3, 6, 9}
    for value in (3, 6, 9):
        share = partial.count(value)
        assert abs(share - len(partial) / 3) < 4 * math.sqrt(len(partial) * (1 / 3) * (2 / 3))
    # same (seed, round, client) → same draw; the draw does not depend on anything else
    assert [steps_to_do(model, 42, 5, k, 12, 3) for k in range(50)] == draws[4 * 50 : 5 * 50]


def test_availability_through_the_engine():
    overrides = [
        "rounds=30",
        "data.num_clients=8",
        "sampling.participation=1",
        "client.steps=2",
        "seed=5",
        "availability.inactive_probability=0.2",
        "availability.incomplete_probability=0.3",
        "evaluation.every=1000",
    ]
    result = driftlab.run(None, overrides=overrides)
    n = 30 * 8
    inactive = sum(r["num_inactive"] for r in result.records)
    incomplete = sum(r["num_incomplete"] for r in result.records)
    assert abs(inactive - 0.2 * n) < 4 * math.sqrt(n * 0.2 * 0.8)
    assert abs(incomplete - 0.3 * n) < 4 * math.sqrt(n * 0.3 * 0.7)
    # the engine's counts are exactly the availability model's draws for (seed, round, client)
    model = AvailabilityModel(0.2, 0.3)
    for record in result.records:
        steps = [steps_to_do(model, 5, record["round"], k, 2, 0) for k in range(8)]
        assert record["num_inactive"] == steps.count(0)
        assert record["num_incomplete"] == steps.count(1)
        # FedAvg drops incomplete clients: only complete ones report
        assert record["reporting_clients"] == [k for k in range(8) if steps[k] == 2]
        assert record["local_steps"] == sum(steps)


def test_incomplete_work_with_fixed_steps_is_uniform_over_steps():
    plan = every_client_plan(4)
    model = AvailabilityModel(0.0, 1.0)
    n = 20  # 2 steps per epoch
    draws = {steps_to_do(model, 0, t, 0, plan.planned_steps(n, t), plan.partial_work_epoch(n)) for t in range(1, 200)}
    assert draws == {1, 2, 3}
    in_epochs = dataclasses.replace(plan, local_epochs=2)
    assert {
        steps_to_do(model, 0, t, 0, in_epochs.planned_steps(n, t), in_epochs.partial_work_epoch(n))
        for t in range(1, 200)
    } == {2}


# ------------------------------------------------------------------ every algorithm with compression and availability

ALL_TINY = [
    "rounds=2",
    "data.num_clients=6",
    "sampling.participation=0.5",
    "client.steps=3",
    "seed=2",
    "evaluation.every=100",
]
ST_BITS_Q005 = (32 + 30 + min(600, 30 * 10)) + (32 + 1 + min(10, 4))  # 362 + 37 = 399
# Algorithms that refuse compression before any work, with the reason the message must give.
COMPRESSION_REFUSED = {
    "fedamp": r"sends each client a view of its own .* set compression.ratio = 1",
    "mime": r"uploads a vector per client before local training .*control_variate",  # the paper's in-round c
}
EXTRA_UPLOAD = {
    "scaffold": 32 * P_MLR,
    "efl": 2 * 32 * P_MLR,
    "mimelite": 32 * P_MLR,
    "mime": 32 * P_MLR,
}  # Δc; u and v; Mime(Lite)'s full-batch gradient


@pytest.mark.parametrize("availability", [False, True], ids=["available", "stragglers"])
@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_every_algorithm_runs_compressed(name, availability):
    overrides = [*ALL_TINY, f"algorithm.name={name}", "compression.ratio=0.05"]
    if availability:
        overrides += ["availability.incomplete_probability=0.4", "availability.inactive_probability=0.2", "rounds=3"]
    if name in COMPRESSION_REFUSED:
        with pytest.raises(driftlab.ConfigError, match=COMPRESSION_REFUSED[name]):
            driftlab.run(None, overrides=overrides)
        return
    result = driftlab.run(None, overrides=overrides)
    assert len(result.records) == (3 if availability else 2)
    assert torch.isfinite(result.final_params).all()
    for record in result.records:
        assert record["upload_bits"] == record["num_reporting"] * (ST_BITS_Q005 + EXTRA_UPLOAD.get(name, 0))
    if availability:
        assert sum(r["num_inactive"] + r["num_incomplete"] for r in result.records) > 0


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "override, key",
    [
        ("algorithm.elastic=-0.5", "algorithm.elastic"),
        ("compression.ratio=0", "compression.ratio"),
        ("compression.ratio=1.5", "compression.ratio"),
        ("compression.ratio=-0.1", "compression.ratio"),
        ("algorithm.incomplete=sometimes", "algorithm.incomplete"),
        ("algorithm.fisher_examples=0", "algorithm.fisher_examples"),
    ],
)
def test_bad_config_names_the_key(override, key):
    with pytest.raises(driftlab.ConfigError, match=key.replace(".", r"\.")):
        driftlab.run(None, overrides=["rounds=1", "data.num_clients=4", "algorithm.name=efl", override])


def test_build_rejects_bad_arguments():
    with pytest.raises(ValueError, match="elastic"):
        efl.build(sgd(), elastic=-1.0)
    with pytest.raises(ValueError, match="incomplete"):
        efl.build(sgd(), incomplete="keep")
    with pytest.raises(ValueError, match="fisher_examples"):
        efl.build(sgd(), fisher_examples=0)
    with pytest.raises(ValueError, match="aggregation"):
        efl.build(sgd(), aggregation="median")


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).
#
# EFL (λ = 0.5, weighted, no compression; the diagonal Fisher is handed in, fixed: u_0 = (1,1),
#   u_1 = (1,0.5)).  Round 1, U = V = 0: FedAvg's clients and average, θ^1 = (0.375, 2.25);
#   v_0 = u_0⊙θ_0 = (1.5,0), v_1 = (0,1.5); U = (2,1.5), V = (1.5,1.5), ‖U‖ = 2.5.
#   Round 2: λU = (1,0.75), V/U = (0.75,1).  client 0: g = (−1.625,2.25) + (−0.375,0.9375) → (1.375,0.65625),
#   g = (−0.625,0.65625) + (0.625,−0.2578125) → (1.375,0.45703125); client 1: g = (0.375,−1.75) + (−0.375,0.9375)
#   → (0.375,2.65625), g = (0.375,−1.34375) + (−0.375,1.2421875) → (0.375,2.70703125);
#   θ^2 = ¼(1.375,0.45703125) + ¾(0.375,2.70703125) = (0.625, 2.14453125); U unchanged.
HAND_CASE = {
    "config": {"elastic": 0.5},
    "fisher": [(1.0, 1.0), (1.0, 0.5)],
    "params": [(0.375, 2.25), (0.625, 2.14453125)],
    "drift": None,
    "metrics": [{"fisher_sum_norm": 2.5}, {"fisher_sum_norm": 2.5}],
}


def test_adaptive_extra_divides_by_the_public_denominator_when_set():
    # The adaptive weights have no release form (E/s_k is unbounded by any clip), but the fold still honours
    # RoundContext.mean_denominator everywhere it takes a mean: the extra Σ (E/s_k − 1)(θ_k − θ) too.
    algorithm = efl.build(sgd(), elastic=0.0, incomplete="adaptive", aggregation="uniform")
    assert algorithm.release is None and '"drop" or "plain"' in algorithm.release_refusal
    server = algorithm.server_init(torch.zeros(2, dtype=torch.float64))
    messages = [
        efl.ClientMessage(torch.tensor([2.0, 0.0], dtype=torch.float64), None, None, 10, 1, 1.0),
        efl.ClientMessage(torch.tensor([0.0, 2.0], dtype=torch.float64), None, None, 10, 1, 0.5),
    ]
    private, _ = algorithm.server_update(server, messages, RoundContext(1, 10, 2, 1.0, mean_denominator=4.0))
    # ((2, 0) + (0, 2))/4 + 1·(2 − 1)·(0, 2)/4 = (0.5, 1)
    assert torch.equal(private.params, torch.tensor([0.5, 1.0], dtype=torch.float64))
    plain, _ = algorithm.server_update(server, messages, RoundContext(1, 10, 2, 1.0))
    assert torch.equal(plain.params, torch.tensor([1.0, 2.0], dtype=torch.float64))  # (1, 1) + (0, 2)/2


def test_efl_releases_the_model_change_and_the_fisher_changes_in_one_vector():
    algorithm = efl.build(sgd(), elastic=0.5, incomplete="drop", aggregation="uniform")
    view = algorithm.broadcast(algorithm.server_init(torch.tensor([1.0, 1.0])))
    change_u, change_v = torch.tensor([0.5, 0.25]), torch.tensor([1.0, 0.75])
    message = efl.ClientMessage(torch.tensor([2.0, 3.0]), change_u, change_v, 9, 1, 1.0)
    x = algorithm.release.release(view, message)
    assert torch.equal(x, torch.tensor([1.0, 2.0, 0.5, 0.25, 1.0, 0.75]))
    carrier = algorithm.release.restore(view, None, x)
    assert (carrier.multiplicity, carrier.completed_fraction) == (1, 1.0)
    assert torch.equal(carrier.params, message.params) and torch.equal(carrier.fisher_change, message.fisher_change)
