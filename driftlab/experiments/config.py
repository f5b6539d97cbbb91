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
value raises ``ConfigError`` naming the key and what is allowed; every problem
of a config is reported in one message (the first 20, then how many more).
``describe_keys()`` lists every key with its meaning and default
(``driftlab config``).

An algorithm of your own is imported before validation from the modules a
config names under ``plugins`` (module names, or paths of .py files relative to
the config file) and from the entry-point group ``driftlab.algorithms``
(``driftlab.algorithms.registry``); its ``[algorithm]`` section is then
validated by its registered config type like a built-in's.

A config file may build on a preset or on another file::

    base = "synthetic-fedavg"      # a preset, or a file relative to this file's folder
    rounds = 50
    [client]
    lr = 0.05
    epochs = "none"                # the string "none" removes a key the base sets

Its tables are merged over the base's, key by key (a schedule table, or an
``[algorithm]`` naming another algorithm, replaces the base's whole value);
bases may themselves have a base, and a cycle is an error.

Config files are read defensively: at most ``MAX_CONFIG_BYTES``, UTF-8, nested
at most ``MAX_NESTING`` levels, no TOML dates or times.  Integers refuse
``true``/``false``, numbers must be finite, rates are at most ``MAX_RATE``.
Sizes that depend on the data and the machine (the batch plan, the number of
clients, the model) are checked before any allocation by
``driftlab.experiments.compatibility``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import tomllib
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic import field_serializer
from pydantic_core import PydanticCustomError

from driftlab.algorithms import registry
from driftlab.errors import ConfigError
from driftlab.data import registry as data_sets
from driftlab.data.registry import DEFAULT_DATA_SET, PARTITIONS  # noqa: F401 - PARTITIONS: re-exported
from driftlab.experiments.shipped import PRESET_PACKAGE, preset_names  # PRESET_PACKAGE: re-exported
from driftlab.experiments.toml_shape import MAX_NESTING, check_toml_shape  # check_toml_shape: re-exported too
from driftlab.models import registry as models
from driftlab.plugins import did_you_mean, load_plugins, resolve_plugin
from driftlab.optim import registry as server_optimizers
from driftlab.optim.schedules import MAX_RATE, Count, Rate, is_constant_one  # MAX_RATE: re-exported too
from driftlab.simulation.round.availability import ClientIds
from driftlab.simulation.state.memory_budget import parse_bytes

MAX_CONFIG_BYTES = 1_000_000  # the largest shipped preset is 2 kB; a megabyte is never a hand-written config
MAX_BASE_CHAIN = 16  # files built on files built on files ...
MAX_LISTED_PROBLEMS = 20  # an error message lists this many problems, then says how many more
MAX_BATCH_SIZE = 1_000_000  # more than any client of any data set holds (MNIST on one client: 60,000)
MAX_WIDTH = 65_536  # hidden widths, embeddings, channels: the model's memory is checked separately


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, so a huge value cannot flood a message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} characters)"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _check_function_reference(reference: str) -> None:
    source, separator, name = reference.rpartition(":")
    if not separator or not source or not name.isidentifier():
        raise ValueError(
            f'expected "module:function" or "path/to/file.py:function", got {_short(reference)}'
        )


class ClientConfig(_Section):
    lr: Rate = Field(0.01, description="client learning rate η_l: a number or a schedule table")
    batch_size: int = Field(10, ge=1, le=MAX_BATCH_SIZE, description="minibatch size B")
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


class SamplingConfig(_Section):
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


class MembershipEventConfig(_Section):
    round: int = Field(ge=1, description="the round at whose start the change happens")
    join: tuple[int, ...] = Field((), description="client ids that register")
    leave: tuple[int, ...] = Field((), description="client ids that deregister")
    join_range: tuple[int, int] | None = Field(None, description="[first, stop) ids that register")
    leave_range: tuple[int, int] | None = Field(None, description="[first, stop) ids that deregister")

    @field_validator("join", "leave")
    @classmethod
    def _ids_are_not_negative(cls, ids: tuple[int, ...]) -> tuple[int, ...]:
        if any(client_id < 0 for client_id in ids):
            raise ValueError(f"client ids are 0 or more, got {_short(list(ids))}")
        return ids

    @field_validator("join_range", "leave_range")
    @classmethod
    def _range_is_increasing(cls, bounds: tuple[int, int] | None) -> tuple[int, int] | None:
        if bounds is not None and not 0 <= bounds[0] < bounds[1]:
            hint = f"; for ids {bounds[1]}..{bounds[0] - 1} write [{bounds[1]}, {bounds[0]}]" if 0 <= bounds[1] < bounds[0] else ""
            raise ValueError(f"a range [first, stop) needs 0 <= first < stop (it holds ids first..stop-1), got {list(bounds)}{hint}")
        return bounds

    def joined(self) -> ClientIds:
        """The ids that register, the range unlisted: Membership checks its bounds against the data before listing it."""
        return ClientIds(self.join, range(*self.join_range) if self.join_range else range(0))

    def left(self) -> ClientIds:
        return ClientIds(self.leave, range(*self.leave_range) if self.leave_range else range(0))


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


ADAPTIVE_KEYS = ("target_quantile", "clip_learning_rate", "count_noise")  # [privacy] keys of adaptive clipping only


