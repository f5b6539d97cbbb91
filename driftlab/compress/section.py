"""``[compression]``: the ST compression ratio of ``driftlab.compress`` (top-k + ternary, error feedback both ways)."""

from __future__ import annotations

from pydantic import Field

from driftlab.config_section import Section


class CompressionConfig(Section):
    ratio: float | None = Field(
        None,
        gt=0,
        le=1,
        description="ST compression (top-k + ternary, error feedback both ways) keeping this fraction q of each "
        "tensor; 1 = uncompressed; none = the algorithm's default (EFL 0.01, others 1)",
    )


__all__ = ["CompressionConfig"]
