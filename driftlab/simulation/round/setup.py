"""What a run's rounds share: the round plan, the evaluation plan, the ``Simulation`` (model, data, algorithm,
backend, memory budget: everything that does not change from round to round) and the ``SimulationState``
(round, server state, client-state stores) that each round maps to the next; the stores and waves sized by
the memory budget."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from driftlab.data.federated import FederatedDataset
from driftlab.optim.schedules import steps_at
from driftlab.randomness import Stream, generator
from driftlab.simulation.backends.augmentation import flip_crop_from_keys
from driftlab.simulation.backends.buffers import ModuleBuffersExtra, has_buffers
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import TrainingBackend, TrainingData, steps_for_epochs
from driftlab.simulation.round.availability import ALWAYS_AVAILABLE, AvailabilityModel, Membership
from driftlab.simulation.round.evaluated_model import EVALUATED_MODELS, ServerModel
from driftlab.simulation.round.latest_models import LatestModels
from driftlab.simulation.seam import Algorithm
from driftlab.simulation.state.memory_budget import MemoryBudget
from driftlab.simulation.state.state_store import (
    ClientStateStore,
    DiskClientStore,
    InMemoryClientStore,
    state_bytes,
)
from driftlab.simulation.time.plan import AsynchronousPlan, SystemPlan


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
    # Each client's own model on its own test split (personal_test_accuracy_*): the algorithm's Personalization,
    # or with finetune_steps > 0 the evaluated model fine-tuned on the client's data for that many local steps.
    personal: bool = False
    finetune_steps: int = 0
    # Also the spread (std over clients) of the server model's per-client test accuracy; on with ``personal``.
    client_spread: bool = False

    @property
    def evaluated_model(self) -> ServerModel:
        """The policy of ``model`` (``round.evaluated_model``): which model an evaluated round evaluates."""
        return EVALUATED_MODELS[self.model]


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
    # Simulated time (config [system]): device profiles, deadline, over-selection; None: rounds are not timed.
    system: SystemPlan | None = None
    # Asynchronous FedBuff (config [asynchronous]; needs system); None: synchronous rounds.
    asynchronous: AsynchronousPlan | None = None
    # The engine-side state of the features a config turns on that saves itself in a checkpoint (each entry's
    # ``state_extra``, set at assembly: the simulated clock, FedBuff's clients in flight); see ``checkpointed_extras``.
    state_extras: tuple[Any, ...] = ()
    training_data: TrainingData = field(init=False, repr=False)
    test_data: TrainingData = field(init=False, repr=False)
    client_rows: list[torch.Tensor] = field(init=False, repr=False)
    client_test_rows: list[torch.Tensor] | None = field(init=False, repr=False)
    client_test_union: torch.Tensor | None = field(
        init=False, repr=False
    )  # every client's test rows, client after client
    # every client's validation rows (data.validation_fraction), rows of training_data, client after client; None: no split
    validation_rows: torch.Tensor | None = field(init=False, repr=False)
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
                raise ValueError(
                    f"data.augment needs image inputs [n, c, h, w], got shape {tuple(self.data.train_inputs.shape)}"
                )
            augment = (
                flip_crop_from_keys  # padding 4, crop with probability 1/2: the FedDyn authors' CIFAR augmentation
            )
        # Multi-label targets are float (multi-hot) and take the arithmetic's dtype; class ids stay int64.
        targets_dtype = self.dtype if self.data.train_targets.is_floating_point() else self.data.train_targets.dtype
        # uint8 pixels stay uint8 (inputs_dtype); each gathered batch is normalised in float32, then cast to the run's dtype.
        pixels = self.data.input_normalisation
        normalisation = None if pixels is None else dataclasses.replace(pixels, dtype=self.dtype)
        self.training_data = TrainingData(
            self.data.train_inputs.to(self.device, inputs_dtype),
            self.data.train_targets.to(self.device, targets_dtype),
            augment,
            normalisation,
        )
        self.test_data = TrainingData(
            self.data.test_inputs.to(self.device, inputs_dtype),
            self.data.test_targets.to(self.device, targets_dtype),
            normalisation=normalisation,
        )
        self.client_rows = [
            torch.tensor(rows, dtype=torch.long, device=self.device) for rows in self.data.client_indices
        ]
        self.client_test_rows = (
            None
            if self.data.client_test_indices is None
            else [torch.tensor(rows, dtype=torch.long, device=self.device) for rows in self.data.client_test_indices]
        )
        self.client_test_union = None
        held = self.data.client_validation_indices
        if held is None:
            self.validation_rows = None
        else:
            self.validation_rows = torch.tensor(
                np.concatenate(held) if held else np.zeros(0, np.int64), dtype=torch.long, device=self.device
            )
        if self.client_test_rows is not None:
            self.client_test_union = (
                torch.cat(self.client_test_rows)
                if self.client_test_rows
                else torch.zeros(0, dtype=torch.long, device=self.device)
            )
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
            raise ValueError(
                f"the membership schedule is for {self.membership.num_clients} clients, the data set has {self.data.num_clients}"
            )

    def checkpointed_extras(self) -> tuple[Any, ...]:
        """Every state extra a checkpoint of this simulation holds (``round.checkpointing.StateExtra``), in the order
        they write: the running sum of the latest models when every client's model is evaluated
        (``evaluation.model = "all_clients_mean"``), then the features' ``state_extras``, then the server's buffers
        of a model that has any (``backends.buffers.ModuleBuffersExtra``)."""
        kept = self.evaluation.evaluated_model.state_extras()
        # A model with buffers (BatchNorm's running statistics) keeps the server's in its module: they are state too.
        buffers = (ModuleBuffersExtra(self.model.module),) if has_buffers(self.model.module) else ()
        return (*kept, *self.state_extras, *buffers)

    def registered_at(self, round_index: int) -> np.ndarray:
        """``S_t``: the clients registered in round ``round_index``."""
        return self.membership.registered_at(round_index)


@dataclass(frozen=True)
class SimulationState:
    """What each round maps to the next: the round, the server state, the client stores and the optional features'
    engine-side state (its *extras*: the latest models' sum, the clock, the clients in flight), each of which saves
    itself into a checkpoint and loads itself back (``round.checkpointing``)."""

    round: int  # last completed round (0 before training)
    server: Any
    clients: ClientStateStore
    # Every client's latest local model, kept only when the evaluated model is "all_clients_mean",
    # and their running sum (None: not yet computed from the store, e.g. after an older checkpoint).
    latest_models: ClientStateStore | None = None
    latest_sum: LatestModels | None = None
    # Simulated seconds at the end of the last completed round (``[system]``, driftlab.simulation.time); None: untimed.
    clock: float | None = None
    # An asynchronous run's engine state between server updates (``driftlab.simulation.asynchronous``: the clients in
    # flight, their held results, the model versions they started from); None: synchronous rounds.
    in_flight: Any = None

    def stores(self) -> dict[str, ClientStateStore]:
        """The state's client stores by the name a checkpoint refers to them with: what a round stages and commits."""
        named = (("clients", self.clients), ("latest_models", self.latest_models))
        return {name: store for name, store in named if store is not None}


STORE_KINDS = ("memory", "disk", "auto")
# no configured budget: half of the machine's memory, asked when needed; MemoryBudget is frozen, so one is shared
_UNCONFIGURED_BUDGET = MemoryBudget()


def make_client_stores(
    kind: str,
    num_clients: int,
    initial_params: torch.Tensor,
    client_initial: Any,
    keep_latest_models: bool,
    directory: Any,
    memory_budget: MemoryBudget = _UNCONFIGURED_BUDGET,
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
        raise TypeError(
            f"memory_budget must be a MemoryBudget (MemoryBudget.for_run parses the setting), got {memory_budget!r}"
        )
    template = client_initial(initial_params) if client_initial is not None else None
    per_client = (state_bytes(template) if template is not None else 0) + (
        state_bytes(initial_params) if keep_latest_models else 0
    )
    if kind == "auto":
        kind = "disk" if per_client * num_clients > memory_budget.host_bytes else "memory"
    initial = (lambda: client_initial(initial_params)) if client_initial is not None else None
    if kind == "memory":
        return InMemoryClientStore(initial), InMemoryClientStore(None) if keep_latest_models else None
    root = directory()
    stores = [template is not None, keep_latest_models]
    cache = memory_budget.cache_bytes(sum(stores))
    clients = (
        DiskClientStore(root / "clients", num_clients, template, initial, cache)
        if template is not None
        else InMemoryClientStore(None)
    )
    latest = (
        DiskClientStore(root / "latest_models", num_clients, initial_params, None, cache)
        if keep_latest_models
        else None
    )
    return clients, latest


def wave_size(sim: Simulation, client_state: Any) -> int:
    """Clients trained together in one wave of a round: as many as ``sim.memory_budget.round_bytes`` holds
    (an eighth of a configured budget, else 1 GiB whatever the machine: ``memory_budget.ROUND_SHARE``).

    Per client: its state read and its new state, and five model-sized vectors
    (its objective's, its final model, its message's).  The messages are
    folded into the server update as clients finish, so nothing outlives its wave.
    """
    budget = sim.memory_budget.round_bytes
    per_client = 2 * (state_bytes(client_state) if client_state is not None else 0) + 5 * state_bytes(
        sim.initial_params
    )
    return max(1, budget // max(1, per_client))


def disk_stores(state: SimulationState) -> dict[str, DiskClientStore]:
    """The state's stores that keep their states in files, by the name a checkpoint refers to them with."""
    return {name: store for name, store in state.stores().items() if isinstance(store, DiskClientStore)}


def norm_scale(initial_params: torch.Tensor) -> float:
    """The model's starting scale: the larger of the initial model's norm and √P (P parameters), the norm of a model
    whose parameters are all 1 in size.

    The floor keeps the test meaningful for a model that starts at zero or near it (the quadratic
    clients' x⁰ = 0, a zero-initialised layer): such a model's first steps multiply its norm by any
    amount, and only a norm far beyond parameters of size 1 says that it diverged.
    """
    initial = float(torch.linalg.vector_norm(initial_params.detach().double()))
    return max(initial, math.sqrt(initial_params.numel()))
