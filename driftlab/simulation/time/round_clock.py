"""The synchronous round's clock policy: what simulated time (config ``[system]``) does to a round, at the fixed points
where the engine asks (docs/update-rules.md, "Simulated time").

The engine plans every round through ``round_clock(sim.system).plan(registered, clock, view)`` and never tests whether
the round is timed: ``UntimedClock`` is the null policy (its planner draws among every registered client, asks every
client for its steps and awaits it, its round adds nothing to the record and leaves the clock as it was), and
``SimulatedClock`` times the round from the ``SystemPlan``.

Round t starts at ``t_s``: the end of round t − 1 (``state.clock``, 0 before round 1), or, when no registered client
is available then, when the first becomes available (``Profiles.next_start``: the server waits for a check-in).  The
sample is drawn among the registered clients available at ``t_s``, ``⌈(1 + f) m⌉`` of them with over-selection f.
Each active client k, on its device p (looked up at ``t_s``), doing s_k steps of ``b_k = min(batch_size, n_k)``
examples, is planned with the upload reserve ``|view|`` (every built-in's uncompressed message is the size of its
view):

    T_k(s) = |view| / p.download + s · b_k / p.speed + |view| / p.upload

* deadline D, partial: ``s_k ← max{s ≤ s_k : T_k(s) ≤ D}`` (``clock.steps_within``); no step fits: dropped.  Drop
  mode: a client with ``T_k(s_k) > D`` is dropped.  A client whose window ends before ``t_s + T_k(s_k)`` left before
  finishing: dropped.  Dropped clients are not trained (``num_missed_deadline``).
* over-selection: the server awaits the first m draws' clients by planned arrival ``t_s + T_k(s_k)`` (ties by client
  id); the rest are neither trained nor counted (``num_not_awaited``).

Once a message m_k exists its arrival is ``a_k = t_s + |view| / p.download + done_k · b_k / p.speed + |m_k| /
p.upload``; after the deadline or the client's window it is late: not folded (``num_missed_deadline``).  The round
ends at ``t_e = max_k a_k`` over the folded messages, or at ``t_s + D`` when an awaited client missed the deadline
or nothing was folded (``t_s`` without a deadline); ``t_e`` is the new clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np
import torch

from driftlab.metrics.communication import payload_bits
from driftlab.simulation.time.clock import ClientTiming, client_timing, fits, steps_within
from driftlab.simulation.time.plan import DeviceProfile, SystemPlan

# (client id, multiplicity, planned steps, steps to do): a planned client, as the engine lists them
Active = tuple[int, int, int, int]
# a timed round's arrival time of each message sent, by client id (None: late)
Arrivals = dict[int, float | None]


class Draw(Protocol):
    """The engine's sampling, which the planner points at the clients the server can reach."""

    def __call__(self, candidates: np.ndarray, over_selection: float) -> tuple[Any, int]:
        """The sample drawn among ``candidates`` with ``over_selection`` f, and its cohort m (the draws awaited)."""
        ...

    def nobody(self) -> Any:
        """The empty sample."""
        ...


class RoundTimer(Protocol):
    """A planned round's time (``RoundWork.timing``): when each message arrives, what the record says, the new clock."""

    def received(self, arrivals: Arrivals, client_id: int, steps_done: int, message: Any) -> bool:
        """Whether ``message`` is on time, so folded; notes its arrival in ``arrivals`` (None: late)."""
        ...

    def record(self, round_index: int, counted: list[int], arrivals: Arrivals | None) -> dict[str, Any]:
        """The round's time keys for its record, once ``counted`` (the folded clients) are known."""
        ...

    def clock_after(self, record: Mapping[str, Any], clock: float | None) -> float | None:
        """The clock at the end of the round whose record is ``record`` (``clock``: at its start)."""
        ...


class RoundPlanner(Protocol):
    """The clock's part of planning one round (``RoundClock.plan``), called by ``plan_round`` in this order."""

    def sample(self, draw: Draw, registered: np.ndarray) -> tuple[Any, int]:
        """The round's sample and cohort, drawn by ``draw`` among the clients the clock lets the server reach."""
        ...

    def client_steps(self, client_id: int, samples_per_step: int, steps: int) -> int:
        """The steps client ``client_id`` is asked for (0: the clock drops it, and counts it)."""
        ...

    def awaited(self, active: list[Active], cohort: int) -> tuple[list[Active], RoundTimer]:
        """The clients the server awaits (in ``active``'s order) and the planned round's timer."""
        ...


class RoundClock(Protocol):
    """A run's round clock policy (``round_clock``): what time does to each of its rounds."""

    def plan(self, registered: np.ndarray, clock: float | None, view: Any) -> RoundPlanner:
        """Start planning the round that follows a round ending at ``clock``, broadcasting ``view``."""
        ...


