"""What the engines read of simulated time: a client's device profile, the synchronous rounds' timing plan
(``SystemPlan``: profiles, deadline, over-selection) and the asynchronous plan (``AsynchronousPlan``: FedBuff's
concurrency, buffer and staleness weight).

Times are simulated seconds (float64), speeds samples per second of local training, bandwidths bits per second;
nothing here reads a wall clock, so a run's timing is a function of (seed, client id, the trace) alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

DEADLINE_MODES = ("partial", "drop")
STALENESS_WEIGHTS = ("sqrt", "constant")


@dataclass(frozen=True)
class DeviceProfile:
    """A client's device from ``start`` on, and ``end``: when its availability ends (simulated seconds).  A trace's
    windows that touch (one ends where the next begins: the device changed) are one stretch, so ``end`` is the end of
    the stretch; work begun in it keeps this device to its end."""

    speed: float  # samples per second of local training (a step of b examples takes b / speed seconds)
    download: float  # bits per second, server to client
    upload: float  # bits per second, client to server
    start: float = 0.0
    end: float = math.inf


class Profiles(Protocol):
    """Where clients' devices come from (``driftlab.simulation.time.profiles``)."""

    def profile(self, client_id: int, time: float) -> DeviceProfile | None:
        """Client ``client_id``'s device at simulated time ``time``; None when it is not available then."""
        ...

    def available(self, client_ids: np.ndarray, time: float) -> np.ndarray:
        """A boolean mask over ``client_ids``: which are available (inside a window) at ``time``."""
        ...

    def next_start(self, time: float) -> float | None:
        """The earliest time after ``time`` at which a client becomes available (None: never again, or always available)."""
        ...


@dataclass(frozen=True)
class SystemPlan:
    """How synchronous rounds are timed (config ``[system]``)."""

    profiles: Profiles
    deadline: float | None = None  # seconds a round waits; None: for its slowest counted client
    deadline_mode: str = "partial"  # one of DEADLINE_MODES
    over_selection: float = 0.0  # select ceil((1 + f)·m), keep the first m to finish

    def __post_init__(self) -> None:
        if self.deadline_mode not in DEADLINE_MODES:
            raise ValueError(f"deadline_mode must be one of {', '.join(DEADLINE_MODES)}, got {self.deadline_mode!r}")
        if self.deadline is not None and not (self.deadline > 0 and math.isfinite(self.deadline)):
            raise ValueError(f"deadline must be a positive number of seconds, got {self.deadline}")
        if not (self.over_selection >= 0 and math.isfinite(self.over_selection)):
            raise ValueError(f"over_selection must be at least 0, got {self.over_selection}")


@dataclass(frozen=True)
class AsynchronousPlan:
    """FedBuff (Nguyen et al., AISTATS 2022): ``concurrency`` clients in flight, a server update every ``buffer`` arrivals,
    each change weighted by ``staleness_weight(τ)``."""

    concurrency: int
    buffer: int
    staleness: str = "sqrt"  # one of STALENESS_WEIGHTS

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.buffer < 1:
            raise ValueError(f"concurrency and buffer must be at least 1, got {self.concurrency} and {self.buffer}")
        if self.buffer > self.concurrency:
            raise ValueError(f"the buffer ({self.buffer}) cannot be larger than the concurrency ({self.concurrency})")
        if self.staleness not in STALENESS_WEIGHTS:
            raise ValueError(f"staleness must be one of {', '.join(STALENESS_WEIGHTS)}, got {self.staleness!r}")

    def staleness_weight(self, staleness: int) -> float:
        """s(τ): 1/sqrt(1 + τ) (FedBuff's), or 1."""
        if staleness < 0:
            raise ValueError(f"staleness must be at least 0, got {staleness}")
        return 1.0 / math.sqrt(1.0 + staleness) if self.staleness == "sqrt" else 1.0
