import builtins
import dataclasses
import json
import pickle
import struct

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from driftlab.algorithms import adabest, efl, fedavg, feddyn, fedprox, scaffold
from driftlab.compress.error_feedback import CompressedPayload
from driftlab.compress.ternary import compress_model
from driftlab.deploy.wire import MessageRejected, TernaryVector, decode, encode, payload_bytes
from driftlab.metrics.communication import BITS_PER_ENTRY, payload_bits
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.seam import ClientContext, ClientUpdate

RUN = "0123456789abcdef"
SIZES = (30, 20, 6)  # the model's tensors, flattened into one vector
P = sum(SIZES)
LIMIT = 1 << 20


class _Fisher:
    def diagonal_fisher(self, params, max_examples):
        return params.square() + 0.5


def _context(client_id, **overrides):
    values = dict(
        client_id=client_id,
        round=3,
        num_samples=40 + client_id,
        mean_num_samples=45.0,
        num_registered=10,
        planned_steps=4,
        multiplicity=1,
        client_lr=0.1,
    )
    values.update(overrides)
    return ClientContext(**values)


def _algorithms():
    sgd = make_server_optimizer("sgd")
    return {
        "fedavg": fedavg.build(sgd),
        "fedprox": fedprox.build(sgd, mu=0.1),
        "scaffold": scaffold.build(sgd),
        "feddyn": feddyn.build(alpha=0.1),
        "adabest": adabest.build(),
        "efl": efl.build(sgd, elastic=0.5, fisher_examples=4),
    }


def _round(algorithm, client_id, seed):
    """A client's real view, state and message of one round of ``algorithm``."""
    generator = torch.Generator().manual_seed(seed)
    initial = torch.randn(P, generator=generator)
    view = algorithm.broadcast(algorithm.server_init(initial))
    state = algorithm.client_state_init(initial) if algorithm.client_state_init is not None else None
    update = ClientUpdate(
        view.params, view.params + 0.1 * torch.randn(P, generator=generator), steps_done=4, computation=_Fisher()
    )
    new_state, message = algorithm.client_finish(view, state, _context(client_id), update)
    return view, new_state, message


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _send(payload, **envelope):
    values = dict(run_fingerprint=RUN, round=3, client_id=7)
    values.update(envelope)
    return encode(payload, **values)


def _receive(blob, template, **expected):
    values = dict(run_fingerprint=RUN, round=3, client_id=7, max_bytes=LIMIT)
    values.update(expected)
    return decode(blob, template, **values)


def _rejected(blob, template, fragment, **expected):
    with pytest.raises(MessageRejected) as caught:
        _receive(blob, template, **expected)
    assert fragment in str(caught.value), str(caught.value)
    assert caught.value.reason == str(caught.value)


def _edit_header(blob, edit):
    """``blob`` with its driftlab header changed by ``edit(header)`` (the tensor data unchanged)."""
    (length,) = struct.unpack("<Q", blob[:8])
    outer = json.loads(blob[8 : 8 + length])
    header = json.loads(outer["__metadata__"]["driftlab"])
    edit(header)
    outer["__metadata__"]["driftlab"] = json.dumps(header)
    text = json.dumps(outer).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + length :]


def _scaffold_message(client_id=7, seed=0):
    return _round(_algorithms()["scaffold"], client_id, seed)[2]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "scaffold", "feddyn", "adabest", "efl"])
def test_views_states_and_messages_of_every_algorithm_round_trip_exactly(name):
    algorithm = _algorithms()[name]
    template = _round(algorithm, 2, seed=1)
    payloads = _round(algorithm, 7, seed=2)
    for payload, expected in zip(payloads, template, strict=True):
        decoded = _receive(_send(payload), expected)
        assert _same(decoded, payload)


def test_ints_floats_bools_none_and_nested_tuples_keep_their_exact_values():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        flag: bool
        weights: tuple

    @dataclasses.dataclass(frozen=True)
    class Outer:
        count: int
        fraction: float
        missing: None
        inner: Inner

    payload = Outer(
        -3,
        0.1 + 0.2,
        None,
        Inner(True, (torch.arange(3, dtype=torch.int64), 1e-310, torch.ones(2, dtype=torch.bfloat16))),
    )
    template = Outer(
        0, 0.0, None, Inner(False, (torch.zeros(3, dtype=torch.int64), 0.0, torch.zeros(2, dtype=torch.bfloat16)))
    )
    assert _same(_receive(_send(payload), template), payload)


