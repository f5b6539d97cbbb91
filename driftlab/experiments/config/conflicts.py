"""The checks a validated config must pass besides each section's own: keys of different sections that cannot be
combined (the server step; the features' conflicts, which their registry entries declare), numbers that are not
finite, and booleans pydantic read as numbers; each problem as (key, message)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from driftlab.algorithms import registry
from driftlab.config_section import short
from driftlab.experiments.config.schema import ExperimentConfig
from driftlab.features.config_facts import config_conflicts
from driftlab.features.registry import FEATURES
from driftlab.optim.schedules import is_constant_one


def _server_step_conflicts(config: ExperimentConfig) -> list[tuple[str, str]]:
    entry = registry.ALGORITHMS[config.algorithm.name]
    problems = []
    if entry.owns_server_step and config.server.optimizer != "sgd":
        problems.append(
            (
                "server.optimizer",
                f"{entry.name} has its own server step and does not use a server optimizer; use sgd (got "
                f"{config.server.optimizer!r})",
            )
        )
    if not entry.uses_server_lr and not is_constant_one(config.server.lr):
        problems.append(
            ("server.lr", f"{entry.name} has its own server step; set server.lr = 1 (got {short(config.server.lr)})")
        )
    return problems


UNBOUNDED = {("privacy.clip", math.inf)}  # (key, value): +inf meaning "no bound" (privacy.clip = inf: no clipping)


def _feature_conflicts(config: ExperimentConfig) -> list[tuple[str, str]]:
    """What each feature whose section ``config`` sets cannot be combined with, by key: the ``config_conflicts`` its
    registry entry declares (computed by ``driftlab.features.config_facts``), in the registry's order.

    The checks that need the data (δ below 1/N, a reachable target ε) are each feature's plan's; what a feature needs
    of the algorithm is assembly's check (``driftlab.features.drivers``)."""
    return config_conflicts(config, FEATURES.values())


def _non_finite_numbers(table: dict[str, Any]) -> list[tuple[str, str]]:
    # pydantic lets inf through `ge`/`gt` bounds and algorithm configs are not _Sections
    problems = []
    pending: list[tuple[Any, str]] = [(table, "")]
    while pending:
        value, key = pending.pop()
        if isinstance(value, dict):
            pending.extend((child, f"{key}.{name}" if key else str(name)) for name, child in value.items())
        elif isinstance(value, (list, tuple)):
            pending.extend((child, key) for child in value)
        elif isinstance(value, float) and not math.isfinite(value) and (key, value) not in UNBOUNDED:
            problems.append((key, f"must be a finite number, got {value!r}"))
    return sorted(problems)


def _booleans_taken_as_numbers(table: dict[str, Any], config: BaseModel) -> list[tuple[str, str]]:
    """Keys given true/false that validation turned into a number (pydantic reads true as 1)."""
    problems = []
    pending: list[tuple[Any, Any, str]] = [(table, config, "")]
    while pending:
        given, validated, key = pending.pop()
        if isinstance(given, bool):
            # None: a key the section dropped (another kind's, at its old default), so not read as a number either
            if validated is not None and not isinstance(validated, bool):
                problems.append((key, f"expected a number, got {str(given).lower()}"))
        elif isinstance(given, dict) and isinstance(validated, BaseModel):
            for name, child in given.items():
                pending.append((child, getattr(validated, name, None), f"{key}.{name}" if key else str(name)))
        elif isinstance(given, (list, tuple)) and isinstance(validated, (list, tuple)) and len(given) == len(validated):
            pending.extend((child, out, key) for child, out in zip(given, validated, strict=True))
    return sorted(problems)
