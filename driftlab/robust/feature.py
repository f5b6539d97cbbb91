"""``[robust]`` as a feature entry (``driftlab.features.entry``): a robust rule planned, wrapped and recorded.

The plan is the rule's settings (``RobustConfig.settings``) and the bucket size, checked against the run's fixed
cohort (Krum needs n > 2f + 2 updates a round, Bulyan n ≥ 4f + 3; with ``robust.bucket_size`` = s these count the
⌈n/s⌉ buckets) before any round; the wrap is ``with_robust_aggregation``, bucketing with the run's seed; run.json
records the rule, its parameters and the bucket size.  What it needs of an algorithm and what it cannot be combined with are data
(``REQUIREMENTS``, ``CONFIG_CONFLICTS``), each with why and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from driftlab.errors import ConfigError
from driftlab.features.capabilities import ONE_PHASE, RELEASE_FORM, SHARED_VIEW, Reason, Requirements
from driftlab.features.entry import FeatureEntry, RunFacts
from driftlab.robust.bucketing import bucketed_aggregate
from driftlab.robust.registry import Settings
from driftlab.robust.section import RobustConfig
from driftlab.robust.wrapper import ASYNCHRONOUS_REASON, with_robust_aggregation
from driftlab.simulation.round.sampling import clients_per_round


@dataclass(frozen=True)
class RobustPlan:
    settings: Settings
    parameters: dict  # the section's keys as set, for run.json
    bucket_size: int | None = None  # robust.bucket_size: None = no bucketing
    seed: int = 0  # the run's seed, which the bucketing permutation of each round derives from


# [robust] in ExperimentConfig's schema
CONFIG_FIELD = (
    "Byzantine-robust aggregation: a rule that replaces the mean of the released vectors (the [robust] keys); absent "
    "= the algorithm's mean"
)


def plan(section: RobustConfig, facts: RunFacts) -> RobustPlan:
    settings = section.settings
    if facts.sampling_mode != "poisson" and facts.num_clients > 0:
        cohort = clients_per_round(facts.participation, facts.num_clients)
        try:  # the rule's own check of the round's size (its buckets' number), on the cohort every round samples
            zeros = torch.zeros(cohort, 1, dtype=torch.float64)
            bucketed_aggregate(settings, zeros, section.bucket_size or 1, range(cohort), client_ids=range(cohort))
        except ValueError as error:
            raise ConfigError(f"[robust] with {cohort} clients a round: {error}") from None
    return RobustPlan(settings, section.parameters, section.bucket_size, facts.seed)


def wrap(algorithm: Any, plan: RobustPlan) -> Any:
    return with_robust_aggregation(algorithm, plan.settings, plan.bucket_size, plan.seed)


def run_info(plan: RobustPlan) -> dict[str, Any]:
    """run.json's ``robust`` entry: the rule, the parameters the config set, and the bucket size when set."""
    bucketing = {} if plan.bucket_size is None else {"bucket_size": plan.bucket_size}
    return {"robust": {"aggregator": plan.settings.name, **plan.parameters, **bucketing}}


REQUIREMENTS = Requirements(
    "[robust]",
    needs=(
        (
            RELEASE_FORM,
            Reason(
                "it gives no release form (seam.ReleaseForm: the vector its message reveals, summed with unit "
                "weights), so there is no vector per client for a robust rule to aggregate in place of the mean",
                'remove [robust], or use an algorithm with one (fedavg or fedprox with aggregation = "uniform", '
                "scaffold, feddyn, ...)",
                "; ",
            ),
        ),
        (
            ONE_PHASE,
            Reason(
                "it uploads a vector per client before local training (Algorithm.prelude), whose mean a robust rule "
                "would leave as it is",
                'remove [robust], or for Mime set algorithm.control_variate = "previous" (one phase)',
                "; ",
            ),
        ),
        (
            SHARED_VIEW,
            Reason(
                "it sends each client a view of its own (Algorithm.client_view), and the released vectors a robust "
                "rule compares are changes from the one broadcast model",
                "remove [robust], or use an algorithm whose clients all receive the broadcast",
            ),
        ),
    ),
)

CONFIG_CONFLICTS = Requirements(
    "[robust]",
    excludes=(
        (
            "[privacy]",
            Reason(
                "[robust] aggregates with a statistic (a median, Krum's one chosen message) in place of the sum of "
                "clipped messages that client-level DP noises and accounts for, so the accounting would not cover it "
                "(and with local noise [privacy] wraps first: its messages release no form to aggregate)",
                "remove [robust] or [privacy] (privacy.clip alone already bounds each message's norm)",
            ),
        ),
        ("[asynchronous]", ASYNCHRONOUS_REASON),
    ),
)


FEATURE = FeatureEntry.of_module(__name__, "robust", RobustConfig)