def test_a_tensor_sent_twice_or_as_a_view_is_sent_by_value():
    base = torch.arange(8, dtype=torch.float32)
    payload = (base, base, base[2:5])
    assert _same(_receive(_send(payload), (base, base, base[:3])), payload)


def test_a_client_with_no_message_sends_none():
    assert _receive(_send(None), None) is None


# ---------------------------------------------------------------- malformed and replayed messages


def test_wrong_shape_is_rejected():
    message = _scaffold_message()
    bad = dataclasses.replace(message, params_delta=torch.zeros(P + 1))
    _rejected(_send(bad), message, f"payload/params_delta: shape [{P + 1}], expected [{P}]")


def test_wrong_dtype_is_rejected():
    message = _scaffold_message()
    bad = dataclasses.replace(message, control_delta=message.control_delta.double())
    _rejected(_send(bad), message, "payload/control_delta: dtype float64, expected float32")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_tensor_values_are_rejected(value):
    message = _scaffold_message()
    poisoned = message.params_delta.clone()
    poisoned[5] = value
    _rejected(
        _send(dataclasses.replace(message, params_delta=poisoned)),
        message,
        "payload/params_delta: 1 non-finite value (NaN or infinity)",
    )


def test_non_finite_float_is_rejected():
    message = _round(_algorithms()["efl"], 7, seed=0)[2]
    _rejected(
        _send(dataclasses.replace(message, completed_fraction=float("nan"))),
        message,
        "payload/completed_fraction: non-finite value nan",
    )


def test_wrong_scalar_type_is_rejected():
    message = _scaffold_message()
    _rejected(
        _send(dataclasses.replace(message, multiplicity=1.0)),
        message,
        "payload/multiplicity: expected an int, got a float",
    )
    _rejected(
        _send(dataclasses.replace(message, multiplicity=True)),
        message,
        "payload/multiplicity: expected an int, got a bool",
    )


def test_missing_key_is_rejected():
    message = _scaffold_message()
    blob = _edit_header(_send(message), lambda header: header["tree"]["fields"].pop("control_delta"))
    _rejected(blob, message, "payload: missing key 'control_delta'")


def test_extra_key_is_rejected():
    message = _scaffold_message()
    blob = _edit_header(_send(message), lambda header: header["tree"]["fields"].update(extra={"kind": "none"}))
    _rejected(blob, message, "payload: unexpected key 'extra'")


def test_a_tensor_the_header_does_not_describe_is_rejected():
    message = _scaffold_message()
    blob = _send(message)
    (length,) = struct.unpack("<Q", blob[:8])
    metadata = json.loads(blob[8 : 8 + length])["__metadata__"]
    tensors = load_safetensors(blob)
    tensors["payload/smuggled"] = torch.zeros(3)
    _rejected(save_safetensors(tensors, metadata=metadata), message, "unexpected tensor 'payload/smuggled'")


def test_another_message_type_is_rejected():
    expected = _scaffold_message()
    other = _round(_algorithms()["fedavg"], 7, seed=0)[2]
    _rejected(
        _send(other),
        expected,
        "payload: expected a driftlab.algorithms.scaffold.ClientMessage, got a 'driftlab.algorithms.fedavg.ClientMessage'",
    )


def test_a_tensor_where_nothing_is_expected_and_the_reverse_are_rejected():
    message = _round(_algorithms()["efl"], 7, seed=0)[2]
    without_fisher = dataclasses.replace(message, fisher_change=None, weighted_model_change=None)
    _rejected(_send(message), without_fisher, "payload/fisher_change: expected nothing (None), got a tensor")
    _rejected(_send(without_fisher), message, f"payload/fisher_change: expected a tensor (float32 [{P}]), got a none")


