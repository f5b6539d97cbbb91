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
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from driftlab.data.federated import FederatedDataset
from driftlab.metrics.communication import payload_bits
from driftlab.optim.schedules import steps_at, value_at
from driftlab.simulation.augmentation import flip_crop_from_keys
from driftlab.simulation.availability import ALWAYS_AVAILABLE, AvailabilityModel, Membership, steps_to_do
from driftlab.simulation.client import ClientData, ClientSettings, client_end, client_start
from driftlab.simulation.flat import FlatModel
from driftlab.simulation.local_training import LocalSettings, TrainingBackend, TrainingData, steps_for_epochs
from driftlab.simulation.randomness import Stream, generator
from driftlab.simulation.latest_models import LatestModels, LatestModelsUpdate, all_clients_mean, summed_store
from driftlab.simulation.ordered_fold import FoldedRound, OrderedFold
from driftlab.simulation.sampling import sample_clients
from driftlab.simulation.seam import Algorithm, ClientContext, RoundContext, plugin_note
from driftlab.simulation.memory_budget import MemoryBudget
from driftlab.simulation.state_store import (
    ClientStateStore,
    DiskClientStore,
    InMemoryClientStore,
    state_bytes,
)

EVALUATED_MODELS = ("server", "reporting_mean", "all_clients_mean")


@dataclass(frozen=True)
class RoundPlan:
    """How clients are asked to work; rates and counts are constants or schedules of the round."""

    seed: int
    participation: float
    sampling: str
    batch_size: int
    client_lr: Any
    server_lr: Any
    local_epochs: int | None
    steps: Any  # K: an int or a schedule of the round (config client.steps), used when local_epochs is None
    weight_decay: float = 0.0
    clip_norm: float | None = None
    inexact_gamma: float | None = None  # FedProx's γ-inexact local solver; None: always do the planned steps
    availability: AvailabilityModel = ALWAYS_AVAILABLE
    augment: bool = False  # CIFAR training augmentation (flip, pad-4 crop) of every local step's minibatch

    def planned_steps(self, num_samples: int, round_index: int) -> int:
        if self.local_epochs is not None:
            return steps_for_epochs(num_samples, self.batch_size, self.local_epochs)
        return steps_at(self.steps, round_index)

    def steps_per_epoch(self, num_samples: int) -> int:
        return steps_for_epochs(num_samples, self.batch_size, 1)

    def partial_work_epoch(self, num_samples: int) -> int:
        """The epoch length a straggler's work is cut in: whole epochs when work is given in
        epochs, single steps (0) when it is a fixed step count K."""
        return self.steps_per_epoch(num_samples) if self.local_epochs is not None else 0


@dataclass(frozen=True)
class EvaluationPlan:
    every: int = 1
    model: str = "server"  # which model is evaluated, one of EVALUATED_MODELS
    dissimilarity_every: int = 0  # 0: never compute B(θ)² and the gradient variance
    batch_size: int = 4096
    # An evaluated train or test loss above this multiple of the initial model's is divergence; 0: off.
    divergence_factor: float = 0.0
    # A server model norm above this multiple of Simulation.norm_scale is divergence, tested every round; 0: off.
    norm_growth_factor: float = 0.0
    # train_loss over the data of this many clients, a sample fixed by the seed; 0 (or at least every client): all.
    train_loss_clients: int = 0


