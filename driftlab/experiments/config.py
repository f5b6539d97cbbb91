"""The experiment configuration: typed, validated before any work, overridable by dotted keys.

A config is a TOML file (or a shipped preset) with a few sections::

    seed = 0
    rounds = 100
    [data]       name = "synthetic", synthetic_alpha = 1.0, ...
    [model]      name = "mlr"
    [algorithm]  name = "fedavg", aggregation = "weighted"   (the rest depends on the algorithm)
    [client]     lr = 0.01, batch_size = 10, epochs = 20, ...
    [server]     optimizer = "sgd", lr = 1.0, ...
    [sampling]   participation = 0.1, mode = "uniform"

and any key can be overridden as ``section.key=value`` (``client.lr=0.05``,
``algorithm.name=fedavg``).  An unknown key, a wrong type or an out-of-range
value raises ``ConfigError`` naming the key and what is allowed.
``describe_keys()`` lists every key with its meaning and default
(``driftlab config``).
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from driftlab.algorithms import ALGORITHM_CONFIGS
from driftlab.experiments.datasets import DATA_SETS
from driftlab.models import MODEL_NAMES
from driftlab.optim.schedules import ExponentialSchedule, InverseTimeSchedule

PRESET_PACKAGE = "driftlab.experiments.presets"


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message says which key and what is allowed."""


def _rate(value: Any) -> float | ExponentialSchedule | InverseTimeSchedule:
    return _number_or_schedule(value, integer=False)


def _count(value: Any) -> int | ExponentialSchedule | InverseTimeSchedule:
    return _number_or_schedule(value, integer=True)