@dataclass(frozen=True)
class UntimedRound:
    """The null timer: every message is on time, the record gains nothing, the clock stays."""

    def received(self, arrivals: Arrivals, client_id: int, steps_done: int, message: Any) -> bool:  # noqa: ARG002
        return True

    def record(self, round_index: int, counted: list[int], arrivals: Arrivals | None) -> dict[str, Any]:  # noqa: ARG002
        return {}

    def clock_after(self, record: Mapping[str, Any], clock: float | None) -> float | None:  # noqa: ARG002
        return clock


UNTIMED_ROUND = UntimedRound()


@dataclass(frozen=True)
class UntimedClock:
    """The null policy (no ``[system]``): every registered client may be drawn, does its steps and is awaited."""

    def plan(self, registered: np.ndarray, clock: float | None, view: Any) -> UntimedClock:  # noqa: ARG002
        return self

    def sample(self, draw: Draw, registered: np.ndarray) -> tuple[Any, int]:
        return draw(registered, 0.0)  # count = m draws exactly the sample of a run without over-selection

    def client_steps(self, client_id: int, samples_per_step: int, steps: int) -> int:  # noqa: ARG002
        return steps

    def awaited(self, active: list[Active], cohort: int) -> tuple[list[Active], RoundTimer]:  # noqa: ARG002
        return active, UNTIMED_ROUND


@dataclass(frozen=True)
class ClientClock:
    """What an awaited client's timing needs besides its steps and message: its device at the round's start and
    ``b_k = min(batch_size, n_k)``, the examples of one of its steps."""

    profile: DeviceProfile
    samples_per_step: int


@dataclass(frozen=True)
class RoundTiming:
    """A timed round's plan: its start, deadline, the awaited clients' devices and the clients the plan already
    dropped or does not await."""

    start: float  # t_s, simulated seconds
    deadline: float | None  # D, seconds after the start; None: the round waits for its slowest counted client
    download_bits: int  # |view|: every client's download, and the upload reserve of the plan
    clients: Mapping[int, ClientClock]  # the awaited (trained) clients, by id
    # dropped by the plan: no step fits the deadline, the work does not (drop mode), a window ends first
    num_missed_deadline: int
    num_not_awaited: int  # over-selected clients beyond the first m

    def client_timing(self, client_id: int, steps_done: int, upload_bits: int) -> ClientTiming:
        """Client ``client_id``'s download, ``steps_done`` steps and an upload of ``upload_bits``."""
        clock = self.clients[client_id]
        return client_timing(clock.profile, self.download_bits, steps_done, clock.samples_per_step, upload_bits)

    def arrival(self, client_id: int, steps_done: int, message: Any) -> float | None:
        """When client ``client_id``'s ``message`` reaches the server; None when it is late (after the deadline or the
        end of the client's window) or there is no message."""
        if message is None:
            return None
        timing = self.client_timing(client_id, steps_done, payload_bits(message))
        arrival = self.start + timing.total
        if not fits(self.deadline, timing) or arrival > self.clients[client_id].profile.end:
            return None
        return arrival

    def received(self, arrivals: Arrivals, client_id: int, steps_done: int, message: Any) -> bool:
        if message is None:
            return True  # nothing sent, nothing late
        arrivals[client_id] = self.arrival(client_id, steps_done, message)
        return arrivals[client_id] is not None

    def end(self, arrivals: Mapping[int, float | None], counted: Any, missed: int) -> float:
        """``t_e``: the latest arrival of the ``counted`` clients (those whose message was folded); ``t_s + D`` when
        ``missed`` awaited clients did not make the deadline (the server cannot know that before D passes) or nobody
        was counted; ``t_s`` for a round without a deadline that counted nobody."""
        times = [arrivals[client_id] for client_id in counted]
        if self.deadline is not None and (missed > 0 or not times):
            return self.start + self.deadline
        return max(times) if times else self.start

    def record(self, round_index: int, counted: list[int], arrivals: Arrivals | None) -> dict[str, Any]:
        """The round's simulated start and end and the clients the clock cost it: dropped by the plan or late, and
        not awaited."""
        arrivals = arrivals or {}
        missing = [client_id for client_id in counted if arrivals.get(client_id) is None]
        if missing:
            raise ValueError(f"round {round_index} is timed, but clients {missing} were folded without an arrival time")
        missed = self.num_missed_deadline + sum(arrival is None for arrival in arrivals.values())
        return {
            "time_start": self.start,
            "time_end": self.end(arrivals, counted, missed),
            "num_missed_deadline": missed,
            "num_not_awaited": self.num_not_awaited,
        }

    def clock_after(self, record: Mapping[str, Any], clock: float | None) -> float | None:  # noqa: ARG002
        return record["time_end"]


@dataclass(frozen=True)
class SimulatedClock:
    """Rounds timed by a ``SystemPlan`` (module docstring)."""

    system: SystemPlan

    def plan(self, registered: np.ndarray, clock: float | None, view: Any) -> _TimedPlanner:
        start = round_start(self.system, registered, clock or 0.0)
        return _TimedPlanner(self.system, start, payload_bits(view))


