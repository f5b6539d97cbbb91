"""Dispatch choice (uniform over registered, available, idle clients; a function of the dispatch number) and timing."""

import math

import numpy as np
import pytest

from driftlab.simulation.asynchronous.events import REJECTION_DRAWS, choose_client, dispatch_seed, work_seconds
from driftlab.simulation.time.plan import AsynchronousPlan, DeviceProfile


class Window:
    """Clients in ``available`` are available at every time, the others never."""

    def __init__(self, available):
        self.ids = set(available)

    def profile(self, client_id, time):
        return DeviceProfile(1.0, 1.0, 1.0) if client_id in self.ids else None

    def available(self, client_ids, time):
        return np.array([int(k) in self.ids for k in client_ids], dtype=bool)


def test_the_choice_is_a_function_of_the_dispatch_number():
    registered = np.arange(50)
    everyone = Window(range(50))
    first = [choose_client(7, d, registered, set(), everyone, 0.0) for d in range(20)]
    assert first == [choose_client(7, d, registered, set(), everyone, 123.0) for d in range(20)]
    assert first != [choose_client(8, d, registered, set(), everyone, 0.0) for d in range(20)]


def test_only_idle_available_registered_clients_are_chosen_and_uniformly():
    registered = np.array([0, 2, 3, 5, 7, 8, 9])
    profiles = Window([0, 2, 3, 5, 6])  # 6 is available but not registered
    busy = {3}
    eligible = [0, 2, 5]
    counts = np.zeros(10, dtype=int)
    for dispatch in range(3000):
        counts[choose_client(1, dispatch, registered, busy, profiles, 0.0)] += 1
    assert counts[eligible].sum() == 3000
    assert np.all(np.abs(counts[eligible] / 3000 - 1 / 3) < 0.04)


def test_the_fallback_list_finds_a_rare_eligible_client():
    # 1 eligible client in 1000: rejection nearly always misses REJECTION_DRAWS times and draws from the list
    registered = np.arange(1000)
    profiles = Window([17, 400])
    assert REJECTION_DRAWS < 50
    chosen = {choose_client(2, dispatch, registered, {400}, profiles, 0.0) for dispatch in range(30)}
    assert chosen == {17}


def test_nobody_eligible_is_none():
    assert choose_client(0, 0, np.arange(3), {0, 1, 2}, Window(range(3)), 0.0) is None
    assert choose_client(0, 0, np.arange(3), set(), Window([]), 0.0) is None
    assert choose_client(0, 0, np.arange(0), set(), Window([]), 0.0) is None


def test_each_dispatch_trains_with_its_own_seed():
    seeds = {dispatch_seed(5, d, 3) for d in range(10)}
    assert len(seeds) == 10 and dispatch_seed(5, 0, 3) == dispatch_seed(5, 0, 3) != dispatch_seed(5, 0, 4)


def test_work_takes_download_compute_and_upload():
    profile = DeviceProfile(speed=50.0, download=1e6, upload=2.5e5)
    # 32000 bits down at 1 Mb/s, 4 steps of 25 examples at 50/s, 32000 bits up at 250 kb/s
    assert work_seconds(profile, 32000, 4, 25, 32000) == pytest.approx(0.032 + 2.0 + 0.128, rel=1e-15)


def test_staleness_weights():
    sqrt = AsynchronousPlan(4, 2)
    assert [sqrt.staleness_weight(tau) for tau in (0, 3, 8)] == [1.0, 0.5, pytest.approx(1 / 3)]
    assert AsynchronousPlan(4, 2, "constant").staleness_weight(7) == 1.0
    with pytest.raises(ValueError, match="at least 0"):
        sqrt.staleness_weight(-1)
    assert math.isclose(sqrt.staleness_weight(1), 1 / math.sqrt(2))
