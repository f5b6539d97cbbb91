"""Sweeps: a grid of config variants times a list of seeds, run in parallel processes, resumable.

A sweep file (TOML; shipped ones are listed by ``driftlab presets``)::

    description = "FedProx Figure 1: mu = 0 vs mu = 1 on synthetic data"
    base = "synthetic-fedprox"          # a preset, or a config file relative to this file
    plugins = ["my_algorithm.py"]       # optional: modules every run imports (paths relative to this file)
    overrides = ["rounds=100"]          # applied to every run: the scaled setting
    seeds = [0, 1]
    targets = [0.7]                     # target accuracies for the report
    steps_reference = "Constant K"      # optional: the method local SGD steps are compared with

    [scales.paper]                      # `driftlab sweep NAME --scale paper`: the paper's full scale
    overrides = ["rounds=200"]
    seeds = [0, 1, 2, 3, 4]

    [[axes]]
    name = "data"
    role = "setting"                    # settings get their own tables and plots
    values = [
      { label = "synthetic(0,0)", set = ["data.synthetic_alpha=0", "data.synthetic_beta=0"] },
      { label = "synthetic(1,1)", set = ["data.synthetic_alpha=1", "data.synthetic_beta=1"] },
    ]

    [[axes]]
    name = "method"
    role = "method"                     # methods are the rows a report compares
    values = [
      { label = "FedAvg", set = ["algorithm.mu=0"] },
      { label = "FedProx", set = ["algorithm.mu=1"], at_scale = { paper = ["client.epochs=50"] } },
    ]

Overrides apply in order: ``overrides``, the scale's overrides, the axes' ``set``
(each followed by its ``at_scale`` entry for the chosen scale) in axis order, then
the command line's ``key=value``; the seed comes last.

A sweep without a file, ``--grid client.lr=[0.1, 0.2]`` on a config, labels its
values by the key's last part (``lr=0.1``; more of it where two keys end alike)
and is described by its base, axes and seeds.

The output directory holds ``sweep.json`` (the plan: axes, labels and every run's
overrides) and ``runs/<setting>/<method>/seed-<s>/``, each an ordinary run
directory. Its ``description`` is the sweep's, followed by a ``run_note`` such as
``(run here with: scale paper (rounds=3000); rounds=5)`` when what ran is not the
default scale the sweep's description describes. Running the same sweep again
skips complete runs, resumes interrupted ones from their checkpoints
(bit-identical to an uninterrupted run), retries failed ones and leaves diverged
ones alone (they would diverge again: every random draw derives from seed, round
and client id). Raising ``rounds`` extends finished runs. Each run's process
stops, checkpointed, when the sweep that started it dies, however it dies; a run
whose directory another live process holds is reported as running elsewhere and
never given a second writer.

Where runs execute is the executor's business (``driftlab.executors``: local
processes, SLURM jobs through submitit, Ray tasks); every one starts each run through
``worker_main``, so results are the same byte for byte, and ``driftlab sweep --status``
(``sweep_status``) reads where each run stands from the directories alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import traceback
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from driftlab.algorithms import registry
from driftlab.experiments.config import (
    MAX_CONFIG_BYTES,
    ConfigError,
    ExperimentConfig,
    config_from_record,
    load_config,
    parse_override,
    read_config_source,
)

if TYPE_CHECKING:
    from driftlab.executors import ExecutorOptions

SWEEP_PACKAGE = "driftlab.experiments.sweeps"
SWEEP_FILE = "sweep.json"
FAILURE_FILE = "failure.txt"
SWEEP_FORMAT = 1

Role = Literal["setting", "method"]
RunStatus = Literal["pending", "running", "complete", "interrupted", "diverged", "failed"]

# Keys that change how a method computes (rows of a comparison) rather than the problem it solves.
METHOD_SECTIONS = ("algorithm", "client", "server", "compression")

@dataclass(frozen=True)
class AxisValue:
    label: str
    set: tuple[str, ...]
    at_scale: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (scale name, extra overrides) for one variant at one scale
    dir_name: str = ""  # its part of the run directory; empty: slug(label) (sweep files, so their directories never move)

    def assignments(self, scale: str | None) -> tuple[str, ...]:
        return self.set + dict(self.at_scale).get(scale, ())


@dataclass(frozen=True)
class Axis:
    name: str
    role: Role
    values: tuple[AxisValue, ...]


@dataclass(frozen=True)
class Scale:
    overrides: tuple[str, ...] = ()
    seeds: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SweepSpec:
    name: str
    base: str
    description: str = ""
    overrides: tuple[str, ...] = ()
    seeds: tuple[int, ...] = (0,)
    targets: tuple[float, ...] = ()
    steps_reference: str | None = None
    axes: tuple[Axis, ...] = ()
    scales: dict[str, Scale] = field(default_factory=dict)
    plugins: tuple[str, ...] = ()  # imported for every run, after the base config's own (absolute paths or module names)


@dataclass(frozen=True)
class PlannedRun:
    dir: str
    setting: str
    method: str
    seed: int
    overrides: tuple[str, ...]
    config: ExperimentConfig = field(repr=False, compare=False)  # the overrides applied to the base, validated


@dataclass(frozen=True)
class RunOutcome:
    run: PlannedRun
    status: RunStatus
    message: str = ""
    seconds: float = 0.0


# ---------------------------------------------------------------- reading sweep files


def sweep_names() -> list[str]:
    """The shipped sweep presets (the papers' headline experiments)."""
    return sorted(p.name[: -len(".toml")] for p in resources.files(SWEEP_PACKAGE).iterdir() if p.name.endswith(".toml"))


def is_sweep_source(source: str | Path) -> bool:
    """Whether ``source`` names a sweep (a shipped sweep or a TOML file with ``base``/``[[axes]]``) rather than a config."""
    if str(source) in sweep_names():
        return True
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".toml":
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return False  # load_config refuses it with the reason
        try:
            table = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError):
            return False
        # a config file may build on a `base` too; a sweep file holds nothing but sweep keys
        return "axes" in table or ("base" in table and set(table) <= _TOP_KEYS)
    return False


