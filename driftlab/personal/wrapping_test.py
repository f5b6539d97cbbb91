"""Partial-model personalization (``wrapping.py``): rounds by hand, equivalences, checkpoints and refusals.

The hand cases use the 2-layer linear model f(x) = b·a·x (``0.weight`` = a, the body; ``1.weight`` = b, the head),
the loss ½(f(x) − y)², η_l = 0.1, and two clients with one example each: client 0 (x = 1, y = 3), client 1
(x = 2, y = 0); θ⁰ = (a, b) = (1, 1); uniform FedAvg with server SGD at rate 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from driftlab.algorithms import ditto, fedavg, fedprox, scaffold
from driftlab.optim.server import make_server_optimizer
from driftlab.personal.selection import select
from driftlab.personal.wrapping import PersonalState, PersonalView, with_personal_layers
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import LocalSettings, TrainingData
from driftlab.simulation.round.client import ClientData, ClientRound, ClientSettings, run_client
from driftlab.simulation.seam import Algorithm, ClientContext, RoundContext
from driftlab.simulation.state.checkpoint import state_from_tensors, state_to_tensors

LR = 0.1


def _half_squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return 0.5 * (outputs[:, 0] - targets) ** 2


def linear_model(dtype: torch.dtype = torch.float64) -> FlatModel:
    module = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)).to(dtype)
    with torch.no_grad():
        module[0].weight.fill_(1.0)
        module[1].weight.fill_(1.0)
    return FlatModel.wrap(module, _half_squared_error, is_classifier=False)


def hand_clients(model: FlatModel) -> dict[int, ClientData]:
    examples = {0: (1.0, 3.0), 1: (2.0, 0.0)}
    return {
        k: ClientData(
            model,
            TrainingData(torch.tensor([[x]], dtype=torch.float64), torch.tensor([y], dtype=torch.float64)),
            torch.arange(1),
        )
        for k, (x, y) in examples.items()
    }


def run_rounds(
    algorithm: Algorithm,
    initial: torch.Tensor,
    clients: dict[int, ClientData],
    rounds: range,
    steps: int = 1,
    batch_size: int = 1,
    server: Any = None,
    states: dict[int, Any] | None = None,
) -> tuple[Any, dict[int, Any], list[Any]]:
    """The engine's round in miniature: every client through ``run_client`` from its view, then the server update."""
    server = algorithm.server_init(initial) if server is None else server
    states = dict(states or {})
    settings = ClientSettings(seed=0, batch_size=batch_size, local=LocalSettings(LR))
    messages: list[Any] = []
    for round_index in rounds:
        committed = dict(states)
        shared = algorithm.broadcast(server)
        messages = []
        for client_id, data in clients.items():
            init = algorithm.client_state_init
            state = committed.get(client_id, init(initial) if init is not None else None)
            view = algorithm.view_for(
                server, client_id, shared, lambda committed=committed: iter(sorted(committed.items()))
            )
            n = data.num_samples
            context = ClientContext(client_id, round_index, n, float(n), len(clients), steps, LR)
            new_state, message, _ = run_client(ClientRound(algorithm, view, state, context, data, settings))
            if new_state is not None:
                states[client_id] = new_state
            messages.append(message)
        server, _ = algorithm.server_update(
            server, messages, RoundContext(round_index, len(clients), len(clients), 1.0)
        )
    return server, states, messages


def uniform_fedavg() -> Algorithm:
    return fedavg.build(make_server_optimizer("sgd"), aggregation="uniform")


def wrapped(keep: tuple[str, ...], model: FlatModel, algorithm: Algorithm | None = None, first: int = 0) -> Algorithm:
    part = select(model.names, model.numels, keep)
    return with_personal_layers(algorithm or uniform_fedavg(), part, first)


