"""Reading a config source: a TOML or JSON file or a shipped preset, read defensively, with its ``base`` chain
merged under it, and the paths it names (plugins, ``data.loader``, ``model.loss``, ``system.trace``) made absolute."""

from __future__ import annotations

import datetime
import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from driftlab.config_section import short
from driftlab.errors import ConfigError
from driftlab.experiments.config.tagged import DEFAULT_ALGORITHM, TAGGED_SECTIONS, without_other_kinds_keys
from driftlab.experiments.config.toml_shape import MAX_NESTING, check_toml_shape
from driftlab.experiments.sweep.shipped import PRESET_PACKAGE, preset_names
from driftlab.plugins import did_you_mean, resolve_plugin

MAX_CONFIG_BYTES = 1_000_000  # the largest shipped preset is 2 kB; a megabyte is never a hand-written config
MAX_BASE_CHAIN = 16  # files built on files built on files ...


def read_config_source(source: str | Path) -> dict[str, Any]:
    """The raw table of a TOML (or JSON) file, or of a shipped preset when ``source`` names one,
    with its ``base`` (a preset or another file) merged under it."""
    return _read_with_base(source, chain=())


def _read_with_base(source: str | Path, chain: tuple[str, ...]) -> dict[str, Any]:
    table, origin, identity, folder = _read_one(source)
    if identity in chain:
        cycle = " -> ".join([*chain[chain.index(identity) :], identity])
        raise ConfigError(f"{origin}: its `base` chain comes back to itself ({cycle}); remove one of these `base` keys")
    base = table.pop("base", None)
    if base is None:
        return table
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(
            f'{origin}: `base` must name a preset (such as "synthetic-fedavg") or a config file, got {short(base)}'
        )
    if len(chain) >= MAX_BASE_CHAIN:
        raise ConfigError(
            f"{origin}: more than {MAX_BASE_CHAIN} files built on one another through `base`; flatten some of them"
        )
    base = _base_source(base, folder)
    try:
        under = _read_with_base(base, (*chain, identity))
    except ConfigError as error:
        raise ConfigError(f"{origin}: base {base!r}: {error}") from None
    return merge_tables(under, table)


def _base_source(base: str, folder: Path | None) -> str:
    if folder is not None and not Path(base).is_absolute() and (folder / base).is_file():
        return str(folder / base)  # relative to the file that names it, as in sweep files
    return base


def _where_set(source: str | Path, path: list[str]) -> str | None:
    """Which file of ``source``'s ``base`` chain sets the value at ``path``, as ``FILE: line N`` (the line where
    plainly found).

    The topmost file that sets it: its value is the one merged. Reads the chain again, so only for an error message;
    a base is named as ``_read_with_base`` names it (``top.toml: base 'b.toml': b.toml: line 3``).
    """
    chain = ""
    for _ in range(MAX_BASE_CHAIN + 1):
        try:
            table, origin, _, folder = _read_one(source)
        except ConfigError:
            return None
        node: Any = table
        for part in path:
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is not _ABSENT:
            line = (
                _line_setting(Path(origin).read_text(encoding="utf-8"), path)
                if Path(origin).suffix == ".toml" and Path(origin).is_file()
                else None
            )
            return chain + (origin if line is None else f"{origin}: line {line}")
        base = table.get("base")
        if not isinstance(base, str) or not base.strip():
            return None
        chain += f"{origin}: base {base!r}: "
        source = _base_source(base, folder)
    return None


_ABSENT = object()


def _line_setting(text: str, path: list[str]) -> int | None:
    """The line of a TOML text that plainly sets ``path``: ``client = 5``, ``client.lr = 5``, or ``lr = 5`` under
    ``[client]``."""

    def parts(key: str) -> list[str]:
        return [part.strip().strip("\"'") for part in key.split(".")]

    header: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("["):
            header = parts(stripped.partition("#")[0].strip().strip("[]"))
            if header == path:
                return number
        elif "=" in stripped and header + parts(stripped.partition("=")[0]) == path:
            return number
    return None


def _read_one(source: str | Path) -> tuple[dict[str, Any], str, str, Path | None]:
    """(table, origin for messages, identity for cycle detection, folder that relative bases start from)."""
    path = Path(source)
    if path.is_file():
        origin = str(path)
        text = read_config_text(path)
        identity, folder = str(path.resolve()), path.parent
    elif str(source) in preset_names():
        origin = f"preset {source}"
        text = resources.files(PRESET_PACKAGE).joinpath(f"{source}.toml").read_text()
        identity, folder = origin, None
    else:
        guess = did_you_mean(str(source)[:200], preset_names())
        hint = f" (did you mean {guess!r}?)" if guess else ""
        raise ConfigError(
            f"{str(source)[:200]!r} is neither a config file nor a preset{hint}; presets: {', '.join(preset_names())}"
        )
    if path.is_file() and path.suffix.lower() == ".json":
        # the resolved config a run writes (config.json), so `driftlab run DIR/config.json --out DIR --resume` works
        table = _parsed(json.loads, json.JSONDecodeError, "JSON", text, origin)
        if not isinstance(table, dict):
            raise ConfigError(f"{origin} must hold a JSON object (a table of sections), got {type(table).__name__}")
    else:
        table = parse_toml(text, origin)
    check_plain_values(table, origin)
    plugins = table.get("plugins")
    if folder is not None and isinstance(plugins, (str, list)):
        # relative to this file, wherever the config is loaded from (a plain string is one plugin)
        plugins = [plugins] if isinstance(plugins, str) else plugins
        table["plugins"] = [resolve_plugin(p, folder) if isinstance(p, str) and p else p for p in plugins]
    if folder is not None:
        table = with_function_paths_resolved(table, folder)
    return table, origin, identity, folder


