"""The arithmetic of a client's simulated time: download, local work, upload (docs/update-rules.md, "Simulated time").

For a client with device p that starts at t0 and does s local steps of b = min(batch_size, n_k) examples:

    download = download_bits / p.download            (the model view it receives)
    compute  = s · b / p.speed
    upload   = upload_bits / p.upload                 (its message)
    arrival  = t0 + (download + compute + upload)

FedScale (Lai et al., ICML 2022) times a client's round the same way: communication at its bandwidths plus computation
at its speed.  The synchronous and the asynchronous engine share these functions, so a client's timing is one rule.
A deadline D is seconds after the round's start; ``steps_within`` gives the most steps whose timing fits it:

    steps = min(s, floor((D − download − upload) · p.speed / b))

corrected by at most a step or two so that ``client_timing(...).total <= D`` holds exactly in floating point for the
steps returned and fails for one more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from driftlab.simulation.time.plan import DeviceProfile


@dataclass(frozen=True)
class ClientTiming:
    """Seconds a client spends receiving the model, training and sending its message."""

    download: float
    compute: float
    upload: float

    @property
    def total(self) -> float:
        """download + compute + upload, in that order (the one sum both engines compare and add to a start time)."""
        return self.download + self.compute + self.upload


def client_timing(
    profile: DeviceProfile, download_bits: float, steps: int, samples_per_step: int, upload_bits: float
) -> ClientTiming:
    """The timing of ``steps`` local steps of ``samples_per_step`` examples between a download and an upload of the
    given sizes, on ``profile``'s device."""
    if download_bits < 0 or upload_bits < 0:
        raise ValueError(f"message sizes are 0 bits or more, got download {download_bits} and upload {upload_bits}")
    if steps < 0 or samples_per_step < 0:
        raise ValueError(f"steps and samples per step are 0 or more, got {steps} and {samples_per_step}")
    return ClientTiming(
        download=download_bits / profile.download,
        compute=steps * samples_per_step / profile.speed,
        upload=upload_bits / profile.upload,
    )


def fits(deadline: float | None, timing: ClientTiming) -> bool:
    """Whether ``timing`` ends by the deadline (seconds after the start; None: no deadline, everything fits)."""
    return deadline is None or timing.total <= deadline


def steps_within(
    deadline: float, profile: DeviceProfile, download_bits: float, upload_bits: float, samples_per_step: int, steps: int
) -> int:
    """The most local steps, at most ``steps``, whose download, work and upload end by ``deadline`` (partial mode);
    0 when not even the download and upload fit, or no step does."""
    if not deadline > 0:
        raise ValueError(f"the deadline must be a positive number of seconds, got {deadline}")

    def total(count: int) -> float:
        return client_timing(profile, download_bits, count, samples_per_step, upload_bits).total

    if steps <= 0 or total(0) > deadline:
        return 0
    if samples_per_step == 0 or total(steps) <= deadline:
        return steps  # steps of no examples take no time; or the whole work fits
    estimate = (
        (deadline - download_bits / profile.download - upload_bits / profile.upload) * profile.speed / samples_per_step
    )
    count = min(steps, max(0, math.floor(estimate)))
    # the quotient and the sum round differently: step to the exact boundary of `total(count) <= deadline`
    while count > 0 and total(count) > deadline:
        count -= 1
    while count < steps and total(count + 1) <= deadline:
        count += 1
    return count


def least_time(
    devices: Iterable[tuple[int, DeviceProfile]],
    download_bits: float,
    work: Callable[[int], tuple[int, int]],
    within: float,
) -> float:
    """The least time any of ``devices`` needs for its work (``work(client) = (steps, samples per step)``, a download
    and an upload of ``download_bits``), stopping at the first that needs at most ``within`` seconds: whether a
    deadline can be met at all is asked before any round, and a feasible one is answered by the first few clients."""
    least = math.inf
    for client_id, profile in devices:
        steps, samples_per_step = work(client_id)
        least = min(least, client_timing(profile, download_bits, steps, samples_per_step, download_bits).total)
        if least <= within:
            break
    return least


__all__ = ["ClientTiming", "client_timing", "fits", "least_time", "steps_within"]
