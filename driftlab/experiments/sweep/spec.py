"""Sweep files: reading and validating them, the shipped sweeps, and sweeps made from ``--grid`` on a config.

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

An axis with ``role = "tuned"`` is a grid each method is tuned over rather than a row of its own (FedProx's μ,
FedDyn's α, a learning rate): its runs live under their method, ``runs/<setting>/<method>/<tuned value>/seed-<s>``,
and the report picks, per setting and method, the value best on the clients' validation rows
(``driftlab.experiments.report.tuning``), never on test data. Tuned runs need ``data.validation_fraction``; the
sweep says how a value is scored::

    tuning_metric = "validation_accuracy"   # or "validation_loss", or any key of the runs' records
    tuning_rule = "final"                   # "final", "best" or "rounds_to:0.8" (over the evaluated rounds)
    halving = { first = 10, eta = 3 }       # optional: successive halving of the tuned values (``execution``)

    [[axes]]
    name = "mu"
    role = "tuned"
    methods = ["FedProx"]                   # optional: the method values whose runs it tunes (absent: every method's)
    values = [{ label = "μ=0.01", set = ["algorithm.mu=0.01"] }, { label = "μ=0.1", set = ["algorithm.mu=0.1"] }]

A tuned axis with ``methods`` (labels of values of the method axes) tunes only the runs of those methods: FedDyn's α
or FedProx's μ is no hyper-parameter of FedAvg, whose runs are planned once, untuned (``runs/<setting>/<method>/seed-<s>``,
no pick). A run is tuned over the product of the tuned axes that apply to its method.

Overrides apply in order: ``overrides``, the scale's overrides, the axes' ``set``
(each followed by its ``at_scale`` entry for the chosen scale) in axis order, then
the command line's ``key=value``; the seed comes last (``driftlab.experiments.sweep.planning``).
``LABEL:key=value`` in ``overrides`` or on the command line applies to the runs of the
axis value labelled LABEL only.

A sweep without a file, ``--grid client.lr=[0.1, 0.2]`` on a config, labels its
values by the key's last part (``lr=0.1``; more of it where two keys end alike)
and is described by its base, axes and seeds.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Sequence

from driftlab.errors import ConfigError
from driftlab.experiments.config import MAX_CONFIG_BYTES, check_toml_shape, parse_override, parse_toml, read_config_text
from driftlab.experiments.config.toml_writer import toml_string, toml_value
from driftlab.experiments.report.tuning import Tuning, tuning_from_keys
from driftlab.experiments.sweep.directory import slug
from driftlab.experiments.sweep.shipped import SWEEP_PACKAGE, sweep_names
from driftlab.plugins import did_you_mean, resolve_plugin

Role = Literal["setting", "method", "tuned"]
ROLES = ("setting", "method", "tuned")

# Keys that change how a method computes (rows of a comparison) rather than the problem it solves.
METHOD_SECTIONS = ("algorithm", "client", "server", "compression")


@dataclass(frozen=True)
class AxisValue:
    label: str
    set: tuple[str, ...]
    at_scale: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (scale name, extra overrides) for one variant at one scale
    dir_name: str = (
        ""  # its part of the run directory; empty: slug(label) (sweep files, so their directories never move)
    )

    def assignments(self, scale: str | None) -> tuple[str, ...]:
        return self.set + dict(self.at_scale).get(scale, ())


@dataclass(frozen=True)
class Axis:
    name: str
    role: Role
    values: tuple[AxisValue, ...]
    methods: tuple[str, ...] | None = None  # a tuned axis's methods (method value labels); None: every method's runs

    def applies_to(self, method_labels: Sequence[str]) -> bool:
        """Whether this axis varies a run whose method values are labelled ``method_labels`` (a run of any method
        when the axis names no ``methods``; with several method axes, a run one of whose method values it names)."""
        return self.methods is None or any(label in self.methods for label in method_labels)


@dataclass(frozen=True)
class Scale:
    overrides: tuple[str, ...] = ()
    seeds: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Halving:
    """Successive halving of a tuned axis's values: all run to round ``first``, the best ⌈n/eta⌉ go on to
    ``first·eta``, then ``first·eta²``, ..., the last ones to the sweep's full rounds (``execution``)."""

    first: int
    eta: int = 3

    def rungs(self, rounds: int) -> list[int]:
        """The rounds at which values are compared, ending with ``rounds`` itself: first, first·eta, ... < rounds."""
        rungs, r = [], self.first
        while r < rounds:
            rungs.append(r)
            r *= self.eta
        return [*rungs, rounds]


