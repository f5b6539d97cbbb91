"""A run's features, for assembly: the facts their plans read, which ones a config turns on, the refusal of an
algorithm that lacks what one needs, and what they add to run.json.  ``config`` is an ``ExperimentConfig`` and
``sim`` a ``Simulation``, read by attribute (this package imports nothing from ``driftlab.experiments``)."""

from __future__ import annotations

from typing import Any

from driftlab.errors import ConfigError
from driftlab.features.entry import FeatureEntry, RunFacts
from driftlab.features.registry import FEATURES


def run_facts(config: Any, num_clients: int | None = None, tensor_sizes: tuple[int, ...] = ()) -> RunFacts:
    """The facts a feature's plan reads: ``num_clients`` is the data's N (None: ``config.data.num_clients``)."""
    return RunFacts(
        seed=config.seed,
        rounds=config.rounds,
        num_clients=config.data.num_clients if num_clients is None else num_clients,
        sampling_mode=config.sampling.mode,
        participation=config.sampling.participation,
        algorithm=config.algorithm.name,
        tensor_sizes=tuple(int(size) for size in tensor_sizes),
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


def features_run_info(config: Any, sim: Any) -> dict[str, Any]:
    """What the features ``config`` turns on add to run.json (each entry's ``run_info``, in the registry's order)."""
    facts = run_facts(config, sim.data.num_clients)
    info: dict[str, Any] = {}
    for entry, section in configured_features(config, facts):
        plan = entry.used_plan(sim, section) if entry.used_plan is not None else entry.plan(section, facts)
        info.update(entry.run_info(plan))
    return info
