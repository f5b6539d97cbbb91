"""The shipped presets and sweeps: their names and descriptions, read from the package's TOML files.

Imports nothing but the standard library, so ``driftlab presets`` lists them without importing
torch (``driftlab.experiments.config`` and ``driftlab.experiments.sweep.spec`` validate them and do).
"""

from __future__ import annotations

import tomllib
from importlib import resources

PRESET_PACKAGE = "driftlab.experiments.presets"
SWEEP_PACKAGE = "driftlab.experiments.sweeps"


def _names(package: str) -> list[str]:
    return sorted(p.name[: -len(".toml")] for p in resources.files(package).iterdir() if p.name.endswith(".toml"))


def preset_names() -> list[str]:
    """The shipped config presets (``driftlab run NAME``)."""
    return _names(PRESET_PACKAGE)


def sweep_names() -> list[str]:
    """The shipped sweep presets (the papers' headline experiments)."""
    return _names(SWEEP_PACKAGE)


def preset_text(name: str) -> str:
    return resources.files(PRESET_PACKAGE).joinpath(f"{name}.toml").read_text(encoding="utf-8")


def sweep_text(name: str) -> str:
    return resources.files(SWEEP_PACKAGE).joinpath(f"{name}.toml").read_text(encoding="utf-8")


def preset_description(name: str) -> str:
    """The comment lines at the top of a shipped preset, as one paragraph."""
    lines = []
    for line in preset_text(name).splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(" ".join(lines).split())


def sweep_description(name: str) -> str:
    """The ``description`` of a shipped sweep, as ``load_sweep(name).description`` reads it."""
    return str(tomllib.loads(sweep_text(name)).get("description", ""))


__all__ = ["PRESET_PACKAGE", "SWEEP_PACKAGE", "preset_description", "preset_names", "sweep_description", "sweep_names"]
