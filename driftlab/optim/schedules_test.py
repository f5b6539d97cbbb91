"""Schedules of the round t (algorithms.md "Schedules"), checked by hand."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from pydantic import ValidationError

from driftlab.optim.schedules import (
    ExponentialSchedule,
    InverseTimeSchedule,
    is_constant_one,
    schedule_from_table,
    steps_at,
    value_at,
)


def test_exponential_by_hand():
    schedule = ExponentialSchedule(initial=0.1, decay=0.5)
    assert [schedule(t) for t in (1, 2, 3, 4)] == pytest.approx([0.1, 0.05, 0.025, 0.0125])
    assert value_at(schedule, 1) == 0.1  # rounds count from 1: t = 1 is the initial value


def test_inverse_time_by_hand():
    schedule = InverseTimeSchedule(a=6.0, b=2.0)
    assert [schedule(t) for t in (1, 2, 4, 10)] == pytest.approx([2.0, 1.5, 1.0, 0.5])
    assert value_at(InverseTimeSchedule(a=1.0, b=0.0), 4) == 0.25


def test_constants_are_constant():
    assert value_at(0.05, 1) == value_at(0.05, 1000) == 0.05
    assert isinstance(value_at(2, 3), float)
    assert steps_at(7, 1) == steps_at(7, 500) == 7


def test_steps_at_is_ceiling_with_at_least_one():
    k = ExponentialSchedule(initial=10.0, decay=0.5)
    # 10, 5, 2.5 -> 3, 1.25 -> 2, 0.625 -> 1, then max(1, ...) keeps 1
    assert [steps_at(k, t) for t in range(1, 8)] == [10, 5, 3, 2, 1, 1, 1]
    inverse = InverseTimeSchedule(a=20.0, b=1.0)
    # ⌈20/(1+t)⌉: 10, 6.67 -> 7, 5, 4, 3.33 -> 4; far out max(1, ⌈0.02⌉) = 1
    assert [steps_at(inverse, t) for t in range(1, 6)] == [10, 7, 5, 4, 4]
    assert steps_at(inverse, 1000) == 1


def test_steps_at_is_not_thrown_off_by_floating_point_rounding():
    """K_0·d^(t−1) that is an integer in exact arithmetic must not gain a step from rounding (25·0.8² = 16)."""
    assert 25 * 0.8**2 > 16  # floating point lands just above the integer
    assert steps_at(ExponentialSchedule(initial=25, decay=0.8), 3) == 16
    for k0 in range(1, 60):
        for decay in ("0.5", "0.55", "0.6", "0.75", "0.8", "0.9", "0.95", "0.99"):
            schedule = ExponentialSchedule(initial=k0, decay=float(decay))
            for t in range(1, 25):
                exact = Fraction(k0) * Fraction(decay) ** (t - 1)
                assert steps_at(schedule, t) == max(1, math.ceil(exact)), (k0, decay, t)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ExponentialSchedule(initial=0.1, decay=1.5),  # decay above 1
        lambda: ExponentialSchedule(initial=0.1, decay=0.0),
        lambda: ExponentialSchedule(initial=-0.1, decay=0.9),
        lambda: InverseTimeSchedule(a=0.0, b=1.0),
        lambda: InverseTimeSchedule(a=1.0, b=-1.0),
        lambda: ExponentialSchedule(initial=0.1, decay=0.9, extra=1),
    ],
)
def test_invalid_schedules_are_rejected(make):
    with pytest.raises(ValidationError):
        make()


@pytest.mark.parametrize(
    "table, expected",
    [
        (
            {"kind": "exponential", "initial": 0.1, "decay": 0.998},
            ExponentialSchedule(initial=0.1, decay=0.998),
        ),  # docs: client/server lr
        ({"kind": "inverse_time", "a": 200, "b": 1}, InverseTimeSchedule(a=200.0, b=1.0)),  # docs: client.steps
        (
            {"kind": "exponential", "initial": 0.98, "decay": 0.999},
            ExponentialSchedule(initial=0.98, decay=0.999),
        ),  # AdaBest β
        (
            {"initial": 0.1, "decay": 0.5, "kind": "exponential"},
            ExponentialSchedule(initial=0.1, decay=0.5),
        ),  # key order is free
    ],
)
def test_schedule_from_table_reads_every_documented_form(table, expected):
    assert schedule_from_table(table) == expected


@pytest.mark.parametrize(
    "table, message",
    [
        ({"initial": 0.1, "decay": 0.9}, "a schedule needs kind = one of ['exponential', 'inverse_time'], got None"),
        (
            {"kind": "cosine", "initial": 0.1},
            "a schedule needs kind = one of ['exponential', 'inverse_time'], got 'cosine'",
        ),
        ({"kind": "exponential", "initial": True, "decay": 0.9}, "schedule parameters are numbers, not true/false"),
        (
            {"kind": "exponential", "initial": 0.1, "decay": 1.5},
            "invalid exponential schedule: decay: Input should be less than or equal to 1",
        ),
        ({"kind": "inverse_time", "a": 1.0}, "invalid inverse_time schedule: b: Field required"),
        (
            {"kind": "inverse_time", "a": 1.0, "b": 1, "c": 2},
            "invalid inverse_time schedule: c: Extra inputs are not permitted",
        ),
    ],
)
def test_schedule_from_table_rejects_bad_tables_with_the_old_messages(table, message):
    with pytest.raises(ValueError) as error:
        schedule_from_table(table)
    assert message in str(error.value)


def test_is_constant_one():
    assert is_constant_one(1.0) and is_constant_one(1) and is_constant_one(ExponentialSchedule(initial=1.0, decay=1.0))
    assert not is_constant_one(0.5)
    assert not is_constant_one(ExponentialSchedule(initial=1.0, decay=0.99))
    assert not is_constant_one(InverseTimeSchedule(a=2.0, b=1.0))  # 1 in round 1 only
