"""FedBuff's engine: event order, staleness and the server model by hand; the synchronous special case; backends,
threads and a restored in-flight state give the same bytes; refusals before any work."""

import dataclasses
import math

import numpy as np
import pytest
import torch

import driftlab
from driftlab.experiments.run.runner import build_simulation
from driftlab.simulation.asynchronous.checkpointing import in_flight_tensors, restore_in_flight
from driftlab.simulation.asynchronous.engine import asynchronous_problem, check_asynchronous, run_update
from driftlab.simulation.round.engine import commit_round, run_round
from driftlab.simulation.round.setup import SimulationState
from driftlab.simulation.state.memory_budget import MemoryBudget
from driftlab.simulation.time.plan import AsynchronousPlan, DeviceProfile, SystemPlan
from driftlab.simulation.time.profiles import LognormalProfiles, TraceProfiles


@dataclasses.dataclass(frozen=True)
class Speeds:
    """Client k trains at ``speeds[k]`` samples/s inside ``[0, ends[k])``; links take no time."""

    speeds: tuple[float, ...]
    ends: tuple[float, ...] | None = None

    def profile(self, client_id, time):
        end = math.inf if self.ends is None else self.ends[client_id]
        return DeviceProfile(self.speeds[client_id], math.inf, math.inf, 0.0, end) if time < end else None

    def available(self, client_ids, time):
        return np.array([self.profile(int(k), time) is not None for k in client_ids], dtype=bool)

    def next_start(self, time):  # every window starts at 0: none later
        return None


def quadratic_sim(num_clients, speeds, concurrency, buffer, staleness="sqrt", steps=5, ends=None, **sections):
    """Clients f_k(x) = ½ z_k x² − x (z on a grid over [1, 3]), one-example minibatches of identical rows: a local
    step is x ← x − η (z_k x − 1) exactly."""
    config = {
        "data": {"name": "quadratic1d", "num_clients": num_clients},
        "model": {"name": "quadratic"},
        "client": {"lr": 0.1, "batch_size": 1, "steps": steps},
        "algorithm": {"name": "fedavg", "aggregation": "uniform"},
        "precision": "float64",
        **sections,
    }
    sim, state = build_simulation(driftlab.load_config(config))
    return asynchronous(sim, Speeds(tuple(speeds), ends), concurrency, buffer, staleness), state


def asynchronous(sim, profiles, concurrency, buffer, staleness="sqrt", declare=True):
    if declare:  # FedAvg's declaration (the algorithm module's) made here, so these tests do not depend on it
        sim.algorithm = dataclasses.replace(sim.algorithm, asynchronous=True)
    sim.system = SystemPlan(profiles)
    sim.asynchronous = AsynchronousPlan(concurrency, buffer, staleness)
    return sim


def updates(sim, state, count, evaluate_after=False):
    records = []
    for _ in range(count):
        state, record = run_update(sim, state, evaluate_after)
        commit_round(state)
        records.append(record)
    return state, records


def local_change(x, z, steps=5, lr=0.1):
    start = x
    for _ in range(steps):
        x = x - lr * (z * x - 1)
    return x - start


def test_two_clients_buffer_of_one_by_hand():
    # 5 steps of one example: client 0 (speed 5) takes 1 s, client 1 (speed 2) 2.5 s.  Both start at t = 0; client 0
    # returns every second and is sent out again at once (the only idle client), client 1 every 2.5 s.  Arrivals:
    # arrival at t   1  2  2.5  3  4  5 (client 0 first: same time, lower id)  5 (client 1)
    # of client      0  0  1    0  0  0                                        1
    # sent from θ^   0  1  0    2  4  5                                        3
    sim, state = quadratic_sim(2, (5.0, 2.0), concurrency=2, buffer=1)
    state, records = updates(sim, state, 7)
    assert [r["time_end"] for r in records] == [1.0, 2.0, 2.5, 3.0, 4.0, 5.0, 5.0]
    assert [r["time_start"] for r in records] == [0.0, 1.0, 2.0, 2.5, 3.0, 4.0, 5.0]
    assert [r["reporting_clients"] for r in records] == [[0], [0], [1], [0], [0], [0], [1]]
    assert [r["max_staleness"] for r in records] == [0, 0, 2, 1, 0, 0, 3]
    assert [r["num_dispatched"] for r in records] == [2, 1, 1, 1, 1, 1, 1]  # both at t = 0, then each refill
    assert all(
        r["num_reporting"] == r["num_selected"] == 1 and r["local_steps"] == 5 and r["num_left"] == 0 for r in records
    )
    z0, z1 = 1.0, 3.0
    theta = [0.0]
    arrivals = [(0, 0, z0), (1, 1, z0), (2, 0, z1), (3, 2, z0), (4, 4, z0), (5, 5, z0), (6, 3, z1)]  # (v, v_k, z_k)
    for version, started, z in arrivals:
        tau = version - started
        theta.append(theta[-1] + local_change(theta[started], z) / math.sqrt(1 + tau))
    assert float(state.server.params[0]) == pytest.approx(theta[-1], rel=1e-13)
    assert [r["model_norm"] for r in records] == pytest.approx([abs(t) for t in theta[1:]], rel=1e-13)


