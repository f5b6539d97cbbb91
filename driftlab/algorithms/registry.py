"""The algorithm registry: one entry per algorithm, holding every fact the rest of driftlab needs about it.

An entry names the algorithm's config type (its ``[algorithm]`` section), the
function that builds it, how reports and sweeps label it, and three facts the
runner, the config validation and the shared tests read instead of keeping
their own lists::

    AlgorithmEntry(
        name="fedavg",                     # algorithm.name in configs
        config_type=fedavg.Config,          # a pydantic model whose `name` field defaults to "fedavg"
        from_config=fedavg.from_config,     # (config, server_optimizer) -> seam.Algorithm
        label="FedAvg",                     # rows of reports, method labels of sweeps
        keeps_partial_work=False,           # a straggler's partial work is dropped (by default)
    )

The built-in algorithms are registered by ``driftlab.algorithms``.  An algorithm
of your own registers itself the same way from a plugin module, with one call
at import::

    from driftlab.algorithms import AlgorithmEntry, register
    register(AlgorithmEntry("nesterov_avg", Config, from_config, label="Nesterov FedAvg"))

(``driftlab.plugins.Registry``, the same for every kind of plugin), and a config names the module under ``plugins`` (a module name, or the path of
a ``.py`` file relative to the config file or the working directory), or an
installed package declares it in the entry-point group ``driftlab.algorithms``.
Plugins are imported before a config is validated, in every process that
reads one (``driftlab run``, ``driftlab.run``, each sweep run's interpreter, a
resume, ``driftlab report``), and ``config.json`` records them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel

from driftlab.plugins import Registry, check_config_type, check_entry_name

ENTRY_POINT_GROUP = "driftlab.algorithms"


@dataclass(frozen=True)
class AlgorithmEntry:
    """Everything driftlab needs to know about one algorithm besides its code.

    ``config_type`` is a pydantic model with a ``name`` field whose default is
    ``name`` (the other fields are the algorithm's hyperparameters);
    ``from_config(config, server_optimizer)`` returns the
    ``driftlab.simulation.seam.Algorithm``.  ``owns_server_step``: the
    algorithm's server update is its own, so ``server.optimizer`` must stay
    ``sgd``.  ``uses_server_lr``: False when that own step has no rate, so
    ``server.lr`` must stay 1 (config validation checks both).  ``keeps_partial_work``: with its default hyperparameters, a
    straggler's partial work is aggregated (True) or dropped (False).
    ``default_compression_ratio`` is used when ``compression.ratio`` is unset.
    ``needs_num_clients``: ``from_config(config, server_optimizer, num_clients)`` gets the data's N too (an algorithm
    whose server state holds one row per client: FedAMP); built-ins only, a plugin's is called with two arguments.
    """

    name: str
    config_type: type
    from_config: Callable[[Any, Any], Any]
    label: str
    default_compression_ratio: float = 1.0
    owns_server_step: bool = False
    uses_server_lr: bool = True
    keeps_partial_work: bool = True
    needs_num_clients: bool = False

    def __post_init__(self) -> None:
        check_entry_name("algorithm", self.name)
        check_config_type(
            "algorithm", self.name, self.config_type, BaseModel, "pydantic.BaseModel (the [algorithm] section)"
        )
        if not callable(self.from_config):
            raise ValueError(
                f"algorithm {self.name!r}: from_config must be a function (config, server_optimizer) -> Algorithm"
            )
        if not isinstance(self.label, str) or not self.label.strip():
            raise ValueError(f"algorithm {self.name!r}: label must be a non-empty string (how reports name it)")
        if not 0 < self.default_compression_ratio <= 1:
            raise ValueError(
                f"algorithm {self.name!r}: default_compression_ratio must be in (0, 1], got {self.default_compression_ratio!r}"
            )

    @property
    def module(self) -> str:
        """The module that defines the algorithm."""
        return self.from_config.__module__


REGISTRY: Registry[AlgorithmEntry] = Registry(
    "algorithm", ENTRY_POINT_GROUP, AlgorithmEntry, lambda entry: entry.from_config
)
ALGORITHMS: dict[str, AlgorithmEntry] = (
    REGISTRY.entries
)  # in registration order: the built-ins (papers' order), then plugins
BUILT_IN: tuple[str, ...] = ()  # set by driftlab.algorithms once the built-ins are registered


# The kind's registry functions are the Registry's own (driftlab.plugins.Registry documents them).
register = REGISTRY.register
lookup = REGISTRY.lookup
names = REGISTRY.names
is_plugin = REGISTRY.is_plugin
describe_plugin = REGISTRY.describe
load_entry_points = REGISTRY.load_entry_points
plugin_source = REGISTRY.plugin_source


def label(name: str) -> str:
    """How reports and sweeps name the algorithm (its own name when it is not registered)."""
    entry = ALGORITHMS.get(name)
    return entry.label if entry is not None else name
