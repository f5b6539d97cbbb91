"""The entry point: names, settings records, refusals, and properties every rule shares."""

from __future__ import annotations

import math

import pytest
import torch

from driftlab.robust import AGGREGATORS, Bulyan, CenteredClipping, Krum, TrimmedMean, aggregate, make_settings

F64 = torch.float64

EVERY_RULE = {
    "median": {},
    "trimmed_mean": {"beta": 0.2},
    "krum": {"byzantine": 1},
    "multi_krum": {"byzantine": 1, "selected": 3},
    "bulyan": {"byzantine": 1},
    "geometric_median": {},
    "centered_clipping": {"radius": math.inf},
    "norm_bound": {"max_norm": 100.0},
}


def test_every_registered_rule_is_covered_here():
    assert set(AGGREGATORS) == set(EVERY_RULE)


@pytest.mark.parametrize("name", sorted(EVERY_RULE))
def test_identical_updates_aggregate_to_that_update(name):
    x = torch.tensor([[0.25, -3.0, 8.0]], dtype=F64).repeat(8, 1)
    result = aggregate(name, x, torch.tensor([1.0, 2.0, 1.0, 4.0, 1.0, 1.0, 2.0, 5.0]), **EVERY_RULE[name])
    assert torch.equal(result.aggregate, x[0])


@pytest.mark.parametrize("name", sorted(EVERY_RULE))
def test_deterministic(name):
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    first, second = aggregate(name, x, **EVERY_RULE[name]), aggregate(name, x, **EVERY_RULE[name])
    assert torch.equal(first.aggregate, second.aggregate) and torch.equal(first.kept, second.kept)


def test_a_record_or_a_name_with_fields():
    x = torch.tensor([[1.0], [2.0], [3.0], [4.0], [100.0]], dtype=F64)
    assert torch.equal(aggregate(TrimmedMean(beta=0.2), x).aggregate, aggregate("trimmed_mean", x, beta=0.2).aggregate)
    assert make_settings("bulyan", byzantine=2) == Bulyan(byzantine=2)


def test_refusals_name_the_fix():
    x = torch.ones(5, 2)
    with pytest.raises(ValueError, match="choose one of bulyan, centered_clipping"):
        aggregate("mean", x)
    with pytest.raises(ValueError, match="takes the fields byzantine; got"):
        aggregate("krum", x, beta=0.1)
    with pytest.raises(ValueError, match="put them in the record"):
        aggregate(Krum(byzantine=1), x, beta=0.1)
    with pytest.raises(ValueError, match="pass state only to centered_clipping"):
        aggregate(Krum(byzantine=1), x, state=aggregate(CenteredClipping(radius=1.0), x).state)