def load_sweep(source: str | Path) -> SweepSpec:
    """Read a sweep file or a shipped sweep preset, with errors that name the key at fault."""
    path = Path(source)
    if path.is_file():
        text, origin, folder, name = path.read_text(), str(path), path.parent, path.stem
    elif str(source) in sweep_names():
        text, origin, folder, name = resources.files(SWEEP_PACKAGE).joinpath(f"{source}.toml").read_text(), f"sweep {source}", None, str(source)
    else:
        raise ConfigError(f"{source!r} is neither a sweep file nor a shipped sweep; shipped sweeps: {', '.join(sweep_names())}")
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{origin} is not valid TOML: {error}") from None
    return sweep_from_table(table, origin, name, folder)


_TOP_KEYS = {"description", "base", "plugins", "overrides", "seeds", "targets", "steps_reference", "axes", "scales", "name"}


def sweep_from_table(table: dict[str, Any], origin: str, name: str, folder: Path | None = None) -> SweepSpec:
    unknown = sorted(set(table) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{origin}: unknown key(s) {', '.join(unknown)}; a sweep file has {', '.join(sorted(_TOP_KEYS))}")
    base = table.get("base")
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{origin}: `base` must name the config every run starts from (a preset such as \"mnist-feddyn\" or a .toml file)")
    if folder is not None and not Path(base).is_absolute() and (folder / base).is_file():
        base = str(folder / base)
    axes = tuple(_axis(a, i, origin) for i, a in enumerate(_list(table, "axes", origin, dict)))
    seen: set[str] = set()
    for axis in axes:
        if axis.name in seen:
            raise ConfigError(f"{origin}: two axes are named {axis.name!r}; give each axis its own name")
        seen.add(axis.name)
    scales = {}
    raw_scales = table.get("scales", {})
    if not isinstance(raw_scales, dict):
        raise ConfigError(f"{origin}: `scales` must be a table of named scales, e.g. [scales.paper] overrides = [...]")
    for scale_name, raw in raw_scales.items():
        where = f"{origin}: scales.{scale_name}"
        if not isinstance(raw, dict) or set(raw) - {"overrides", "seeds"}:
            raise ConfigError(f"{where} must be a table with `overrides` (a list of key=value) and optionally `seeds`")
        seeds = validate_seeds(raw["seeds"], where) if "seeds" in raw else None
        scales[scale_name] = Scale(tuple(_list(raw, "overrides", where, str)), seeds)
    for axis in axes:
        for value in axis.values:
            for scale_name, _ in value.at_scale:
                if scale_name not in scales:
                    raise ConfigError(f"{origin}: axis {axis.name}, value {value.label!r}: at_scale names {scale_name!r}, which is not under [scales]")
    targets = tuple(_list(table, "targets", origin, (int, float)))
    for target in targets:
        if not 0 < target <= 1:
            raise ConfigError(f"{origin}: target accuracies are fractions in (0, 1], got {target}")
    reference = table.get("steps_reference")
    if reference is not None and reference not in {v.label for a in axes if a.role == "method" for v in a.values}:
        raise ConfigError(f"{origin}: steps_reference={reference!r} is not a method label of any axis with role = \"method\"")
    plugins = tuple(registry.resolve_plugin(plugin, folder) for plugin in _list(table, "plugins", origin, str))
    if not all(plugins):
        raise ConfigError(f"{origin}: `plugins` lists module names or paths of .py files, not empty strings")
    return SweepSpec(
        name=str(table.get("name", name)),
        base=base,
        plugins=plugins,
        description=str(table.get("description", "")),
        overrides=tuple(_list(table, "overrides", origin, str)),
        seeds=validate_seeds(table.get("seeds", [0]), origin),
        targets=tuple(float(t) for t in targets),
        steps_reference=reference,
        axes=axes,
        scales=scales,
    )


def _list(table: dict[str, Any], key: str, origin: str, kind: type | tuple[type, ...]) -> list[Any]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        kinds = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{origin}: `{key}` must be a list of {kinds} values, got {value!r}")
    return value


def validate_seeds(value: Any, origin: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value):
        raise ConfigError(f"{origin}: `seeds` must be a non-empty list of non-negative integers, got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{origin}: `seeds` lists a seed twice: {value!r}")
    return tuple(value)


def _axis(raw: dict[str, Any], index: int, origin: str) -> Axis:
    where = f"{origin}: axes[{index}]"
    if set(raw) - {"name", "role", "values"}:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(set(raw) - {'name', 'role', 'values'}))}; an axis has name, role, values")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: `name` must be a non-empty string")
    values = raw.get("values")
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where} ({name}): `values` must be a non-empty list of {{ label = \"...\", set = [\"key=value\", ...] }}")
    parsed = []
    for value in values:
        if (
            not isinstance(value, dict)
            or not {"label", "set"} <= set(value) <= {"label", "set", "at_scale"}
            or not isinstance(value["label"], str)
            or not value["label"]
        ):
            raise ConfigError(
                f"{where} ({name}): each value is {{ label = \"...\", set = [\"key=value\", ...] }} "
                f"(optionally at_scale = {{ paper = [\"key=value\", ...] }}), got {value!r}"
            )
        assignments = value["set"]
        if not isinstance(assignments, list) or not all(isinstance(a, str) for a in assignments):
            raise ConfigError(f"{where} ({name}), value {value['label']!r}: `set` must be a list of \"key=value\" strings")
        at_scale = value.get("at_scale", {})
        if not isinstance(at_scale, dict) or not all(isinstance(v, list) and all(isinstance(a, str) for a in v) for v in at_scale.values()):
            raise ConfigError(f"{where} ({name}), value {value['label']!r}: at_scale maps scale names to lists of \"key=value\" strings")
        for assignment in [*assignments, *(a for v in at_scale.values() for a in v)]:
            parse_override(assignment)
        parsed.append(AxisValue(value["label"], tuple(assignments), tuple((k, tuple(v)) for k, v in at_scale.items())))
    labels = [v.label for v in parsed]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{where} ({name}): labels must differ, got {labels}")
    role = raw.get("role") or _infer_role(v for value in parsed for v in value.set)
    if role not in ("setting", "method"):
        raise ConfigError(f"{where} ({name}): role must be \"setting\" or \"method\", got {role!r}")
    return Axis(name, role, tuple(parsed))


def _infer_role(assignments) -> Role:
    sections = {parse_override(a)[0][0] for a in assignments}
    return "method" if sections and sections <= set(METHOD_SECTIONS) else "setting"


GRID_FORMS = "KEY=[v1, v2, ...] (a TOML list, e.g. --grid 'client.lr=[0.1, 0.2]') or KEY=v1,v2 (e.g. --grid algorithm.name=fedavg,scaffold)"

_BARE_WORD = re.compile(r"[A-Za-z0-9_.+\-]+")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def grid_axis(assignment: str, label_key: str | None = None) -> Axis:
    """``--grid algorithm.mu=[0, 1]`` (a TOML list) or ``--grid algorithm.name=fedavg,fedprox`` as an axis.

    Keys in the algorithm, client, server or compression sections are methods
    (rows of the report); other keys are settings (tables of their own). Values are
    labelled ``LABEL_KEY=value`` (default: the key's last component, ``mu=0.01``).
    """
    key, sep, raw = assignment.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key or not raw:
        raise ConfigError(f"--grid {assignment!r} must be {GRID_FORMS}")
    if not _KEY.fullmatch(key):
        raise ConfigError(f"--grid {assignment!r}: {key!r} is not a config key such as client.lr or algorithm.mu; write {GRID_FORMS}")
    literals = _grid_literals(assignment, raw)
    if not literals:
        raise ConfigError(f"--grid {assignment!r} lists no values; write {GRID_FORMS}")
    seen: dict[Any, str] = {}
    for literal in literals:
        value = parse_override(f"{key}={literal}")[1]
        if _canonical(value) in seen:
            same = literal if seen[_canonical(value)] == literal else f"{seen[_canonical(value)]} and {literal}, one value,"
            raise ConfigError(f"--grid {assignment!r} lists {same} twice; list each value once")
        seen[_canonical(value)] = literal
    short = label_key or key.split(".")[-1]
    axis_values = tuple(_grid_value(key, short, literal) for literal in literals)
    return Axis(key, _infer_role(v.set[0] for v in axis_values), axis_values)


def _grid_literals(assignment: str, raw: str) -> list[str]:
    """The values of one --grid as TOML literals; anything that is not exactly one of the two forms is an error."""
    if raw.startswith("[") or raw.endswith("]"):
        try:
            values = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"--grid {assignment!r}: {raw!r} is not a TOML list ({error}); write {GRID_FORMS}") from None
        if not isinstance(values, list):
            raise ConfigError(f"--grid {assignment!r}: {raw!r} is not a list; write {GRID_FORMS}")
        return [_toml_literal(v) for v in values]
    literals = []
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            raise ConfigError(f"--grid {assignment!r} has an empty value between commas; write {GRID_FORMS}")
        try:
            tomllib.loads(f"v = {part}")
        except tomllib.TOMLDecodeError:
            if not _BARE_WORD.fullmatch(part):
                raise ConfigError(
                    f"--grid {assignment!r}: {part!r} is neither a TOML value nor a bare word (a value holding a comma, "
                    f"bracket or quote needs the TOML list form, e.g. KEY=[\"a,b\"]; tables need a sweep file); write {GRID_FORMS}"
                ) from None
        literals.append(part)
    return literals


