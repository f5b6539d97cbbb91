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
    state_from_tensors,
    state_to_tensors,
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
    "state_from_tensors",
    "state_to_tensors",
    "yogi",
]
