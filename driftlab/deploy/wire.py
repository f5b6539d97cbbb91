"""The wire format of driftlab payloads: pickle-free, validated against what the receiver expects.

A payload is what travels between server and client: a client view, a
client message, a compressed message.  Payloads are frozen dataclasses of
tensors, ints, floats, bools, strings and ``None``, nested in dataclasses and
tuples.

``encode`` writes one safetensors blob: every tensor under its field path
(``payload/params_delta``, ``payload/payload/0``, ...) and, in the
safetensors metadata, a JSON header with the tree of the payload (dataclass
type names, field names, tuple lengths, each tensor's dtype and shape, each
scalar's type and value; floats as ``float.hex`` so they round-trip exactly)
and the envelope: the run's config fingerprint, the round and the client id.

``decode`` trusts nothing in a blob.  It walks a *template* of the expected
structure (for example the message an algorithm would produce) and rebuilds
the payload from the template's own types, so the blob can only fill in
values: it never names a class to instantiate, and no pickle, ``torch.load``
or ``eval`` is involved.  Everything that does not match raises
``MessageRejected`` with the exact reason: a blob over ``max_bytes``, an
unreadable blob, another run's fingerprint, another client's id, a round
other than the expected one (an older round is a replay), a missing or
unexpected field, a wrong dataclass type, tuple length, tensor shape or
dtype, a scalar of the wrong type, and any NaN or infinity.  It does not
authenticate: a blob carries no checksum or signature, so a flipped bit
inside a tensor's bytes decodes as another valid value.  Integrity (and
secrecy) on the wire depend on the transport: Flower with TLS.  What a
valid message may say is bounded by the deployment (``driftlab.deploy.server``
module docstring: planned weights, reply bounds, the node's own config).

Compressed uploads travel compressed.  ``TernaryVector`` (defined in
compress/ternary.py, importable from here) is ST(Δ) as it goes on the wire: per model tensor a scale μ,
one sign bit per kept entry and the positions as indices or a mask,
bit-packed, so its bytes are ``payload_bits/8`` of it (rounded up to whole
bytes).  A compressed message sent as ``CompressedPayload.wire_form()`` (its
model-sized field empty, a ``TernaryVector`` beside it) costs on the wire
what the metrics count, plus the header.  ``TernaryVector.to_dense()`` gives back the dense ST(Δ) exactly
(``torch.equal``), so the receiver reconstructs ``θ_start + ST(Δ)`` with the
same arithmetic as the client.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from driftlab.compress.ternary import TernaryVector  # sent as part of compressed messages; importable from here

WIRE_FORMAT = "driftlab-wire/1"
_METADATA_KEY = "driftlab"
_ROOT = "payload"


class MessageRejected(ValueError):
    """A received blob that is not the expected payload; ``reason`` says exactly what is wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------- encode


def encode(payload: Any, *, run_fingerprint: str, round: int, client_id: int) -> bytes:
    """``payload`` as one safetensors blob with the header and envelope in its metadata (module docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    tree = _encode_node(payload, _ROOT, tensors, storages)
    header = {
        "format": WIRE_FORMAT,
        "run_fingerprint": str(run_fingerprint),
        "round": int(round),
        "client_id": int(client_id),
        "tree": tree,
    }
    return save_safetensors(tensors, metadata={_METADATA_KEY: json.dumps(header, separators=(",", ":"))})


def _encode_node(value: Any, path: str, tensors: dict[str, torch.Tensor], storages: set[int]) -> dict[str, Any]:
    if value is None:
        return {"kind": "none"}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "value": value.hex()}
    if isinstance(value, str):
        return {"kind": "str", "value": value}
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # safetensors refuses tensors sharing memory (a view, the same tensor twice)
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[path] = tensor
        return {"kind": "tensor", "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            field.name: _encode_node(getattr(value, field.name), f"{path}/{field.name}", tensors, storages)
            for field in dataclasses.fields(value)
        }
        return {"kind": "dataclass", "type": _type_name(type(value)), "fields": fields}
    if isinstance(value, tuple):
        return {
            "kind": "tuple",
            "items": [_encode_node(item, f"{path}/{index}", tensors, storages) for index, item in enumerate(value)],
        }
    raise TypeError(
        f"cannot send {path!r} of type {type(value).__name__}: payloads hold tensors, ints, floats, bools, strings, None, dataclasses and tuples"
    )


def payload_bytes(blob: bytes) -> int:
    """Bytes of tensor data in an encoded blob (everything but the safetensors header)."""
    (header_length,) = struct.unpack("<Q", blob[:8])
    return len(blob) - 8 - header_length


# ---------------------------------------------------------------- decode


@dataclass(frozen=True)
class Envelope:
    """What a blob says about itself, read before it is decoded: which run, round and client, and the payload's type."""

    run_fingerprint: Any
    round: Any
    client_id: Any
    payload_type: str | None  # the dataclass type name of the payload (None: the payload is not a dataclass)


