"""``[attack]`` as a feature entry (``driftlab.features.entry``): a seeded Byzantine attack planned, wrapped and
recorded.

The plan draws the Byzantine clients from (seed, N) once (``byzantine.byzantine_clients``, ``Stream.
BYZANTINE_CLIENTS``), so the same seed gives the same attackers in every round, on every backend and after a resume;
the wrap is ``with_attack`` (registered after ``[robust]``, so it wraps outside it: the attackers forge, then the
server aggregates); run.json records the attack, its parameters and the Byzantine ids.  Label flipping and the
backdoor poison a client's data, which no algorithm wrap reaches: they are functions of ``driftlab.attacks``
(``flip_labels``, ``poison_batch``) awaiting a per-client data seam, not ``attack.kind`` values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from driftlab.attacks.byzantine import byzantine_clients
from driftlab.attacks.model_updates import Attack
from driftlab.attacks.section import AttackConfig
from driftlab.attacks.wrapper import ASYNCHRONOUS_REASON, with_attack
from driftlab.errors import ConfigError
from driftlab.features.capabilities import ONE_PHASE, RELEASE_FORM, SHARED_VIEW, Reason, Requirements
from driftlab.features.entry import FeatureEntry, RunFacts


@dataclass(frozen=True)
class AttackPlan:
    settings: Attack
    clients: tuple[int, ...]  # the run's Byzantine client ids, sorted
    start_round: int
    seed: int
    parameters: dict  # the section's keys of the attack, as set, for run.json


# [attack] in ExperimentConfig's schema
CONFIG_FIELD = (
    "a seeded Byzantine attack: who attacks and what they forge (the [attack] keys); absent = every client honest"
)


def plan(section: AttackConfig, facts: RunFacts) -> AttackPlan:
    try:
        clients = byzantine_clients(section.byzantine, facts.seed, facts.num_clients)
    except ValueError as error:
        raise ConfigError(f"{error}: name ids below {facts.num_clients}, or give attack.fraction") from None
    return AttackPlan(section.settings, clients, section.start_round, facts.seed, section.parameters)


def wrap(algorithm: Any, plan: AttackPlan) -> Any:
    return with_attack(algorithm, plan.settings, frozenset(plan.clients), plan.start_round, plan.seed)


def run_info(plan: AttackPlan) -> dict[str, Any]:
    """run.json's ``attack`` entry: the kind, its parameters, the first round and the Byzantine ids."""
    return {
        "attack": {
            "kind": plan.settings.name,
            **plan.parameters,
            "start_round": plan.start_round,
            "byzantine_clients": list(plan.clients),
        }
    }


REQUIREMENTS = Requirements(
    "[attack]",
    needs=(
        (
            RELEASE_FORM,
            Reason(
                "it gives no release form (seam.ReleaseForm: the vector its message reveals), so there is no vector "
                "for an attacker to forge",
                'remove [attack], or use an algorithm with one (fedavg or fedprox with aggregation = "uniform", '
                "scaffold, feddyn, ...)",
                "; ",
            ),
        ),
        (
            ONE_PHASE,
            Reason(
                "it uploads a vector per client before local training (Algorithm.prelude), which the attack would "
                "leave honest",
                'remove [attack], or for Mime set algorithm.control_variate = "previous" (one phase)',
                "; ",
            ),
        ),
        (
            SHARED_VIEW,
            Reason(
                "it sends each client a view of its own (Algorithm.client_view), and the omniscient attacks imitate "
                "changes from the one broadcast model",
                "remove [attack], or use an algorithm whose clients all receive the broadcast",
            ),
        ),
    ),
)

CONFIG_CONFLICTS = Requirements(
    "[attack]",
    excludes=(
        (
            "[privacy]",
            Reason(
                "[privacy] wraps the algorithm before [attack], and a private algorithm's messages release no form "
                "for an attacker to forge",
                "remove [attack] or [privacy]",
            ),
        ),
        ("[asynchronous]", ASYNCHRONOUS_REASON),
    ),
)


FEATURE = FeatureEntry.of_module(__name__, "attack", AttackConfig)
