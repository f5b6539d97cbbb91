"""What a config turns on besides its sections, as named facts, and each feature's conflicts with them as data.

A feature's ``FeatureEntry.config_conflicts`` (``capabilities.Requirements``) needs and excludes facts by name
("[system]", 'sampling.mode = "weighted"'); ``facts()`` says when each holds and at which key a conflict with it is
reported: "[name]" for each feature's optional section, the facts of the sections every config has, and each
feature's own (``FeatureEntry.config_facts``).  ``config_conflicts(config)`` computes every problem with
``capabilities.conflicts``, the one function that computes the algorithms' refusals too, as the (key, message) pairs
config validation lists.  A reason's
``{participation}``, ``{ratio}``, ``{whose}`` and ``{mode}`` are the config's values.
"""

from __future__ import annotations

from typing import Any, Iterable

from driftlab.compress.feature import ratio
from driftlab.features.capabilities import conflicts
from driftlab.features.entry import Fact, FeatureEntry
from driftlab.features.registry import FEATURES
from driftlab.features.run import configured_features, run_facts


def _is(config_test: Any) -> Any:
    """A fact's ``holds`` that reads the config alone."""
    return lambda config, _on: config_test(config)


# The facts of the sections every config has; each feature adds its own (``FeatureEntry.config_facts``).
COMMON_FACTS = (
    Fact('sampling.mode = "weighted"', "sampling.mode", _is(lambda config: config.sampling.mode == "weighted")),
    Fact('sampling.mode != "uniform"', "sampling.mode", _is(lambda config: config.sampling.mode != "uniform")),
    Fact(
        "availability.events", "availability.events", _is(lambda config: config.availability.events not in ((), None))
    ),
    Fact(
        "availability.initially_registered",
        "availability.initially_registered",
        _is(lambda config: config.availability.initially_registered not in ((), None)),
    ),
    *(
        Fact(
            f"availability.{key} > 0",
            f"availability.{key}",
            _is(lambda config, key=key: getattr(config.availability, key) > 0),
        )
        for key in ("inactive_probability", "incomplete_probability")
    ),
)


def _section_set(entry: FeatureEntry) -> Fact:
    return Fact(f"[{entry.name}]", entry.name, _is(lambda config: entry.section(config) is not None))


def facts(features: Iterable[FeatureEntry] | None = None) -> tuple[Fact, ...]:
    """Every fact conflicts may name: "[name]" of each feature with an optional section, the common facts, and each
    feature's own (``features``: the entries, None: the registry's)."""
    features = tuple(FEATURES.values() if features is None else features)
    sections = tuple(_section_set(entry) for entry in features if entry.config_field is not None)
    return (*sections, *COMMON_FACTS, *(fact for entry in features for fact in entry.config_facts))


def present(config: Any) -> frozenset[str]:
    """The names of the facts that hold for ``config``."""
    on = frozenset(entry.name for entry, _ in configured_features(config, run_facts(config)))
    return frozenset(fact.name for fact in facts() if fact.holds(config, on))


def _values(config: Any) -> dict[str, str]:
    whose = "" if config.compression.ratio is not None else f", {config.algorithm.name}'s default"
    return {
        "participation": f"{config.sampling.participation:g}",
        "ratio": f"{ratio(config.compression, config.algorithm.name):g}",
        "whose": whose,
        "mode": config.sampling.mode,
    }


def config_conflicts(config: Any, features: Any) -> list[tuple[str, str]]:
    """Every conflict of the ``features`` (``FeatureEntry`` values) whose section ``config`` sets, with the facts of
    ``config``: (the key it is reported at, why and the fix), in the features' order, each its needs then exclusions."""
    held = present(config)
    keys = {fact.name: fact.key for fact in facts()}
    values = _values(config)
    problems = []
    for entry in features:
        if entry.config_conflicts is None or entry.section(config) is None:
            continue
        for conflict in conflicts(entry.config_conflicts, entry.name, held):
            needed = conflict.first == entry.config_conflicts.key  # a missing need: reported at the feature's own key
            key = entry.name if needed else keys[conflict.first]
            text = conflict.reason.text
            for name, value in values.items():
                text = text.replace("{" + name + "}", value)
            problems.append((key, text))
    return problems