@dataclass
class Simulation:
    """Everything a round needs that does not change from round to round."""

    model: FlatModel
    data: FederatedDataset
    algorithm: Algorithm
    backend: TrainingBackend
    plan: RoundPlan
    device: torch.device
    dtype: torch.dtype
    initial_params: torch.Tensor
    evaluation: EvaluationPlan = EvaluationPlan()
    membership: Membership | None = None  # None: every client registered in every round
    # The run's memory budget (config memory_budget, parsed once by assembly): waves, store caches and chunks
    # are sized from it.  The default is the unconfigured budget (half the machine; waves of 1 GiB).
    memory_budget: MemoryBudget = MemoryBudget()
    training_data: TrainingData = field(init=False, repr=False)
    test_data: TrainingData = field(init=False, repr=False)
    client_rows: list[torch.Tensor] = field(init=False, repr=False)
    client_test_rows: list[torch.Tensor] | None = field(init=False, repr=False)
    client_test_union: torch.Tensor | None = field(init=False, repr=False)  # every client's test rows, client after client
    union_rows: torch.Tensor = field(init=False, repr=False)
    train_loss_rows: torch.Tensor = field(init=False, repr=False)  # the rows train_loss is the mean over
    client_sizes: np.ndarray = field(init=False, repr=False)
    # The initial model's evaluated losses, the reference of the divergence test; computed on first use.
    initial_losses: dict[str, float] | None = field(init=False, repr=False, default=None)
    # The initial model's test accuracy (classifiers), computed with initial_losses: a report's round-0 point.
    initial_accuracy: float | None = field(init=False, repr=False, default=None)
    # The model's starting scale, the norm test's reference (``norm_scale``): fixed by the initial model and its size.
    norm_scale: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.evaluation.model not in EVALUATED_MODELS:
            raise ValueError(f"unknown evaluated model {self.evaluation.model!r}; valid: {', '.join(EVALUATED_MODELS)}")
        inputs_dtype = self.dtype if self.data.train_inputs.is_floating_point() else self.data.train_inputs.dtype
        augment = None
        if self.plan.augment:
            if self.data.train_inputs.dim() != 4:
                raise ValueError(f"data.augment needs image inputs [n, c, h, w], got shape {tuple(self.data.train_inputs.shape)}")
            augment = flip_crop_from_keys  # padding 4, crop with probability 1/2: the FedDyn authors' CIFAR augmentation
        # Multi-label targets are float (multi-hot) and take the arithmetic's dtype; class ids stay int64.
        targets_dtype = self.dtype if self.data.train_targets.is_floating_point() else self.data.train_targets.dtype
        # uint8 pixels stay uint8 (inputs_dtype); each gathered batch is normalised in float32, then cast to the run's dtype.
        pixels = self.data.input_normalisation
        normalisation = None if pixels is None else dataclasses.replace(pixels, dtype=self.dtype)
        self.training_data = TrainingData(
            self.data.train_inputs.to(self.device, inputs_dtype), self.data.train_targets.to(self.device, targets_dtype), augment, normalisation
        )
        self.test_data = TrainingData(
            self.data.test_inputs.to(self.device, inputs_dtype), self.data.test_targets.to(self.device, targets_dtype), normalisation=normalisation
        )
        self.client_rows = [torch.tensor(rows, dtype=torch.long, device=self.device) for rows in self.data.client_indices]
        self.client_test_rows = (
            None
            if self.data.client_test_indices is None
            else [torch.tensor(rows, dtype=torch.long, device=self.device) for rows in self.data.client_test_indices]
        )
        self.client_test_union = None
        if self.client_test_rows is not None:
            self.client_test_union = torch.cat(self.client_test_rows) if self.client_test_rows else torch.zeros(0, dtype=torch.long, device=self.device)
        self.union_rows = torch.cat(self.client_rows)
        self.train_loss_rows = self.union_rows
        sampled = self.evaluation.train_loss_clients
        if 0 < sampled < self.data.num_clients:
            rng = generator(self.plan.seed, Stream.EVALUATION_SAMPLE)
            chosen = np.sort(rng.choice(self.data.num_clients, size=sampled, replace=False))
            rows = torch.cat([self.client_rows[client_id] for client_id in chosen.tolist()])
            self.train_loss_rows = rows if len(rows) else self.union_rows  # a sample of empty clients: all the data
        self.client_sizes = self.data.client_sizes
        self.norm_scale = norm_scale(self.initial_params)
        if self.membership is None:
            self.membership = Membership(self.data.num_clients)
        elif self.membership.num_clients != self.data.num_clients:
            raise ValueError(f"the membership schedule is for {self.membership.num_clients} clients, the data set has {self.data.num_clients}")

    def registered_at(self, round_index: int) -> np.ndarray:
        """``S_t``: the clients registered in round ``round_index``."""
        return self.membership.registered_at(round_index)


@dataclass(frozen=True)
class SimulationState:
    round: int  # last completed round (0 before training)
    server: Any
    clients: ClientStateStore
    # Every client's latest local model, kept only when the evaluated model is "all_clients_mean",
    # and their running sum (None: not yet computed from the store, e.g. after an older checkpoint).
    latest_models: ClientStateStore | None = None
    latest_sum: LatestModels | None = None


STORE_KINDS = ("memory", "disk", "auto")


