"""``[privacy]`` as a feature entry (``driftlab.features.entry``): client-level DP planned, wrapped and recorded.

``privacy_settings(section, facts)`` is what a run's ``[privacy]`` resolves to on the data's N clients (q, the
expected cohort m = q·N, the population, the noise a target ε needs); ``with_privacy`` wraps the algorithm (after
compression: what is clipped and noised is what a client sends); run.json records the resolved noise and the run's ε.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from driftlab.errors import ConfigError
from driftlab.features import drivers
from driftlab.features.capabilities import Reason, Requirements
from driftlab.features.entry import Fact, FeatureEntry, RunFacts, config_errors
from driftlab.privacy import accounting
from driftlab.privacy.mechanism import with_privacy
from driftlab.privacy.section import PrivacyConfig
from driftlab.privacy.settings import AdaptiveClipping, PrivacySettings
from driftlab.simulation.backends.buffers import refuse_running_statistics
from driftlab.simulation.round.sampling import clients_per_round


@dataclass(frozen=True)
class PrivacyPlan:
    """The resolved settings, and the number of rounds the run's ε is reported after."""

    settings: PrivacySettings
    rounds: int


def privacy_settings(privacy: PrivacyConfig, facts: RunFacts) -> PrivacySettings:
    """What ``privacy`` resolves to for a run on ``facts.num_clients`` clients.

    q is ``sampling.participation`` with poisson sampling, else the fixed cohort m over N (1 with full participation);
    the expected cohort m = q·N is the public denominator of means under central noise; the population is
    ``privacy.population``, else N.  A ``target_epsilon`` is turned into the noise multiplier that spends at most it
    in ``facts.rounds`` rounds (``accounting.noise_multiplier_for``; local noise: its multiplier z/2 at q = 1).
    ConfigError, before any round, for δ not below 1/population, a target no noise reaches, or adaptive
    clipping whose count noise leaves the update no privacy.
    """
    num_clients = facts.num_clients
    if num_clients < 1:
        raise ConfigError("[privacy] needs clients: the data has none")
    if facts.sampling_mode == "poisson":
        rate, cohort = facts.participation, facts.participation * num_clients
    else:
        cohort = clients_per_round(facts.participation, num_clients)
        rate = cohort / num_clients
    population = privacy.population if privacy.population is not None else num_clients
    delta = privacy.delta
    if delta is not None and not delta < 1 / population:
        whose = "privacy.population" if privacy.population is not None else "clients"
        raise ConfigError(
            f"privacy.delta = {delta:g} is not below 1/N = {1 / population:g} for N = {population} {whose}: a δ that "
            f"large allows publishing some client's data outright; set privacy.delta below {1 / population:g} (e.g. "
            f"{_suggested_delta(population):g})"
        )
    noise_multiplier = privacy.noise_multiplier
    accounting_rate = rate if privacy.noise_cohort_size is None else min(1.0, privacy.noise_cohort_size / population)
    if privacy.target_epsilon is not None:
        noise_multiplier = _noise_multiplier_for(privacy, facts.rounds, accounting_rate)
    adaptive = None
    if privacy.adaptive:
        count_noise = privacy.count_noise if privacy.count_noise is not None else cohort / 20  # Andrew et al. 2021
        adaptive = AdaptiveClipping(privacy.target_quantile, privacy.clip_learning_rate, count_noise)
    with config_errors("[privacy]"):
        settings = PrivacySettings(
            clip=privacy.clip,
            noise_multiplier=noise_multiplier,
            seed=facts.seed,
            sampling_rate=rate,
            expected_cohort=cohort,
            population=population,
            noise=privacy.noise,
            delta=delta,
            accountant=privacy.accountant,
            noise_cohort_size=privacy.noise_cohort_size,
            adaptive=adaptive,
        )
        settings.update_noise_multiplier  # noqa: B018 - raises when σ_b leaves the update no privacy
    return settings


def _suggested_delta(population: int) -> float:
    """A power of ten at most 1/(10·N): the usual δ ≪ 1/N."""
    return 10.0 ** math.floor(math.log10(1 / (10 * population)))


def _noise_multiplier_for(privacy: PrivacyConfig, rounds: int, accounting_rate: float) -> float:
    """The noise multiplier that spends at most ``privacy.target_epsilon`` (within 0.5%) in ``rounds`` rounds."""
    local = privacy.noise == "local"
    with config_errors(f"privacy.target_epsilon = {privacy.target_epsilon:g}"):
        # local noise: each client's own messages, sensitivity 2C (multiplier z/2), every round (q = 1)
        z = accounting.noise_multiplier_for(
            privacy.target_epsilon, privacy.delta, 1.0 if local else accounting_rate, rounds, privacy.accountant
        )
    return 2 * z if local else z


