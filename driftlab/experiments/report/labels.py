"""How a report names what it compares: settings and methods of stand-alone runs, from their configs.

A sweep's runs carry the sweep's own labels (``sweep.json``); runs outside a sweep
are labelled here. Algorithm names come from the built-in table
(``driftlab.algorithm_labels``, no torch) or, for a plugin's algorithm, the label its
run.json records (else its name in config.json): a report never imports a run's
plugins (that would run code from the folder it reads). Keys outside a run's identity (trackers, plugins' paths,
checkpointing, memory limits) never enter a label.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from driftlab.algorithm_labels import BUILT_IN_LABELS
from driftlab.experiments.report.run_data import RunData

# FedAvg with another server optimizer is a method of its own in the literature (Reddi et al. 2020, FedOpt).
SERVER_OPTIMIZER_LABELS = {"momentum": "FedAvgM", "adam": "FedAdam", "adagrad": "FedAdagrad", "yogi": "FedYogi"}
# Config keys that do not change what a run computes, or only how long it runs: runs differing only
# in these (and the seed) are seeds of one method.
IGNORED_KEYS = (
    "seed",
    "rounds",
    "device",
    "checkpoint_every",
    "keep_checkpoint",
    "backend",
    "evaluation.target_accuracy",
    "log",
    "plugins",
    "state",
    "memory_budget",
)
# Of those, the keys outside a run's identity (``ExperimentConfig.fingerprint`` ignores them): they never
# tell two runs apart, even two that claim one seed (a run resumed with a tracker on is the same run).
NOT_IDENTITY_KEYS = ("log", "plugins", "state", "memory_budget", "checkpoint_every", "keep_checkpoint", "device")
# Sections that define the problem rather than the method. The model is included: the same
# algorithm on another network is another setting, not another row of the same table. So are the
# clients' devices ([system]: speeds, bandwidths, trace), but not how the server waits for them.
SETTING_SECTIONS = ("data", "model", "sampling", "availability", "system")
# [system] keys that are the server's choice (how long it waits, how many it over-selects): method keys.
SERVER_SYSTEM_KEYS = ("system.deadline", "system.deadline_mode", "system.over_selection")
# Config sections that make a run a variant of its method, and the prefix the papers name that variant by: a run
# with a [privacy] section is the differentially private one (DP-FedAvg, McMahan et al. 2018; DP-SCAFFOLD, Noble
# et al. 2022). Runs of one variant are told apart from each other only, by the section's keys that differ.
VARIANT_PREFIXES = (("privacy", "DP-"),)
# A run with an [asynchronous] section is buffered asynchronous aggregation: FedAvg so run is FedBuff (Nguyen et
# al. 2022); another algorithm is "FedBuff (FedProx)".
ASYNCHRONOUS_SECTION = "asynchronous"
SYSTEM_SECTION = "system"
SAMPLING_SECTION = "sampling"
ASYNCHRONOUS_NAME = "FedBuff"


def flatten_config(config: dict[str, Any]) -> dict[str, Any]:
    """``{"client": {"lr": 0.1}}`` -> ``{"client.lr": 0.1}``; values (schedules, lists) stay whole."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                flat[f"{key}.{sub_key}"] = sub_value
        else:
            flat[key] = value
    return flat


def display_value(value: Any) -> str:
    """A config value as a reader wants it: ``0.01``, ``exponential(initial=10, decay=0.97)``."""
    if isinstance(value, dict) and "kind" in value:
        rest = ", ".join(f"{k}={display_value(v)}" for k, v in value.items() if k != "kind")
        return f"{value['kind']}({rest})"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def algorithm_label(flat: dict[str, Any], recorded: dict[str, str] | None = None) -> str:
    """The method's name as the papers spell it: FedAvg, FedAdam (FedAvg + server Adam), SCAFFOLD, ...

    ``recorded`` maps a plugin's algorithm name to the label its runs' run.json recorded
    (``algorithm_label``); without one a plugin's algorithm keeps its name.
    """
    name = str(flat.get("algorithm.name"))
    optimizer = flat.get("server.optimizer", "sgd")
    if name == "fedavg" and optimizer in SERVER_OPTIMIZER_LABELS:
        return SERVER_OPTIMIZER_LABELS[optimizer]
    label = BUILT_IN_LABELS.get(name) or (recorded or {}).get(name) or name
    return label if optimizer == "sgd" else f"{label} + server {optimizer}"


