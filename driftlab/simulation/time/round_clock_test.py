"""The round clock policy by hand: the null policy changes nothing, the simulated one plans, times and checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from driftlab.simulation.time.plan import DeviceProfile, SystemPlan
from driftlab.simulation.time.round_clock import (
    UNTIMED,
    UNTIMED_ROUND,
    ClockExtra,
    RoundTiming,
    SimulatedClock,
    round_clock,
)

# 32 bits down at 32 bit/s: 1 s; a step of 10 examples at 10/s: 1 s; 32 bits up at 16 bit/s: 2 s
FAST = DeviceProfile(speed=10.0, download=32.0, upload=16.0)
SLOW = DeviceProfile(speed=1.0, download=32.0, upload=16.0)  # a step takes 10 s
VIEW = torch.zeros(1)  # 32 bits


class Fixed:
    """Every client on its device always, or from ``start`` on."""

    def __init__(self, devices: dict[int, DeviceProfile]) -> None:
        self.devices = devices

    def profile(self, client_id: int, time: float) -> DeviceProfile | None:
        device = self.devices[client_id]
        return device if device.start <= time < device.end else None

    def available(self, client_ids: np.ndarray, time: float) -> np.ndarray:
        return np.array([self.profile(int(k), time) is not None for k in client_ids], dtype=bool)

    def next_start(self, time: float) -> float | None:
        later = [device.start for device in self.devices.values() if device.start > time]
        return min(later) if later else None


class Draw:
    """Takes the first ``m = 1`` candidates, ``⌈(1 + f) m⌉`` of them, each drawn once; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[int], float]] = []

    def __call__(self, candidates: np.ndarray, over_selection: float):
        self.asked.append((candidates.tolist(), over_selection))
        count = int(np.ceil(1 + over_selection))
        return candidates[:count], 1

    def nobody(self):
        return "nobody"


def test_the_null_policy_draws_among_every_registered_client_and_changes_nothing():
    assert round_clock(None) is UNTIMED
    planner = UNTIMED.plan(np.arange(3), None, VIEW)
    draw = Draw()
    assert planner.sample(draw, np.arange(3))[0].tolist() == [0]
    assert draw.asked == [([0, 1, 2], 0.0)]
    assert planner.client_steps(2, 10, 7) == 7
    active = [(0, 1, 7, 7), (2, 2, 7, 3)]
    assert planner.awaited(active, 1) == (active, UNTIMED_ROUND)
    arrivals: dict[int, float | None] = {}
    assert UNTIMED_ROUND.received(arrivals, 0, 7, VIEW) and arrivals == {}
    assert UNTIMED_ROUND.record(1, [0], arrivals) == {}
    assert UNTIMED_ROUND.clock_after({"time_end": 5.0}, None) is None
    assert UNTIMED_ROUND.clock_after({}, 3.0) == 3.0


def test_a_timed_round_plans_its_clients_and_awaits_the_first_to_arrive():
    clock = round_clock(SystemPlan(Fixed({0: SLOW, 1: FAST, 2: FAST}), deadline=20.0, over_selection=1.0))
    assert isinstance(clock, SimulatedClock)
    planner = clock.plan(np.arange(3), 4.0, VIEW)
    draw = Draw()
    sample, cohort = planner.sample(draw, np.arange(3))
    assert draw.asked == [([0, 1, 2], 1.0)] and sample.tolist() == [0, 1] and cohort == 1
    # client 0: 1 + s · 10 + 2 s within D = 20 → s = 1 of its 5; client 1: 1 + 2 · 1 + 2 = 5 s
    assert planner.client_steps(0, 10, 5) == 1
    assert planner.client_steps(1, 10, 2) == 2
    active, timing = planner.awaited([(0, 1, 5, 1), (1, 1, 2, 2)], cohort)
    assert active == [(1, 1, 2, 2)]  # client 1 arrives at 9 s, client 0 at 17 s: the cohort of 1 is client 1
    assert isinstance(timing, RoundTiming) and timing.start == 4.0 and timing.num_not_awaited == 1
    arrivals: dict[int, float | None] = {}
    assert timing.received(arrivals, 1, 2, VIEW) and arrivals == {1: 9.0}
    assert timing.received(arrivals, 1, 2, None) and arrivals == {1: 9.0}  # nothing sent: nothing noted
    record = timing.record(1, [1], arrivals)
    assert record == {"time_start": 4.0, "time_end": 9.0, "num_missed_deadline": 0, "num_not_awaited": 1}
    assert timing.clock_after(record, 4.0) == 9.0


def test_a_late_message_is_refused_and_the_round_lasts_its_deadline():
    planner = SimulatedClock(SystemPlan(Fixed({0: FAST}), deadline=6.0)).plan(np.arange(1), 0.0, VIEW)
    planner.sample(Draw(), np.arange(1))
    assert planner.client_steps(0, 10, 3) == 3  # 1 + 3 + 2 = 6 s: fits exactly
    _, timing = planner.awaited([(0, 1, 3, 3)], 1)
    big = torch.zeros(2)  # 64 bits up: 4 s, so 8 s > D
    arrivals: dict[int, float | None] = {}
    assert not timing.received(arrivals, 0, 3, big) and arrivals == {0: None}
    assert timing.record(1, [], arrivals) == {
        "time_start": 0.0,
        "time_end": 6.0,
        "num_missed_deadline": 1,
        "num_not_awaited": 0,
    }
    with pytest.raises(ValueError, match="without an arrival time"):
        timing.record(1, [0], {})


def test_a_round_with_nobody_available_waits_for_the_first_check_in_or_selects_nobody():
    later = SystemPlan(Fixed({0: DeviceProfile(10.0, 32.0, 16.0, start=50.0)}))
    planner = round_clock(later).plan(np.arange(1), 3.0, VIEW)
    assert planner.start == 50.0
    gone = SystemPlan(Fixed({0: DeviceProfile(10.0, 32.0, 16.0, end=1.0)}), deadline=5.0)
    planner = round_clock(gone).plan(np.arange(1), 3.0, VIEW)
    draw = Draw()
    assert planner.start == 3.0 and planner.sample(draw, np.arange(1)) == ("nobody", 0) and draw.asked == []
    _, timing = planner.awaited([], 0)
    assert timing.record(2, [], {})["time_end"] == 8.0  # nobody counted: the server waits its deadline


def test_the_clock_extra_writes_engine_clock_only_when_timed_and_reads_it_back():
    class State:
        clock: float | None = None

    state = State()
    assert ClockExtra().engine_tensors(state, {}) == {}
    state.clock = 19.25
    tensors = ClockExtra().engine_tensors(state, {})
    assert list(tensors) == ["clock"] and tensors["clock"].dtype == torch.float64
    assert ClockExtra().restored(None, state, tensors) == {"clock": 19.25}
    assert ClockExtra().restored(None, state, {}) == {}  # an untimed (or older) checkpoint: the state's own clock