def test_a_buffer_averages_its_staleness_weighted_changes():
    # 6 steps at speeds 6, 3, 2: clients 0, 1, 2 take 1, 2, 3 s; C = 3, B = 2, constant weights.  Client 0 arrives at
    # 1 s and is sent again from θ⁰ (no update yet); at 2 s it arrives before client 1 (same time, lower id) and
    # fills the buffer: update 1 = two changes of client 0 from θ⁰.  Its slot is refilled with client 0 again (client
    # 1, still to be processed, is not idle) from θ¹; client 1 (from θ⁰) then client 0 (from θ¹, at 3 s, before client 2)
    # make update 2.
    sim, state = quadratic_sim(3, (6.0, 3.0, 2.0), concurrency=3, buffer=2, staleness="constant", steps=6)
    state, records = updates(sim, state, 3)
    assert [r["reporting_clients"] for r in records] == [[0, 0], [1, 0], [2, 0]]
    assert [r["time_end"] for r in records] == [2.0, 3.0, 4.0]
    assert [r["mean_staleness"] for r in records] == [0.0, 0.5, 1.0]
    z = np.linspace(1, 3, 3)

    def change(x, k):
        return local_change(x, z[k], steps=6)

    theta1 = 0.0 + (change(0.0, 0) + change(0.0, 0)) / 2
    theta2 = theta1 + (change(0.0, 1) + change(theta1, 0)) / 2
    theta3 = theta2 + (change(0.0, 2) + change(theta2, 0)) / 2
    assert [r["model_norm"] for r in records] == pytest.approx([abs(theta1), abs(theta2), abs(theta3)], rel=1e-13)


def test_ties_are_broken_by_client_id():
    sim, state = quadratic_sim(3, (5.0, 5.0, 5.0), concurrency=3, buffer=1)
    _, records = updates(sim, state, 3)
    assert [r["reporting_clients"] for r in records] == [[0], [1], [2]]
    assert [r["time_end"] for r in records] == [1.0, 1.0, 1.0]
    assert [r["max_staleness"] for r in records] == [0, 1, 2]


def test_full_buffer_of_equally_fast_clients_is_synchronous_fedavg_only_at_first():
    # B = C = N, equal speeds, constant weights.  Update 1 waits for every client, all from θ⁰: synchronous FedAvg's
    # round 1 (uniform, participation 1), up to rounding (the synchronous fold sums θ_k, the asynchronous one
    # θ⁰ + Σ (θ_k − θ⁰) / B).  It is not FedAvg after that, because a slot is refilled the moment its client arrives:
    # clients 0-2 arrive (at one time, by id) before client 3 completes the buffer, so they are sent out again from
    # θ^{v−1}; only client 3 starts from θ^v.  Every later update is θ^{v+1} = θ^v + (Σ_{k<3} Δ_k(θ^{v−1}) + Δ_3(θ^v)) / 4.
    sim, state = quadratic_sim(4, (5.0,) * 4, concurrency=4, buffer=4, staleness="constant")
    _, records = updates(sim, state, 4)
    sync_sim, sync_state = build_simulation(
        driftlab.load_config(
            {
                "data": {"name": "quadratic1d", "num_clients": 4},
                "model": {"name": "quadratic"},
                "client": {"lr": 0.1, "batch_size": 1, "steps": 5},
                "algorithm": {"name": "fedavg", "aggregation": "uniform"},
                "sampling": {"participation": 1.0},
                "precision": "float64",
            }
        )
    )
    _, sync_record = run_round(sync_sim, sync_state)
    assert records[0]["model_norm"] == pytest.approx(sync_record["model_norm"], rel=1e-14)
    assert (
        records[0]["upload_bits"] == sync_record["upload_bits"]
        and records[0]["local_steps"] == sync_record["local_steps"]
    )
    assert [r["reporting_clients"] for r in records] == [[0, 1, 2, 3]] * 4
    assert [r["time_end"] for r in records] == [1.0, 2.0, 3.0, 4.0]
    assert [r["mean_staleness"] for r in records] == [0.0, 0.75, 0.75, 0.75]
    assert [r["num_dispatched"] for r in records] == [7, 4, 4, 4]  # 4 at t = 0 and clients 0-2 again at 1 s
    z = np.linspace(1, 3, 4)
    theta = [0.0, sum(local_change(0.0, z[k]) for k in range(4)) / 4]
    for _ in range(3):
        theta.append(
            theta[-1] + (sum(local_change(theta[-2], z[k]) for k in range(3)) + local_change(theta[-1], z[3])) / 4
        )
    assert [r["model_norm"] for r in records] == pytest.approx([abs(t) for t in theta[1:]], rel=1e-13)


