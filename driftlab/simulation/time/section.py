"""``[system]``: the config section of simulated time (device profiles, the virtual clock, deadline, over-selection)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from driftlab.config_section import Section


class SystemConfig(Section):
    """``[system]``: simulated time (``driftlab.simulation.time``): each client's device speed and bandwidths, the
    virtual clock of every round, a deadline and over-selection; a config without it counts rounds, bits and steps only.

    Profiles are drawn from (seed, client id) (``profiles = "lognormal"``, medians and spreads below) or read from a
    CSV trace (``profiles = "trace"``, ``system.trace``).  A round's simulated duration is the largest download +
    local compute + upload of its counted clients (docs/update-rules.md, "Simulated time").
    """

    profiles: Literal["lognormal", "trace"] = Field(
        "lognormal",
        description="lognormal: each client's speed and bandwidths drawn once from (seed, client id), lognormal around "
        "the medians below (FedScale's device model); trace: read from the CSV file system.trace",
    )
    speed_median: float = Field(
        100.0, gt=0, allow_inf_nan=False, description="median local-training speed, samples per second"
    )
    speed_sigma: float = Field(
        0.5, ge=0, le=5, allow_inf_nan=False, description="σ of the speed's log (0: every client equally fast)"
    )
    download_median: float = Field(
        2e7, gt=0, allow_inf_nan=False, description="median download bandwidth, bits per second"
    )
    upload_median: float = Field(5e6, gt=0, allow_inf_nan=False, description="median upload bandwidth, bits per second")
    bandwidth_sigma: float = Field(
        0.5, ge=0, le=5, allow_inf_nan=False, description="σ of the bandwidths' logs (0: every client's link alike)"
    )
    trace: str | None = Field(
        None,
        description="with profiles = trace: a CSV file with columns client, speed (samples/s), download, upload "
        "(bits/s) and optional start, end (seconds): the client's profile and availability window; several rows per "
        "client give several windows (a profile that changes over time); every client of the data set needs a row",
    )
    deadline: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="seconds a synchronous round waits: a client whose download, work and upload do not fit does part "
        "of its work (deadline_mode = partial) or is dropped (drop); none = wait for the slowest",
    )
    deadline_mode: Literal["partial", "drop"] = Field(
        "partial",
        description="partial: a client does the steps that fit before the deadline (none fit: dropped); drop: a client "
        "whose whole work does not fit sends nothing",
    )
    over_selection: float = Field(
        0.0,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="select (1 + this) times a round's cohort and keep the first cohort-many clients to finish "
        "(Bonawitz et al. 2019); the others are not waited for (nor trained: their work would be discarded)",
    )

    @model_validator(mode="after")
    def _trace_matches_profiles(self) -> "SystemConfig":
        if self.profiles == "trace" and not self.trace:
            raise ValueError(
                'system.profiles = "trace" reads system.trace: set it to a CSV file (columns client, speed, download, '
                "upload[, start, end])"
            )
        if self.profiles != "trace" and self.trace:
            raise ValueError(
                f'system.trace ({self.trace!r}) is read only with system.profiles = "trace": set that, or remove '
                f"system.trace"
            )
        return self


__all__ = ["SystemConfig"]