def _canonical(value: Any) -> Any:
    """A hashable stand-in for a parsed value in which 0 and 0.0 are one value but true and 1 are not."""
    if isinstance(value, bool) or value is None:
        return ("const", value)
    if isinstance(value, (int, float)):
        return ("number", float(value))
    return ("other", json.dumps(value, sort_keys=True))


def _grid_value(key: str, label_key: str, literal: str) -> AxisValue:
    shown = parse_override(f"{key}={literal}")[1]
    text = shown if isinstance(shown, str) else literal
    # The key part is slugged like any label; the value part keeps its sign, so lr=-1 and lr=1 get different directories.
    value_part = re.sub(r"[^a-z0-9.+\-]+", "-", text.lower()).rstrip("-") or "x"
    return AxisValue(f"{label_key}={text}", (f"{key}={literal}",), dir_name=f"{slug(label_key)}-{value_part}")


def short_keys(keys: Sequence[str]) -> list[str]:
    """The shortest trailing part of each dotted key that no other key ends with: mu, or client.lr beside server.lr."""
    parts = [key.split(".") for key in keys]
    shortened = []
    for index, key_parts in enumerate(parts):
        for n in range(1, len(key_parts) + 1):
            suffix = key_parts[-n:]
            if not any(other[-n:] == suffix for j, other in enumerate(parts) if j != index):
                break
        shortened.append(".".join(suffix))
    return shortened


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", value) else json.dumps(value)
    raise ConfigError(f"--grid values must be numbers, booleans or strings; use a sweep file for {value!r}")


