"""Schedules: rates and step counts as functions of the round ``t`` (rounds count from 1).

Decaying-K paper, docs/update-rules.md "Schedules":

* exponential:  ``x_t = x_0 · d^(t−1)``  (client lr ``γ_t``, server lr ``η_t``,
  FedDyn/AdaBest ``lr_decay``, decaying local steps ``K_t``);
* inverse time: ``x_t = a / (b + t)``  (the 1/t forms of its Theorem 2);
* step counts are ``K_t = max(1, ⌈x_t⌉)`` of either (``steps_at``).

In a config, any rate or count is a plain number (constant) or a table::

    lr = {kind = "exponential", initial = 0.1, decay = 0.998}
    steps = {kind = "inverse_time", a = 200, b = 1}

Schedules are pydantic models so configs validate them; each is also a plain
callable ``schedule(t) -> float``.  ``schedule_from_table`` is the one parser of
a schedule table: configs (rates and counts) and AdaBest's β both read theirs
through it, then check the range their own quantity allows.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Union

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ExponentialSchedule(BaseModel):
    """``initial · decay^(t−1)``."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf/NaN would make every round's value inf/NaN
    kind: Literal["exponential"] = "exponential"
    initial: float = Field(gt=0, description="value in round 1")
    decay: float = Field(gt=0, le=1, description="factor per round, in (0, 1]")

    def __call__(self, round_index: int) -> float:
        return self.initial * self.decay ** (round_index - 1)


class InverseTimeSchedule(BaseModel):
    """``a / (b + t)``."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf/NaN would make every round's value inf/NaN
    kind: Literal["inverse_time"] = "inverse_time"
    a: float = Field(gt=0, description="numerator")
    b: float = Field(ge=0, description="offset added to the round")

    def __call__(self, round_index: int) -> float:
        return self.a / (self.b + round_index)


Schedule = Annotated[Union[ExponentialSchedule, InverseTimeSchedule], Field(discriminator="kind")]

SCHEDULE_KINDS: dict[str, type[ExponentialSchedule] | type[InverseTimeSchedule]] = {
    "exponential": ExponentialSchedule,
    "inverse_time": InverseTimeSchedule,
}


def schedule_from_table(table: dict[str, Any]) -> ExponentialSchedule | InverseTimeSchedule:
    """The schedule a table such as ``{kind = "exponential", initial = 0.1, decay = 0.99}`` describes.

    Raises ValueError naming what is wrong: an unknown ``kind``, a true/false
    parameter (pydantic would take it as 1 or 0), or the invalid parameters.
    """
    kind = table.get("kind")
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"a schedule needs kind = one of {sorted(SCHEDULE_KINDS)}, got {_short(kind)}")
    if any(isinstance(value, bool) for value in table.values()):
        raise ValueError(f"schedule parameters are numbers, not true/false: {_short(table)}")
    try:
        return SCHEDULE_KINDS[kind](**table)
    except ValidationError as error:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ValueError(f"invalid {kind} schedule: {details}") from None


def is_constant_one(rate: float | ExponentialSchedule | InverseTimeSchedule) -> bool:
    """Whether ``rate`` is 1 in every round (the number 1, or an exponential schedule 1·1^(t−1))."""
    if isinstance(rate, ExponentialSchedule):
        return rate.initial == 1.0 and rate.decay == 1.0
    return not isinstance(rate, InverseTimeSchedule) and rate == 1.0


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, so a huge value cannot flood a message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} characters)"


def value_at(rate: float | ExponentialSchedule | InverseTimeSchedule, round_index: int) -> float:
    """A constant or a schedule, evaluated at round ``round_index``."""
    if isinstance(rate, (int, float)):
        return float(rate)
    return rate(round_index)


def steps_at(count: int | ExponentialSchedule | InverseTimeSchedule, round_index: int) -> int:
    """``K_t = max(1, ⌈x_t⌉)``; a constant count is returned as it is."""
    if isinstance(count, int):
        return count
    value = value_at(count, round_index)
    # K_0·d^(t−1) is computed in floating point: an exact integer can come out one ulp above it
    # (25·0.8² = 16.000000000000004), and ceil would then add a whole step.
    nearest = round(value)
    if abs(value - nearest) <= 1e-9 * max(1.0, abs(value)):
        value = float(nearest)
    return max(1, math.ceil(value))
