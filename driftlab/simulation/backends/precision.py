"""The arithmetic of local training: ``precision = float32 | float64 | tf32 | bf16``.

Parameters, client state, corrections, aggregation and evaluation are kept in
``float64`` under ``precision=float64`` and in ``float32`` otherwise.  The two
reduced settings change only the loss gradients of local steps:

* ``tf32``: matrix products and convolutions on a CUDA device round their
  inputs to TensorFloat-32 (10-bit mantissa) inside the tensor cores and
  accumulate in float32; everything else is float32.  CUDA only.
* ``bf16``: the forward and backward passes of local steps run under
  ``torch.autocast(dtype=bfloat16)`` (products and convolutions in bfloat16,
  reductions, softmax and the loss in float32), with float32 parameters that
  the step updates in float32.  Runs on CPUs with bfloat16 instructions too.

What each does to accuracy is measured in docs/performance.md.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

PRECISIONS = ("float32", "float64", "tf32", "bf16")
_tf32_lock = threading.Lock()
_tf32_users = 0
_tf32_saved: tuple[bool, bool] | None = None


def parameter_dtype(precision: str) -> torch.dtype:
    """The dtype of parameters, state and aggregation for ``precision``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return torch.float64 if precision == "float64" else torch.float32


def check_precision(precision: str, device: torch.device) -> str | None:
    """Why ``precision`` cannot run on ``device``, or ``None``."""
    parameter_dtype(precision)
    if precision == "tf32" and device.type != "cuda":
        return (
            f"precision=tf32 needs a CUDA device (TensorFloat-32 is an NVIDIA tensor-core format), but device is {device.type}; "
            "use precision=float32, or precision=bf16 for reduced-precision local steps on a CPU"
        )
    return None


@contextlib.contextmanager
def local_arithmetic(precision: str, device: torch.device) -> Iterator[None]:
    """The context local steps' gradients are computed in; enter it in the thread that computes them (autocast is per thread).

    On a CUDA device ``float32`` and ``float64`` turn TF32 off for cuDNN
    convolutions too (PyTorch's default lets cuDNN use it), so that float32
    means float32 on every device; ``tf32`` turns it on for matmuls as well.
    """
    if precision == "bf16":
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    elif device.type == "cuda":
        with _tf32(precision == "tf32"):
            yield
    else:
        yield


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    """Set TF32 for CUDA matmuls and cuDNN convolutions while any caller is inside; restore the user's flags after.

    The flags are process-wide; chunks trained on several threads share one setting (a run has one precision).
    """
    global _tf32_users, _tf32_saved
    with _tf32_lock:
        if _tf32_users == 0:
            _tf32_saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            torch.backends.cuda.matmul.allow_tf32 = enabled
            torch.backends.cudnn.allow_tf32 = enabled
        _tf32_users += 1
    try:
        yield
    finally:
        with _tf32_lock:
            _tf32_users -= 1
            if _tf32_users == 0 and _tf32_saved is not None:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = _tf32_saved


__all__ = ["PRECISIONS", "check_precision", "local_arithmetic", "parameter_dtype"]
