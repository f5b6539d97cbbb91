"""The experiment configuration: typed, validated before any work, overridable by dotted keys.

A config is a TOML file (or a shipped preset) with a few sections::

    seed = 0
    rounds = 100
    [data]       name = "synthetic", synthetic_alpha = 1.0, ...
    [model]      name = "mlr"
    [algorithm]  name = "fedavg", aggregation = "weighted"   (the rest depends on the algorithm)
    [client]     lr = 0.01, batch_size = 10, epochs = 20, ...
    [server]     optimizer = "sgd", lr = 1.0, ...
    [sampling]   participation = 0.1, mode = "uniform"

and any key can be overridden as ``section.key=value`` (``client.lr=0.05``,
``algorithm.name=fedavg``).  An unknown key, a wrong type or an out-of-range
value raises ``ConfigError`` naming the key and what is allowed; every problem
of a config is reported in one message (the first 20, then how many more).
``describe_keys()`` lists every key with its meaning and default
(``driftlab config``).

An algorithm of your own is imported before validation from the modules a
config names under ``plugins`` (module names, or paths of .py files relative to
the config file) and from the entry-point group ``driftlab.algorithms``
(``driftlab.algorithms.registry``); its ``[algorithm]`` section is then
validated by its registered config type like a built-in's.

A config file may build on a preset or on another file::

    base = "synthetic-fedavg"      # a preset, or a file relative to this file's folder
    rounds = 50
    [client]
    lr = 0.05
    epochs = "none"                # the string "none" removes a key the base sets

Its tables are merged over the base's, key by key (a schedule table, or an
``[algorithm]`` naming another algorithm, replaces the base's whole value);
bases may themselves have a base, and a cycle is an error.

Config files are read defensively: at most ``MAX_CONFIG_BYTES``, UTF-8, nested
at most ``MAX_NESTING`` levels, no TOML dates or times.  Integers refuse
``true``/``false``, numbers must be finite, rates are at most ``MAX_RATE``.
Sizes that depend on the data and the machine (the batch plan, the number of
clients, the model) are checked before any allocation by
``driftlab.experiments.run.compatibility``.

The package, one job a module: ``schema`` (the core sections and ``ExperimentConfig``), ``tagged`` (the sections
named by a registry entry: ``[algorithm]``, ``[data]``, ``[model]``, ``[server]``), ``reading`` (files, presets,
``base`` chains), ``loading`` (overrides, validation, ``load_config``), ``conflicts`` (checks across sections),
``messages`` (problems in words, ``describe_keys``) and ``toml_writer`` (a table as TOML).  The sections of the
optional features live in their packages, each named by its registry entry (``FeatureEntry.section_type``).  Every
name is re-exported here (the sections' through the registry), so ``from driftlab.experiments.config import X`` reads
as it always has.
"""

from __future__ import annotations

import sys
from typing import Any

# Names the module had before it became a package, imported by users of ``driftlab.experiments.config``.
from driftlab.algorithms import registry
from driftlab.config_section import Section as _Section  # noqa: F401 - the old module's name, re-exported
from driftlab.config_section import short as _short  # noqa: F401 - the old module's name, re-exported
from driftlab.data import registry as data_sets
from driftlab.data.registry import DEFAULT_DATA_SET, PARTITIONS
from driftlab.errors import ConfigError
from driftlab.experiments.config.conflicts import (
    UNBOUNDED,
)
from driftlab.experiments.config.conflicts import (
    _booleans_taken_as_numbers as _booleans_taken_as_numbers,
)
from driftlab.experiments.config.conflicts import (
    _feature_conflicts as _feature_conflicts,
)
from driftlab.experiments.config.conflicts import (
    _non_finite_numbers as _non_finite_numbers,
)
from driftlab.experiments.config.conflicts import (
    _server_step_conflicts as _server_step_conflicts,
)
from driftlab.experiments.config.loading import (
    _given_by as _given_by,
)
from driftlab.experiments.config.loading import (
    _reaching_into_a_value as _reaching_into_a_value,
)
from driftlab.experiments.config.loading import (
    apply_overrides,
    config_from_record,
    load_config,
    parse_override,
    validate_config,
    with_plugins_loaded,
)
from driftlab.experiments.config.messages import (
    MAX_LISTED_PROBLEMS,
    algorithms_with_key,
    describe_keys,
    format_problems,
    format_validation_error,
    validation_problems,
)
from driftlab.experiments.config.messages import (
    _describe_model_keys as _describe_model_keys,
)
from driftlab.experiments.config.messages import (
    _describe_server_keys as _describe_server_keys,
)
from driftlab.experiments.config.messages import (
    _key_hint as _key_hint,
)
from driftlab.experiments.config.messages import (
    _section_model as _section_model,
)
from driftlab.experiments.config.messages import (
    _section_type as _section_type,
)
from driftlab.experiments.config.messages import (
    _sections as _sections,
)
from driftlab.experiments.config.messages import (
    _valid_keys as _valid_keys,
)
from driftlab.experiments.config.reading import (
    _ABSENT as _ABSENT,
)
from driftlab.experiments.config.reading import (
    FUNCTION_KEYS,
    MAX_BASE_CHAIN,
    MAX_CONFIG_BYTES,
    check_plain_values,
    merge_tables,
    parse_toml,
    read_config_source,
    read_config_text,
    with_function_paths_resolved,
)
from driftlab.experiments.config.reading import (
    _base_source as _base_source,
)
from driftlab.experiments.config.reading import (
    _line_setting as _line_setting,
)
from driftlab.experiments.config.reading import (
    _read_one as _read_one,
)
from driftlab.experiments.config.reading import (
    _read_with_base as _read_with_base,
)
from driftlab.experiments.config.reading import (
    _replaces_whole as _replaces_whole,
)
from driftlab.experiments.config.reading import (
    _where_set as _where_set,
)
from driftlab.experiments.config.reading import (
    _with_trace_resolved as _with_trace_resolved,
)
from driftlab.experiments.config.schema import (
    MAX_BATCH_SIZE,
    MAX_WIDTH,
    MONITORING_KEYS,
    STOP_METRICS,
    AvailabilityConfig,
    ClientConfig,
    EvaluationConfig,
    ExperimentConfig,
    MembershipEventConfig,
    SamplingConfig,
    StateConfig,
    StopAtConfig,
)
from driftlab.experiments.config.schema import (
    _check_function_reference as _check_function_reference,
)
from driftlab.experiments.config.schema import (
    _plain as _plain,
)
from driftlab.experiments.config.tagged import (
    DEFAULT_ALGORITHM,
    DEFAULT_MODEL,
    LEGACY_FLAT_DEFAULTS,
    TAGGED_SECTIONS,
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    ServerConfig,
    kind_keys,
    legacy_flat_form,
    registered_section,
    unknown_algorithm_message,
    without_other_kinds_keys,
)
from driftlab.experiments.config.tagged import (
    _algorithm_section as _algorithm_section,
)
from driftlab.experiments.config.tagged import (
    _same_value as _same_value,
)
from driftlab.experiments.config.toml_shape import MAX_NESTING, check_toml_shape
from driftlab.experiments.config.toml_writer import to_toml, toml_key, toml_string, toml_value
from driftlab.experiments.sweep.shipped import PRESET_PACKAGE, preset_names
from driftlab.features.registry import FEATURES
from driftlab.models import registry as models
from driftlab.optim import registry as server_optimizers
from driftlab.optim.schedules import MAX_RATE, Count, Rate, is_constant_one
from driftlab.plugins import did_you_mean, load_plugins, resolve_plugin
from driftlab.simulation.round.availability import ClientIds
from driftlab.simulation.state.memory_budget import parse_bytes


