"""``[personal_layers]`` as a feature entry (``driftlab.features.entry``): FedPer, LG-FedAvg and FedRep over any
algorithm with a release form.

The plan resolves ``keep`` over the model's parameter names (``RunFacts.tensor_names``, in ``named_parameters``
order beside ``tensor_sizes``; ``"batchnorm"`` over their kinds, ``RunFacts.tensor_kinds``); it is a ConfigError,
listing the names, when an item matches none.  The entry wraps the algorithm first (innermost), and refuses, from
the config alone, what needs one shared view: ``[privacy]``, compression and ``[asynchronous]``.  run.json records
the personal parameters and their count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from driftlab.errors import ConfigError
from driftlab.features.capabilities import Reason, Requirements
from driftlab.features.entry import FeatureEntry, RunFacts
from driftlab.personal.buffers import ClientBuffers, personal_buffer_names
from driftlab.personal.section import PersonalLayersConfig
from driftlab.personal.selection import BATCHNORM, PersonalPart, parameter_kinds, select
from driftlab.personal.wrapping import KEY, REQUIREMENTS, with_personal_layers
from driftlab.simulation.backends.buffers import module_buffers


@dataclass(frozen=True)
class PersonalLayersPlan:
    part: PersonalPart
    personal_first_steps: int


# [personal_layers] in ExperimentConfig's schema
CONFIG_FIELD = (
    "partial-model personalization (FedPer, LG-FedAvg, FedRep): the parameters each client keeps as its own (the "
    "[personal_layers] keys); absent = every parameter shared"
)


def plan(section: PersonalLayersConfig, facts: RunFacts) -> PersonalLayersPlan:
    names, sizes = facts.tensor_names, facts.tensor_sizes
    if not section.keep and not names:
        names = tuple(f"tensor {index}" for index in range(len(sizes)))  # nothing to match: only the sizes count
    if not names:
        raise ConfigError(
            "[personal_layers] keep names parameters, and this run's facts carry no parameter names "
            "(RunFacts.tensor_names); build the run with driftlab.experiments.run.assembly, which gives them"
        )
    try:
        part = select(names, sizes, section.keep, facts.tensor_kinds)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return PersonalLayersPlan(part, section.personal_first_steps)


def used_plan(sim: Any, section: PersonalLayersConfig) -> PersonalLayersPlan:
    """The plan the built simulation runs, from its model's parameter names and sizes (for run.json)."""
    try:
        names = tuple(sim.model.names)
        kinds = parameter_kinds(sim.model.module, names) if BATCHNORM in section.keep else ()
        part = select(names, tuple(sim.model.numels), section.keep, kinds)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return PersonalLayersPlan(part, section.personal_first_steps)


def finish(sim: Any, plan: PersonalLayersPlan) -> None:
    """FedBN: the running statistics of the BatchNorm layers whose affine parameters are personal stay on each client
    (``personal.buffers``), a state extra of the simulation that the engine finds (``own_buffers_record``)."""
    names = personal_buffer_names(sim.model.module, plan.part)
    if names:
        initial = {name: value for name, value in module_buffers(sim.model.module).items() if name in names}
        sim.state_extras = (*sim.state_extras, ClientBuffers(initial))


def wrap(algorithm: Any, plan: PersonalLayersPlan) -> Any:
    try:
        return with_personal_layers(algorithm, plan.part, plan.personal_first_steps)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def run_info(plan: PersonalLayersPlan) -> dict[str, Any]:
    part = plan.part
    return {
        "personal_layers": {
            "personal": list(part.personal),
            "personal_parameters": part.num_personal,
            "shared_parameters": part.num_parameters - part.num_personal,
            "personal_first_steps": plan.personal_first_steps,
        }
    }


_ONE_VIEW = (
    "{fact} needs one view shared by every client, and with [personal_layers] each client starts from its own model "
    "(the broadcast with its personal parameters)"
)

# What needs one shared view, refused from the config before any data is loaded (the same refusals assembly would
# compute from the wrapped algorithm's capabilities, earlier and at the right keys).
CONFIG_CONFLICTS = Requirements(
    KEY,
    excludes=tuple(
        (fact, Reason(_ONE_VIEW.format(fact=fact), f"remove {fix} or [personal_layers]", "; "))
        for fact, fix in (
            ("[privacy]", "[privacy]"),
            ("compression.ratio < 1", "compression (compression.ratio = {ratio}{whose}: set it to 1)"),
            ("[asynchronous]", "[asynchronous]"),
        )
    ),
)

FEATURE = FeatureEntry.of_module(__name__, "personal_layers", PersonalLayersConfig, requirements=REQUIREMENTS)
