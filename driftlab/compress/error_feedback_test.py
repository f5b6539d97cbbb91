"""Error feedback both ways (algorithms.md, "EFL"): mass conservation, the server model, and bits on the wire."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import driftlab
from driftlab.algorithms import fedavg
from driftlab.algorithms.efl_test import context
from driftlab.compress import compress_model, with_compression
from driftlab.compress.testing import tiny_run
from driftlab.experiments.config import load_config
from driftlab.experiments.run.runner import build_simulation
from driftlab.metrics.communication import payload_bits
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.round.engine import run_round
from driftlab.simulation.seam import ClientUpdate, RoundContext

SIZES = (6, 3)  # two "tensors" in a flat vector of 9
RATIO = 0.34  # k = 2 of 6, 1 of 3
P = sum(SIZES)


def test_error_feedback_conserves_mass_on_both_sides():
    """Σ_t true Δ_k = Σ_t sent_k + R_k per client; Σ_t Σ_k w_k sent_k = Σ_t ST(Δ) + R at the server; θ_T − θ_0 = Σ_t ST(Δ)."""
    algorithm = with_compression(fedavg.build(make_server_optimizer("sgd")), RATIO, SIZES)
    generator = torch.Generator().manual_seed(5)
    theta0 = torch.randn(P, generator=generator, dtype=torch.float64)
    server = algorithm.server_init(theta0)
    clients = {k: algorithm.client_state_init(theta0) for k in (0, 1)}
    samples = {0: 1, 1: 3}  # w = 1/4, 3/4
    true_sums = {k: torch.zeros(P, dtype=torch.float64) for k in clients}
    sent_sums = {k: torch.zeros(P, dtype=torch.float64) for k in clients}
    aggregated_sum = torch.zeros(P, dtype=torch.float64)
    broadcast_sum = torch.zeros(P, dtype=torch.float64)
    for t in range(1, 7):
        start = server.params
        messages = []
        for k in clients:
            true_update = torch.randn(P, generator=generator, dtype=torch.float64) * (k + 1)
            update = ClientUpdate(start, start + true_update, 4)
            previous_residual = clients[k].residual
            clients[k], message = algorithm.client_finish(
                algorithm.broadcast(server), clients[k], context(k, t, samples[k]), update
            )
            sent = message.payload.params - start
            # what was sent is ST of (old residual + true update), per tensor
            expected_sent, expected_bits = compress_model(
                previous_residual + (update.final_params - start), SIZES, RATIO
            )
            assert torch.allclose(sent, expected_sent, rtol=0, atol=1e-12)
            assert int((sent[:6] != 0).sum()) == 2 and int((sent[6:] != 0).sum()) == 1
            assert message.bits == expected_bits == (32 + 2 + min(6, 2 * 3)) + (32 + 1 + min(3, 1 * 2))
            true_sums[k] += true_update
            sent_sums[k] += sent
            messages.append(message)
        aggregated = 0.25 * (messages[0].payload.params - start) + 0.75 * (messages[1].payload.params - start)
        aggregated_sum += aggregated
        server, _ = algorithm.server_update(server, messages, RoundContext(t, 2, 2, 1.0))
        broadcast = server.params - start
        assert int((broadcast[:6] != 0).sum()) <= 2 and int((broadcast[6:] != 0).sum()) <= 1
        broadcast_sum += broadcast
        assert server.broadcast_bits == 40 + 35
        # the residual is not trivially zero: compression really loses something each round
        assert float(server.residual.abs().max()) > 1e-3
    for k in clients:
        assert float(clients[k].residual.abs().max()) > 1e-3
        assert torch.allclose(sent_sums[k] + clients[k].residual, true_sums[k], rtol=0, atol=1e-12)
    assert torch.allclose(broadcast_sum + server.residual, aggregated_sum, rtol=0, atol=1e-12)
    assert torch.allclose(server.params - theta0, broadcast_sum, rtol=0, atol=1e-12)
    assert torch.equal(server.inner.params, server.params)  # the global model is the one every client holds


def test_dropped_message_keeps_the_clients_residual():
    """FedAvg drops an incomplete client: nothing is sent, so its residual must not change."""
    algorithm = with_compression(fedavg.build(make_server_optimizer("sgd")), RATIO, SIZES)
    theta0 = torch.zeros(P, dtype=torch.float64)
    server = algorithm.server_init(theta0)
    client = algorithm.client_state_init(theta0)
    first = torch.arange(1.0, P + 1, dtype=torch.float64)
    client, message = algorithm.client_finish(
        algorithm.broadcast(server), client, context(0, 1, 1), ClientUpdate(theta0, first, 4)
    )
    residual = client.residual.clone()
    assert float(residual.abs().max()) > 0
    client, message = algorithm.client_finish(
        algorithm.broadcast(server), client, context(0, 2, 1, available=2), ClientUpdate(theta0, 2 * first, 2)
    )
    assert message is None
    assert torch.equal(client.residual, residual)


def test_client_algorithm_sees_the_reconstructed_model_and_the_local_one():
    seen = {}
    inner = fedavg.build(make_server_optimizer("sgd"))

    def spy(view, client, context, update):
        seen["view"], seen["update"] = view, update
        return inner.client_finish(view, client, context, update)

    algorithm = with_compression(dataclasses.replace(inner, client_finish=spy), 0.5, (4,))
    theta0 = torch.zeros(4, dtype=torch.float64)
    local = torch.tensor([1.0, -3.0, 0.5, 2.0], dtype=torch.float64)
    server = algorithm.server_init(theta0)
    view = algorithm.broadcast(server)
    algorithm.client_finish(view, algorithm.client_state_init(theta0), context(0, 1, 1), ClientUpdate(theta0, local, 4))
    assert seen["view"] == fedavg.ClientView(theta0)  # the wrapped algorithm gets its own view, unwrapped
    assert payload_bits(view) == 32 * 4  # round 1 broadcasts a full model
    assert seen["update"].final_params.tolist() == [0.0, -2.5, 0.0, 2.5]  # ST keeps −3, 2 at μ = 2.5
    assert torch.equal(seen["update"].trained_params, local)


# ------------------------------------------------------------------ end to end

TINY = tiny_run(4)


def test_end_to_end_server_moves_only_by_broadcast_st_and_conserves_mass():
    config = load_config(None, [*TINY, "compression.ratio=0.1"])
    sim, state = build_simulation(config)
    numels = sim.model.numels
    assert numels == (600, 10)
    theta0 = state.server.params.clone()
    aggregated_sum = torch.zeros_like(theta0)
    broadcast_sum = torch.zeros_like(theta0)
    original_update = sim.algorithm.server_update
    captured = {}

    def recording_update(server, messages, context):
        weights = torch.tensor([m.payload.num_samples * m.payload.multiplicity for m in messages], dtype=torch.float64)
        weights = weights / weights.sum()
        captured["aggregated"] = sum(
            w * (m.payload.params - server.params) for w, m in zip(weights.tolist(), messages, strict=True)
        )
        return original_update(server, messages, context)

    sim.algorithm = dataclasses.replace(
        sim.algorithm, server_update=recording_update, server_fold=None
    )  # the engine collects
    for _ in range(config.rounds):
        before = state.server.params
        state, record = run_round(sim, state)
        step = state.server.params - before
        # each move is ST-shaped per tensor: ≤ k non-zeros, all of one magnitude
        for piece, kept in zip(torch.split(step, numels), (60, 1), strict=True):
            nonzero = piece[piece != 0]
            assert 0 < len(nonzero) <= kept
            assert torch.allclose(nonzero.abs(), nonzero.abs().mean().expand(len(nonzero)), rtol=1e-9, atol=0)
        aggregated_sum += captured["aggregated"]
        broadcast_sum += step
        assert record["upload_bits"] == record["num_reporting"] * (692 + 37)
    assert torch.allclose(state.server.params - theta0, broadcast_sum, rtol=0, atol=1e-12)
    assert torch.allclose(broadcast_sum + state.server.residual, aggregated_sum, rtol=0, atol=1e-12)
    assert float(state.server.residual.abs().max()) > 0


def test_bits_of_compressed_fedavg_run():
    result = driftlab.run(None, overrides=[*TINY, "compression.ratio=0.1"])
    st_bits = (32 + 60 + min(600, 60 * 10)) + (32 + 1 + min(10, 1 * 4))
    assert st_bits == 729
    for record in result.records:
        assert record["upload_bits"] == record["num_reporting"] * st_bits
        per_client_down = 32 * 610 if record["round"] == 1 else st_bits
        assert record["download_bits"] == record["num_selected"] * per_client_down


def test_ratio_one_is_no_compression_at_all():
    plain = driftlab.run(None, overrides=TINY)
    explicit = driftlab.run(None, overrides=[*TINY, "compression.ratio=1"])
    assert torch.equal(plain.final_params, explicit.final_params)
    strip = lambda records: [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]  # noqa: E731
    assert strip(plain.records) == strip(explicit.records)
    assert all(r["upload_bits"] == r["num_reporting"] * 32 * 610 for r in plain.records)


def _compressed_round(name: str, ratio: float = 0.2):
    """One client's compressed message of algorithm ``name`` (float32), with the round's start model."""
    from driftlab.algorithms import adabest, efl, feddyn, scaffold

    sgd = make_server_optimizer("sgd")
    inner = {
        "fedavg": lambda: fedavg.build(sgd),
        "scaffold": lambda: scaffold.build(sgd),
        "feddyn": lambda: feddyn.build(alpha=0.1),
        "adabest": lambda: adabest.build(),
        "efl": lambda: efl.build(sgd, elastic=0.5, fisher_examples=4),
    }[name]()
    sizes = (40, 24, 8)
    algorithm = with_compression(inner, ratio, sizes)
    generator = torch.Generator().manual_seed(11)
    start = torch.randn(sum(sizes), generator=generator)
    view = algorithm.broadcast(algorithm.server_init(start))

    class Fisher:
        def diagonal_fisher(self, params, max_examples):
            return params.square() + 0.5

    update = ClientUpdate(view.params, view.params + 0.1 * torch.randn(sum(sizes), generator=generator), 4, Fisher())
    _, message = algorithm.client_finish(view, algorithm.client_state_init(start), context(3, 1, 5), update)
    return message, start


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


@pytest.mark.parametrize(("name", "form"), [("fedavg", 1), ("scaffold", 2), ("feddyn", 1), ("adabest", 1), ("efl", 1)])
def test_a_compressed_message_travels_compressed_and_is_rebuilt_bit_for_bit(name, form):
    from driftlab.deploy.wire import encode, payload_bytes

    message, start = _compressed_round(name)
    assert message.model_form == form and message.model is not None
    field = dataclasses.fields(message.payload)[message.model_field].name
    sent = message.wire_form()
    assert getattr(sent.payload, field) is None and getattr(message.payload, field) is not None
    on_wire = payload_bytes(encode(sent, run_fingerprint="run", round=1, client_id=3))
    assert message.bits <= 8 * on_wire < message.bits + 8  # the bytes sent are the bits counted (rounded up to a byte)
    assert _equal(sent.rebuilt(start), message)


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "efl"])
def test_the_compressed_algorithms_codec_sends_the_wire_form_and_rebuilds_the_message_checking_its_bits(name):
    message, start = _compressed_round(name)
    codec = with_compression(fedavg.build(make_server_optimizer("sgd")), 0.2, (40, 24, 8)).codec
    assert _equal(codec.to_wire(message), message.wire_form())
    assert _equal(codec.from_wire(codec.to_wire(message), start), message)
    assert codec.unplanned == ("bits", "model")  # checked by from_wire, and ST(Δ_k) itself: never compared with a plan
    forged = dataclasses.replace(codec.to_wire(message), bits=message.bits - 1)
    with pytest.raises(
        ValueError, match=f"^the compressed message claims {message.bits - 1} bits, what arrived costs {message.bits}$"
    ):
        codec.from_wire(forged, start)
    with pytest.raises(ValueError, match="^compressed message does not fit: .*must arrive empty"):
        codec.from_wire(message, start)  # sent with its model field: the dense model would travel
    with pytest.raises(
        ValueError, match="^compressed message does not fit: a [A-Za-z]+ arrived, a compressed message was expected$"
    ):
        codec.from_wire(message.payload, start)


def test_an_uncompressed_algorithm_sends_its_messages_as_they_are():
    algorithm = fedavg.build(make_server_optimizer("sgd"))
    message = fedavg.ClientMessage(torch.ones(3), 5, 1)
    assert algorithm.codec.to_wire(message) is message and algorithm.codec.from_wire(message, torch.zeros(3)) is message
    assert algorithm.codec.unplanned == ()


def test_a_rebuilt_message_needs_a_consistent_form():
    message, start = _compressed_round("fedavg")
    sent = message.wire_form()
    with pytest.raises(ValueError, match="must arrive empty"):
        message.rebuilt(start)
    with pytest.raises(ValueError, match="do not fit the message"):
        dataclasses.replace(sent, model_field=17).rebuilt(start)
    with pytest.raises(ValueError, match="carries no compressed model"):
        dataclasses.replace(sent, model_form=0).rebuilt(start)
    with pytest.raises(
        ValueError, match=r"compressed model is torch.float32 \(72,\), the model is torch.float32 \(71,\)"
    ):
        sent.rebuilt(start[:71])


def test_the_compressed_bundle_forwards_every_field_it_does_not_change():
    from driftlab.privacy.mechanism_test import extended

    inner = dataclasses.replace(
        extended(fedavg.build(make_server_optimizer("sgd")), "a later field"), plugin="algorithm plugin 'x' (x.py)"
    )
    compressed = with_compression(inner, RATIO, SIZES)
    assert compressed.extra == "a later field" and (compressed.name, compressed.plugin) == (inner.name, inner.plugin)
    assert (
        compressed.server_fold is not inner.server_fold
        and compressed.codec is not inner.codec
        and not compressed.asynchronous
    )
