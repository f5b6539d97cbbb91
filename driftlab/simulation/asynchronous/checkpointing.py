"""An asynchronous run's in-flight state as checkpoint tensors, and back (engine tensors "async/...")."""

from __future__ import annotations

from typing import Any

import torch


def in_flight_tensors(in_flight: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's ``engine/async/...`` tensors of ``in_flight`` (written by the asynchronous engine's owner)."""
    raise NotImplementedError("asynchronous checkpoints are being written (issue 28)")


def restore_in_flight(sim: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The in-flight state a checkpoint's engine tensors hold (None: the run had not started its first update)."""
    raise NotImplementedError("asynchronous checkpoints are being written (issue 28)")