def test_a_client_whose_window_closes_first_is_discarded_at_its_arrival():
    # client 1 would arrive at 2.5 s but its window ends at 2 s: its work is dropped at 2.5 s, not trained
    sim, state = quadratic_sim(2, (5.0, 2.0), concurrency=2, buffer=1, ends=(math.inf, 2.0))
    _, records = updates(sim, state, 4)
    assert [r["time_end"] for r in records] == [1.0, 2.0, 3.0, 4.0]
    assert [r["num_left"] for r in records] == [0, 0, 1, 0]
    assert all(r["reporting_clients"] == [0] for r in records)
    assert records[2]["num_dispatched"] == 1  # client 0's refill; client 1 is unavailable from 2 s on: its slot waits


def test_a_run_with_nobody_in_flight_and_nobody_available_says_so():
    sim, state = quadratic_sim(1, (5.0,), concurrency=1, buffer=1, ends=(1.5,))
    state, _ = updates(sim, state, 1)  # arrives at 1 s, dispatched again, would arrive at 2 s: left
    with pytest.raises(RuntimeError, match="stalled at 2.0 simulated seconds"):
        run_update(sim, state)


def test_a_server_with_nobody_available_waits_for_the_next_window():
    # client 0: speed 5 (5 steps: 1 s) in [0, 1.5) and again from 10 s on; links take no time
    sim, state = quadratic_sim(1, (5.0,), concurrency=1, buffer=1)
    never = math.inf
    sim.system = SystemPlan(
        TraceProfiles(
            client=np.array([0, 0]),
            speed=np.array([5.0, 5.0]),
            download=np.array([never, never]),
            upload=np.array([never, never]),
            start=np.array([0.0, 10.0]),
            end=np.array([1.5, never]),
            num_clients=1,
        )
    )
    state, records = updates(sim, state, 2)
    # update 1 at 1 s; the client is sent again at 1 s, would arrive at 2 s after its window closed at 1.5 s (left);
    # nobody is available then, so the server waits for 10 s, sends it again, and it arrives at 11 s
    assert [(r["time_start"], r["time_end"], r["num_left"]) for r in records] == [(0.0, 1.0, 0), (1.0, 11.0, 1)]


def small_model_sim(backend="sequential", concurrency=4, buffer=2, declare=True, **extra):
    config = {
        "data": {"num_clients": 8},
        "client": {"steps": 3},
        "algorithm": {"name": "fedavg", "aggregation": "uniform"},
        "backend": backend,
        "seed": 3,
        **extra,
    }
    sim, state = build_simulation(driftlab.load_config(config))
    return asynchronous(sim, LognormalProfiles(3), concurrency, buffer, declare=declare), state


def test_same_bytes_with_one_and_two_threads():
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            sim, state = small_model_sim()
            state, records = updates(sim, state, 4)
            results.append(
                (state.server.params.clone(), [{k: v for k, v in r.items() if k != "round_seconds"} for r in records])
            )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]