def test_fedper_two_rounds_by_hand() -> None:
    # Round 1 from (a, b) = (1, 1): client 0 has f = 1, r = f − y = −2, ∇a = r·b·x = −2, ∇b = r·a·x = −2 → (1.2, 1.2);
    # client 1 has f = 2, r = 2, ∇a = ∇b = 4 → (0.6, 0.6).  The body is FedAvg's: a = 1 + (0.2 − 0.4)/2 = 0.9; the
    # head stays each client's own: p_0 = 1.2, p_1 = 0.6; the server's b stays 1.
    # Round 2: client 0 from (0.9, 1.2): f = 1.08, r = −1.92, ∇a = −2.304, ∇b = −1.728 → (1.1304, 1.3728);
    # client 1 from (0.9, 0.6): f = 1.08, r = 1.08, ∇a = 1.296, ∇b = 1.944 → (0.7704, 0.4056); a = 0.9504.
    model = linear_model()
    algorithm = wrapped(("head",), model)
    initial = model.initial_parameters()
    server, states, _ = run_rounds(algorithm, initial, hand_clients(model), range(1, 2))
    torch.testing.assert_close(server.params, torch.tensor([0.9, 1.0], dtype=torch.float64), rtol=0, atol=1e-12)
    assert states[0].personal.tolist() == pytest.approx([1.2], abs=1e-12)
    assert states[1].personal.tolist() == pytest.approx([0.6], abs=1e-12)
    server, states, _ = run_rounds(algorithm, initial, hand_clients(model), range(2, 3), server=server, states=states)
    torch.testing.assert_close(server.params, torch.tensor([0.9504, 1.0], dtype=torch.float64), rtol=0, atol=1e-12)
    assert server.params[1].item() == 1.0  # the server's head never moves: every message releases 0 there
    assert states[0].personal.tolist() == pytest.approx([1.3728], abs=1e-12)
    assert states[1].personal.tolist() == pytest.approx([0.4056], abs=1e-12)
    # each client's own model: the server's body with its own head
    shared = algorithm.broadcast(server)
    for client_id, head in ((0, 1.3728), (1, 0.4056)):
        view = algorithm.view_for(server, client_id, shared, lambda: iter(sorted(states.items())))
        assert isinstance(view, PersonalView)
        torch.testing.assert_close(view.params, torch.tensor([0.9504, head], dtype=torch.float64), rtol=0, atol=1e-12)
        mine = algorithm.personalization.model(view, states[client_id])
        torch.testing.assert_close(mine, torch.tensor([0.9504, head], dtype=torch.float64), rtol=0, atol=1e-12)


def test_lg_fedavg_round_by_hand() -> None:
    # LG-FedAvg keeps the body a on each client and averages the head b: the clients' round-1 steps are FedPer's
    # (both start at (1, 1)), so b = 1 + (0.2 − 0.4)/2 = 0.9, p_0 = a_0 = 1.2, p_1 = a_1 = 0.6, the server's a stays 1.
    model = linear_model()
    algorithm = wrapped(("body",), model)
    server, states, _ = run_rounds(algorithm, model.initial_parameters(), hand_clients(model), range(1, 2))
    torch.testing.assert_close(server.params, torch.tensor([1.0, 0.9], dtype=torch.float64), rtol=0, atol=1e-12)
    assert [states[k].personal.item() for k in (0, 1)] == pytest.approx([1.2, 0.6], abs=1e-12)


def test_fedrep_trains_the_head_first_then_the_body_by_hand() -> None:
    # Two local steps, the first on the head only, the second on the body only.  Client 0 from (1, 1): step 1,
    # r = −2, ∇b = −2 → b = 1.2; step 2, f = 1.2, r = −1.8, ∇a = r·b·x = −2.16 → a = 1.216.  Client 1: step 1,
    # r = 2, ∇b = 4 → b = 0.6; step 2, f = 1.2, r = 1.2, ∇a = 1.44 → a = 0.856.  a = 1 + (0.216 − 0.144)/2 = 1.036.
    model = linear_model()
    algorithm = wrapped(("head",), model, first=1)
    server, states, _ = run_rounds(algorithm, model.initial_parameters(), hand_clients(model), range(1, 2), steps=2)
    torch.testing.assert_close(server.params, torch.tensor([1.036, 1.0], dtype=torch.float64), rtol=0, atol=1e-12)
    assert [states[k].personal.item() for k in (0, 1)] == pytest.approx([1.2, 0.6], abs=1e-12)


def random_clients(model: FlatModel, count: int = 3, rows: int = 10) -> dict[int, ClientData]:
    generator = torch.Generator().manual_seed(0)
    return {
        k: ClientData(
            model,
            TrainingData(torch.randn(rows, 4, generator=generator), torch.randint(0, 3, (rows,), generator=generator)),
            torch.arange(rows),
        )
        for k in range(count)
    }


def mlp() -> FlatModel:
    torch.manual_seed(0)
    return FlatModel.wrap(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))


def _same(first: Any, second: Any) -> None:
    first_tensors, second_tensors = state_to_tensors(first, "x"), state_to_tensors(second, "x")
    assert first_tensors.keys() == second_tensors.keys()
    for key in first_tensors:
        assert torch.equal(first_tensors[key], second_tensors[key]), key


@pytest.mark.parametrize("build", [uniform_fedavg, lambda: scaffold.build(make_server_optimizer("sgd"))])
def test_nothing_personal_is_the_wrapped_algorithm_bit_for_bit(build: Any) -> None:
    model = mlp()
    initial = model.initial_parameters()
    clients = random_clients(model)
    plain = run_rounds(build(), initial, clients, range(1, 4), steps=3, batch_size=4)
    personal = run_rounds(wrapped((), model, build()), initial, clients, range(1, 4), steps=3, batch_size=4)
    _same(plain[0], personal[0])
    for client_id, state in plain[1].items():
        _same(state, personal[1][client_id].inner)
    for plain_message, message in zip(plain[2], personal[2], strict=True):
        _same(plain_message, message)


