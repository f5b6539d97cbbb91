"""A feature as a registry entry: its config section, what it needs of the algorithm, how it plans, wraps and records.

An optional feature (client-level DP, compression, simulated time, FedBuff, the personal evaluation) is one
``FeatureEntry``, defined in its own package (``driftlab/privacy/feature.py``, ...) and registered in
``driftlab.features.registry.FEATURES``.  Assembly (``driftlab.experiments.run.assembly``) iterates the entries and names
none of them::

    for each entry whose section is set (section_of(config) is not None and enabled(section, facts)):
        refusal(entry.requirements, algorithm)       before the data (one template, driftlab.features.capabilities)
        plan      = entry.plan(section, facts)       from its section and the run's facts, never the whole config
        algorithm = entry.wrap(algorithm, plan)      in registration order (compression inside privacy)
        Simulation(..., **entry.simulation_fields(plan)); entry.finish(sim, plan)
        run.json  += entry.run_info(plan)

``RunFacts`` is the small record of what a plan may read besides its section (seed, rounds, clients, sampling,
the algorithm's name, the model's tensor sizes), so the arrows keep pointing down: a feature's package never
imports ``driftlab.experiments``.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from driftlab.errors import ConfigError
from driftlab.features.capabilities import Requirements


@dataclass(frozen=True)
class RunFacts:
    """What a feature's plan may know about the run besides its own section."""

    seed: int
    rounds: int
    num_clients: int  # the data's N (the config's data.num_clients before the data is loaded)
    sampling_mode: str  # sampling.mode: "uniform", "weighted", "poisson"
    participation: float  # sampling.participation
    algorithm: str = "fedavg"  # algorithm.name (a compression default is the algorithm's)
    tensor_sizes: tuple[int, ...] = ()  # the model's tensors' sizes, once it is built (compression's ST blocks)
    tensor_names: tuple[str, ...] = ()  # their names, in named_parameters order (partial personalization's keep)
    # their kinds: "running_norm" for a normalisation layer's with running statistics, else the owning module's class
    # name (driftlab.simulation.backends.flat.parameter_kinds; [personal_layers] keep = ["batchnorm"], FedBN)
    tensor_kinds: tuple[str, ...] = ()


