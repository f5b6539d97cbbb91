"""The shared list every algorithm in the registry must pass, and the quadratic harness the per-algorithm tests use.

Shared list (parametrized over the registry's built-in algorithms; a new algorithm joins by
its registry line, and its own test module's ``HAND_CASE``):

* seeded determinism of a short ``driftlab.run``; another seed gives other numbers;
* checkpoint/resume exactness, client state included: 2 rounds, resume to 4
  equals 4 rounds straight (final model, every metric but wall time, and
  every tensor of the final checkpoint, server and client states);
* a round of two clients checked against numbers computed by hand.

The quadratic harness (``Quadratics``, ``run_quadratic``) trains clients
``f_i(x) = ½ xᵀ A_i x − b_iᵀ x`` (diagonal ``A_i``) by full-batch GD through
``corrected_step``, the engine's own local step, and calls an algorithm's
``broadcast``/``client_objective``/``client_finish``/``server_update`` exactly as
the engine does (the client halves get the client view).  It lets the convergence tests run without the engine's data sets.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.algorithms import ALGORITHMS
from driftlab.algorithms.registry import BUILT_IN
from driftlab.algorithms.testing import TINY
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.backends.local_training import LocalSettings, corrected_step
from driftlab.simulation.backends.objectives import as_local_objective, objective_loss
from driftlab.simulation.seam import Algorithm, ClientContext, ClientUpdate, RoundContext

BUILT_IN_NAMES = sorted(BUILT_IN)

# ---------------------------------------------------------------- quadratic harness


@dataclass(frozen=True)
class Quadratics:
    """Clients ``f_i(x) = ½ xᵀ diag(curvatures[i]) x − targets[i]ᵀ x``; the global objective is their mean."""

    curvatures: torch.Tensor  # [N, d], positive
    targets: torch.Tensor  # [N, d]

    @property
    def num_clients(self) -> int:
        return self.curvatures.shape[0]

    def gradient(self, client: int, x: torch.Tensor) -> torch.Tensor:
        return self.curvatures[client] * x - self.targets[client]

    def minimiser(self) -> torch.Tensor:
        """``argmin mean_i f_i = Σ b_i / Σ a_i`` (coordinate-wise)."""
        return self.targets.sum(0) / self.curvatures.sum(0)


def heterogeneous_quadratics(num_clients: int = 5, dim: int = 3, seed: int = 0) -> Quadratics:
    """Curvatures uniform in [1, 3], targets N(0, 4): clients with very different minimisers."""
    generator = torch.Generator().manual_seed(seed)
    curvatures = 1 + 2 * torch.rand(num_clients, dim, generator=generator, dtype=torch.float64)
    targets = 2 * torch.randn(num_clients, dim, generator=generator, dtype=torch.float64)
    return Quadratics(curvatures, targets)


@dataclass
class QuadraticRun:
    server: Any
    client_states: dict[int, Any]
    metrics: list[dict[str, float]]


def run_quadratic(
    algorithm: Algorithm,
    problem: Quadratics,
    initial: torch.Tensor,
    rounds: int,
    steps: int,
    learning_rate: float,
    participants: Callable[[int], Sequence[int]] | None = None,
    num_samples: Sequence[int] | None = None,
) -> QuadraticRun:
    """Full-batch local GD on ``problem`` for ``rounds`` rounds; ``participants(t)`` picks the clients (default: all)."""
    num_clients = problem.num_clients
    sizes = list(num_samples) if num_samples is not None else [10] * num_clients
    mean_size = sum(sizes) / num_clients
    settings = LocalSettings(learning_rate)
    server = algorithm.server_init(initial)
    states: dict[int, Any] = {}
    history = []
    for t in range(1, rounds + 1):
        chosen = list(participants(t)) if participants is not None else list(range(num_clients))
        new_states, messages = {}, []
        for client in chosen:
            if client in states:
                state = states[client]
            else:
                state = algorithm.client_state_init(initial) if algorithm.client_state_init else None
            context = ClientContext(client, t, sizes[client], mean_size, num_clients, steps, learning_rate)
            stored = lambda: iter(sorted(states.items()))  # noqa: E731 - the round's committed states, as the engine's store
            view = algorithm.view_for(
                server, client, algorithm.broadcast(server), stored
            )  # a view of its own (FedAMP's u_k)
            correction = algorithm.client_objective(view, state, context)
            theta = view.params
            for _ in range(steps):
                theta = corrected_step(theta, problem.gradient(client, theta), correction, settings)
            new_states[client], message = algorithm.client_finish(
                view, state, context, ClientUpdate(view.params, theta, steps)
            )
            messages.append(message)
        states.update(new_states)  # like the engine: states are written after every client of the round finished
        server, metrics = algorithm.server_update(server, messages, RoundContext(t, num_clients, len(chosen), 1.0))
        history.append(metrics)
    return QuadraticRun(server, states, history)


def build_algorithm(
    name: str, server_optimizer: str = "sgd", num_clients: int = 4, **hyperparameters: Any
) -> Algorithm:
    """The registered algorithm; one whose entry ``needs_num_clients`` is built for ``num_clients`` (the hand case's N = 4)."""
    entry = ALGORITHMS[name]
    config = entry.config_type(name=name, **hyperparameters)
    if entry.needs_num_clients:
        return entry.from_config(config, make_server_optimizer(server_optimizer), num_clients)
    return entry.from_config(config, make_server_optimizer(server_optimizer))


# ---------------------------------------------------------------- full runs


def tiny_config(name: str, **top: Any) -> driftlab.ExperimentConfig:
    table = {**TINY, **top, "algorithm": {"name": name}}
    return driftlab.load_config(table)


def without_wall_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in record.items() if k != "round_seconds"} for record in records]