class PrivacyConfig(_Section):
    """``[privacy]``: client-level differential privacy (``driftlab.privacy``); a config without it is not private.

    Each reporting client's message is clipped to L2 norm ``clip`` as the algorithm's ``PrivacyForm`` releases it,
    and Gaussian noise of std ``noise_multiplier · clip`` is added to the round's sum (DP-FedAvg, McMahan et al.,
    "Learning Differentially Private Recurrent Language Models", ICLR 2018), or to each message (``noise = "local"``).
    The checks that need the data's number of clients (δ below 1/N, the noise a target ε needs) are made by
    ``driftlab.experiments.assembly`` before any round.
    """

    clip: float = Field(
        math.inf,
        gt=0,
        allow_inf_nan=True,
        description="L2 norm C each reporting client's message (the whole of what it reveals) is clipped to before "
        "the fold; inf = no clipping (McMahan et al. 2018); the initial C_0 with privacy.adaptive",
    )
    noise_multiplier: float = Field(
        0.0,
        ge=0,
        description="z: Gaussian noise of std z·clip on the round's sum of clipped messages (central) or on each "
        "message (local); 0 = no noise; give privacy.target_epsilon instead to have it computed",
    )
    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="the ε the run may spend in its rounds at privacy.delta: the noise multiplier is computed for it "
        "(instead of privacy.noise_multiplier) with the accountant, for the sampling rate and rounds of the run",
    )
    delta: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="δ of the (ε, δ) guarantee, below 1/number of clients; set: ε after every round in the metrics "
        "(privacy_epsilon) and run.json; none = not accounted",
    )
    accountant: Literal["rdp", "prv"] = Field(
        "rdp",
        description="rdp: Rényi DP of the sampled Gaussian mechanism (Mironov et al. 2019); prv: privacy loss random "
        "variables (Gopi et al., NeurIPS 2021), tighter and slower; both Opacus's (extra driftlab[privacy])",
    )
    noise: Literal["central", "local"] = Field(
        "central",
        description="central: noise once on the sum at a trusted server, means divide by the expected cohort q·N; "
        "local: noise on each client's message before it is sent (ε of each client's own messages, no amplification)",
    )
    noise_cohort_size: float | None = Field(
        None,
        gt=0,
        description="M: central noise calibrated as if a cohort of M clients reported (std z·clip·m/M, pfl-research's "
        "noise_cohort_size), and ε accounted for a cohort of M out of privacy.population; none = the run's own cohort",
    )
    population: int | None = Field(
        None,
        ge=1,
        description="the population privacy.noise_cohort_size's cohort is drawn from (the accountant's "
        "q = M/population); none = the data's number of clients",
    )
    adaptive: bool = Field(
        False,
        description="adaptive clipping (Andrew et al., \"Differentially Private Learning with Adaptive Clipping\", "
        "NeurIPS 2021): the clip follows the target quantile of the clients' norms, C ← C·exp(−η(b̃ − γ))",
    )
    target_quantile: float = Field(
        0.5, ge=0, le=1, description="γ: the fraction of clients adaptive clipping aims to leave unclipped"
    )
    clip_learning_rate: float = Field(0.2, gt=0, le=MAX_RATE, description="η_C of adaptive clipping's geometric update")
    count_noise: float | None = Field(
        None,
        gt=0,
        description="σ_b: std of the noise on adaptive clipping's count of unclipped clients; none = m/20 for the "
        "expected cohort m, as Andrew et al. suggest (it must exceed noise_multiplier/2)",
    )

    @field_serializer("clip")
    def _clip_as_text_when_unbounded(self, clip: float) -> float | str:
        # "inf" rather than a float: config.json stays strict JSON (no Infinity literal), and it reads back as inf
        return "inf" if math.isinf(clip) else clip

    @model_validator(mode="after")
    def _settings_agree(self) -> "PrivacyConfig":
        # Each message says "got": the whole section is not repeated after it (validation_problems).
        noise = f"noise_multiplier {self.noise_multiplier:g}" if self.target_epsilon is None else "a target_epsilon"
        if self.noised and math.isinf(self.clip):
            raise ValueError(
                f"noise without clipping (got {noise} and clip inf): the noise is z·clip, and an unclipped message "
                "can be anything; set privacy.clip to a finite norm (e.g. 1.0)"
            )
        if self.target_epsilon is not None and self.noise_multiplier > 0:
            raise ValueError(
                f"give privacy.target_epsilon or privacy.noise_multiplier, not both (got {self.target_epsilon:g} and "
                f"{self.noise_multiplier:g}): the noise multiplier is computed from the target; remove "
                "privacy.noise_multiplier"
            )
        if self.target_epsilon is not None and self.delta is None:
            raise ValueError(
                f"privacy.target_epsilon needs privacy.delta (got target_epsilon {self.target_epsilon:g} without it): "
                "ε holds at a δ; set privacy.delta below 1/number of clients, e.g. 1e-5"
            )
        if self.population is not None and self.noise_cohort_size is None:
            raise ValueError(
                f"privacy.population is the population privacy.noise_cohort_size's cohort is drawn from (got "
                f"population {self.population} without it): set privacy.noise_cohort_size too, or remove "
                "privacy.population"
            )
        if self.noise_cohort_size is not None and self.noise == "local":
            raise ValueError(
                f"privacy.noise_cohort_size calibrates the central noise on the sum (got {self.noise_cohort_size:g} "
                'with noise "local"): remove it, or set privacy.noise = "central"'
            )
        if self.adaptive and self.noise == "local":
            raise ValueError(
                "adaptive clipping noises the count of unclipped clients at the server, which local noise does not "
                'trust (got adaptive true with noise "local"): set privacy.noise = "central", or '
                "privacy.adaptive = false"
            )
        if self.adaptive and math.isinf(self.clip):
            raise ValueError(
                "adaptive clipping starts from privacy.clip (got clip inf): set it to a finite initial clip (e.g. 0.1)"
            )
        defaults = type(self).model_fields
        stray = [key for key in ADAPTIVE_KEYS if getattr(self, key) != defaults[key].default]
        if stray and not self.adaptive:
            raise ValueError(
                f"privacy.{stray[0]} is a setting of adaptive clipping (got {getattr(self, stray[0]):g} with adaptive "
                "false): set privacy.adaptive = true, or remove it"
            )
        return self

    @property
    def noised(self) -> bool:
        """Whether the run adds noise (a noise multiplier, given or computed from a target ε)."""
        return self.noise_multiplier > 0 or self.target_epsilon is not None

    @property
    def accounted_centrally(self) -> bool:
        """Central noise: its ε is the sampled Gaussian mechanism's, which assumes each client sampled independently."""
        return self.noised and self.noise == "central"


class SystemConfig(_Section):
    """``[system]``: simulated time (``driftlab.simulation.time``): each client's device speed and bandwidths, the
    virtual clock of every round, a deadline and over-selection; a config without it counts rounds, bits and steps only.

    Profiles are drawn from (seed, client id) (``profiles = "lognormal"``, medians and spreads below) or read from a
    CSV trace (``profiles = "trace"``, ``system.trace``).  A round's simulated duration is the largest download +
    local compute + upload of its counted clients (docs/update-rules.md, "Simulated time").
    """

    profiles: Literal["lognormal", "trace"] = Field(
        "lognormal",
        description="lognormal: each client's speed and bandwidths drawn once from (seed, client id), lognormal around "
        "the medians below (FedScale's device model); trace: read from the CSV file system.trace",
    )
    speed_median: float = Field(100.0, gt=0, allow_inf_nan=False, description="median local-training speed, samples per second")
    speed_sigma: float = Field(
        0.5, ge=0, le=5, allow_inf_nan=False, description="σ of the speed's log (0: every client equally fast)"
    )
    download_median: float = Field(2e7, gt=0, allow_inf_nan=False, description="median download bandwidth, bits per second")
    upload_median: float = Field(5e6, gt=0, allow_inf_nan=False, description="median upload bandwidth, bits per second")
    bandwidth_sigma: float = Field(
        0.5, ge=0, le=5, allow_inf_nan=False, description="σ of the bandwidths' logs (0: every client's link alike)"
    )
    trace: str | None = Field(
        None,
        description="with profiles = trace: a CSV file with columns client, speed (samples/s), download, upload "
        "(bits/s) and optional start, end (seconds): the client's profile and availability window; several rows per "
        "client give several windows (a profile that changes over time); every client of the data set needs a row",
    )
    deadline: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="seconds a synchronous round waits: a client whose download, work and upload do not fit does part of "
        "its work (deadline_mode = partial) or is dropped (drop); none = wait for the slowest",
    )
    deadline_mode: Literal["partial", "drop"] = Field(
        "partial",
        description="partial: a client does the steps that fit before the deadline (none fit: dropped); drop: a client "
        "whose whole work does not fit sends nothing",
    )
    over_selection: float = Field(
        0.0, ge=0, le=10, allow_inf_nan=False,
        description="select (1 + this) times a round's cohort and keep the first cohort-many clients to finish "
        "(Bonawitz et al. 2019); the others are not waited for (nor trained: their work would be discarded)",
    )

    @model_validator(mode="after")
    def _trace_matches_profiles(self) -> "SystemConfig":
        if self.profiles == "trace" and not self.trace:
            raise ValueError('system.profiles = "trace" reads system.trace: set it to a CSV file (columns client, speed, download, upload[, start, end])')
        if self.profiles != "trace" and self.trace:
            raise ValueError(f'system.trace ({self.trace!r}) is read only with system.profiles = "trace": set that, or remove system.trace')
        return self


class AsynchronousConfig(_Section):
    """``[asynchronous]``: buffered asynchronous aggregation (FedBuff: Nguyen et al., "Federated Learning with Buffered
    Asynchronous Aggregation", AISTATS 2022) on the simulated clock of ``[system]``; ``rounds`` counts server updates."""

    concurrency: int = Field(
        100, ge=1, le=1_000_000,
        description="C: clients training at once, each picked uniformly among idle clients; a finished client's slot is "
        "refilled at once (replaces sampling.participation, which an asynchronous run does not read)",
    )
    buffer: int = Field(10, ge=1, le=1_000_000, description="B (the paper's K): the server updates after every B arrivals")
    staleness: Literal["sqrt", "constant"] = Field(
        "sqrt",
        description="weight of a change τ server updates old: sqrt = 1/sqrt(1+τ) (the paper's), constant = 1",
    )

    @model_validator(mode="after")
    def _buffer_fits(self) -> "AsynchronousConfig":
        if self.buffer > self.concurrency:
            raise ValueError(
                f"asynchronous.buffer ({self.buffer}) is larger than asynchronous.concurrency ({self.concurrency}): the server "
                "could never fill its buffer; set buffer at most concurrency"
            )
        return self


class StateConfig(_Section):
    store: Literal["memory", "disk", "auto"] = Field(
        "auto",
        description="where per-client algorithm state (SCAFFOLD's c_k, FedDyn's λ_k, ...) and the latest local models of "
        "evaluation.model=all_clients_mean live: memory, disk (one file per state field in RUN/client_state/, a temporary "
        "directory without --out; checkpoints then write only the rows that changed), or auto (disk when every client's "
        "state would exceed memory_budget); results are bit-identical either way",
    )


