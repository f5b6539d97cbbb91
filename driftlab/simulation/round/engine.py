"""The round loop: sample clients, train them, let the algorithm aggregate, evaluate.

The engine owns *how* clients run (sampling, availability, minibatches, the
training backend, client-state storage, bit accounting, evaluation); the
algorithm owns *what* they compute, through the functions of
``seam.Algorithm``.  The engine never looks at which algorithm it runs.

A round is a pure step ``(state, round t) -> (state, record)``: all randomness
comes from (seed, round, client id), so ``run_round`` on a restored state
repeats an uninterrupted run bit for bit.  It is three parts: ``plan_round``
(the server's plan: who trains, with which view and context), the client
phase (``simulation.client``: ``client_start``, the backend's local SGD,
``client_end``, in waves that fit the memory budget, each message folded into
the server update in sample order as its client finishes) and
``finish_folded_round`` (bits, metrics, evaluation, divergence checks);
``finish_round`` is the same finish for messages collected elsewhere (a
deployment's).

Divergence: a round whose server model has a non-finite entry, whose record
holds a non-finite number, whose evaluated loss exceeds
``EvaluationPlan.divergence_factor`` times the initial model's, or whose server
model's norm exceeds ``EvaluationPlan.norm_growth_factor`` times the model's
starting scale (``Simulation.norm_scale``) raises ``FloatingPointError`` naming
the round and the values; it returns no record, so nothing non-finite is ever
recorded.  The norm is computed every round, so the norm test runs in every
round, evaluated or not: a model that blows up between two evaluations is
stopped in the round it does, not recorded and checkpointed as healthy until the
next evaluation (a loss that explodes while the norm stays moderate is still
seen only where it is evaluated).

Messages: a client whose ``client_finish`` returns ``None`` as its message sends
nothing (an algorithm dropping incomplete work); inactive clients are not
trained and send nothing.  Both still received the broadcast.

A round may select nobody (``sampling.mode = "poisson"``), or every client it
selected may drop out or send nothing.  It is still a round: nobody trains, the
server state stays unless the algorithm's fold ``finishes_empty`` (a private
fold releases its noise and moves its clip on: ``OrderedFold`` calls its
``finish`` then), the record says so (``num_selected``/``num_reporting`` 0,
no bits, no local steps), and evaluation runs as scheduled (the
"reporting_mean" model of a round where nobody reported is the server's).

Simulated time (``Simulation.system``, config ``[system]``; docs/update-rules.md, "Simulated time").  Round t
starts at ``t_s = state.clock`` (0 before round 1).  Sampling draws among the registered clients available at
``t_s`` (their trace windows).  Each active client k, on its device p (looked up at ``t_s``), doing s_k steps
of ``b_k = min(batch_size, n_k)`` examples, is planned with the upload reserve ``|view|`` (every built-in's
uncompressed message is the size of its view; ``clock``):

    T_k(s) = |view| / p.download + s · b_k / p.speed + |view| / p.upload

* deadline D, partial: ``s_k ← max{s ≤ s_k : T_k(s) ≤ D}`` (``clock.steps_within``), a client cut short is
  incomplete (``available_steps < planned_steps``), as a straggler; no step fits: dropped.  Drop mode: a client
  with ``T_k(s_k) > D`` is dropped.  A client whose window ends before ``t_s + T_k(s_k)`` left before finishing:
  dropped.  Dropped clients are not trained (``num_missed_deadline``).
* over-selection f: ``⌈(1 + f) m⌉`` clients (draws) are selected for a cohort of m; the server awaits the first
  m draws' clients by planned arrival ``t_s + T_k(s_k)`` (ties by client id); the rest are neither trained
  nor counted (``num_not_awaited``).

Once a client's message exists its actual arrival is ``a_k = t_s + |view| / p.download + done_k · b_k /
p.speed + |m_k| / p.upload`` (a compressed message uploads faster).  A message arriving after the deadline or
its window is late: not folded, and the client's new state is discarded with it, as a dropout's
(``num_missed_deadline``).  The round ends at ``t_e = max_k a_k`` over the clients whose message is folded, or
at ``t_s + D`` when some awaited client missed the deadline (the server learns that only when D passes) or nothing
was folded (``t_s`` without a deadline).  A round starts when the previous one ended, or, when no registered client
is available then, when the first becomes available (``Profiles.next_start``: the server waits for a check-in).  The new state's ``clock`` is
``t_e``; the record gains ``time_start``, ``time_end``, ``num_missed_deadline`` and ``num_not_awaited``.
Untimed rounds take none of these steps: their records and models are those of a run without ``[system]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from driftlab.metrics.communication import payload_bits
from driftlab.optim.schedules import value_at
from driftlab.simulation.round.availability import steps_to_do
from driftlab.simulation.round.client import ClientData, ClientDataComputation, ClientSettings, client_end, client_start
from driftlab.simulation.backends.local_training import LocalSettings, single_threaded_clients
from driftlab.simulation.round.latest_models import LatestModels, LatestModelsUpdate, all_clients_mean, summed_store
from driftlab.simulation.round.ordered_fold import FoldedRound, OrderedFold
from driftlab.simulation.round.sampling import ClientSample, clients_per_round, over_selected, sample_clients
from driftlab.simulation.seam import ClientContext, RoundContext, plugin_note
from driftlab.simulation.state.state_store import (
    ClientStateStore,
)
from driftlab.simulation.evaluation import (
    DIVERGENCE_ADVICE,
    dissimilarity,
    divergence,
    evaluate,
    evaluate_personal,
    norm_growth,
    reference_losses,
)
from driftlab.simulation.round.setup import RoundPlan, Simulation, SimulationState, wave_size
from driftlab.simulation.time.clock import ClientTiming, client_timing, fits, steps_within
from driftlab.simulation.time.plan import DeviceProfile, SystemPlan


@dataclass(frozen=True)
class ClientClock:
    """What an awaited client's timing needs besides its steps and message: its device at the round's start and
    ``b_k = min(batch_size, n_k)``, the examples of one of its steps."""

    profile: DeviceProfile
    samples_per_step: int


@dataclass(frozen=True)
class RoundTiming:
    """A timed round's plan (module docstring, "Simulated time"): its start, deadline, the awaited clients' devices
    and the clients the plan already dropped or does not await."""

    start: float  # t_s, simulated seconds
    deadline: float | None  # D, seconds after the start; None: the round waits for its slowest counted client
    download_bits: int  # |view|: every client's download, and the upload reserve of the plan
    clients: Mapping[int, ClientClock]  # the awaited (trained) clients, by id
    num_missed_deadline: int  # dropped by the plan: no step fits the deadline, the work does not (drop mode), a window ends
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

    def end(self, arrivals: Mapping[int, float | None], counted: Any, missed: int) -> float:
        """``t_e``: the latest arrival of the ``counted`` clients (those whose message was folded); ``t_s + D`` when
        ``missed`` awaited clients did not make the deadline (the server cannot know that before D passes) or nobody
        was counted; ``t_s`` for a round without a deadline that counted nobody."""
        times = [arrivals[client_id] for client_id in counted]
        if self.deadline is not None and (missed > 0 or not times):
            return self.start + self.deadline
        return max(times) if times else self.start


@dataclass(frozen=True)
class RoundWork:
    """A planned round (``plan_round``): who trains, from which view, with which contexts and settings; nothing trained yet."""

    round: int
    registered: np.ndarray  # S_t
    server: Any  # the server state after the round's membership changes
    view: Any  # algorithm.broadcast(server): what every selected client receives (without Algorithm.client_view)
    selected: np.ndarray  # the sampled client ids, sorted and unique (multiplicities are in the contexts)
    contexts: tuple[ClientContext, ...]  # the active clients' (those with steps to do), in sample order
    settings: ClientSettings  # what every client needs of the round (seed, batch size, η_l, ...)
    server_lr: float
    num_inactive: int
    num_incomplete: int
    started: float  # time.perf_counter() when planning began, for the record's round_seconds
    timing: RoundTiming | None = None  # simulated time ([system]); None: the round is not timed
    prelude_bits: int = 0  # the vectors the clients uploaded in the round's first phase (Algorithm.prelude)
    # The client states at the round's start, (client id, state) in id order, for per-client views (Algorithm.client_view)
    client_states: Any = field(default=lambda: iter(()), repr=False, compare=False)

    def view_of(self, algorithm: Any, client_id: int) -> Any:
        """The view client ``client_id`` receives this round (``Algorithm.view_for``)."""
        return algorithm.view_for(self.server, client_id, self.view, self.client_states)

    def download_bits(self, algorithm: Any) -> int:
        """Bits sent to the selected clients: the shared view once per client, or each client's own view."""
        if algorithm.client_view is None:
            return int(payload_bits(self.view) * len(self.selected))
        return int(sum(payload_bits(self.view_of(algorithm, int(client_id))) for client_id in self.selected.tolist()))