def sweep_from_config(base: str, grid: Sequence[str], seeds: Sequence[int], name: str) -> SweepSpec:
    """A sweep over ``--grid`` axes on one config or preset (no sweep file), described by its base, axes and seeds."""
    axes = tuple(grid_axis(g) for g in grid)
    names = [a.name for a in axes]
    if len(set(names)) != len(names):
        raise ConfigError(f"--grid names a key twice: {names}; list all of its values in one --grid")
    axes = tuple(grid_axis(g, short) for g, short in zip(grid, short_keys(names)))
    seeds = validate_seeds(list(seeds), "--seeds")
    return SweepSpec(name=name, base=base, description=grid_description(base, axes, seeds), seeds=seeds, axes=axes)


def grid_description(base: str, axes: Sequence[Axis], seeds: Sequence[int]) -> str:
    """``Grid on synthetic-fedprox: algorithm.mu ∈ {0, 0.01} × data.partition ∈ {iid, dirichlet}; seeds 0, 1.``"""
    grid = " × ".join(f"{a.name} ∈ {{{', '.join(v.label.split('=', 1)[1] for v in a.values)}}}" for a in axes)
    seed_text = f"seed{'s' if len(seeds) != 1 else ''} {', '.join(map(str, seeds))}"
    return f"Grid on {base}: {grid}; {seed_text}." if axes else f"{base}, {seed_text}."


