"""Data poisoning by label flipping: a Byzantine client trains honestly on its data with every label y replaced by
C − 1 − y (C classes), as in Fang et al. (USENIX Security 2020) and the Blades benchmark.  Nothing in its message
is forged: every part (SCAFFOLD's Δc_k, EFL's Fisher terms) is the honest function of the poisoned data."""

from __future__ import annotations

import torch


def flip_labels(targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """y → C − 1 − y on integer class targets in [0, C)."""
    if targets.is_floating_point() or targets.is_complex():
        raise ValueError("label flipping needs integer class targets; a regression target has no classes to flip")
    if num_classes < 2:
        raise ValueError(f"label flipping needs at least 2 classes, got {num_classes}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= num_classes):
        raise ValueError(
            f"label flipping: targets must lie in [0, {num_classes}), got [{int(targets.min())}, {int(targets.max())}]"
        )
    return (num_classes - 1) - targets