def test_oversize_is_rejected_before_anything_is_parsed():
    message = _scaffold_message()
    blob = _send(message)
    _rejected(
        blob,
        message,
        f"message of {len(blob)} bytes exceeds the limit of {len(blob) - 1} bytes",
        max_bytes=len(blob) - 1,
    )
    assert _same(_receive(blob, message, max_bytes=len(blob)), message)


def test_wrong_client_id_is_rejected():
    message = _scaffold_message()
    _rejected(_send(message, client_id=8), message, "message says it is from client 8, it was expected from client 7")


def test_replay_of_an_older_round_is_rejected():
    message = _scaffold_message()
    _rejected(_send(message, round=2), message, "replay of round 2: round 3 is in progress")


def test_a_future_round_is_rejected():
    message = _scaffold_message()
    _rejected(_send(message, round=4), message, "message is for round 4, round 3 is in progress")


def test_wrong_run_fingerprint_is_rejected():
    message = _scaffold_message()
    _rejected(
        _send(message, run_fingerprint="feedfacefeedface"),
        message,
        "message belongs to run 'feedfacefeedface', this run's config fingerprint is '0123456789abcdef'",
    )


@pytest.mark.parametrize(
    "blob, fragment",
    [
        (b"", "too short"),
        (b"\xff" * 64, "header claims"),
        (struct.pack("<Q", 4) + b"{}  ", "its header is unreadable"),
    ],
)
def test_garbage_is_rejected(blob, fragment):
    _rejected(blob, _scaffold_message(), fragment)


def test_truncated_tensor_data_is_rejected():
    message = _scaffold_message()
    _rejected(_send(message)[:-4], message, "unreadable tensor data")


# ---------------------------------------------------------------- no pickle


