import math

import numpy as np
import pytest

from driftlab.simulation.round.availability import ALWAYS_AVAILABLE, AvailabilityModel, steps_to_do


def test_always_available_does_the_planned_steps():
    assert [steps_to_do(ALWAYS_AVAILABLE, 0, t, c, 37, 5) for t in range(1, 4) for c in range(3)] == [37] * 9


def test_outcome_fractions_match_the_configured_distribution():
    model = AvailabilityModel(inactive_probability=0.2, incomplete_probability=0.3)
    draws = np.array([steps_to_do(model, 7, t, c, 20, 4) for t in range(1, 201) for c in range(50)])
    n = len(draws)
    inactive = (draws == 0).mean()
    incomplete = ((draws > 0) & (draws < 20)).mean()
    # four binomial standard deviations with a fixed seed: fails only if the model is wrong
    assert abs(inactive - 0.2) < 4 * math.sqrt(0.2 * 0.8 / n)
    assert abs(incomplete - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)


def test_incomplete_work_is_whole_epochs_short_of_e():
    model = AvailabilityModel(incomplete_probability=1.0)
    # 5 epochs of 4 steps: a straggler does 1..4 whole epochs (FedProx's U{1..E-1})
    draws = {steps_to_do(model, 3, t, 0, 20, 4) for t in range(1, 400)}
    assert draws == {4, 8, 12, 16}


def test_incomplete_single_epoch_work_is_cut_in_steps():
    model = AvailabilityModel(incomplete_probability=1.0)
    draws = {steps_to_do(model, 3, t, 0, 6, 6) for t in range(1, 400)}
    assert draws == {1, 2, 3, 4, 5}
    assert steps_to_do(model, 3, 1, 0, 1, 1) == 1  # a single step cannot be cut short


def test_draws_depend_only_on_seed_round_and_client():
    model = AvailabilityModel(0.3, 0.3)
    first = [steps_to_do(model, 11, t, c, 10, 2) for t in range(1, 30) for c in range(10)]
    again = [steps_to_do(model, 11, t, c, 10, 2) for t in range(1, 30) for c in range(10)]
    other_seed = [steps_to_do(model, 12, t, c, 10, 2) for t in range(1, 30) for c in range(10)]
    assert first == again
    assert first != other_seed


@pytest.mark.parametrize("inactive, incomplete", [(-0.1, 0.0), (0.0, 1.5), (0.6, 0.6)])
def test_bad_probabilities_are_rejected(inactive, incomplete):
    with pytest.raises(ValueError, match="probability"):
        AvailabilityModel(inactive, incomplete)


# ------------------------------------------------------------------ registered set: joins and leaves

from driftlab.simulation.round.availability import Membership, MembershipEvent  # noqa: E402


def test_membership_follows_the_events():
    membership = Membership(
        10, 4, (MembershipEvent(3, join=(4, 5)), MembershipEvent(5, leave=(0, 4)), MembershipEvent(7, join=(0,)))
    )
    assert [membership.registered_at(t).tolist() for t in (1, 2, 3, 5, 7)] == [
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [0, 1, 2, 3, 4, 5],
        [1, 2, 3, 5],
        [0, 1, 2, 3, 5],
    ]
    joined, left = membership.changes_at(5)
    assert joined.tolist() == [] and left.tolist() == [0, 4]
    joined, left = membership.changes_at(7)
    assert joined.tolist() == [0] and left.tolist() == []
    assert [c.tolist() for c in membership.changes_at(1)] == [[], []]


def test_static_membership_is_every_client():
    membership = Membership(6)
    assert membership.is_static
    assert membership.registered_at(100).tolist() == list(range(6))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initially_registered": 0}, "initially_registered"),
        ({"initially_registered": 11}, "initially_registered"),
        ({"events": (MembershipEvent(2, join=(10,)),)}, "client 10 does not exist"),
        ({"events": (MembershipEvent(0, join=(1,)),)}, "round must be >= 1"),
        ({"initially_registered": 2, "events": (MembershipEvent(3, leave=(0, 1)),)}, "no registered client"),
    ],
)
def test_bad_membership_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Membership(10, **kwargs)


@pytest.mark.parametrize(
    "events, message",
    [
        (
            (MembershipEvent(3, join=(4, 5), leave=(5,)),),
            "round 3: client 5 both join and leave; a client changes its registration at most once per round",
        ),
        # the same in two events of one round: which came first would decide, so it is refused too
        (
            (MembershipEvent(4, leave=(1, 2)), MembershipEvent(4, join=(2, 1, 7))),
            "round 4: clients 1, 2 both join and leave",
        ),
    ],
)
def test_a_client_joining_and_leaving_in_one_round_is_refused(events, message):
    with pytest.raises(ValueError) as error:
        Membership(10, 4, events)
    assert str(error.value).startswith(message)
    assert "remove it from the join or the leave list of that round (or move one change to another round)" in str(
        error.value
    )


def test_joining_and_leaving_in_different_rounds_is_kept():
    membership = Membership(10, 4, (MembershipEvent(3, join=(5,)), MembershipEvent(4, leave=(5,))))
    assert [membership.registered_at(t).tolist() for t in (3, 4)] == [[0, 1, 2, 3, 5], [0, 1, 2, 3]]


def test_ranges_are_checked_before_they_are_listed():
    from driftlab.simulation.round.availability import ClientIds

    ids = ClientIds((2,), range(5, 8))
    assert list(ids) == [2, 5, 6, 7] and len(ids) == 4 and ids.bounds() == (2, 7) and ids == (2, 5, 6, 7)
    membership = Membership(10, 2, (MembershipEvent(2, join=ClientIds((), range(5, 8))),))
    assert membership.registered_at(2).tolist() == [0, 1, 5, 6, 7]
    # 10**12 ids: refused from the bounds at once (listing them would need terabytes)
    with pytest.raises(
        ValueError, match=r"round 2: client 999999999999 does not exist; the data set has clients 0\.\.9"
    ):
        Membership(10, 2, (MembershipEvent(2, join=ClientIds((), range(0, 10**12))),))
