"""A run's features, for assembly: the facts their plans read, which ones a config turns on, the refusal of an
algorithm that lacks what one needs, and what they add to run.json.  ``config`` is an ``ExperimentConfig`` and
``sim`` a ``Simulation``, read by attribute (this package imports nothing from ``driftlab.experiments``)."""

from __future__ import annotations

from typing import Any

from driftlab.errors import ConfigError
from driftlab.features.entry import FeatureEntry, RunFacts
from driftlab.features.registry import FEATURES


def run_facts(
    config: Any, num_clients: int | None = None, tensor_sizes: tuple[int, ...] = (), tensor_names: tuple[str, ...] = ()
) -> RunFacts:
    """The facts a feature's plan reads: ``num_clients`` is the data's N (None: ``config.data.num_clients``);
    ``tensor_sizes`` and ``tensor_names`` the built model's tensors (empty before it is built)."""
    return RunFacts(
        seed=config.seed,
        rounds=config.rounds,
        num_clients=config.data.num_clients if num_clients is None else num_clients,
        sampling_mode=config.sampling.mode,
        participation=config.sampling.participation,
        algorithm=config.algorithm.name,
        tensor_sizes=tuple(int(size) for size in tensor_sizes),
        tensor_names=tuple(tensor_names),
    )


def configured_features(config: Any, facts: RunFacts) -> list[tuple[FeatureEntry, Any]]:
    """The features ``config`` turns on, with their sections, in the registry's order."""
    found = []
    for entry in FEATURES.values():
        section = entry.section(config)
        if section is not None and entry.enabled(section, facts):
            found.append((entry, section))
    return found


def check_feature(entry: FeatureEntry, algorithm: Any) -> None:
    """ConfigError when ``algorithm`` lacks what the feature needs: the one refusal template, naming both and a fix."""
    problem = algorithm.refusal(entry.requirements)
    if problem is not None:
        raise ConfigError(problem)


def feature_plan(config: Any, name: str, num_clients: int | None = None) -> Any:
    """The plan of feature ``name`` (``FEATURES[name].plan``) for ``config`` on ``num_clients`` clients (the data's N;
    None: ``config.data.num_clients``); None when ``config`` does not turn the feature on."""
    facts = run_facts(config, num_clients)
    on = [(entry, section) for entry, section in configured_features(config, facts) if entry.name == name]
    return next((entry.plan(section, facts) for entry, section in on), None)


def features_run_info(config: Any, sim: Any, only: str | None = None) -> dict[str, Any]:
    """What the features ``config`` turns on add to run.json (each entry's ``run_info``, in the registry's order;
    ``only``: that feature's alone, {} when it is off)."""
    facts = run_facts(config, sim.data.num_clients)
    info: dict[str, Any] = {}
    for entry, section in configured_features(config, facts):
        if only in (None, entry.name):  # the plan the run used, the one sim holds (FeatureEntry.used_plan), else again
            plan = entry.used_plan(sim, section) if entry.used_plan is not None else entry.plan(section, facts)
            info.update(entry.run_info(plan))
    return info


def feature_run_info(config: Any, name: str, num_clients: int | None = None) -> dict[str, Any]:
    """What feature ``name`` adds to run.json for ``config`` on ``num_clients`` clients, planned from the config
    alone (None: ``config.data.num_clients``); {} when ``config`` does not turn it on."""
    plan = feature_plan(config, name, num_clients)
    return {} if plan is None else FEATURES[name].run_info(plan)
