"""What the vectorized backend asks of a gradient engine, and the step's batch an engine computes on.

``vectorized_step.train_chunk`` trains a chunk of clients through one engine: the
batched Linear/ReLU layers, ``vmap`` and loss terms (``vectorized_gradients``), the
zoo's batched layers (``stacked``) or a chunk's buffers (``vectorized_buffers``).
Every engine computes, for the ``n`` rows of a ``[n, P]`` stack ``θ`` at once,

    out[k] = ∇_θ Σ_i w_ki ℓ(θ_k; x_ki, y_ki)        (plus client k's loss term, for a loss-term engine)

from one step's ``StepBatch``: inputs ``[n, B, ...]``, targets and weights ``[n, B]``
(``w_ki = 1/|batch_k|`` on real examples, 0 on padding), the rows' dropout keys
(``modes.step_keys``) and the mode: a local step (training mode, dropout masks from
the keys) or a measurement (γ-inexact stopping's full gradient, evaluation mode).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepBatch:
    """One step's batch for the ``n`` rows an engine computes (module docstring)."""

    inputs: torch.Tensor  # [n, B, ...]
    targets: torch.Tensor  # [n, B]
    weights: torch.Tensor  # [n, B]
    keys: torch.Tensor | None = None  # [n] int64: the rows' dropout keys
    training: bool = True  # False: a measurement, in evaluation mode

    def dropout_keys(self, theta: torch.Tensor, draws_dropout: bool) -> torch.Tensor | None:
        """The rows' dropout keys on ``theta``'s device for a local step of a model that draws dropout masks, else
        ``None`` (no masks); such a model trains only with one key per row of ``theta``."""
        if not (self.training and draws_dropout):
            return None
        if self.keys is None or self.keys.shape != theta.shape[:1]:
            raise ValueError(
                f"a model with dropout needs one dropout key per client row ({theta.shape[0]}), got "
                f"{None if self.keys is None else tuple(self.keys.shape)}"
            )
        return self.keys.to(theta.device)

    def part(self, rows: torch.Tensor, size: int) -> "StepBatch":
        """The batch of ``rows`` alone, cut to their first ``size`` examples."""
        keys = None if self.keys is None else self.keys[rows]
        return StepBatch(
            self.inputs[rows, :size], self.targets[rows, :size], self.weights[rows, :size], keys, self.training
        )


class GradientEngine(ABC):
    """A chunk's gradient engine, as ``vectorized_step.train_chunk`` calls it (module docstring).

    Beyond this interface an engine may offer ``sgd_step_`` (the step fused into the weight-gradient GEMM,
    ``LinearReluStack``), ``client(k)`` (the engine for the chunk's client ``k`` alone, when it keeps per-client rows)
    and ``freeze(k)`` (client ``k`` stopped early: its per-client state is that of now).
    """

    draws_dropout = False  # whether local steps draw dropout masks (from the rows' keys)

    def flat_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """The data's inputs in the layout this engine's batches are gathered from."""
        return inputs

    def loss_gradient(
        self,
        theta: torch.Tensor,
        x: torch.Tensor,
        targets: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
        keys: torch.Tensor | None = None,
        training: bool = True,
    ) -> torch.Tensor:
        """``out[k] = ∇_θ Σ_i w_ki ℓ(θ_k; x_ki, y_ki)`` for the ``n`` rows of ``theta`` (``[n, P]``), written into the
        rows of ``out`` and returned; ``keys``, ``training``: the ``StepBatch``'s."""
        self.write_gradient(theta, StepBatch(x, targets, weights, keys, training), out)
        return out

    @abstractmethod
    def write_gradient(self, theta: torch.Tensor, batch: StepBatch, out: torch.Tensor) -> None:
        """``loss_gradient`` of this engine: the rows of ``out`` for the rows of ``theta`` on ``batch``."""


__all__ = ["GradientEngine", "StepBatch"]
