import math

import pytest

from driftlab.simulation.time.clock import ClientTiming, client_timing, fits, least_time, steps_within
from driftlab.simulation.time.plan import DeviceProfile

# 10 samples/s, 1000 bits/s down, 100 bits/s up
DEVICE = DeviceProfile(speed=10.0, download=1000.0, upload=100.0)


def test_client_timing_by_hand():
    # 2000 bits down: 2 s; 3 steps of 5 examples at 10/s: 1.5 s; 50 bits up: 0.5 s
    timing = client_timing(DEVICE, 2000, 3, 5, 50)
    assert timing == ClientTiming(download=2.0, compute=1.5, upload=0.5)
    assert timing.total == 4.0


def test_no_steps_take_only_communication():
    assert client_timing(DEVICE, 1000, 0, 32, 100).total == 2.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="0 bits or more"):
        client_timing(DEVICE, -1, 1, 1, 0)
    with pytest.raises(ValueError, match="0 or more"):
        client_timing(DEVICE, 0, -1, 1, 0)
    with pytest.raises(ValueError, match="positive number of seconds"):
        steps_within(0.0, DEVICE, 0, 0, 1, 1)


def test_fits():
    timing = ClientTiming(1.0, 2.0, 1.0)
    assert fits(None, timing)
    assert fits(4.0, timing)
    assert not fits(3.999, timing)


def test_steps_within_by_hand():
    # download 2 s + upload 0.5 s leave D - 2.5 s; a step of 5 examples takes 0.5 s
    assert steps_within(4.0, DEVICE, 2000, 50, 5, 10) == 3  # 1.5 s: 3 steps
    assert steps_within(4.2, DEVICE, 2000, 50, 5, 10) == 3  # 1.7 s: still 3
    assert steps_within(100.0, DEVICE, 2000, 50, 5, 10) == 10  # everything fits: the planned steps
    assert steps_within(2.9, DEVICE, 2000, 50, 5, 10) == 0  # 0.4 s: not one step
    assert steps_within(2.0, DEVICE, 2000, 50, 5, 10) == 0  # not even the communication
    assert steps_within(4.0, DEVICE, 2000, 50, 5, 0) == 0


def test_steps_of_no_examples_take_no_time():
    assert steps_within(2.5, DEVICE, 2000, 50, 0, 7) == 7
    assert steps_within(2.4, DEVICE, 2000, 50, 0, 7) == 0


@pytest.mark.parametrize("deadline", [0.3, 0.7, 1.1, 1.3, 2.9, 10 / 3, 0.1 + 0.2, 7.7, 1e-9 + 1.0])
@pytest.mark.parametrize("speed", [3.0, 7.0, 10.0, 0.1 * 3])
def test_steps_within_is_the_exact_boundary(deadline, speed):
    # awkward decimals, where the floor of the quotient and the rounded sum can disagree
    device = DeviceProfile(speed=speed, download=3.0, upload=7.0)
    steps = steps_within(deadline, device, 0.1, 0.7, 1, 1000)
    assert client_timing(device, 0.1, steps, 1, 0.7).total <= deadline or steps == 0
    assert steps == 1000 or client_timing(device, 0.1, steps + 1, 1, 0.7).total > deadline
    exact = math.floor((deadline - 0.1 / 3.0 - 0.7 / 7.0) * speed)
    assert abs(steps - max(0, exact)) <= 1


def test_deadline_exactly_at_a_step_boundary_counts_that_step():
    # download 1 s + upload 1 s + 2 steps of 1 s = 4 s exactly
    device = DeviceProfile(speed=1.0, download=1.0, upload=1.0)
    assert steps_within(4.0, device, 1, 1, 1, 5) == 2
    assert fits(4.0, client_timing(device, 1, 2, 1, 1))


def test_a_deadline_equal_to_a_timing_gives_its_steps_though_the_quotient_floors_below():
    # (D − download − upload)·speed rounds to 28.999…: the floor alone would give 28 steps where 29 fit exactly
    device = DeviceProfile(speed=1.1, download=3.0, upload=7.0)
    deadline = client_timing(device, 0.7, 29, 1, 0.3).total
    assert math.floor((deadline - 0.7 / 3.0 - 0.3 / 7.0) * 1.1) == 28
    assert steps_within(deadline, device, 0.7, 0.3, 1, 100) == 29


def test_least_time_stops_at_the_first_device_within_reach():
    fast, slow = DeviceProfile(10.0, 100.0, 100.0), DeviceProfile(1.0, 100.0, 100.0)
    seen = []

    def work(client_id):
        seen.append(client_id)
        return 2, 5  # 2 steps of 5 examples

    # fast: 1 + 1 + 1 = 3 s; slow: 1 + 10 + 1 = 12 s (download and upload of 100 bits at 100 bits/s)
    assert least_time([(0, slow), (1, fast), (2, slow)], 100, work, within=5.0) == 3.0
    assert seen == [0, 1]  # the third device is never looked at
    seen.clear()
    assert least_time([(0, slow), (1, fast), (2, slow)], 100, work, within=2.0) == 3.0  # none within: all looked at
    assert seen == [0, 1, 2]
    assert least_time([], 100, work, within=1.0) == math.inf
