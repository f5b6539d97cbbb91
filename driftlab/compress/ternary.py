"""ST: top-k sparsification followed by ternary quantization, and its exact bit cost.

EFL (../shared/papers/002_*, Algorithm 2) as algorithms.md states it, per tensor ``T`` with ``n`` entries:

    k = max(⌊q·n⌋, 1);   keep the k entries of largest |T|;
    μ = mean |T| over the kept entries;   ST(T) = μ·sign(T) on them, 0 elsewhere.

(The extracted paper text averages the signed kept values; the sheet's mean
magnitude is what makes the output ternary in {−μ, 0, μ} as the paper says.)

Bits on the wire for one tensor: a 32-bit scale, one sign bit per kept entry,
and the positions, ``k·⌈log2 n⌉`` bits as indices or an ``n``-bit mask,
whichever is smaller: ``32 + k + min(n, k·⌈log2 n⌉)``.

``ratio = 1`` means no compression at all (the identity, 32 bits per entry),
the paper's uncompressed baseline, rather than a ternary code of every entry.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def kept_entries(numel: int, ratio: float) -> int:
    """``k = max(⌊q·n⌋, 1)``."""
    return max(int(math.floor(ratio * numel)), 1)


def ternary_bits(numel: int, kept: int) -> int:
    """``32 + k + min(n, k·⌈log2 n⌉)`` bits for one ST-compressed tensor."""
    position_bits = kept * math.ceil(math.log2(numel)) if numel > 1 else 0
    return 32 + kept + min(numel, position_bits)


def sparse_ternary(tensor: torch.Tensor, ratio: float) -> torch.Tensor:
    """``ST(tensor)`` for a 1-D tensor, as a dense tensor with k non-zero entries of equal magnitude."""
    flat = tensor.reshape(-1)
    kept = kept_entries(flat.numel(), ratio)
    magnitudes = flat.abs()
    positions = torch.topk(magnitudes, kept, sorted=False).indices
    scale = magnitudes[positions].mean()
    out = torch.zeros_like(flat)
    out[positions] = scale * torch.sign(flat[positions])
    return out.reshape(tensor.shape)


def compress_model(vector: torch.Tensor, tensor_sizes: Sequence[int], ratio: float) -> tuple[torch.Tensor, int]:
    """ST applied to each of the model's tensors inside a flat vector; returns the result and its bits.

    ``ratio >= 1`` is the identity at 32 bits per entry.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"compression ratio q must be in (0, 1], got {ratio}")
    if sum(tensor_sizes) != vector.numel():
        raise ValueError(f"tensor sizes sum to {sum(tensor_sizes)}, the vector has {vector.numel()} entries")
    if ratio >= 1:
        return vector, 32 * vector.numel()
    pieces = torch.split(vector, list(tensor_sizes))
    compressed = torch.cat([sparse_ternary(piece, ratio) for piece in pieces])
    bits = sum(ternary_bits(size, kept_entries(size, ratio)) for size in tensor_sizes)
    return compressed, bits
