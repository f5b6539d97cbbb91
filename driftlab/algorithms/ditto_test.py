"""Ditto: the personal pass by hand, λ = 0 and large λ, the global model is FedAvg's bit for bit, v_k's fixed point on
quadratics, stragglers, compression, privacy, asynchrony, both backends and bad input."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.algorithms import ditto, fedavg
from driftlab.algorithms.shared_test import Quadratics, heterogeneous_quadratics
from driftlab.algorithms.testing import TINY
from driftlab.compress import with_compression
from driftlab.errors import ConfigError
from driftlab.models import build_model
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import LocalSettings, TrainingData, corrected_step
from driftlab.simulation.round.client import ClientData, ClientDataComputation, ClientSettings
from driftlab.simulation.seam import NO_CORRECTION, ClientContext, ClientUpdate, GradientCorrection, RoundContext

SGD = make_server_optimizer("sgd")


def vector(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@dataclass
class QuadraticTraining:
    """A ``ClientComputation`` whose ``train`` is full-batch GD on ``f(θ) = ½ θᵀ diag(a) θ − bᵀ θ`` with the
    correction, as the engine's local step does it; it records what it was asked (correction, steps, purpose)."""

    curvature: torch.Tensor
    target: torch.Tensor
    learning_rate: float
    calls: list = field(default_factory=list)

    def train(self, params, correction, steps, purpose="personal"):
        self.calls.append((correction, steps, purpose))
        settings = LocalSettings(self.learning_rate)
        theta = params
        for _ in range(steps):
            theta = corrected_step(theta, self.curvature * theta - self.target, correction, settings)
        return theta, steps


def run_ditto(
    algorithm, problem: Quadratics, initial, rounds, steps, learning_rate, num_samples=None, participants=None
):
    """Rounds of full-batch local GD as the engine runs them (``shared_test.run_quadratic``), each client's update
    carrying a ``QuadraticTraining`` for its personal pass; returns the server and every client's state."""
    sizes = list(num_samples) if num_samples is not None else [10] * problem.num_clients
    settings = LocalSettings(learning_rate)
    server, states = algorithm.server_init(initial), {}
    for t in range(1, rounds + 1):
        view = algorithm.broadcast(server)
        messages, new_states = [], {}
        for client in participants(t) if participants is not None else range(problem.num_clients):
            state = states.get(client, algorithm.client_state_init(initial) if algorithm.client_state_init else None)
            context = ClientContext(
                client, t, sizes[client], sum(sizes) / len(sizes), problem.num_clients, steps, learning_rate
            )
            correction = algorithm.client_objective(view, state, context)
            theta = view.params
            for _ in range(steps):
                theta = corrected_step(theta, problem.gradient(client, theta), correction, settings)
            computation = QuadraticTraining(problem.curvatures[client], problem.targets[client], learning_rate)
            new_states[client], message = algorithm.client_finish(
                view, state, context, ClientUpdate(view.params, theta, steps, computation)
            )
            messages.append(message)
        states.update(new_states)
        server, _ = algorithm.server_update(server, messages, RoundContext(t, problem.num_clients, len(messages), 1.0))
    return server, states