def variant_prefix(table: dict[str, Any]) -> str:
    """The prefixes (``VARIANT_PREFIXES``) of the variant sections a flattened config has: ``"DP-"``, or ``""``."""
    return "".join(prefix for section, prefix in VARIANT_PREFIXES if any(_listed(key, (section,)) for key in table))


def asynchronous_label(label: str) -> str:
    """An asynchronous run's method name: FedAvg run asynchronously is FedBuff; another method keeps its name inside."""
    return ASYNCHRONOUS_NAME if label == "FedAvg" else f"{ASYNCHRONOUS_NAME} ({label})"


def recorded_labels(runs: Sequence[RunData]) -> dict[str, str]:
    """Algorithm name -> the label run.json recorded for it (the registry entry's, written by the runner)."""
    labels = {}
    for run in runs:
        label = (run.info or {}).get("algorithm_label")
        name = (run.config.get("algorithm") or {}).get("name")
        if isinstance(label, str) and label and isinstance(name, str):
            labels.setdefault(name, label)
    return labels


def _frozen(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _listed(key: str, keys: tuple[str, ...]) -> bool:
    """Whether a flattened key, or the section it belongs to (``state`` for ``state.store``), is in ``keys``."""
    return key in keys or key.split(".")[0] in keys


def _split_keys(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(setting keys, method keys) of a flattened config, without the ignored keys."""
    kept = {k: v for k, v in flat.items() if not _listed(k, IGNORED_KEYS)}
    if any(_listed(key, (ASYNCHRONOUS_SECTION,)) for key in kept):
        # An asynchronous run samples no cohorts (its [sampling] is the refused-otherwise default): those keys
        # say nothing about it, so it shares the setting of synchronous runs whatever their participation.
        kept = {k: v for k, v in kept.items() if not _listed(k, (SAMPLING_SECTION,))}
    setting = {k: v for k, v in kept.items() if k.split(".")[0] in SETTING_SECTIONS and k not in SERVER_SYSTEM_KEYS}
    method = {k: v for k, v in kept.items() if k not in setting}
    return setting, method


def _differing_keys(tables: Sequence[dict[str, Any]]) -> list[str]:
    keys = sorted({key for table in tables for key in table})
    return [key for key in keys if len({_frozen(table.get(key)) for table in tables}) > 1]


def _differing_setting_keys(tables: Sequence[dict[str, Any]], asynchronous: Sequence[bool]) -> list[str]:
    """``_differing_keys`` of setting tables, where an asynchronous run's missing [sampling] keys differ from nothing."""
    synchronous = [table for table, is_asynchronous in zip(tables, asynchronous, strict=True) if not is_asynchronous]
    sampling = set(_differing_keys(synchronous))
    return [key for key in _differing_keys(tables) if not _listed(key, (SAMPLING_SECTION,)) or key in sampling]


def _describe(table: dict[str, Any], keys: Iterable[str]) -> str:
    return ", ".join(f"{key}={display_value(table[key])}" for key in keys if key in table)


def _timed(table: dict[str, Any]) -> bool:
    return any(_listed(key, (SYSTEM_SECTION,)) for key in table)


def _describe_setting(table: dict[str, Any], keys: Sequence[str], tables: Sequence[dict[str, Any]]) -> str:
    """A setting's differing keys; where timed and untimed runs meet, "timed"/"untimed" stands for the [system] keys
    that differ only by being there, and the timed runs are told apart by those that differ among them."""
    if all(_timed(other) for other in tables) or not any(_timed(other) for other in tables):
        return _describe(table, keys)
    if not _timed(table):
        return ", ".join(
            filter(None, ["untimed", _describe(table, [key for key in keys if not _listed(key, (SYSTEM_SECTION,))])])
        )
    among_timed = set(_differing_keys([other for other in tables if _timed(other)]))
    shown = [key for key in keys if not _listed(key, (SYSTEM_SECTION,)) or key in among_timed]
    return ", ".join(filter(None, ["timed", _describe(table, shown)]))


def label_standalone(runs: Sequence[RunData]) -> None:
    """Give runs outside a sweep a setting and a method label from their configs.

    Runs whose configs agree except for the seed (and rounds, device, backend,
    checkpointing) are seeds of one method; two of them that claim one seed are
    told apart by those keys instead: "FedAvg (rounds=50)", "FedAvg (rounds=100)".
    Settings are told apart by the data/model/sampling/availability keys that
    differ between runs (else the data set's name); methods by their algorithm's
    name, plus the keys that differ when several methods share that name:
    "FedProx (algorithm.mu=0)". A run with a ``[privacy]`` section is "DP-" its method
    ("DP-FedAvg"), told apart from other private runs by the privacy keys that differ; one with an
    ``[asynchronous]`` section is "FedBuff" (FedAvg) or "FedBuff (FedProx)". The clients' devices
    (``[system]``) are part of the setting; the server's deadline and over-selection are method keys.
    """
    splits = [_split_keys(flatten_config(run.config)) for run in runs]
    recorded = recorded_labels(runs)
    by_data: dict[str, list[int]] = {}
    for index, (setting, _) in enumerate(splits):
        by_data.setdefault(display_value(setting.get("data.name", "runs")), []).append(index)
    # Runs on different data sets are told apart by the data set's name alone; only runs on one
    # data set need the keys that differ between them ("synthetic, sampling.participation=0.1").
    for data_name, indices in by_data.items():
        tables = [splits[i][0] for i in indices]
        asynchronous = [any(_listed(key, (ASYNCHRONOUS_SECTION,)) for key in splits[i][1]) for i in indices]
        setting_keys = [key for key in _differing_setting_keys(tables, asynchronous) if key != "data.name"]
        for index in indices:
            runs[index].setting = ", ".join(
                filter(None, [data_name, _describe_setting(splits[index][0], setting_keys, tables)])
            )
    by_setting: dict[str, list[int]] = {}
    for index, run in enumerate(runs):
        by_setting.setdefault(run.setting, []).append(index)
    for indices in by_setting.values():
        methods: dict[str, dict[str, Any]] = {}  # frozen method keys -> method keys
        for index in indices:
            methods.setdefault(_frozen(splits[index][1]), splits[index][1])
        by_name: dict[str, list[dict[str, Any]]] = {}
        for table in methods.values():
            # A variant's runs are named apart, so its section's keys tell them apart from each other only.
            name = variant_prefix(table) + algorithm_label(table, recorded)
            if any(_listed(key, (ASYNCHRONOUS_SECTION,)) for key in table):
                name = asynchronous_label(name)
            by_name.setdefault(name, []).append(table)
        labels = {}
        for name, tables in by_name.items():
            differing = _differing_keys(tables)
            for table in tables:
                detail = _describe(table, differing)
                labels[_frozen(table)] = f"{name} ({detail})" if detail else name
        for index in indices:
            runs[index].method = labels[_frozen(splits[index][1])]
    _split_same_seed_runs(runs)


def _split_same_seed_runs(runs: Sequence[RunData]) -> None:
    """Tell apart runs of one method that claim the same seed by the ignored keys they differ in: "FedAvg (rounds=50)".

    Averaging them as seeds would pass off two runs of one seed as two seeds; a
    short and a long run of one config are two rows instead (compared up to the
    shorter one, see ``cut_to_shortest``).
    """
    groups: dict[tuple[str, str], list[RunData]] = {}
    for run in runs:
        groups.setdefault((run.setting, run.method), []).append(run)
    for group in groups.values():
        seeds = [run.seed for run in group]
        if len(set(seeds)) == len(seeds):
            continue
        tables = [
            {
                k: v
                for k, v in flatten_config(run.config).items()
                if _listed(k, IGNORED_KEYS) and k != "seed" and not _listed(k, NOT_IDENTITY_KEYS)
            }
            for run in group
        ]
        differing = _differing_keys(tables)
        for run, table in zip(group, tables, strict=True):
            detail = _describe(table, differing)
            if detail:  # no detail: the same config twice, which ``collect`` refuses
                run.method = f"{run.method[:-1]}, {detail})" if run.method.endswith(")") else f"{run.method} ({detail})"


def method_order(run: RunData) -> tuple:
    """Papers' order: FedAvg (and its server-optimizer variants), FedProx, SCAFFOLD, FedDyn, AdaBest, EFL, then plugins;
    a method's private variants (DP-), then its asynchronous ones (FedBuff), after it."""
    flat = flatten_config(run.config)
    name = flat.get("algorithm.name")
    variants = tuple(any(_listed(key, (section,)) for key in flat) for section, _ in VARIANT_PREFIXES)
    asynchronous = any(_listed(key, (ASYNCHRONOUS_SECTION,)) for key in flat)
    return (_algorithm_rank(name), flat.get("server.optimizer", "sgd") != "sgd", *variants, asynchronous, run.method)


def _algorithm_rank(name: Any) -> int:
    built_in = tuple(BUILT_IN_LABELS)
    return built_in.index(name) if name in built_in else len(built_in)  # plugins after the built-ins, by label
