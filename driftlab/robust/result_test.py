"""The rules' shared argument checks: a count must be a positive integer, named in the message."""

from __future__ import annotations

import pytest

from driftlab.robust.clipping import CenteredClipping
from driftlab.robust.geometric_median import GeometricMedian
from driftlab.robust.krum import MultiKrum
from driftlab.robust.result import check_positive_integer


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_a_count_that_is_no_positive_integer_is_refused_with_its_rule_and_name(value):
    with pytest.raises(ValueError, match=rf"^rule: steps k must be a positive integer, got {value!r}$"):
        check_positive_integer(value, "rule", "steps k")


def test_each_rules_counts_are_checked():
    check_positive_integer(1, "rule", "steps k")
    assert MultiKrum(1, selected=None).selected is None  # None: m = n − f
    with pytest.raises(ValueError, match="multi_krum: selected .* must be a positive integer, got 0"):
        MultiKrum(1, selected=0)
    with pytest.raises(ValueError, match="centered_clipping: iterations L must be a positive integer, got 0"):
        CenteredClipping(1.0, iterations=0)
    with pytest.raises(ValueError, match="geometric_median: iterations T must be a positive integer, got 2.0"):
        GeometricMedian(iterations=2.0)