def read_config_text(path: Path) -> str:
    """The file's text, refused before parsing when it is larger than a config can be or not UTF-8."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path} is larger than {MAX_CONFIG_BYTES:,} bytes, far more than a config needs "
            "(the shipped presets are about 1 kB); is it the right file?"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {error.start} is {data[error.start : error.start + 1]!r}); save it as "
            f"UTF-8"
        ) from None


def parse_toml(text: str, origin: str) -> dict[str, Any]:
    """``tomllib.loads(text)``, refused with a ConfigError naming ``origin`` when it is not TOML or not shaped like a
    config (``check_toml_shape``: bounded before ``tomllib`` allocates)."""
    check_toml_shape(text, origin, pieces=False)
    return _parsed(tomllib.loads, tomllib.TOMLDecodeError, "TOML", text, origin)


def _parsed(loads: Callable[[str], Any], syntax_error: type[Exception], language: str, text: str, origin: str) -> Any:
    """``loads(text)``, its syntax errors and a nesting too deep for the parser as ConfigErrors naming ``origin``."""
    try:
        return loads(text)
    except syntax_error as error:
        raise ConfigError(f"{origin} is not valid {language}: {error}") from None
    except RecursionError:
        raise ConfigError(
            f"{origin} is nested too deeply to be a config (a config nests at most {MAX_NESTING} levels)"
        ) from None


def check_plain_values(table: Any, origin: str) -> None:
    """Refuse nesting deeper than ``MAX_NESTING`` and TOML dates/times, naming the key.

    Iterative, so a hostile depth cannot exhaust Python's recursion limit; it runs before
    anything recursive (deep copies, merges, pydantic) sees the table.
    """
    pending: list[tuple[Any, str, int]] = [(table, "", 0)]
    while pending:
        value, key, depth = pending.pop()
        if depth > MAX_NESTING:
            raise ConfigError(
                f"{origin}: {key[:200] or 'the table'} is nested more than {MAX_NESTING} levels deep; "
                "a config is sections of keys, with at most a schedule table or a list of events inside"
            )
        if isinstance(value, dict):
            pending.extend((child, f"{key}.{name}" if key else str(name), depth + 1) for name, child in value.items())
        elif isinstance(value, (list, tuple)):
            pending.extend((child, f"{key}[{index}]", depth + 1) for index, child in enumerate(value))
        elif isinstance(value, (datetime.date, datetime.time)):  # datetime.datetime is a date
            raise ConfigError(
                f"{origin}: {key or 'value'} = {value.isoformat()}: TOML dates and times are not allowed in a config; "
                "write a number or a quoted string"
            )


def merge_tables(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, key by key; the string ``"none"`` in ``top`` removes the key.

    A schedule table (it has ``kind``) and an ``[algorithm]`` naming another algorithm replace the
    base's value whole: mixing two schedules' or two algorithms' keys would only give unknown keys.
    """
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        if isinstance(value, str) and value.strip().lower() == "none":
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(below, dict) and not _replaces_whole(key, below, value):
            if key in TAGGED_SECTIONS:
                tag = TAGGED_SECTIONS[key][1]
                if value.get(tag) not in (None, below.get(tag, TAGGED_SECTIONS[key][2])):
                    below = without_other_kinds_keys(key, below, value[tag])  # another kind: the base's own keys go
            merged[key] = merge_tables(below, value)
        else:
            merged[key] = value
    return merged


def _replaces_whole(key: str, below: dict[str, Any], value: dict[str, Any]) -> bool:
    if "kind" in value or "kind" in below:
        return True
    return key == "algorithm" and value.get("name") not in (None, below.get("name", DEFAULT_ALGORITHM))


FUNCTION_KEYS = (
    ("data", "loader"),
    ("model", "loss"),
)  # "module:function" references, imported when the run needs them


def with_function_paths_resolved(table: Any, folder: Path | None = None) -> Any:
    """``table`` with the file paths of ``data.loader`` and ``model.loss`` made absolute: relative to ``folder``
    (a config file's) like plugins, else to the working directory; module names are kept."""
    if not isinstance(table, dict):
        return table
    resolved = dict(table)
    for section, key in FUNCTION_KEYS:
        values = resolved.get(section)
        reference = values.get(key) if isinstance(values, dict) else None
        if isinstance(reference, str) and ":" in reference:
            source, _, name = reference.rpartition(":")
            if source:
                resolved[section] = {**values, key: f"{resolve_plugin(source, folder)}:{name}"}
    return _with_trace_resolved(resolved, folder)


def _with_trace_resolved(table: dict[str, Any], folder: Path | None) -> dict[str, Any]:
    """``system.trace`` made absolute like a plugin's path: relative to ``folder`` (the config file's) when the file is
    there or not in the working directory, else to the working directory."""
    system = table.get("system")
    trace = system.get("trace") if isinstance(system, dict) else None
    if not isinstance(trace, str) or not trace or Path(trace).expanduser().is_absolute():
        return table
    given = Path(trace).expanduser()
    path = folder / given if folder is not None and ((folder / given).is_file() or not given.is_file()) else given
    return {**table, "system": {**system, "trace": str(path.resolve())}}