def run_round(
    sim: Simulation, state: SimulationState, evaluate_after: bool = False, commit: bool = True
) -> tuple[SimulationState, dict[str, Any]]:
    """Run round ``state.round + 1``; returns the new state and the round's metrics record.

    ``plan_round``, then every active client through ``client_start``, the
    backend's local training and ``client_end`` (the functions a deployment
    client runs too), in waves that fit the memory budget (``wave_size``),
    each message folded into the server update as its client finishes, then
    the round's record (``finish_folded_round``).  Client states written during
    the round are staged in the stores and committed at the end;
    ``commit=False`` leaves that to the caller (``commit_round``), which the
    runner does only once the round's record is on disk, so an interruption
    anywhere leaves the stores at the last completed round.
    """
    if evaluate_after and sim.evaluation.divergence_factor:
        reference_losses(sim)  # once per process, outside the round's timing
    work = plan_round(sim, state)
    if sim.algorithm.prelude is not None:
        work = run_prelude(sim, work)
    keep_models = evaluate_after and sim.evaluation.model == "reporting_mean"
    folding = start_fold(sim, work, keep_models)
    latest = None
    if state.latest_models is not None:
        start = state.latest_sum if state.latest_sum is not None else summed_store(state.latest_models, sim.initial_params)
        latest = LatestModelsUpdate(start, [context.client_id for context in work.contexts])
    steps_done, arrivals = _train_clients(sim, state, work, folding, latest)
    latest_sum = latest.result() if latest is not None else None
    server, record = finish_folded_round(
        sim, work, folding.result(), steps_done, evaluate_after=evaluate_after, latest_models=state.latest_models, latest_sum=latest_sum,
        arrivals=arrivals, clients=state.clients,
    )
    clock = record["time_end"] if work.timing is not None else state.clock
    new_state = SimulationState(work.round, server, state.clients, state.latest_models, latest_sum, clock)
    if commit:
        commit_round(new_state)
    return new_state, record


