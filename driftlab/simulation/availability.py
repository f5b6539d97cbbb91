"""Client availability: does a selected client report full work, partial work, or nothing?

algorithms.md, "Client availability (shared by all algorithms)": per round each
selected client independently

* is inactive with probability ``p_inactive`` (``s_k = 0``: it trains nothing
  and sends nothing),
* else is incomplete with probability ``p_incomplete``: it completes only part of
  its work, ``s_k`` drawn uniformly from the whole epochs short of ``E`` (FedProx's
  stragglers do ``U{1..E−1}`` epochs of ``E``; EFL's incomplete clients do
  ``s_k < E``), or from ``{1..K−1}`` steps when the work is one epoch or a fixed
  step count ``K``,
* else completes its planned work.

The draws come from (seed, round, client id) alone, so every algorithm run with
the same seed meets the same stragglers and dropouts.  What an algorithm does
with partial work and dropouts is the algorithm's business (its docstring says).
"""

from __future__ import annotations

from dataclasses import dataclass

from driftlab.simulation.randomness import Stream, generator


@dataclass(frozen=True)
class AvailabilityModel:
    inactive_probability: float = 0.0
    incomplete_probability: float = 0.0

    def __post_init__(self) -> None:
        for name in ("inactive_probability", "incomplete_probability"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.inactive_probability + self.incomplete_probability > 1.0:
            raise ValueError("inactive_probability + incomplete_probability must be at most 1")

    @property
    def always_complete(self) -> bool:
        return self.inactive_probability == 0.0 and self.incomplete_probability == 0.0


ALWAYS_AVAILABLE = AvailabilityModel()


def steps_to_do(model: AvailabilityModel, seed: int, round_index: int, client_id: int, planned_steps: int, steps_per_epoch: int) -> int:
    """The steps client ``client_id`` does in round ``round_index``: 0 (inactive), fewer than planned, or all."""
    if model.always_complete:
        return planned_steps
    rng = generator(seed, Stream.AVAILABILITY, round_index, client_id)
    outcome = rng.random()
    if outcome < model.inactive_probability:
        return 0
    if outcome >= model.inactive_probability + model.incomplete_probability:
        return planned_steps
    epochs = planned_steps // steps_per_epoch if steps_per_epoch > 0 else 0
    if epochs >= 2 and planned_steps % steps_per_epoch == 0:
        return int(rng.integers(1, epochs)) * steps_per_epoch
    if planned_steps >= 2:
        return int(rng.integers(1, planned_steps))
    return planned_steps  # one step cannot be cut short
