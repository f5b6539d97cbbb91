"""Server optimizers (init/update pairs over flat parameter vectors, built as chains of update transformations),
and their registry: what ``[server] optimizer = ...`` and a chain's ``[[server.transforms]]`` can name.

The built-ins register here through the same ``register`` a plugin calls (``driftlab.optim.registry``).
"""

from driftlab.optim import built_in, registry
from driftlab.optim.registry import (
    ServerOptimizerConfig,
    ServerOptimizerEntry,
    TransformationConfig,
    TransformationEntry,
    register,
)
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

for _entry in (*built_in.OPTIMIZERS, *built_in.STAGES):
    register(_entry)
del _entry
registry.REGISTRY.finish_built_ins()
registry.TRANSFORMATIONS.finish_built_ins()

__all__ = [
    "SERVER_OPTIMIZER_NAMES",
    "AdagradState",
    "AdamState",
    "MomentumState",
    "ServerOptimizer",
    "ServerOptimizerConfig",
    "ServerOptimizerEntry",
    "ServerOptimizerState",
    "SgdState",
    "TransformationConfig",
    "TransformationEntry",
    "UpdateTransformation",
    "YogiState",
    "adagrad",
    "adam",
    "chain",
    "make_server_optimizer",
    "momentum",
    "register",
    "sgd",
    "yogi",
]