def run_prelude(sim: Simulation, work: RoundWork) -> RoundWork:
    """The round's first phase (``seam.RoundPrelude``): every client with work computes its vector at the broadcast
    view, one after another in sample order on the client code path's computations (the same numbers on every
    backend); the server applies their weighted mean, and the clients train from the new state's view."""
    prelude = sim.algorithm.prelude
    if not work.contexts:
        return work
    total, weights, bits = None, 0.0, 0
    with single_threaded_clients(sim.device):
        for context in work.contexts:
            data = client_data(sim, context.client_id)
            computation = ClientDataComputation(data, work.settings.seed, work.round, context.client_id, work.settings)
            vector = prelude.compute(work.view_of(sim.algorithm, context.client_id), context, computation)
            weight = float(prelude.weight(context))
            total = vector * weight if total is None else total + vector * weight
            weights += weight
            bits += payload_bits(vector)
    server = prelude.apply(work.server, total / weights)
    return dataclasses.replace(work, server=server, view=sim.algorithm.broadcast(server), prelude_bits=bits)


def start_fold(sim: Simulation, work: RoundWork, keep_models: bool = False) -> OrderedFold:
    """The round's server update, ready to take its active clients' messages in any order (``OrderedFold``)."""
    return OrderedFold(
        sim.algorithm.fold(), work.server, round_context(work), [context.client_id for context in work.contexts], keep_models
    )


def round_context(work: RoundWork) -> RoundContext:
    return RoundContext(round=work.round, num_registered=len(work.registered), num_selected=len(work.selected), server_learning_rate=work.server_lr)


