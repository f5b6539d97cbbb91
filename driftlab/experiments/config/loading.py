"""Loading a config: ``section.key=value`` overrides applied to the table read, the config's plugins imported, and
the table validated into an ``ExperimentConfig``, or one ``ConfigError`` listing every problem and where it came
from."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from driftlab.config_section import short
from driftlab.errors import ConfigError
from driftlab.experiments.config.conflicts import (
    _booleans_taken_as_numbers,
    _feature_conflicts,
    _non_finite_numbers,
    _server_step_conflicts,
)
from driftlab.experiments.config.messages import (
    MAX_LISTED_PROBLEMS,
    _section_model,
    format_problems,
    validation_problems,
)
from driftlab.experiments.config.reading import (
    _where_set,
    check_plain_values,
    read_config_source,
    with_function_paths_resolved,
)
from driftlab.experiments.config.schema import ExperimentConfig
from driftlab.experiments.config.tagged import DEFAULT_ALGORITHM, TAGGED_SECTIONS, without_other_kinds_keys
from driftlab.experiments.config.toml_shape import MAX_NESTING, check_toml_shape
from driftlab.plugins import load_plugins, resolve_plugin


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """``"client.lr=0.05"`` -> ``(["client", "lr"], 0.05)``; values are TOML values, bare words are strings."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(
            f"override {short(assignment)} is not of the form section.key=value (for example client.lr=0.05)"
        )
    raw = raw.strip()
    path = key.strip().split(".")
    if len(path) > MAX_NESTING:
        raise ConfigError(
            f"override {key.strip()[:100]}...: a key has at most {MAX_NESTING} dotted parts (section.key), got "
            f"{len(path)}"
        )
    if "[" in raw or "{" in raw:
        check_toml_shape(f"value = {raw}", f"override {key.strip()[:100]}", pieces=False)
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError:
        raise ConfigError(
            f"override {key.strip()[:100]}=...: the value is nested too deeply (at most {MAX_NESTING} levels)"
        ) from None
    if raw.lower() in ("none", "null"):
        value = None
    check_plain_values(value, f"override {key.strip()[:100]}")
    return path, value


def apply_overrides(
    table: dict[str, Any], overrides: list[str], where: Callable[[list[str]], str | None] | None = None
) -> dict[str, Any]:
    """``table`` with each ``section.key=value`` set in turn (a copy).

    ``where(path)`` names the file that set ``table``'s value at ``path`` (``load_config`` passes one), so that
    an override reaching into a value blames the file when the file put a value where a section belongs.
    """
    table = json.loads(json.dumps(table))  # deep copy of plain data
    applied: list[tuple[list[str], str]] = []
    for assignment in overrides:
        path, value = parse_override(assignment)
        node = table
        for depth, part in enumerate(path[:-1], start=1):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(_reaching_into_a_value(assignment, path[:depth], child, table, applied, where))
            node = child
        if path[0] == "algorithm" and path[-1] == "name" and len(path) == 2 and node.get("name") not in (None, value):
            # switching algorithm: the old algorithm's keys do not apply to the new one
            node.clear()
        elif len(path) == 2 and path[0] in TAGGED_SECTIONS and path[1] == TAGGED_SECTIONS[path[0]][1]:
            if node.get(path[1], TAGGED_SECTIONS[path[0]][2]) != value:  # switching model, data set or server optimizer
                kept = without_other_kinds_keys(path[0], node, value)
                node.clear()
                node.update(kept)
        node[path[-1]] = value
        applied.append((path, assignment))
    return table


def _reaching_into_a_value(
    assignment: str,
    prefix: list[str],
    value: Any,
    table: dict[str, Any],
    applied: list[tuple[list[str], str]],
    where: Callable[[list[str]], str | None] | None,
) -> str:
    """The message for an override ``a.b.c=1`` whose ``a.b`` (``prefix``) holds a value, naming whoever is at fault.

    Where the config has a section (``client``, ``model``), the value is the fault, so the file (or the earlier
    override) that set it is named first; where it has a value (``client.lr``), the override reaching into it is.
    """
    dotted = ".".join(prefix)
    # the last override that wrote this value (or a table holding it) set it, else the config it was applied to
    setter = next((f"override {short(done)}" for path, done in reversed(applied) if path == prefix[: len(path)]), None)
    origin = setter or (where(prefix) if where is not None else None) or "the config"
    sections = {
        name: section for name, section in table.items() if isinstance(section, dict)
    }  # `algorithm = 5` has no name to read
    if _section_model(prefix, sections) is not None:
        return (
            f"{origin}: {dotted} = {short(value)}, but {dotted} is a section of keys (override {short(assignment)} "
            f"sets one of them): write [{dotted}] and its keys under it, as `driftlab config` lists them"
        )
    return (
        f"override {short(assignment)}: {dotted} is a value, not a section ({dotted} = {short(value)} from {origin}); "
        f"set {dotted}=... itself"
    )