@dataclass
class _TimedPlanner:
    """One timed round being planned (``SimulatedClock.plan``): the devices and planned arrivals of its clients."""

    system: SystemPlan
    start: float
    download_bits: int
    clocks: dict[int, tuple[ClientClock, float]] = field(default_factory=dict)  # a client's device, planned arrival
    num_missed_deadline: int = 0

    def sample(self, draw: Draw, registered: np.ndarray) -> tuple[Any, int]:
        """Drawn among the registered clients available at the round's start; nobody available selects nobody."""
        candidates = registered[self.system.profiles.available(registered, self.start)]
        if len(candidates) == 0:
            return draw.nobody(), 0
        return draw(candidates, self.system.over_selection)

    def client_steps(self, client_id: int, samples_per_step: int, steps: int) -> int:
        clock = ClientClock(profile_at(self.system, client_id, self.start), samples_per_step)
        steps, arrival = planned_work(self.system, clock, self.start, self.download_bits, steps)
        if steps == 0:
            self.num_missed_deadline += 1
        else:
            self.clocks[client_id] = (clock, arrival)
        return steps

    def awaited(self, active: list[Active], cohort: int) -> tuple[list[Active], RoundTimer]:
        arrivals = {client_id: arrival for client_id, (_, arrival) in self.clocks.items()}
        awaited = awaited_clients(active, arrivals, cohort)
        timing = RoundTiming(
            start=self.start,
            deadline=self.system.deadline,
            download_bits=self.download_bits,
            clients={client_id: self.clocks[client_id][0] for client_id in awaited},
            num_missed_deadline=self.num_missed_deadline,
            num_not_awaited=len(active) - len(awaited),
        )
        return [entry for entry in active if entry[0] in awaited], timing


def round_clock(system: SystemPlan | None) -> RoundClock:
    """The policy of a run's rounds: timed by ``system``, or untimed without one."""
    return UNTIMED if system is None else SimulatedClock(system)


UNTIMED = UntimedClock()


def round_start(system: SystemPlan, registered: np.ndarray, clock: float) -> float:
    """When round t starts: at the end of round t − 1, or, when no registered client is available then (a gap in
    every trace window), when the first one becomes available: the server waits for a client to check in.  A run
    with nobody available ever again starts its rounds at ``clock``, and they select nobody."""
    start: float | None = clock
    while start is not None and not system.profiles.available(registered, start).any():
        start = system.profiles.next_start(start)
    return clock if start is None else start


def profile_at(system: SystemPlan, client_id: int, start: float) -> DeviceProfile:
    profile = system.profiles.profile(client_id, start)
    if profile is None:
        raise ValueError(
            f"client {client_id} was sampled as available at {start} s, but its profile says it is not then"
        )
    return profile


def planned_work(
    system: SystemPlan, clock: ClientClock, start: float, download_bits: int, steps: int
) -> tuple[int, float]:
    """The steps a client is asked for under the deadline and its window (0: dropped) and its planned arrival, with the
    upload reserve ``download_bits`` (module docstring)."""
    profile, samples_per_step = clock.profile, clock.samples_per_step
    if system.deadline is not None and system.deadline_mode == "partial":
        steps = steps_within(system.deadline, profile, download_bits, download_bits, samples_per_step, steps)
        if steps == 0:
            return 0, start
    timing = client_timing(profile, download_bits, steps, samples_per_step, download_bits)
    arrival = start + timing.total
    if not fits(system.deadline, timing) or arrival > profile.end:
        return 0, start
    return steps, arrival


def awaited_clients(active: list[Active], arrivals: Mapping[int, float], cohort: int) -> set[int]:
    """The clients the server awaits: the first by planned arrival (ties by client id) until their draws reach the
    cohort m; everyone without over-selection (their draws never exceed m)."""
    awaited: set[int] = set()
    draws = 0
    for client_id, multiplicity, _, _ in sorted(active, key=lambda entry: (arrivals[entry[0]], entry[0])):
        if draws >= cohort:
            break
        awaited.add(client_id)
        draws += multiplicity
    return awaited


CLOCK = "clock"  # the checkpoint's engine/clock: simulated seconds at the end of its round


@dataclass(frozen=True)
class ClockExtra:
    """``SimulationState.clock`` in a checkpoint (engine/clock, float64): a resumed timed run's next round starts
    where the checkpointed one ended."""

    def engine_tensors(self, state: Any, disk_stores: Mapping[str, Any]) -> dict[str, torch.Tensor]:  # noqa: ARG002
        return {} if state.clock is None else {CLOCK: torch.tensor(state.clock, dtype=torch.float64)}

    def restored(self, sim: Any, state: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:  # noqa: ARG002
        return {"clock": float(tensors[CLOCK].item())} if CLOCK in tensors else {}
