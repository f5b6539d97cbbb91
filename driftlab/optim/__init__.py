"""Server optimizers (init/update pairs over flat parameter vectors, built as chains of update transformations)."""

from driftlab.optim.server import (
    SERVER_OPTIMIZER_NAMES,
    AdagradState,
    AdamState,
    MomentumState,
    ServerOptimizer,
    ServerOptimizerState,
    SgdState,
    UpdateTransformation,
    YogiState,
    adagrad,
    adam,
    chain,
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
    "UpdateTransformation",
    "YogiState",
    "adagrad",
    "adam",
    "chain",
    "make_server_optimizer",
    "momentum",
    "sgd",
    "yogi",
]