def _number_or_schedule(value: Any, integer: bool) -> Any:
    kind = "a positive integer" if integer else "a positive number"
    if isinstance(value, bool):
        raise ValueError(f"expected {kind} or a schedule table, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"expected {kind}, got {value!r}")
        if integer and (not float(value).is_integer()):
            raise ValueError(f"expected {kind}, got {value!r}")
        if value <= 0:
            raise ValueError(f"must be > 0, got {value!r}")
        return int(value) if integer else float(value)
    if isinstance(value, (ExponentialSchedule, InverseTimeSchedule)):
        return value
    if isinstance(value, dict):
        kinds = {"exponential": ExponentialSchedule, "inverse_time": InverseTimeSchedule}
        schedule_kind = value.get("kind")
        if schedule_kind not in kinds:
            raise ValueError(f"a schedule needs kind = one of {sorted(kinds)}, got {schedule_kind!r}")
        try:
            return kinds[schedule_kind](**value)
        except ValidationError as error:
            details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise ValueError(f"invalid {schedule_kind} schedule: {details}") from None
    raise ValueError(
        f"expected {kind} or a schedule table such as "
        '{kind="exponential", initial=0.1, decay=0.99} or {kind="inverse_time", a=1.0, b=10}'
        f", got {value!r}"
    )


Rate = Annotated[Any, BeforeValidator(_rate)]
Count = Annotated[Any, BeforeValidator(_count)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


DataSetName = Literal[tuple(DATA_SETS)]  # type: ignore[valid-type]
PARTITIONS = ("natural", "iid", "dirichlet", "dirichlet_classwise", "classes_per_client", "power_law")


class DataConfig(_Section):
    name: DataSetName = Field("synthetic", description="data set; `driftlab data list` describes each")
    root: str | None = Field(None, description="where the data set's official files are; default: its folder under ../shared/data or $DRIFTLAB_DATA")
    num_clients: int = Field(30, ge=1, description="number of clients (devices) of generated data and of partitioned pooled data")
    partition: Literal[PARTITIONS] | None = Field(  # type: ignore[valid-type]
        None,
        description="natural (the data set's own clients), iid, dirichlet (client-prior form, FedDyn), dirichlet_classwise "
        "(Hsu et al.), classes_per_client (shards), power_law (FedProx MNIST); none = natural where it exists, else iid",
    )
    quotas: Literal["balanced", "lognormal"] = Field("balanced", description="client sizes for iid, dirichlet and classes_per_client: balanced or lognormal (FedDyn)")
    lognormal_sigma: float = Field(0.3, ge=0, description="σ of lognormal quotas (FedDyn uses 0.3)")
    dirichlet_alpha: float = Field(0.3, gt=0, description="concentration α of the Dirichlet partitions (smaller is more heterogeneous)")
    min_client_size: int = Field(10, ge=0, description="dirichlet_classwise: redraw until every client has at least this many samples")
    classes_per_client: int = Field(2, ge=1, description="classes_per_client and power_law: classes each client holds")
    client_test_fraction: float = Field(
        0.0, ge=0, lt=1, description="hold out this fraction of every client's data as its local test split (0 = off; data sets with their own keep theirs)"
    )
    synthetic_alpha: float = Field(1.0, ge=0, description="α of synthetic(α,β): variance of the shared mean of each device's W_k, b_k")
    synthetic_beta: float = Field(1.0, ge=0, description="β of synthetic(α,β): how much local data differs")
    feddyn_kind: int = Field(1, ge=0, le=3, description="feddyn_synthetic: heterogeneity type 1, 2 or 3 (0: homogeneous)")
    feddyn_heterogeneity: float = Field(1.0, ge=0, description="feddyn_synthetic: the γ of the chosen type")
    quadratic_dimension: int = Field(10, ge=1, description="dimension of the multi-dimensional quadratic clients")
    quadratic_heterogeneity: float = Field(1.0, ge=0, description="spread of curvatures and linear terms across quadratic clients")
    max_clients: int | None = Field(None, ge=1, description="femnist, shakespeare, sent140: keep at most this many clients (largest first for shakespeare)")
    samples_per_client: int | None = Field(None, ge=1, description="shakespeare: windows per role, e.g. 2000 for FedDyn's split; stackoverflow: at most this many per user")
    min_samples_per_client: int = Field(0, ge=0, description="shakespeare: drop roles with fewer windows")
    vocabulary_size: int = Field(10_000, ge=3, description="sent140: tokens in the vocabulary, PAD and UNK included; stackoverflow: bag-of-words size")
    tag_count: int = Field(500, ge=1, description="stackoverflow: the most frequent tags predicted")
    limit_per_class: int | None = Field(None, ge=1, description="cifar10_folder: read at most this many images per class and split")
    augment: bool = Field(
        False,
        description="image data (CIFAR): train on augmented minibatches as the FedDyn code does, a random horizontal flip, then "
        "with probability 1/2 zero-padding by 4 and a random crop back; draws from (seed, round, client, step, slot), the same on every backend",
    )
    seed: int | None = Field(None, ge=0, description="seed of generation and partitioning; default: the experiment seed")


class ModelConfig(_Section):
    name: Literal[MODEL_NAMES] = Field(  # type: ignore[valid-type]
        "mlr",
        description="mlr (multinomial logistic regression), mlp, cnn (FedDyn CIFAR CNN), femnist_cnn, lstm, gru, resnet18_gn, "
        "vgg11, quadratic (the parameter x of the quadratic clients)",
    )
    hidden: tuple[int, ...] = Field((200, 200), description="hidden widths of the mlp (784-200-200-10 by default; (100, 100) for EMNIST-L)")
    rnn_hidden: int | None = Field(None, ge=1, description="lstm/gru hidden units; none = 100 for lstm (FedDyn), 256 for gru")
    rnn_layers: int = Field(2, ge=1, description="lstm/gru layers")
    embedding_dim: int = Field(8, ge=1, description="lstm/gru character embedding size")
    groups: int = Field(2, ge=1, description="resnet18_gn: GroupNorm groups")
    resnet_stem: Literal["cifar", "imagenet"] = Field("cifar", description="resnet18_gn stem: cifar (3x3, no max-pool) or imagenet (FedDyn's code)")
    width: int = Field(64, ge=1, description="resnet18_gn/vgg11 base width")

    def keyword_arguments(self) -> dict[str, Any]:
        """Keyword arguments of ``driftlab.models.build_model`` besides name, shape and classes."""
        return {
            "hidden": self.hidden,
            "rnn_hidden": self.rnn_hidden,
            "rnn_layers": self.rnn_layers,
            "embedding_dim": self.embedding_dim,
            "groups": self.groups,
            "resnet_stem": self.resnet_stem,
            "width": self.width,
        }


class ClientConfig(_Section):
    lr: Rate = Field(0.01, description="client learning rate η_l: a number or a schedule table")
    batch_size: int = Field(10, ge=1, description="minibatch size B")
    epochs: int | None = Field(None, ge=1, description="local epochs E, steps = E·⌈n_k/B⌉ per client (default 1 when client.steps is not set)")
    steps: Count | None = Field(None, description="fixed local steps K for every client (a number or a schedule); use instead of epochs")
    weight_decay: float = Field(0.0, ge=0, description="L2 weight decay added to the local gradient")
    clip_norm: float | None = Field(None, gt=0, description="clip ∇loss (+ linear correction) to this global norm; none = off")
    inexact_gamma: float | None = Field(
        None, ge=0, le=1,
        description="FedProx γ-inexact solver: stop once ‖∇h_k‖ ≤ γ‖∇h_k(θ^{t-1})‖ (full local gradients, checked each epoch); none = off",
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


class ServerConfig(_Section):
    optimizer: Literal["sgd", "momentum", "adam", "adagrad", "yogi"] = Field(
        "sgd", description="server optimizer on the pseudo-gradient: sgd (FedAvg at lr 1), momentum (FedAvgM), adam (FedAdam), adagrad, yogi"
    )
    lr: Rate = Field(1.0, description="server learning rate η_g: a number or a schedule table")
    momentum: float = Field(0.9, ge=0, lt=1, description="momentum β (optimizer = momentum)")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam/Yogi β1")
    beta2: float | None = Field(None, ge=0, lt=1, description="Adam/Yogi β2; none = the optimizer's default (adam 0.999, yogi 0.99)")
    epsilon: float | None = Field(None, gt=0, description="ε (τ) of adam, adagrad, yogi; none = the optimizer's default (adam 1e-8, adagrad and yogi 1e-3)")
    bias_correction: bool = Field(True, description="Adam bias correction (the decaying-K paper's Algorithm 3 has it; Reddi's has not)")

    def optimizer_hyperparameters(self) -> dict[str, Any]:
        """Keyword arguments of ``driftlab.optim.server.make_server_optimizer`` for the chosen optimizer."""
        chosen: dict[str, Any] = {}
        if self.optimizer == "momentum":
            chosen = {"beta": self.momentum}
        elif self.optimizer == "adam":
            chosen = {"beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon, "bias_correction": self.bias_correction}
        elif self.optimizer == "adagrad":
            chosen = {"epsilon": self.epsilon}
        elif self.optimizer == "yogi":
            chosen = {"beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon}
        return {key: value for key, value in chosen.items() if value is not None}


class SamplingConfig(_Section):
    participation: float = Field(0.1, gt=0, le=1, description="fraction of registered clients selected per round, in (0, 1]")
    mode: Literal["uniform", "weighted"] = Field(
        "uniform",
        description="uniform: without replacement; weighted: draws with probability n_k/n (FedProx Algorithm 2, "
        "which pairs it with a simple average: algorithm.aggregation=uniform)",
    )


class MembershipEventConfig(_Section):
    round: int = Field(ge=1, description="the round at whose start the change happens")
    join: tuple[int, ...] = Field((), description="client ids that register")
    leave: tuple[int, ...] = Field((), description="client ids that deregister")
    join_range: tuple[int, int] | None = Field(None, description="[first, stop) ids that register")
    leave_range: tuple[int, int] | None = Field(None, description="[first, stop) ids that deregister")

    def joined(self) -> tuple[int, ...]:
        return self.join + (tuple(range(*self.join_range)) if self.join_range else ())

    def left(self) -> tuple[int, ...]:
        return self.leave + (tuple(range(*self.leave_range)) if self.leave_range else ())


class AvailabilityConfig(_Section):
    initially_registered: int | None = Field(
        None, ge=1, description="clients 0..M-1 are registered in round 1; none = all (see availability.events)"
    )
    events: tuple[MembershipEventConfig, ...] = Field(
        (), description='clients joining and leaving: [{round = 50, join_range = [50, 100], leave = [3, 7]}, ...]'
    )
    inactive_probability: float = Field(0.0, ge=0, le=1, description="chance a selected client reports nothing in a round")
    incomplete_probability: float = Field(
        0.0, ge=0, le=1, description="chance a selected client does only part of its work (U{1..E−1} epochs, or U{1..K−1} steps)"
    )

    @model_validator(mode="after")
    def _probabilities_sum(self) -> "AvailabilityConfig":
        if self.inactive_probability + self.incomplete_probability > 1:
            raise ValueError("availability.inactive_probability + availability.incomplete_probability must be at most 1")
        return self


class CompressionConfig(_Section):
    ratio: float | None = Field(
        None, gt=0, le=1,
        description="ST compression (top-k + ternary, error feedback both ways) keeping this fraction q of each tensor; "
        "1 = uncompressed; none = the algorithm's default (EFL 0.01, others 1)",
    )


class EvaluationConfig(_Section):
    every: int = Field(1, ge=1, description="evaluate every N rounds (and always after the last round)")
    model: Literal["server", "reporting_mean", "all_clients_mean"] = Field(
        "server",
        description="evaluated model: server, reporting_mean (mean of the round's reporting clients), "
        "all_clients_mean (every client's latest local model, never-trained ones at θ⁰; FedDyn's reporting)",
    )
    dissimilarity_every: int = Field(0, ge=0, description="every N rounds record B(θ)² and the gradient variance at the server model; 0 = off")
    target_accuracy: float | None = Field(None, gt=0, le=1, description="test accuracy whose first crossing the summary reports")


AlgorithmConfig = Annotated[Union[tuple(ALGORITHM_CONFIGS.values())], Field(discriminator="name")]


class ExperimentConfig(_Section):
    seed: int = Field(0, ge=0, description="experiment seed: client samples, minibatches and initialisation derive from it")
    rounds: int = Field(100, ge=1, description="communication rounds")
    device: str = Field("cpu", description="cpu, cuda, cuda:N, or auto (cuda when available)")
    precision: Literal["float32", "float64"] = Field("float32", description="arithmetic of training and aggregation")
    backend: Literal["auto", "vectorized", "sequential"] = Field(
        "auto",
        description="local training backend: vectorized (a round's clients trained together), sequential (one by one, the reference), "
        "or auto (vectorized, which is faster for every zoo model; see docs/performance.md)",
    )
    checkpoint_every: int = Field(10, ge=1, description="write a checkpoint every N rounds (and at the end or on interruption)")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    algorithm: AlgorithmConfig = Field(default_factory=lambda: next(iter(ALGORITHM_CONFIGS.values()))())
    client: ClientConfig = ClientConfig()
    server: ServerConfig = ServerConfig()
    sampling: SamplingConfig = SamplingConfig()
    availability: AvailabilityConfig = AvailabilityConfig()
    compression: CompressionConfig = CompressionConfig()
    evaluation: EvaluationConfig = EvaluationConfig()

    @model_validator(mode="after")
    def _device_is_known(self) -> "ExperimentConfig":
        device = self.device
        if device not in ("cpu", "cuda", "auto") and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return _plain(self.model_dump(mode="python"))

    def fingerprint(self, ignore: tuple[str, ...] = ("rounds", "checkpoint_every", "device")) -> str:
        """A hash of everything that determines the numbers a run produces (not its length or where it runs)."""
        content = {k: v for k, v in self.to_dict().items() if k not in ignore}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, BaseModel):
        return _plain(value.model_dump(mode="python"))
    return value


# ---------------------------------------------------------------- loading and overrides


def preset_names() -> list[str]:
    return sorted(p.name[: -len(".toml")] for p in resources.files(PRESET_PACKAGE).iterdir() if p.name.endswith(".toml"))


def read_config_source(source: str | Path) -> dict[str, Any]:
    """The raw table of a TOML file, or of a shipped preset when ``source`` names one."""
    path = Path(source)
    if path.is_file():
        text, origin = path.read_text(), str(path)
    elif str(source) in preset_names():
        text, origin = resources.files(PRESET_PACKAGE).joinpath(f"{source}.toml").read_text(), f"preset {source}"
    else:
        raise ConfigError(f"{source!r} is neither a config file nor a preset; presets: {', '.join(preset_names())}")
    if path.is_file() and path.suffix.lower() == ".json":
        # the resolved config a run writes (config.json), so `driftlab run DIR/config.json --out DIR --resume` works
        try:
            table = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{origin} is not valid JSON: {error}") from None
        if not isinstance(table, dict):
            raise ConfigError(f"{origin} must hold a JSON object (a table of sections), got {type(table).__name__}")
        return table
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{origin} is not valid TOML: {error}") from None


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """``"client.lr=0.05"`` -> ``(["client", "lr"], 0.05)``; values are TOML values, bare words are strings."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {assignment!r} is not of the form section.key=value (for example client.lr=0.05)")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw
    if raw.lower() in ("none", "null"):
        value = None
    return key.strip().split("."), value


def apply_overrides(table: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    table = json.loads(json.dumps(table))  # deep copy of plain data
    for assignment in overrides:
        path, value = parse_override(assignment)
        node = table
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {assignment!r}: {part!r} is a value, not a section")
            node = child
        if path[0] == "algorithm" and path[-1] == "name" and len(path) == 2 and node.get("name") not in (None, value):
            # switching algorithm: the old algorithm's keys do not apply to the new one
            node.clear()
        node[path[-1]] = value
    return table


def load_config(source: str | Path | dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Validate a config file, preset name or table (``None``: all defaults), with overrides applied."""
    if source is None:
        table: dict[str, Any] = {}
    elif isinstance(source, dict):
        table = source
    else:
        table = read_config_source(source)
    table = apply_overrides(table, list(overrides))
    return validate_config(table)


def validate_config(table: dict[str, Any]) -> ExperimentConfig:
    algorithm = table.get("algorithm")
    if isinstance(algorithm, dict) and "name" not in algorithm:
        # an [algorithm] section without `name` configures the default algorithm
        table = {**table, "algorithm": {"name": next(iter(ALGORITHM_CONFIGS)), **algorithm}}
    try:
        return ExperimentConfig.model_validate(table)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, table)) from None


def format_validation_error(error: ValidationError, table: dict[str, Any]) -> str:
    lines = []
    for item in error.errors():
        loc = [str(part) for part in item["loc"] if not isinstance(part, int)]
        # drop the discriminator tag pydantic inserts for tagged unions (algorithm.<name>.key)
        if len(loc) >= 2 and loc[0] == "algorithm" and loc[1] in ALGORITHM_CONFIGS:
            loc = [loc[0], *loc[2:]]
        key = ".".join(loc) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            valid = ", ".join(_valid_keys(loc[:-1], table))
            message = f"unknown key; valid keys here: {valid}"
        elif item["type"] == "union_tag_invalid":
            tag = (item.get("ctx") or {}).get("tag", item["input"])
            message = f"unknown algorithm {tag!r}; valid algorithms: {', '.join(ALGORITHM_CONFIGS)}"
        elif item["type"] == "union_tag_not_found":
            message = f"missing `name`; valid algorithms: {', '.join(ALGORITHM_CONFIGS)}"
        elif "input" in item and item["type"] not in ("missing",) and "got " not in message:
            message = f"{message} (got {item['input']!r})"
        lines.append(f"  {key}: {message}")
    return "invalid configuration:\n" + "\n".join(lines) + "\nrun `driftlab config` to list every key with its meaning and default"


def _section_model(path: list[str], table: dict[str, Any]) -> type[BaseModel] | None:
    model: type[BaseModel] = ExperimentConfig
    for part in path:
        if part == "algorithm" and model is ExperimentConfig:
            name = (table.get("algorithm") or {}).get("name", next(iter(ALGORITHM_CONFIGS)))
            model = ALGORITHM_CONFIGS.get(name, next(iter(ALGORITHM_CONFIGS.values())))
            continue
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _valid_keys(path: list[str], table: dict[str, Any]) -> list[str]:
    model = _section_model(path, table)
    return list(model.model_fields) if model else []


def describe_keys() -> str:
    """Every key with its type, default and meaning, section by section."""
    lines: list[str] = []

    def section(prefix: str, model: type[BaseModel]) -> None:
        nested = []
        for name, info in model.model_fields.items():
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                nested.append((name, annotation))
                continue
            if prefix == "" and name == "algorithm":
                continue
            default = info.get_default(call_default_factory=True)
            default_text = json.dumps(_plain(default)) if default is not None else "none"
            description = info.description or ("which algorithm; one of " + ", ".join(ALGORITHM_CONFIGS) if prefix == "algorithm." and name == "name" else "")
            lines.append(f"  {prefix}{name} = {default_text}\n      {description}")
        for name, sub in nested:
            lines.append(f"[{name}]")
            section(f"{name}.", sub)

    lines.append("[top level]")
    section("", ExperimentConfig)
    for name, model in ALGORITHM_CONFIGS.items():
        lines.append(f"[algorithm] when algorithm.name = {name!r}")
        section("algorithm.", model)
    lines.append(
        'Rates (client.lr, server.lr) and client.steps take a number or a schedule table: '
        '{kind="exponential", initial=0.1, decay=0.99} or {kind="inverse_time", a=1.0, b=10}.'
    )
    return "\n".join(lines)
