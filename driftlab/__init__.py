"""driftlab: fast, exactly reproducible simulation of federated optimization.

    >>> import driftlab
    >>> result = driftlab.run("synthetic-fedavg", overrides=["rounds=3"])   # doctest: +SKIP
    >>> result.records[-1]["test_accuracy"]                                  # doctest: +SKIP
    >>> outcomes = driftlab.run_sweep(driftlab.load_sweep("fedprox-figure1"), "runs/fedprox")   # doctest: +SKIP
    >>> driftlab.make_report(["runs/fedprox"], "reports/fedprox").markdown                    # doctest: +SKIP
"""

from driftlab.experiments.config import ConfigError, ExperimentConfig, load_config
from driftlab.experiments.report import make_report
from driftlab.experiments.runner import RunResult, run
from driftlab.experiments.sweep import load_sweep, run_sweep

__version__ = "0.1.0"

__all__ = ["ConfigError", "ExperimentConfig", "RunResult", "load_config", "load_sweep", "make_report", "run", "run_sweep", "__version__"]
