"""Planning a sweep: every run of a spec at a scale, validated, with its labels and run directory, and ``sweep.json``.

Overrides apply in order: ``overrides``, the scale's overrides, the axes' ``set``
(each followed by its ``at_scale`` entry for the chosen scale) in axis order, then
the command line's ``key=value``; the seed comes last. An override written
``LABEL:key=value`` (``scoped_override``) applies only to the runs of the axis value
labelled LABEL, such as one method's key (``FedProx:algorithm.mu=0.1``). Each run's directory is
``runs/<setting>/<method>/seed-<s>`` (``runs/<method>/seed-<s>`` without setting
axes); a run of a tuned axis lives under its method, ``runs/<setting>/<method>/<tuned value>/seed-<s>``, is
labelled ``METHOD (VALUE)`` until the report picks a value for the method, and must hold validation rows
(``data.validation_fraction``): the pick is made on them. A tuned axis with ``methods`` varies the runs of those
methods only; a run of a method no tuned axis applies to is planned once per setting and seed, as in a sweep
without tuned axes. A run's ``description`` in ``sweep.json`` is the sweep's, followed by a
``run_note`` such as ``(run here with: scale paper (rounds=3000); rounds=5)``
when what ran is not the default scale the sweep's description describes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from driftlab.algorithms import registry
from driftlab.errors import ConfigError
from driftlab.experiments.config import (
    DEFAULT_ALGORITHM,
    ExperimentConfig,
    algorithms_with_key,
    apply_overrides,
    load_config,
    read_config_source,
)
from driftlab.experiments.sweep.directory import slug
from driftlab.experiments.sweep.spec import Axis, AxisValue, Scale, SweepSpec
from driftlab.plugins import did_you_mean

SWEEP_FORMAT = 1


@dataclass(frozen=True)
class PlannedRun:
    dir: str
    setting: str
    method: str
    seed: int
    overrides: tuple[str, ...]
    config: ExperimentConfig = field(repr=False, compare=False)  # the overrides applied to the base, validated
    tuned: str = ""  # the tuned axes' value labels ("" unless an axis has role = "tuned")
    tuned_method: str = ""  # the method a tuned run is a candidate of (``method`` is "METHOD (VALUE)")


def _dir_part(values: Sequence[AxisValue]) -> str:
    if any(value.dir_name for value in values):
        return "-".join(value.dir_name or slug(value.label) for value in values)
    return slug(", ".join(value.label for value in values))


def plan(spec: SweepSpec, scale: str | None = None, extra_overrides: Sequence[str] = ()) -> list[PlannedRun]:
    """Every run of the sweep, validated: a bad key fails here, before any work starts."""
    if scale is not None and scale not in spec.scales:
        known = ", ".join(spec.scales) or "none"
        raise ConfigError(
            f"sweep {spec.name} has no scale {scale!r}; its scales: {known} (omit --scale for the default)"
        )
    chosen = spec.scales.get(scale, Scale()) if scale else Scale()
    seeds = chosen.seeds or spec.seeds
    base_table = read_config_source(spec.base)
    if spec.plugins:
        # every run's config records the sweep's plugins too, so its own interpreter imports them
        base_plugins = base_table.get("plugins", [])
        base_plugins = (
            base_plugins if isinstance(base_plugins, list) else [base_plugins]
        )  # validation names a bad value
        base_table = {**base_table, "plugins": [*base_plugins, *(p for p in spec.plugins if p not in base_plugins)]}
    combos: list[list[tuple[Axis, AxisValue]]] = [[]]
    for axis in spec.axes:
        combos = [combo + [(axis, value)] for combo in combos for value in axis.values]
    combos = _applicable(combos)
    labels = [value.label for axis in spec.axes for value in axis.values]
    shared = [scoped_override(a, labels) for a in [*spec.overrides, *chosen.overrides]]
    extra = [scoped_override(a, labels) for a in extra_overrides]
    runs, seen_dirs = [], {}
    for combo in combos:
        setting_values = [value for axis, value in combo if axis.role == "setting"]
        method_values = [value for axis, value in combo if axis.role == "method"]
        tuned_values = [value for axis, value in combo if axis.role == "tuned"]
        tuned = ", ".join(value.label for value in tuned_values)
        setting = ", ".join(value.label for value in setting_values)
        method_parts = [value.label for value in method_values]
        assignments = _run_assignments(combo, shared, extra, scale)
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
                names = " / ".join(value.label for _, value in combo) or "the base config"
                hint = _scope_hint(str(error), base_table, spec.axes, combos, shared, extra, scale)
                raise ConfigError(f"sweep {spec.name}, run {names} (seed {seed}): {error}{hint}") from None
            method = ", ".join(method_parts) or registry.label(config.algorithm.name)
            parts = [_dir_part(setting_values)] if setting_values else []
            parts.append(_dir_part(method_values) if method_values else slug(method))
            if tuned_values:
                _check_validation_rows(spec, config, combo, seed)
                parts.append(_dir_part(tuned_values))
            run_dir = "/".join(["runs", *parts, f"seed-{seed}"])
            if run_dir in seen_dirs:
                raise ConfigError(
                    f"sweep {spec.name}: labels {seen_dirs[run_dir]!r} and {(setting, method)!r} map to the same directory {run_dir}; "
                    "make the labels differ in letters or digits"
                )
            label = f"{method} ({tuned})" if tuned else method
            seen_dirs[run_dir] = (setting, label)
            runs.append(PlannedRun(run_dir, setting, label, seed, overrides, config, tuned, method if tuned else ""))
    if spec.halving is not None:
        _check_extendable(spec, runs)
    return runs


def _applicable(combos: list[list[tuple[Axis, AxisValue]]]) -> list[list[tuple[Axis, AxisValue]]]:
    """The combinations without the values of tuned axes that do not apply to their method (``Axis.methods``), each
    once, in the order of their first appearance: FedAvg beside an α axis for FedDyn is one combination, not three.
    With no ``methods`` on any axis, every combination is kept as it is."""
    kept: dict[tuple[tuple[str, str], ...], list[tuple[Axis, AxisValue]]] = {}
    for combo in combos:
        method_labels = [value.label for axis, value in combo if axis.role == "method"]
        applied = [(axis, value) for axis, value in combo if axis.role != "tuned" or axis.applies_to(method_labels)]
        kept.setdefault(tuple((axis.name, value.label) for axis, value in applied), applied)
    return list(kept.values())


def _check_validation_rows(
    spec: SweepSpec, config: ExperimentConfig, combo: list[tuple[Axis, AxisValue]], seed: int
) -> None:
    """A tuned value is picked on validation rows: a run without them could only be picked on test data."""
    if getattr(config.data, "validation_fraction", None):
        return
    names = " / ".join(value.label for _, value in combo)
    raise ConfigError(
        f"sweep {spec.name}, run {names} (seed {seed}): a tuned axis picks its value on validation data, and this run holds "
        'none (data.validation_fraction is unset); add "data.validation_fraction=0.1" to the sweep\'s `overrides` (or '
        "`validation_fraction = 0.1` under [data] in its base config), which holds 10% of every client's training rows out"
    )


def _check_extendable(spec: SweepSpec, runs: Sequence[PlannedRun]) -> None:
    """Successive halving stops runs early and may extend them later: only a run whose computation does not depend on
    its ``rounds`` (the fingerprint ignores them) gives, extended, the bytes of a run made straight."""
    assert spec.halving is not None
    for r in runs:
        if not r.tuned:
            continue
        shorter = r.config.model_copy(update={"rounds": min(spec.halving.first, r.config.rounds)})
        if shorter.fingerprint() != r.config.fingerprint():
            raise ConfigError(
                f"sweep {spec.name}, run {r.dir}: halving stops runs early and extends them later, but this run's computation "
                "depends on its rounds (privacy.target_epsilon calibrates the noise to them); set privacy.noise_multiplier "
                "instead, or run without halving"
            )


Scoped = list[tuple[str | None, str]]  # (the label an override is scoped to, or None: every run; the plain key=value)


def _run_assignments(
    combo: list[tuple[Axis, AxisValue]], shared: Scoped, extra: Scoped, scale: str | None
) -> list[str]:
    """One run's overrides in order: the sweep's (and its scale's), its axis values' ``set``, the command line's;
    a scoped override only where its label is one of the run's."""
    in_run = {value.label for _, value in combo}
    return [
        *(a for scope, a in shared if scope is None or scope in in_run),
        *(a for _, value in combo for a in value.assignments(scale)),
        *(a for scope, a in extra if scope is None or scope in in_run),
    ]


def scoped_override(assignment: str, labels: Sequence[str]) -> tuple[str | None, str]:
    """``"FedProx:algorithm.mu=1"`` -> ``("FedProx", "algorithm.mu=1")``: an override for the runs of one axis value only;
    ``"algorithm.mu=1"`` -> ``(None, "algorithm.mu=1")``, for every run.

    The scope is the text before the first ``:`` that is followed by ``key=``; it must be the label of an axis value
    (labels may hold ``=``, as a --grid's ``mu=0`` does). A value holding a colon (``data.loader=mod:fn``) is no scope.
    """
    for found in _SCOPE.finditer(assignment):
        scope, rest = assignment[: found.start()], assignment[found.start() + 1 :]
        if scope in labels:
            return scope, rest
        if "=" not in scope:
            known = ", ".join(repr(label) for label in labels) or "none (the sweep has no axes)"
            guess = did_you_mean(scope, list(labels))
            raise ConfigError(
                f"override {assignment[:200]!r}: {scope[:100]!r} is not the label of a value of the sweep's axes, so it cannot "
                f"scope the override{f' (did you mean {guess!r}?)' if guess else ''}; labels: {known}"
            )
    return None, assignment


_SCOPE = re.compile(r":(?=\s*[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\s*=)")


def _scope_hint(
    message: str,
    base_table: dict[str, Any],
    axes: Sequence[Axis],
    combos: list[list[tuple[Axis, AxisValue]]],
    shared: Scoped,
    extra: Scoped,
    scale: str | None,
) -> str:
    """For an ``algorithm.KEY: unknown key`` caused by a sweep-wide override: which algorithms own the key, and the
    scoped overrides (``LABEL:algorithm.KEY=value``) that set it for the runs that use them only."""
    for scope, assignment in [*shared, *extra]:
        key = assignment.split("=", 1)[0].strip()
        parts = key.split(".")
        if scope is not None or len(parts) != 2 or parts[0] != "algorithm" or f"{key}: unknown key" not in message:
            continue
        owners = algorithms_with_key(parts[1])
        without = ([(s, a) for s, a in shared if a != assignment], [(s, a) for s, a in extra if a != assignment])
        owning = [_algorithm_name(base_table, _run_assignments(combo, *without, scale)) in owners for combo in combos]
        # axis values all of whose runs use an owner: each label scopes the override to runs that have the key
        fitting = [
            value.label
            for axis in axes
            for value in axis.values
            if all(own for combo, own in zip(combos, owning, strict=True) if any(v is value for _, v in combo))
        ]
        intro = f"\n{assignment!r} is set for every run of the sweep, but {key} is a key of {', '.join(owners)} only"
        if not fitting:
            return (
                f"{intro}; set it in the `set` of the axis values whose runs use {' or '.join(owners)} (a sweep file)"
            )
        scoped = " ".join(f"'{label}:{assignment}'" for label in fitting)
        return (
            f"{intro}, which the runs of {' and '.join(repr(label) for label in fitting)} use; "
            f"set it for those runs alone with a scoped override: {scoped}"
        )
    return ""


def _algorithm_name(base_table: dict[str, Any], assignments: list[str]) -> str | None:
    """The algorithm a run's overrides name, read without validating them (None when they cannot even be applied)."""
    try:
        algorithm = apply_overrides(base_table, assignments).get("algorithm", {})
    except ConfigError:
        return None
    return algorithm.get("name", DEFAULT_ALGORITHM) if isinstance(algorithm, dict) else None


def sweep_document(
    spec: SweepSpec, runs: Sequence[PlannedRun], scale: str | None, extra_overrides: Sequence[str]
) -> dict[str, Any]:
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
        "axes": [_axis_entry(a, scale) for a in spec.axes],
        "runs": [_run_entry(r) for r in runs],
        **_tuning_entries(spec),
    }


