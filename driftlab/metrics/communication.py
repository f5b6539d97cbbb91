"""Bits on the wire.

docs/update-rules.md: uncompressed tensors cost 32 bits per entry,
whatever dtype the simulation computes in (an fp64 test run still models fp32
traffic).  A compressed payload type carries its own exact count in a ``bits``
attribute.  Scalars such as a client's sample count are not counted: the
papers count model-sized traffic only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

BITS_PER_ENTRY = 32


def payload_bits(payload: Any) -> int:
    """Bits to send ``payload``: a tensor, a dataclass of them, a sequence of them, or None."""
    import torch  # here: reports read BITS_PER_ENTRY (through metrics.summary) without importing torch

    if payload is None or isinstance(payload, (int, float, bool, str)):
        return 0
    bits = getattr(payload, "bits", None)
    if isinstance(bits, int):
        return bits
    if isinstance(payload, torch.Tensor):
        return BITS_PER_ENTRY * payload.numel()
    if dataclasses.is_dataclass(payload):
        return sum(payload_bits(getattr(payload, field.name)) for field in dataclasses.fields(payload))
    if isinstance(payload, (tuple, list)):
        return sum(payload_bits(item) for item in payload)
    raise TypeError(f"cannot count the bits of a {type(payload).__name__}; use tensors, dataclasses or sequences")


def model_equivalents(bits: int, num_parameters: int) -> float:
    """``bits`` expressed in uncompressed models (FedDyn Tables 1-2 count communication this way)."""
    return bits / (BITS_PER_ENTRY * num_parameters)
