"""Images kept as their uint8 pixels and normalised one gathered batch at a time.

A float32 copy of an image data set takes four times the memory of its
pixels.  A data set may instead hold the uint8 pixels and a
``PixelNormalisation``; training and evaluation then normalise each batch
right after gathering it (``TrainingData.model_inputs``), with exactly the
operations the loaders used to apply to the whole set (torchvision's
``ToTensor`` then ``Normalize``), so every value is bit-identical.

Example:
    >>> import torch
    >>> norm = PixelNormalisation((0.5,), (0.25,))
    >>> norm(torch.tensor([[0, 255]], dtype=torch.uint8)).tolist()
    [[-2.0, 2.0]]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PixelNormalisation"]


@dataclass(frozen=True)
class PixelNormalisation:
    """``x = (pixel / 255 − mean[c]) / std[c]`` in float32, per channel, then cast to ``dtype``.

    Attributes:
        mean, std: one value per channel (the channel axis is the third from
            last, ``[..., c, h, w]``), or one value for every pixel of
            single-channel or flat images.
        dtype: the run's arithmetic dtype; the values are computed in float32
            (as the loaders computed them) and only then cast.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        mean, std = _floats(self.mean, "mean"), _floats(self.std, "std")
        if len(mean) != len(std):
            raise ValueError(
                f"the normalisation has {len(mean)} means but {len(std)} deviations; give one of each per channel"
            )
        if any(not s > 0 for s in std):
            raise ValueError(f"the normalisation's deviations must be positive, got {std}")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    @property
    def channels(self) -> int:
        return len(self.mean)

    def __call__(self, pixels: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``pixels`` (uint8) normalised; ``out``: an optional float32 buffer of the same shape to write into."""
        if pixels.dtype != torch.uint8:
            raise ValueError(f"a PixelNormalisation takes uint8 pixels, got {pixels.dtype}")
        x = pixels.to(torch.float32) if out is None else out.copy_(pixels)
        mean, std = _constants(self.mean, self.std, x.device)
        x = x.div_(255.0).sub_(mean).div_(std)
        return x if self.dtype == torch.float32 else x.to(self.dtype)


def _floats(values: Sequence[float] | float, name: str) -> tuple[float, ...]:
    values = (values,) if isinstance(values, (int, float)) else tuple(values)
    if not values:
        raise ValueError(f"the normalisation's {name} is empty; give one value per channel")
    return tuple(float(v) for v in values)


@functools.lru_cache(maxsize=64)
def _constants(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``mean`` and ``std`` shaped to broadcast over ``[..., c, h, w]``, made once per device (no copy per batch).

    A one-element tensor divides exactly as the Python scalar the loaders used (both round the value to float32)."""
    shape = (-1, 1, 1) if len(mean) > 1 else (1,)
    return (
        torch.tensor(mean, dtype=torch.float32, device=device).view(shape),
        torch.tensor(std, dtype=torch.float32, device=device).view(shape),
    )
