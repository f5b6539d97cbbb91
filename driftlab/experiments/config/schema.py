"""The config's schema: the core sections, and ``ExperimentConfig`` assembling them with the tagged sections
(``tagged``) and the optional sections of the features (``[compression]``, ``[privacy]``, ``[system]``,
``[asynchronous]``, each defined in its feature's package); ``to_dict`` and the fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from driftlab.algorithms import registry
from driftlab.compress.section import CompressionConfig
from driftlab.config_section import Section, short
from driftlab.data import registry as data_sets
from driftlab.data.registry import DEFAULT_DATA_SET
from driftlab.experiments.config.tagged import (
    DEFAULT_ALGORITHM,
    DEFAULT_MODEL,
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    ServerConfig,
    legacy_flat_form,
)
from driftlab.features.registry import FEATURES
from driftlab.models import registry as models
from driftlab.models.registry import MAX_WIDTH
from driftlab.optim import registry as server_optimizers
from driftlab.optim.schedules import Count, Rate
from driftlab.simulation.evaluation import EVALUATION_KEYS
from driftlab.simulation.round.availability import ClientIds
from driftlab.simulation.state.memory_budget import parse_bytes

MAX_BATCH_SIZE = 1_000_000  # more than any client of any data set holds (MNIST on one client: 60,000)


def _check_function_reference(reference: str) -> None:
    source, separator, name = reference.rpartition(":")
    if not separator or not source or not name.isidentifier():
        raise ValueError(f'expected "module:function" or "path/to/file.py:function", got {short(reference)}')


class ClientConfig(Section):
    lr: Rate = Field(0.01, description="client learning rate η_l: a number or a schedule table")
    batch_size: int = Field(10, ge=1, le=MAX_BATCH_SIZE, description="minibatch size B")
    epochs: int | None = Field(
        None, ge=1, description="local epochs E, steps = E·⌈n_k/B⌉ per client (default 1 when client.steps is not set)"
    )
    steps: Count | None = Field(
        None, description="fixed local steps K for every client (a number or a schedule); use instead of epochs"
    )
    weight_decay: float = Field(0.0, ge=0, description="L2 weight decay added to the local gradient")
    clip_norm: float | None = Field(
        None, gt=0, description="clip ∇loss (+ linear correction) to this global norm; none = off"
    )
    inexact_gamma: float | None = Field(
        None,
        ge=0,
        le=1,
        description="FedProx γ-inexact solver: stop once ‖∇h_k‖ ≤ γ‖∇h_k(θ^{t-1})‖ (full local gradients, checked "
        "each epoch); none = off",
    )

    @model_validator(mode="after")
    def _one_kind_of_work(self) -> "ClientConfig":
        if self.steps is not None and self.epochs is not None:
            raise ValueError("set either client.epochs or client.steps, not both (override the other with =none)")
        return self

    @property
    def local_epochs(self) -> int | None:
        """E, or None when the work is a fixed step count."""
        if self.steps is not None:
            return None
        return self.epochs if self.epochs is not None else 1


class SamplingConfig(Section):
    participation: float = Field(
        0.1,
        gt=0,
        le=1,
        description="fraction of registered clients selected per round, in (0, 1] (poisson: each one's probability)",
    )
    mode: Literal["uniform", "weighted", "poisson"] = Field(
        "uniform",
        description="uniform: without replacement; weighted: draws with probability n_k/n (FedProx Algorithm 2, "
        "which pairs it with a simple average: algorithm.aggregation=uniform); poisson: each registered client "
        "independently with probability participation, a cohort of varying size that may be empty (the sampling "
        "DP accounting assumes: [privacy] noise with participation below 1 needs it)",
    )


class MembershipEventConfig(Section):
    round: int = Field(ge=1, description="the round at whose start the change happens")
    join: tuple[int, ...] = Field((), description="client ids that register")
    leave: tuple[int, ...] = Field((), description="client ids that deregister")
    join_range: tuple[int, int] | None = Field(None, description="[first, stop) ids that register")
    leave_range: tuple[int, int] | None = Field(None, description="[first, stop) ids that deregister")

    @field_validator("join", "leave")
    @classmethod
    def _ids_are_not_negative(cls, ids: tuple[int, ...]) -> tuple[int, ...]:
        if any(client_id < 0 for client_id in ids):
            raise ValueError(f"client ids are 0 or more, got {short(list(ids))}")
        return ids

    @field_validator("join_range", "leave_range")
    @classmethod
    def _range_is_increasing(cls, bounds: tuple[int, int] | None) -> tuple[int, int] | None:
        if bounds is not None and not 0 <= bounds[0] < bounds[1]:
            hint = (
                f"; for ids {bounds[1]}..{bounds[0] - 1} write [{bounds[1]}, {bounds[0]}]"
                if 0 <= bounds[1] < bounds[0]
                else ""
            )
            raise ValueError(
                f"a range [first, stop) needs 0 <= first < stop (it holds ids first..stop-1), got {list(bounds)}{hint}"
            )
        return bounds

    def joined(self) -> ClientIds:
        """The ids that register, the range unlisted: Membership checks its bounds against the data before listing
        it."""
        return ClientIds(self.join, range(*self.join_range) if self.join_range else range(0))

    def left(self) -> ClientIds:
        return ClientIds(self.leave, range(*self.leave_range) if self.leave_range else range(0))


class AvailabilityConfig(Section):
    initially_registered: int | None = Field(
        None, ge=1, description="clients 0..M-1 are registered in round 1; none = all (see availability.events)"
    )
    events: tuple[MembershipEventConfig, ...] = Field(
        (), description="clients joining and leaving: [{round = 50, join_range = [50, 100], leave = [3, 7]}, ...]"
    )
    inactive_probability: float = Field(
        0.0, ge=0, le=1, description="chance a selected client reports nothing in a round"
    )
    incomplete_probability: float = Field(
        0.0,
        ge=0,
        le=1,
        description="chance a selected client does only part of its work (U{1..E−1} epochs, or U{1..K−1} steps)",
    )

    @model_validator(mode="after")
    def _probabilities_sum(self) -> "AvailabilityConfig":
        if self.inactive_probability + self.incomplete_probability > 1:
            raise ValueError(
                "availability.inactive_probability + availability.incomplete_probability must be at most 1"
            )
        return self


class StateConfig(Section):
    store: Literal["memory", "disk", "auto"] = Field(
        "auto",
        description="where per-client algorithm state (SCAFFOLD's c_k, FedDyn's λ_k, ...) and the latest local models "
        "of evaluation.model=all_clients_mean live: memory, disk (one file per state field in RUN/client_state/, a "
        "temporary "
        "directory without --out; checkpoints then write only the rows that changed), or auto (disk when every "
        "client's state would exceed memory_budget); results are bit-identical either way",
    )


# The metrics a stop rule may watch: those an evaluated round records (``simulation.evaluation.EVALUATION_KEYS``).
STOP_METRICS = EVALUATION_KEYS
_MINIMIZED = ("loss", "distance")  # a metric named with one of these words improves downwards; any other upwards


def default_mode(metric: str) -> Literal["max", "min"]:
    """Whether ``metric`` improves upwards (accuracies, recall) or downwards (losses, the distance to the minimiser)."""
    return "min" if any(word in metric for word in _MINIMIZED) else "max"


class StopAtConfig(Section):
    """``evaluation.stop_at``: end the run once an evaluated metric reaches a value, or stops improving.

    With ``value`` v the run stops after the first evaluated round t whose metric m_t reaches it: m_t >= v (mode max)
    or m_t <= v (mode min).  With ``patience`` p it stops after the evaluated round at which p evaluated rounds have
    passed since the best one, a round improving on the best b when m_t > b + min_delta (max) or m_t < b - min_delta
    (min).  Both set: whichever comes first."""

    metric: str = Field(
        description="the metric to watch, one an evaluated round records (test_accuracy, test_loss, ...)"
    )
    value: float | None = Field(None, description="stop once the metric reaches this value (>= for max, <= for min)")
    patience: int | None = Field(
        None, ge=1, description="stop once this many evaluated rounds have passed without improving on the best"
    )
    min_delta: float = Field(
        0.0, ge=0, description="with patience: an improvement must exceed the best by more than this"
    )
    mode: Literal["max", "min"] | None = Field(
        None, description="max: higher is better, min: lower is better; unset: min for losses and distances, else max"
    )

    @field_validator("metric")
    @classmethod
    def _metric_is_recorded(cls, metric: str) -> str:
        if metric not in STOP_METRICS:
            raise ValueError(
                f"unknown metric {short(metric)}; an evaluated round records {', '.join(STOP_METRICS)} "
                "(each where the run computes it)"
            )
        return metric

    @model_validator(mode="after")
    def _a_rule_is_given(self) -> "StopAtConfig":
        if self.value is None and self.patience is None:
            raise ValueError(
                f'give a value, a patience or both, e.g. {{metric = "{self.metric}", value = ...}} or '
                f'{{metric = "{self.metric}", patience = 10}}'
            )
        if self.min_delta and self.patience is None:
            raise ValueError("min_delta applies to patience only; set patience, or remove min_delta")
        return self

    @property
    def direction(self) -> Literal["max", "min"]:
        return self.mode or default_mode(self.metric)


class EvaluationConfig(Section):
    every: int = Field(1, ge=1, description="evaluate every N rounds (and always after the last round)")
    train_loss_clients: int = Field(
        100,
        ge=0,
        description="train_loss is the mean over the data of this many clients, a fixed sample drawn from the seed "
        "(all clients when there are no more); 0 = every client's data",
    )
    model: Literal["server", "reporting_mean", "all_clients_mean"] = Field(
        "server",
        description="evaluated model: server, reporting_mean (mean of the round's reporting clients), "
        "all_clients_mean (every client's latest local model, never-trained ones at θ⁰; FedDyn's reporting)",
    )
    dissimilarity_every: int = Field(
        0, ge=0, description="every N rounds record B(θ)² and the gradient variance at the server model; 0 = off"
    )
    personal: bool | None = Field(
        None,
        description="evaluate each client's own (personalized) model on its own test split "
        "(personal_test_accuracy_mean/std, "
        "best over rounds = BMTA); unset: on when the algorithm keeps personal models (apfl, ditto, fedamp) or "
        "finetune_steps "
        "is set, and the clients have test splits (data.client_test_fraction); true: required; false: off",
    )
    client_spread: bool | None = Field(
        None,
        description="also record client_test_accuracy_std, the std over clients of the server model's accuracy on each "
        "client's test split (always recorded with the personalized evaluation); unset: off",
    )
    finetune_steps: int | None = Field(
        None,
        ge=1,
        description="FedAvg + fine-tuning: each client's own model is the server model after this many local SGD "
        "steps on its "
        "own data (the round's lr, batch, weight decay), drawn from (seed, round, client); for algorithms without "
        "personal models",
    )
    target_accuracy: float | None = Field(
        None, gt=0, le=1, description="test accuracy whose first crossing the summary reports"
    )
    divergence_factor: float = Field(
        1000.0,
        ge=0,
        description="the run stops as diverged when an evaluated train or test loss exceeds this multiple of the "
        "initial model's "
        "(skipped where that loss is not positive); a non-finite loss or norm always is divergence; 0 = off",
    )
    norm_growth_factor: float = Field(
        1000.0,
        ge=0,
        description="the run stops as diverged when the server model's norm, tested every round (evaluated or not), "
        "exceeds this "
        "multiple of the model's starting scale: the larger of the initial model's norm and √(number of parameters); "
        "0 = off",
    )
    instability_factor: float = Field(
        1.5,
        ge=1,
        description='a run is flagged unstable (a warning, "instability" in run.json and metrics.jsonl, a mark in '
        "reports) when its "
        "evaluated train loss stays above this multiple of the initial model's for evaluation.instability_rounds "
        "rounds",
    )
    instability_rounds: int = Field(
        5,
        ge=0,
        description="how many rounds the evaluated train loss must stay above evaluation.instability_factor times the "
        "initial model's (at every evaluation from the first one above it) before the run is flagged unstable; 0 = off",
    )

    stop_at: tuple[StopAtConfig, ...] | None = Field(
        None,
        description="end the run early, as complete, once a metric reaches a target or stops improving: "
        '{metric = "test_accuracy", value = 0.97}, {metric = "test_loss", patience = 10, min_delta = 0}, or a list of '
        "such rules (the first met stops the run); decided after each evaluated round from the records, so a resume "
        'decides the same; run.json records the round and why ("stopped"); mode = "max" or "min" overrides the '
        "direction the metric's name gives (min for losses and distances)",
    )

    @field_validator("stop_at", mode="before")
    @classmethod
    def _one_rule_is_a_list_of_one(cls, rules: Any) -> Any:
        if isinstance(rules, (dict, StopAtConfig)):
            return (rules,)
        if isinstance(rules, (list, tuple)) and not rules:
            return None  # no rule: the same run (and config.json) as leaving the key out
        return rules

    @property
    def stop_rules(self) -> tuple[StopAtConfig, ...]:
        """``stop_at``'s rules (empty when unset)."""
        return self.stop_at or ()

    @field_validator("divergence_factor", "norm_growth_factor")
    @classmethod
    def _factor_is_a_growth(cls, factor: float) -> float:
        if 0 < factor <= 1:
            raise ValueError(
                f"must be greater than 1 (a multiple of the initial value), or 0 to turn the test off; got {factor!r}"
            )
        return factor