# ---------------------------------------------------------------- planning


_SPELLED_OUT = {"%": "pct", "μ": "mu", "α": "alpha", "β": "beta", "γ": "gamma", "λ": "lambda", "η": "eta"}


def slug(label: str) -> str:
    """A directory name for a label: ``"Dirichlet 0.3, 10%"`` -> ``"dirichlet-0.3-10pct"``."""
    text = label.lower()
    for symbol, word in _SPELLED_OUT.items():
        text = text.replace(symbol, word)
    text = re.sub(r"[^a-z0-9.]+", "-", text).strip("-.")
    return text or "x"


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


def run_status(run_dir: Path, rounds: int) -> RunStatus:
    """Where a planned run stands, from the files its run directory holds."""
    from driftlab.experiments.runner import read_run_info

    if (run_dir / FAILURE_FILE).exists():
        return "failed"
    info = read_run_info(run_dir)
    if info is None:
        return "interrupted" if (run_dir / "metrics.jsonl").exists() else "pending"
    status = info.get("status")
    if status == "complete" and info.get("rounds_done") == rounds:
        return "complete"
    if status == "complete":
        return "interrupted"  # finished a shorter run; `rounds` was raised since, so it resumes
    if status in ("diverged", "failed"):
        return status
    return "interrupted"  # running (killed without a chance to say so) or interrupted


# ---------------------------------------------------------------- running


def _start_worker(
    run_dir: Path, config: dict[str, Any], resume: bool, threads: int, executor: dict[str, Any] | None = None, cwd: str | None = None
) -> subprocess.Popen:
    """A fresh interpreter per run: nothing of the caller's script is re-imported (as multiprocessing's spawn would),
    and it shares the terminal's process group, so Ctrl-C reaches it and it checkpoints.

    ``config`` is the resolved config table; ``executor`` (job id, log paths) goes into the run's run.json;
    ``cwd`` is where relative paths of the config (data.root) are read from: the sweep's working directory.
    """
    arguments = {"run_dir": str(run_dir), "config": config, "resume": resume, "threads": threads, "parent": os.getpid()}
    if executor:
        arguments["executor"] = executor
    arguments = json.dumps(arguments)
    return subprocess.Popen([sys.executable, "-c", "import sys; from driftlab.experiments.sweep import worker_main; worker_main(sys.argv[1])", arguments], cwd=cwd)


# Exit codes of a run's process; a run killed by a signal shows as minus the signal's number.
EXIT_COMPLETE, EXIT_FAILED, EXIT_DIVERGED, EXIT_BUSY, EXIT_INTERRUPTED = 0, 1, 3, 4, 130


def _worker(run_dir: str, config_table: dict[str, Any], resume: bool, threads: int, run_info: dict[str, Any]) -> None:
    """Child process: one run; exits with EXIT_COMPLETE, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_BUSY (another process
    holds the run directory: nothing written) or EXIT_FAILED (see failure.txt)."""
    import torch

    from driftlab.experiments.runner import RunDirectoryBusy, run

    torch.set_num_threads(threads)
    signal.signal(signal.SIGTERM, _stop_at_first_termination)
    out = Path(run_dir)
    try:
        # The plugins the config records are imported here: this is a fresh interpreter.
        run(config_from_record(config_table), out, resume=resume, run_info=run_info)
    except FloatingPointError:
        sys.exit(EXIT_DIVERGED)  # run.json holds the message
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except RunDirectoryBusy as error:
        print(f"driftlab: {error}", file=sys.stderr)
        sys.exit(EXIT_BUSY)  # the directory is another process's: write nothing into it
    except BaseException as error:  # noqa: BLE001 - any failure is recorded for the sweep and the user
        out.mkdir(parents=True, exist_ok=True)
        detail = str(error) if isinstance(error, ConfigError) else traceback.format_exc()
        (out / FAILURE_FILE).write_text(f"{type(error).__name__}: {error}\n\n{detail}")
        sys.exit(EXIT_FAILED)