HALVING_FORM = "R:ETA, e.g. --halving 10:3 (all tuned values to round 10, the best third on to 30, ...), or off"


def parse_halving(text: str, origin: str = "--halving") -> Halving | None:
    """``"10:3"`` -> Halving(10, 3); ``"off"`` -> None (no halving, even where the sweep file asks for it)."""
    if text.strip().lower() == "off":
        return None
    first, sep, eta = text.partition(":")
    try:
        values = int(first), int(eta) if sep else 3
    except ValueError:
        raise ConfigError(f"{origin} {text!r}: write {HALVING_FORM}") from None
    return _halving(*values, origin=origin)


def _halving(first: Any, eta: Any, origin: str) -> Halving:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (first, eta)) or first < 1 or eta < 2:
        raise ConfigError(
            f"{origin}: halving needs a first round R >= 1 and eta >= 2 (integers), got first={first!r}, eta={eta!r}; write {HALVING_FORM}"
        )
    return Halving(first, eta)


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
    plugins: tuple[
        str, ...
    ] = ()  # imported for every run, after the base config's own (absolute paths or module names)
    tuning: Tuning | None = None  # how tuned values are scored on validation; set when an axis is tuned
    halving: Halving | None = None  # successive halving over the tuned values (None: every run to the full rounds)

    @property
    def tuned_axes(self) -> tuple[Axis, ...]:
        return tuple(axis for axis in self.axes if axis.role == "tuned")


# ---------------------------------------------------------------- reading sweep files


def is_sweep_source(source: str | Path) -> bool:
    """Whether ``source`` names a sweep (a shipped sweep or a TOML file with ``base``/``[[axes]]``) rather than a config."""
    if str(source) in sweep_names():
        return True
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".toml":
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return False  # load_config refuses it with the reason
        try:
            table = parse_toml(read_config_text(path), str(path))
        except ConfigError:
            return False  # load_config refuses it with the reason
        # a config file may build on a `base` too; a sweep file holds nothing but sweep keys
        return "axes" in table or ("base" in table and set(table) <= _TOP_KEYS)
    return False


def load_sweep(source: str | Path) -> SweepSpec:
    """Read a sweep file or a shipped sweep preset, with errors that name the key at fault."""
    path = Path(source)
    if path.is_file():
        text, origin, folder, name = read_config_text(path), str(path), path.parent, path.stem
    elif str(source) in sweep_names():
        text, origin, folder, name = (
            resources.files(SWEEP_PACKAGE).joinpath(f"{source}.toml").read_text(),
            f"sweep {source}",
            None,
            str(source),
        )
    else:
        raise ConfigError(
            f"{source!r} is neither a sweep file nor a shipped sweep; shipped sweeps: {', '.join(sweep_names())}"
        )
    return sweep_from_table(parse_toml(text, origin), origin, name, folder)


_TOP_KEYS = {
    "description",
    "base",
    "plugins",
    "overrides",
    "seeds",
    "targets",
    "steps_reference",
    "axes",
    "scales",
    "name",
    "tuning_metric",
    "tuning_rule",
    "halving",
}


