"""The ``[algorithm]`` section's model: what every algorithm's ``Config`` shares, and the whole of one without options.

Every algorithm's config model (the registry's ``AlgorithmEntry.config_type``) refuses keys it does not know, so a
misspelt hyperparameter is an error and not a silent default, and is frozen, so a run's settings cannot change under
it; its ``name`` literal selects it.  ``AlgorithmConfig`` states that once; ``named_section`` builds the whole model of
an algorithm whose only key is its name (SCAFFOLD, FedGATE, VRL-SGD: their step sizes are ``[client]``'s and
``[server]``'s).  ``Aggregation`` and ``Incomplete`` are the values of the two keys many algorithms share, and
``options`` hands a section's keys to the algorithm's ``build``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, create_model

# ``aggregation``: r_k = n_k ("weighted") or 1 ("uniform") in the server's means (aggregation.client_weight).
Aggregation = Literal["weighted", "uniform"]
# ``incomplete``: a straggler's partial work is dropped (FedAvg's rule) or averaged like a complete client's.
Incomplete = Literal["drop", "keep"]


class AlgorithmConfig(BaseModel):
    """The base of every ``[algorithm]`` section: unknown keys refused, the settings frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def named_section(name: str, doc: str, module: str) -> type[AlgorithmConfig]:
    """The ``Config`` of algorithm ``name`` whose only key is ``name`` itself, documented by ``doc`` (its JSON
    schema's description) and living in ``module`` (the algorithm's, for pickling and messages)."""
    return create_model(
        "Config",
        __base__=AlgorithmConfig,
        __doc__=doc,
        __module__=module,
        name=(Literal[name], name),  # type: ignore[valid-type] - the literal of this algorithm's name
    )


def options(config: AlgorithmConfig) -> dict[str, Any]:
    """Every key of ``config`` but ``name``, by name: an algorithm whose ``build`` takes its section's keys as keyword
    arguments is built from a config with ``build(server_optimizer, **options(config))``."""
    return {key: getattr(config, key) for key in type(config).model_fields if key != "name"}
