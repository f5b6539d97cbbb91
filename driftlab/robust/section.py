"""``[robust]``: the config section of Byzantine-robust aggregation, a rule and its parameters, checked here.

One key names the rule (``robust.aggregator``); its parameters are keys of the section, each a field of the rule's
settings record (``driftlab.robust.registry.AGGREGATORS``).  A key the rule does not take, a parameter it needs and
lacks, or a value it refuses is an error naming the key and the fix.  ``rule_settings`` is that check, shared with
``[attack]`` (``driftlab.attacks.section``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field, model_validator

from driftlab.config_section import Section
from driftlab.robust.registry import AGGREGATORS, Settings


def rule_settings(section: str, kind_key: str, constructors: dict[str, type], kind: str, values: dict[str, Any]) -> Any:
    """The settings record of rule ``kind`` (``constructors[kind]``) from the section's keys ``values`` (those set).

    ValueError naming ``[section].key`` for a key the rule does not take, a required one missing, or a value the
    rule refuses (its own message, which names the parameter).
    """
    constructor = constructors[kind]
    fields = [f for f in dataclasses.fields(constructor) if f.init]
    names = [f.name for f in fields]
    taken = f"{section}.{kind_key} = {kind!r} takes " + (", ".join(f"{section}.{n}" for n in names) or "no parameters")
    foreign = sorted(set(values) - set(names))
    if foreign:
        raise ValueError(
            f"{section}.{foreign[0]} is not a parameter of this rule: {taken}; remove {section}.{foreign[0]}"
        )
    missing = [
        f.name
        for f in fields
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{section}.{missing[0]} is required: {taken}; set {section}.{missing[0]}")
    try:
        return constructor(**values)
    except ValueError as error:
        named = next((n for n in names if n in str(error)), None)
        raise ValueError(f"{section}.{named}: {error}" if named else f"{section}: {error}") from None


class RobustConfig(Section):
    """``[robust]``: the server aggregates the round's released vectors with a robust rule instead of their mean.

    ``aggregator`` names the rule (``driftlab.robust``: Yin et al. 2018, Blanchard et al. 2017, El Mhamdi et al.
    2018, Pillutla et al. 2022, Karimireddy et al. 2021, Sun et al. 2019); the other keys are its parameters, each
    used by the rules whose settings have it (``settings`` checks which), except ``bucket_size``, which buckets the
    round's vectors before any rule (``driftlab.robust.bucketing``).
    """

    aggregator: Literal[
        "median",
        "trimmed_mean",
        "krum",
        "multi_krum",
        "bulyan",
        "geometric_median",
        "centered_clipping",
        "norm_bound",
    ] = Field(description="the robust rule that replaces the mean of the round's released vectors")
    beta: float | None = Field(None, description="trimmed_mean: the fraction β trimmed from each side, in [0, 0.5)")
    byzantine: int | None = Field(None, description="krum, multi_krum, bulyan: the number f of Byzantine clients")
    selected: int | None = Field(None, description="multi_krum: how many updates m to average; none = n − f")
    smoothing: float | None = Field(None, description="geometric_median: Weiszfeld's smoothing ν (default 1e-5)")
    iterations: int | None = Field(
        None, description="geometric_median: Weiszfeld steps T (default 4); centered_clipping: clipping steps L (1)"
    )
    tolerance: float | None = Field(None, description="geometric_median: relative change that stops early (1e-6)")
    radius: float | None = Field(None, description="centered_clipping: the clipping radius τ")
    momentum: float | None = Field(
        None, description="centered_clipping: each client's momentum β in [0, 1), kept at the server (default 0)"
    )
    max_norm: float | None = Field(None, description="norm_bound: the norm M every update is clipped to")
    bucket_size: int | None = Field(
        None,
        ge=1,
        description="every rule: bucketing (Karimireddy et al. 2022): the rule aggregates the means of ⌈n/s⌉ random "
        "buckets of s updates each round; none or 1 = no bucketing",
    )

    @property
    def parameters(self) -> dict[str, Any]:
        """The rule's parameters this section sets (``bucket_size`` is not one: it applies to every rule)."""
        keys = sorted(self.model_fields_set - {"aggregator", "bucket_size"})
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}

    @property
    def settings(self) -> Settings:
        """The rule's settings record (``driftlab.robust.registry``)."""
        return rule_settings("robust", "aggregator", AGGREGATORS, self.aggregator, self.parameters)

    @model_validator(mode="after")
    def _rule_takes_its_keys(self) -> RobustConfig:
        self.settings  # noqa: B018 - raises, naming the key, for a parameter the rule does not take or refuses
        return self
