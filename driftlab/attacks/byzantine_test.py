"""Who is Byzantine: seeded by the run seed alone, fixed lists, the first attacking round."""

from __future__ import annotations

import pytest

from driftlab.attacks.byzantine import (
    Byzantine,
    attackers_in_round,
    byzantine_clients,
    byzantine_count,
)
from driftlab.randomness import Stream


def test_a_fraction_is_drawn_from_the_seed_alone():
    settings = Byzantine(fraction=0.2)
    chosen = byzantine_clients(settings, seed=0, num_clients=25)
    assert len(chosen) == 5 and list(chosen) == sorted(chosen) and all(0 <= c < 25 for c in chosen)
    assert byzantine_clients(settings, seed=0, num_clients=25) == chosen
    assert byzantine_clients(settings, seed=1, num_clients=25) != chosen


def test_the_count_is_the_floor_of_fraction_times_clients():
    assert byzantine_count(0.29, 100) == 29 and byzantine_count(0.2, 24) == 4
    assert byzantine_clients(Byzantine(fraction=0.0), seed=3, num_clients=10) == ()


def test_a_fixed_list_and_its_errors():
    assert byzantine_clients(Byzantine(clients=(7, 2)), seed=0, num_clients=10) == (2, 7)
    with pytest.raises(ValueError, match=r"names ids \[12\]"):
        byzantine_clients(Byzantine(clients=(12,)), seed=0, num_clients=10)
    with pytest.raises(ValueError, match="exactly one of fraction"):
        Byzantine(fraction=0.1, clients=(1,))
    with pytest.raises(ValueError, match="twice"):
        Byzantine(clients=(1, 1))


def test_attackers_report_from_the_start_round_on():
    settings = Byzantine(clients=(2, 5), start_round=3)
    assert attackers_in_round(settings, 0, 10, 2, [5, 2, 1]) == ()
    assert attackers_in_round(settings, 0, 10, 3, [5, 1, 2]) == (5, 2)
    assert attackers_in_round(settings, 0, 10, 9, [0, 1]) == ()


def test_every_stream_has_its_own_number():
    # two purposes sharing a number would draw the same numbers: the attacks' streams are Stream members of their own
    assert len({int(member) for member in Stream.__members__.values()}) == len(Stream.__members__)  # aliases included
    assert {Stream.BYZANTINE_CLIENTS, Stream.ATTACK_NOISE, Stream.BACKDOOR_POISON} <= set(Stream)
