"""``[asynchronous]`` (FedBuff on the simulated clock) as a feature entry (``driftlab.features.entry``).

It needs of the algorithm what ``driftlab.features.drivers.ASYNCHRONOUS`` declares (one phase, one shared view, a
stated asynchronous rule, no membership hooks); its plan is the engine's ``AsynchronousPlan``.
"""

from __future__ import annotations

from typing import Any

from driftlab.features import drivers
from driftlab.features.capabilities import Reason, Requirements
from driftlab.features.entry import FeatureEntry, RunFacts, config_errors
from driftlab.simulation.asynchronous.checkpointing import InFlightExtra
from driftlab.simulation.asynchronous.section import AsynchronousConfig
from driftlab.simulation.backends.buffers import refuse_running_statistics
from driftlab.simulation.time.plan import AsynchronousPlan

# [asynchronous] in ExperimentConfig's schema
CONFIG_FIELD = (
    "asynchronous FedBuff on the simulated clock (the [asynchronous] keys; needs [system]); absent = synchronous rounds"
)


def plan(section: AsynchronousConfig, facts: RunFacts) -> AsynchronousPlan:  # noqa: ARG001 - FedBuff reads its section only
    """The engine's ``AsynchronousPlan`` for ``section``."""
    with config_errors("[asynchronous]"):
        return AsynchronousPlan(section.concurrency, section.buffer, section.staleness)


REMOVE = "or remove [asynchronous]"
# What FedBuff cannot be combined with in a config (what it needs of the algorithm is drivers.ASYNCHRONOUS).
CONFIG_CONFLICTS = Requirements(
    "[asynchronous]",
    needs=(
        (
            "[system]",
            Reason(
                "asynchronous rounds run on the simulated clock of [system]",
                f"add a [system] section (its defaults draw lognormal devices), {REMOVE}",
            ),
        ),
    ),
    excludes=(
        ("[privacy]", Reason("[privacy] is not accounted for asynchronous updates", f"remove [privacy], {REMOVE}")),
        (
            "compression.ratio < 1",
            Reason(
                "asynchronous messages are sent uncompressed (ratio {ratio}{whose})",
                f"set compression.ratio = 1, {REMOVE}",
            ),
        ),
        *(
            (
                f"availability.{key} > 0",
                Reason(
                    "an asynchronous client's availability and work come from [system] (its device and trace windows)",
                    f"set availability.{key} = 0, {REMOVE}",
                ),
            )
            for key in ("inactive_probability", "incomplete_probability")
        ),
        (
            "system.deadline",
            Reason(
                "a deadline times synchronous rounds; an asynchronous server waits for its buffer",
                f"remove system.deadline, {REMOVE}",
            ),
        ),
        (
            "system.over_selection > 0",
            Reason("over-selection is for synchronous rounds", f"set system.over_selection = 0, {REMOVE}"),
        ),
        (
            'sampling.mode != "uniform"',
            Reason(
                "an asynchronous run dispatches idle clients uniformly, asynchronous.concurrency at a time, instead of "
                "sampling {mode} cohorts",
                f'set sampling.mode = "uniform", {REMOVE}',
            ),
        ),
    ),
)


def finish(sim: Any, plan: Any) -> None:  # noqa: ARG001  (the FeatureEntry.finish signature)
    """Refuse a model with BatchNorm statistics: FedBuff's buffer folds stale changes of θ, and no stale rule for the
    statistics is implemented."""
    with config_errors("[asynchronous]"):
        refuse_running_statistics(
            sim.model.module,
            "[asynchronous]",
            "FedBuff folds each client's change of the parameters into its buffer and carries no running statistics",
        )


def simulation_fields(plan: AsynchronousPlan) -> dict[str, Any]:
    return {"asynchronous": plan}


STATE_EXTRA = InFlightExtra()  # the clients in flight, saved as engine/async/...

FEATURE = FeatureEntry.of_module(__name__, "asynchronous", AsynchronousConfig, requirements=drivers.ASYNCHRONOUS)
