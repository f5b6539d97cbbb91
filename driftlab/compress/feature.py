"""``[compression]`` as a feature entry (``driftlab.features.entry``): ST compression with error feedback.

The section is always there; a ratio below 1 (``compression.ratio``, else the algorithm's default) turns it on,
and ``with_compression`` wraps the algorithm innermost (privacy then clips what a client sends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from driftlab.algorithms import registry
from driftlab.compress.error_feedback import with_compression
from driftlab.compress.section import CompressionConfig
from driftlab.features import drivers
from driftlab.features.entry import Fact, FeatureEntry, RunFacts, config_errors


@dataclass(frozen=True)
class CompressionPlan:
    ratio: float  # the fraction q of each tensor kept
    tensor_sizes: tuple[int, ...]  # the model's tensors' sizes: ST compresses each on its own


def ratio(compression: CompressionConfig, algorithm: str) -> float:
    """``compression.ratio``, else the algorithm's default (``AlgorithmEntry.default_compression_ratio``)."""
    if compression.ratio is not None:
        return compression.ratio
    entry = registry.ALGORITHMS.get(algorithm)
    return entry.default_compression_ratio if entry is not None else 1.0


def enabled(compression: CompressionConfig, facts: RunFacts) -> bool:
    return ratio(compression, facts.algorithm) < 1


def plan(compression: CompressionConfig, facts: RunFacts) -> CompressionPlan:
    return CompressionPlan(ratio(compression, facts.algorithm), facts.tensor_sizes)


def wrap(algorithm: Any, plan: CompressionPlan) -> Any:
    with config_errors(f"compression.ratio = {plan.ratio:g}"):
        return with_compression(algorithm, plan.ratio, plan.tensor_sizes)


# the fact [privacy]'s local noise excludes: the section turns compression on
CONFIG_FACTS = (Fact("compression.ratio < 1", "compression.ratio", lambda _config, on: "compression" in on),)

FEATURE = FeatureEntry.of_module(__name__, "compression", CompressionConfig, requirements=drivers.COMPRESSION)