def _stop_at_first_termination(signum, frame):  # noqa: ARG001
    """SIGTERM: stop the run (it checkpoints, then exits); later ones are ignored so they cannot cut the checkpoint short.

    A sweep killed outright sends several: the parent-death signal comes again as each of the
    sweep's threads in turn exits and the run is handed to the next.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"terminated by signal {signum}")


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Make this run's process stop (SIGTERM: checkpoint, then exit) when the sweep that started it dies.

    Without this, a sweep killed with SIGKILL leaves its runs going, and the next sweep on the directory
    would start a second writer on each. Linux delivers SIGTERM on the parent's death (prctl); elsewhere
    a daemon thread watches for this process being handed to another parent.
    """
    first_parent = os.getppid()  # `parent`, unless sys.executable is a wrapper that forks
    if not _ask_for_parent_death_signal():
        import threading

        def watch() -> None:
            while os.getppid() == first_parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="driftlab-parent-watch", daemon=True).start()
    if first_parent != parent and process_gone(parent):  # the sweep died before the request above took effect
        sys.exit(EXIT_INTERRUPTED)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting to be reaped has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return Path("/proc/self").exists()  # no /proc at all (macOS): os.kill said it lives
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _ask_for_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def run_directory_holder(run_dir: Path) -> int | None:
    """The process id holding ``run_dir``'s lock (0 when it does not say), or None when no live process holds it.

    Only a probe: the lock is released at once. Called under the sweep's own lock, before this sweep starts the run.
    """
    import fcntl

    from driftlab.experiments.runner import LOCK_FILE

    try:
        handle = open(run_dir / LOCK_FILE, "rb")
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            found = re.search(rb"\d+", handle.read(64))
            return int(found.group()) if found else 0
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def run_sweep(
    spec: SweepSpec,
    out_dir: str | Path,
    *,
    jobs: int | None = None,
    scale: str | None = None,
    extra_overrides: Sequence[str] = (),
    retry_diverged: bool = False,
    log: Callable[[str], None] = print,
    executor: ExecutorOptions | None = None,
    threads: int | None = None,
    trackers: Sequence[str] | None = None,
) -> list[RunOutcome]:
    """Run every pending run of ``spec`` on ``executor`` (default: up to ``jobs`` local processes); returns each run's outcome.

    Locally, threads are split between processes (``torch.set_num_threads``), so a
    2-core machine runs two single-threaded runs at once; SLURM jobs and Ray tasks
    use ``threads`` (default: --slurm-cpus, else 1). Ctrl-C or SIGTERM stops every
    run at its last completed round, checkpointed; run the sweep again to resume,
    on any executor.
    """
    from driftlab.executors import ExecutorOptions, check_options

    options = executor or ExecutorOptions()
    if jobs is not None:
        options = dataclasses.replace(options, jobs=jobs)
    if threads is not None and threads < 1:
        raise ConfigError(f"threads per run must be at least 1, got {threads}")
    check_options(options)
    out = Path(out_dir)
    runs = plan(spec, scale, extra_overrides)
    if trackers is not None:  # --log: not an override, so a sweep's runs can be resumed with logging turned on or off
        runs = [dataclasses.replace(r, config=r.config.model_copy(update={"log": tuple(trackers)})) for r in runs]
    from driftlab.experiments.trackers import check_trackers_installed

    check_trackers_installed([name for r in runs for name in r.config.log])  # before any run starts
    document = sweep_document(spec, runs, scale, extra_overrides)
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):
        _check_existing(out, document)
        for r in runs:
            check_run_directory(out / r.dir, r.config)
        _write_json(out / SWEEP_FILE, document)
        return _run_planned(spec, out, runs, options, threads, retry_diverged, log)


JOBS_FILE = "jobs.json"  # the sweep's record of what it submitted to SLURM or Ray: run directory -> job id, log paths