# [privacy] in ExperimentConfig's schema
CONFIG_FIELD = (
    "client-level differential privacy: clipping, noise, accounting (the [privacy] keys); absent = not private"
)


def plan(privacy: PrivacyConfig, facts: RunFacts) -> PrivacyPlan:
    return PrivacyPlan(privacy_settings(privacy, facts), facts.rounds)


def wrap(algorithm: Any, plan: PrivacyPlan) -> Any:
    with config_errors("[privacy]"):  # the mechanism's refusal of a form it cannot use: a configuration to change
        return with_privacy(algorithm, plan.settings)


def run_info(plan: PrivacyPlan) -> dict[str, Any]:
    """run.json's ``privacy`` entry: the resolved noise multiplier, accountant, δ, the rates and the run's ε.

    ``epsilon`` is ε after the run's ``rounds`` (its final ε when it completes; the metrics hold each round's),
    ``"inf"`` without noise; absent without δ.
    """
    settings = plan.settings
    info: dict[str, Any] = {
        "noise_multiplier": settings.noise_multiplier,
        "noise": settings.noise,
        "accountant": settings.accountant,
        "delta": settings.delta,
        "sampling_rate": settings.accounting_rate,
        "expected_cohort": settings.expected_cohort,
        "population": settings.population,
        "rounds": plan.rounds,
    }
    epsilon = accounting.run_epsilon(settings, plan.rounds)
    if epsilon is not None:
        info["epsilon"] = "inf" if math.isinf(epsilon) else epsilon  # strict JSON, as the report reads it
    return {"privacy": info}


def _fixed_cohort_accounted_centrally(config: Any, on: frozenset[str]) -> bool:
    sampling = config.sampling
    fixed = sampling.mode not in ("weighted", "poisson") and sampling.participation != 1
    return "privacy" in on and config.privacy.accounted_centrally and fixed


# The facts about [privacy] its conflicts name (driftlab.features.config_facts).
CONFIG_FACTS = (
    Fact("a fixed cohort accounted centrally", "sampling.mode", _fixed_cohort_accounted_centrally),
    Fact(
        'privacy.noise = "local" compressed',
        "privacy.noise",
        lambda config, on: "privacy" in on and config.privacy.noise == "local" and "compression" in on,
    ),
)
# What [privacy] cannot be combined with in a config (the data's checks, δ below 1/N and a reachable ε, are the plan's).
CONFIG_CONFLICTS = Requirements(
    "[privacy]",
    excludes=(
        (
            'sampling.mode = "weighted"',
            Reason(
                "weighted sampling draws clients with probability n_k/n, which reveals their private data sizes",
                'with [privacy] set sampling.mode = "poisson" (or "uniform")',
                "; ",
            ),
        ),
        (
            "a fixed cohort accounted centrally",
            Reason(
                "central noise is accounted for clients sampled independently, not for a fixed cohort of "
                "{participation} of them",
                'set sampling.mode = "poisson" (or sampling.participation = 1)',
            ),
        ),
        *(
            (
                key,
                Reason(
                    "[privacy] needs a fixed population of clients (its sampling rate and δ below 1/N)",
                    f"remove {key}, or remove [privacy]",
                ),
            )
            for key in ("availability.events", "availability.initially_registered")
        ),
        (
            'privacy.noise = "local" compressed',
            Reason(
                "local noise is drawn for the message a client sends, which compression (ratio {ratio}) then cuts "
                "down, keeping part of the message and its noise",
                'set compression.ratio = 1, or privacy.noise = "central"',
            ),
        ),
    ),
)


def finish(sim: Any, plan: Any) -> None:  # noqa: ARG001  (the FeatureEntry.finish signature)
    """Refuse a model whose BatchNorm statistics would be averaged outside the clip and the noise."""
    with config_errors("[privacy]"):
        refuse_running_statistics(
            sim.model.module,
            "[privacy]",
            "running statistics move with every client's data and are averaged beside the messages, outside the "
            "clip and the noise, so they would leak what the privacy promise covers",
        )


FEATURE = FeatureEntry.of_module(__name__, "privacy", PrivacyConfig, requirements=drivers.PRIVACY)
