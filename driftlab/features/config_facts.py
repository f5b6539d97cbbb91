"""What a config turns on besides its sections, as named facts, and each feature's conflicts with them as data.

A feature's ``FeatureEntry.config_conflicts`` (``capabilities.Requirements``) needs and excludes facts by name
("[system]", 'sampling.mode = "weighted"'); ``FACTS`` says when each holds and at which key a conflict with it is
reported.  ``config_conflicts(config)`` computes every problem with ``capabilities.conflicts``, the one function
that computes the algorithms' refusals too, as the (key, message) pairs config validation lists.  A reason's
``{participation}``, ``{ratio}``, ``{whose}`` and ``{mode}`` are the config's values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from driftlab.algorithms import registry as algorithms
from driftlab.features.capabilities import conflicts


@dataclass(frozen=True)
class Fact:
    """``name`` holds for a config when ``holds(config)``; a conflict with it is reported at config key ``key``."""

    name: str
    key: str
    holds: Callable[[Any], bool]


def compression_ratio(config: Any) -> float:
    """``compression.ratio``, else the algorithm's default."""
    ratio = config.compression.ratio
    if ratio is None:
        entry = algorithms.ALGORITHMS.get(config.algorithm.name)
        ratio = entry.default_compression_ratio if entry is not None else 1.0
    return ratio


def _fixed_cohort_accounted_centrally(config: Any) -> bool:
    sampling = config.sampling
    fixed = sampling.mode not in ("weighted", "poisson") and sampling.participation != 1
    return config.privacy is not None and config.privacy.accounted_centrally and fixed


def _timed(config: Any, test: Callable[[Any], bool]) -> bool:
    return config.system is not None and test(config.system)


FACTS = (
    Fact("[privacy]", "privacy", lambda config: config.privacy is not None),
    Fact("[system]", "system", lambda config: config.system is not None),
    Fact("[asynchronous]", "asynchronous", lambda config: config.asynchronous is not None),
    Fact('sampling.mode = "weighted"', "sampling.mode", lambda config: config.sampling.mode == "weighted"),
    Fact('sampling.mode != "uniform"', "sampling.mode", lambda config: config.sampling.mode != "uniform"),
    Fact("a fixed cohort accounted centrally", "sampling.mode", _fixed_cohort_accounted_centrally),
    Fact("availability.events", "availability.events", lambda config: config.availability.events not in ((), None)),
    Fact(
        "availability.initially_registered",
        "availability.initially_registered",
        lambda config: config.availability.initially_registered not in ((), None),
    ),
    Fact(
        "availability.inactive_probability > 0",
        "availability.inactive_probability",
        lambda config: config.availability.inactive_probability > 0,
    ),
    Fact(
        "availability.incomplete_probability > 0",
        "availability.incomplete_probability",
        lambda config: config.availability.incomplete_probability > 0,
    ),
    Fact("compression.ratio < 1", "compression.ratio", lambda config: compression_ratio(config) < 1),
    Fact(
        'privacy.noise = "local" compressed',
        "privacy.noise",
        lambda config: config.privacy is not None and config.privacy.noise == "local" and compression_ratio(config) < 1,
    ),
    Fact(
        "system.deadline", "system.deadline", lambda config: _timed(config, lambda system: system.deadline is not None)
    ),
    Fact(
        "system.over_selection > 0",
        "system.over_selection",
        lambda config: _timed(config, lambda system: system.over_selection > 0),
    ),
    Fact(
        "system.over_selection > 0 of a poisson cohort",
        "system.over_selection",
        lambda config: _timed(config, lambda system: system.over_selection > 0) and config.sampling.mode == "poisson",
    ),
)
KEYS = {fact.name: fact.key for fact in FACTS}


def present(config: Any) -> frozenset[str]:
    """The names of the facts that hold for ``config``."""
    return frozenset(fact.name for fact in FACTS if fact.holds(config))


def _values(config: Any) -> dict[str, str]:
    ratio = compression_ratio(config)
    whose = "" if config.compression.ratio is not None else f", {config.algorithm.name}'s default"
    return {
        "participation": f"{config.sampling.participation:g}",
        "ratio": f"{ratio:g}",
        "whose": whose,
        "mode": config.sampling.mode,
    }


def config_conflicts(config: Any, features: Any) -> list[tuple[str, str]]:
    """Every conflict of the ``features`` (``FeatureEntry`` values) whose section ``config`` sets, with the facts of
    ``config``: (the key it is reported at, why and the fix), in the features' order, each its needs then exclusions."""
    facts = present(config)
    values = _values(config)
    problems = []
    for entry in features:
        if entry.config_conflicts is None or entry.section(config) is None:
            continue
        for conflict in conflicts(entry.config_conflicts, entry.name, facts):
            needed = conflict.first == entry.config_conflicts.key  # a missing need: reported at the feature's own key
            key = entry.name if needed else KEYS[conflict.first]
            text = conflict.reason.text
            for name, value in values.items():
                text = text.replace("{" + name + "}", value)
            problems.append((key, text))
    return problems