@pytest.mark.parametrize("name", BUILT_IN_NAMES)
def test_same_seed_same_numbers_other_seed_other_numbers(name: str) -> None:
    first = driftlab.run(tiny_config(name))
    second = driftlab.run(tiny_config(name))
    other = driftlab.run(tiny_config(name, seed=1))
    assert torch.equal(first.final_params, second.final_params)
    assert without_wall_time(first.records) == without_wall_time(second.records)
    assert [r["round"] for r in first.records] == [1, 2, 3]
    assert not torch.equal(first.final_params, other.final_params)
    assert without_wall_time(first.records) != without_wall_time(other.records)
    assert first.records[-1]["train_loss"] != other.records[-1]["train_loss"]


@pytest.mark.parametrize("name", BUILT_IN_NAMES)
def test_resume_from_checkpoint_is_exact_including_client_state(name: str, tmp_path: Path) -> None:
    straight = driftlab.run(tiny_config(name, rounds=4, keep_checkpoint=True), tmp_path / "straight")
    driftlab.run(tiny_config(name, rounds=2, checkpoint_every=1, keep_checkpoint=True), tmp_path / "resumed")
    resumed = driftlab.run(
        tiny_config(name, rounds=4, checkpoint_every=1, keep_checkpoint=True), tmp_path / "resumed", resume=True
    )
    assert torch.equal(straight.final_params, resumed.final_params)
    assert [r["round"] for r in resumed.records] == [1, 2, 3, 4]
    assert without_wall_time(straight.records) == without_wall_time(resumed.records)
    # The final checkpoints hold the server state and every client's state: all equal, tensor by tensor.
    straight_tensors = load_file(str(tmp_path / "straight" / "checkpoint.safetensors"))
    resumed_tensors = load_file(str(tmp_path / "resumed" / "checkpoint.safetensors"))
    assert straight_tensors.keys() == resumed_tensors.keys()
    for key in straight_tensors:
        assert torch.equal(straight_tensors[key], resumed_tensors[key]), key
    client_ids = {key.split("/")[1] for key in straight_tensors if key.startswith("client/")}
    if build_algorithm(name).client_state_init is not None:
        assert len(client_ids) >= 3  # 4 rounds of 3 out of 6 clients: the checkpoint carries several clients' state
    else:
        assert client_ids == set()