def _axis_entry(axis: Axis, scale: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": axis.name,
        "role": axis.role,
        "values": [{"label": v.label, "set": list(v.assignments(scale))} for v in axis.values],
    }
    if axis.methods is not None:  # absent otherwise: the sweep.json of a sweep without `methods` is what it always was
        entry["methods"] = list(axis.methods)
    return entry


def _run_entry(r: PlannedRun) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "dir": r.dir,
        "setting": r.setting,
        "method": r.method,
        "seed": r.seed,
        "overrides": list(r.overrides),
    }
    if r.tuned:  # absent otherwise: an untuned sweep's sweep.json is what it always was
        entry.update(tuned=r.tuned, tuned_method=r.tuned_method)
    return entry


def _tuning_entries(spec: SweepSpec) -> dict[str, Any]:
    """sweep.json's ``tuning`` (and ``halving``) keys, for sweeps with tuned axes only."""
    if spec.tuning is None:
        return {}
    entries: dict[str, Any] = {
        "tuning": {"metric": spec.tuning.metric, "rule": spec.tuning.rule, "axes": [a.name for a in spec.tuned_axes]}
    }
    if spec.halving is not None:
        entries["halving"] = {"first": spec.halving.first, "eta": spec.halving.eta}
    return entries


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


__all__ = ["SWEEP_FORMAT", "PlannedRun", "plan", "run_note", "scoped_override", "sweep_document"]