class EvaluationConfig(_Section):
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
    dissimilarity_every: int = Field(0, ge=0, description="every N rounds record B(θ)² and the gradient variance at the server model; 0 = off")
    personal: bool | None = Field(
        None,
        description="evaluate each client's own (personalized) model on its own test split (personal_test_accuracy_mean/std, "
        "best over rounds = BMTA); unset: on when the algorithm keeps personal models (apfl, ditto, fedamp) or finetune_steps "
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
        description="FedAvg + fine-tuning: each client's own model is the server model after this many local SGD steps on its "
        "own data (the round's lr, batch, weight decay), drawn from (seed, round, client); for algorithms without personal models",
    )
    target_accuracy: float | None = Field(None, gt=0, le=1, description="test accuracy whose first crossing the summary reports")
    divergence_factor: float = Field(
        1000.0,
        ge=0,
        description="the run stops as diverged when an evaluated train or test loss exceeds this multiple of the initial model's "
        "(skipped where that loss is not positive); a non-finite loss or norm always is divergence; 0 = off",
    )
    norm_growth_factor: float = Field(
        1000.0,
        ge=0,
        description="the run stops as diverged when the server model's norm, tested every round (evaluated or not), exceeds this "
        "multiple of the model's starting scale: the larger of the initial model's norm and √(number of parameters); 0 = off",
    )
    instability_factor: float = Field(
        1.5,
        ge=1,
        description="a run is flagged unstable (a warning, \"instability\" in run.json and metrics.jsonl, a mark in reports) when its "
        "evaluated train loss stays above this multiple of the initial model's for evaluation.instability_rounds rounds",
    )
    instability_rounds: int = Field(
        5,
        ge=0,
        description="how many rounds the evaluated train loss must stay above evaluation.instability_factor times the initial "
        "model's (at every evaluation from the first one above it) before the run is flagged unstable; 0 = off",
    )

    @field_validator("divergence_factor", "norm_growth_factor")
    @classmethod
    def _factor_is_a_growth(cls, factor: float) -> float:
        if 0 < factor <= 1:
            raise ValueError(f"must be greater than 1 (a multiple of the initial value), or 0 to turn the test off; got {factor!r}")
        return factor


# [evaluation] keys left out of ExperimentConfig.fingerprint: they decide when a run is stopped or flagged, not its numbers.
MONITORING_KEYS = ("norm_growth_factor", "instability_factor", "instability_rounds")

DEFAULT_ALGORITHM = "fedavg"