def sweep_from_table(table: dict[str, Any], origin: str, name: str, folder: Path | None = None) -> SweepSpec:
    unknown = sorted(set(table) - _TOP_KEYS)
    if unknown:
        raise ConfigError(
            f"{origin}: unknown key(s) {', '.join(unknown)}; a sweep file has {', '.join(sorted(_TOP_KEYS))}"
        )
    base = table.get("base")
    if not isinstance(base, str) or not base:
        raise ConfigError(
            f'{origin}: `base` must name the config every run starts from (a preset such as "mnist-feddyn" or a .toml file)'
        )
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
                    raise ConfigError(
                        f"{origin}: axis {axis.name}, value {value.label!r}: at_scale names {scale_name!r}, which is not under [scales]"
                    )
    targets = tuple(_list(table, "targets", origin, (int, float)))
    for target in targets:
        if not 0 < target <= 1:
            raise ConfigError(f"{origin}: target accuracies are fractions in (0, 1], got {target}")
    reference = table.get("steps_reference")
    if reference is not None and reference not in {v.label for a in axes if a.role == "method" for v in a.values}:
        raise ConfigError(
            f'{origin}: steps_reference={reference!r} is not a method label of any axis with role = "method"'
        )
    plugins = tuple(resolve_plugin(plugin, folder) for plugin in _list(table, "plugins", origin, str))
    if not all(plugins):
        raise ConfigError(f"{origin}: `plugins` lists module names or paths of .py files, not empty strings")
    _check_methods(axes, origin)
    tuning, halving = _tuning(table, axes, origin)
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
        tuning=tuning,
        halving=halving,
    )


def _tuning(table: dict[str, Any], axes: Sequence[Axis], origin: str) -> tuple[Tuning | None, Halving | None]:
    """The sweep's tuning keys, refused when no axis is tuned (they would choose nothing) or when misspelt."""
    given = [key for key in ("tuning_metric", "tuning_rule", "halving") if key in table]
    if not any(axis.role == "tuned" for axis in axes):
        if given:
            raise ConfigError(
                f'{origin}: {", ".join(given)} applies to tuned axes, and no axis has role = "tuned"; mark the axis to tune'
            )
        return None, None
    for axis in axes:
        if axis.role == "tuned" and len(axis.values) < 2:
            raise ConfigError(
                f"{origin}: tuned axis {axis.name!r} has one value ({axis.values[0].label!r}), so there is nothing to pick; "
                "give it at least two values, or move its setting into `overrides`"
            )
    tuning = tuning_from_keys(table.get("tuning_metric"), table.get("tuning_rule"), origin)
    raw = table.get("halving")
    if raw is None:
        return tuning, None
    if not isinstance(raw, dict) or set(raw) - {"first", "eta"} or "first" not in raw:
        raise ConfigError(f"{origin}: `halving` is a table {{ first = R, eta = 3 }} (eta defaults to 3), got {raw!r}")
    return tuning, _halving(raw["first"], raw.get("eta", 3), f"{origin}: halving")


def _check_methods(axes: Sequence[Axis], origin: str) -> None:
    """An axis's ``methods`` names method values, and only a tuned axis has one (a setting or a method is no
    hyper-parameter that one method has and another has not)."""
    labels = [value.label for axis in axes if axis.role == "method" for value in axis.values]
    for axis in axes:
        if axis.methods is None:
            continue
        if axis.role != "tuned":
            raise ConfigError(
                f"{origin}: axis {axis.name!r} has role = {axis.role!r} and `methods`; `methods` says which methods a tuned axis "
                f'tunes, so mark the axis role = "tuned" or remove `methods`'
            )
        for method in axis.methods:
            if method in labels:
                continue
            if not labels:
                raise ConfigError(
                    f"{origin}: tuned axis {axis.name!r} lists methods = {list(axis.methods)!r}, and the sweep has no axis with "
                    'role = "method" whose values they could name; add the method axis, or remove `methods` to tune every run'
                )
            guess = did_you_mean(method, labels)
            raise ConfigError(
                f"{origin}: tuned axis {axis.name!r}: methods lists {method!r}, which is no value of the method axes"
                f"{f' (did you mean {guess!r}?)' if guess else ''}; their labels: {', '.join(repr(label) for label in labels)}"
            )


