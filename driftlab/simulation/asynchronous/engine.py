"""FedBuff on the simulated clock: one call of ``run_update`` is one server update.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation" (AISTATS 2022), Algorithm 1, with the
FedOpt server (Reddi et al. 2021).  C clients are in flight at all times; client k, dispatched from model version
v_k, trains from θ^{v_k} and arrives at the time the timing model gives (``events``).  At each arrival, with v the
current version::

    τ_k = v − v_k,          s(τ) = 1/√(1 + τ)  (or 1: ``AsynchronousPlan.staleness_weight``)
    Δ_k = release(view_{v_k}, m_k)                       (FedAvg: θ_k − θ^{v_k})
    buffer ← buffer + s(τ_k) Δ_k                         (in arrival order)

and after B arrivals the algorithm's own fold runs over the B carriers ``restore(view_v, None, s(τ_k) Δ_k)`` with
``RoundContext(round = v + 1, mean_denominator = B)``::

    θ^{v+1} = ServerOpt(θ^v, −(1/B) Σ_k s(τ_k) Δ_k, η_g)

(for FedAvg/FedProx with uniform aggregation, whose fold is linear in the released vectors: ``seam.ReleaseForm``).
The slot a client frees is refilled at its arrival time, after the server update when that arrival completed the
buffer; a dispatch with nobody eligible leaves its slot idle until the next arrival.

Training is lazy and batched by version: when an arrival's result is needed, every dispatched-but-untrained client
of that version trains in one backend call (waves of the memory budget), through ``client_start``/``client_end`` as
in a synchronous round; results (Δ_k flat, upload bits, steps, the new client state) are held until their arrival.
Each dispatch trains with ``ClientContext.round = v_k + 1`` and a seed of its own (``events.dispatch_seed``).
Everything is a function of (seed, dispatch number, client id) and the state, so a resumed run equals an
uninterrupted one bit for bit, and the event order never depends on which thread finished first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import time as wall_clock
from typing import Any

import numpy as np

from driftlab.metrics.communication import payload_bits
from driftlab.optim.schedules import value_at
from driftlab.simulation.asynchronous.events import choose_client, dispatch_seed, work_seconds
from driftlab.simulation.asynchronous.state import AsynchronousState, HeldResult, InFlightClient, starting_state
from driftlab.simulation.round.client import ClientRound, client_end, client_start
from driftlab.simulation.round.engine import RoundWork, client_data, client_settings, finish_folded_round
from driftlab.simulation.round.ordered_fold import FoldedRound
from driftlab.simulation.round.setup import Simulation, SimulationState, wave_size
from driftlab.simulation.seam import ClientContext, RoundContext
from driftlab.simulation.state.state_store import state_bytes

# A synchronous round's counts that mean nothing here (nobody is sampled, nobody waits for a deadline).
_SYNCHRONOUS_ONLY = ("num_inactive", "num_incomplete", "num_missed_deadline", "num_not_awaited")


def asynchronous_problem(sim: Simulation) -> str | None:
    """Why ``sim`` cannot run asynchronously, with the fix; None when it can.  Asked before any work."""
    if sim.asynchronous is None:
        return "the simulation has no asynchronous plan ([asynchronous])"
    if sim.system is None:
        return "[asynchronous] needs [system]: arrival times come from the clients' devices; add [system]"
    refusal = sim.algorithm.asynchronous_problem()  # what it lacks (membership hooks included): driftlab.features
    if refusal is not None:
        return refusal
    if sim.evaluation.model != "server":
        return (
            f'evaluation.model = "{sim.evaluation.model}" is not defined for an asynchronous run (its clients train from '
            'different models); use evaluation.model = "server"'
        )
    initial = sim.algorithm.client_state_init
    per_client = state_bytes(sim.initial_params) + (
        state_bytes(initial(sim.initial_params)) if initial is not None else 0
    )
    held = sim.asynchronous.concurrency * per_client
    budget = sim.memory_budget.round_bytes
    if held > budget:
        return (
            f"{sim.asynchronous.concurrency} clients in flight hold up to {held} bytes of results (a model-sized change and "
            f"a client state each), more than the {budget} bytes a round may use; lower asynchronous.concurrency or "
            "raise memory_budget"
        )
    return None


def check_asynchronous(sim: Simulation) -> None:
    """Raise ValueError (what is wrong and the fix) unless ``sim`` can run asynchronously."""
    problem = asynchronous_problem(sim)
    if problem is not None:
        raise ValueError(problem)


def run_update(
    sim: Simulation, state: SimulationState, evaluate_after: bool = False
) -> tuple[SimulationState, dict[str, Any]]:
    """Server update ``state.round + 1``: fill the idle slots, process arrivals until B are buffered, update the server.

    Returns the new state (``in_flight``: the engine state after the update, ``clock``: its time) and the update's
    record.  Client states of the arrivals are staged in ``state.clients``; the caller commits them
    (``engine.commit_round``) once the record is on disk.
    """
    started = wall_clock.perf_counter()
    plan = sim.asynchronous
    if plan is None or sim.system is None:
        check_asynchronous(sim)
    flight = state.in_flight
    if flight is None:
        flight = starting_state(plan.concurrency, state.clock or 0.0, state.round)
    if flight.version != state.round:
        raise ValueError(f"the in-flight state is at model version {flight.version}, the server at {state.round}")
    interval = _Interval(sim, state, flight)
    interval.fill_slots(flight.clock)
    while interval.buffered < plan.buffer:
        interval.next_arrival()
    return interval.finish(evaluate_after, started)


@dataclasses.dataclass
class _Interval:
    """The events between two server updates (used by ``run_update`` only, never kept)."""

    sim: Simulation
    state: SimulationState
    flight: AsynchronousState

    def __post_init__(self) -> None:
        sim, flight = self.sim, self.flight
        self.version = flight.version
        self.round = flight.version + 1
        self.view = sim.algorithm.broadcast(self.state.server)
        self.view_bits = payload_bits(self.view)
        self.registered = sim.registered_at(self.round)
        self.fold = sim.algorithm.fold()
        self.context = RoundContext(
            round=self.round,
            num_registered=len(self.registered),
            num_selected=sim.asynchronous.buffer,
            server_learning_rate=value_at(sim.plan.server_lr, self.round),
            mean_denominator=float(sim.asynchronous.buffer),
        )
        self.accumulator = self.fold.start(self.state.server, self.context)
        self.clients = {client.dispatch: client for client in flight.in_flight}
        self.busy = {client.client_id for client in flight.in_flight}  # a client is in flight once at most
        self.queue = [(*client.order,) for client in flight.in_flight]
        heapq.heapify(self.queue)
        self.views = dict(flight.views)
        self.idle_slots = flight.idle_slots
        self.next_dispatch = flight.next_dispatch
        self.time = flight.clock
        self.buffered = 0
        self.staleness: list[int] = []
        self.reporting: list[int] = []
        self.upload_bits = 0
        self.local_steps = 0
        self.num_dispatched = 0
        self.num_left = 0

    # ------------------------------------------------------------------ dispatch

    def fill_slots(self, at: float) -> None:
        """Dispatch into every idle slot at time ``at``, while some client is eligible."""
        while self.idle_slots > 0:
            chosen = choose_client(
                self.sim.plan.seed, self.next_dispatch, self.registered, self.busy, self.sim.system.profiles, at
            )
            if chosen is None:
                return  # the slot waits for the next arrival
            self._dispatch(chosen, at)

    def _dispatch(self, client_id: int, at: float) -> None:
        sim = self.sim
        profile = sim.system.profiles.profile(client_id, at)
        if profile is None:
            raise RuntimeError(f"client {client_id} was chosen as available at {at} s but has no device profile then")
        num_samples = int(sim.client_sizes[client_id])
        steps = sim.plan.planned_steps(num_samples, self.round)
        seconds = work_seconds(profile, self.view_bits, steps, min(sim.plan.batch_size, num_samples), self.view_bits)
        arrives = at + seconds
        client = InFlightClient(
            client_id, self.next_dispatch, self.version, at, arrives, steps, left=profile.end < arrives
        )
        self.clients[client.dispatch] = client
        self.busy.add(client_id)
        heapq.heappush(self.queue, client.order)
        if client.needs_training:
            self.views[self.version] = self.view
        self.next_dispatch += 1
        self.idle_slots -= 1
        self.num_dispatched += 1

    # ------------------------------------------------------------------ arrivals

    def next_arrival(self) -> None:
        """Process the earliest arrival: fold its change into the buffer, then refill the slots (unless it filled it)."""
        while not self.queue:  # nobody in flight and nobody was available: the server waits for the next window
            later = self.sim.system.profiles.next_start(self.time)
            if later is None:
                raise RuntimeError(
                    f"the asynchronous run stalled at {self.time} simulated seconds: no client is in flight, none of the "
                    f"{len(self.registered)} registered clients is available and no trace window starts later; give the "
                    "trace windows that keep some client available until the run's last update"
                )
            self.time = later
            self.fill_slots(later)
        arrives, _, dispatch = heapq.heappop(self.queue)
        if self.clients[dispatch].needs_training:
            self._train_version(self.clients[dispatch].version)
        client = self.clients.pop(dispatch)
        self.busy.discard(client.client_id)
        self.time = arrives
        self.idle_slots += 1
        if client.left:
            self.num_left += 1
        else:
            result = client.result
            self.state.clients.put(client.client_id, result.client_state)
            self.local_steps += result.steps_done
            if result.change is not None:
                staleness = self.version - client.version
                weight = self.sim.asynchronous.staleness_weight(staleness)
                carrier = self.sim.algorithm.release.restore(self.view, None, result.change * weight)
                self.accumulator = self.fold.add(self.accumulator, carrier)
                self.buffered += 1
                self.staleness.append(staleness)
                self.reporting.append(client.client_id)
                self.upload_bits += result.upload_bits
        if self.buffered < self.sim.asynchronous.buffer:
            self.fill_slots(self.time)

    def _train_version(self, version: int) -> None:
        """Train every dispatched, untrained client of ``version`` (one backend call per wave); each in-flight client
        holds its result until it arrives."""
        waiting = sorted(
            (client for client in self.clients.values() if client.version == version and client.needs_training),
            key=lambda client: client.dispatch,
        )
        results = _train(self.sim, self.state, self.views[version], version, waiting)
        for client in waiting:
            self.clients[client.dispatch] = dataclasses.replace(client, result=results[client.dispatch])

    def finish(self, evaluate_after: bool, started: float) -> tuple[SimulationState, dict[str, Any]]:
        sim = self.sim
        server, metrics = self.fold.finish(self.state.server, self.accumulator, self.context)
        work = RoundWork(
            round=self.round,
            registered=self.registered,
            server=self.state.server,
            view=self.view,
            selected=np.asarray(self.reporting, dtype=np.int64),
            contexts=(),
            settings=client_settings(sim.plan, self.round, getattr(sim.backend, "precision", "float32")),
            server_lr=self.context.server_learning_rate,
            num_inactive=0,
            num_incomplete=0,
            started=started,
        )
        folded = FoldedRound(server, metrics, list(self.reporting), self.upload_bits, None)
        server, record = finish_folded_round(sim, work, folded, {}, evaluate_after=evaluate_after)
        for key in _SYNCHRONOUS_ONLY:
            record.pop(key, None)
        record.update(
            time_start=self.flight.clock,
            time_end=self.time,
            num_selected=self.buffered,
            num_reporting=self.buffered,
            mean_staleness=float(np.mean(self.staleness)),
            max_staleness=int(max(self.staleness)),
            num_dispatched=self.num_dispatched,
            num_left=self.num_left,
            upload_bits=int(self.upload_bits),
            download_bits=int(self.num_dispatched * self.view_bits),
            local_steps=int(self.local_steps),
        )
        record.pop("round_seconds", None)
        record["round_seconds"] = wall_clock.perf_counter() - started  # last, as in a synchronous record
        in_flight = tuple(sorted(self.clients.values(), key=lambda client: client.order))
        needed = sorted({client.version for client in in_flight if client.needs_training})
        flight = AsynchronousState(
            clock=self.time,
            version=self.round,
            next_dispatch=self.next_dispatch,
            idle_slots=self.idle_slots,
            in_flight=in_flight,
            views=tuple((version, self.views[version]) for version in needed),
        )
        return dataclasses.replace(
            self.state, round=self.round, server=server, clock=self.time, in_flight=flight
        ), record


def _train(
    sim: Simulation, state: SimulationState, view: Any, version: int, clients: list[InFlightClient]
) -> dict[int, HeldResult]:
    """``clients`` (all dispatched from ``version``, whose view is ``view``) trained together, in waves of the memory
    budget, through ``client_start``/``client_end`` as a synchronous round trains; their held results by dispatch."""
    round_index = version + 1
    plan = sim.plan
    registered = sim.registered_at(round_index)
    mean_samples = float(sim.client_sizes[registered].mean()) if len(registered) else 0.0
    base = client_settings(plan, round_index, getattr(sim.backend, "precision", "float32"))
    form = sim.algorithm.release
    initial = sim.algorithm.client_state_init
    size = wave_size(sim, initial(sim.initial_params) if initial is not None else None)
    results: dict[int, HeldResult] = {}
    for first in range(0, len(clients), size):
        wave = clients[first : first + size]
        ids = [client.client_id for client in wave]
        state.clients.prefetch(ids)
        contexts = [
            ClientContext(
                client_id=client.client_id,
                round=round_index,
                num_samples=int(sim.client_sizes[client.client_id]),
                mean_num_samples=mean_samples,
                num_registered=len(registered),
                planned_steps=client.steps,
                client_lr=base.local.client_lr,
            )
            for client in wave
        ]
        client_rounds = [
            ClientRound(
                sim.algorithm,
                view,
                state.clients.get(client.client_id),
                context,
                client_data(sim, client.client_id),
                dataclasses.replace(base, seed=dispatch_seed(plan.seed, client.dispatch, client.client_id)),
            )
            for client, context in zip(wave, contexts, strict=True)
        ]
        tasks = [client_start(client) for client in client_rounds]
        with contextlib.closing(
            sim.backend.train(sim.model, view.params, tasks, base.local, sim.training_data)
        ) as trained:
            for position, final_params, done in trained:
                new_state, message = client_end(client_rounds[position], final_params, done)
                change = form.release(view, message).detach() if message is not None else None
                results[wave[position].dispatch] = HeldResult(change, payload_bits(message), int(done), new_state)
                client_rounds[position] = tasks[position] = None
    return results


__all__ = ["asynchronous_problem", "check_asynchronous", "run_update"]
