"""Server optimizers (init/update pairs over flat parameter vectors)."""

from driftlab.optim.server import (
    SERVER_OPTIMIZER_NAMES,
    AdagradState,
    AdamState,
    MomentumState,
    ServerOptimizer,
    ServerOptimizerState,
    SgdState,
    YogiState,
    adagrad,
    adam,
    make_server_optimizer,
    momentum,
    sgd,
    yogi,
)

__all__ = [
    "SERVER_OPTIMIZER_NAMES",
    "AdagradState",
    "AdamState",
    "MomentumState",
    "ServerOptimizer",
    "ServerOptimizerState",
    "SgdState",
    "YogiState",
    "adagrad",
    "adam",
    "make_server_optimizer",
    "momentum",
    "sgd",
    "yogi",
]