def plan_round(sim: Simulation, state: SimulationState) -> RoundWork:
    """Round ``state.round + 1`` up to local training: membership changes, sampling, availability, the clients'
    contexts, the view they receive and the round's rates; with ``sim.system``, the clients' timing, the deadline and
    over-selection (module docstring, "Simulated time").  Reads client states only for joining and leaving clients."""
    started = time.perf_counter()
    t = state.round + 1
    plan = sim.plan
    registered = sim.registered_at(t)
    server = _apply_membership_changes(sim, state, t)
    view = sim.algorithm.broadcast(server)
    sizes = sim.client_sizes[registered]
    start = _round_start(sim.system, registered, state.clock or 0.0) if sim.system is not None else None
    sample, cohort = _sample(sim, t, registered, start)
    client_lr = value_at(plan.client_lr, t)
    mean_samples = float(sizes.mean())
    download_bits = payload_bits(view) if sim.system is not None else 0
    active: list[tuple[int, int, int, int]] = []  # (client id, multiplicity, planned steps, steps to do)
    clocks: dict[int, tuple[ClientClock, float]] = {}  # a timed client's device and planned arrival
    num_inactive = num_missed_deadline = 0
    for client_id, multiplicity in zip(sample.client_ids.tolist(), sample.multiplicity.tolist(), strict=True):
        num_samples = int(sim.client_sizes[client_id])
        planned = plan.planned_steps(num_samples, t)
        steps = steps_to_do(plan.availability, plan.seed, t, client_id, planned, plan.partial_work_epoch(num_samples))
        if steps == 0:
            num_inactive += 1
            continue
        if sim.system is not None:
            clock = ClientClock(_profile_at(sim.system, client_id, start), min(plan.batch_size, num_samples))
            steps, arrival = _planned_work(sim.system, clock, start, download_bits, steps)
            if steps == 0:
                num_missed_deadline += 1
                continue
            clocks[client_id] = (clock, arrival)
        active.append((client_id, multiplicity, planned, steps))
    timing = None
    if sim.system is not None:
        awaited = _awaited(active, {client_id: arrival for client_id, (_, arrival) in clocks.items()}, cohort)
        timing = RoundTiming(
            start=start,
            deadline=sim.system.deadline,
            download_bits=download_bits,
            clients={client_id: clocks[client_id][0] for client_id in awaited},
            num_missed_deadline=num_missed_deadline,
            num_not_awaited=len(active) - len(awaited),
        )
        active = [entry for entry in active if entry[0] in awaited]
    contexts = tuple(
        ClientContext(
            client_id=client_id,
            round=t,
            num_samples=int(sim.client_sizes[client_id]),
            mean_num_samples=mean_samples,
            num_registered=len(registered),
            planned_steps=planned,
            client_lr=client_lr,
            multiplicity=multiplicity,
            available_steps=steps,
        )
        for client_id, multiplicity, planned, steps in active
    )
    # a deployment's client trains as this backend does
    settings = client_settings(plan, t, getattr(sim.backend, "precision", "float32"))
    return RoundWork(
        round=t,
        registered=registered,
        server=server,
        view=view,
        selected=sample.client_ids,
        contexts=contexts,
        settings=settings,
        server_lr=value_at(plan.server_lr, t),
        num_inactive=num_inactive,
        num_incomplete=sum(steps < planned for _, _, planned, steps in active),
        started=started,
        timing=timing,
        client_states=state.clients.items,  # committed states: this round's are staged apart until it ends
    )


def _sample(sim: Simulation, round_index: int, registered: np.ndarray, start: float | None) -> tuple[ClientSample, int]:
    """The round's sample and its cohort m (the draws the server awaits).  Timed (``start`` set): drawn among the
    registered clients available at ``start``, ``⌈(1 + f) m⌉`` of them with over-selection f; nobody available
    selects nobody."""
    plan = sim.plan
    if start is None:
        return sample_clients(plan.seed, round_index, registered, sim.client_sizes[registered], plan.participation, plan.sampling), 0
    candidates = registered[sim.system.profiles.available(registered, start)]
    if len(candidates) == 0:
        nobody = np.zeros(0, dtype=np.int64)
        return ClientSample(nobody, nobody), 0
    sizes = sim.client_sizes[candidates]
    if plan.sampling == "poisson":  # a cohort of random size: every selected client is awaited
        over_selected(1, sim.system.over_selection, len(candidates), plan.sampling)  # refuses over-selection
        sample = sample_clients(plan.seed, round_index, candidates, sizes, plan.participation, plan.sampling)
        return sample, int(sample.multiplicity.sum())
    cohort = clients_per_round(plan.participation, len(candidates))
    count = over_selected(cohort, sim.system.over_selection, len(candidates), plan.sampling)
    return sample_clients(plan.seed, round_index, candidates, sizes, plan.participation, plan.sampling, count), cohort


