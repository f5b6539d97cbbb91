"""One module per algorithm; the registry (``driftlab.algorithms.registry``) holds one entry for each.

A registry line gives an algorithm's config name, its config model (a pydantic
model with a ``name`` literal and the algorithm's hyperparameters), its module's
``from_config(config, server_optimizer)`` that builds the
``driftlab.simulation.seam.Algorithm``, its label in reports and sweeps, and the
facts the runner and the shared tests read.  Algorithms of your own register
themselves from a plugin module with ``register(AlgorithmEntry(...))``
(docs/design.md, "Writing a plugin").
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from driftlab.algorithm_labels import BUILT_IN_LABELS as LABELS
from driftlab.algorithms import (
    adabest,
    apfl,
    ditto,
    efl,
    fedamp,
    fedavg,
    feddyn,
    fedgate,
    fednova,
    fedprox,
    mime,
    registry,
    scaffold,
    vrlsgd,
)
from driftlab.algorithms.registry import ALGORITHMS, AlgorithmEntry, register


def _register_built_in(
    module: ModuleType, name: str = "", config: type | None = None, builder: Any = None, **facts: Any
) -> None:
    """Register the algorithm of ``module`` under ``name`` (default: the module's own name), with its ``Config`` and
    ``from_config`` unless given (a second algorithm of one module: Mime beside MimeLite), its label
    (``algorithm_labels``) and the facts the runner reads (``AlgorithmEntry``'s fields)."""
    name = name or module.__name__.rsplit(".", 1)[1]
    register(AlgorithmEntry(name, config or module.Config, builder or module.from_config, label=LABELS[name], **facts))


OWN_SERVER_STEP = {"owns_server_step": True, "uses_server_lr": False}  # FedDyn, AdaBest, FedAMP: no server.lr

_register_built_in(fedavg, keeps_partial_work=False)
_register_built_in(fedprox)
_register_built_in(scaffold)
_register_built_in(feddyn, **OWN_SERVER_STEP)
_register_built_in(adabest, **OWN_SERVER_STEP)
_register_built_in(efl, default_compression_ratio=efl.DEFAULT_COMPRESSION_RATIO)
_register_built_in(fednova)
_register_built_in(fedgate, keeps_partial_work=False)
_register_built_in(vrlsgd)
_register_built_in(mime, "mimelite", owns_server_step=True)
_register_built_in(mime, "mime", mime.MimeConfig, mime.from_mime_config, owns_server_step=True)
_register_built_in(apfl, keeps_partial_work=False)
_register_built_in(ditto, keeps_partial_work=False)
_register_built_in(fedamp, **OWN_SERVER_STEP, needs_num_clients=True)
registry.REGISTRY.finish_built_ins()
registry.BUILT_IN = registry.REGISTRY.built_in

__all__ = ["ALGORITHMS", "AlgorithmEntry", "register"]
