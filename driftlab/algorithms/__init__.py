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

register(AlgorithmEntry("fedavg", fedavg.Config, fedavg.from_config, label=LABELS["fedavg"], keeps_partial_work=False))
register(AlgorithmEntry("fedprox", fedprox.Config, fedprox.from_config, label=LABELS["fedprox"]))
register(AlgorithmEntry("scaffold", scaffold.Config, scaffold.from_config, label=LABELS["scaffold"]))
register(
    AlgorithmEntry(
        "feddyn", feddyn.Config, feddyn.from_config, label=LABELS["feddyn"], owns_server_step=True, uses_server_lr=False
    )
)
register(
    AlgorithmEntry(
        "adabest",
        adabest.Config,
        adabest.from_config,
        label=LABELS["adabest"],
        owns_server_step=True,
        uses_server_lr=False,
    )
)
register(
    AlgorithmEntry(
        "efl", efl.Config, efl.from_config, label=LABELS["efl"], default_compression_ratio=efl.DEFAULT_COMPRESSION_RATIO
    )
)
register(AlgorithmEntry("fednova", fednova.Config, fednova.from_config, label=LABELS["fednova"]))
register(
    AlgorithmEntry("fedgate", fedgate.Config, fedgate.from_config, label=LABELS["fedgate"], keeps_partial_work=False)
)
register(AlgorithmEntry("vrlsgd", vrlsgd.Config, vrlsgd.from_config, label=LABELS["vrlsgd"]))
register(AlgorithmEntry("mimelite", mime.Config, mime.from_config, label=LABELS["mimelite"], owns_server_step=True))
register(AlgorithmEntry("mime", mime.MimeConfig, mime.from_mime_config, label=LABELS["mime"], owns_server_step=True))
register(AlgorithmEntry("apfl", apfl.Config, apfl.from_config, label=LABELS["apfl"], keeps_partial_work=False))
register(AlgorithmEntry("ditto", ditto.Config, ditto.from_config, label=LABELS["ditto"], keeps_partial_work=False))
register(
    AlgorithmEntry(
        "fedamp",
        fedamp.Config,
        fedamp.from_config,
        label=LABELS["fedamp"],
        owns_server_step=True,
        uses_server_lr=False,
        needs_num_clients=True,
    )
)
registry.REGISTRY.finish_built_ins()
registry.BUILT_IN = registry.REGISTRY.built_in

__all__ = ["ALGORITHMS", "AlgorithmEntry", "register"]
