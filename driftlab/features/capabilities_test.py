"""The one refusal function: needs against capabilities, exclusions against present features, one template."""

from __future__ import annotations

import pytest

from driftlab.features import drivers
from driftlab.features.capabilities import (
    ONE_PHASE,
    RELEASE_FORM,
    SHARED_VIEW,
    Lack,
    Reason,
    Requirements,
    conflicts,
    first_refusal,
    refusal,
    synchronous_only,
    with_lack,
)

GENERIC = Reason("it gives no form", "give one")
NEEDS = Requirements("[privacy]", needs=((ONE_PHASE, Reason("two phases", "use one")), (RELEASE_FORM, GENERIC)))


def test_the_template_names_both_keys_the_reason_and_the_fix():
    assert (
        refusal("[privacy]", 'algorithm.name = "moon"', GENERIC)
        == '[privacy] with algorithm.name = "moon": it gives no form: give one'
    )
    assert refusal("[x]", "y", Reason("why", "fix", "; ")) == "[x] with y: why; fix"
    assert refusal("[x]", "y", Reason("why alone")) == "[x] with y: why alone"


def test_a_provided_capability_is_no_conflict_and_a_missing_one_gives_the_generic_reason():
    assert conflicts(NEEDS, "a", {ONE_PHASE, RELEASE_FORM}) == []
    assert first_refusal(NEEDS, "a", {ONE_PHASE, RELEASE_FORM}) is None
    assert first_refusal(NEEDS, "a", {ONE_PHASE}) == "[privacy] with a: it gives no form: give one"
    assert [c.reason.why for c in conflicts(NEEDS, "a", set())] == ["two phases", "it gives no form"]  # declared order


def test_the_seconds_own_reason_replaces_the_generic_one_and_comes_first():
    own = Reason("n_k weights", 'set aggregation = "uniform"')
    found = conflicts(NEEDS, "a", set(), {RELEASE_FORM: own})
    assert [c.reason for c in found] == [own, NEEDS.needs[0][1]]


def test_exclusions_sharing_a_reason_are_one_refusal_naming_every_feature():
    shared = Reason("a deployment runs in real time, and {features} simulate{s} time", "remove {features}")
    timed = Requirements("a deployment", excludes=(("[system]", shared), ("[asynchronous]", shared)))
    (one,) = conflicts(timed, "b", {"[system]"})
    assert (
        one.message
        == "[system] with a deployment: a deployment runs in real time, and [system] simulates time: remove [system]"
    )
    (both,) = conflicts(timed, "b", {"[system]", "[asynchronous]"})
    assert both.message == (
        "[system] and [asynchronous] with a deployment: a deployment runs in real time, and [system] and "
        "[asynchronous] simulate time: remove [system] and [asynchronous]"
    )


def test_a_wrappers_lack_replaces_the_wrapped_ones_of_that_capability_only():
    inner = (Lack(RELEASE_FORM, GENERIC), Lack(SHARED_VIEW, Reason("views")))
    wrapped = with_lack(inner, SHARED_VIEW, Reason("mine", "fix").then(Reason("views")))
    assert [lack.capability for lack in wrapped] == [RELEASE_FORM, SHARED_VIEW]
    assert wrapped[1].reason.text == "mine: fix; and views"
    assert Reason("mine", "fix").then(None) == Reason("mine", "fix")  # the wrapped algorithm gives no reason
    with pytest.raises(ValueError, match="unknown capability"):
        Lack("flying", GENERIC)


def test_every_drivers_needs_are_capabilities_and_its_exclusions_feature_keys():
    from driftlab.features.capabilities import CAPABILITIES

    for requirements in (
        drivers.ASYNCHRONOUS,
        drivers.PRIVACY,
        drivers.COMPRESSION,
        drivers.SIMULATED_TIME,
        drivers.DEPLOYMENT,
    ):
        assert all(need in CAPABILITIES for need, _ in requirements.needs), requirements.key
        assert all(key not in CAPABILITIES for key, _ in requirements.excludes), requirements.key
        assert all(reason.fix for _, reason in (*requirements.needs, *requirements.excludes)), requirements.key


def test_a_synchronous_only_reason_fixes_by_running_the_algorithm_synchronously_or_the_alternative():
    assert synchronous_only("x", "stale").text == (
        'stale: run x synchronously (remove [asynchronous]), or use fedavg or fedprox with aggregation = "uniform"'
    )
    assert synchronous_only("x", "stale", alternative="use y").text == (
        "stale: run x synchronously (remove [asynchronous]), or use y"
    )
    assert synchronous_only("x", "stale", alternative="").text == "stale: run x synchronously (remove [asynchronous])"