def _algorithm_section(value: Any) -> BaseModel:
    """The ``[algorithm]`` table validated by the config type of the algorithm it names, looked up in the
    registry now (not at import), so an algorithm a plugin registered validates like a built-in."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="python")
    if not isinstance(value, dict):
        raise PydanticCustomError(
            "algorithm_table", "expected a table such as [algorithm] name = \"fedavg\", got {value}", {"value": _short(value)}
        )
    name = value.get("name", DEFAULT_ALGORITHM)
    entry = registry.lookup(name) if isinstance(name, str) else None
    if entry is None:
        raise PydanticCustomError("unknown_algorithm", "{message}", {"message": unknown_algorithm_message(name)})
    return entry.config_type.model_validate({**value, "name": name})


def unknown_algorithm_message(name: Any) -> str:
    """What to say about an ``algorithm.name`` no registered algorithm has, and how to make it one."""
    known = registry.names()
    guess = did_you_mean(name, known) if isinstance(name, str) else None
    message = (
        f"unknown algorithm {_short(name)}{f' (did you mean {guess!r}?)' if guess else ''}; valid algorithms: {', '.join(known)}. "
        "An algorithm of your own is imported by naming its module at the top of the config: "
        'plugins = ["my_algorithm.py"] (docs/design.md, "Writing a plugin")'
    )
    problems = registry.load_entry_points()
    if problems:
        message += "; installed plugins that failed to load: " + "; ".join(problems)
    return message


AlgorithmConfig = Annotated[Any, BeforeValidator(_algorithm_section)]


# The flat [model], [data] and [server] sections of driftlab before they became tagged unions (one config type per
# registered model, data set and server optimizer), with their defaults (None values left out, as to_dict leaves them).
# Two uses: a config.json written then names every key of every kind at its default, and such a key of another kind
# at its old default is dropped on reading (it never had an effect); and the fingerprint hashes each section
# completed with these defaults, so every config keeps the fingerprint it had, and old runs still resume.
LEGACY_FLAT_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {
        "name": "mlr", "hidden": [200, 200], "rnn_layers": 2, "embedding_dim": 8, "groups": 2, "resnet_stem": "cifar",
        "width": 64,
    },
    "data": {
        "name": "synthetic", "num_clients": 30, "quotas": "balanced", "lognormal_sigma": 0.3, "dirichlet_alpha": 0.3,
        "min_client_size": 10, "classes_per_client": 2, "client_test_fraction": 0.0, "synthetic_alpha": 1.0,
        "synthetic_beta": 1.0, "feddyn_kind": 1, "feddyn_heterogeneity": 1.0, "quadratic_dimension": 10,
        "quadratic_heterogeneity": 1.0, "min_samples_per_client": 0, "vocabulary_size": 10000, "tag_count": 500,
        "augment": False,
    },
    "server": {"optimizer": "sgd", "lr": 1.0, "momentum": 0.9, "beta1": 0.9, "bias_correction": True},
}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


# section -> (registry_of, tag, default) of every tagged-union section (registered_section), for the merging of tables
TAGGED_SECTIONS: dict[str, tuple[Any, str, str]] = {}


def kind_keys(section: str, name: Any) -> set[str] | None:
    """The keys section ``section`` takes when its tag names ``name`` (None: not a tagged section, or an unknown name)."""
    if section not in TAGGED_SECTIONS or not isinstance(name, str):
        return None
    registry_of, _, _ = TAGGED_SECTIONS[section]
    entry = registry_of().lookup(name)
    return None if entry is None else set(entry.config_type.model_fields)


def without_other_kinds_keys(section: str, table: dict[str, Any], name: Any) -> dict[str, Any]:
    """``table`` (a tagged section) switched to ``name``: the keys the new kind does not take are dropped (the old
    kind's own keys), its shared keys kept, as switching ``algorithm.name`` drops the old algorithm's keys."""
    keys = kind_keys(section, name)
    return dict(table) if keys is None else {key: value for key, value in table.items() if key in keys}


def registered_section(section: str, registry_of: Any, tag: str, default: str) -> Any:
    """The type of a config section that is a tagged union over a registry's entries, like ``[algorithm]``.

    ``section`` is the table's name ("model"), ``registry_of()`` returns the ``driftlab.plugins.Registry`` (called at
    validation time, so an entry a plugin registered validates like a built-in), ``tag`` is the key that names the
    entry ("name"; "optimizer" for [server]) and ``default`` the entry used when the tag is absent.  The table is
    validated by the entry's ``config_type``.  A key of the old flat section that the entry does not take is
    dropped when it holds its old default (config.json written before the sections were split), and refused
    otherwise, naming the kinds that take it.
    """

    TAGGED_SECTIONS[section] = (registry_of, tag, default)

    def validate(value: Any) -> BaseModel:
        registry = registry_of()
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="python")
        if not isinstance(value, dict):
            raise PydanticCustomError(
                f"{section}_table", "expected a table such as [{section}] {tag} = \"{default}\", got {value}",
                {"section": section, "tag": tag, "default": default, "value": _short(value)},
            )
        name = value.get(tag, default)
        entry = registry.lookup(name) if isinstance(name, str) else None
        if entry is None:
            raise PydanticCustomError(f"unknown_{section}", "{message}", {"message": registry.unknown_message(name, f"{section}.{tag}")})
        fields = entry.config_type.model_fields
        legacy = LEGACY_FLAT_DEFAULTS.get(section, {})
        table = {}
        for key, item in value.items():
            if key not in fields and item is None:
                continue  # `data.limit_per_class = none` (a sweep's default for a key of some data sets): the key unset
            if key not in fields and key in legacy and _same_value(item, legacy[key]):
                continue  # an old config.json's key of another kind, at the default it had: it never changed anything
            if key not in fields and key != tag:
                owners = [other for other in registry.names() if key in registry.lookup(other).config_type.model_fields]
                if owners:
                    raise PydanticCustomError(
                        f"{section}_key_of_another_kind", "{message}",
                        {"message": f"{section}.{key} is a key of {', '.join(owners)}, not of {section}.{tag} = {name!r}, "
                         f"whose keys are: {', '.join(k for k in fields if k != tag)}; remove it, or set {section}.{tag} to one of those"},
                    )
            table[key] = item
        return entry.config_type.model_validate({**table, tag: name})

    return Annotated[Any, BeforeValidator(validate)]


def legacy_flat_form(content: dict[str, Any]) -> dict[str, Any]:
    """``content`` (a to_dict table) with each tagged section completed by the old flat defaults it leaves out: the
    form fingerprints are computed from, so a config hashes as it did before the sections became tagged unions."""
    completed = dict(content)
    for section, defaults in LEGACY_FLAT_DEFAULTS.items():
        if isinstance(completed.get(section), dict):
            completed[section] = {**defaults, **completed[section]}
    return completed


# [data]: a tagged union over the registered data sets (driftlab.data.registry); every data set's section subclasses
# driftlab.data.registry.DataSection, the keys all share, and holds its own keys besides.
DataConfig = registered_section("data", lambda: data_sets.REGISTRY, "name", DEFAULT_DATA_SET)

# [model]: a tagged union over the registered models (driftlab.models.registry); every model's section subclasses
# driftlab.models.ModelSection (loss, classifier) and holds its own keys besides (mlp: hidden; lstm: rnn_hidden, ...).
DEFAULT_MODEL = "mlr"
ModelConfig = registered_section("model", lambda: models.REGISTRY, "name", DEFAULT_MODEL)

# [server]: a tagged union over the registered server optimizers (driftlab.optim.registry), named by server.optimizer;
# every optimizer's section subclasses driftlab.optim.registry.ServerOptimizerConfig (lr) and holds its own keys besides
# (momentum: momentum; adam: beta1, beta2, epsilon, bias_correction; chain: transforms, the stages of a chain in TOML).
ServerConfig = registered_section(
    "server", lambda: server_optimizers.REGISTRY, server_optimizers.TAG, server_optimizers.DEFAULT
)


class ExperimentConfig(_Section):
    seed: int = Field(0, ge=0, description="experiment seed: client samples, minibatches and initialisation derive from it")
    rounds: int = Field(100, ge=1, le=10_000_000, description="communication rounds (at most 10 million: a record is kept per round)")
    device: str = Field(
        "cpu",
        description="cpu, cuda, cuda:N, auto (cuda when available), or several GPUs as cuda:0,cuda:1 "
        "(the vectorized backend spreads a round's client chunks over them; the first holds the model and aggregates)",
    )
    precision: Literal["float32", "float64", "tf32", "bf16"] = Field(
        "float32",
        description="arithmetic: float32 or float64 for everything; tf32 (CUDA only) or bf16 for local steps' gradients, "
        "with parameters, state and aggregation in float32 (docs/performance.md: what each does to accuracy)",
    )
    convolution: Literal["grouped", "unfold"] | None = Field(
        None,
        description="how the vectorized backend's batched layers compute a chunk's convolutions: grouped (one grouped "
        "convolution per layer, the default) or unfold (im2col and one matrix product per client); the same function to "
        "rounding, a different speed per device (docs/performance.md); chunks of one client and the sequential backend use "
        "the module's own layer (unset: grouped)",
    )
    backend: Literal["auto", "vectorized", "sequential"] = Field(
        "auto",
        description="local training backend: vectorized (a round's clients trained together), sequential (one by one, the reference), "
        "or auto (what docs/performance.md measured faster for the model and device: vectorized on a GPU and for the zoo's models, "
        "sequential for other modules on a CPU and for recurrent networks (LSTM, GRU) on a GPU)",
    )
    checkpoint_every: int = Field(10, ge=1, description="write a checkpoint every N rounds (and at the end or on interruption)")
    keep_checkpoint: bool = Field(
        False,
        description="keep the last checkpoint (and the disk store's client_state folder) once the run completes; by default a completed "
        "run keeps its final model and metrics only, and raising rounds later re-runs it from round 0 (the same numbers, the time again) "
        "instead of continuing from the checkpoint; interrupted, failed and diverged runs always keep theirs",
    )
    data: DataConfig = Field(default_factory=lambda: data_sets.REGISTRY.entries[DEFAULT_DATA_SET].config_type())
    model: ModelConfig = Field(default_factory=lambda: models.MODELS[DEFAULT_MODEL].config_type())
    plugins: tuple[Annotated[str, Field(min_length=1)], ...] = Field(
        (),
        description='modules imported before the config is validated, to register algorithms of your own: module names, or paths of '
        '.py files relative to this config file (or the working directory), e.g. ["my_algorithm.py"]; config.json records them, '
        "so sweeps, resume and report import them too (docs/design.md, Writing a plugin)",
    )
    algorithm: AlgorithmConfig = Field(default_factory=lambda: registry.ALGORITHMS[DEFAULT_ALGORITHM].config_type())
    client: ClientConfig = ClientConfig()
    server: ServerConfig = Field(default_factory=lambda: server_optimizers.REGISTRY.entries["sgd"].config_type())
    sampling: SamplingConfig = SamplingConfig()
    availability: AvailabilityConfig = AvailabilityConfig()
    compression: CompressionConfig = CompressionConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    state: StateConfig = StateConfig()
    privacy: PrivacyConfig | None = Field(
        None,
        description="client-level differential privacy: clipping, noise, accounting (the [privacy] keys); "
        "absent = not private",
    )
    system: SystemConfig | None = Field(
        None,
        description="simulated time: device speeds and bandwidths, the virtual clock, deadline and over-selection (the "
        "[system] keys); absent = rounds are not timed",
    )
    asynchronous: AsynchronousConfig | None = Field(
        None,
        description="asynchronous FedBuff on the simulated clock (the [asynchronous] keys; needs [system]); absent = "
        "synchronous rounds",
    )
    memory_budget: int | str | None = Field(
        None,
        description='memory the client states may take, in bytes or as "4GB", "512MB", "1.5GiB": state.store=auto '
        "puts them on disk beyond it, the disk store's row cache takes a sixteenth of it (at most 512 MiB), and a round trains its "
        "clients in waves (and the vectorized backend its CPU chunks) that fit an eighth of it; none = half of the memory the "
        "process may hold (physical, ulimit, cgroup, SLURM) (waves of 1 GiB). A GPU's chunks take 80% of its memory, split "
        "between the runs sharing it (DRIFTLAB_GPU_SHARE=N)",
    )
    log: tuple[Literal["tensorboard", "wandb", "mlflow"], ...] = Field(
        (),
        description='experiment trackers fed with every round\'s record, e.g. ["tensorboard", "mlflow"] (extras driftlab[tensorboard], '
        "driftlab[wandb], driftlab[mlflow]); not part of the run's identity, so a run can be resumed with logging turned on",
    )

    @model_validator(mode="after")
    def _device_is_known(self) -> "ExperimentConfig":
        device = self.device
        if "," in device:
            devices = [part.strip() for part in device.split(",")]
            if not all(part.startswith("cuda:") and part[5:].isdigit() for part in devices) or len(set(devices)) != len(devices):
                raise ValueError(f"several devices must be distinct GPUs written cuda:N, e.g. cuda:0,cuda:1; got {device!r}")
        elif device not in ("cpu", "cuda", "auto") and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError(f"device must be cpu, cuda, cuda:N, auto or a list like cuda:0,cuda:1, got {device!r}")
        return self

    @model_validator(mode="after")
    def _convolution_needs_the_vectorized_backend(self) -> "ExperimentConfig":
        if self.convolution == "unfold" and self.backend == "sequential":
            raise ValueError(
                "convolution=unfold says how the vectorized backend's batched layers compute, but backend=sequential trains "
                "each client with its own module; set backend=vectorized (or auto), or leave convolution unset"
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
        self, ignore: tuple[str, ...] = ("rounds", "checkpoint_every", "keep_checkpoint", "device", "log", "state", "memory_budget", "plugins")
    ) -> str:
        """A hash of everything that determines the numbers a run produces (not its length, where it runs or where it is logged,
        nor where its plugins' files are: the algorithm's name and hyperparameters are in the hash).  Your own data is
        ``data.name = "custom"`` here; its ``data.digest`` is compared on its own (``run_directory.check_run_directory``)."""
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


# ---------------------------------------------------------------- loading and overrides


def read_config_source(source: str | Path) -> dict[str, Any]:
    """The raw table of a TOML (or JSON) file, or of a shipped preset when ``source`` names one,
    with its ``base`` (a preset or another file) merged under it."""
    return _read_with_base(source, chain=())


def _read_with_base(source: str | Path, chain: tuple[str, ...]) -> dict[str, Any]:
    table, origin, identity, folder = _read_one(source)
    if identity in chain:
        cycle = " -> ".join([*chain[chain.index(identity):], identity])
        raise ConfigError(f"{origin}: its `base` chain comes back to itself ({cycle}); remove one of these `base` keys")
    base = table.pop("base", None)
    if base is None:
        return table
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{origin}: `base` must name a preset (such as \"synthetic-fedavg\") or a config file, got {_short(base)}")
    if len(chain) >= MAX_BASE_CHAIN:
        raise ConfigError(f"{origin}: more than {MAX_BASE_CHAIN} files built on one another through `base`; flatten some of them")
    base = _base_source(base, folder)
    try:
        under = _read_with_base(base, (*chain, identity))
    except ConfigError as error:
        raise ConfigError(f"{origin}: base {base!r}: {error}") from None
    return merge_tables(under, table)


def _base_source(base: str, folder: Path | None) -> str:
    if folder is not None and not Path(base).is_absolute() and (folder / base).is_file():
        return str(folder / base)  # relative to the file that names it, as in sweep files
    return base


def _where_set(source: str | Path, path: list[str]) -> str | None:
    """Which file of ``source``'s ``base`` chain sets the value at ``path``, as ``FILE: line N`` (the line where plainly found).

    The topmost file that sets it: its value is the one merged. Reads the chain again, so only for an error message;
    a base is named as ``_read_with_base`` names it (``top.toml: base 'b.toml': b.toml: line 3``).
    """
    chain = ""
    for _ in range(MAX_BASE_CHAIN + 1):
        try:
            table, origin, _, folder = _read_one(source)
        except ConfigError:
            return None
        node: Any = table
        for part in path:
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is not _ABSENT:
            line = _line_setting(Path(origin).read_text(encoding="utf-8"), path) if Path(origin).suffix == ".toml" and Path(origin).is_file() else None
            return chain + (origin if line is None else f"{origin}: line {line}")
        base = table.get("base")
        if not isinstance(base, str) or not base.strip():
            return None
        chain += f"{origin}: base {base!r}: "
        source = _base_source(base, folder)
    return None


_ABSENT = object()


def _line_setting(text: str, path: list[str]) -> int | None:
    """The line of a TOML text that plainly sets ``path``: ``client = 5``, ``client.lr = 5``, or ``lr = 5`` under ``[client]``."""
    def parts(key: str) -> list[str]:
        return [part.strip().strip("\"'") for part in key.split(".")]

    header: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("["):
            header = parts(stripped.partition("#")[0].strip().strip("[]"))
            if header == path:
                return number
        elif "=" in stripped and header + parts(stripped.partition("=")[0]) == path:
            return number
    return None


def _read_one(source: str | Path) -> tuple[dict[str, Any], str, str, Path | None]:
    """(table, origin for messages, identity for cycle detection, folder that relative bases start from)."""
    path = Path(source)
    if path.is_file():
        origin = str(path)
        text = read_config_text(path)
        identity, folder = str(path.resolve()), path.parent
    elif str(source) in preset_names():
        origin = f"preset {source}"
        text = resources.files(PRESET_PACKAGE).joinpath(f"{source}.toml").read_text()
        identity, folder = origin, None
    else:
        guess = did_you_mean(str(source)[:200], preset_names())
        hint = f" (did you mean {guess!r}?)" if guess else ""
        raise ConfigError(f"{str(source)[:200]!r} is neither a config file nor a preset{hint}; presets: {', '.join(preset_names())}")
    if path.is_file() and path.suffix.lower() == ".json":
        # the resolved config a run writes (config.json), so `driftlab run DIR/config.json --out DIR --resume` works
        try:
            table = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{origin} is not valid JSON: {error}") from None
        except RecursionError:
            raise ConfigError(f"{origin} is nested too deeply to be a config (a config nests at most {MAX_NESTING} levels)") from None
        if not isinstance(table, dict):
            raise ConfigError(f"{origin} must hold a JSON object (a table of sections), got {type(table).__name__}")
    else:
        table = parse_toml(text, origin)
    check_plain_values(table, origin)
    plugins = table.get("plugins")
    if folder is not None and isinstance(plugins, (str, list)):
        # relative to this file, wherever the config is loaded from (a plain string is one plugin)
        plugins = [plugins] if isinstance(plugins, str) else plugins
        table["plugins"] = [resolve_plugin(p, folder) if isinstance(p, str) and p else p for p in plugins]
    if folder is not None:
        table = with_function_paths_resolved(table, folder)
    return table, origin, identity, folder


def read_config_text(path: Path) -> str:
    """The file's text, refused before parsing when it is larger than a config can be or not UTF-8."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path} is larger than {MAX_CONFIG_BYTES:,} bytes, far more than a config needs "
            "(the shipped presets are about 1 kB); is it the right file?"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {error.start} is {data[error.start:error.start + 1]!r}); save it as UTF-8"
        ) from None