def _feature_section_names() -> dict[str, Any]:
    """What the modules of the features' config sections export (each ``FeatureEntry.section_type``'s module's
    ``__all__``: ``CompressionConfig``, ``SystemConfig``, ...), by name: importable from here as before the sections
    moved into the features' packages, found in the registry so that this package names none of them."""
    names: dict[str, Any] = {}
    for entry in FEATURES.values():
        if entry.section_type is not None:
            module = sys.modules[entry.section_type.__module__]
            for name in getattr(module, "__all__", (entry.section_type.__name__,)):
                names[name] = getattr(module, name)
    return names


def __getattr__(name: str) -> Any:
    found = _feature_section_names()
    if name in found:
        return found[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_feature_section_names()})


# The private names imported above (``_Section``, ``_feature_conflicts``, ...) are re-exported too, for the modules
# and tests that import them from here; the features' section types are found in the registry (``__getattr__``).
__all__ = [
    "AlgorithmConfig",
    "AvailabilityConfig",
    "ClientConfig",
    "ClientIds",
    "ConfigError",
    "Count",
    "DEFAULT_ALGORITHM",
    "DEFAULT_DATA_SET",
    "DEFAULT_MODEL",
    "DataConfig",
    "EvaluationConfig",
    "STOP_METRICS",
    "StopAtConfig",
    "ExperimentConfig",
    "FUNCTION_KEYS",
    "LEGACY_FLAT_DEFAULTS",
    "MAX_BASE_CHAIN",
    "MAX_BATCH_SIZE",
    "MAX_CONFIG_BYTES",
    "MAX_LISTED_PROBLEMS",
    "MAX_NESTING",
    "MAX_RATE",
    "MAX_WIDTH",
    "MONITORING_KEYS",
    "MembershipEventConfig",
    "ModelConfig",
    "PARTITIONS",
    "PRESET_PACKAGE",
    "Rate",
    "SamplingConfig",
    "ServerConfig",
    "StateConfig",
    "TAGGED_SECTIONS",
    "UNBOUNDED",
    "algorithms_with_key",
    "apply_overrides",
    "check_plain_values",
    "check_toml_shape",
    "config_from_record",
    "data_sets",
    "describe_keys",
    "did_you_mean",
    "format_problems",
    "format_validation_error",
    "is_constant_one",
    "kind_keys",
    "legacy_flat_form",
    "load_config",
    "load_plugins",
    "merge_tables",
    "models",
    "parse_bytes",
    "parse_override",
    "parse_toml",
    "preset_names",
    "read_config_source",
    "read_config_text",
    "registered_section",
    "registry",
    "resolve_plugin",
    "server_optimizers",
    "to_toml",
    "toml_key",
    "toml_string",
    "toml_value",
    "unknown_algorithm_message",
    "validate_config",
    "validation_problems",
    "with_function_paths_resolved",
    "with_plugins_loaded",
    "without_other_kinds_keys",
    *_feature_section_names(),
]
