"""Fixtures the experiments' tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def built_in_algorithms_only(monkeypatch):
    """The registry as a fresh process has it: plugins other tests registered (MOON's mu, nesterov_avg) are out of sight."""
    from driftlab.algorithms import registry

    built_ins = {name: registry.ALGORITHMS[name] for name in registry.BUILT_IN}
    monkeypatch.setattr(registry.REGISTRY, "entries", built_ins)
    monkeypatch.setattr(registry, "ALGORITHMS", built_ins)