def _run_planned(
    spec: SweepSpec,
    out: Path,
    runs: list[PlannedRun],
    options: ExecutorOptions,
    threads: int | None,
    retry_diverged: bool,
    log: Callable[[str], None],
) -> list[RunOutcome]:
    from driftlab.executors import Events, RunTask, TaskResult, execute

    outcomes: dict[str, RunOutcome] = {}
    todo: list[PlannedRun] = []
    for r in runs:
        status = run_status(out / r.dir, r.config.rounds)
        if status == "complete" or (status == "diverged" and not retry_diverged):
            outcomes[r.dir] = RunOutcome(r, status, _message(out / r.dir))
        else:
            todo.append(r)
    skipped = len(runs) - len(todo)
    if options.name == "local":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # the cores this process may use
        jobs = max(1, min(options.jobs or cores, max(len(todo), 1)))
        threads = threads or max(1, cores // jobs)
        options = dataclasses.replace(options, jobs=jobs)
        log(f"sweep {spec.name}: {len(runs)} runs, {skipped} already finished, {len(todo)} to run in {jobs} process(es) x {threads} thread(s)")
    else:
        threads = threads or (options.slurm_cpus if options.name == "slurm" else None) or 1
        log(f"sweep {spec.name}: {len(runs)} runs, {skipped} already finished, {len(todo)} to run as {options.name} jobs x {threads} thread(s)")

    by_key = {r.dir: r for r in todo}
    done = skipped
    submitted: dict[str, Any] = {}

    def started(task: RunTask, resume: bool, job: dict[str, Any]) -> None:
        if job.get("job_id"):
            submitted[task.key] = job
            _write_json(out / JOBS_FILE, {"executor": options.name, "runs": submitted})
            log(f"  submit  {_name(by_key[task.key])}  (job {job['job_id']})" + ("  (resuming)" if resume else ""))
        else:
            log(f"  start  {_name(by_key[task.key])}" + ("  (resuming)" if resume else ""))

    def finished(result: TaskResult) -> None:
        nonlocal done
        r = by_key[result.task.key]
        done += 1
        if not result.started:
            outcomes[r.dir] = RunOutcome(r, "running", _elsewhere(result.holder))
            log(f"  running  {_name(r)}  [{done}/{len(runs)}]  {outcomes[r.dir].message}")
            return
        status = _status_from_exit(result.exit_code)
        message = _elsewhere(run_directory_holder(out / r.dir) or 0) if status == "running" else _message(out / r.dir)
        outcome = RunOutcome(r, status, message or result.job.get("error", "") or _exit_message(result.exit_code), result.seconds)
        outcomes[r.dir] = outcome
        log(f"  {status:<8s} {_name(r)}  [{done}/{len(runs)}, {_duration(outcome.seconds)}]" + (f"  {outcome.message}" if outcome.message else ""))

    def interrupted() -> None:
        log("sweep interrupted: stopping runs at their last completed round (checkpointed); run the same command again to resume")

    local = options.name == "local"
    tasks = [RunTask(r.dir, out / r.dir if local else (out / r.dir).absolute(), r.config.to_dict(), threads, _name(r), os.getcwd()) for r in todo]
    previous = _read_jobs(out)
    if previous and not local:
        submitted.update(previous.get("runs", {}))
    execute(tasks, options, Events(started, finished, interrupted))
    return [outcomes[r.dir] for r in runs if r.dir in outcomes]


def _read_jobs(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / JOBS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@contextlib.contextmanager
def _exclusive(out: Path):
    """One sweep process per directory: a second one would run the same runs into the same files."""
    import fcntl

    handle = open(out / ".sweep.lock", "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another `driftlab sweep` is running on {out}; wait for it to finish (or stop it) first") from None
        yield
    finally:
        handle.close()


def check_run_directory(run_dir: Path, config: ExperimentConfig) -> None:
    """Refuse to count or continue a run directory made from another configuration, or run past the planned rounds."""
    from driftlab.experiments.runner import CONFIG_FILE, read_run_info

    stored = run_dir / CONFIG_FILE
    if not stored.exists():
        return
    try:
        previous = config_from_record(json.loads(stored.read_text()))
    except ConfigError:
        raise
    except (json.JSONDecodeError, ValueError) as error:
        raise ConfigError(f"{stored} is not a valid run configuration ({error}); delete {run_dir} to run it again") from None
    if previous.fingerprint() != config.fingerprint():
        raise ConfigError(
            f"{run_dir} holds a run of another configuration than the sweep now plans (its base or overrides changed); "
            "choose another --out directory, or delete that run directory to run it again"
        )
    done = (read_run_info(run_dir) or {}).get("rounds_done", 0)
    if done > config.rounds:
        raise ConfigError(
            f"{run_dir} has {done} rounds done, more than rounds={config.rounds}; raise rounds to at least {done} "
            "or choose another --out directory (a sweep extends runs, it never shortens them)"
        )


def _check_existing(out: Path, document: dict[str, Any]) -> None:
    path = out / SWEEP_FILE
    if not path.exists():
        return
    try:
        previous = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error}); delete it to re-plan the sweep (run directories are kept)") from None
    for key in ("name", "scale"):
        if previous.get(key) != document[key]:
            raise ConfigError(
                f"{out} holds sweep {previous.get('name')!r} at scale {previous.get('scale')!r}, not {document['name']!r} at scale "
                f"{document['scale']!r}; choose another --out directory"
            )
    planned = {r["dir"]: r["overrides"] for r in document["runs"]}
    for r in previous.get("runs", []):
        before, now = _without_rounds(r.get("overrides", [])), _without_rounds(planned.get(r["dir"], []))
        if r["dir"] in planned and before != now:
            raise ConfigError(
                f"{out}/{r['dir']} was run with overrides {r.get('overrides')} but the sweep now gives it {planned[r['dir']]}; "
                "only rounds may change when continuing a sweep; choose another --out directory"
            )