def test_sequential_and_vectorized_backends_agree():
    outcomes = []
    for backend in ("sequential", "vectorized"):
        sim, state = small_model_sim(backend)
        state, records = updates(sim, state, 4)
        outcomes.append((state.server.params, records))
    (sequential, seq_records), (vectorized, vec_records) = outcomes
    keys = ("reporting_clients", "time_end", "max_staleness", "num_dispatched", "local_steps")
    assert [[r[k] for k in keys] for r in seq_records] == [[r[k] for k in keys] for r in vec_records]
    assert torch.allclose(sequential, vectorized, rtol=1e-5, atol=1e-6)


def test_a_restored_in_flight_state_continues_byte_for_byte():
    sim, state = small_model_sim(concurrency=5, buffer=2)
    straight, straight_records = updates(sim, state, 6)

    sim, state = small_model_sim(concurrency=5, buffer=2)
    state, _ = updates(sim, state, 3)
    assert state.in_flight.in_flight and any(c.result is not None for c in state.in_flight.in_flight)
    assert any(c.result is None for c in state.in_flight.in_flight)  # both kinds cross the checkpoint
    tensors = {name: tensor.clone() for name, tensor in in_flight_tensors(state.in_flight).items()}
    assert all(name.startswith("async/") for name in tensors)
    restored = restore_in_flight(sim, tensors)
    assert _same_flight(restored, state.in_flight)
    resumed = SimulationState(state.round, state.server, state.clients, clock=state.clock, in_flight=restored)
    resumed, resumed_records = updates(sim, resumed, 3)
    assert torch.equal(resumed.server.params, straight.server.params)
    without_wall_time = [{k: v for k, v in r.items() if k != "round_seconds"} for r in resumed_records]
    assert without_wall_time == [{k: v for k, v in r.items() if k != "round_seconds"} for r in straight_records[3:]]


def _same_flight(a, b):
    if (a.clock, a.version, a.next_dispatch, a.idle_slots) != (b.clock, b.version, b.next_dispatch, b.idle_slots):
        return False
    for x, y in zip(a.in_flight, b.in_flight, strict=True):
        if dataclasses.replace(x, result=None) != dataclasses.replace(y, result=None) or (x.result is None) != (
            y.result is None
        ):
            return False
        if x.result is not None and not torch.equal(x.result.change, y.result.change):
            return False
    return [v for v, _ in a.views] == [v for v, _ in b.views] and all(
        torch.equal(x.params, y.params) for (_, x), (_, y) in zip(a.views, b.views, strict=True)
    )


def test_no_restored_state_before_the_first_update():
    sim, _ = small_model_sim()
    assert restore_in_flight(sim, {"clock": torch.tensor(0.0, dtype=torch.float64)}) is None


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "adabest", "efl"])
def test_algorithms_without_an_asynchronous_rule_are_refused_with_the_seams_message(name):
    sim, _ = small_model_sim(algorithm={"name": name}, declare=False)
    assert asynchronous_problem(sim) == sim.algorithm.asynchronous_problem() is not None
    with pytest.raises(ValueError, match=name):
        check_asynchronous(sim)


def test_weighted_fedavg_is_refused():
    sim, _ = small_model_sim(algorithm={"name": "fedavg", "aggregation": "weighted"}, declare=False)
    problem = asynchronous_problem(sim)
    assert problem is not None and problem == sim.algorithm.asynchronous_problem()


def test_more_held_results_than_the_memory_budget_are_refused_naming_both_numbers():
    sim, _ = small_model_sim(concurrency=8, buffer=2)
    per_client = sim.initial_params.numel() * sim.initial_params.element_size()
    sim.memory_budget = MemoryBudget(configured=8 * (7 * per_client))  # a round gets an eighth: 7 clients' worth
    problem = asynchronous_problem(sim)
    assert f"{8 * per_client} bytes" in problem and f"{7 * per_client} bytes" in problem
    assert "lower asynchronous.concurrency or raise memory_budget" in problem
    sim.asynchronous = AsynchronousPlan(7, 2)
    assert asynchronous_problem(sim) is None


def test_only_the_server_model_is_evaluated():
    sim, _ = small_model_sim(evaluation={"model": "reporting_mean"})
    assert 'use evaluation.model = "server"' in asynchronous_problem(sim)


def test_membership_hooks_are_refused():
    sim, _ = small_model_sim()
    sim.algorithm = dataclasses.replace(sim.algorithm, client_joined=lambda server, client_state: server)
    assert "client_joined" in asynchronous_problem(sim)
