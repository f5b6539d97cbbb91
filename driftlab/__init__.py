"""driftlab: fast, exactly reproducible simulation of federated optimization.

    >>> import driftlab
    >>> result = driftlab.run("synthetic-fedavg", overrides=["rounds=3"])   # doctest: +SKIP
    >>> result.records[-1]["test_accuracy"]                                  # doctest: +SKIP
"""

from driftlab.experiments.config import ConfigError, ExperimentConfig, load_config
from driftlab.experiments.runner import RunResult, run

__version__ = "0.1.0"

__all__ = ["ConfigError", "ExperimentConfig", "RunResult", "load_config", "run", "__version__"]
