"""``[system]`` (simulated time) as a feature entry (``driftlab.features.entry``): device profiles, deadline, clock.

The plan is the engine's ``SystemPlan`` (profiles drawn from (seed, client id) or read from a trace for the data's N
clients); once the simulation is built, a deadline no client can meet is refused before any round; run.json
records the profiles' kind and a trace's path and SHA-256.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from driftlab.errors import ConfigError
from driftlab.features import drivers
from driftlab.features.capabilities import Reason, Requirements
from driftlab.features.entry import Fact, FeatureEntry, RunFacts, config_errors
from driftlab.metrics.communication import payload_bits
from driftlab.simulation.time.clock import least_time
from driftlab.simulation.time.plan import SystemPlan
from driftlab.simulation.time.profiles import TraceProfiles, devices, profiles_for
from driftlab.simulation.time.round_clock import ClockExtra
from driftlab.simulation.time.section import SystemConfig


@dataclass(frozen=True)
class TimePlan:
    """The engine's plan, and the profiles' kind run.json names ("lognormal", "trace")."""

    system: SystemPlan
    profiles: str


def system_plan(system: SystemConfig, facts: RunFacts) -> SystemPlan:
    """The engine's ``SystemPlan`` for ``system`` on ``facts.num_clients`` clients; a trace that cannot be used is a
    ConfigError naming the file, line and column."""
    with config_errors("system.trace" if system.profiles == "trace" else "[system]"):
        profiles = profiles_for(system, facts.seed, facts.num_clients)
        return SystemPlan(profiles, system.deadline, system.deadline_mode, system.over_selection)


# [system] in ExperimentConfig's schema
CONFIG_FIELD = (
    "simulated time: device speeds and bandwidths, the virtual clock, deadline and over-selection (the [system] keys); "
    "absent = rounds are not timed"
)


def plan(system: SystemConfig, facts: RunFacts) -> TimePlan:
    return TimePlan(system_plan(system, facts), system.profiles)


def check_deadline(sim: Any) -> None:
    """ConfigError, before any round, when no client can meet ``system.deadline``: not one step and the model both ways
    (``deadline_mode = "partial"``), or not its whole first-round work (``"drop"``); every round would select
    clients and wait out the deadline for nothing."""
    system = sim.system
    if system is None or system.deadline is None:
        return
    view_bits = payload_bits(sim.algorithm.broadcast(sim.algorithm.server_init(sim.initial_params)))
    partial = system.deadline_mode == "partial"

    def work(client_id: int) -> tuple[int, int]:
        num_samples = int(sim.client_sizes[client_id])
        planned = sim.plan.planned_steps(num_samples, 1)
        return (min(1, planned) if partial else planned), min(sim.plan.batch_size, num_samples)

    least = least_time(devices(system.profiles, sim.data.num_clients), view_bits, work, system.deadline)
    if least > system.deadline:
        what = (
            "to receive the model, do one local step and send its message"
            if partial
            else "for its whole first-round work"
        )
        # rounded up at 6 digits, so the deadline the message names is one that works
        scale = 10 ** (math.floor(math.log10(least)) - 5)
        enough = float(f"{math.ceil(least / scale) * scale:.6g}")
        raise ConfigError(
            f"system.deadline = {system.deadline:g} s: no client can meet it; the fastest needs {least:.9g} s {what} "
            f"({view_bits:,} bits each way); raise system.deadline to at least {enough:g}, or remove it"
        )


def run_info(plan: TimePlan) -> dict[str, Any]:
    """run.json's ``system`` entry: the profiles' kind, and a trace's path and SHA-256 (of the bytes the run read)."""
    info: dict[str, Any] = {"profiles": plan.profiles}
    if isinstance(plan.system.profiles, TraceProfiles):
        info.update(trace=plan.system.profiles.source, sha256=plan.system.profiles.sha256)
    return {"system": info}


def _timed(test: Any) -> Any:
    """A fact that holds when [system] is set and ``test(config)``."""
    return lambda config, on: "system" in on and test(config)


# The facts about [system] conflicts name (driftlab.features.config_facts).
CONFIG_FACTS = (
    Fact("system.deadline", "system.deadline", _timed(lambda config: config.system.deadline is not None)),
    Fact("system.over_selection > 0", "system.over_selection", _timed(lambda config: config.system.over_selection > 0)),
    Fact(
        "system.over_selection > 0 of a poisson cohort",
        "system.over_selection",
        _timed(lambda config: config.system.over_selection > 0 and config.sampling.mode == "poisson"),
    ),
)
CONFIG_CONFLICTS = Requirements(
    "[system]",
    excludes=(
        (
            "system.over_selection > 0 of a poisson cohort",
            Reason(
                "a poisson cohort has no fixed size to over-select",
                'set system.over_selection = 0, or sampling.mode = "uniform"',
            ),
        ),
    ),
)


def simulation_fields(plan: TimePlan) -> dict[str, Any]:
    return {"system": plan.system}


def finish(sim: Any, plan: TimePlan) -> None:  # noqa: ARG001  (the FeatureEntry.finish signature)
    check_deadline(sim)


def state_fields(plan: TimePlan) -> dict[str, Any]:  # noqa: ARG001  (the FeatureEntry.state_fields signature)
    """Simulated seconds from 0, saved as engine/clock (``STATE_EXTRA``); untimed runs keep None (their records are
    unchanged)."""
    return {"clock": 0.0}


def used_plan(sim: Any, system: SystemConfig) -> TimePlan:
    return TimePlan(sim.system, system.profiles)


STATE_EXTRA = ClockExtra()

FEATURE = FeatureEntry.of_module(__name__, "system", SystemConfig, requirements=drivers.SIMULATED_TIME)
