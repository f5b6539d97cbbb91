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
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError


class _RoundSchedule(BaseModel):
    """A value per round ``t``, ``schedule(t)``; validated as a config table is."""

    # inf/NaN would make every round's value inf/NaN
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ExponentialSchedule(_RoundSchedule):
    """``initial · decay^(t−1)``."""

    kind: Literal["exponential"] = "exponential"
    initial: float = Field(gt=0, description="value in round 1")
    decay: float = Field(gt=0, le=1, description="factor per round, in (0, 1]")

    def __call__(self, round_index: int) -> float:
        return self.initial * self.decay ** (round_index - 1)


class InverseTimeSchedule(_RoundSchedule):
    """``a / (b + t)``."""

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


# Learning rates above 1e6 are typos (1e6 for 1e-6, 1e308): the largest rate any method here uses is
# O(10) (server lr of FedAvgM/FedAdam sweeps), and a step of 1e6 times an O(1) gradient already leaves
# any sensible parameter range, while rates up to 1e6 stay representable after any float32 arithmetic.
MAX_RATE = 1e6


def number_or_schedule(value: Any, integer: bool) -> Any:
    """A config's rate (``integer=False``) or step count (``integer=True``): a positive number, or a schedule
    (a table, or a schedule already built); a ValueError saying what is allowed otherwise.

    Here, not in the config package (``driftlab.experiments.config``), so the config types of other packages (the server optimizers'
    ``lr``) validate their rates by the same rule without importing the config module.
    """
    kind = "a positive integer" if integer else "a positive number"
    if isinstance(value, bool):
        raise ValueError(f"expected {kind} or a schedule table, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"expected {kind}, got {value!r}")
        if integer and (not float(value).is_integer()):
            raise ValueError(f"expected {kind}, got {value!r}")
        if value <= 0:
            raise ValueError(f"must be > 0, got {value!r}")
        if not integer and value > MAX_RATE:
            raise ValueError(
                f"must be at most {MAX_RATE:g} (a larger rate is a typo such as 1e6 for 1e-6), got {value!r}"
            )
        return int(value) if integer else float(value)
    if isinstance(value, (ExponentialSchedule, InverseTimeSchedule)):
        return _bounded_schedule(value, integer)
    if isinstance(value, dict):
        return _bounded_schedule(schedule_from_table(value), integer)
    raise ValueError(
        f"expected {kind} or a schedule table such as "
        '{kind="exponential", initial=0.1, decay=0.99} or {kind="inverse_time", a=1.0, b=10}'
        f", got {_short(value)}"
    )


def _bounded_schedule(
    schedule: ExponentialSchedule | InverseTimeSchedule, integer: bool
) -> ExponentialSchedule | InverseTimeSchedule:
    # both kinds decrease with the round, so round 1 holds the largest value
    if not integer and schedule(1) > MAX_RATE:
        raise ValueError(
            f"the schedule's round-1 rate {schedule(1):g} is above {MAX_RATE:g} (a typo such as 1e6 for 1e-6?)"
        )
    return schedule


Rate = Annotated[Any, BeforeValidator(lambda value: number_or_schedule(value, integer=False))]
Count = Annotated[Any, BeforeValidator(lambda value: number_or_schedule(value, integer=True))]


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