def load_config(
    source: str | Path | dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> ExperimentConfig:
    """Validate a config file, preset name or table (``None``: all defaults), with overrides applied."""
    if source is None:
        table: dict[str, Any] = {}
    elif isinstance(source, dict):
        check_plain_values(source, "config")
        table = source
    else:
        table = read_config_source(source)
    where = None if source is None or isinstance(source, dict) else (lambda path: _where_set(source, path))
    table = apply_overrides(table, list(overrides), where)
    if where is None or not overrides:
        return validate_config(table)
    # a file and overrides: each problem says which of them gave the key its value
    given = [(parse_override(assignment)[0], assignment) for assignment in overrides]
    return validate_config(table, lambda key: _given_by(key.split("."), given, where))


def _given_by(
    path: list[str], given: list[tuple[list[str], str]], where: Callable[[list[str]], str | None]
) -> str | None:
    """Where the value at ``path`` came from: the last override that set it (or a table holding it), else the file
    that set it and the overrides that set keys inside it."""
    whole = next((assignment for key, assignment in reversed(given) if key == path[: len(key)]), None)
    if whole is not None:
        return f"override {short(whole)}"
    inside = [f"override {short(assignment)}" for key, assignment in given if key[: len(path)] == path]
    return " and ".join(filter(None, [where(path), *inside[:3]])) or None


def validate_config(table: dict[str, Any], given_by: Callable[[str], str | None] | None = None) -> ExperimentConfig:
    """The validated config, or one ``ConfigError`` listing every problem found (the first ``MAX_LISTED_PROBLEMS``).

    The config's ``plugins`` are imported first (a ConfigError naming the one that fails), so
    the algorithms they register validate like the built-ins; paths are recorded absolute.
    ``given_by(key)`` names where a key's value came from (a file's line, an override), added to its problem.
    """
    table = with_function_paths_resolved(with_plugins_loaded(table))
    algorithm = table.get("algorithm")
    if isinstance(algorithm, dict) and "name" not in algorithm:
        # an [algorithm] section without `name` configures the default algorithm
        table = {**table, "algorithm": {"name": DEFAULT_ALGORITHM, **algorithm}}
    problems = _non_finite_numbers(table)
    config = None
    try:
        config = ExperimentConfig.model_validate(table)
    except ValidationError as error:
        flagged = {key for key, _ in problems}
        # a non-finite schedule parameter also fails its schedule: report it once, at the parameter
        problems += [
            (key, message)
            for key, message in validation_problems(error, table)
            if not any(f == key or f.startswith(f"{key}.") for f in flagged)
        ]
    if config is not None and not problems:
        problems = _booleans_taken_as_numbers(table, config) + _server_step_conflicts(config)
        problems += _feature_conflicts(config)
    if problems:
        if given_by is not None:  # for the problems listed only: each may read the config's files again
            for index, (key, message) in enumerate(problems[:MAX_LISTED_PROBLEMS]):
                source = given_by(key)
                problems[index] = (key, f"{message} (from {source})" if source else message)
        raise ConfigError(format_problems(problems))
    return config


def with_plugins_loaded(table: Any) -> Any:
    """``table`` with its ``plugins`` imported and their paths made absolute (relative ones are
    taken from the working directory; a config file's own are resolved against its folder on reading).

    A ``plugins`` value that is not a list of strings (or a table that is not one) is left for validation to report.
    """
    plugins = table.get("plugins") if isinstance(table, dict) else None
    if isinstance(plugins, str) and plugins:
        plugins = [plugins]  # `plugins=my_algorithm.py` on the command line: one plugin
    if not isinstance(plugins, (list, tuple)) or not all(isinstance(p, str) and p for p in plugins):
        return table
    resolved = [resolve_plugin(plugin) for plugin in plugins]
    load_plugins(resolved)
    return {**table, "plugins": resolved}


def config_from_record(table: dict[str, Any]) -> ExperimentConfig:
    """A resolved config as a run recorded it (config.json, a sweep run's table): its plugins imported, then validated.

    Raises pydantic's ValidationError for a table that is not a config, and ConfigError for a plugin that cannot be
    imported.
    """
    return ExperimentConfig.model_validate(with_plugins_loaded(table))
