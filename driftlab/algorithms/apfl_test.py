"""APFL: two local steps by hand, the replica of w against the sequential backend bit for bit, the equivalences
(α = 0 fixed is FedAvg with the server model as personal model; α = 1 fixed is plain local SGD), convergence of the
personal models on quadratics, both backends, resume with v and α, compression, privacy and the refusals."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.algorithms import apfl, fedavg
from driftlab.algorithms.aggregation import WEIGHTED_REFUSAL
from driftlab.algorithms.shared_test import TINY, Quadratics, heterogeneous_quadratics
from driftlab.errors import ConfigError
from driftlab.models import build_model
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import LocalSettings, TrainingData, corrected_step
from driftlab.simulation.round.client import ClientData, ClientDataComputation, ClientRound, ClientSettings, run_client
from driftlab.simulation.seam import NO_CORRECTION, ClientContext, ClientUpdate, RoundContext

F64 = torch.float64
SGD = make_server_optimizer("sgd")


def vector(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


@dataclass(frozen=True)
class TargetsComputation:
    """A ``ClientComputation`` whose minibatch ``b`` has loss ``½‖θ − b‖²`` (gradient ``θ − b``): ``minibatches`` gives
    the targets of the local steps in order."""

    targets: tuple[torch.Tensor, ...]
    settings: LocalSettings

    def minibatches(self, steps: int, purpose: str = "local") -> list[tuple[torch.Tensor, None]]:
        assert purpose == "local" and steps <= len(self.targets)
        return [(target, None) for target in self.targets[:steps]]

    def loss_gradient(self, params: torch.Tensor, inputs: torch.Tensor, targets: None) -> torch.Tensor:
        return params - inputs


# ---------------------------------------------------------------- the client's steps by hand


def test_two_local_steps_by_hand() -> None:
    # w⁰ = (1,0), v⁰ = (0,2), α⁰ = ½, η_l = ½, η_α = ¼; minibatch targets b₁ = (2,2), b₂ = (0,0).
    # Step 1: v̄ = (½,1), g = v̄ − b₁ = (−3/2,−1); ⟨v − w, g⟩ = ⟨(−1,2), g⟩ = −½ → α¹ = ½ + ¼·½ = 5/8;
    #   v¹ = v⁰ − η α⁰ g = (3/8, 9/4);  w¹ = w⁰ − η (w⁰ − b₁) = (3/2, 1).
    # Step 2: v̄ = 5/8 v¹ + 3/8 w¹ = (51/64, 57/32) = g;  ⟨v¹ − w¹, g⟩ = ⟨(−9/8, 5/4), g⟩ = 681/512
    #   → α² = 5/8 − 681/2048 = 599/2048;  v² = v¹ − ½·5/8·g = (129/1024, 867/512);  w² = (3/4, 1/2).
    computation = TargetsComputation((vector(2, 2), vector(0, 0)), LocalSettings(0.5))
    start = apfl.ClientState(vector(0, 2), 0.5)

    def steps(adaptive: bool, alpha_lr: float) -> tuple[apfl.ClientState, torch.Tensor]:
        """The two steps from (w⁰, v⁰, α⁰) on b₁, b₂."""
        batches = computation.minibatches(2)
        return apfl.personal_steps(
            start, vector(1, 0), batches, computation.loss_gradient, computation.settings, adaptive, alpha_lr
        )

    state, w = steps(adaptive=True, alpha_lr=0.25)
    assert state.alpha == 599 / 2048 and isinstance(state.alpha, float)
    assert torch.equal(state.personal, vector(129 / 1024, 867 / 512)) and torch.equal(w, vector(0.75, 0.5))
    # α fixed: the same v¹ (it uses α⁰), then v² with α = ½: v̄ = ½(3/8,9/4) + ½(3/2,1) = (15/16, 13/8) = g
    fixed, _ = steps(adaptive=False, alpha_lr=0.25)
    assert fixed.alpha == 0.5 and torch.equal(fixed.personal, vector(3 / 8 - 15 / 64, 9 / 4 - 13 / 32))
    # α is projected onto [0, 1]: a large step size ends it at 0
    projected, _ = steps(adaptive=True, alpha_lr=10.0)
    assert projected.alpha == 0.0


def test_client_finish_sends_fedavgs_message_and_keeps_v_and_alpha() -> None:
    # The hand steps above through the algorithm: α_lr unset is η_l = ½ (α¹ = ½ + ½·½ = ¾).
    algorithm = apfl.build(SGD, alpha=0.5, adaptive=True)
    view = algorithm.broadcast(algorithm.server_init(vector(1, 0)))
    computation = TargetsComputation((vector(2, 2),), LocalSettings(0.5))
    context = ClientContext(3, 1, 10, 10.0, 4, 1, 0.5)
    state, message = algorithm.client_finish(
        view, apfl.ClientState(vector(0, 2), 0.5), context, ClientUpdate(view.params, vector(1.5, 1), 1, computation)
    )
    assert (
        isinstance(message, fedavg.ClientMessage)
        and torch.equal(message.params, vector(1.5, 1))
        and message.num_samples == 10
    )
    assert state.alpha == 0.75 and torch.equal(state.personal, vector(3 / 8, 9 / 4))
    # the personal model mixes v with the view the server would send now
    assert torch.equal(algorithm.personalization.model(view, state), 0.75 * vector(3 / 8, 9 / 4) + 0.25 * vector(1, 0))
    # a straggler's w is dropped (FedAvg's default) but its v and α still learn from the steps it did
    late = dataclasses.replace(context, available_steps=1, planned_steps=3)
    dropped_state, dropped = algorithm.client_finish(
        view, apfl.ClientState(vector(0, 2), 0.5), late, ClientUpdate(view.params, vector(1.5, 1), 1, computation)
    )
    assert (
        dropped is None and dropped_state.alpha == state.alpha and torch.equal(dropped_state.personal, state.personal)
    )
    # no step done: nothing learned
    kept = apfl.ClientState(vector(0, 2), 0.5)
    assert (
        algorithm.client_finish(view, kept, context, ClientUpdate(view.params, view.params, 0, computation))[0] is kept
    )


def test_personal_model_is_exactly_the_server_model_at_alpha_zero_and_v_at_one() -> None:
    view = fedavg.ClientView(vector(0.1, 0.3))
    v = vector(7.0, -0.0)
    assert apfl.mixed(0.0, v, view.params) is view.params and apfl.mixed(1.0, v, view.params) is v
    fresh = apfl.build(SGD, alpha=0.0, adaptive=False)
    state = fresh.client_state_init(vector(5, 5))
    assert fresh.personalization.model(view, state) is view.params


# ---------------------------------------------------------------- the replica of w and α = 1 against the client's own training


def _client(alpha: float, adaptive: bool, weight_decay: float = 0.0, clip: float | None = None):
    torch.manual_seed(0)
    model = FlatModel.wrap(build_model("mlp", (5,), 3, hidden=(7,)))
    generator = torch.Generator().manual_seed(1)
    data = ClientData(
        model,
        TrainingData(torch.randn(23, 5, generator=generator), torch.randint(0, 3, (23,), generator=generator)),
        rows=torch.arange(23),
    )
    context = ClientContext(0, 2, 23, 23.0, 1, 9, 0.1)
    settings = ClientSettings(seed=0, batch_size=4, local=LocalSettings(0.1, weight_decay, clip))
    return apfl.build(SGD, alpha=alpha, adaptive=adaptive), model, data, context, settings


@pytest.mark.parametrize(("weight_decay", "clip"), [(0.0, None), (1e-3, 0.5)])
def test_the_replica_of_w_equals_the_sequential_backends_w_bit_for_bit(weight_decay: float, clip: float | None) -> None:
    algorithm, model, data, context, settings = _client(0.3, True, weight_decay, clip)
    seen = {}

    def finish(view, state, context, update):
        computation = update.computation
        batches = computation.minibatches(update.steps_done, "local")
        seen["state"], seen["w"] = apfl.personal_steps(
            state, view.params, batches, computation.loss_gradient, computation.settings, True, None
        )
        seen["final"] = update.final_params
        return algorithm.client_finish(view, state, context, update)

    spy = dataclasses.replace(algorithm, client_finish=finish)
    view = spy.broadcast(spy.server_init(model.initial_parameters()))
    start = apfl.ClientState(model.initial_parameters() + 0.1, 0.3)  # v ≠ w, so α moves from the first step
    # the sequential backend's client
    state, message, steps = run_client(ClientRound(spy, view, start, context, data, settings))
    assert steps == 9 and torch.equal(seen["w"], seen["final"]) and torch.equal(message.params, seen["final"])
    assert torch.equal(state.personal, seen["state"].personal) and state.alpha == seen["state"].alpha != 0.3


def test_fixed_alpha_one_is_plain_local_sgd_of_v_on_the_same_minibatches() -> None:
    algorithm, model, data, context, settings = _client(1.0, False, 1e-3, 0.5)
    view = algorithm.broadcast(algorithm.server_init(model.initial_parameters()))
    v = model.initial_parameters() * 0.5
    state, _, steps = run_client(ClientRound(algorithm, view, apfl.ClientState(v, 1.0), context, data, settings))
    computation = ClientDataComputation(data, settings.seed, context.round, context.client_id, settings)
    local, _ = computation.train(v, NO_CORRECTION, steps, "local")  # the same batches the global model read, from v
    assert state.alpha == 1.0 and torch.equal(state.personal, local)
    assert torch.equal(algorithm.personalization.model(view, state), local)


# ---------------------------------------------------------------- quadratics: the personal models find each client's optimum


@dataclass(frozen=True)
class QuadraticComputation:
    """Full-batch ``f_k(θ) = ½ θᵀ diag(a_k) θ − b_kᵀ θ`` as a ``ClientComputation``."""

    problem: Quadratics
    client: int
    settings: LocalSettings

    def minibatches(self, steps: int, purpose: str = "local") -> list[tuple[None, None]]:
        return [(None, None)] * steps

    def loss_gradient(self, params: torch.Tensor, inputs: None, targets: None) -> torch.Tensor:
        return self.problem.gradient(self.client, params)


def _run_quadratics(
    algorithm: Any, problem: Quadratics, rounds: int, steps: int, lr: float
) -> tuple[Any, dict[int, Any]]:
    settings = LocalSettings(lr)
    initial = torch.zeros(problem.curvatures.shape[1], dtype=F64)
    server = algorithm.server_init(initial)
    init = algorithm.client_state_init or (lambda params: None)
    states = {k: init(initial) for k in range(problem.num_clients)}
    for t in range(1, rounds + 1):
        view = algorithm.broadcast(server)
        messages = []
        for k in range(problem.num_clients):
            theta = view.params
            for _ in range(steps):
                theta = corrected_step(theta, problem.gradient(k, theta), NO_CORRECTION, settings)
            context = ClientContext(k, t, 10, 10.0, problem.num_clients, steps, lr)
            update = ClientUpdate(view.params, theta, steps, QuadraticComputation(problem, k, settings))
            states[k], message = algorithm.client_finish(view, states[k], context, update)
            messages.append(message)
        server, _ = algorithm.server_update(
            server, messages, RoundContext(t, problem.num_clients, problem.num_clients, 1.0)
        )
    return server, states


def _papers_round(
    problem: Quadratics, client: int, v: torch.Tensor, w: torch.Tensor, alpha: float, steps: int, lr: float
):
    """The paper's K local steps with α fixed, written out: ``v̄ = α v + (1−α) w``, ``v ← v − η α ∇f(v̄)``,
    ``w ← w − η ∇f(w)``; returns the final v and the mixtures v̄ the steps evaluated."""
    mixtures = []
    for _ in range(steps):
        mixture = alpha * v + (1 - alpha) * w
        mixtures.append(mixture)
        v, w = v - lr * alpha * problem.gradient(client, mixture), w - lr * problem.gradient(client, w)
    return v, torch.stack(mixtures)


@pytest.mark.parametrize(("alpha", "steps"), [(0.5, 1), (1.0, 5), (0.5, 5)])
def test_fixed_alpha_converges_to_the_papers_fixed_point_on_quadratics(alpha: float, steps: int) -> None:
    # At the fixed point a round returns v to itself, so Σ_t ∇f_k(v̄^{t−1}) = 0: the mean of the round's mixtures is
    # x_k* = b_k/a_k (f_k quadratic).  With one step, or α = 1, that is the personal model α v + (1−α) w itself.
    problem = heterogeneous_quadratics()
    algorithm = apfl.build(SGD, alpha=alpha, adaptive=False)
    server, states = _run_quadratics(algorithm, problem, rounds=1000, steps=steps, lr=0.1)
    view = algorithm.broadcast(server)
    for k in range(problem.num_clients):
        optimum = problem.targets[k] / problem.curvatures[k]
        v, mixtures = _papers_round(problem, k, states[k].personal, server.params, alpha, steps, 0.1)
        assert torch.allclose(v, states[k].personal, rtol=0, atol=1e-10), k
        assert torch.allclose(mixtures.mean(0), optimum, rtol=0, atol=1e-9), k
        if steps == 1 or alpha == 1.0:
            assert torch.allclose(algorithm.personalization.model(view, states[k]), optimum, rtol=0, atol=1e-9), k
    fedavg_server, _ = _run_quadratics(fedavg.build(SGD), problem, rounds=1000, steps=steps, lr=0.1)
    assert torch.equal(server.params, fedavg_server.params)


@pytest.mark.parametrize(("alpha", "alpha_lr"), [(0.5, None), (0.25, 0.01)])
def test_learned_alpha_gives_each_client_a_better_model_than_the_global_one_on_quadratics(
    alpha: float, alpha_lr: float | None
) -> None:
    # Full-batch quadratics: each client's own minimiser is its best model, so α should grow towards 1.  (α⁰ = 0.25 with
    # η_α = η_l = 0.1 drives three of these five clients to α = 0, where v stops: docs/update-rules.md, "APFL".)
    problem = heterogeneous_quadratics()
    algorithm = apfl.build(SGD, alpha=alpha, adaptive=True, alpha_lr=alpha_lr)
    server, states = _run_quadratics(algorithm, problem, rounds=400, steps=5, lr=0.1)
    view = algorithm.broadcast(server)

    def excess(k: int, x: torch.Tensor) -> float:  # f_k(x) − min f_k
        return float(0.5 * (problem.curvatures[k] * (x - problem.targets[k] / problem.curvatures[k]) ** 2).sum())

    for k in range(problem.num_clients):
        own = algorithm.personalization.model(view, states[k])
        assert excess(k, own) < 0.05 * excess(k, server.params), (k, states[k].alpha)
        assert alpha < states[k].alpha <= 1.0


# ---------------------------------------------------------------- full runs

PERSONAL = ["data.client_test_fraction=0.25", "client.lr=0.1", "rounds=4"]


def run(*overrides: str, algorithm: dict | None = None, **top: Any) -> Any:
    return driftlab.run({**TINY, **top, "algorithm": algorithm or {"name": "apfl"}}, overrides=list(overrides))


def test_fixed_alpha_zero_is_fedavg_and_its_personal_column_is_the_server_models() -> None:
    ours = run(*PERSONAL, algorithm={"name": "apfl", "alpha": 0.0, "adaptive": False})
    reference = run(*PERSONAL, algorithm={"name": "fedavg"})
    assert torch.equal(ours.final_params, reference.final_params)
    for a, b in zip(ours.records, reference.records, strict=True):
        assert a["personal_test_accuracy_mean"] == a["client_test_accuracy_mean"] == b["client_test_accuracy_mean"]
        assert a["personal_test_accuracy_std"] == a["client_test_accuracy_std"]
        assert a["test_accuracy"] == b["test_accuracy"] and a["train_loss"] == b["train_loss"]


def test_learned_alpha_personalizes_resumes_with_v_and_alpha_and_keeps_fedavgs_global_model(tmp_path: Path) -> None:
    config = {**TINY, "algorithm": {"name": "apfl"}}
    overrides = [*PERSONAL, "keep_checkpoint=true"]
    straight = driftlab.run(config, tmp_path / "straight", overrides=overrides)
    driftlab.run(config, tmp_path / "resumed", overrides=[*overrides, "rounds=2", "checkpoint_every=1"])
    resumed = driftlab.run(config, tmp_path / "resumed", overrides=[*overrides, "checkpoint_every=1"], resume=True)
    assert torch.equal(straight.final_params, resumed.final_params)
    assert [{k: v for k, v in r.items() if k != "round_seconds"} for r in straight.records] == [
        {k: v for k, v in r.items() if k != "round_seconds"} for r in resumed.records
    ]
    a = load_file(str(tmp_path / "straight" / "checkpoint.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoint.safetensors"))
    alphas = {key: value for key, value in a.items() if key.startswith("client/") and key.endswith("/alpha")}
    assert len(alphas) >= 3 and any(float(value) != 0.25 for value in alphas.values())  # α was learned
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)  # v and α resumed bit for bit
    # the personal models are not the server model, and the global model is FedAvg's
    assert any(r["personal_test_accuracy_mean"] != r["client_test_accuracy_mean"] for r in straight.records)
    reference = run(*PERSONAL, algorithm={"name": "fedavg"})
    assert torch.equal(straight.final_params, reference.final_params)


def test_sequential_and_vectorized_backends_agree() -> None:
    # client.lr = 0.01 (TINY's): float32 rounding of the two backends' global models stays small for 4 rounds
    sequential = run("data.client_test_fraction=0.25", "rounds=4", backend="sequential")
    vectorized = run("data.client_test_fraction=0.25", "rounds=4", backend="vectorized")
    assert torch.allclose(sequential.final_params, vectorized.final_params, rtol=1e-4, atol=1e-5)
    for a, b in zip(sequential.records, vectorized.records, strict=True):
        assert a["personal_test_accuracy_mean"] == pytest.approx(b["personal_test_accuracy_mean"], abs=0.02)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)


def test_compressed_uploads_run_and_cost_less() -> None:
    plain = run(*PERSONAL)
    compressed = run(*PERSONAL, "compression.ratio=0.3")
    assert torch.isfinite(compressed.final_params).all() and not torch.equal(
        plain.final_params, compressed.final_params
    )
    assert sum(r["upload_bits"] for r in compressed.records) < sum(r["upload_bits"] for r in plain.records)
    assert all("personal_test_accuracy_mean" in r for r in compressed.records)


def test_privacy_uses_fedavgs_form_and_asynchronous_training_is_refused() -> None:
    weighted = apfl.build(SGD)
    assert weighted.release is None and weighted.release_refusal == WEIGHTED_REFUSAL
    uniform = apfl.build(SGD, aggregation="uniform")
    view = uniform.broadcast(uniform.server_init(vector(1, 2)))
    message = fedavg.ClientMessage(vector(1.5, 1), 4, 1)
    assert torch.equal(uniform.release.release(view, message), vector(0.5, -1))
    assert torch.equal(
        uniform.release.release(view, uniform.release.restore(view, message, vector(2, 3))), vector(2, 3)
    )
    private = run(
        "privacy.clip=1",
        "privacy.noise_multiplier=1",
        "privacy.delta=1e-3",
        "sampling.mode=poisson",
        algorithm={"name": "apfl", "aggregation": "uniform"},
    )
    assert torch.isfinite(private.final_params).all()
    assert (
        not uniform.asynchronous
        and uniform.asynchronous_problem()
        == f'[asynchronous] with algorithm.name = "apfl": {apfl.ASYNCHRONOUS_REASON.text}'
    )
    with pytest.raises(ConfigError, match="remove \\[asynchronous\\]"):
        run("system.profiles=lognormal", "asynchronous.concurrency=5", "asynchronous.buffer=2")


@pytest.mark.parametrize("bad", [{"alpha": 1.5}, {"alpha": -0.1}, {"alpha_lr": 0.0}, {"mixing": 0.5}])
def test_bad_hyperparameters_are_config_errors(bad: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        driftlab.load_config({**TINY, "algorithm": {"name": "apfl", **bad}})


def test_build_refuses_an_alpha_outside_the_unit_interval() -> None:
    with pytest.raises(ValueError, match="alpha .* must be in \\[0, 1\\], got 2"):
        apfl.build(SGD, alpha=2)
    with pytest.raises(ConfigError, match="finetune_steps"):
        run(*PERSONAL, "evaluation.finetune_steps=2")


# ---------------------------------------------------------------- the shared two-client round, by hand
#
# shared_test.test_two_client_rounds_match_hand_computation runs this case (its setup is described there).  The global
# model is FedAvg's whatever α; with α = 0 fixed v is never read, so the shared harness needs no minibatches.
HAND_CASE = {"config": {"alpha": 0.0, "adaptive": False}, "params": [(0.375, 2.25), (0.46875, 2.8125)], "drift": None}