# ---------------------------------------------------------------- a two-client round by hand
#
# Two reporting clients out of N = 4 registered, f_k(θ) = ½‖θ − b_k‖² (gradient θ − b_k),
# b_0 = (2, 0), b_1 = (0, 4), n_0 = 1, n_1 = 3, n̄ = 2, θ^0 = (0, 0), K = 2 steps of
# η = 0.5, two rounds with both clients.  All numbers are dyadic, so float64 is exact.
#
# Each algorithm's test module holds its case, computed by hand for this setup, as ``HAND_CASE``:
# {"config": hyperparameters, "params": θ^1 and θ^2, "drift": drift_norm of rounds 1 and 2 or None,
#  optionally "fisher" (a fixed diagonal Fisher per client) and "metrics" (other metrics of rounds 1 and 2)}.


@dataclass(frozen=True)
class HandComputation:
    """A ``seam.ClientComputation`` of a hand-case client: its diagonal Fisher given by hand (zero when not), and the
    full gradient ``θ − b_k`` of its ``f_k(θ) = ½‖θ − b_k‖²``."""

    fisher: tuple[float, ...] | None
    target: torch.Tensor

    def diagonal_fisher(self, params: torch.Tensor, max_examples: int) -> torch.Tensor:
        return torch.zeros_like(params) if self.fisher is None else torch.tensor(self.fisher, dtype=params.dtype)

    def full_gradient(self, params: torch.Tensor) -> torch.Tensor:
        return params - self.target