def make_client_stores(
    kind: str,
    num_clients: int,
    initial_params: torch.Tensor,
    client_initial: Any,
    keep_latest_models: bool,
    directory: Any,
    memory_budget: MemoryBudget = MemoryBudget(),
) -> tuple[ClientStateStore, ClientStateStore | None]:
    """The store of the algorithm's client states and, when ``keep_latest_models``, of every client's latest model.

    ``kind`` "auto" means disk when ``num_clients`` states (and latest models) would take more
    than ``memory_budget.host_bytes`` (the configured budget, else half of the machine's memory).
    Disk stores live in ``directory``/clients and ``directory``/latest_models; ``directory`` is a
    callable giving the directory, so a memory run never creates one.
    """
    if kind not in STORE_KINDS:
        raise ValueError(f"unknown client-state store {kind!r}; valid: {', '.join(STORE_KINDS)}")
    if not isinstance(memory_budget, MemoryBudget):
        raise TypeError(f"memory_budget must be a MemoryBudget (MemoryBudget.for_run parses the setting), got {memory_budget!r}")
    template = client_initial(initial_params) if client_initial is not None else None
    per_client = (state_bytes(template) if template is not None else 0) + (state_bytes(initial_params) if keep_latest_models else 0)
    if kind == "auto":
        kind = "disk" if per_client * num_clients > memory_budget.host_bytes else "memory"
    initial = (lambda: client_initial(initial_params)) if client_initial is not None else None
    if kind == "memory":
        return InMemoryClientStore(initial), InMemoryClientStore(None) if keep_latest_models else None
    root = directory()
    stores = [template is not None, keep_latest_models]
    cache = memory_budget.cache_bytes(sum(stores))
    clients = DiskClientStore(root / "clients", num_clients, template, initial, cache) if template is not None else InMemoryClientStore(None)
    latest = DiskClientStore(root / "latest_models", num_clients, initial_params, None, cache) if keep_latest_models else None
    return clients, latest