def _list(table: dict[str, Any], key: str, origin: str, kind: type | tuple[type, ...]) -> list[Any]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        kinds = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{origin}: `{key}` must be a list of {kinds} values, got {value!r}")
    return value


def validate_seeds(value: Any, origin: str) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value)
    ):
        raise ConfigError(f"{origin}: `seeds` must be a non-empty list of non-negative integers, got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{origin}: `seeds` lists a seed twice: {value!r}")
    return tuple(value)


def _axis(raw: dict[str, Any], index: int, origin: str) -> Axis:
    where = f"{origin}: axes[{index}]"
    keys = {"name", "role", "values", "methods"}
    if set(raw) - keys:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(set(raw) - keys))}; an axis has name, role, values (and methods, if tuned)"
        )
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: `name` must be a non-empty string")
    values = raw.get("values")
    if not isinstance(values, list) or not values:
        raise ConfigError(
            f'{where} ({name}): `values` must be a non-empty list of {{ label = "...", set = ["key=value", ...] }}'
        )
    parsed = []
    for value in values:
        if (
            not isinstance(value, dict)
            or not {"label", "set"} <= set(value) <= {"label", "set", "at_scale"}
            or not isinstance(value["label"], str)
            or not value["label"]
        ):
            raise ConfigError(
                f'{where} ({name}): each value is {{ label = "...", set = ["key=value", ...] }} '
                f'(optionally at_scale = {{ paper = ["key=value", ...] }}), got {value!r}'
            )
        assignments = value["set"]
        if not isinstance(assignments, list) or not all(isinstance(a, str) for a in assignments):
            raise ConfigError(
                f'{where} ({name}), value {value["label"]!r}: `set` must be a list of "key=value" strings'
            )
        at_scale = value.get("at_scale", {})
        if not isinstance(at_scale, dict) or not all(
            isinstance(v, list) and all(isinstance(a, str) for a in v) for v in at_scale.values()
        ):
            raise ConfigError(
                f'{where} ({name}), value {value["label"]!r}: at_scale maps scale names to lists of "key=value" strings'
            )
        for assignment in [*assignments, *(a for v in at_scale.values() for a in v)]:
            parse_override(assignment)
        parsed.append(AxisValue(value["label"], tuple(assignments), tuple((k, tuple(v)) for k, v in at_scale.items())))
    labels = [v.label for v in parsed]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{where} ({name}): labels must differ, got {labels}")
    role = raw.get("role") or _infer_role(v for value in parsed for v in value.set)
    if role not in ROLES:
        raise ConfigError(
            f'{where} ({name}): role must be "setting" or "method" (or "tuned": values each method is tuned over), got {role!r}'
        )
    return Axis(name, role, tuple(parsed), _methods(raw, where, name))


def _methods(raw: dict[str, Any], where: str, name: str) -> tuple[str, ...] | None:
    """An axis's ``methods`` list (None when absent); which labels it may hold is checked once every axis is read."""
    if "methods" not in raw:
        return None
    methods = raw["methods"]
    if not isinstance(methods, list) or not all(isinstance(m, str) and m for m in methods):
        raise ConfigError(
            f'{where} ({name}): `methods` must be a list of method labels, e.g. methods = ["FedDyn"], got {methods!r}'
        )
    if not methods:
        raise ConfigError(
            f"{where} ({name}): `methods` is empty, so the axis would tune no run; list the methods it tunes "
            '(e.g. methods = ["FedDyn"]), or remove `methods` to tune every method'
        )
    if len(set(methods)) != len(methods):
        raise ConfigError(f"{where} ({name}): `methods` lists a method twice: {methods!r}")
    return tuple(methods)


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
        raise ConfigError(
            f"--grid {assignment!r}: {key!r} is not a config key such as client.lr or algorithm.mu; write {GRID_FORMS}"
        )
    literals = _grid_literals(assignment, raw)
    if not literals:
        raise ConfigError(f"--grid {assignment!r} lists no values; write {GRID_FORMS}")
    seen: dict[Any, str] = {}
    for literal in literals:
        value = parse_override(f"{key}={literal}")[1]
        if _canonical(value) in seen:
            same = (
                literal
                if seen[_canonical(value)] == literal
                else f"{seen[_canonical(value)]} and {literal}, one value,"
            )
            raise ConfigError(f"--grid {assignment!r} lists {same} twice; list each value once")
        seen[_canonical(value)] = literal
    short = label_key or key.split(".")[-1]
    axis_values = tuple(_grid_value(key, short, literal) for literal in literals)
    return Axis(key, _infer_role(v.set[0] for v in axis_values), axis_values)