def test_decode_never_unpickles_loads_with_torch_or_evaluates(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the wire format must not unpickle, torch.load or eval")

    message = _round(_algorithms()["efl"], 7, seed=0)[2]
    blob = _send(message)
    for module, name in [
        (pickle, "loads"),
        (pickle, "load"),
        (pickle, "Unpickler"),
        (torch, "load"),
        (builtins, "eval"),
        (builtins, "exec"),
    ]:
        monkeypatch.setattr(module, name, forbidden)
    assert _same(_receive(blob, message), message)


def test_the_blob_is_a_json_header_and_raw_tensor_bytes_only():
    message = _scaffold_message()
    blob = _send(message)
    (length,) = struct.unpack("<Q", blob[:8])
    json.loads(blob[8 : 8 + length])  # the whole header is JSON (no pickle opcodes anywhere in it)
    raw = message.params_delta.numpy().tobytes() + message.control_delta.numpy().tobytes()
    assert sorted(blob[8 + length :]) == sorted(raw)  # and the rest is exactly the tensors' bytes
    assert pickle.PROTO not in blob[8 : 8 + length]


# ---------------------------------------------------------------- compressed messages


def _compressed_scaffold(client_id, seed, ratio=0.1):
    """SCAFFOLD's message with its model-sized field in compressed form, and the dense ST(Δ) it carries."""
    message = _round(_algorithms()["scaffold"], client_id, seed)[2]
    sent, bits = compress_model(message.params_delta, SIZES, ratio)
    wire = dataclasses.replace(message, params_delta=TernaryVector.from_dense(sent, SIZES))
    # What with_compression counts: the message, its model part at the ST bits instead of 32 per entry.
    counted = payload_bits(message) - BITS_PER_ENTRY * P + bits
    return CompressedPayload(wire, counted), sent, bits


@pytest.mark.parametrize("ratio", [0.1, 0.5])  # indices, and a mask for the 6-entry tensor
def test_a_compressed_vector_round_trips_to_the_exact_dense_st_output(ratio):
    vector = torch.randn(P, generator=torch.Generator().manual_seed(3))
    sent, bits = compress_model(vector, SIZES, ratio)
    code = TernaryVector.from_dense(sent, SIZES)
    assert code.bits == bits
    assert torch.equal(code.to_dense(), sent)


def test_compressed_messages_cost_on_the_wire_what_payload_bits_counts():
    payload, sent, bits = _compressed_scaffold(7, seed=0)
    assert payload_bits(payload.payload) == payload.bits  # TernaryVector counts its own bits
    assert payload.payload.params_delta.bits == bits
    blob = _send(payload)
    on_wire = payload_bytes(blob)  # tensor data only, the header excluded
    assert payload.bits / 8 <= on_wire < payload.bits / 8 + 1
    assert on_wire < 4 * 2 * P * 0.7  # far below two dense vectors
    template = _compressed_scaffold(2, seed=1)[0]
    decoded = _receive(blob, template)
    assert _same(decoded, payload)
    assert torch.equal(decoded.payload.params_delta.to_dense(), sent)


def test_a_dense_vector_is_not_taken_for_a_ternary_one():
    with pytest.raises(ValueError, match="piece 0 .* is not a sparse ternary vector"):
        TernaryVector.from_dense(torch.randn(P), SIZES)


def test_inconsistent_compressed_vectors_are_rejected():
    payload = _compressed_scaffold(7, seed=0)[0]
    template = _compressed_scaffold(2, seed=1)[0]
    blob = _send(payload)
    grown = _edit_header(
        blob,
        lambda h: h["tree"]["fields"]["payload"]["fields"]["params_delta"]["fields"]["counts"]["items"][0].update(
            value=9
        ),
    )
    _rejected(grown, template, "payload/payload/params_delta: inconsistent compressed vector (code must be")
    other_sizes = dataclasses.replace(
        payload,
        payload=dataclasses.replace(payload.payload, params_delta=TernaryVector.from_dense(torch.zeros(P), (P,))),
    )
    _rejected(_send(other_sizes), template, "payload/payload/params_delta/sizes: expected a tuple of 3 items, got 1")
    # A position outside its tensor: the first index of the 30-entry piece (5 bits) set to 31.
    code = payload.payload.params_delta.code.clone()
    count = payload.payload.params_delta.counts[0]
    stream = [(int(code[i // 8]) >> (i % 8)) & 1 for i in range(8 * len(code))]
    stream[count : count + 5] = [1, 1, 1, 1, 1]
    packed = torch.tensor(
        [sum(bit << j for j, bit in enumerate(stream[i : i + 8])) for i in range(0, len(stream), 8)], dtype=torch.uint8
    )
    bad = dataclasses.replace(payload.payload.params_delta, code=packed)
    sent = _send(dataclasses.replace(payload, payload=dataclasses.replace(payload.payload, params_delta=bad)))
    _rejected(sent, template, "are not 3 distinct increasing indices below 30")


def test_the_deploy_package_and_the_flower_project_module_import_without_flower():
    import subprocess
    import sys

    modules = "driftlab.deploy.wire, driftlab.deploy.node_state, driftlab.deploy.messages, driftlab.deploy.node, driftlab.deploy.server"
    code = f"import sys, {modules}, driftlab.flower.project; assert 'flwr' not in sys.modules, 'flwr was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@dataclasses.dataclass(frozen=True)
class _Named:
    precision: str
    count: int


def test_strings_round_trip_and_a_string_of_another_type_is_rejected():
    assert _receive(_send(_Named("bf16", 3)), _Named("float32", 0)) == _Named("bf16", 3)
    blob = _edit_header(_send(_Named("bf16", 3)), lambda h: h["tree"]["fields"]["precision"].update(value=16))
    _rejected(blob, _Named("float32", 0), "payload/precision: expected a string value, got 16")
    _rejected(_send(_Named("bf16", 3)), _Named("float32", 0.5), "payload/count: expected a float, got a int")


def test_the_envelope_is_read_before_decoding_and_names_the_payload_type():
    from driftlab.deploy.wire import Envelope, read_envelope, type_name

    envelope = read_envelope(_send(_Named("bf16", 3), round=4, client_id=2), max_bytes=LIMIT)
    assert envelope == Envelope(RUN, 4, 2, type_name(_Named))
    assert read_envelope(_send((1, 2)), max_bytes=LIMIT).payload_type is None
    with pytest.raises(MessageRejected, match="exceeds the limit of 10 bytes"):
        read_envelope(_send(_Named("bf16", 3)), max_bytes=10)
    with pytest.raises(MessageRejected, match="too short"):
        read_envelope(b"abc", max_bytes=LIMIT)