def _without_rounds(overrides: Sequence[str]) -> list[str]:
    return [o for o in overrides if not o.replace(" ", "").startswith("rounds=")]


def _elsewhere(pid: int) -> str:
    who = f"pid {pid}" if pid else "another process"
    return f"running elsewhere ({who} holds its directory); run the sweep again once that process has ended"


def _exit_message(code: int | None) -> str:
    if code is not None and code < 0 and code not in (-signal.SIGTERM, -signal.SIGINT):
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"the run's process was killed by {name} (out of memory?); run the sweep again to resume it from its checkpoint"
    if code not in (EXIT_COMPLETE, EXIT_DIVERGED, EXIT_BUSY, EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT):
        return f"the run's process exited with code {code} before it could record why; its error output is above"
    return ""


def _status_from_exit(code: int | None) -> RunStatus:
    statuses: dict[int | None, RunStatus] = {
        EXIT_COMPLETE: "complete",
        EXIT_DIVERGED: "diverged",
        EXIT_BUSY: "running",
        EXIT_INTERRUPTED: "interrupted",
        -signal.SIGTERM: "interrupted",
        -signal.SIGINT: "interrupted",
    }
    return statuses.get(code, "failed")


def _message(run_dir: Path) -> str:
    from driftlab.experiments.runner import read_run_info

    failure = run_dir / FAILURE_FILE
    if failure.exists():
        return failure.read_text().splitlines()[0] + f"  (details: {failure})"
    info = read_run_info(run_dir) or {}
    return info.get("message", "") if info.get("status") in ("diverged", "failed") else ""


def _name(r: PlannedRun) -> str:
    return " / ".join(part for part in (r.setting, r.method, f"seed {r.seed}") if part)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def _write_json(path: Path, content: dict[str, Any]) -> None:
    from driftlab.simulation.checkpoint import write_atomically

    text = json.dumps(content, indent=2) + "\n"
    write_atomically(path, lambda tmp: tmp.write_text(text))


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


__all__ = [
    "Axis",
    "AxisValue",
    "PlannedRun",
    "RunOutcome",
    "Scale",
    "SweepSpec",
    "grid_axis",
    "is_sweep_source",
    "load_sweep",
    "plan",
    "run_status",
    "run_sweep",
    "sweep_from_config",
    "sweep_names",
]


def worker_main(arguments: str) -> None:
    """Entry point of a run's interpreter (see ``_start_worker``)."""
    parsed = json.loads(arguments)
    die_with_parent(parsed["parent"])
    if parsed.get("executor"):
        if parsed["executor"].get("executor") == "slurm" and hasattr(signal, "SIGUSR2"):
            # SLURM's pre-emption warning (submitit's USR2) may reach every process of the job, and would kill
            # this one outright; the job's own process handles it by stopping this run (SIGTERM: checkpoint, exit).
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    run_info = {"executor": parsed["executor"]} if parsed.get("executor") else {}
    _worker(parsed["run_dir"], parsed["config"], parsed["resume"], parsed["threads"], run_info)
