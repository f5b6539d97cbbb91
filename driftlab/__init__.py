"""driftlab: fast, exactly reproducible simulation of federated optimization.

    >>> import driftlab
    >>> result = driftlab.run("synthetic-fedavg", overrides=["rounds=3"])   # doctest: +SKIP
    >>> result.records[-1]["test_accuracy"]                                  # doctest: +SKIP
    >>> outcomes = driftlab.run_sweep(driftlab.load_sweep("fedprox-figure1"), "runs/fedprox")   # doctest: +SKIP
    >>> driftlab.make_report(["runs/fedprox"], "reports/fedprox").markdown                    # doctest: +SKIP

The names below are imported when first used, so ``import driftlab`` (and
``driftlab report``, which reads run directories) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from driftlab.errors import ConfigError

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "ExperimentConfig": "driftlab.experiments.config",
    "FederatedArrays": "driftlab.data.federated",
    "load_config": "driftlab.experiments.config",
    "load_model": "driftlab.experiments.run.loading",
    "load_run": "driftlab.experiments.run.loading",
    "make_report": "driftlab.experiments.report",
    "RunResult": "driftlab.experiments.run.runner",
    "run": "driftlab.experiments.run.runner",
    "load_sweep": "driftlab.experiments.sweep",
    "run_sweep": "driftlab.experiments.sweep",
}

__all__ = [
    "ConfigError",
    "ExperimentConfig",
    "FederatedArrays",
    "RunResult",
    "load_config",
    "load_model",
    "load_run",
    "load_sweep",
    "make_report",
    "run",
    "run_sweep",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