def read_envelope(blob: bytes, *, max_bytes: int) -> Envelope:
    """The envelope of ``blob``, to choose the template to decode it with; MessageRejected for what is no driftlab message.

    Nothing here is trusted: ``decode`` checks the envelope again against what the receiver expects.
    """
    blob = _bytes_within(blob, max_bytes)
    header = _read_header(blob)
    if header.get("format") != WIRE_FORMAT:
        raise MessageRejected(f"message format is {header.get('format')!r}, this driftlab reads {WIRE_FORMAT!r}")
    tree = header.get("tree")
    kind = tree.get("type") if isinstance(tree, dict) and tree.get("kind") == "dataclass" else None
    return Envelope(
        header.get("run_fingerprint"),
        header.get("round"),
        header.get("client_id"),
        kind if isinstance(kind, str) else None,
    )


def _bytes_within(blob: Any, max_bytes: int) -> bytes:
    """``blob`` as bytes; ``MessageRejected`` for anything else or more than ``max_bytes``, before any parsing."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise MessageRejected(f"expected bytes, got a {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise MessageRejected(f"message of {len(blob)} bytes exceeds the limit of {max_bytes} bytes")
    return bytes(blob)


def decode(blob: bytes, template: Any, *, run_fingerprint: str, round: int, client_id: int, max_bytes: int) -> Any:
    """The payload in ``blob``, of ``template``'s structure, from ``client_id`` for ``round`` of this run; else ``MessageRejected``."""
    blob = _bytes_within(blob, max_bytes)
    header = _read_header(blob)
    if header.get("format") != WIRE_FORMAT:
        raise MessageRejected(f"message format is {header.get('format')!r}, this driftlab reads {WIRE_FORMAT!r}")
    if header.get("run_fingerprint") != run_fingerprint:
        raise MessageRejected(
            f"message belongs to run {header.get('run_fingerprint')!r}, this run's config fingerprint is {run_fingerprint!r}"
        )
    sender = header.get("client_id")
    if type(sender) is not int or sender != client_id:
        raise MessageRejected(f"message says it is from client {sender!r}, it was expected from client {client_id}")
    sent_round = header.get("round")
    if type(sent_round) is not int:
        raise MessageRejected(f"message round {sent_round!r} is not a round number")
    if sent_round < round:
        raise MessageRejected(f"replay of round {sent_round}: round {round} is in progress")
    if sent_round > round:
        raise MessageRejected(f"message is for round {sent_round}, round {round} is in progress")
    try:
        tensors = load_safetensors(blob)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise MessageRejected(f"unreadable tensor data ({error})") from None
    used: set[str] = set()
    payload = _decode_node(header.get("tree"), template, _ROOT, tensors, used)
    extra = sorted(set(tensors) - used)
    if extra:
        raise MessageRejected(f"unexpected tensor {extra[0]!r} that the header does not describe")
    return payload