def parse_toml(text: str, origin: str) -> dict[str, Any]:
    """``tomllib.loads(text)``, refused with a ConfigError naming ``origin`` when it is not TOML or not shaped like a config
    (``check_toml_shape``: bounded before ``tomllib`` allocates)."""
    check_toml_shape(text, origin, pieces=False)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{origin} is not valid TOML: {error}") from None
    except RecursionError:
        raise ConfigError(f"{origin} is nested too deeply to be a config (a config nests at most {MAX_NESTING} levels)") from None


def check_plain_values(table: Any, origin: str) -> None:
    """Refuse nesting deeper than ``MAX_NESTING`` and TOML dates/times, naming the key.

    Iterative, so a hostile depth cannot exhaust Python's recursion limit; it runs before
    anything recursive (deep copies, merges, pydantic) sees the table.
    """
    pending: list[tuple[Any, str, int]] = [(table, "", 0)]
    while pending:
        value, key, depth = pending.pop()
        if depth > MAX_NESTING:
            raise ConfigError(
                f"{origin}: {key[:200] or 'the table'} is nested more than {MAX_NESTING} levels deep; "
                "a config is sections of keys, with at most a schedule table or a list of events inside"
            )
        if isinstance(value, dict):
            pending.extend((child, f"{key}.{name}" if key else str(name), depth + 1) for name, child in value.items())
        elif isinstance(value, (list, tuple)):
            pending.extend((child, f"{key}[{index}]", depth + 1) for index, child in enumerate(value))
        elif isinstance(value, (datetime.date, datetime.time)):  # datetime.datetime is a date
            raise ConfigError(
                f"{origin}: {key or 'value'} = {value.isoformat()}: TOML dates and times are not allowed in a config; "
                "write a number or a quoted string"
            )


def merge_tables(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, key by key; the string ``"none"`` in ``top`` removes the key.

    A schedule table (it has ``kind``) and an ``[algorithm]`` naming another algorithm replace the
    base's value whole: mixing two schedules' or two algorithms' keys would only give unknown keys.
    """
    merged = dict(base)
    for key, value in top.items():
        below = merged.get(key)
        if isinstance(value, str) and value.strip().lower() == "none":
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(below, dict) and not _replaces_whole(key, below, value):
            if key in TAGGED_SECTIONS:
                tag = TAGGED_SECTIONS[key][1]
                if value.get(tag) not in (None, below.get(tag, TAGGED_SECTIONS[key][2])):
                    below = without_other_kinds_keys(key, below, value[tag])  # another kind: the base's own keys go
            merged[key] = merge_tables(below, value)
        else:
            merged[key] = value
    return merged


def _replaces_whole(key: str, below: dict[str, Any], value: dict[str, Any]) -> bool:
    if "kind" in value or "kind" in below:
        return True
    return key == "algorithm" and value.get("name") not in (None, below.get("name", DEFAULT_ALGORITHM))


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """``"client.lr=0.05"`` -> ``(["client", "lr"], 0.05)``; values are TOML values, bare words are strings."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {_short(assignment)} is not of the form section.key=value (for example client.lr=0.05)")
    raw = raw.strip()
    path = key.strip().split(".")
    if len(path) > MAX_NESTING:
        raise ConfigError(f"override {key.strip()[:100]}...: a key has at most {MAX_NESTING} dotted parts (section.key), got {len(path)}")
    if "[" in raw or "{" in raw:
        check_toml_shape(f"value = {raw}", f"override {key.strip()[:100]}", pieces=False)
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError:
        raise ConfigError(f"override {key.strip()[:100]}=...: the value is nested too deeply (at most {MAX_NESTING} levels)") from None
    if raw.lower() in ("none", "null"):
        value = None
    check_plain_values(value, f"override {key.strip()[:100]}")
    return path, value


