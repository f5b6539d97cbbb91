"""Synchronous rounds on the simulated clock ([system]): hand-timed rounds, deadlines, over-selection, windows, resume.

The hand-timed cases use the three scalar quadratic clients (n_k = 1000, 707, 577; the model is one float64, so every
view and uncompressed message is 32 bits) and devices whose times are exact binary fractions:

    T_k = 32 / download_k + s_k · min(batch_size, n_k) / speed_k + |m_k| / upload_k
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import driftlab
from driftlab.experiments.run.runner import build_simulation
from driftlab.simulation.round.engine import plan_round, run_round
from driftlab.simulation.time.plan import DeviceProfile, SystemPlan

# K = 2 steps of the whole client (batch_size 1000 ≥ n_k): client 0 takes 1 + 2 + 2 = 5 s, client 1 4 + 1 + 1 = 6 s,
# client 2 1 + 8 + 0.5 = 9.5 s.
DEVICES = {
    0: DeviceProfile(speed=1000.0, download=32.0, upload=16.0),
    1: DeviceProfile(speed=1414.0, download=8.0, upload=32.0),
    2: DeviceProfile(speed=144.25, download=32.0, upload=64.0),
}


@dataclasses.dataclass(frozen=True)
class Devices:
    """Fixed devices by client, each with its windows: a list of profiles whose [start, end) do not overlap."""

    windows: dict[int, tuple[DeviceProfile, ...]]

    @classmethod
    def always(cls, devices: dict[int, DeviceProfile]) -> Devices:
        return cls({client_id: (profile,) for client_id, profile in devices.items()})

    def profile(self, client_id: int, time: float) -> DeviceProfile | None:
        return next((p for p in self.windows[client_id] if p.start <= time < p.end), None)

    def available(self, client_ids: np.ndarray, time: float) -> np.ndarray:
        return np.array([self.profile(int(client_id), time) is not None for client_id in client_ids], dtype=bool)

    def next_start(self, time: float) -> float | None:
        later = [p.start for windows in self.windows.values() for p in windows if p.start > time]
        return min(later) if later else None


def quadratic(steps: int = 2, participation: float = 1.0, **sections) -> dict:
    config = {
        "data": {"name": "quadratic1d", "num_clients": 3},
        "model": {"name": "quadratic"},
        "client": {"lr": 0.1, "batch_size": 1000, "steps": steps},
        "sampling": {"participation": participation},
        "precision": "float64",
        "rounds": 1,
    }
    return config | sections


def timed(config: dict, profiles=None, **system):
    """The simulation of ``config`` with ``system`` set by hand (fixed devices), and its state before round 1."""
    sim, state = build_simulation(driftlab.load_config(config))
    sim.system = SystemPlan(profiles if profiles is not None else Devices.always(DEVICES), **system)
    return sim, dataclasses.replace(state, clock=0.0)


def rounds(sim, state, count: int):
    records = []
    for _ in range(count):
        state, record = run_round(sim, state)
        records.append(record)
    return state, records


def test_a_round_ends_when_its_slowest_counted_client_arrives_and_the_next_starts_there():
    sim, state = timed(quadratic())
    state, records = rounds(sim, state, 2)
    assert [(r["time_start"], r["time_end"]) for r in records] == [(0.0, 9.5), (9.5, 19.0)]
    assert state.clock == 19.0
    assert [r["num_missed_deadline"] for r in records] == [0, 0]
    assert [r["num_not_awaited"] for r in records] == [0, 0]
    assert records[0]["reporting_clients"] == [0, 1, 2]


def test_an_untimed_round_has_no_clock_and_no_time_keys():
    sim, state = build_simulation(driftlab.load_config(quadratic()))
    state, record = run_round(sim, state)
    assert state.clock is None
    assert not {"time_start", "time_end", "num_missed_deadline", "num_not_awaited"} & record.keys()


def test_the_clock_adds_keys_and_changes_no_number_of_an_untimed_run():
    config = quadratic(steps=3)
    _, untimed = rounds(*build_simulation(driftlab.load_config(config)), 3)
    state, timed_records = rounds(*timed(config), 3)
    untimed_state, _ = rounds(*build_simulation(driftlab.load_config(config)), 3)

    def strip(r):
        timed = ("round_seconds", "time_start", "time_end", "num_missed_deadline", "num_not_awaited")
        return {k: v for k, v in r.items() if k not in timed}

    assert [strip(r) for r in timed_records] == [strip(r) for r in untimed]
    assert torch.equal(state.server.params, untimed_state.server.params)


def _deadline_round(algorithm: dict, mode: str, deadline: float = 7.0):
    # K = 4: clients 0 and 1 take 1 + 4 + 2 = 7 s and 4 + 2 + 1 = 7 s; client 2 would take 1 + 16 + 0.5 = 17.5 s.
    sim, state = timed(quadratic(steps=4, algorithm=algorithm), deadline=deadline, deadline_mode=mode)
    work = plan_round(sim, state)
    _, record = run_round(sim, state)
    return work, record


def test_a_partial_deadline_cuts_the_slow_client_to_the_steps_that_fit_and_fedavg_drops_it():
    work, record = _deadline_round({"name": "fedavg"}, "partial")
    # client 2: 7 − 1 − 0.5 = 5.5 s of work at 4 s a step → 1 step; clients 0 and 1 fit exactly (7 ≤ 7)
    assert [(c.client_id, c.planned_steps, c.available_steps) for c in work.contexts] == [
        (0, 4, 4),
        (1, 4, 4),
        (2, 4, 1),
    ]
    assert record["num_incomplete"] == 1
    assert record["reporting_clients"] == [0, 1]  # FedAvg drops incomplete work
    assert record["local_steps"] == 9
    assert record["num_missed_deadline"] == 0
    assert record["time_end"] == 7.0


def test_fedprox_keeps_the_client_the_deadline_cut_short():
    _, record = _deadline_round({"name": "fedprox", "mu": 0.1}, "partial")
    assert record["reporting_clients"] == [0, 1, 2]
    assert record["num_incomplete"] == 1
    assert record["time_end"] == 7.0  # client 2 arrives at 1 + 4 + 0.5 = 5.5 s


def test_a_deadline_no_step_fits_drops_the_client_untrained():
    # D = 1.4: client 2's download and upload alone take 1.5 s; clients 0 and 1 fit no step either (3 s, 5 s)
    work, record = _deadline_round({"name": "fedprox", "mu": 0.1}, "partial", deadline=1.4)
    assert work.contexts == ()
    assert record["num_missed_deadline"] == 3
    assert record["num_reporting"] == 0 and record["local_steps"] == 0
    assert record["time_end"] == 1.4  # nobody counted: the round lasted its deadline


def test_drop_mode_drops_the_client_whose_whole_work_does_not_fit():
    work, record = _deadline_round({"name": "fedprox", "mu": 0.1}, "drop")
    assert [c.client_id for c in work.contexts] == [0, 1]
    assert record["num_missed_deadline"] == 1
    assert record["num_incomplete"] == 0
    assert record["reporting_clients"] == [0, 1]
    assert record["local_steps"] == 8
    assert record["num_selected"] == 3  # it was selected and received the model
    assert record["download_bits"] == 3 * 32


# Client 0 takes 1 + 8 + 2 = 11 s; clients 1 and 2 take 6 s each (4 + 1 + 1, 2 + 2 + 2).
SLOW_FIRST = {
    0: DeviceProfile(speed=250.0, download=32.0, upload=16.0),
    1: DeviceProfile(speed=1414.0, download=8.0, upload=32.0),
    2: DeviceProfile(speed=577.0, download=16.0, upload=16.0),
}


def test_over_selection_trains_only_the_first_m_to_finish():
    # participation 0.5 of 3: m = 2; f = 0.5 selects ⌈3⌉ = 3 and awaits the two fastest
    sim, state = timed(quadratic(participation=0.5), Devices.always(SLOW_FIRST), over_selection=0.5)
    work = plan_round(sim, state)
    assert work.selected.tolist() == [0, 1, 2]
    assert [c.client_id for c in work.contexts] == [1, 2]
    new_state, record = run_round(sim, state)
    assert record["num_not_awaited"] == 1 and record["num_selected"] == 3
    assert record["reporting_clients"] == [1, 2] and record["local_steps"] == 4
    assert record["time_end"] == 6.0
    # the server model is that of a round of clients 1 and 2 alone (client 0 away)
    away = Devices({0: (dataclasses.replace(SLOW_FIRST[0], start=100.0),), 1: (SLOW_FIRST[1],), 2: (SLOW_FIRST[2],)})
    alone_state, alone = run_round(*timed(quadratic(), away))
    assert alone["reporting_clients"] == [1, 2]
    assert torch.equal(new_state.server.params, alone_state.server.params)


def test_over_selection_breaks_ties_of_arrival_by_client_id():
    # participation 0.2 of 3: m = 1; f = 2 selects all three; clients 1 and 2 both arrive at 6 s: client 1 is kept
    sim, state = timed(quadratic(participation=0.2), Devices.always(SLOW_FIRST), over_selection=2.0)
    _, record = run_round(sim, state)
    assert record["reporting_clients"] == [1]
    assert record["num_not_awaited"] == 2
    assert record["time_end"] == 6.0


def test_without_over_selection_the_slow_client_is_awaited():
    sim, state = timed(quadratic(participation=1.0), Devices.always(SLOW_FIRST))
    _, record = run_round(sim, state)
    assert record["reporting_clients"] == [0, 1, 2] and record["time_end"] == 11.0


def test_a_client_whose_window_ends_mid_work_is_dropped_and_unavailable_clients_are_not_sampled():
    windows = Devices(
        {
            0: (DEVICES[0],),
            1: (dataclasses.replace(DEVICES[1], start=3.0),),  # joins at 3 s: not available at round 1's start
            2: (dataclasses.replace(DEVICES[2], end=9.0),),  # would arrive at 9.5 s: leaves before finishing
        }
    )
    sim, state = timed(quadratic(), windows)
    work = plan_round(sim, state)
    assert work.selected.tolist() == [0, 2]  # participation 1 of the two available clients
    state, record = run_round(sim, state)
    assert record["num_missed_deadline"] == 1
    assert record["reporting_clients"] == [0]
    assert record["time_end"] == 5.0
    # round 2 starts at 5 s: client 1 has joined, client 2 is still inside its window but cannot finish by 9 s
    _, record = run_round(sim, state)
    assert record["num_selected"] == 3 and record["reporting_clients"] == [0, 1]
    assert record["time_start"] == 5.0 and record["time_end"] == 11.0


def test_sampling_draws_among_the_available_clients_only():
    windows = Devices({0: (DEVICES[0],), 1: (dataclasses.replace(DEVICES[1], start=100.0),), 2: (DEVICES[2],)})
    sim, state = timed(quadratic(participation=0.5), windows)
    for round_index in range(1, 6):
        work = plan_round(sim, dataclasses.replace(state, round=round_index - 1))
        assert len(work.selected) == 1  # m = ⌊0.5 · 2 + ½⌋ of the two available
        assert 1 not in work.selected.tolist()


def test_a_round_where_nobody_is_available_waits_for_the_first_check_in():
    later = Devices({k: (dataclasses.replace(p, start=50.0),) for k, p in DEVICES.items()})
    sim, state = timed(quadratic(), later, deadline=20.0)
    state, records = rounds(sim, state, 2)
    # nobody is available at 0: round 1 starts at 50 s, when the clients' windows open, and lasts 9.5 s as in the
    # hand-timed round above; round 2 starts where it ended
    assert [(r["time_start"], r["time_end"], r["num_selected"]) for r in records] == [(50.0, 59.5, 3), (59.5, 69.0, 3)]


def test_rounds_after_the_last_window_select_nobody_and_last_their_deadline():
    gone = Devices({k: (dataclasses.replace(p, end=1.0),) for k, p in DEVICES.items()})
    sim, state = timed(quadratic(), gone, deadline=20.0)
    state, records = rounds(sim, state, 3)
    # round 1's clients would finish after their windows close at 1 s: dropped, so the server waits to its deadline
    assert [(r["time_end"], r["num_selected"], r["num_missed_deadline"]) for r in records] == [
        (20.0, 3, 3),
        (40.0, 0, 0),
        (60.0, 0, 0),
    ]


@pytest.mark.parametrize("deadline", [None, 7.0])
def test_both_backends_give_the_same_times_and_counts(deadline):
    config = quadratic(steps=4, algorithm={"name": "fedprox", "mu": 0.1})
    keys = (
        "time_start",
        "time_end",
        "num_missed_deadline",
        "num_not_awaited",
        "num_incomplete",
        "reporting_clients",
        "local_steps",
    )
    results = []
    for backend in ("sequential", "vectorized"):
        sim, state = timed(config | {"backend": backend}, deadline=deadline)
        _, records = rounds(sim, state, 2)
        results.append([{key: r[key] for key in keys} for r in records])
    assert results[0] == results[1]


def test_compression_shortens_the_round_by_its_smaller_uploads():
    config = {
        "data": {"name": "synthetic", "num_clients": 4},
        "model": {"name": "mlp", "hidden": [8]},
        "client": {"steps": 2, "batch_size": 5},
        "sampling": {"participation": 1.0},
        "rounds": 1,
    }
    same = Devices.always({k: DeviceProfile(speed=50.0, download=1e5, upload=1e4) for k in range(4)})
    ends = {}
    for ratio in (1.0, 0.1):
        sim, state = timed(config | {"compression": {"ratio": ratio}}, same)
        _, record = run_round(sim, state)
        view_bits = 32 * sim.initial_params.numel()
        message_bits = record["upload_bits"] / record["num_reporting"]  # every client's message has the same size
        expected = view_bits / 1e5 + 2 * 5 / 50.0 + message_bits / 1e4
        assert record["time_end"] == pytest.approx(expected, rel=1e-12)
        ends[ratio] = record["time_end"]
    assert ends[0.1] < ends[1.0] - 0.5 * (32 * sim.initial_params.numel()) / 1e4


def test_a_message_larger_than_the_reserve_that_arrives_late_is_not_folded():
    # client 0 sends 224 bits instead of the 32 planned: 1 + 2 + 14 = 17 s > D = 9.75 s; clients 1 and 2 arrive at 6, 9.5 s
    sim, state = timed(quadratic(algorithm={"name": "fedprox", "mu": 0.1}), deadline=9.75)
    finish = sim.algorithm.client_finish

    def larger_message(view, client_state, context, update):
        new_state, message = finish(view, client_state, context, update)
        if context.client_id == 0:
            params = message.params.clone()
            params.bits = 224  # payload_bits reads a payload's own bit count
            message = dataclasses.replace(message, params=params)
        return new_state, message

    sim.algorithm = dataclasses.replace(sim.algorithm, client_finish=larger_message)
    _, record = run_round(sim, state)
    assert record["reporting_clients"] == [1, 2]
    assert record["num_missed_deadline"] == 1
    assert record["local_steps"] == 6  # its work was done, and lost
    assert record["time_end"] == 9.75  # the server waited for client 0 until the deadline (the others were in by 9.5 s)


def test_a_timed_run_resumes_bit_for_bit(tmp_path):
    config = quadratic(
        steps=3,
        rounds=6,
        participation=0.7,
        checkpoint_every=1,
        keep_checkpoint=True,
        system={"speed_median": 700.0, "deadline": 6.0, "download_median": 32.0, "upload_median": 32.0},
        algorithm={"name": "fedprox", "mu": 0.1},
    )
    straight = driftlab.run(config)
    driftlab.run(config | {"rounds": 3}, tmp_path / "run")
    resumed = driftlab.run(config, tmp_path / "run", resume=True)
    strip = lambda records: [{k: v for k, v in r.items() if k != "round_seconds"} for r in records]  # noqa: E731
    assert strip(straight.records) == strip(resumed.records)
    assert torch.equal(straight.final_params, resumed.final_params)
    assert straight.records[-1]["time_end"] > straight.records[2]["time_end"] > 0
    assert sum(r["num_incomplete"] for r in straight.records) > 0  # the deadline cut some clients short


def test_a_run_on_lognormal_devices_without_deadline_equals_the_untimed_run_but_for_its_clock():
    config = quadratic(steps=3, rounds=4, participation=0.7, algorithm={"name": "scaffold"})
    untimed = driftlab.run(config)
    timed_run = driftlab.run(config | {"system": {"speed_sigma": 1.0}})
    time_keys = {"time_start", "time_end", "num_missed_deadline", "num_not_awaited"}
    strip = lambda records: [{k: v for k, v in r.items() if k not in time_keys | {"round_seconds"}} for r in records]  # noqa: E731
    assert strip(timed_run.records) == strip(untimed.records)
    assert torch.equal(timed_run.final_params, untimed.final_params)
    assert all(
        time_keys <= r.keys() and not time_keys & u.keys()
        for r, u in zip(timed_run.records, untimed.records, strict=True)
    )
    ends = [r["time_end"] for r in timed_run.records]
    assert ends == sorted(ends) and ends[0] > 0
    assert [r["time_start"] for r in timed_run.records[1:]] == ends[:-1]