def hand_gradient(objective: Any, theta: torch.Tensor, target: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """A hand client's ``(correction, ∇[½‖θ − b_k‖² + loss term](θ))``: an objective's loss term (Mime's) runs on the
    model whose output is θ itself with the example loss ``½‖out − b_k‖²``, through ``objectives.objective_loss``."""
    local = as_local_objective(objective)
    if local.loss_term is None:
        return local.correction, theta - target
    loss = objective_loss(
        lambda params, inputs: params.expand(len(inputs), -1),
        lambda outputs, targets: 0.5 * ((outputs - targets) ** 2).sum(1),
        local.loss_term.function,
    )
    inputs, weights = torch.zeros(1, 1, dtype=theta.dtype), torch.ones(1, dtype=theta.dtype)
    return local.correction, torch.func.grad(loss)(theta, inputs, target[None], weights, *local.loss_term.tensors)


def hand_round(
    algorithm: Algorithm,
    round_index: int,
    server: Any,
    states: list[Any],
    fisher: Sequence[tuple[float, ...]] | None = None,
) -> tuple[Any, list[Any], dict[str, float]]:
    targets = [torch.tensor([2.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 4.0], dtype=torch.float64)]
    sizes = [1, 3]
    settings = LocalSettings(0.5)
    new_states, messages = [], []
    if algorithm.prelude is not None:  # the round's first phase, as the engine's run_prelude does it
        prelude, shared = algorithm.prelude, algorithm.broadcast(server)
        total, weights = 0.0, 0.0
        for client in range(2):
            context = ClientContext(client, round_index, sizes[client], 2.0, 4, 2, 0.5)
            computation = HandComputation(fisher[client] if fisher is not None else None, targets[client])
            total = total + prelude.weight(context) * prelude.compute(
                algorithm.view_for(server, client, shared), context, computation
            )
            weights += prelude.weight(context)
        server = prelude.apply(server, total / weights)
    for client in range(2):
        context = ClientContext(client, round_index, sizes[client], 2.0, 4, 2, 0.5)
        stored = lambda: ((k, state) for k, state in enumerate(states) if state is not None)  # noqa: E731 - clients 0, 1
        view = algorithm.view_for(
            server, client, algorithm.broadcast(server), stored
        )  # a view of its own (FedAMP's u_k)
        correction = algorithm.client_objective(view, states[client], context)
        theta = view.params
        for _ in range(2):
            step_correction, gradient = hand_gradient(correction, theta, targets[client])
            theta = corrected_step(theta, gradient, step_correction, settings)
        computation = HandComputation(fisher[client] if fisher is not None else None, targets[client])
        update = ClientUpdate(view.params, theta, 2, computation)
        state, message = algorithm.client_finish(view, states[client], context, update)
        new_states.append(state)
        messages.append(message)
    server, metrics = algorithm.server_update(server, messages, RoundContext(round_index, 4, 2, 1.0))
    return server, new_states, metrics


def hand_case(name: str) -> dict[str, Any]:
    """The ``HAND_CASE`` of the algorithm's test module (``driftlab/algorithms/fedavg_test.py`` for fedavg), or its
    ``HAND_CASES[name]`` when the module holds several algorithms (mime.py: MimeLite and Mime)."""
    module = importlib.import_module(f"{ALGORITHMS[name].module}_test")
    return getattr(module, "HAND_CASES", {}).get(name, module.HAND_CASE)


@pytest.mark.parametrize("name", BUILT_IN_NAMES)
def test_every_algorithm_has_a_hand_case(name: str) -> None:
    assert {"config", "params", "drift"} <= set(hand_case(name))


@pytest.mark.parametrize("name", BUILT_IN_NAMES)
def test_two_client_rounds_match_hand_computation(name: str) -> None:
    case = hand_case(name)
    algorithm = build_algorithm(name, **case["config"])
    initial = torch.zeros(2, dtype=torch.float64)
    server = algorithm.server_init(initial)
    states = [algorithm.client_state_init(initial) if algorithm.client_state_init else None] * 2
    for round_index in (1, 2):
        server, states, metrics = hand_round(algorithm, round_index, server, states, case.get("fisher"))
        expected = torch.tensor(case["params"][round_index - 1], dtype=torch.float64)
        assert torch.equal(server.params, expected), (round_index, server.params, expected)
        if case["drift"] is None:
            assert "drift_norm" not in metrics
        else:
            assert metrics["drift_norm"] == pytest.approx(case["drift"][round_index - 1], rel=1e-15)
        for key, value in case.get("metrics", [{}, {}])[round_index - 1].items():
            assert metrics[key] == pytest.approx(value, rel=1e-15)


# ---------------------------------------------------------------- the FedAvg contrast on quadratics


def test_fedavg_with_several_local_steps_converges_to_a_surrogate_not_the_minimiser() -> None:
    # Per coordinate, K steps of GD on client i map x to x_i* + (1 − η a_i)^K (x − x_i*), x_i* = b_i/a_i, so the
    # fixed point of the average is x = Σ φ_i x_i* / Σ φ_i with φ_i = 1 − (1 − η a_i)^K (decaying-K paper, Section 3).
    problem = heterogeneous_quadratics()
    initial = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    steps, learning_rate = 10, 0.1
    run = run_quadratic(
        build_algorithm("fedavg"), problem, initial, rounds=200, steps=steps, learning_rate=learning_rate
    )
    phi = 1 - (1 - learning_rate * problem.curvatures) ** steps
    surrogate = (phi * problem.targets / problem.curvatures).sum(0) / phi.sum(0)
    assert torch.allclose(run.server.params, surrogate, rtol=0, atol=1e-10)
    assert torch.linalg.vector_norm(surrogate - problem.minimiser()) > 0.05
    # with one local step FedAvg is gradient descent on the mean objective and finds the minimiser
    one_step = run_quadratic(
        build_algorithm("fedavg"), problem, initial, rounds=400, steps=1, learning_rate=learning_rate
    )
    assert torch.allclose(one_step.server.params, problem.minimiser(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", BUILT_IN_NAMES)
def test_partial_work_and_dropouts(name: str) -> None:
    overrides = [
        f"algorithm.name={name}",
        "rounds=4",
        "data.num_clients=8",
        "sampling.participation=1.0",
        "client.epochs=3",
        "availability.inactive_probability=0.25",
        "availability.incomplete_probability=0.5",
        "compression.ratio=1",
    ]
    result = driftlab.run(None, overrides=overrides)
    assert sum(r["num_incomplete"] for r in result.records) > 0 and sum(r["num_inactive"] for r in result.records) > 0
    for record in result.records:
        active = record["num_selected"] - record["num_inactive"]  # dropouts never report
        # what the algorithm does with partial work (stragglers), as its registry entry and docstring say
        expected = active if ALGORITHMS[name].keeps_partial_work else active - record["num_incomplete"]
        assert record["num_reporting"] == expected
        assert record["upload_bits"] % (32 * result.num_parameters) == 0
        assert (record["upload_bits"] == 0) == (record["num_reporting"] == 0)
