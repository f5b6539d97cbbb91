"""The asynchronous run's events: which idle client a dispatch picks, and when a dispatched client arrives.

Dispatch ``d`` (0, 1, 2, ... over the whole run) picks uniformly among the clients that are registered, available
at the dispatch time and idle (not in flight), with ``generator(seed, ASYNC_DISPATCH, d)`` alone, so a resumed run
picks what an uninterrupted one does.  Rejection sampling over the registered clients (a handful of draws, the common
case when C ≪ N) falls back to drawing from the explicit list of eligible clients; both are uniform over that set,
so their mixture is too.

A client dispatched at t₀ with profile p (looked up at t₀ and used for the whole work), doing s local steps of
b_k = min(batch size, n_k) examples, arrives at (design.md, "Timing model")::

    arrival = t₀ + bits(view) / p.download + s · b_k / p.speed + bits(view) / p.upload

(the upload at the view's size: an asynchronous message is uncompressed).  Its work is lost when its availability
window ends first: ``p.end < arrival``.
"""

from __future__ import annotations

import numpy as np

from driftlab.randomness import Stream, generator, torch_seed
from driftlab.simulation.time.clock import client_timing
from driftlab.simulation.time.plan import DeviceProfile, Profiles

REJECTION_DRAWS = 8  # draws among the registered clients before listing the eligible ones


def choose_client(
    seed: int, dispatch: int, registered: np.ndarray, busy: set[int], profiles: Profiles, time: float
) -> int | None:
    """The client dispatch ``dispatch`` sends work to at ``time``: uniform over ``registered`` clients that are
    available then and not in ``busy``; None when there is none."""
    if len(registered) == 0:
        return None
    rng = generator(seed, Stream.ASYNC_DISPATCH, dispatch)
    for _ in range(REJECTION_DRAWS):
        client_id = int(registered[rng.integers(len(registered))])
        if (
            client_id not in busy and profiles.profile(client_id, time) is not None
        ):  # one client's windows, not every row
            return client_id
    idle = registered[~np.isin(registered, np.fromiter(busy, dtype=np.int64, count=len(busy)))]
    eligible = idle[np.asarray(profiles.available(idle, time), dtype=bool)] if len(idle) else idle
    if len(eligible) == 0:
        return None
    return int(eligible[rng.integers(len(eligible))])


def dispatch_seed(seed: int, dispatch: int, client_id: int) -> int:
    """The training seed of dispatch ``dispatch`` (``ClientSettings.seed``): a client dispatched twice from one model
    version draws other minibatches the second time.  Its own (seed, stream, dispatch, client) tuple, apart from the
    choice's draws."""
    return torch_seed(seed, Stream.ASYNC_DISPATCH, dispatch, client_id)


def work_seconds(
    profile: DeviceProfile, download_bits: int, steps: int, samples_per_step: int, upload_bits: int
) -> float:
    """Download, local training and upload of one client's work on ``profile`` (module docstring)."""
    return client_timing(profile, download_bits, steps, samples_per_step, upload_bits).total