def _grid_literals(assignment: str, raw: str) -> list[str]:
    """The values of one --grid as TOML literals; anything that is not exactly one of the two forms is an error."""
    # bounded before tomllib, which recurses once per bracket: a value nested 50,000 deep is refused here
    check_toml_shape(f"v = {raw}", f"--grid {assignment[:100]!r}")
    if raw.startswith("[") or raw.endswith("]"):
        try:
            values = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(
                f"--grid {assignment!r}: {raw!r} is not a TOML list ({error}); write {GRID_FORMS}"
            ) from None
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
                    f'bracket or quote needs the TOML list form, e.g. KEY=["a,b"]; tables need a sweep file); write {GRID_FORMS}'
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
    """A --grid value as the override text a sweep records (``key=literal``): a bare word as it is, another string
    quoted in ASCII (as sweeps recorded it with ``json.dumps``, so a sweep planned before resumes), else TOML."""
    if isinstance(value, str):
        return value if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", value) else toml_string(value, ascii_only=True)
    if isinstance(value, (bool, int, float)):
        return toml_value(value)
    raise ConfigError(f"--grid values must be numbers, booleans or strings; use a sweep file for {value!r}")


def sweep_from_config(base: str, grid: Sequence[str], seeds: Sequence[int], name: str) -> SweepSpec:
    """A sweep over ``--grid`` axes on one config or preset (no sweep file), described by its base, axes and seeds."""
    axes = tuple(grid_axis(g) for g in grid)
    names = [a.name for a in axes]
    if len(set(names)) != len(names):
        raise ConfigError(f"--grid names a key twice: {names}; list all of its values in one --grid")
    axes = tuple(grid_axis(g, short) for g, short in zip(grid, short_keys(names), strict=True))
    seeds = validate_seeds(list(seeds), "--seeds")
    return SweepSpec(name=name, base=base, description=grid_description(base, axes, seeds), seeds=seeds, axes=axes)


def grid_description(base: str, axes: Sequence[Axis], seeds: Sequence[int]) -> str:
    """``Grid on synthetic-fedprox: algorithm.mu ∈ {0, 0.01} × data.partition ∈ {iid, dirichlet}; seeds 0, 1.``"""
    grid = " × ".join(f"{a.name} ∈ {{{', '.join(v.label.split('=', 1)[1] for v in a.values)}}}" for a in axes)
    seed_text = f"seed{'s' if len(seeds) != 1 else ''} {', '.join(map(str, seeds))}"
    return f"Grid on {base}: {grid}; {seed_text}." if axes else f"{base}, {seed_text}."


__all__ = [
    "GRID_FORMS",
    "HALVING_FORM",
    "METHOD_SECTIONS",
    "ROLES",
    "SWEEP_PACKAGE",
    "Axis",
    "AxisValue",
    "Halving",
    "Role",
    "Scale",
    "SweepSpec",
    "grid_axis",
    "grid_description",
    "is_sweep_source",
    "load_sweep",
    "parse_halving",
    "short_keys",
    "sweep_from_config",
    "sweep_from_table",
    "sweep_names",
    "validate_seeds",
]