def test_shared_part_is_the_wrapped_rule_and_personal_part_each_clients_own_sgd() -> None:
    # SCAFFOLD with the head personal: on the body the server moves as SCAFFOLD over the body does (the messages are
    # SCAFFOLD's there), on the head neither θ nor c ever moves, and each client's head is its own local SGD's.
    model = mlp()
    initial = model.initial_parameters()
    clients = random_clients(model)
    algorithm = wrapped(("head",), model, scaffold.build(make_server_optimizer("sgd")))
    mask = select(model.names, model.numels, ("head",)).mask()
    server, states, messages = run_rounds(algorithm, initial, clients, range(1, 3), steps=3, batch_size=4)
    assert torch.equal(server.params[mask], initial[mask])
    assert torch.equal(server.control[mask], torch.zeros(int(mask.sum()), dtype=server.control.dtype))
    assert not torch.equal(server.params[~mask], initial[~mask])
    for message in messages:
        assert torch.equal(message.params_delta[mask], torch.zeros_like(message.params_delta[mask]))
        assert torch.equal(message.control_delta[mask], torch.zeros_like(message.control_delta[mask]))
    # a client's own head after the rounds is what plain SCAFFOLD's local SGD gives from its own start model
    plain = scaffold.build(make_server_optimizer("sgd"))
    server, states, _ = run_rounds(algorithm, initial, clients, range(1, 2), steps=3, batch_size=4)
    server_two, states_two, _ = run_rounds(
        algorithm, initial, clients, range(2, 3), steps=3, batch_size=4, server=server, states=states
    )
    settings = ClientSettings(seed=0, batch_size=4, local=LocalSettings(LR))
    view = algorithm.view_for(server, 1, algorithm.broadcast(server), lambda: iter(sorted(states.items())))
    plain_view = dataclasses.replace(plain.broadcast(server), params=view.params)
    context = ClientContext(1, 2, 10, 10.0, 3, 3, LR)
    plain_state, plain_message, _ = run_client(
        ClientRound(plain, plain_view, states[1].inner, context, clients[1], settings)
    )
    trained = plain_view.params + plain_message.params_delta  # SCAFFOLD's message carries Δy_k = y_k − start
    torch.testing.assert_close(states_two[1].personal, trained[mask], rtol=0, atol=1e-6)
    _same(states_two[1].inner, plain_state)


def test_a_resumed_run_equals_an_uninterrupted_one() -> None:
    # Two rounds, the server and client states through a checkpoint's tensors, two more: the same numbers as four.
    model = mlp()
    initial = model.initial_parameters()
    clients = random_clients(model)
    algorithm = wrapped(("head",), model, fedprox.build(make_server_optimizer("sgd"), mu=0.1, aggregation="uniform"))
    straight = run_rounds(algorithm, initial, clients, range(1, 5), steps=3, batch_size=4)
    server, states, _ = run_rounds(algorithm, initial, clients, range(1, 3), steps=3, batch_size=4)
    template = algorithm.client_state_init(initial)
    saved = {k: state_to_tensors(state, f"client/{k}") for k, state in states.items()}
    loaded = {k: state_from_tensors(template, saved[k], f"client/{k}", initial.device) for k in states}
    assert all(isinstance(state, PersonalState) for state in loaded.values())
    server = state_from_tensors(server, state_to_tensors(server, "server"), "server", initial.device)
    resumed = run_rounds(algorithm, initial, clients, range(3, 5), steps=3, batch_size=4, server=server, states=loaded)
    _same(straight[0], resumed[0])
    for client_id in straight[1]:
        _same(straight[1][client_id], resumed[1][client_id])


def test_refusals_say_why_and_what_to_change() -> None:
    model = linear_model()
    part = select(model.names, model.numels, ("head",))
    weighted = fedavg.build(make_server_optimizer("sgd"))  # n_k-weighted: no release form
    with pytest.raises(ValueError, match=r'\[personal_layers\] with .*aggregation = "uniform"'):
        with_personal_layers(weighted, part)
    with pytest.raises(ValueError, match="already keeps one"):
        with_personal_layers(ditto.build(make_server_optimizer("sgd")), part)
    algorithm = with_personal_layers(uniform_fedavg(), part)
    assert algorithm.release is None and algorithm.client_view is not None
    assert "each client starts from its own model" in algorithm.lack_reasons["shared view"].text
