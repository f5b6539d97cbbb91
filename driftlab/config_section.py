"""The base of every ``[section]`` of an experiment config, and the quoting its messages share.

Low in the package (it imports pydantic only), so a feature's own package can define its section
(``driftlab.privacy.section``, ``driftlab.simulation.time.section``, ...) without importing
``driftlab.experiments``, which assembles the sections into ``ExperimentConfig``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, so a huge value cannot flood a message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} characters)"


class Section(BaseModel):
    """A config section: unknown keys refused, frozen, and no inf or nan unless a field allows it."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


__all__ = ["Section", "short"]
