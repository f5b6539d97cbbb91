"""ST: top-k sparsification followed by ternary quantization, and its exact bit cost.

EFL (Algorithm 2) as docs/update-rules.md states it, per tensor ``T`` with ``n`` entries:

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
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from driftlab.metrics.communication import BITS_PER_ENTRY


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


@dataclass(frozen=True)
class TernaryVector:
    """ST(Δ) of a flat vector as it travels: for each model tensor (``sizes``) a scale and its kept entries.

    ``counts[i]`` entries of piece ``i`` are non-zero, all ``±scales[i]``.  ``code``
    is one little-endian bit stream (uint8): for each piece its ``counts[i]`` sign
    bits (1 = negative), then the positions, as ``counts[i]`` indices of
    ``⌈log2 n⌉`` bits or as an ``n``-bit mask, whichever is shorter (indices on a
    tie), exactly the layout ``ternary_bits`` counts.  Scales travel in the dense
    vector's dtype: 32 bits in an fp32 run (an fp64 test run sends 64-bit scales,
    as it sends its dense tensors at 64 bits).  A kept entry that is exactly 0 is
    not sent, so ``counts[i]`` can be below ``k`` (and the bits below
    ``ternary_bits(n, k)``) when a piece has fewer than ``k`` non-zero entries.

    The receiver should count ``payload_bits`` of what it decoded, never a
    ``bits`` number the sender wrote into a ``CompressedPayload``.
    """

    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    scales: torch.Tensor
    code: torch.Tensor

    @property
    def bits(self) -> int:
        """Bits on the wire, as ``payload_bits`` counts them (a 32-bit scale per piece)."""
        return sum(ternary_bits(size, count) for size, count in zip(self.sizes, self.counts, strict=True))

    @staticmethod
    def from_dense(vector: torch.Tensor, sizes: tuple[int, ...] | list[int]) -> "TernaryVector":
        """Encode a dense ST output (``compress_model``'s): in each piece, the non-zero entries share one magnitude."""
        sizes = tuple(int(size) for size in sizes)
        if vector.dim() != 1 or not vector.is_floating_point() or sum(sizes) != vector.numel():
            raise ValueError(
                f"expected a flat floating vector of {sum(sizes)} entries (the tensor sizes {list(sizes)}), "
                f"got {vector.dtype} of shape {tuple(vector.shape)}"
            )
        flat = vector.detach().to("cpu")
        counts, scales, chunks = [], [], []
        offset = 0
        for piece, size in enumerate(sizes):
            values = flat[offset : offset + size]
            positions = torch.nonzero(values, as_tuple=True)[0]
            kept = values[positions]
            scale = kept[0].abs() if len(kept) else torch.zeros((), dtype=flat.dtype)
            if not bool(torch.isfinite(kept).all()) or not bool((kept.abs() == scale).all()):
                raise ValueError(
                    f"piece {piece} (entries {offset}..{offset + size - 1}) is not a sparse ternary vector: its non-zero entries "
                    "must all be ±μ for one finite μ; encode the output of compress_model / sparse_ternary"
                )
            counts.append(len(kept))
            scales.append(scale)
            chunks.append(_piece_bits((kept < 0).numpy(), positions.numpy(), size))
            offset += size
        stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)
        code = torch.from_numpy(np.packbits(stream, bitorder="little"))
        scale_tensor = torch.stack(scales) if scales else torch.zeros(0, dtype=flat.dtype)
        return TernaryVector(sizes, tuple(counts), scale_tensor, code)

    def to_dense(self) -> torch.Tensor:
        """The dense vector back, ``torch.equal`` to the one encoded; ValueError for an inconsistent code."""
        self.check()
        stream = np.unpackbits(self.code.cpu().numpy(), bitorder="little")
        scales = self.scales.cpu()
        out = torch.zeros(sum(self.sizes), dtype=scales.dtype)
        offset, cursor = 0, 0
        for piece, (size, count) in enumerate(zip(self.sizes, self.counts, strict=True)):
            negative = stream[cursor : cursor + count].astype(bool)
            cursor += count
            width = _index_width(size)
            if count * width <= size:
                bits = stream[cursor : cursor + count * width].reshape(count, width).astype(np.int64)
                positions = (bits << np.arange(width, dtype=np.int64)).sum(axis=1)
                cursor += count * width
            else:
                positions = np.flatnonzero(stream[cursor : cursor + size])
                cursor += size
            if len(positions) != count or (count and (positions.max() >= size or np.any(np.diff(positions) <= 0))):
                raise ValueError(
                    f"piece {piece}: positions {positions.tolist()[:8]}... are not {count} distinct increasing indices below {size}"
                )
            signs = torch.where(torch.from_numpy(negative), -1.0, 1.0).to(scales.dtype)
            out[offset + torch.from_numpy(positions)] = scales[piece] * signs  # sparse_ternary's own product
            offset += size
        return out.to(self.scales.device)

    def scaled(self, factor: float) -> "TernaryVector":
        """The same signs and positions with each piece's μ times ``factor`` ≥ 0: ``factor`` times the vector, still
        ternary and of the same bits (client-level DP clips a compressed upload this way, so it travels compressed).

        ``to_dense`` of the result is ``μ·factor·sign`` on the kept entries, the receiver's own product; ValueError for
        a negative or non-finite factor (a sign flip would change the code, not the scales)."""
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"a ternary vector scales by a finite factor ≥ 0, got {factor}")
        return TernaryVector(self.sizes, self.counts, self.scales * factor, self.code)

    def check(self) -> None:
        """ValueError unless the counts, scales and code length agree with ``sizes``."""
        if len(self.counts) != len(self.sizes) or tuple(self.scales.shape) != (len(self.sizes),):
            raise ValueError(
                f"{len(self.sizes)} pieces need {len(self.sizes)} counts and scales, got {len(self.counts)} and {tuple(self.scales.shape)}"
            )
        for piece, (size, count) in enumerate(zip(self.sizes, self.counts, strict=True)):
            if not 0 <= count <= size:
                raise ValueError(f"piece {piece} of {size} entries cannot keep {count}")
        expected = math.ceil(
            sum(ternary_bits(size, count) - BITS_PER_ENTRY for size, count in zip(self.sizes, self.counts, strict=True))
            / 8
        )
        if self.code.dtype != torch.uint8 or tuple(self.code.shape) != (expected,):
            raise ValueError(
                f"code must be {expected} uint8 bytes for these counts, got {self.code.dtype} of shape {tuple(self.code.shape)}"
            )
        if not bool(torch.isfinite(self.scales).all()) or bool((self.scales < 0).any()):
            raise ValueError("scales must be finite and non-negative")


def _index_width(size: int) -> int:
    return math.ceil(math.log2(size)) if size > 1 else 0


def _piece_bits(negative: np.ndarray, positions: np.ndarray, size: int) -> np.ndarray:
    count, width = len(positions), _index_width(size)
    if count * width <= size:
        places = ((positions.astype(np.int64)[:, None] >> np.arange(width, dtype=np.int64)) & 1).reshape(-1)
    else:
        places = np.zeros(size, dtype=np.int64)
        places[positions] = 1
    return np.concatenate([negative.astype(np.uint8), places.astype(np.uint8)])
