"""One module per algorithm; this registry is the only place that lists them.

A registry line maps an algorithm's config name to its config model (a
pydantic model with a ``name`` literal and the algorithm's hyperparameters)
and its module, whose ``from_config(config, server_optimizer)`` builds the
``driftlab.simulation.seam.Algorithm``.
"""

from __future__ import annotations

from driftlab.algorithms import adabest, efl, fedavg, feddyn, fedprox, scaffold

ALGORITHM_MODULES = {
    "fedavg": fedavg,
    "fedprox": fedprox,
    "scaffold": scaffold,
    "feddyn": feddyn,
    "adabest": adabest,
    "efl": efl,
}

ALGORITHM_CONFIGS = {name: module.Config for name, module in ALGORITHM_MODULES.items()}
