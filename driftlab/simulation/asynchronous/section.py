"""``[asynchronous]``: the config section of buffered asynchronous aggregation (FedBuff) on the simulated clock."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from driftlab.config_section import Section


class AsynchronousConfig(Section):
    """``[asynchronous]``: buffered asynchronous aggregation (FedBuff: Nguyen et al., "Federated Learning with
    Buffered Asynchronous Aggregation", AISTATS 2022) on the simulated clock of ``[system]``; ``rounds`` counts server
    updates."""

    concurrency: int = Field(
        100,
        ge=1,
        le=1_000_000,
        description="C: clients training at once, each picked uniformly among idle clients; a finished client's slot "
        "is refilled at once (replaces sampling.participation, which an asynchronous run does not read)",
    )
    buffer: int = Field(
        10, ge=1, le=1_000_000, description="B (the paper's K): the server updates after every B arrivals"
    )
    staleness: Literal["sqrt", "constant"] = Field(
        "sqrt",
        description="weight of a change τ server updates old: sqrt = 1/sqrt(1+τ) (the paper's), constant = 1",
    )

    @model_validator(mode="after")
    def _buffer_fits(self) -> "AsynchronousConfig":
        if self.buffer > self.concurrency:
            raise ValueError(
                f"asynchronous.buffer ({self.buffer}) is larger than asynchronous.concurrency ({self.concurrency}): "
                f"the server "
                "could never fill its buffer; set buffer at most concurrency"
            )
        return self


__all__ = ["AsynchronousConfig"]