def apply_overrides(
    table: dict[str, Any], overrides: list[str], where: Callable[[list[str]], str | None] | None = None
) -> dict[str, Any]:
    """``table`` with each ``section.key=value`` set in turn (a copy).

    ``where(path)`` names the file that set ``table``'s value at ``path`` (``load_config`` passes one), so that
    an override reaching into a value blames the file when the file put a value where a section belongs.
    """
    table = json.loads(json.dumps(table))  # deep copy of plain data
    applied: list[tuple[list[str], str]] = []
    for assignment in overrides:
        path, value = parse_override(assignment)
        node = table
        for depth, part in enumerate(path[:-1], start=1):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(_reaching_into_a_value(assignment, path[:depth], child, table, applied, where))
            node = child
        if path[0] == "algorithm" and path[-1] == "name" and len(path) == 2 and node.get("name") not in (None, value):
            # switching algorithm: the old algorithm's keys do not apply to the new one
            node.clear()
        elif len(path) == 2 and path[0] in TAGGED_SECTIONS and path[1] == TAGGED_SECTIONS[path[0]][1]:
            if node.get(path[1], TAGGED_SECTIONS[path[0]][2]) != value:  # switching model, data set or server optimizer
                kept = without_other_kinds_keys(path[0], node, value)
                node.clear()
                node.update(kept)
        node[path[-1]] = value
        applied.append((path, assignment))
    return table


def _reaching_into_a_value(
    assignment: str, prefix: list[str], value: Any, table: dict[str, Any], applied: list[tuple[list[str], str]],
    where: Callable[[list[str]], str | None] | None,
) -> str:
    """The message for an override ``a.b.c=1`` whose ``a.b`` (``prefix``) holds a value, naming whoever is at fault.

    Where the config has a section (``client``, ``model``), the value is the fault, so the file (or the earlier
    override) that set it is named first; where it has a value (``client.lr``), the override reaching into it is.
    """
    dotted = ".".join(prefix)
    # the last override that wrote this value (or a table holding it) set it, else the config it was applied to
    setter = next((f"override {_short(done)}" for path, done in reversed(applied) if path == prefix[: len(path)]), None)
    origin = setter or (where(prefix) if where is not None else None) or "the config"
    sections = {name: section for name, section in table.items() if isinstance(section, dict)}  # `algorithm = 5` has no name to read
    if _section_model(prefix, sections) is not None:
        return (
            f"{origin}: {dotted} = {_short(value)}, but {dotted} is a section of keys (override {_short(assignment)} "
            f"sets one of them): write [{dotted}] and its keys under it, as `driftlab config` lists them"
        )
    return (
        f"override {_short(assignment)}: {dotted} is a value, not a section ({dotted} = {_short(value)} from {origin}); "
        f"set {dotted}=... itself"
    )


