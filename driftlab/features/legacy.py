"""The per-feature functions assembly used to define, over the feature entries: kept for their callers.

``driftlab.experiments.run.assembly`` re-exports these (``privacy_settings``, ``privacy_run_info``, ``system_plan``,
``system_run_info``, ``asynchronous_plan``, ``personal_evaluation``, ``check_deadline``); each reads one entry of
``FEATURES`` with ``run_facts``.  ``config`` is an ``ExperimentConfig``, read by attribute.
"""

from __future__ import annotations

from typing import Any

from driftlab.features.registry import FEATURES
from driftlab.features.run import run_facts
from driftlab.privacy.feature import PrivacyPlan
from driftlab.privacy.feature import privacy_settings as _privacy_settings
from driftlab.simulation.personal_evaluation import PersonalRequest
from driftlab.simulation.personal_evaluation import personal_evaluation as _personal_evaluation
from driftlab.simulation.time.feature import TimePlan, check_deadline


def privacy_settings(config: Any, num_clients: int) -> Any:
    """What ``config.privacy`` resolves to for a run on ``num_clients`` clients (None without ``[privacy]``)."""
    return None if config.privacy is None else _privacy_settings(config.privacy, run_facts(config, num_clients))


def privacy_run_info(config: Any, num_clients: int) -> dict[str, Any]:
    """run.json's ``privacy`` entry (``driftlab.privacy.feature.run_info``); empty without ``[privacy]``."""
    settings = privacy_settings(config, num_clients)
    return {} if settings is None else FEATURES["privacy"].run_info(PrivacyPlan(settings, config.rounds))


def system_plan(config: Any, num_clients: int) -> Any:
    """The engine's ``SystemPlan`` for ``config.system`` on ``num_clients`` clients (None without ``[system]``)."""
    return (
        None if config.system is None else FEATURES["system"].plan(config.system, run_facts(config, num_clients)).system
    )


def system_run_info(config: Any, plan: Any) -> dict[str, Any]:
    """run.json's ``system`` entry for the run's ``SystemPlan``; empty without ``[system]``."""
    if config.system is None or plan is None:
        return {}
    return FEATURES["system"].run_info(TimePlan(plan, config.system.profiles))


def asynchronous_plan(config: Any) -> Any:
    """The engine's ``AsynchronousPlan`` for ``config.asynchronous`` (None without ``[asynchronous]``)."""
    return (
        None if config.asynchronous is None else FEATURES["asynchronous"].plan(config.asynchronous, run_facts(config))
    )


def personal_evaluation(config: Any, sim: Any) -> bool:
    """Whether rounds evaluate each client's own model (``driftlab.simulation.personal_evaluation``)."""
    evaluation = config.evaluation
    return _personal_evaluation(PersonalRequest(evaluation.personal, evaluation.finetune_steps or 0), sim)


__all__ = [
    "asynchronous_plan",
    "check_deadline",
    "personal_evaluation",
    "privacy_run_info",
    "privacy_settings",
    "system_plan",
    "system_run_info",
]