# ---------------------------------------------------------------- the shared two-client case, by hand
#
# f_k(θ) = ½‖θ − b_k‖², b_0 = (2, 0), b_1 = (0, 4), n = (1, 3), θ^0 = 0, K = 2 steps of η = 0.5.  The global model is
# FedAvg's (fedavg_test's hand case): w^1 = (0.375, 2.25), w^2 = (0.46875, 2.8125).  shared_test's hand harness gives
# client_finish no ClientComputation.train, so its case sets personal_steps = 0 (the global half alone); the personal
# pass, λ = 0.5 and s = K = 2, is checked by hand below:
#   round 1 (reference w^0 = 0):  v_0: (0, 0) → (1, 0) → (1.25, 0)            [∇ = (−2, 0), then (−0.5, 0)]
#                                 v_1: (0, 0) → (0, 2) → (0, 2.5)             [∇ = (0, −4), then (0, −1)]
#   round 2 (reference w^1):      v_0: ∇ = (−0.75, 0) + ½(0.875, −2.25) = (−0.3125, −1.125) → (1.40625, 0.5625);
#                                      ∇ = (−0.59375, 0.5625) + ½(1.03125, −1.6875) = (−0.078125, −0.28125)
#                                      → (1.4453125, 0.703125)
#                                 v_1: ∇ = (0, −1.5) + ½(−0.375, 0.25) = (−0.1875, −1.375) → (0.09375, 3.1875);
#                                      ∇ = (0.09375, −0.8125) + ½(−0.28125, 0.9375) = (−0.046875, −0.34375)
#                                      → (0.1171875, 3.359375)
HAND_CASE = {"config": {"personal_steps": 0}, "params": [(0.375, 2.25), (0.46875, 2.8125)], "drift": None}
HAND_PROBLEM = Quadratics(torch.ones(2, 2, dtype=torch.float64), torch.stack((vector(2.0, 0.0), vector(0.0, 4.0))))
HAND_PERSONAL = [((1.25, 0.0), (0.0, 2.5)), ((1.4453125, 0.703125), (0.1171875, 3.359375))]


@pytest.mark.parametrize("rounds", [1, 2])
def test_two_hand_rounds_move_the_personal_models_as_computed_by_hand(rounds: int):
    algorithm = ditto.build(SGD, lam=0.5)
    server, states = run_ditto(algorithm, HAND_PROBLEM, vector(0.0, 0.0), rounds, 2, 0.5, num_samples=[1, 3])
    assert torch.equal(server.params, vector(*HAND_CASE["params"][rounds - 1]))  # FedAvg's, untouched by v_k
    for client in (0, 1):
        assert torch.equal(states[client].personal, vector(*HAND_PERSONAL[rounds - 1][client]))
        assert torch.equal(
            algorithm.personalization.model(algorithm.broadcast(server), states[client]), states[client].personal
        )


def test_the_personal_pass_asks_for_s_proximal_steps_toward_the_received_model_on_the_personal_minibatches():
    algorithm = ditto.build(SGD, lam=0.25, personal_steps=7)
    view = algorithm.broadcast(algorithm.server_init(vector(1.0, -1.0)))
    computation = QuadraticTraining(torch.ones(2, dtype=torch.float64), vector(0.0, 0.0), 0.1)
    context = ClientContext(0, 1, 5, 5.0, 4, 3, 0.1)
    state, message = algorithm.client_finish(
        view, ditto.ClientState(vector(3.0, 3.0)), context, ClientUpdate(view.params, vector(2.0, 2.0), 3, computation)
    )
    ((correction, steps, purpose),) = computation.calls
    assert steps == 7 and purpose == "personal"
    assert correction.quadratic == 0.25 and torch.equal(correction.reference, vector(1.0, -1.0))  # w^t, not w_k
    assert torch.equal(message.params, vector(2.0, 2.0)) and message.num_samples == 5  # FedAvg's message: w_k


def test_lambda_zero_trains_separate_local_models_with_no_correction_at_all():
    algorithm = ditto.build(SGD, lam=0.0)
    view = algorithm.broadcast(algorithm.server_init(vector(1.0, -1.0)))
    computation = QuadraticTraining(torch.ones(2, dtype=torch.float64), vector(0.0, 0.0), 0.1)
    algorithm.client_finish(
        view,
        algorithm.client_state_init(vector(0.0, 0.0)),
        ClientContext(0, 1, 5, 5.0, 4, 3, 0.1),
        ClientUpdate(view.params, view.params, 3, computation),
    )
    assert computation.calls == [(NO_CORRECTION, 3, "personal")]