def load_config(source: str | Path | dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Validate a config file, preset name or table (``None``: all defaults), with overrides applied."""
    if source is None:
        table: dict[str, Any] = {}
    elif isinstance(source, dict):
        check_plain_values(source, "config")
        table = source
    else:
        table = read_config_source(source)
    where = None if source is None or isinstance(source, dict) else (lambda path: _where_set(source, path))
    table = apply_overrides(table, list(overrides), where)
    if where is None or not overrides:
        return validate_config(table)
    # a file and overrides: each problem says which of them gave the key its value
    given = [(parse_override(assignment)[0], assignment) for assignment in overrides]
    return validate_config(table, lambda key: _given_by(key.split("."), given, where))


def _given_by(path: list[str], given: list[tuple[list[str], str]], where: Callable[[list[str]], str | None]) -> str | None:
    """Where the value at ``path`` came from: the last override that set it (or a table holding it), else the file
    that set it and the overrides that set keys inside it."""
    whole = next((assignment for key, assignment in reversed(given) if key == path[: len(key)]), None)
    if whole is not None:
        return f"override {_short(whole)}"
    inside = [f"override {_short(assignment)}" for key, assignment in given if key[: len(path)] == path]
    return " and ".join(filter(None, [where(path), *inside[:3]])) or None


def validate_config(table: dict[str, Any], given_by: Callable[[str], str | None] | None = None) -> ExperimentConfig:
    """The validated config, or one ``ConfigError`` listing every problem found (the first ``MAX_LISTED_PROBLEMS``).

    The config's ``plugins`` are imported first (a ConfigError naming the one that fails), so
    the algorithms they register validate like the built-ins; paths are recorded absolute.
    ``given_by(key)`` names where a key's value came from (a file's line, an override), added to its problem.
    """
    table = with_function_paths_resolved(with_plugins_loaded(table))
    algorithm = table.get("algorithm")
    if isinstance(algorithm, dict) and "name" not in algorithm:
        # an [algorithm] section without `name` configures the default algorithm
        table = {**table, "algorithm": {"name": DEFAULT_ALGORITHM, **algorithm}}
    problems = _non_finite_numbers(table)
    config = None
    try:
        config = ExperimentConfig.model_validate(table)
    except ValidationError as error:
        flagged = {key for key, _ in problems}
        # a non-finite schedule parameter also fails its schedule: report it once, at the parameter
        problems += [(key, message) for key, message in validation_problems(error, table) if not any(f == key or f.startswith(f"{key}.") for f in flagged)]
    if config is not None and not problems:
        problems = _booleans_taken_as_numbers(table, config) + _server_step_conflicts(config)
        problems += _privacy_conflicts(config) + _system_conflicts(config)
    if problems:
        if given_by is not None:  # for the problems listed only: each may read the config's files again
            for index, (key, message) in enumerate(problems[:MAX_LISTED_PROBLEMS]):
                source = given_by(key)
                problems[index] = (key, f"{message} (from {source})" if source else message)
        raise ConfigError(format_problems(problems))
    return config


def with_plugins_loaded(table: Any) -> Any:
    """``table`` with its ``plugins`` imported and their paths made absolute (relative ones are
    taken from the working directory; a config file's own are resolved against its folder on reading).

    A ``plugins`` value that is not a list of strings (or a table that is not one) is left for validation to report.
    """
    plugins = table.get("plugins") if isinstance(table, dict) else None
    if isinstance(plugins, str) and plugins:
        plugins = [plugins]  # `plugins=my_algorithm.py` on the command line: one plugin
    if not isinstance(plugins, (list, tuple)) or not all(isinstance(p, str) and p for p in plugins):
        return table
    resolved = [resolve_plugin(plugin) for plugin in plugins]
    load_plugins(resolved)
    return {**table, "plugins": resolved}


FUNCTION_KEYS = (("data", "loader"), ("model", "loss"))  # "module:function" references, imported when the run needs them


def with_function_paths_resolved(table: Any, folder: Path | None = None) -> Any:
    """``table`` with the file paths of ``data.loader`` and ``model.loss`` made absolute: relative to ``folder``
    (a config file's) like plugins, else to the working directory; module names are kept."""
    if not isinstance(table, dict):
        return table
    resolved = dict(table)
    for section, key in FUNCTION_KEYS:
        values = resolved.get(section)
        reference = values.get(key) if isinstance(values, dict) else None
        if isinstance(reference, str) and ":" in reference:
            source, _, name = reference.rpartition(":")
            if source:
                resolved[section] = {**values, key: f"{resolve_plugin(source, folder)}:{name}"}
    return _with_trace_resolved(resolved, folder)


def _with_trace_resolved(table: dict[str, Any], folder: Path | None) -> dict[str, Any]:
    """``system.trace`` made absolute like a plugin's path: relative to ``folder`` (the config file's) when the file is
    there or not in the working directory, else to the working directory."""
    system = table.get("system")
    trace = system.get("trace") if isinstance(system, dict) else None
    if not isinstance(trace, str) or not trace or Path(trace).expanduser().is_absolute():
        return table
    given = Path(trace).expanduser()
    path = folder / given if folder is not None and ((folder / given).is_file() or not given.is_file()) else given
    return {**table, "system": {**system, "trace": str(path.resolve())}}


def config_from_record(table: dict[str, Any]) -> ExperimentConfig:
    """A resolved config as a run recorded it (config.json, a sweep run's table): its plugins imported, then validated.

    Raises pydantic's ValidationError for a table that is not a config, and ConfigError for a plugin that cannot be imported.
    """
    return ExperimentConfig.model_validate(with_plugins_loaded(table))


def _server_step_conflicts(config: ExperimentConfig) -> list[tuple[str, str]]:
    entry = registry.ALGORITHMS[config.algorithm.name]
    problems = []
    if entry.owns_server_step and config.server.optimizer != "sgd":
        problems.append((
            "server.optimizer",
            f"{entry.name} has its own server step and does not use a server optimizer; use sgd (got {config.server.optimizer!r})",
        ))
    if not entry.uses_server_lr and not is_constant_one(config.server.lr):
        problems.append(("server.lr", f"{entry.name} has its own server step; set server.lr = 1 (got {_short(config.server.lr)})"))
    return problems


UNBOUNDED = {("privacy.clip", math.inf)}  # (key, value): +inf meaning "no bound" (privacy.clip = inf: no clipping)


def _privacy_conflicts(config: ExperimentConfig) -> list[tuple[str, str]]:
    """What ``[privacy]`` cannot be combined with, by key: the sampling, membership changes, compression of local noise.

    The checks that need the data (δ below 1/N, a reachable target ε) are ``assembly.privacy_settings``'s.
    """
    privacy = config.privacy
    if privacy is None:
        return []
    problems = []
    sampling = config.sampling
    if sampling.mode == "weighted":
        problems.append((
            "sampling.mode",
            "weighted sampling draws clients with probability n_k/n, which reveals their private data sizes; with "
            '[privacy] set sampling.mode = "poisson" (or "uniform")',
        ))
    elif privacy.accounted_centrally and not (sampling.mode == "poisson" or sampling.participation == 1):
        problems.append((
            "sampling.mode",
            f"central noise is accounted for clients sampled independently, not for a fixed cohort of "
            f'{sampling.participation:g} of them: set sampling.mode = "poisson" (or sampling.participation = 1)',
        ))
    for key in ("events", "initially_registered"):
        if getattr(config.availability, key) not in ((), None):
            problems.append((
                f"availability.{key}",
                "[privacy] needs a fixed population of clients (its sampling rate and δ below 1/N): remove "
                f"availability.{key}, or remove [privacy]",
            ))
    ratio = config.compression.ratio
    if ratio is None:
        ratio = registry.ALGORITHMS[config.algorithm.name].default_compression_ratio
    if privacy.noise == "local" and ratio < 1:
        problems.append((
            "privacy.noise",
            f"local noise is drawn for the message a client sends, which compression (ratio {ratio:g}) then cuts down, "
            'keeping part of the message and its noise: set compression.ratio = 1, or privacy.noise = "central"',
        ))
    return problems


def _system_conflicts(config: ExperimentConfig) -> list[tuple[str, str]]:
    """What ``[asynchronous]`` (FedBuff on the simulated clock) cannot be combined with, and over-selection with poisson
    sampling; by key.  The algorithm's own refusal (``Algorithm.asynchronous_problem``) is assembly's check."""
    problems = []
    system, sampling = config.system, config.sampling
    if system is not None and system.over_selection > 0 and sampling.mode == "poisson":
        problems.append((
            "system.over_selection",
            "a poisson cohort has no fixed size to over-select: set system.over_selection = 0, or sampling.mode = "
            '"uniform"',
        ))
    if config.asynchronous is None:
        return problems
    remove = "or remove [asynchronous]"
    if system is None:
        problems.append((
            "asynchronous",
            "asynchronous rounds run on the simulated clock of [system]: add a [system] section (its defaults draw "
            f"lognormal devices), {remove}",
        ))
    if config.privacy is not None:
        problems.append(("privacy", f"[privacy] is not accounted for asynchronous updates: remove [privacy], {remove}"))
    ratio = config.compression.ratio
    if ratio is None:
        ratio = registry.ALGORITHMS[config.algorithm.name].default_compression_ratio
    if ratio < 1:
        whose = "" if config.compression.ratio is not None else f", {config.algorithm.name}'s default"
        problems.append((
            "compression.ratio",
            f"asynchronous messages are sent uncompressed (ratio {ratio:g}{whose}): set compression.ratio = 1, {remove}",
        ))
    for key in ("inactive_probability", "incomplete_probability"):
        if getattr(config.availability, key) > 0:
            problems.append((
                f"availability.{key}",
                f"an asynchronous client's availability and work come from [system] (its device and trace windows): set "
                f"availability.{key} = 0, {remove}",
            ))
    if system is not None and system.deadline is not None:
        problems.append((
            "system.deadline",
            f"a deadline times synchronous rounds; an asynchronous server waits for its buffer: remove system.deadline, {remove}",
        ))
    if system is not None and system.over_selection > 0:
        problems.append((
            "system.over_selection",
            f"over-selection is for synchronous rounds: set system.over_selection = 0, {remove}",
        ))
    if sampling.mode != "uniform":
        # sampling.participation is simply not read (presets set it for their synchronous runs); a mode is a promise
        # about who is drawn (n_k-weighted, independent coins) that an asynchronous run would not keep
        problems.append((
            "sampling.mode",
            f"an asynchronous run dispatches idle clients uniformly, asynchronous.concurrency at a time, instead of "
            f'sampling {sampling.mode} cohorts: set sampling.mode = "uniform", {remove}',
        ))
    return problems


def _non_finite_numbers(table: dict[str, Any]) -> list[tuple[str, str]]:
    # pydantic lets inf through `ge`/`gt` bounds and algorithm configs are not _Sections
    problems = []
    pending: list[tuple[Any, str]] = [(table, "")]
    while pending:
        value, key = pending.pop()
        if isinstance(value, dict):
            pending.extend((child, f"{key}.{name}" if key else str(name)) for name, child in value.items())
        elif isinstance(value, (list, tuple)):
            pending.extend((child, key) for child in value)
        elif isinstance(value, float) and not math.isfinite(value) and (key, value) not in UNBOUNDED:
            problems.append((key, f"must be a finite number, got {value!r}"))
    return sorted(problems)


def _booleans_taken_as_numbers(table: dict[str, Any], config: BaseModel) -> list[tuple[str, str]]:
    """Keys given true/false that validation turned into a number (pydantic reads true as 1)."""
    problems = []
    pending: list[tuple[Any, Any, str]] = [(table, config, "")]
    while pending:
        given, validated, key = pending.pop()
        if isinstance(given, bool):
            # None: a key the section dropped (another kind's, at its old default), so not read as a number either
            if validated is not None and not isinstance(validated, bool):
                problems.append((key, f"expected a number, got {str(given).lower()}"))
        elif isinstance(given, dict) and isinstance(validated, BaseModel):
            for name, child in given.items():
                pending.append((child, getattr(validated, name, None), f"{key}.{name}" if key else str(name)))
        elif isinstance(given, (list, tuple)) and isinstance(validated, (list, tuple)) and len(given) == len(validated):
            pending.extend((child, out, key) for child, out in zip(given, validated, strict=True))
    return sorted(problems)


def format_validation_error(error: ValidationError, table: dict[str, Any]) -> str:
    return format_problems(validation_problems(error, table))


def format_problems(problems: list[tuple[str, str]]) -> str:
    """``invalid configuration:`` and one line per problem, at most ``MAX_LISTED_PROBLEMS`` of them."""
    lines = [f"  {key[:200]}: {message}" for key, message in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more")
    return "invalid configuration:\n" + "\n".join(lines) + "\nrun `driftlab config` to list every key with its meaning and default"


def validation_problems(error: ValidationError, table: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, message) for each of pydantic's errors, in words a user can act on."""
    problems = []
    for item in error.errors(include_url=False):
        loc = [str(part) for part in item["loc"] if not isinstance(part, int)]
        key = ".".join(loc) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            valid = _valid_keys(loc[:-1], table)
            message = f"unknown key; valid keys here: {', '.join(valid)}{_key_hint(loc, valid, table)}"
        elif (
            "input" in item
            and item["type"] not in ("missing", "unknown_algorithm", "algorithm_table")
            and not item["type"].startswith("unknown_")
            and not item["type"].endswith(("_table", "_key_of_another_kind"))
            and "got " not in message
        ):
            message = f"{message} (got {_short(item['input'])})"
        problems.append((key, message))
    return problems


def _key_hint(loc: list[str], valid: list[str], table: dict[str, Any]) -> str:
    """``; did you mean client.lr?`` for a misspelt key, or where else the key exists: another section, or the algorithms that own it."""
    name = loc[-1]
    guess = did_you_mean(name, valid)
    if guess is not None:
        return f"; did you mean {'.'.join([*loc[:-1], guess])}?"
    if loc[:-1] == ["algorithm"]:
        owners = algorithms_with_key(name)
        algorithm = table.get("algorithm")
        current = algorithm.get("name", DEFAULT_ALGORITHM) if isinstance(algorithm, dict) else DEFAULT_ALGORITHM
        if owners:
            return f"; {name} is a key of {', '.join(repr(o) for o in owners)}, not of {_short(current)}"
    if loc[:-1] == ["server"]:  # a misspelt key of another optimizer (server.betaa with optimizer = "sgd")
        entries = server_optimizers.REGISTRY.entries
        guess = did_you_mean(name, sorted({key for entry in entries.values() for key in entry.config_type.model_fields}))
        if guess is not None:
            owners = " or ".join(repr(other) for other, entry in entries.items() if guess in entry.config_type.model_fields)
            return f"; did you mean server.{guess} (a key of server.optimizer = {owners})?"
    elsewhere = [f"{section}.{name}" for section, model in _sections() if section and section != ".".join(loc[:-1]) and name in model.model_fields]
    elsewhere = list(dict.fromkeys(elsewhere))  # [model] is listed once per model
    return f"; did you mean {' or '.join(elsewhere)}?" if elsewhere else ""


def algorithms_with_key(key: str) -> list[str]:
    """The registered algorithms whose ``[algorithm]`` section has ``key`` (``mu``: fedprox)."""
    return [name for name, entry in registry.ALGORITHMS.items() if key in entry.config_type.model_fields and key != "name"]


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section type of a field: ``ClientConfig``, or ``PrivacyConfig`` of an optional ``PrivacyConfig | None``."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    sections = [option for option in options if isinstance(option, type) and issubclass(option, BaseModel)]
    return sections[0] if len(sections) == 1 and all(o in (sections[0], type(None)) for o in options) else None


def _sections() -> list[tuple[str, type[BaseModel]]]:
    """(name, model) of every section of a config; the top level is named ""."""
    found = [("", ExperimentConfig)]
    for name, info in ExperimentConfig.model_fields.items():
        section = _section_type(info.annotation)
        if section is not None:
            found.append((name, section))
    found.append(("data", data_sets.DataSection))  # the keys every data set has
    found.append(("server", server_optimizers.ServerOptimizerConfig))  # the key every server optimizer has (lr)
    found += [("model", entry.config_type) for entry in models.MODELS.values()]  # [model]: each model's keys
    return found


def _section_model(path: list[str], table: dict[str, Any]) -> type[BaseModel] | None:
    model: type[BaseModel] = ExperimentConfig
    for part in path:
        if part == "algorithm" and model is ExperimentConfig:
            name = (table.get("algorithm") or {}).get("name", DEFAULT_ALGORITHM)
            entry = registry.ALGORITHMS.get(name) if isinstance(name, str) else None
            model = (entry or registry.ALGORITHMS[DEFAULT_ALGORITHM]).config_type
            continue
        if part == "model" and model is ExperimentConfig:
            section = table.get("model")
            name = section.get("name", DEFAULT_MODEL) if isinstance(section, dict) else DEFAULT_MODEL
            entry = models.MODELS.get(name) if isinstance(name, str) else None
            model = (entry or models.MODELS[DEFAULT_MODEL]).config_type
            continue
        if part == "server" and model is ExperimentConfig:
            name = (table.get("server") or {}).get(server_optimizers.TAG, server_optimizers.DEFAULT)
            entry = server_optimizers.REGISTRY.entries.get(name) if isinstance(name, str) else None
            model = (entry or server_optimizers.REGISTRY.entries[server_optimizers.DEFAULT]).config_type
            continue
        if part == "data" and model is ExperimentConfig:
            name = (table.get("data") or {}).get("name", DEFAULT_DATA_SET)
            entry = data_sets.lookup(name) if isinstance(name, str) else None
            model = (entry or data_sets.lookup(DEFAULT_DATA_SET)).config_type
            continue
        annotation = _section_type(model.model_fields[part].annotation) if part in model.model_fields else None
        if annotation is None:
            return None
        model = annotation
    return model


def _valid_keys(path: list[str], table: dict[str, Any]) -> list[str]:
    model = _section_model(path, table)
    return list(model.model_fields) if model else []


def _describe_server_keys(lines: list[str], section: Callable[..., None]) -> None:
    """The [server] part of ``describe_keys``: server.optimizer and lr, each optimizer's own keys, each stage's."""
    base = server_optimizers.ServerOptimizerConfig
    known = server_optimizers.names()
    lines.append(f"[server] keys of every server optimizer; server.optimizer is one of {', '.join(known)}")
    lines.append(
        f'  server.optimizer = "{server_optimizers.DEFAULT}"\n      which server optimizer: one of {", ".join(known)}'
    )
    section("server.", base)
    optimizers = server_optimizers.REGISTRY
    for name in known:
        entry = optimizers.entries[name]
        own = [key for key in entry.config_type.model_fields if key not in (*base.model_fields, server_optimizers.TAG)]
        origin = f" (plugin {optimizers.plugin_source(entry) or optimizers.module(entry)})" if optimizers.is_plugin(entry) else ""
        lines.append(f"[server] when server.optimizer = {name!r}: {server_optimizers.label(name)}{origin}")
        section("server.", entry.config_type, own)
    stages = server_optimizers.TRANSFORMATIONS
    for name in stages.names():
        entry = stages.entries[name]
        origin = f" (plugin {stages.plugin_source(entry) or stages.module(entry)})" if stages.is_plugin(entry) else ""
        applies = "; applies server.lr" if entry.applies_lr else ""
        lines.append(f'[[server.transforms]] name = {name!r}: a stage of optimizer = "chain"{applies}{origin}')
        section("server.transforms[].", entry.config_type, [k for k in entry.config_type.model_fields if k != "name"])


def _describe_model_keys(lines: list[str], section: Any) -> None:
    """[model]: the keys every model has once, then each registered model's own keys."""
    lines.append(f"[model] keys of every model; model.name is one of {', '.join(models.names())} (default {DEFAULT_MODEL!r})")
    section("model.", models.ModelSection)
    for name in models.names():
        entry = models.MODELS[name]
        own = [key for key in entry.config_type.model_fields if key != "name" and key not in models.ModelSection.model_fields]
        plugin = models.REGISTRY.is_plugin(entry)
        origin = f" (plugin {models.REGISTRY.plugin_source(entry) or models.REGISTRY.module(entry)})" if plugin else ""
        lines.append(f"[model] when model.name = {name!r}{origin}: {entry.description or 'no keys of its own'}")
        if own:
            section("model.", entry.config_type, own)


def describe_keys() -> str:
    """Every key with its type, default and meaning, section by section."""
    lines: list[str] = []

    def section(prefix: str, model: type[BaseModel], only: list[str] | None = None) -> None:
        nested = []
        for name, info in model.model_fields.items():
            annotation = _section_type(info.annotation)
            if annotation is not None:
                nested.append((name, annotation))
                if info.default is not None:
                    continue  # an optional section ([privacy]) is also a key, absent (none) by default
            default = info.get_default(call_default_factory=True)
            if (prefix == "" and isinstance(default, BaseModel)) or (only is not None and name not in only):
                continue  # a tagged section ([algorithm], [data]), listed entry by entry below; or a key listed already
            if info.is_required():
                default_text = "(required)"  # no default: a plugin's key, or a chain stage's such as max_norm
            else:
                default_text = json.dumps(_plain(default)) if default is not None else "none"
                default_text = "inf" if default == math.inf else default_text  # privacy.clip: TOML's inf, not JSON's
            description = info.description or ("which algorithm; one of " + ", ".join(registry.names()) if prefix == "algorithm." and name == "name" else "")
            lines.append(f"  {prefix}{name} = {default_text}\n      {description}")
        for name, sub in nested:
            lines.append(f"[{name}]")
            section(f"{name}.", sub)

    lines.append("[top level]")
    section("", ExperimentConfig)
    for name in registry.names():
        entry = registry.ALGORITHMS[name]
        origin = "" if name in registry.BUILT_IN else f" (plugin {registry.plugin_source(entry) or entry.module})"
        lines.append(f"[algorithm] when algorithm.name = {name!r}{origin}")
        section("algorithm.", entry.config_type)
    lines.append(f"[data] keys of every data set; data.name is one of {', '.join(data_sets.REGISTRY.names())}")
    section("data.", data_sets.DataSection)
    for name in data_sets.REGISTRY.names():
        data_set = data_sets.REGISTRY.entries[name]
        if data_set.own_keys:
            plugin = data_sets.REGISTRY.is_plugin(data_set)
            origin = f" (plugin {data_sets.REGISTRY.plugin_source(data_set) or data_sets.REGISTRY.module(data_set)})" if plugin else ""
            lines.append(f"[data] when data.name = {name!r}{origin}")
            section("data.", data_set.config_type, data_set.own_keys)
    _describe_model_keys(lines, section)
    _describe_server_keys(lines, section)
    lines.append(
        'Rates (client.lr, server.lr) and client.steps take a number or a schedule table: '
        '{kind="exponential", initial=0.1, decay=0.99} or {kind="inverse_time", a=1.0, b=10}.'
    )
    return "\n".join(lines)
