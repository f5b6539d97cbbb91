"""Training augmentation the engine applies to local minibatches: CIFAR's flip and pad-crop, drawn from per-example keys.

The draws of every example come from its own 64-bit key
(``randomness.example_keys(augment_key, step, slot)``), so an example's
augmentation depends neither on the training backend nor on which clients share
a chunk.  ``driftlab.data.images.random_flip_crop`` is the same augmentation
with the draws taken from a ``torch.Generator``.
"""

from __future__ import annotations

import torch


def check_images(images: torch.Tensor, padding: int) -> None:
    """``ValueError`` unless ``images`` is ``[n, c, h, w]`` and ``padding`` >= 0."""
    if images.dim() != 4:
        raise ValueError(f"images must be [n, c, h, w], got shape {tuple(images.shape)}")
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")


def flip_crop_from_keys(
    images: torch.Tensor, keys: torch.Tensor, padding: int = 4, crop_probability: float = 0.5
) -> torch.Tensor:
    """``driftlab.data.images.random_flip_crop`` with every image's draws read from the bits of its 64-bit key.

    Image ``i`` depends only on ``images[i]`` and ``keys[i]``, never on which
    other images share the call, so a training backend may augment any set of
    examples at once (see ``driftlab.randomness.example_keys``,
    which makes well-mixed keys).  Bits of ``keys[i]`` (bit 0 is the least
    significant):

    * bit 0: flip horizontally when set (probability 1/2);
    * bits 8–31, as an integer ``u < 2**24``: pad and crop when
      ``u < round(crop_probability · 2**24)`` (exact for 0, 1/2 and 1);
    * bits 32–47 and 48–63, as ``v < 2**16``: the row and column offsets
      ``⌊v·(2·padding+1) / 2**16⌋`` in ``0..2·padding`` (uniform up to
      ``1/2**16``); without a crop both offsets are ``padding`` (the identity).

    Args:
        images: ``[n, c, h, w]`` tensor.
        keys: ``[n]`` int64 tensor.
        padding: pixels of zero padding on each side before cropping.
        crop_probability: probability of the pad-and-crop step.

    Returns:
        A new ``[n, c, h, w]`` tensor; ``images`` is not modified.
    """
    check_images(images, padding)
    if keys.dtype != torch.int64 or keys.shape != images.shape[:1]:
        raise ValueError(
            f"keys must be an int64 tensor of shape [{images.shape[0]}], got {keys.dtype} {tuple(keys.shape)}"
        )
    if not 0.0 <= crop_probability <= 1.0:
        raise ValueError(f"crop_probability must be in [0, 1], got {crop_probability}")
    keys = keys.to(images.device)
    flip = (keys & 1) == 1
    crop = ((keys >> 8) & 0xFFFFFF) < round(crop_probability * 2**24)
    # Arithmetic shifts copy the sign bit in from the left; the masks keep only the wanted bits.
    rows = (((keys >> 32) & 0xFFFF) * (2 * padding + 1)) >> 16
    cols = (((keys >> 48) & 0xFFFF) * (2 * padding + 1)) >> 16
    offsets = torch.where(
        crop[:, None],
        torch.stack([rows, cols], dim=1),
        torch.full((len(keys), 2), padding, dtype=torch.int64, device=keys.device),
    )
    return flip_then_shift(images, flip, offsets, padding)


def flip_then_shift(images: torch.Tensor, flip: torch.Tensor, offsets: torch.Tensor, padding: int) -> torch.Tensor:
    """Flip the images where ``flip``, zero-pad by ``padding`` and take the original-size window at ``offsets`` ([n, 2])."""
    n, c, h, w = images.shape
    device = images.device
    flipped = torch.where(flip.view(n, 1, 1, 1), images.flip(-1), images)
    if padding == 0:
        return flipped
    padded = torch.nn.functional.pad(flipped, (padding, padding, padding, padding))
    rows = offsets[:, 0, None] + torch.arange(h, device=device)  # [n, h]
    cols = offsets[:, 1, None] + torch.arange(w, device=device)  # [n, w]
    batch = torch.arange(n, device=device).view(n, 1, 1, 1)
    channel = torch.arange(c, device=device).view(1, c, 1, 1)
    return padded[batch, channel, rows.view(n, 1, h, 1), cols.view(n, 1, 1, w)]