def _read_header(blob: bytes) -> dict[str, Any]:
    if len(blob) < 8:
        raise MessageRejected(f"message of {len(blob)} bytes is too short to be a driftlab message")
    (length,) = struct.unpack("<Q", blob[:8])
    if length > len(blob) - 8:
        raise MessageRejected(f"message header claims {length} bytes, only {len(blob) - 8} follow")
    try:
        outer = json.loads(blob[8 : 8 + length])
        header = json.loads(outer["__metadata__"][_METADATA_KEY])
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise MessageRejected(
            f"not a driftlab message: its header is unreadable ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(header, dict):
        raise MessageRejected("not a driftlab message: its header is not a JSON object")
    return header


def _decode_node(node: Any, template: Any, path: str, tensors: dict[str, torch.Tensor], used: set[str]) -> Any:
    if not isinstance(node, dict) or not isinstance(node.get("kind"), str):
        raise MessageRejected(f"{path}: missing or malformed entry in the header")
    kind = node["kind"]
    expected = _kind_of(template)
    if kind != expected:
        raise MessageRejected(f"{path}: expected {_describe(template)}, got a {kind}")
    if template is None:
        return None
    if isinstance(template, bool):
        return _scalar(node, bool, path)
    if isinstance(template, int):
        return _scalar(node, int, path)
    if isinstance(template, str):
        return _scalar(node, str, path)
    if isinstance(template, float):
        text = node.get("value")
        try:
            value = float.fromhex(text)
        except (TypeError, ValueError):
            raise MessageRejected(f"{path}: float value {text!r} is not a hexadecimal float") from None
        if not math.isfinite(value):
            raise MessageRejected(f"{path}: non-finite value {value}")
        return value
    if isinstance(template, torch.Tensor):
        return _tensor(node, template, path, tensors, used)
    if isinstance(template, tuple):
        items = node.get("items")
        if not isinstance(items, list) or len(items) != len(template):
            raise MessageRejected(
                f"{path}: expected a tuple of {len(template)} items, got {len(items) if isinstance(items, list) else items!r}"
            )
        return tuple(
            _decode_node(item, sub, f"{path}/{index}", tensors, used)
            for index, (item, sub) in enumerate(zip(items, template, strict=True))
        )
    # a dataclass (_kind_of accepts nothing else)
    if node.get("type") != _type_name(type(template)):
        raise MessageRejected(f"{path}: expected a {_type_name(type(template))}, got a {node.get('type')!r}")
    fields = node.get("fields")
    if not isinstance(fields, dict):
        raise MessageRejected(f"{path}: malformed dataclass entry (no fields)")
    names = [field.name for field in dataclasses.fields(template)]
    missing = [name for name in names if name not in fields]
    if missing:
        raise MessageRejected(f"{path}: missing key {missing[0]!r}")
    extra = sorted(set(fields) - set(names))
    if extra:
        raise MessageRejected(f"{path}: unexpected key {extra[0]!r}")
    if isinstance(template, TernaryVector):
        return _ternary(fields, template, path, tensors, used)
    values = {
        name: _decode_node(fields[name], getattr(template, name), f"{path}/{name}", tensors, used) for name in names
    }
    try:
        return dataclasses.replace(template, **values)
    except (TypeError, ValueError) as error:
        raise MessageRejected(f"{path}: the values do not make a valid {type(template).__name__} ({error})") from None


_SCALAR_NAMES = {int: "an int", bool: "a bool", str: "a string"}


def _scalar(node: dict[str, Any], kind: type, path: str) -> Any:
    value = node.get("value")
    if type(value) is not kind:
        raise MessageRejected(f"{path}: expected {_SCALAR_NAMES[kind]} value, got {value!r}")
    return value


def _tensor(
    node: dict[str, Any], template: torch.Tensor, path: str, tensors: dict[str, torch.Tensor], used: set[str]
) -> torch.Tensor:
    tensor = tensors.get(path)
    if tensor is None:
        raise MessageRejected(f"{path}: missing tensor data")
    used.add(path)
    if tensor.dtype != template.dtype:
        raise MessageRejected(f"{path}: dtype {_dtype_name(tensor.dtype)}, expected {_dtype_name(template.dtype)}")
    if tensor.shape != template.shape:
        raise MessageRejected(f"{path}: shape {list(tensor.shape)}, expected {list(template.shape)}")
    if node.get("dtype") != _dtype_name(tensor.dtype) or node.get("shape") != list(tensor.shape):
        raise MessageRejected(
            f"{path}: the header says {node.get('dtype')} {node.get('shape')}, the data is {_dtype_name(tensor.dtype)} {list(tensor.shape)}"
        )
    if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise MessageRejected(f"{path}: {bad} non-finite value{'s' if bad > 1 else ''} (NaN or infinity)")
    return tensor.to(template.device)


def _ternary(
    fields: dict[str, Any], template: TernaryVector, path: str, tensors: dict[str, torch.Tensor], used: set[str]
) -> TernaryVector:
    sizes = _decode_node(fields["sizes"], template.sizes, f"{path}/sizes", tensors, used)
    if sizes != template.sizes:
        raise MessageRejected(f"{path}/sizes: {list(sizes)}, expected the model's tensor sizes {list(template.sizes)}")
    counts = _decode_node(fields["counts"], template.counts, f"{path}/counts", tensors, used)
    scales = _decode_node(fields["scales"], template.scales, f"{path}/scales", tensors, used)
    node = fields["code"]
    if not isinstance(node, dict) or node.get("kind") != "tensor":
        raise MessageRejected(f"{path}/code: expected a tensor")
    code = tensors.get(f"{path}/code")
    if code is None:
        raise MessageRejected(f"{path}/code: missing tensor data")
    used.add(f"{path}/code")
    vector = TernaryVector(sizes, counts, scales, code)
    try:
        vector.to_dense()  # checks the counts, the code length and every position
    except ValueError as error:
        raise MessageRejected(f"{path}: inconsistent compressed vector ({error})") from None
    return vector


def _kind_of(template: Any) -> str:
    if template is None:
        return "none"
    if isinstance(template, bool):
        return "bool"
    if isinstance(template, int):
        return "int"
    if isinstance(template, float):
        return "float"
    if isinstance(template, str):
        return "str"
    if isinstance(template, torch.Tensor):
        return "tensor"
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        return "dataclass"
    if isinstance(template, tuple):
        return "tuple"
    raise TypeError(
        f"a template holds tensors, ints, floats, bools, strings, None, dataclasses and tuples, not a {type(template).__name__}"
    )


def _describe(template: Any) -> str:
    kind = _kind_of(template)
    if kind == "none":
        return "nothing (None)"
    if kind == "tensor":
        return f"a tensor ({_dtype_name(template.dtype)} {list(template.shape)})"
    if kind == "dataclass":
        return f"a {type(template).__name__}"
    return {"int": "an int", "str": "a string"}.get(kind, f"a {kind}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def type_name(cls: type) -> str:
    """The name a blob's header gives a dataclass type (``Envelope.payload_type``)."""
    return _type_name(cls)


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