def _client_data(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = (
        torch.randn(12, 4, generator=generator, dtype=torch.float64),
        torch.randint(0, 3, (12,), generator=generator),
    )
    model = FlatModel.wrap(build_model("mlr", (4,), 3)).to("cpu", torch.float64)
    params = torch.randn(model.initial_parameters().numel(), generator=generator, dtype=torch.float64)
    return ClientData(model, TrainingData(inputs, targets), torch.arange(12)), params


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_on_real_data_the_personal_model_is_the_client_code_paths_training_bit_for_bit(lam: float):
    data, params = _client_data()
    settings = ClientSettings(seed=3, batch_size=4, local=LocalSettings(0.1, weight_decay=0.01, clip_norm=1.0))
    computation = ClientDataComputation(data, 3, 2, 1, settings)
    algorithm = ditto.build(SGD, lam=lam)
    view = algorithm.broadcast(algorithm.server_init(params))
    personal = params * 0.5
    state, _ = algorithm.client_finish(
        view,
        ditto.ClientState(personal),
        ClientContext(1, 2, 12, 12.0, 4, 5, 0.1),
        ClientUpdate(params, params + 1, 5, computation),
    )
    correction = NO_CORRECTION if lam == 0 else GradientCorrection(quadratic=lam, reference=params)
    expected, steps = computation.train(personal, correction, 5, "personal")
    assert steps == 5 and torch.equal(state.personal, expected)
    alone, _ = computation.train(personal, NO_CORRECTION, 5, "personal")
    assert torch.equal(state.personal, alone) == (lam == 0)  # the proximal term moves v_k only when λ > 0


def test_with_eta_lambda_one_each_personal_step_lands_one_gradient_step_from_the_received_model():
    # η λ = 1: v ← v − η(∇F_k(v; ξ) + λ(v − w)) = w − η ∇F_k(v; ξ), whatever v was: large λ pins v_k to the received w.
    data, params = _client_data()
    settings = ClientSettings(seed=3, batch_size=4, local=LocalSettings(0.1))
    computation = ClientDataComputation(data, 3, 2, 1, settings)
    algorithm = ditto.build(SGD, lam=10.0)
    view = algorithm.broadcast(algorithm.server_init(params))
    start = torch.zeros_like(params)
    state, _ = algorithm.client_finish(
        view,
        ditto.ClientState(start),
        ClientContext(1, 2, 12, 12.0, 4, 4, 0.1),
        ClientUpdate(params, params, 4, computation),
    )
    before_last, _ = computation.train(start, GradientCorrection(quadratic=10.0, reference=params), 3, "personal")
    inputs, targets = computation.minibatches(4, "personal")[-1]
    expected = params - 0.1 * computation.loss_gradient(before_last, inputs, targets)
    torch.testing.assert_close(state.personal, expected, rtol=0, atol=1e-14)
    assert torch.linalg.vector_norm(state.personal - params) < 0.1 * torch.linalg.vector_norm(start - params)


# ---------------------------------------------------------------- quadratics: FedAvg's global model, v_k's fixed point


def test_the_global_model_is_fedavgs_bit_for_bit_under_partial_participation():
    problem = heterogeneous_quadratics()
    initial = vector(1.0, -1.0, 0.5)
    chosen = lambda t: [t % 5, (t + 2) % 5]  # noqa: E731 - partial participation, changing each round
    for aggregation in ("weighted", "uniform"):
        server, _ = run_ditto(
            ditto.build(SGD, lam=0.7, aggregation=aggregation), problem, initial, 20, 4, 0.1, [3, 7, 1, 4, 9], chosen
        )
        plain, _ = run_ditto(
            fedavg.build(SGD, aggregation=aggregation), problem, initial, 20, 4, 0.1, [3, 7, 1, 4, 9], chosen
        )
        assert torch.equal(server.params, plain.params)


@pytest.mark.parametrize("lam", [0.0, 0.5, 5.0, 50.0])
def test_personal_models_converge_to_their_own_optimum_regularized_toward_the_global_model(lam: float):
    # FedAvg's w → w_∞ = Σ φ_i b_i/a_i / Σ φ_i (shared_test's surrogate, φ_i = 1 − (1 − η a_i)^K).  With w fixed, GD on
    # h_k(v) = F_k(v) + λ/2 ‖v − w‖² has the fixed point v_k* = (b_k + λ w)/(a_k + λ) per coordinate, whatever s:
    # the client's own optimum b_k/a_k at λ = 0, within ‖∇F_k(w)‖/λ of w, tending to w as λ grows.
    problem = heterogeneous_quadratics()
    a, b = problem.curvatures, problem.targets
    steps, rate = 5, 0.02  # η (a_k + λ) ≤ 0.02 · 53 < 2: the personal pass is stable for every λ here
    server, states = run_ditto(ditto.build(SGD, lam=lam), problem, vector(1.0, -1.0, 0.5), 600, steps, rate)
    phi = 1 - (1 - rate * a) ** steps
    w = (phi * b / a).sum(0) / phi.sum(0)
    assert torch.allclose(server.params, w, rtol=0, atol=1e-10)
    for k in range(problem.num_clients):
        v = states[k].personal
        assert torch.allclose(v, (b[k] + lam * w) / (a[k] + lam), rtol=0, atol=1e-10)
        if lam > 0:
            assert torch.linalg.vector_norm(v - w) <= torch.linalg.vector_norm(a[k] * w - b[k]) / lam
    if lam == 50.0:
        assert max(float(torch.linalg.vector_norm(states[k].personal - w)) for k in range(5)) < 0.2


# ---------------------------------------------------------------- stragglers, a client without data, compression


def test_a_straggler_does_at_most_its_global_steps_and_is_dropped_by_default_but_keeps_its_personal_update():
    algorithm = ditto.build(SGD, lam=0.5, personal_steps=5)
    view = algorithm.broadcast(algorithm.server_init(vector(0.0, 0.0)))
    computation = QuadraticTraining(torch.ones(2, dtype=torch.float64), vector(2.0, 0.0), 0.5)
    straggler = ClientContext(0, 1, 5, 5.0, 4, 3, 0.5, available_steps=1)
    state, message = algorithm.client_finish(
        view,
        algorithm.client_state_init(view.params),
        straggler,
        ClientUpdate(view.params, vector(1.0, 0.0), 1, computation),
    )
    assert message is None  # FedAvg's incomplete = "drop"
    assert computation.calls[-1][1:] == (1, "personal") and torch.equal(state.personal, vector(1.0, 0.0))
    kept = ditto.build(SGD, lam=0.5, incomplete="keep")
    _, message = kept.client_finish(
        view,
        kept.client_state_init(view.params),
        straggler,
        ClientUpdate(view.params, vector(1.0, 0.0), 1, computation),
    )
    assert torch.equal(message.params, vector(1.0, 0.0)) and computation.calls[-1][1] == 1  # unset s: the global steps


def test_a_client_that_did_no_step_keeps_its_personal_model_and_needs_no_data():
    algorithm = ditto.build(SGD, lam=0.5)
    view = algorithm.broadcast(algorithm.server_init(vector(1.0)))
    state = ditto.ClientState(vector(4.0))
    new_state, _ = algorithm.client_finish(
        view,
        state,
        ClientContext(0, 1, 1, 1.0, 1, 3, 0.1, available_steps=0),
        ClientUpdate(view.params, view.params, 0),
    )
    assert new_state is state


def test_a_client_update_without_its_data_says_what_is_missing_and_the_fix():
    algorithm = ditto.build(SGD, lam=0.5)
    view = algorithm.broadcast(algorithm.server_init(vector(1.0)))
    with pytest.raises(RuntimeError, match=r"computation.train.*or run fedavg"):
        algorithm.client_finish(
            view,
            algorithm.client_state_init(vector(0.0)),
            ClientContext(0, 1, 1, 1.0, 1, 1, 0.1),
            ClientUpdate(view.params, vector(2.0), 1),
        )


def test_compression_leaves_the_personal_model_alone_and_forwards_it():
    plain = ditto.build(SGD, lam=0.5)
    compressed = with_compression(ditto.build(SGD, lam=0.5), 0.5, [4])
    computation = QuadraticTraining(torch.ones(4, dtype=torch.float64), vector(1.0, -2.0, 3.0, -4.0), 0.1)
    update = ClientUpdate(torch.zeros(4, dtype=torch.float64), vector(0.1, -0.2, 0.3, -0.4), 3, computation)
    context = ClientContext(0, 1, 1, 1.0, 1, 3, 0.1)
    plain_view = plain.broadcast(plain.server_init(torch.zeros(4, dtype=torch.float64)))
    expected, _ = plain.client_finish(plain_view, plain.client_state_init(plain_view.params), context, update)
    view = compressed.broadcast(compressed.server_init(torch.zeros(4, dtype=torch.float64)))
    state, message = compressed.client_finish(
        view, compressed.client_state_init(torch.zeros(4, dtype=torch.float64)), context, update
    )
    assert torch.equal(
        state.inner.personal, expected.personal
    )  # trained from v_k toward w^t, not the compressed upload
    assert int((message.payload.params != 0).sum()) == 2  # the upload is compressed (ST keeps half the entries)
    assert torch.equal(compressed.personalization.model(view, state), expected.personal)


# ---------------------------------------------------------------- privacy, asynchrony, bad input


def test_the_release_form_is_fedavgs_and_the_asynchronous_rule_is_refused_with_the_reason():
    uniform = ditto.build(SGD, aggregation="uniform")
    view = uniform.broadcast(uniform.server_init(vector(1.0, 2.0)))
    assert torch.equal(uniform.release.release(view, ditto.ClientMessage(vector(2.0, 2.0), 7, 1)), vector(1.0, 0.0))
    weighted = ditto.build(SGD)
    assert weighted.release is None and 'set algorithm.aggregation = "uniform"' in weighted.release_refusal
    for algorithm in (uniform, weighted):
        assert (
            not algorithm.asynchronous
            and algorithm.asynchronous_problem()
            == f'[asynchronous] with algorithm.name = "ditto": {ditto.ASYNCHRONOUS_REASON.text}'
        )
    assert "v_k" in ditto.ASYNCHRONOUS_REASON.text and "remove [asynchronous]" in ditto.ASYNCHRONOUS_REASON.text


@pytest.mark.parametrize("lam", [-0.1, math.inf, math.nan])
def test_a_bad_lambda_is_refused_before_any_work(lam: float):
    with pytest.raises(ConfigError, match=r"algorithm\.lam"):
        driftlab.load_config({"algorithm": {"name": "ditto", "lam": lam}})
    with pytest.raises(ValueError, match=r"finite lam \(λ\) >= 0"):
        ditto.build(SGD, lam=lam)


def test_bad_personal_steps_and_unknown_keys_are_refused():
    with pytest.raises(ConfigError, match=r"algorithm\.personal_steps"):
        driftlab.load_config({"algorithm": {"name": "ditto", "personal_steps": -1}})
    with pytest.raises(ConfigError, match="mu"):
        driftlab.load_config({"algorithm": {"name": "ditto", "mu": 0.1}})
    with pytest.raises(ValueError, match="personal_steps >= 0"):
        ditto.build(SGD, personal_steps=-2)


# ---------------------------------------------------------------- whole runs

RUN = {**TINY, "algorithm": {"name": "ditto", "lam": 0.5}}
PERSONAL_KEYS = (
    "personal_test_accuracy_mean",
    "personal_test_accuracy_std",
    "client_test_accuracy_std",
    "round_seconds",
)


def _global_columns(records):
    return [{key: value for key, value in record.items() if key not in PERSONAL_KEYS} for record in records]


@pytest.mark.parametrize(
    "algorithm", [{}, {"aggregation": "uniform", "incomplete": "keep"}], ids=["defaults", "uniform-keep"]
)
def test_a_ditto_run_has_fedavgs_server_model_and_records_bit_for_bit(algorithm):
    stragglers = {"availability": {"incomplete_probability": 0.4}}
    run = driftlab.run({**RUN, **stragglers, "algorithm": {"name": "ditto", "lam": 0.5, **algorithm}})
    plain = driftlab.run({**RUN, **stragglers, "algorithm": {"name": "fedavg", **algorithm}})
    assert torch.equal(run.final_params, plain.final_params)
    assert _global_columns(run.records) == _global_columns(plain.records)
    assert all(0 <= record["personal_test_accuracy_mean"] <= 1 for record in run.records)


def test_in_a_run_a_large_lambda_keeps_every_personal_model_next_to_the_model_its_client_received(tmp_path):
    # All clients take part each round, η λ = 1: after round 4, v_k = w^3 − η ∇F_k(v_k; ξ) for every k, much nearer w^3
    # than the server moved in round 4 (‖w^4 − w^3‖); with λ = 0 the local models wander off.  (The accuracy columns
    # are too coarse for this: a model near θ⁰ has near-tied logits, and 0.5% of its norm flips many predictions.)
    base = {**RUN, "sampling": {"participation": 1.0}, "client": {"epochs": 1, "lr": 0.001}, "keep_checkpoint": True}
    received = driftlab.run({**base, "algorithm": {"name": "ditto", "lam": 1000.0}}).final_params
    moved = {}
    for lam in (1000.0, 0.0):
        result = driftlab.run({**base, "rounds": 4, "algorithm": {"name": "ditto", "lam": lam}}, tmp_path / str(lam))
        step = torch.linalg.vector_norm(result.final_params - received)
        tensors = load_file(str(tmp_path / str(lam) / "checkpoint.safetensors"))
        moved[lam] = [
            float(torch.linalg.vector_norm(tensors[f"client/{k}/state/personal"] - received) / step) for k in range(6)
        ]
    assert max(moved[1000.0]) < 0.25 and min(moved[0.0]) > 1


def test_both_backends_agree():
    config = {**RUN, "precision": "float64"}
    sequential = driftlab.run({**config, "backend": "sequential"})
    vectorized = driftlab.run({**config, "backend": "vectorized"})
    torch.testing.assert_close(vectorized.final_params, sequential.final_params, rtol=1e-12, atol=1e-12)
    for first, second in zip(sequential.records, vectorized.records, strict=True):
        assert first["personal_test_accuracy_mean"] == second["personal_test_accuracy_mean"]


def test_compressed_and_private_runs_evaluate_the_personal_models():
    compressed = driftlab.run({**RUN, "compression": {"ratio": 0.2}})
    plain = driftlab.run(RUN)
    assert compressed.records[-1]["upload_bits"] < plain.records[-1]["upload_bits"]
    private = driftlab.run(
        {
            **RUN,
            "algorithm": {"name": "ditto", "lam": 0.5, "aggregation": "uniform"},
            "sampling": {"participation": 0.5, "mode": "poisson"},
            "privacy": {"clip": 1.0, "noise_multiplier": 1.0},
        }
    )
    for result in (compressed, private):
        assert all(0 <= record["personal_test_accuracy_mean"] <= 1 for record in result.records)


def test_an_asynchronous_ditto_config_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"remove \[asynchronous\]"):
        driftlab.run({**RUN, "system": {"profiles": "lognormal"}, "asynchronous": {"concurrency": 3, "buffer": 2}})
