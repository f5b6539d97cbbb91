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

Optional features are policies and observers with null objects, asked at fixed points, so the round tests none:

* simulated time (``[system]``): the round clock policy (``time.round_clock``) says which clients the round can
  reach, the steps each is asked for (none: dropped, not trained), which the server awaits, whether each message
  arrives in time (late: not folded, its client's new state not kept), the record's time keys and the new ``clock``;
  an untimed round gets its null policy, which drops nobody and finds nothing late, so its records and models are
  those of a run without ``[system]``;
* an algorithm's first phase (``prelude.run_prelude``; a one-phase round is the round as planned) and its membership
  hooks (``Membership.server_after_changes``);
* the round's observers of its trained clients: every client's latest model (``latest_models.observe_round``, for
  ``evaluation.model = "all_clients_mean"``) and the model's buffers, BatchNorm's running statistics
  (``buffers.observe_buffers``: each wave's starting buffers to the backend, the reporting clients' mean to the
  server before the round is evaluated; FedBN's own buffers kept), each a null observer when the run has none;
* the evaluated model (``evaluated_model``, from ``evaluation.model``) and, in ``simulation.evaluation``, the loss
  reference, the dissimilarity columns and the divergence tests.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from driftlab.metrics.communication import payload_bits
from driftlab.optim.schedules import value_at
from driftlab.simulation.backends.local_training import LocalSettings
from driftlab.simulation.evaluation import (
    DIVERGENCE_ADVICE,
    dissimilarity_columns,
    evaluate,
    personal_columns,
    prepare_reference,
    round_divergence,
)
from driftlab.simulation.round.availability import steps_to_do
from driftlab.simulation.round.buffers import observe_buffers
from driftlab.simulation.round.client import ClientRound, ClientSettings, client_data, client_end, client_start
from driftlab.simulation.round.latest_models import LatestModels, observe_round
from driftlab.simulation.round.ordered_fold import FoldedRound, OrderedFold
from driftlab.simulation.round.prelude import run_prelude
from driftlab.simulation.round.sampling import CohortDraw
from driftlab.simulation.round.setup import RoundPlan, Simulation, SimulationState, wave_size
from driftlab.simulation.seam import ClientContext, RoundContext, plugin_note
from driftlab.simulation.state.state_store import ClientStateStore
from driftlab.simulation.time.round_clock import UNTIMED_ROUND, RoundTimer, round_clock


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
    timing: RoundTimer = UNTIMED_ROUND  # the round's time under its clock policy (``round_clock``)
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

    ``plan_round`` and the round's first phase (``run_prelude``), then every
    active client through ``client_start``, the backend's local training and
    ``client_end`` (the functions a deployment client runs too), in waves that
    fit the memory budget (``wave_size``), each message folded into the server
    update as its client finishes and shown to the round's observers, then the
    round's record (``finish_folded_round``).  Client states written during
    the round are staged in the stores and committed at the end;
    ``commit=False`` leaves that to the caller (``commit_round``), which the
    runner does only once the round's record is on disk, so an interruption
    anywhere leaves the stores at the last completed round.
    """
    prepare_reference(sim, evaluate_after)  # once per process, outside the round's timing
    work = run_prelude(sim, plan_round(sim, state))
    folding = start_fold(sim, work, evaluate_after)
    order = [context.client_id for context in work.contexts]
    latest = observe_round(state.latest_models, state.latest_sum, sim.initial_params, order)
    buffers = observe_buffers(sim, work.contexts)
    steps_done, arrivals = _train_clients(sim, state, work, folding, latest, buffers)
    latest_sum = latest.result()
    buffers.finish()  # the server's buffers are the reporting clients' mean before the round is evaluated
    server, record = finish_folded_round(
        sim,
        work,
        folding.result(),
        steps_done,
        evaluate_after=evaluate_after,
        latest_models=state.latest_models,
        latest_sum=latest_sum,
        arrivals=arrivals,
        clients=state.clients,
    )
    clock = work.timing.clock_after(record, state.clock)
    new_state = SimulationState(work.round, server, state.clients, state.latest_models, latest_sum, clock)
    if commit:
        commit_round(new_state)
    return new_state, record


def start_fold(sim: Simulation, work: RoundWork, evaluate_after: bool = False) -> OrderedFold:
    """The round's server update, ready to take its active clients' messages in any order (``OrderedFold``), summing
    their final models too where the round's evaluated model is their mean."""
    return OrderedFold(
        sim.algorithm.fold(),
        work.server,
        round_context(work),
        [context.client_id for context in work.contexts],
        evaluate_after and sim.evaluation.evaluated_model.keeps_reporting_models,
    )


def round_context(work: RoundWork) -> RoundContext:
    return RoundContext(
        round=work.round,
        num_registered=len(work.registered),
        num_selected=len(work.selected),
        server_learning_rate=work.server_lr,
    )


def plan_round(sim: Simulation, state: SimulationState) -> RoundWork:
    """Round ``state.round + 1`` up to local training: membership changes, sampling, availability, the clients'
    contexts, the view they receive and the round's rates; the round clock policy (``round_clock``) picks the clients
    the round can reach, the steps they are asked for and those the server awaits.  Reads client states only for
    joining and leaving clients."""
    started = time.perf_counter()
    t = state.round + 1
    plan = sim.plan
    registered = sim.registered_at(t)
    server = sim.membership.server_after_changes(sim.algorithm, state.server, state.clients, t)
    view = sim.algorithm.broadcast(server)
    sizes = sim.client_sizes[registered]
    planner = round_clock(sim.system).plan(registered, state.clock, view)
    sample, cohort = planner.sample(
        CohortDraw(sim.plan.seed, sim.plan.participation, sim.plan.sampling, sim.client_sizes, t), registered
    )
    client_lr = value_at(plan.client_lr, t)
    mean_samples = float(sizes.mean())
    active: list[tuple[int, int, int, int]] = []  # (client id, multiplicity, planned steps, steps to do)
    num_inactive = 0
    for client_id, multiplicity in zip(sample.client_ids.tolist(), sample.multiplicity.tolist(), strict=True):
        num_samples = int(sim.client_sizes[client_id])
        planned = plan.planned_steps(num_samples, t)
        steps = steps_to_do(plan.availability, plan.seed, t, client_id, planned, plan.partial_work_epoch(num_samples))
        if steps == 0:
            num_inactive += 1
            continue
        steps = planner.client_steps(client_id, min(plan.batch_size, num_samples), steps)
        if steps > 0:  # else the clock dropped it (and counts it)
            active.append((client_id, multiplicity, planned, steps))
    active, timing = planner.awaited(active, cohort)
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


def _train_clients(
    sim: Simulation, state: SimulationState, work: RoundWork, folding: OrderedFold, latest: Any, buffers: Any
) -> tuple[dict[int, int], dict[int, float | None]]:
    """The round's client phase, wave by wave: ``client_start`` for the wave's clients, the backend trains their tasks,
    ``client_end`` for each as it finishes, its message folded into ``folding`` and the client shown to the round's
    observers (``latest``: its final model; ``buffers``: its final buffers).  Returns the steps each client did and
    the arrivals its clock noted (in a timed round each message's arrival time; None: late, so not folded and its
    client's new state not kept)."""
    steps_done: dict[int, int] = {}
    arrivals: dict[int, float | None] = {}
    contexts = work.contexts
    initial = sim.algorithm.client_state_init
    size = wave_size(sim, initial(sim.initial_params) if initial is not None else None)
    for first in range(0, len(contexts), size):
        wave = contexts[first : first + size]
        state.clients.prefetch([context.client_id for context in wave])  # one batched read of the wave's states
        latest.prefetch([context.client_id for context in wave])
        client_rounds = [
            ClientRound(
                sim.algorithm,
                work.view_of(sim.algorithm, context.client_id),
                state.clients.get(context.client_id),
                context,
                client_data(sim, context.client_id),
                work.settings,
            )
            for context in wave
        ]
        tasks = [client_start(client) for client in client_rounds]
        # closing(): a backend that changed process-wide settings (threads) restores them even if client_end raises.
        with contextlib.closing(
            sim.backend.train(
                sim.model,
                work.view.params,
                tasks,
                work.settings.local,
                sim.training_data,
                **buffers.backend_arguments(wave),
            )
        ) as trained:
            for position, final_params, done in trained:
                context = wave[position]
                new_client_state, message = client_end(client_rounds[position], final_params, done)
                steps_done[context.client_id] = done
                if not work.timing.received(arrivals, context.client_id, done, message):
                    # late: the server never sees its work, as a client that dropped out while uploading
                    folding.add(context.client_id, None)
                    client_rounds[position] = tasks[position] = new_client_state = message = None
                    continue
                # Staged at once (a disk store writes it to its staging file); the wave's lists let go of the client's tensors.
                state.clients.put(context.client_id, new_client_state)
                client_rounds[position] = tasks[position] = new_client_state = None
                buffers.client_trained(position, context.client_id, message)
                latest.client_trained(context.client_id, final_params)
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
    the deadline is not folded (``round_clock``).  The server update, the bits and every mean
    run over the messages in sample order (``work.contexts``), so the result
    never depends on completion order.  ``reporting_models`` (the reporting
    clients' final models) is needed only to evaluate the "reporting_mean"
    model, ``latest_models`` (the store, staged states included) only for
    "all_clients_mean".  Raises ``FloatingPointError`` on divergence (module
    docstring).
    """
    folding = start_fold(sim, work, evaluate_after)
    models = reporting_models if reporting_models is not None else {}
    arrivals: dict[int, float | None] = {}
    for context in work.contexts:
        if context.client_id in messages:
            message = messages[context.client_id]
            if not work.timing.received(arrivals, context.client_id, steps_done.get(context.client_id, 0), message):
                message = None  # late: not folded
            folding.add(context.client_id, message, models.get(context.client_id))
    return finish_folded_round(
        sim,
        work,
        folding.result(),
        steps_done,
        evaluate_after=evaluate_after,
        latest_models=latest_models,
        arrivals=arrivals,
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
    the "all_clients_mean" evaluation sums the store, staged models included.  ``arrivals`` are what the round's
    clock noted of each message sent (``RoundTimer.received``); the clock adds its keys to the record."""
    t = work.round
    prepare_reference(sim, evaluate_after)
    server = folded.server
    num_selected = len(work.selected)
    if not torch.isfinite(server.params).all():
        raise FloatingPointError(
            f"the run diverged in round {t}: the server model has non-finite entries; {DIVERGENCE_ADVICE}{plugin_note(sim.algorithm)}"
        )
    record: dict[str, Any] = {
        "round": t,
        "num_selected": num_selected,
        "num_reporting": len(folded.reporting_clients),
        "reporting_clients": folded.reporting_clients,
        "num_inactive": work.num_inactive,
        "num_incomplete": work.num_incomplete,
        "local_steps": int(
            sum(steps_done.get(context.client_id, 0) for context in work.contexts)
        ),  # a client drawn twice trains once
        "upload_bits": int(folded.upload_bits) + work.prelude_bits,
        "download_bits": work.download_bits(sim.algorithm),
        "client_lr": work.settings.local.client_lr,
        "server_lr": work.server_lr,
        "model_norm": float(torch.linalg.vector_norm(server.params)),
        **folded.metrics,
    }
    record.update(work.timing.record(t, folded.reporting_clients, arrivals))
    if evaluate_after:
        evaluated = sim.evaluation.evaluated_model.params(sim, work.registered, folded, latest_models, latest_sum)
        record.update(evaluate(sim, evaluated))
        record.update(personal_columns(sim, server, clients, work.settings, t))
    record.update(dissimilarity_columns(sim, server.params, work.registered, t))
    problem = round_divergence(sim, record)
    if problem is not None:
        raise FloatingPointError(f"the run diverged in round {t}: {problem}{plugin_note(sim.algorithm)}")
    record["round_seconds"] = time.perf_counter() - work.started
    return server, record


def commit_round(state: SimulationState) -> None:
    """Make the client states staged by ``run_round`` take effect."""
    for store in state.stores().values():
        store.commit()


def discard_round(state: SimulationState) -> None:
    """Forget client states staged by an interrupted round."""
    for store in state.stores().values():
        store.discard()