# [evaluation] keys left out of ExperimentConfig.fingerprint: they decide when a run is stopped or flagged, not its
# numbers.
# stop_at decides when a run ends, like rounds: changing it on resume continues or ends the same run.
MONITORING_KEYS = ("norm_growth_factor", "instability_factor", "instability_rounds", "stop_at")


class ExperimentConfig(Section):
    seed: int = Field(
        0, ge=0, description="experiment seed: client samples, minibatches and initialisation derive from it"
    )
    rounds: int = Field(
        100, ge=1, le=10_000_000, description="communication rounds (at most 10 million: a record is kept per round)"
    )
    device: str = Field(
        "cpu",
        description="cpu, cuda, cuda:N, auto (cuda when available), or several GPUs as cuda:0,cuda:1 "
        "(the vectorized backend spreads a round's client chunks over them; the first holds the model and aggregates)",
    )
    precision: Literal["float32", "float64", "tf32", "bf16"] = Field(
        "float32",
        description="arithmetic: float32 or float64 for everything; tf32 (CUDA only) or bf16 for local steps' "
        "gradients, "
        "with parameters, state and aggregation in float32 (docs/performance.md: what each does to accuracy)",
    )
    convolution: Literal["grouped", "unfold", "channels_last", "mixed"] | None = Field(
        None,
        description="how the vectorized backend's batched layers compute a chunk's convolutions: grouped (one grouped "
        "convolution per layer, the default), unfold (im2col and one matrix product per client), channels_last (the "
        "grouped convolutions on channels-last tensors) or mixed (unfold for layers reading 3 channels, an image's "
        "first layer, grouped elsewhere); the same function "
        "to rounding, a different speed per device (docs/performance.md); chunks of one client and the sequential "
        "backend use the module's own layer (unset: grouped)",
    )
    backend: Literal["auto", "vectorized", "sequential"] = Field(
        "auto",
        description="local training backend: vectorized (a round's clients trained together), sequential (one by one, "
        "the reference), "
        "or auto (what docs/performance.md measured faster for the model and device: vectorized on a GPU and for the "
        "zoo's models, sequential for other modules on a CPU and for recurrent networks (LSTM, GRU) on a GPU)",
    )
    checkpoint_every: int = Field(
        10, ge=1, description="write a checkpoint every N rounds (and at the end or on interruption)"
    )
    keep_checkpoint: bool = Field(
        False,
        description="keep the last checkpoint (and the disk store's client_state folder) once the run completes; by "
        "default a completed "
        "run keeps its final model and metrics only, and raising rounds later re-runs it from round 0 (the same "
        "numbers, the time again) "
        "instead of continuing from the checkpoint; interrupted, failed and diverged runs always keep theirs",
    )
    data: DataConfig = Field(default_factory=lambda: data_sets.REGISTRY.entries[DEFAULT_DATA_SET].config_type())
    model: ModelConfig = Field(default_factory=lambda: models.MODELS[DEFAULT_MODEL].config_type())
    plugins: tuple[Annotated[str, Field(min_length=1)], ...] = Field(
        (),
        description="modules imported before the config is validated, to register algorithms of your own: module "
        "names, or paths of "
        '.py files relative to this config file (or the working directory), e.g. ["my_algorithm.py"]; config.json '
        "records them, so sweeps, resume and report import them too (docs/design.md, Writing a plugin)",
    )
    algorithm: AlgorithmConfig = Field(default_factory=lambda: registry.ALGORITHMS[DEFAULT_ALGORITHM].config_type())
    client: ClientConfig = ClientConfig()
    server: ServerConfig = Field(default_factory=lambda: server_optimizers.REGISTRY.entries["sgd"].config_type())
    sampling: SamplingConfig = SamplingConfig()
    availability: AvailabilityConfig = AvailabilityConfig()
    compression: CompressionConfig = CompressionConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    state: StateConfig = StateConfig()
    # The optional sections of the features (driftlab.features.registry), in its order: [privacy], [system], ...
    for _name, _entry in FEATURES.items():
        if _entry.config_field is not None:
            __annotations__[_name] = _entry.section_type | None
            locals()[_name] = Field(None, description=_entry.config_field)
    del _name, _entry
    memory_budget: int | str | None = Field(
        None,
        description='memory the client states may take, in bytes or as "4GB", "512MB", "1.5GiB": state.store=auto '
        "puts them on disk beyond it, the disk store's row cache takes a sixteenth of it (at most 512 MiB), and a "
        "round trains its "
        "clients in waves (and the vectorized backend its CPU chunks) that fit an eighth of it; none = half of the "
        "memory the "
        "process may hold (physical, ulimit, cgroup, SLURM) (waves of 1 GiB). A GPU's chunks take 80% of its memory, "
        "split between the runs sharing it (DRIFTLAB_GPU_SHARE=N)",
    )
    log: tuple[Literal["tensorboard", "wandb", "mlflow"], ...] = Field(
        (),
        description='experiment trackers fed with every round\'s record, e.g. ["tensorboard", "mlflow"] (extras '
        "driftlab[tensorboard], "
        "driftlab[wandb], driftlab[mlflow]); not part of the run's identity, so a run can be resumed with logging "
        "turned on",
    )

    @model_validator(mode="after")
    def _device_is_known(self) -> "ExperimentConfig":
        device = self.device
        if "," in device:
            devices = [part.strip() for part in device.split(",")]
            if not all(part.startswith("cuda:") and part[5:].isdigit() for part in devices) or len(set(devices)) != len(
                devices
            ):
                raise ValueError(
                    f"several devices must be distinct GPUs written cuda:N, e.g. cuda:0,cuda:1; got {device!r}"
                )
        elif device not in ("cpu", "cuda", "auto") and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError(f"device must be cpu, cuda, cuda:N, auto or a list like cuda:0,cuda:1, got {device!r}")
        return self

    @model_validator(mode="after")
    def _convolution_needs_the_vectorized_backend(self) -> "ExperimentConfig":
        if self.convolution is not None and self.backend == "sequential":
            raise ValueError(
                f"convolution={self.convolution} says how the vectorized backend's batched layers compute, but "
                "backend=sequential "
                "trains each client with its own module; set backend=vectorized (or auto), or leave convolution unset"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        table = _plain(self.model_dump(mode="python"))
        if not table.get("plugins"):
            table.pop("plugins", None)  # a config of built-ins reads (and hashes) as it did before plugins existed
        return table

    @field_validator("convolution")
    @classmethod
    def _grouped_is_unset(cls, kind: str | None) -> str | None:
        # grouped is the default: the same run (and fingerprint) as leaving the key out.
        return None if kind == "grouped" else kind

    @field_validator("memory_budget")
    @classmethod
    def _budget_is_bytes(cls, budget: int | str | None) -> int | str | None:
        if budget is not None:
            parse_bytes(budget)
        return budget

    def fingerprint(
        self,
        ignore: tuple[str, ...] = (
            "rounds",
            "checkpoint_every",
            "keep_checkpoint",
            "device",
            "log",
            "state",
            "memory_budget",
            "plugins",
        ),
    ) -> str:
        """A hash of everything that determines the numbers a run produces (not its length, where it runs or where it
        is logged, nor where its plugins' files are: the algorithm's name and hyperparameters are in the hash).  Your
        own data is ``data.name = "custom"`` here; its ``data.digest`` is compared on its own
        (``run_directory.check_run_directory``)."""
        content = legacy_flat_form({k: v for k, v in self.to_dict().items() if k not in ignore})
        if "rounds" in ignore and isinstance(content.get("privacy"), dict) and "target_epsilon" in content["privacy"]:
            # The noise multiplier of a target ε is computed for the run's rounds: they change its every number.
            content["privacy"]["rounds"] = self.rounds
        if isinstance(content.get("evaluation"), dict):
            # Thresholds that only watch the numbers (when a run is stopped or flagged), never change them: a run
            # stopped by one resumes with another, and runs written before these keys existed still resume.
            for key in MONITORING_KEYS:
                content["evaluation"].pop(key, None)
        if isinstance(content.get("data"), dict):
            # Your own data's loader path and digest: a sweep plans its runs without the digest (the run records it),
            # and the run directory and the run check the digest themselves, with a message about the data.
            content["data"].pop("loader", None)
            content["data"].pop("digest", None)
        trace = content.get("system", {}).get("trace") if isinstance(content.get("system"), dict) else None
        if isinstance(trace, str):
            # The trace's file name counts, not the folder a checkout is in; its bytes are checked on resume against
            # the SHA-256 run.json records (run_directory.check_trace)
            content["system"]["trace"] = Path(trace).name
        loss = content.get("model", {}).get("loss") if isinstance(content.get("model"), dict) else None
        if isinstance(loss, str) and ":" in loss:
            # Like plugins: the loss's file name and function count, not the folder a checkout happens to be in.
            where, function = loss.rsplit(":", 1)
            content["model"]["loss"] = f"{Path(where).name}:{function}"
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, BaseModel):
        return _plain(value.model_dump(mode="python"))
    return value


__all__ = [
    "MAX_BATCH_SIZE",
    "MAX_WIDTH",
    "MONITORING_KEYS",
    "AvailabilityConfig",
    "ClientConfig",
    "EvaluationConfig",
    "ExperimentConfig",
    "MembershipEventConfig",
    "SamplingConfig",
    "STOP_METRICS",
    "StateConfig",
    "StopAtConfig",
    "default_mode",
]
