"""Planning a sweep: every run of a spec at a scale, validated, with its labels and run directory, and ``sweep.json``.

Overrides apply in order: ``overrides``, the scale's overrides, the axes' ``set``
(each followed by its ``at_scale`` entry for the chosen scale) in axis order, then
the command line's ``key=value``; the seed comes last. Each run's directory is
``runs/<setting>/<method>/seed-<s>`` (``runs/<method>/seed-<s>`` without setting
axes). Its ``description`` in ``sweep.json`` is the sweep's, followed by a
``run_note`` such as ``(run here with: scale paper (rounds=3000); rounds=5)``
when what ran is not the default scale the sweep's description describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from driftlab.algorithms import registry
from driftlab.experiments.config import ConfigError, ExperimentConfig, load_config, read_config_source
from driftlab.experiments.sweep.directory import slug
from driftlab.experiments.sweep.spec import Axis, AxisValue, Scale, SweepSpec

SWEEP_FORMAT = 1


@dataclass(frozen=True)
class PlannedRun:
    dir: str
    setting: str
    method: str
    seed: int
    overrides: tuple[str, ...]
    config: ExperimentConfig = field(repr=False, compare=False)  # the overrides applied to the base, validated


def _dir_part(values: Sequence[AxisValue]) -> str:
    if any(value.dir_name for value in values):
        return "-".join(value.dir_name or slug(value.label) for value in values)
    return slug(", ".join(value.label for value in values))


def plan(spec: SweepSpec, scale: str | None = None, extra_overrides: Sequence[str] = ()) -> list[PlannedRun]:
    """Every run of the sweep, validated: a bad key fails here, before any work starts."""
    if scale is not None and scale not in spec.scales:
        known = ", ".join(spec.scales) or "none"
        raise ConfigError(f"sweep {spec.name} has no scale {scale!r}; its scales: {known} (omit --scale for the default)")
    chosen = spec.scales.get(scale, Scale()) if scale else Scale()
    seeds = chosen.seeds or spec.seeds
    base_table = read_config_source(spec.base)
    if spec.plugins:
        # every run's config records the sweep's plugins too, so its own interpreter imports them
        base_plugins = base_table.get("plugins", [])
        base_plugins = base_plugins if isinstance(base_plugins, list) else [base_plugins]  # validation names a bad value
        base_table = {**base_table, "plugins": [*base_plugins, *(p for p in spec.plugins if p not in base_plugins)]}
    combos: list[list[tuple[Axis, AxisValue]]] = [[]]
    for axis in spec.axes:
        combos = [combo + [(axis, value)] for combo in combos for value in axis.values]
    runs, seen_dirs = [], {}
    for combo in combos:
        setting_values = [value for axis, value in combo if axis.role == "setting"]
        method_values = [value for axis, value in combo if axis.role == "method"]
        setting = ", ".join(value.label for value in setting_values)
        method_parts = [value.label for value in method_values]
        assignments = [*spec.overrides, *chosen.overrides, *(a for _, value in combo for a in value.assignments(scale)), *extra_overrides]
        seed_assignments = [a for a in assignments if a.split("=", 1)[0].strip() == "seed"]
        if seed_assignments:
            # Every run's seed comes from the sweep's seed list; a `seed=` override would be replaced without a word.
            raise ConfigError(
                f"sweep {spec.name}: {seed_assignments[0]!r} would be replaced by each run's seed; "
                "give the seeds with --seeds 0,1,2 (or `seeds = [...]` in the sweep file) instead"
            )
        for seed in seeds:
            overrides = tuple([*assignments, f"seed={seed}"])
            try:
                config = load_config(base_table, overrides)
            except ConfigError as error:
                labels = " / ".join(value.label for _, value in combo) or "the base config"
                raise ConfigError(f"sweep {spec.name}, run {labels} (seed {seed}): {error}") from None
            method = ", ".join(method_parts) or registry.label(config.algorithm.name)
            parts = [_dir_part(setting_values)] if setting_values else []
            run_dir = "/".join(["runs", *parts, _dir_part(method_values) if method_values else slug(method), f"seed-{seed}"])
            if run_dir in seen_dirs:
                raise ConfigError(
                    f"sweep {spec.name}: labels {seen_dirs[run_dir]!r} and {(setting, method)!r} map to the same directory {run_dir}; "
                    "make the labels differ in letters or digits"
                )
            seen_dirs[run_dir] = (setting, method)
            runs.append(PlannedRun(run_dir, setting, method, seed, overrides, config))
    return runs


def sweep_document(spec: SweepSpec, runs: Sequence[PlannedRun], scale: str | None, extra_overrides: Sequence[str]) -> dict[str, Any]:
    """The content of ``sweep.json``: what a report needs to group runs by setting, method and seed."""
    chosen = spec.scales.get(scale, Scale()) if scale else Scale()
    note = run_note(spec, scale, extra_overrides)
    return {
        "format": SWEEP_FORMAT,
        "name": spec.name,
        "description": f"{spec.description.rstrip()}\n{note}".strip() if note else spec.description,
        "spec_description": spec.description,
        "run_note": note,
        "command_overrides": list(extra_overrides),
        "rounds": sorted({r.config.rounds for r in runs}),
        "base": spec.base,
        "plugins": list(spec.plugins),
        "scale": scale or "default",
        "overrides": [*spec.overrides, *chosen.overrides, *extra_overrides],
        "seeds": list(chosen.seeds or spec.seeds),
        "targets": list(spec.targets),
        "steps_reference": spec.steps_reference,
        "axes": [{"name": a.name, "role": a.role, "values": [{"label": v.label, "set": list(v.assignments(scale))} for v in a.values]} for a in spec.axes],
        "runs": [{"dir": r.dir, "setting": r.setting, "method": r.method, "seed": r.seed, "overrides": list(r.overrides)} for r in runs],
    }


def run_note(spec: SweepSpec, scale: str | None, extra_overrides: Sequence[str]) -> str:
    """What was run besides the sweep's default scale, which its description describes; empty when nothing else."""
    parts = []
    if scale:
        chosen = spec.scales.get(scale, Scale())
        settings = [*chosen.overrides, *([f"seeds {', '.join(map(str, chosen.seeds))}"] if chosen.seeds else [])]
        parts.append(f"scale {scale}" + (f" ({', '.join(settings)})" if settings else ""))
    if extra_overrides:
        parts.append(", ".join(extra_overrides))
    return f"(run here with: {'; '.join(parts)})" if parts else ""


__all__ = ["SWEEP_FORMAT", "PlannedRun", "plan", "run_note", "sweep_document"]