def _round_start(system: SystemPlan, registered: np.ndarray, clock: float) -> float:
    """When round t starts: at the end of round t − 1, or, when no registered client is available then (a gap in
    every trace window), when the first one becomes available: the server waits for a client to check in.  A run
    with nobody available ever again starts its rounds at ``clock``, and they select nobody."""
    start: float | None = clock
    while start is not None and not system.profiles.available(registered, start).any():
        start = system.profiles.next_start(start)
    return clock if start is None else start


def _profile_at(system: SystemPlan, client_id: int, start: float) -> DeviceProfile:
    profile = system.profiles.profile(client_id, start)
    if profile is None:
        raise ValueError(f"client {client_id} was sampled as available at {start} s, but its profile says it is not then")
    return profile


def _planned_work(system: SystemPlan, clock: ClientClock, start: float, download_bits: int, steps: int) -> tuple[int, float]:
    """The steps a client is asked for under the deadline and its window (0: dropped) and its planned arrival, with the
    upload reserve ``download_bits`` (module docstring, "Simulated time")."""
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


def _awaited(active: list[tuple[int, int, int, int]], arrivals: Mapping[int, float], cohort: int) -> set[int]:
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


def client_settings(plan: RoundPlan, round_index: int, precision: str) -> ClientSettings:
    """What every client of round ``round_index`` needs of it (seed, batch size, η_l, ...): ``plan_round``'s, and what a
    deployment's node checks a request against (from its own config's plan), so the two cannot drift apart."""
    return ClientSettings(
        seed=plan.seed,
        batch_size=plan.batch_size,
        local=LocalSettings(value_at(plan.client_lr, round_index), plan.weight_decay, plan.clip_norm),
        inexact_gamma=plan.inexact_gamma,
        augment=plan.augment,
        precision=precision,
    )


def client_data(sim: Simulation, client_id: int) -> ClientData:
    """Client ``client_id``'s data in the simulation: the shared training tensors and its rows."""
    return ClientData(sim.model, sim.training_data, sim.client_rows[client_id])


def _train_clients(
    sim: Simulation, state: SimulationState, work: RoundWork, folding: OrderedFold, latest: LatestModelsUpdate | None
) -> tuple[dict[int, int], dict[int, float | None]]:
    """The round's client phase, wave by wave: ``client_start`` for the wave's clients, the backend trains their tasks,
    ``client_end`` for each as it finishes, its message folded into ``folding``.  Returns the steps each client did
    and, in a timed round, each message's arrival time (None: late, so not folded and its client's new state not kept)."""
    steps_done: dict[int, int] = {}
    arrivals: dict[int, float | None] = {}
    contexts = work.contexts
    initial = sim.algorithm.client_state_init
    size = wave_size(sim, initial(sim.initial_params) if initial is not None else None)
    for first in range(0, len(contexts), size):
        wave = contexts[first : first + size]
        state.clients.prefetch([context.client_id for context in wave])  # one batched read of the wave's states
        if state.latest_models is not None:
            state.latest_models.prefetch([context.client_id for context in wave])
        client_states = [state.clients.get(context.client_id) for context in wave]
        datas = [client_data(sim, context.client_id) for context in wave]
        views = [work.view_of(sim.algorithm, context.client_id) for context in wave]
        tasks = [
            client_start(sim.algorithm, view, client_state, context, data, work.settings)
            for view, client_state, context, data in zip(views, client_states, wave, datas, strict=True)
        ]
        # closing(): a backend that changed process-wide settings (threads) restores them even if client_end raises.
        with contextlib.closing(sim.backend.train(sim.model, work.view.params, tasks, work.settings.local, sim.training_data)) as trained:
            for position, final_params, done in trained:
                context = wave[position]
                new_client_state, message = client_end(
                    sim.algorithm, views[position], client_states[position], context, datas[position], work.settings, final_params, done
                )
                views[position] = None
                steps_done[context.client_id] = done
                if work.timing is not None and message is not None:
                    arrival = arrivals[context.client_id] = work.timing.arrival(context.client_id, done, message)
                    if arrival is None:  # late: the server never sees its work, as a client that dropped out while uploading
                        folding.add(context.client_id, None)
                        client_states[position] = tasks[position] = new_client_state = message = None
                        continue
                # Staged at once (a disk store writes it to its staging file); the wave's lists let go of the client's tensors.
                state.clients.put(context.client_id, new_client_state)
                client_states[position] = tasks[position] = new_client_state = None
                if state.latest_models is not None:
                    latest.add(context.client_id, final_params, state.latest_models.get(context.client_id))
                    state.latest_models.put(context.client_id, final_params)
                folding.add(context.client_id, message, final_params)
    return steps_done, arrivals