@contextmanager
def config_errors(where: str) -> Iterator[None]:
    """A ``ValueError`` raised inside (a library's refusal of what a feature's section asked for) becomes a
    ``ConfigError`` "``where``: why", ``where`` the key or section to change; a ``ConfigError`` passes unchanged."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None


@dataclass(frozen=True)
class Fact:
    """A named fact about a config that features' ``config_conflicts`` need or exclude ('sampling.mode = "weighted"',
    "system.deadline"): it holds for a config when ``holds(config, on)``, ``on`` the names of the features the config
    turns on; a conflict with it is reported at config key ``key``."""

    name: str
    key: str
    holds: Callable[[Any, frozenset[str]], bool]


def _no_fields(plan: Any) -> dict[str, Any]:  # noqa: ARG001 - a feature that sets no Simulation field
    return {}


def _no_info(plan: Any) -> dict[str, Any]:  # noqa: ARG001 - a feature that adds nothing to run.json
    return {}


def _unchanged(algorithm: Any, plan: Any) -> Any:  # noqa: ARG001 - a feature that does not wrap the algorithm
    return algorithm


def _nothing_to_finish(sim: Any, plan: Any) -> None:  # noqa: ARG001 - a feature with no check on the built simulation
    return None


def _always(section: Any, facts: RunFacts) -> bool:  # noqa: ARG001 - a section that is set is on
    return True


# The fields ``FeatureEntry.of_module`` reads from a feature's module: its hook functions under the fields' own names,
# its declarations under the names in capitals.
MODULE_HOOKS = (
    "plan",
    "section_of",
    "enabled",
    "wrap",
    "simulation_fields",
    "finish",
    "run_info",
    "state_fields",
    "used_plan",
)
MODULE_DECLARATIONS = ("requirements", "config_conflicts", "config_facts", "config_field", "state_extra")


@dataclass(frozen=True)
class FeatureEntry:
    """One optional feature (module docstring).

    ``name`` is its config key (``[privacy]``'s "privacy"); ``section_type`` its section's pydantic type (None: a
    feature of another section's keys, the personal evaluation's ``evaluation.personal``); ``section_of(config)``
    its section, None when the config does not set it (default: ``getattr(config, name, None)``);
    ``enabled(section, facts)`` whether a set section turns it on (compression: a ratio below 1).
    ``requirements`` what it needs of the algorithm and excludes, each with a why and a fix
    (``capabilities.Requirements``; its key names the feature in refusals).  ``plan(section, facts)`` is what the
    run uses (a ConfigError naming the key to change when it cannot); ``wrap(algorithm, plan)`` the algorithm with the
    feature; ``simulation_fields(plan)`` the ``Simulation`` fields it sets; ``finish(sim, plan)`` a check or change
    once the simulation is built (a ConfigError before any round); ``run_info(plan)`` what it adds to run.json;
    ``state_fields(plan)`` the ``SimulationState`` fields it starts, and ``state_extra`` how a checkpoint keeps them.
    """

    name: str
    plan: Callable[[Any, RunFacts], Any]
    requirements: Requirements = Requirements("")
    section_type: type | None = None
    section_of: Callable[[Any], Any] | None = None
    enabled: Callable[[Any, RunFacts], bool] = _always
    wrap: Callable[[Any, Any], Any] = _unchanged
    simulation_fields: Callable[[Any], dict[str, Any]] = _no_fields
    finish: Callable[[Any, Any], None] = _nothing_to_finish
    run_info: Callable[[Any], dict[str, Any]] = field(default=_no_info)
    # the SimulationState fields it starts (simulated time: the clock at 0 s); {}: none
    state_fields: Callable[[Any], dict[str, Any]] = _no_fields
    # What it cannot be combined with in a config, over the facts of driftlab.features.config_facts (needs: reported at
    # its own key; exclusions: at the fact's), each with a why and a fix; None: nothing.
    config_conflicts: Requirements | None = None
    # The facts about its keys that conflicts name (besides "[name]", which holds when its optional section is set).
    config_facts: tuple[Fact, ...] = ()
    # The description of the optional section ExperimentConfig gains for it (None by default, the feature off); None:
    # it gains none (the feature's keys are in another section, or its section is always there).
    config_field: str | None = None
    # (built simulation, section) -> the plan the simulation holds (run.json records what the run used); None: plan
    # again
    used_plan: Callable[[Any, Any], Any] | None = None
    # The part of SimulationState it starts that a checkpoint saves and a resume loads back (a
    # ``driftlab.simulation.round.checkpointing.StateExtra``: the simulated clock, FedBuff's clients in flight); None:
    # none.  Assembly gives the simulation those of the features a config turns on (``Simulation.state_extras``).
    state_extra: Any = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"a feature's name is its config key, a Python identifier; got {self.name!r}")
        if not self.requirements.key:
            object.__setattr__(self, "requirements", Requirements(f"[{self.name}]"))

    @classmethod
    def of_module(cls, module: str, name: str, section_type: type | None = None, **fields: Any) -> FeatureEntry:
        """The entry ``name`` of section type ``section_type`` whose other fields module ``module`` (the caller's
        ``__name__``) defines under the fields' names: the hooks as functions (``plan``, ``wrap``, ``run_info``,
        ``finish``, ...: ``MODULE_HOOKS``), the declarations in capitals (``REQUIREMENTS``, ``CONFIG_CONFLICTS``,
        ``CONFIG_FACTS``, ``CONFIG_FIELD``, ``STATE_EXTRA``: ``MODULE_DECLARATIONS``); ``fields`` given here win.

        So each feature module reads the same way: its plan and hooks, what it needs and excludes, then one line
        ``FEATURE = FeatureEntry.of_module(__name__, "robust", RobustConfig)`` that names none of them again.  A name
        the module only imports for its entry (``personal.feature``'s ``REQUIREMENTS``) is given here instead, or a
        linter removes the import it sees unused.
        """
        defined = vars(sys.modules[module])  # the module being imported: what it has defined so far
        found = {hook: defined[hook] for hook in MODULE_HOOKS if hook in defined}
        found |= {field: defined[field.upper()] for field in MODULE_DECLARATIONS if field.upper() in defined}
        return cls(name=name, section_type=section_type, **(found | fields))

    def section(self, config: Any) -> Any:
        """The feature's section of ``config`` (None: not set)."""
        return self.section_of(config) if self.section_of is not None else getattr(config, self.name, None)

    @property
    def wraps(self) -> bool:
        """Whether the feature wraps the algorithm (compression, privacy)."""
        return self.wrap is not _unchanged

    @property
    def module(self) -> str:
        """The module that defines the feature (its ``plan``)."""
        return getattr(self.plan, "__module__", None) or "unknown module"
