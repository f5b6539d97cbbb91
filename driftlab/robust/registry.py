"""The one entry point: ``aggregate(settings or name, updates, weights)``, and the registry of rules by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from driftlab.robust.clipping import CenteredClipping, CenteredClippingState, NormBound, centered_clipping, norm_bound
from driftlab.robust.coordinatewise import Median, TrimmedMean, median, trimmed_mean
from driftlab.robust.geometric_median import GeometricMedian, geometric_median
from driftlab.robust.krum import Bulyan, Krum, MultiKrum, bulyan, krum, multi_krum
from driftlab.robust.result import RobustResult

# name -> the settings constructor; the settings record is what a config section resolves to.
AGGREGATORS: dict[str, type] = {
    settings.name: settings
    for settings in (Median, TrimmedMean, Krum, MultiKrum, Bulyan, GeometricMedian, CenteredClipping, NormBound)
}

_RULES: dict[type, Callable[..., RobustResult]] = {
    Median: median,
    TrimmedMean: trimmed_mean,
    Krum: krum,
    MultiKrum: multi_krum,
    Bulyan: bulyan,
    GeometricMedian: geometric_median,
    NormBound: norm_bound,
}

Settings = Median | TrimmedMean | Krum | MultiKrum | Bulyan | GeometricMedian | CenteredClipping | NormBound


def make_settings(name: str, **fields: Any) -> Settings:
    """The settings record of rule ``name`` from its fields, with errors that name the rule's fields."""
    if name not in AGGREGATORS:
        raise ValueError(f"unknown robust aggregator {name!r}; choose one of {', '.join(sorted(AGGREGATORS))}")
    constructor = AGGREGATORS[name]
    try:
        return constructor(**fields)
    except TypeError as error:
        known = [f for f in constructor.__dataclass_fields__ if f != "name"]
        raise ValueError(
            f"robust aggregator {name!r} takes the fields {', '.join(known) or '(none)'}; got {sorted(fields)}"
        ) from error


def aggregate(
    settings: Settings | str,
    updates: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    state: CenteredClippingState | None = None,
    client_ids: Sequence[int] | None = None,
    **fields: Any,
) -> RobustResult:
    """Aggregate a round's ``[n, d]`` updates with the rule ``settings`` (a record, or a name plus its ``fields``).

    ``weights`` ([n], None: uniform) are the algorithm's weights, used by the rules
    that average (multi-Krum among the selected, geometric median, norm bounding,
    centered clipping) and ignored by those that count clients (median, trimmed
    mean, Krum, Bulyan).  ``state`` and ``client_ids`` are centered clipping's (its
    last aggregate, and the per-client momenta when β > 0); the others refuse a state.

    Example:
        >>> import torch
        >>> from driftlab.robust import aggregate
        >>> aggregate("median", torch.tensor([[1.0], [2.0], [10.0]])).aggregate
        tensor([2.])
    """
    if isinstance(settings, str):
        settings = make_settings(settings, **fields)
    elif fields:
        raise ValueError(f"aggregate got a settings record and extra fields {sorted(fields)}; put them in the record")
    if isinstance(settings, CenteredClipping):
        return centered_clipping(settings, updates, weights, state=state, client_ids=client_ids)
    rule = _RULES.get(type(settings))
    if rule is None:
        raise ValueError(
            f"not a robust aggregator's settings: {settings!r}; choose one of {', '.join(sorted(AGGREGATORS))}"
        )
    if state is not None:
        raise ValueError(f"{settings.name} carries no state between rounds; pass state only to centered_clipping")
    return rule(settings, updates, weights)