def finish_round(
    sim: Simulation,
    work: RoundWork,
    messages: Mapping[int, Any],
    steps_done: Mapping[int, int],
    *,
    evaluate_after: bool = False,
    reporting_models: Mapping[int, torch.Tensor] | None = None,
    latest_models: ClientStateStore | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The server half of a planned round from its collected messages: the new server state and the round's record.

    ``messages`` and ``steps_done`` are keyed by client id, in any order (the
    order clients finished in); a client missing from ``messages`` or whose
    message is None sent nothing; in a timed round, a message arriving after
    the deadline is not folded (module docstring, "Simulated time").  The server update, the bits and every mean
    run over the messages in sample order (``work.contexts``), so the result
    never depends on completion order.  ``reporting_models`` (the reporting
    clients' final models) is needed only to evaluate the "reporting_mean"
    model, ``latest_models`` (the store, staged states included) only for
    "all_clients_mean".  Raises ``FloatingPointError`` on divergence (module
    docstring).
    """
    keep_models = evaluate_after and sim.evaluation.model == "reporting_mean"
    if keep_models and reporting_models is None and any(message is not None for message in messages.values()):
        raise ValueError('evaluation.model "reporting_mean" needs the reporting clients\' final models (reporting_models)')
    folding = start_fold(sim, work, keep_models)
    arrivals: dict[int, float | None] = {}
    for context in work.contexts:
        if context.client_id in messages:
            message = messages[context.client_id]
            if work.timing is not None and message is not None:
                arrival = arrivals[context.client_id] = work.timing.arrival(context.client_id, steps_done.get(context.client_id, 0), message)
                if arrival is None:
                    message = None  # late: not folded
            model = reporting_models.get(context.client_id) if keep_models and message is not None else None
            folding.add(context.client_id, message, model)
    return finish_folded_round(
        sim, work, folding.result(), steps_done, evaluate_after=evaluate_after, latest_models=latest_models, arrivals=arrivals
    )


def finish_folded_round(
    sim: Simulation,
    work: RoundWork,
    folded: FoldedRound,
    steps_done: Mapping[int, int],
    *,
    evaluate_after: bool = False,
    latest_models: ClientStateStore | None = None,
    latest_sum: LatestModels | None = None,
    arrivals: Mapping[int, float | None] | None = None,
    clients: ClientStateStore | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The round's record once its messages are folded (``start_fold``): bits, norms, evaluation, divergence checks.

    ``clients`` (the client-state store, this round's states staged) is read for the personalized evaluation
    (``evaluation.personal``); without it (a deployment: the nodes hold the personal models) that column is left out.

    ``latest_sum`` is the running sum of the latest models after this round (``latest_models``); without it,
    the "all_clients_mean" evaluation sums the store, staged models included.  A timed round (``work.timing``)
    needs ``arrivals``, the arrival time of every message sent (None: late, not folded), and adds its times and counts
    to the record."""
    t = work.round
    if evaluate_after and sim.evaluation.divergence_factor:
        reference_losses(sim)
    server = folded.server
    num_selected = len(work.selected)
    if not torch.isfinite(server.params).all():
        raise FloatingPointError(f"the run diverged in round {t}: the server model has non-finite entries; {DIVERGENCE_ADVICE}{plugin_note(sim.algorithm)}")
    record: dict[str, Any] = {
        "round": t,
        "num_selected": num_selected,
        "num_reporting": len(folded.reporting_clients),
        "reporting_clients": folded.reporting_clients,
        "num_inactive": work.num_inactive,
        "num_incomplete": work.num_incomplete,
        "local_steps": int(sum(steps_done.get(context.client_id, 0) for context in work.contexts)),  # a client drawn twice trains once
        "upload_bits": int(folded.upload_bits) + work.prelude_bits,
        "download_bits": work.download_bits(sim.algorithm),
        "client_lr": work.settings.local.client_lr,
        "server_lr": work.server_lr,
        "model_norm": float(torch.linalg.vector_norm(server.params)),
        **folded.metrics,
    }
    if work.timing is not None:
        record.update(_time_record(work, folded, arrivals))
    if evaluate_after:
        if sim.evaluation.model == "reporting_mean" and folded.reporting_clients:
            evaluated = folded.reporting_mean
        elif sim.evaluation.model == "all_clients_mean":
            if latest_models is None:
                raise ValueError('evaluation.model "all_clients_mean" needs the store of every client\'s latest model (latest_models)')
            if latest_sum is None:
                latest_sum = summed_store(latest_models, sim.initial_params, include_staged=True)
            evaluated = all_clients_mean(latest_sum, latest_models, work.registered, sim.data.num_clients, sim.initial_params)
        else:
            evaluated = server.params
        record.update(evaluate(sim, evaluated))
        if sim.evaluation.personal and sim.client_test_rows is not None and clients is not None:
            record.update(evaluate_personal(sim, server, clients, work.settings, t))
    if sim.evaluation.dissimilarity_every and t % sim.evaluation.dissimilarity_every == 0:
        record.update(dissimilarity(sim, server.params, work.registered))
    problem = divergence(record, sim.initial_losses, sim.evaluation.divergence_factor)
    if problem is None:
        problem = norm_growth(record["model_norm"], sim.norm_scale, sim.evaluation.norm_growth_factor)
    if problem is not None:
        raise FloatingPointError(f"the run diverged in round {t}: {problem}{plugin_note(sim.algorithm)}")
    record["round_seconds"] = time.perf_counter() - work.started
    return server, record


def _time_record(work: RoundWork, folded: FoldedRound, arrivals: Mapping[int, float | None] | None) -> dict[str, Any]:
    """A timed round's simulated start and end and the clients the clock cost it: dropped by the plan or late, and
    not awaited."""
    timing = work.timing
    arrivals = arrivals or {}
    missing = [client_id for client_id in folded.reporting_clients if arrivals.get(client_id) is None]
    if missing:
        raise ValueError(f"round {work.round} is timed, but clients {missing} were folded without an arrival time")
    missed = timing.num_missed_deadline + sum(arrival is None for arrival in arrivals.values())
    return {
        "time_start": timing.start,
        "time_end": timing.end(arrivals, folded.reporting_clients, missed),
        "num_missed_deadline": missed,
        "num_not_awaited": timing.num_not_awaited,
    }


def _apply_membership_changes(sim: Simulation, state: SimulationState, round_index: int) -> Any:
    """The server state after the clients that join or leave at the start of this round are accounted for."""
    server = state.server
    joined, left = sim.membership.changes_at(round_index)
    if sim.algorithm.client_joined is not None:
        for client_id in joined.tolist():
            server = sim.algorithm.client_joined(server, state.clients.get(client_id))
    if sim.algorithm.client_left is not None:
        for client_id in left.tolist():
            server = sim.algorithm.client_left(server, state.clients.get(client_id))
    return server


def commit_round(state: SimulationState) -> None:
    """Make the client states staged by ``run_round`` take effect."""
    state.clients.commit()
    if state.latest_models is not None:
        state.latest_models.commit()


def discard_round(state: SimulationState) -> None:
    """Forget client states staged by an interrupted round."""
    state.clients.discard()
    if state.latest_models is not None:
        state.latest_models.discard()