def wave_size(sim: Simulation, client_state: Any) -> int:
    """Clients trained together in one wave of a round: as many as ``sim.memory_budget.round_bytes`` holds
    (an eighth of a configured budget, else 1 GiB whatever the machine: ``memory_budget.ROUND_SHARE``).

    Per client: its state read and its new state, and five model-sized vectors
    (its objective's, its final model, its message's).  The messages are
    folded into the server update as clients finish, so nothing outlives its wave.
    """
    budget = sim.memory_budget.round_bytes
    per_client = 2 * (state_bytes(client_state) if client_state is not None else 0) + 5 * state_bytes(sim.initial_params)
    return max(1, budget // max(1, per_client))


def disk_stores(state: SimulationState) -> dict[str, DiskClientStore]:
    """The state's stores that keep their states in files, by the name a checkpoint refers to them with."""
    named = (("clients", state.clients), ("latest_models", state.latest_models))
    return {name: store for name, store in named if isinstance(store, DiskClientStore)}


@dataclass(frozen=True)
class RoundWork:
    """A planned round (``plan_round``): who trains, from which view, with which contexts and settings; nothing trained yet."""

    round: int
    registered: np.ndarray  # S_t
    server: Any  # the server state after the round's membership changes
    view: Any  # algorithm.broadcast(server): what every selected client receives
    selected: np.ndarray  # the sampled client ids, sorted and unique (multiplicities are in the contexts)
    contexts: tuple[ClientContext, ...]  # the active clients' (those with steps to do), in sample order
    settings: ClientSettings  # what every client needs of the round (seed, batch size, η_l, ...)
    server_lr: float
    num_inactive: int
    num_incomplete: int
    started: float  # time.perf_counter() when planning began, for the record's round_seconds


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
    keep_models = evaluate_after and sim.evaluation.model == "reporting_mean"
    folding = start_fold(sim, work, keep_models)
    latest = None
    if state.latest_models is not None:
        start = state.latest_sum if state.latest_sum is not None else summed_store(state.latest_models, sim.initial_params)
        latest = LatestModelsUpdate(start, [context.client_id for context in work.contexts])
    steps_done = _train_clients(sim, state, work, folding, latest)
    latest_sum = latest.result() if latest is not None else None
    server, record = finish_folded_round(
        sim, work, folding.result(), steps_done, evaluate_after=evaluate_after, latest_models=state.latest_models, latest_sum=latest_sum
    )
    new_state = SimulationState(work.round, server, state.clients, state.latest_models, latest_sum)
    if commit:
        commit_round(new_state)
    return new_state, record


def start_fold(sim: Simulation, work: RoundWork, keep_models: bool = False) -> OrderedFold:
    """The round's server update, ready to take its active clients' messages in any order (``OrderedFold``)."""
    return OrderedFold(
        sim.algorithm.fold(), work.server, round_context(work), [context.client_id for context in work.contexts], keep_models
    )


def round_context(work: RoundWork) -> RoundContext:
    return RoundContext(round=work.round, num_registered=len(work.registered), num_selected=len(work.selected), server_learning_rate=work.server_lr)


def plan_round(sim: Simulation, state: SimulationState) -> RoundWork:
    """Round ``state.round + 1`` up to local training: membership changes, sampling, availability, the clients'
    contexts, the view they receive and the round's rates.  Reads client states only for joining and leaving clients."""
    started = time.perf_counter()
    t = state.round + 1
    plan = sim.plan
    registered = sim.registered_at(t)
    server = _apply_membership_changes(sim, state, t)
    sizes = sim.client_sizes[registered]
    sample = sample_clients(plan.seed, t, registered, sizes, plan.participation, plan.sampling)
    client_lr = value_at(plan.client_lr, t)
    mean_samples = float(sizes.mean())
    contexts: list[ClientContext] = []
    num_inactive = num_incomplete = 0
    for client_id, multiplicity in zip(sample.client_ids.tolist(), sample.multiplicity.tolist()):
        num_samples = int(sim.client_sizes[client_id])
        planned = plan.planned_steps(num_samples, t)
        steps = steps_to_do(plan.availability, plan.seed, t, client_id, planned, plan.partial_work_epoch(num_samples))
        if steps == 0:
            num_inactive += 1
            continue
        num_incomplete += steps < planned
        contexts.append(
            ClientContext(
                client_id=client_id,
                round=t,
                num_samples=num_samples,
                mean_num_samples=mean_samples,
                num_registered=len(registered),
                planned_steps=planned,
                client_lr=client_lr,
                multiplicity=multiplicity,
                available_steps=steps,
            )
        )
    # a deployment's client trains as this backend does
    settings = client_settings(plan, t, getattr(sim.backend, "precision", "float32"))
    return RoundWork(
        round=t,
        registered=registered,
        server=server,
        view=sim.algorithm.broadcast(server),
        selected=sample.client_ids,
        contexts=tuple(contexts),
        settings=settings,
        server_lr=value_at(plan.server_lr, t),
        num_inactive=num_inactive,
        num_incomplete=int(num_incomplete),
        started=started,
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


def client_data(sim: Simulation, client_id: int) -> ClientData:
    """Client ``client_id``'s data in the simulation: the shared training tensors and its rows."""
    return ClientData(sim.model, sim.training_data, sim.client_rows[client_id])


def _train_clients(
    sim: Simulation, state: SimulationState, work: RoundWork, folding: OrderedFold, latest: LatestModelsUpdate | None
) -> dict[int, int]:
    """The round's client phase, wave by wave: ``client_start`` for the wave's clients, the backend trains their tasks,
    ``client_end`` for each as it finishes, its message folded into ``folding``.  Returns the steps each client did."""
    steps_done: dict[int, int] = {}
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
        tasks = [
            client_start(sim.algorithm, work.view, client_state, context, data, work.settings)
            for client_state, context, data in zip(client_states, wave, datas)
        ]
        # closing(): a backend that changed process-wide settings (threads) restores them even if client_end raises.
        with contextlib.closing(sim.backend.train(sim.model, work.view.params, tasks, work.settings.local, sim.training_data)) as trained:
            for position, final_params, done in trained:
                context = wave[position]
                new_client_state, message = client_end(
                    sim.algorithm, work.view, client_states[position], context, datas[position], work.settings, final_params, done
                )
                # Staged at once (a disk store writes it to its staging file); the wave's lists let go of the client's tensors.
                state.clients.put(context.client_id, new_client_state)
                client_states[position] = tasks[position] = new_client_state = None
                if state.latest_models is not None:
                    latest.add(context.client_id, final_params, state.latest_models.get(context.client_id))
                    state.latest_models.put(context.client_id, final_params)
                folding.add(context.client_id, message, final_params)
                steps_done[context.client_id] = done
    return steps_done


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
    message is None sent nothing.  The server update, the bits and every mean
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
    for context in work.contexts:
        if context.client_id in messages:
            model = reporting_models.get(context.client_id) if keep_models else None
            folding.add(context.client_id, messages[context.client_id], model)
    return finish_folded_round(sim, work, folding.result(), steps_done, evaluate_after=evaluate_after, latest_models=latest_models)


def finish_folded_round(
    sim: Simulation,
    work: RoundWork,
    folded: FoldedRound,
    steps_done: Mapping[int, int],
    *,
    evaluate_after: bool = False,
    latest_models: ClientStateStore | None = None,
    latest_sum: LatestModels | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The round's record once its messages are folded (``start_fold``): bits, norms, evaluation, divergence checks.

    ``latest_sum`` is the running sum of the latest models after this round (``latest_models``); without it,
    the "all_clients_mean" evaluation sums the store, staged models included."""
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
        "upload_bits": int(folded.upload_bits),
        "download_bits": int(payload_bits(work.view) * num_selected),
        "client_lr": work.settings.local.client_lr,
        "server_lr": work.server_lr,
        "model_norm": float(torch.linalg.vector_norm(server.params)),
        **folded.metrics,
    }
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
    if sim.evaluation.dissimilarity_every and t % sim.evaluation.dissimilarity_every == 0:
        record.update(dissimilarity(sim, server.params, work.registered))
    problem = divergence(record, sim.initial_losses, sim.evaluation.divergence_factor)
    if problem is None:
        problem = norm_growth(record["model_norm"], sim.norm_scale, sim.evaluation.norm_growth_factor)
    if problem is not None:
        raise FloatingPointError(f"the run diverged in round {t}: {problem}{plugin_note(sim.algorithm)}")
    record["round_seconds"] = time.perf_counter() - work.started
    return server, record


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


DIVERGENCE_ADVICE = "lower client.lr (or server.lr), or set client.clip_norm"
LOSS_KEYS = ("train_loss", "test_loss")  # the evaluated losses the divergence test compares with the initial model's


def divergence(record: dict[str, Any], initial_losses: dict[str, float] | None, factor: float) -> str | None:
    """Why a round's record shows divergence, with what to try; None for a healthy round.

    A round diverged when any number it recorded is non-finite (losses, norms, accuracies,
    the algorithm's metrics), or when ``factor`` > 0 and an evaluated loss exceeds ``factor``
    times the initial model's.  A round-1 blow-up already is such a jump, so the reference
    is the model before round 1, not round 1's.  The test is skipped for a loss whose
    initial value is not positive (an objective such as the quadratic clients' can be negative).
    """
    non_finite = [f"{key}={value}" for key, value in record.items() if not _all_finite(value)]
    if non_finite:
        return f"non-finite values {', '.join(non_finite)}; {DIVERGENCE_ADVICE}"
    if not factor or not initial_losses:
        return None
    for key in LOSS_KEYS:
        initial, value = initial_losses.get(key), record.get(key)
        if value is not None and initial is not None and initial > 0 and value > factor * initial:
            return (
                f"{key} is {value:.4g}, {value / initial:.3g} times the initial model's {initial:.4g} "
                f"(more than evaluation.divergence_factor={factor:g}); {DIVERGENCE_ADVICE}, "
                "or raise evaluation.divergence_factor (0 = off) if such a loss is expected"
            )
    return None


def norm_scale(initial_params: torch.Tensor) -> float:
    """The model's starting scale: the larger of the initial model's norm and √P (P parameters), the norm of a model
    whose parameters are all 1 in size.

    The floor keeps the test meaningful for a model that starts at zero or near it (the quadratic
    clients' x⁰ = 0, a zero-initialised layer): such a model's first steps multiply its norm by any
    amount, and only a norm far beyond parameters of size 1 says that it diverged.
    """
    initial = float(torch.linalg.vector_norm(initial_params.detach().double()))
    return max(initial, math.sqrt(initial_params.numel()))


def norm_growth(model_norm: float, scale: float, factor: float) -> str | None:
    """Why a round's server model norm shows divergence, with what to try; None for a healthy round (or ``factor`` 0).

    The norm is recorded every round, so this test runs in rounds without evaluation too.  It compares
    with the starting scale rather than with the previous round's norm: a diverging run may grow its
    norm tenfold a round and never a thousandfold in one (MNIST with η_l = 3: 12.6, 127, 1463, 30094),
    which a round-to-round test misses, while a healthy run's norm stays within a small multiple of
    its starting scale.
    """
    if not factor or not math.isfinite(model_norm) or model_norm <= factor * scale:
        return None
    return (
        f"model_norm is {model_norm:.4g}, {model_norm / scale:.3g} times the model's starting scale {scale:.4g} "
        f"(the larger of the initial model's norm and √(number of parameters)), more than evaluation.norm_growth_factor={factor:g}; "
        f"{DIVERGENCE_ADVICE}, or raise evaluation.norm_growth_factor (0 = off) if so large a model is expected"
    )


def _all_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_all_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_all_finite(item) for item in value.values())
    return True


def reference_losses(sim: Simulation) -> dict[str, float]:
    """The initial model's evaluated losses, the divergence test's reference; computed once per simulation.

    Evaluation draws no random numbers, so computing them changes no result.
    """
    if sim.initial_losses is None:
        rows = _global_test_rows(sim)
        with torch.no_grad():
            sim.initial_losses, correct = _mean_losses(sim, sim.initial_params, rows)
        if sim.model.is_classifier:
            sim.initial_accuracy = correct / len(rows)
    return sim.initial_losses


def _global_test_rows(sim: Simulation) -> torch.Tensor:
    return torch.arange(sim.data.global_test_size or len(sim.test_data.targets), device=sim.device)


def _mean_losses(
    sim: Simulation, params: torch.Tensor, test_rows: torch.Tensor, test_hits: torch.Tensor | None = None
) -> tuple[dict[str, float], int]:
    """Mean test loss over ``test_rows`` and mean train loss over the sampled clients' data, and the correct test predictions
    (per row into ``test_hits`` when given)."""
    batch = sim.evaluation.batch_size
    test_loss, test_correct = _loss_and_correct(sim.model, params, sim.test_data, test_rows, batch, test_hits)
    train_loss, _ = _loss_and_correct(sim.model, params, sim.training_data, sim.train_loss_rows, batch)
    return {"test_loss": test_loss / len(test_rows), "train_loss": train_loss / len(sim.train_loss_rows)}, test_correct


# What `evaluate` may add to a round's record; a resumed run whose evaluation schedule changed drops them
# from rounds the new schedule does not evaluate, so its metrics match a run made in one go.
EVALUATION_KEYS = ("test_loss", "train_loss", "test_accuracy", "client_test_accuracy_mean", "test_recall_at_5", "distance_to_minimizer")


@torch.no_grad()
def evaluate(sim: Simulation, params: torch.Tensor) -> dict[str, float]:
    """Test accuracy and loss on the global test set; train loss over the data of ``evaluation.train_loss_clients``
    clients (a sample fixed by the seed; every client's when 0 or at least the number of clients).

    With per-client test splits, also the mean of the clients' local test
    accuracies (EFL's per-client accuracy).  For objectives with a known
    minimiser, the distance to it.
    """
    batch = sim.evaluation.batch_size
    test = sim.test_data
    test_rows = _global_test_rows(sim)
    per_client = sim.model.is_classifier and sim.client_test_rows is not None
    test_hits = torch.zeros(len(test_rows), dtype=torch.int64) if per_client else None
    metrics, test_correct = _mean_losses(sim, params, test_rows, test_hits)
    if sim.model.is_classifier:
        metrics["test_accuracy"] = test_correct / len(test_rows)
        if per_client:
            accuracies = _client_test_accuracies(sim, params, test_hits)
            if len(accuracies):
                metrics["client_test_accuracy_mean"] = float(np.mean(accuracies))
    if sim.model.multi_label:
        metrics["test_recall_at_5"] = _recall_at_k(sim.model, params, test, test_rows, batch, k=5)
    if sim.data.known_minimizer is not None:
        minimizer = torch.as_tensor(sim.data.known_minimizer, dtype=params.dtype, device=params.device)
        metrics["distance_to_minimizer"] = float(torch.linalg.vector_norm(params - minimizer))
    return metrics


def _client_test_accuracies(sim: Simulation, params: torch.Tensor, global_hits: torch.Tensor | None = None) -> list[float]:
    """Each client's accuracy on its own test rows (clients without any left out), in client order.

    One pass over all clients' test rows in evaluation batches, then a count per client: a forward
    pass per client would cost 100,000 small passes with 100,000 clients.  ``global_hits``, the
    correct predictions of the global test rows ``0..G-1``, are reused when every client's test
    rows lie among them (client test splits usually make up the global test set).
    """
    lengths = [len(rows) for rows in sim.client_test_rows]
    rows = sim.client_test_union
    if global_hits is not None and (len(rows) == 0 or int(rows.max()) < len(global_hits)):
        hits = global_hits[rows.cpu()]
    else:
        hits = torch.zeros(len(rows), dtype=torch.int64)
        _loss_and_correct(sim.model, params, sim.test_data, rows, sim.evaluation.batch_size, hits)
    owner = np.repeat(np.arange(len(lengths)), lengths)  # the client of each row
    correct = np.bincount(owner, weights=hits.numpy(), minlength=len(lengths))
    return [int(correct[k]) / n for k, n in enumerate(lengths) if n]


def _recall_at_k(model: FlatModel, params: torch.Tensor, data: TrainingData, rows: torch.Tensor, batch_size: int, k: int) -> float:
    """Micro recall of the top-k labels: true labels among each example's k highest logits / all true labels
    (TFF's StackOverflow tag-prediction metric, ``Recall(top_k=5)``)."""
    hits, positives = 0.0, 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        outputs = model.forward(params, data.batch(chunk))
        targets = data.targets[chunk]
        top = outputs.topk(min(k, outputs.shape[1]), dim=1).indices
        hits += float(targets.gather(1, top).sum())
        positives += float(targets.sum())
    return hits / positives if positives > 0 else 0.0


def _loss_and_correct(
    model: FlatModel, params: torch.Tensor, data: TrainingData, rows: torch.Tensor, batch_size: int, hits: torch.Tensor | None = None
) -> tuple[float, int]:
    """Summed loss and correct predictions over ``rows``; with ``hits`` (int64, one per row) also which rows were correct."""
    loss_sum, correct = 0.0, 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        outputs = model.forward(params, data.batch(chunk))
        loss_sum += float(model.example_loss(outputs, data.targets[chunk]).sum())
        if model.is_classifier:
            right = outputs.argmax(dim=1) == data.targets[chunk]
            correct += int(right.sum())
            if hits is not None:
                hits[start : start + len(chunk)] = right.cpu()
    return loss_sum, correct


def dissimilarity(sim: Simulation, params: torch.Tensor, registered: np.ndarray | None = None) -> dict[str, float | None]:
    """FedProx Definition 2 at the server model, over all registered clients with ``p_k = n_k / n``:

        B(θ)² = E_k ‖∇F_k(θ)‖² / ‖∇f(θ)‖²,    variance = E_k ‖∇F_k(θ) − ∇f(θ)‖²,    ∇f = E_k ∇F_k.

    B(θ)² is None (null in metrics.jsonl) where ∇f(θ) = 0 and the ratio is undefined.
    """
    if registered is None:
        registered = sim.registered_at(1)
    loss_gradient = torch.func.grad(sim.model.batch_loss)
    weights = sim.client_sizes[registered] / sim.client_sizes[registered].sum()
    # One pass, no [N, P] table: E‖g_k − ḡ‖² = E‖g_k‖² − ‖ḡ‖² (clamped at 0 against rounding).
    global_gradient = torch.zeros_like(params)
    mean_squared_norm = 0.0
    for client_id, weight in zip(registered.tolist(), weights.tolist()):
        rows = sim.client_rows[client_id]
        gradient = torch.zeros_like(params)
        for start in range(0, len(rows), sim.evaluation.batch_size):
            part = rows[start : start + sim.evaluation.batch_size]
            gradient += loss_gradient(params, sim.training_data.batch(part), sim.training_data.targets[part]) * (len(part) / len(rows))
        global_gradient += weight * gradient
        mean_squared_norm += weight * float((gradient**2).sum())
    global_norm_squared = float((global_gradient**2).sum())
    return {
        "dissimilarity_b2": mean_squared_norm / global_norm_squared if global_norm_squared > 0 else None,
        "gradient_variance": max(0.0, mean_squared_norm - global_norm_squared),
    }
