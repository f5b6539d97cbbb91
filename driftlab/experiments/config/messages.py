"""What the config says to a person: validation problems in words a user can act on (the valid keys, a likely
misspelling, the section or algorithm that owns a key), one message for all of them, and ``describe_keys``."""

from __future__ import annotations

import json
import math
import types
import typing
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from driftlab.algorithms import registry
from driftlab.config_section import short
from driftlab.data import registry as data_sets
from driftlab.data.registry import DEFAULT_DATA_SET
from driftlab.experiments.config.schema import ExperimentConfig, _plain
from driftlab.experiments.config.tagged import DEFAULT_ALGORITHM, DEFAULT_MODEL
from driftlab.models import registry as models
from driftlab.optim import registry as server_optimizers
from driftlab.plugins import did_you_mean

MAX_LISTED_PROBLEMS = 20  # an error message lists this many problems, then says how many more


def format_validation_error(error: ValidationError, table: dict[str, Any]) -> str:
    return format_problems(validation_problems(error, table))


def format_problems(problems: list[tuple[str, str]]) -> str:
    """``invalid configuration:`` and one line per problem, at most ``MAX_LISTED_PROBLEMS`` of them."""
    lines = [f"  {key[:200]}: {message}" for key, message in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more")
    return (
        "invalid configuration:\n"
        + "\n".join(lines)
        + "\nrun `driftlab config` to list every key with its meaning and default"
    )


def validation_problems(error: ValidationError, table: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, message) for each of pydantic's errors, in words a user can act on."""
    problems = []
    for item in error.errors(include_url=False):
        loc = [str(part) for part in item["loc"] if not isinstance(part, int)]
        key = ".".join(loc) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            valid = _valid_keys(loc[:-1], table)
            message = f"unknown key; valid keys here: {', '.join(valid)}{_key_hint(loc, valid, table)}"
        elif (
            "input" in item
            and item["type"] not in ("missing", "unknown_algorithm", "algorithm_table")
            and not item["type"].startswith("unknown_")
            and not item["type"].endswith(("_table", "_key_of_another_kind"))
            and "got " not in message
        ):
            message = f"{message} (got {short(item['input'])})"
        problems.append((key, message))
    return problems


def _key_hint(loc: list[str], valid: list[str], table: dict[str, Any]) -> str:
    """``; did you mean client.lr?`` for a misspelt key, or where else the key exists: another section, or the
    algorithms that own it."""
    name = loc[-1]
    guess = did_you_mean(name, valid)
    if guess is not None:
        return f"; did you mean {'.'.join([*loc[:-1], guess])}?"
    if loc[:-1] == ["algorithm"]:
        owners = algorithms_with_key(name)
        algorithm = table.get("algorithm")
        current = algorithm.get("name", DEFAULT_ALGORITHM) if isinstance(algorithm, dict) else DEFAULT_ALGORITHM
        if owners:
            return f"; {name} is a key of {', '.join(repr(o) for o in owners)}, not of {short(current)}"
    if loc[:-1] == ["server"]:  # a misspelt key of another optimizer (server.betaa with optimizer = "sgd")
        entries = server_optimizers.REGISTRY.entries
        guess = did_you_mean(
            name, sorted({key for entry in entries.values() for key in entry.config_type.model_fields})
        )
        if guess is not None:
            owners = " or ".join(
                repr(other) for other, entry in entries.items() if guess in entry.config_type.model_fields
            )
            return f"; did you mean server.{guess} (a key of server.optimizer = {owners})?"
    elsewhere = [
        f"{section}.{name}"
        for section, model in _sections()
        if section and section != ".".join(loc[:-1]) and name in model.model_fields
    ]
    elsewhere = list(dict.fromkeys(elsewhere))  # [model] is listed once per model
    return f"; did you mean {' or '.join(elsewhere)}?" if elsewhere else ""


def algorithms_with_key(key: str) -> list[str]:
    """The registered algorithms whose ``[algorithm]`` section has ``key`` (``mu``: fedprox)."""
    return [
        name for name, entry in registry.ALGORITHMS.items() if key in entry.config_type.model_fields and key != "name"
    ]


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section type of a field: ``ClientConfig``, or ``PrivacyConfig`` of an optional ``PrivacyConfig | None``."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    sections = [option for option in options if isinstance(option, type) and issubclass(option, BaseModel)]
    return sections[0] if len(sections) == 1 and all(o in (sections[0], type(None)) for o in options) else None


def _sections() -> list[tuple[str, type[BaseModel]]]:
    """(name, model) of every section of a config; the top level is named ""."""
    found = [("", ExperimentConfig)]
    for name, info in ExperimentConfig.model_fields.items():
        section = _section_type(info.annotation)
        if section is not None:
            found.append((name, section))
    found.append(("data", data_sets.DataSection))  # the keys every data set has
    found.append(("server", server_optimizers.ServerOptimizerConfig))  # the key every server optimizer has (lr)
    found += [("model", entry.config_type) for entry in models.MODELS.values()]  # [model]: each model's keys
    return found


def _section_model(path: list[str], table: dict[str, Any]) -> type[BaseModel] | None:
    model: type[BaseModel] = ExperimentConfig
    for part in path:
        if part == "algorithm" and model is ExperimentConfig:
            name = (table.get("algorithm") or {}).get("name", DEFAULT_ALGORITHM)
            entry = registry.ALGORITHMS.get(name) if isinstance(name, str) else None
            model = (entry or registry.ALGORITHMS[DEFAULT_ALGORITHM]).config_type
            continue
        if part == "model" and model is ExperimentConfig:
            section = table.get("model")
            name = section.get("name", DEFAULT_MODEL) if isinstance(section, dict) else DEFAULT_MODEL
            entry = models.MODELS.get(name) if isinstance(name, str) else None
            model = (entry or models.MODELS[DEFAULT_MODEL]).config_type
            continue
        if part == "server" and model is ExperimentConfig:
            name = (table.get("server") or {}).get(server_optimizers.TAG, server_optimizers.DEFAULT)
            entry = server_optimizers.REGISTRY.entries.get(name) if isinstance(name, str) else None
            model = (entry or server_optimizers.REGISTRY.entries[server_optimizers.DEFAULT]).config_type
            continue
        if part == "data" and model is ExperimentConfig:
            name = (table.get("data") or {}).get("name", DEFAULT_DATA_SET)
            entry = data_sets.lookup(name) if isinstance(name, str) else None
            model = (entry or data_sets.lookup(DEFAULT_DATA_SET)).config_type
            continue
        annotation = _section_type(model.model_fields[part].annotation) if part in model.model_fields else None
        if annotation is None:
            return None
        model = annotation
    return model


def _valid_keys(path: list[str], table: dict[str, Any]) -> list[str]:
    model = _section_model(path, table)
    return list(model.model_fields) if model else []


def _describe_server_keys(lines: list[str], section: Callable[..., None]) -> None:
    """The [server] part of ``describe_keys``: server.optimizer and lr, each optimizer's own keys, each stage's."""
    base = server_optimizers.ServerOptimizerConfig
    known = server_optimizers.names()
    lines.append(f"[server] keys of every server optimizer; server.optimizer is one of {', '.join(known)}")
    lines.append(
        f'  server.optimizer = "{server_optimizers.DEFAULT}"\n      which server optimizer: one of {", ".join(known)}'
    )
    section("server.", base)
    optimizers = server_optimizers.REGISTRY
    for name in known:
        entry = optimizers.entries[name]
        own = [key for key in entry.config_type.model_fields if key not in (*base.model_fields, server_optimizers.TAG)]
        origin = (
            f" (plugin {optimizers.plugin_source(entry) or optimizers.module(entry)})"
            if optimizers.is_plugin(entry)
            else ""
        )
        lines.append(f"[server] when server.optimizer = {name!r}: {server_optimizers.label(name)}{origin}")
        section("server.", entry.config_type, own)
    stages = server_optimizers.TRANSFORMATIONS
    for name in stages.names():
        entry = stages.entries[name]
        origin = f" (plugin {stages.plugin_source(entry) or stages.module(entry)})" if stages.is_plugin(entry) else ""
        applies = "; applies server.lr" if entry.applies_lr else ""
        lines.append(f'[[server.transforms]] name = {name!r}: a stage of optimizer = "chain"{applies}{origin}')
        section("server.transforms[].", entry.config_type, [k for k in entry.config_type.model_fields if k != "name"])


def _describe_model_keys(lines: list[str], section: Any) -> None:
    """[model]: the keys every model has once, then each registered model's own keys."""
    lines.append(
        f"[model] keys of every model; model.name is one of {', '.join(models.names())} (default {DEFAULT_MODEL!r})"
    )
    section("model.", models.ModelSection)
    for name in models.names():
        entry = models.MODELS[name]
        own = [
            key
            for key in entry.config_type.model_fields
            if key != "name" and key not in models.ModelSection.model_fields
        ]
        plugin = models.REGISTRY.is_plugin(entry)
        origin = f" (plugin {models.REGISTRY.plugin_source(entry) or models.REGISTRY.module(entry)})" if plugin else ""
        lines.append(f"[model] when model.name = {name!r}{origin}: {entry.description or 'no keys of its own'}")
        if own:
            section("model.", entry.config_type, own)


def describe_keys() -> str:
    """Every key with its type, default and meaning, section by section."""
    lines: list[str] = []

    def section(prefix: str, model: type[BaseModel], only: list[str] | None = None) -> None:
        nested = []
        for name, info in model.model_fields.items():
            annotation = _section_type(info.annotation)
            if annotation is not None:
                nested.append((name, annotation))
                if info.default is not None:
                    continue  # an optional section ([privacy]) is also a key, absent (none) by default
            default = info.get_default(call_default_factory=True)
            if (prefix == "" and isinstance(default, BaseModel)) or (only is not None and name not in only):
                continue  # a tagged section ([algorithm], [data]), listed entry by entry below; or a key listed already
            if info.is_required():
                default_text = "(required)"  # no default: a plugin's key, or a chain stage's such as max_norm
            else:
                default_text = json.dumps(_plain(default)) if default is not None else "none"
                default_text = "inf" if default == math.inf else default_text  # privacy.clip: TOML's inf, not JSON's
            description = info.description or (
                "which algorithm; one of " + ", ".join(registry.names())
                if prefix == "algorithm." and name == "name"
                else ""
            )
            lines.append(f"  {prefix}{name} = {default_text}\n      {description}")
        for name, sub in nested:
            lines.append(f"[{name}]")
            section(f"{name}.", sub)

    lines.append("[top level]")
    section("", ExperimentConfig)
    for name in registry.names():
        entry = registry.ALGORITHMS[name]
        origin = "" if name in registry.BUILT_IN else f" (plugin {registry.plugin_source(entry) or entry.module})"
        lines.append(f"[algorithm] when algorithm.name = {name!r}{origin}")
        section("algorithm.", entry.config_type)
    lines.append(f"[data] keys of every data set; data.name is one of {', '.join(data_sets.REGISTRY.names())}")
    section("data.", data_sets.DataSection)
    for name in data_sets.REGISTRY.names():
        data_set = data_sets.REGISTRY.entries[name]
        if data_set.own_keys:
            plugin = data_sets.REGISTRY.is_plugin(data_set)
            origin = (
                f" (plugin {data_sets.REGISTRY.plugin_source(data_set) or data_sets.REGISTRY.module(data_set)})"
                if plugin
                else ""
            )
            lines.append(f"[data] when data.name = {name!r}{origin}")
            section("data.", data_set.config_type, data_set.own_keys)
    _describe_model_keys(lines, section)
    _describe_server_keys(lines, section)
    lines.append(
        "Rates (client.lr, server.lr) and client.steps take a number or a schedule table: "
        '{kind="exponential", initial=0.1, decay=0.99} or {kind="inverse_time", a=1.0, b=10}.'
    )
    return "\n".join(lines)
