"""Training and evaluation modes of a user's module, and dropout masks drawn from per-step keys.

Modes: every forward pass runs in the mode its purpose asks for, set on the
module for the length of the call and then restored (``module_mode``):

* training mode for local SGD's steps (``local_training.BoundModule`` and the
  vectorized backend's per-thread copies, a loss term's ``batch.forward``
  included);
* evaluation mode for everything else: ``FlatModel.forward``/``batch_loss``
  (test, train-loss and validation passes, client and personal models,
  fine-tuning's evaluation, FedProx's dissimilarity and gradient variance),
  an algorithm's ``ClientComputation`` measurements (``loss_gradient``,
  ``full_gradient``, ``diagonal_fisher``) and γ-inexact stopping's full
  local gradient.  Measurements are of the deterministic model: no dropout
  mask, BatchNorm with its running statistics.

Dropout: a local step draws its masks from a 64-bit key of (seed, round,
client, purpose, step), ``step_keys``; the ``j``-th dropout call of the step's
forward (and backward) pass keeps element ``i`` (its row-major position in the
call's input) when

    u = ((example_keys(key, j, i) >>> 11) · 2⁻⁵³) ≥ p,     output_i = input_i / (1 − p)  (else 0)

(``randomness.example_keys``; ``u`` is uniform on [0, 1) to 2⁻⁵³).  The mask
depends on those numbers alone, never on a generator's state, the thread or
which clients share a ``vmap``: the sequential and vectorized backends draw the
same masks, and reruns are bit-identical.  A client's batch is the first
dimension, so a padded batch (the vectorized backend's short last batch) gives
its real rows the masks the unpadded one gets.  ``F.dropout`` and
``F.dropout1d/2d/3d`` (``nn.Dropout*``) are keyed, inside any module that has
an ``nn.Dropout*`` layer; other random operations (``nn.AlphaDropout``,
attention's ``dropout_p``, LSTM's inter-layer dropout, ``torch.rand`` in a
forward) draw from torch's global generator: not reproducible across threads,
and the vectorized backend cannot ``vmap`` them and trains such a model with
the sequential backend (logged).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from driftlab.randomness import example_keys, mix64

# A step's dropout key is its augmentation base key mixed with a slot no example has (slots are >= 0) and a salt,
# so the masks are unrelated to the augmentation draws of the same step.
_DROPOUT_SLOT = -1
_DROPOUT_SALT = 0x5DEECE66D2B7E151
_UNIT = 2.0**-53
_FEATURE_DROPOUTS = {F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3}  # channel dropout: spatial dims after [N, C]


def has_dropout(module: nn.Module) -> bool:
    """Whether ``module`` has a layer whose masks ``keyed_dropout`` draws (``nn.Dropout``, ``Dropout1d/2d/3d``)."""
    return any(type(sub) in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d) for sub in module.modules())


def trained_buffers(module: nn.Module) -> list[str]:
    """Names of the normalisation layers whose running statistics a training-mode forward updates (BatchNorm,
    InstanceNorm with ``track_running_stats``)."""
    return [
        name or type(sub).__name__
        for name, sub in module.named_modules()
        if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats
    ]


@contextmanager
def module_mode(module: nn.Module, training: bool) -> Iterator[None]:
    """``module`` (every submodule) in training or evaluation mode for the block, each submodule's previous mode
    restored after.  Nothing is done when every submodule is in that mode already."""
    previous = [(sub, sub.training) for sub in module.modules() if sub.training != training]
    if previous:
        module.train(training)
    try:
        yield
    finally:
        for sub, flag in previous:
            sub.training = flag


def set_mode(module: nn.Module, training: bool, source: nn.Module | None = None) -> None:
    """A private copy's mode (the backends' copies of the module are used by one thread; nothing to restore).

    Switched to evaluation mode with a ``source``, the copy takes ``source``'s buffers: its own running statistics
    moved with whichever clients its thread trained, and a measurement must not depend on that.  A copy training a
    client from the round's buffers (``buffers.py``) passes no source: its statistics are that client's."""
    if any(sub.training != training for sub in module.modules()):
        module.train(training)
    if not training and source is not None:
        with torch.no_grad():
            for mine, theirs in zip(module.buffers(), source.buffers(), strict=True):  # a deep copy: the same layout
                mine.copy_(theirs)


def step_keys(base: int | torch.Tensor, step: int) -> torch.Tensor:
    """The dropout key (int64) of local step ``step`` of the client(s) with augmentation base key(s) ``base``
    (``randomness.augmentation_key``): a 0-d tensor for an int, ``[C]`` for ``[C]`` base keys."""
    base = torch.as_tensor(base, dtype=torch.int64)
    slot = torch.full((), _DROPOUT_SLOT, dtype=torch.int64, device=base.device)
    salt = _DROPOUT_SALT - (1 << 64) if _DROPOUT_SALT >= 1 << 63 else _DROPOUT_SALT
    return mix64(example_keys(base, step, slot) ^ salt)


def _kept(key: torch.Tensor, call: int, shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """Which elements of a ``shape`` input the ``call``-th dropout of the step keeps (module docstring)."""
    positions = torch.arange(shape.numel(), dtype=torch.int64, device=device).view(shape)
    bits = example_keys(key.to(device), call, positions)
    uniform = ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64) * _UNIT
    return uniform >= p


class _KeyedDropout(TorchFunctionMode):
    """Replaces dropout calls by masks drawn from ``key`` (module docstring); thread-local, like every function mode."""

    def __init__(self, key: torch.Tensor) -> None:
        super().__init__()
        self.key = key
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.dropout and func not in _FEATURE_DROPOUTS:
            return func(*args, **kwargs)
        names = ("input", "p", "training", "inplace")
        values = {**dict(zip(names, args, strict=False)), **kwargs}
        x, p, training = values["input"], float(values.get("p", 0.5)), values.get("training", True)
        if not training or p == 0.0:
            return x
        if p == 1.0:
            return torch.zeros_like(x)
        shape = x.shape
        if func in _FEATURE_DROPOUTS and x.dim() > _FEATURE_DROPOUTS[func]:
            # One draw per (example, channel): the mask is [N, C, 1, ...] (an unbatched input is [C, ...]).
            spatial = _FEATURE_DROPOUTS[func]
            shape = torch.Size((*x.shape[: x.dim() - spatial], *([1] * spatial)))
        call, self.calls = self.calls, self.calls + 1
        kept = _kept(self.key, call, shape, p, x.device)
        return torch.where(kept, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))


@contextmanager
def keyed_dropout(key: torch.Tensor | None) -> Iterator[None]:
    """Dropout in the block draws its masks from ``key`` (an int64 0-d tensor, batched under ``vmap``);
    None: as torch draws them."""
    if key is None:
        yield
        return
    with _KeyedDropout(key):
        yield


__all__ = ["has_dropout", "keyed_dropout", "module_mode", "set_mode", "step_keys", "trained_buffers"]
