"""Run one experiment: ``driftlab.run(config) -> RunResult``, used by the CLI, sweeps and notebooks.

An output directory holds::

    config.json               the resolved configuration (every key, defaults included)
    metrics.jsonl             one JSON object per round, strict JSON (pandas: ``pd.read_json(path, lines=True)``)
    metrics.csv               the same records as a table: one column per key (first-seen order), one row per
                              round, empty where a round lacks a key, lists JSON-encoded; rewritten from the
                              run's records at every checkpoint and when the run ends or stops (after
                              a kill it may trail metrics.jsonl until the next checkpoint)
    checkpoint.safetensors    the last checkpoint (atomic, no pickle)
    client_state/             with the disk client-state store: its files, which the checkpoint refers to
    final_model.safetensors   the final server model, written when the run completes
    run.json                  status (running, complete, interrupted, diverged, failed), rounds done,
                              wall time summed over resumes, parameter count, machine and versions
    .lock                     flock'ed by the process writing the directory (holds its PID)
    tensorboard/ mlruns/ wandb/   with ``log = [...]``: the trackers' files (driftlab.experiments.trackers)

config.json is written first, before any data is loaded, so a run killed at any
moment resumes with ``driftlab run DIR/config.json --out DIR --resume``.  A run
writes only into a new or empty directory, or into a run of its own
configuration (with ``resume``); one process at a time (RunDirectoryBusy).

``resume=True`` continues from the checkpoint: metrics of rounds after it are
dropped and recomputed, which gives bit-identical models and metrics (wall
times aside) because every random draw derives from (seed, round, client id).
The checkpoint's checksum, config.json and every line of metrics.jsonl are
checked before anything is rewritten; only a last line torn by a kill may be
dropped, and a missing or damaged record is an error, never a silent gap.

A round that diverges (a non-finite model entry, loss or norm, or an evaluated loss
above ``evaluation.divergence_factor`` times the initial model's) is neither recorded
nor checkpointed: the run stops with FloatingPointError (status "diverged"), whose
message names the round, the values, and the checkpoint of the last healthy round
(or that none exists).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import json
import os
import platform
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import nn
from safetensors.torch import save_file

from driftlab.algorithms import registry
from driftlab.compress import with_compression
from driftlab.experiments.config import ConfigError, ExperimentConfig, config_from_record, load_config, read_config_source
from driftlab.experiments.compatibility import check_sizes, checked_model
from driftlab.experiments.datasets import DataSetupError, build_dataset, vocabulary_size
from driftlab.experiments.trackers import check_trackers_installed, open_trackers
from driftlab.metrics.summary import summarize
from driftlab.models import build_model
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.checkpoint import load_checkpoint, save_checkpoint, write_atomically
from driftlab.simulation.availability import AvailabilityModel, Membership, MembershipEvent
from driftlab.simulation.engine import (
    EVALUATION_KEYS,
    EvaluationPlan,
    RoundPlan,
    Simulation,
    SimulationState,
    commit_round,
    discard_round,
    disk_stores,
    make_client_stores,
    run_round,
)
from driftlab.simulation.flat import FlatModel, binary_cross_entropy_per_example, objective_per_example
from driftlab.simulation.local_training import SequentialBackend
from driftlab.simulation.precision import check_precision, parameter_dtype
from driftlab.simulation.randomness import Stream, torch_seed
from driftlab.simulation.seam import Algorithm
from driftlab.simulation.vectorized import VectorizedBackend, auto_backend

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
METRICS_CSV_FILE = "metrics.csv"
CHECKPOINT_FILE = "checkpoint.safetensors"
CLIENT_STATE_DIR = "client_state"  # the disk client-state store's files (state.store), which checkpoints refer to
FINAL_MODEL_FILE = "final_model.safetensors"
RUN_INFO_FILE = "run.json"
LOCK_FILE = ".lock"  # flock'ed by the process writing the directory; holds its PID
RUN_FILES = (CONFIG_FILE, METRICS_FILE, METRICS_CSV_FILE, CHECKPOINT_FILE, FINAL_MODEL_FILE, RUN_INFO_FILE)
# What write_atomically leaves of a write a kill interrupted: `.NAME.tmp-PID`.
_INTERRUPTED_WRITE = re.compile(r"^\.(" + "|".join(re.escape(name) for name in RUN_FILES) + r")\.tmp-\d+$")


class RunDirectoryBusy(ConfigError):
    """Another process is writing the run directory (it holds ``DIR/.lock``)."""

BACKENDS = {"sequential": SequentialBackend, "vectorized": VectorizedBackend}


@dataclass
class RunResult:
    """A finished (or interrupted) run: its config, per-round records and final server model."""

    config: ExperimentConfig
    records: list[dict[str, Any]]
    final_params: torch.Tensor
    num_parameters: int
    out_dir: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    def frame(self):
        """The records as a pandas DataFrame, one row per round (needs pandas, which driftlab does not install)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError(
                "RunResult.frame() needs pandas, which driftlab does not install: pip install pandas. "
                "Without pandas, result.records holds the same per-round metrics as a list of dicts "
                "(and a run with an output directory writes them as a table to metrics.csv)"
            ) from None
        return pd.DataFrame(self.records)


def resolve_devices(name: str) -> tuple[torch.device, ...]:
    """The devices of ``config.device``: one, or several GPUs (``cuda:0,cuda:1``), the first holding the model."""
    if name == "auto":
        return (torch.device("cuda" if torch.cuda.is_available() else "cpu"),)
    names = [part.strip() for part in name.split(",")]
    if any(part.startswith("cuda") for part in names):
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name!r} but CUDA is not available on this machine; use device=cpu (or auto)")
        missing = [part for part in names if part.startswith("cuda:") and int(part[5:]) >= torch.cuda.device_count()]
        if missing:
            raise ConfigError(f"device={name!r}: this machine has {torch.cuda.device_count()} GPU(s), so {', '.join(missing)} does not exist")
    return tuple(torch.device(part) for part in names)


def resolve_device(name: str) -> torch.device:
    return resolve_devices(name)[0]


def resolve_backend(name: str, model: FlatModel | None = None, device: torch.device | None = None) -> str:
    """``auto`` is the rule of ``vectorized.auto_backend`` for the model and device (docs/performance.md);
    without a model, the vectorized backend."""
    if name != "auto":
        return name
    if model is None or device is None:
        return "vectorized"
    return auto_backend(model, device)


def _make_backend(config: ExperimentConfig, model: FlatModel, devices: tuple[torch.device, ...]):
    name = resolve_backend(config.backend, model, devices[0])
    if len(devices) > 1 and name != "vectorized":
        raise ConfigError(f"device={config.device!r} lists several GPUs, which only backend=vectorized uses; set backend=vectorized (or auto)")
    if name == "vectorized":
        return BACKENDS[name](precision=config.precision, devices=devices if len(devices) > 1 else None)
    return BACKENDS[name](precision=config.precision)


ModelSource = Union[nn.Module, Callable[[tuple[int, ...], int], nn.Module], None]


def _build_model(config: ExperimentConfig, data: Any, model: ModelSource) -> FlatModel:
    """The zoo model ``config.model`` names, or the user's, initialised from (seed, MODEL_INIT), with its loss."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(config.seed, Stream.MODEL_INIT))
        if model is None:
            module = build_model(
                config.model.name, data.input_shape, data.num_classes, vocab_size=vocabulary_size(config.data), **config.model.keyword_arguments()
            )
        elif isinstance(model, nn.Module):
            module = copy.deepcopy(model)
        else:
            module = model(data.input_shape, data.num_classes)
    if model is None and config.model.name == "quadratic":
        return FlatModel.wrap(module, example_loss=objective_per_example, is_classifier=False)
    if data.multi_label:
        return FlatModel.wrap(module, example_loss=binary_cross_entropy_per_example, is_classifier=False, multi_label=True)
    return FlatModel.wrap(module)


def _build_algorithm(config: ExperimentConfig, flat_model: FlatModel) -> Algorithm:
    """The configured algorithm with its server optimizer, compressed when ``compression.ratio`` < 1."""
    server_optimizer = make_server_optimizer(config.server.optimizer, **config.server.optimizer_hyperparameters())
    entry = registry.ALGORITHMS[config.algorithm.name]
    algorithm = entry.from_config(config.algorithm, server_optimizer)
    ratio = config.compression.ratio
    if ratio is None:
        ratio = entry.default_compression_ratio
    return with_compression(algorithm, ratio, flat_model.numels) if ratio < 1 else algorithm


def build_simulation(config: ExperimentConfig, model: ModelSource = None, state_dir: Path | None = None) -> tuple[Simulation, SimulationState]:
    """Data, model, algorithm and backend for ``config``, and the state before round 1.

    A disk client-state store (``state.store``) keeps its files in ``state_dir``
    (a run's ``RUN/client_state``), or in a temporary directory removed with the store.

    ``model`` replaces the zoo model named by ``config.model``: a module (copied;
    its current weights are the initial model) or a factory
    ``(input_shape, num_classes) -> module`` called under the run's seeded
    initialisation.
    """
    devices = resolve_devices(config.device)
    device = devices[0]
    problem = check_precision(config.precision, device)
    if problem is not None:
        raise ConfigError(problem)
    dtype = parameter_dtype(config.precision)
    check_sizes(config)  # before the data: client counts and local work against the machine's memory
    try:
        data = build_dataset(config.data, config.seed)
    except DataSetupError as error:
        raise ConfigError(str(error)) from None
    # the batch plan and the model's memory, then one forward pass on real examples (ConfigError on a mismatch)
    flat_model = checked_model(config, data, lambda: _build_model(config, data, model).to(device, dtype), device, dtype, model)
    initial_params = flat_model.initial_parameters().to(device, dtype)
    algorithm = _build_algorithm(config, flat_model)
    plan = RoundPlan(
        seed=config.seed,
        participation=config.sampling.participation,
        sampling=config.sampling.mode,
        batch_size=config.client.batch_size,
        client_lr=config.client.lr,
        server_lr=config.server.lr,
        local_epochs=config.client.local_epochs,
        local_steps=config.client.steps,
        weight_decay=config.client.weight_decay,
        clip_norm=config.client.clip_norm,
        inexact_gamma=config.client.inexact_gamma,
        augment=config.data.augment,
        availability=AvailabilityModel(config.availability.inactive_probability, config.availability.incomplete_probability),
    )
    evaluation = EvaluationPlan(
        every=config.evaluation.every,
        model=config.evaluation.model,
        dissimilarity_every=config.evaluation.dissimilarity_every,
        divergence_factor=config.evaluation.divergence_factor,
        train_loss_clients=config.evaluation.train_loss_clients,
    )
    try:
        membership = Membership(
            data.num_clients,
            config.availability.initially_registered,
            tuple(MembershipEvent(e.round, e.joined(), e.left()) for e in config.availability.events),
        )
    except ValueError as error:
        raise ConfigError(f"availability: {error}") from None
    try:
        sim = Simulation(
            flat_model, data, algorithm, _make_backend(config, flat_model, devices), plan, device, dtype, initial_params, evaluation, membership
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    store, latest_models = _client_stores(config, sim, config.state.store, state_dir)
    return sim, SimulationState(0, algorithm.server_init(initial_params), store, latest_models)


def _client_stores(config: ExperimentConfig, sim: Simulation, kind: str, state_dir: Path | None) -> tuple[Any, Any]:
    def directory() -> Path:
        if state_dir is not None:
            return Path(state_dir)
        import shutil
        import tempfile
        import weakref

        temporary = Path(tempfile.mkdtemp(prefix="driftlab-client-state-"))
        weakref.finalize(sim, shutil.rmtree, temporary, True)
        return temporary

    keep_latest = config.evaluation.model == "all_clients_mean"
    return make_client_stores(
        kind, sim.data.num_clients, sim.initial_params, sim.algorithm.client_state_init, keep_latest, directory, config.memory_budget
    )


def run(
    config: ExperimentConfig | dict[str, Any] | str | Path | None = None,
    out_dir: str | Path | None = None,
    *,
    resume: bool = False,
    overrides: list[str] | tuple[str, ...] = (),
    progress: bool | Callable[[dict[str, Any]], None] = False,
    model: ModelSource = None,
    progress_label: str | None = None,
    run_info: dict[str, Any] | None = None,
    algorithm: registry.AlgorithmEntry | None = None,
) -> RunResult:
    """Run an experiment; write to ``out_dir`` when given (required for ``resume``).

    ``algorithm`` runs an algorithm of your own, given as its registry entry
    (``driftlab.algorithms.AlgorithmEntry``): it is registered, ``algorithm.name``
    becomes its name (the config's ``[algorithm]`` keys are kept when the config
    names it already, dropped when it names another algorithm) and the config's
    ``plugins`` gain its module, so config.json lets resume, sweeps and reports
    in other processes import it.  An entry defined in a script (``__main__``)
    is not importable elsewhere: put it in a module to resume or report such runs.

    ``model`` trains your own ``torch.nn.Module`` instead of ``config.model``
    (a module, or a factory ``(input_shape, num_classes) -> module``); resume
    such a run by passing the same model again.

    ``progress=True`` shows a bar labelled ``progress_label`` (default: the
    algorithm's name) on a terminal, and one line when the run ends elsewhere;
    a callable is called with each round's record instead.

    ``run_info`` adds entries to the run's ``run.json`` (a sweep's executor records
    its job id and log paths there).

    Example:
        >>> import driftlab
        >>> result = driftlab.run({"rounds": 2, "data": {"num_clients": 5}}, overrides=["sampling.participation=0.4"])
        >>> [r["round"] for r in result.records]
        [1, 2]
    """
    if algorithm is not None:
        config, overrides = _with_algorithm(config, overrides, algorithm)
    if not isinstance(config, ExperimentConfig):
        config = load_config(config, overrides)
    elif overrides:
        config = load_config(config.to_dict(), overrides)
    if config.log:
        check_trackers_installed(config.log)  # before any work
    if out_dir is None:
        if resume:
            raise ConfigError("resume needs the output directory of the interrupted run (--out DIR)")
        if config.log:
            raise ConfigError(f"log={list(config.log)} needs an output directory (--out DIR): a tracker run is tied to the run's directory")
        return _run_in(None, config, resume, progress, model, progress_label, {})
    out = _output_directory(out_dir)
    lock = _claim_run_directory(out, config, resume)
    try:
        return _run_in(out, config, resume, progress, model, progress_label, run_info or {})
    finally:
        lock.close()


def _with_algorithm(
    config: ExperimentConfig | dict[str, Any] | str | Path | None, overrides: Sequence[str], entry: registry.AlgorithmEntry
) -> tuple[dict[str, Any], list[str]]:
    """The config table and overrides of ``run(config, overrides=..., algorithm=entry)``, ``entry`` registered."""
    if not isinstance(entry, registry.AlgorithmEntry):
        raise ConfigError(
            f"algorithm= takes a driftlab.algorithms.AlgorithmEntry (name, config type, from_config, label), got {type(entry).__name__}"
        )
    try:
        registry.register(entry)
    except ValueError as error:
        raise ConfigError(f"algorithm=: {error}") from None
    if isinstance(config, ExperimentConfig):
        table = config.to_dict()
    elif isinstance(config, dict):
        table = dict(config)
    elif config is None:
        table = {}
    else:
        table = read_config_source(config)
    source = registry.plugin_source(entry)
    plugins = table.get("plugins") or []
    if source is not None and isinstance(plugins, list) and source not in plugins:
        table["plugins"] = [*plugins, source]
    return table, [f"algorithm.name={entry.name}", *overrides]


def _run_in(
    out: Path | None,
    config: ExperimentConfig,
    resume: bool,
    progress: bool | Callable[[dict[str, Any]], None],
    model: ModelSource,
    progress_label: str | None,
    run_info: dict[str, Any],
) -> RunResult:
    """The run itself; ``out``, when given, is claimed (locked, checked, config.json written) by the caller."""
    sim, state = build_simulation(config, model, out / CLIENT_STATE_DIR if out is not None else None)
    records: list[dict[str, Any]] = []
    if out is not None:
        records, state = _prepare_output(out, config, sim, state, resume)
    # Opening a tracker logs the records it lacks, so every round reaches it once however the last process ended.
    trackers = open_trackers(out, config, records) if out is not None and config.log else None

    info = _RunInfo.start(out, config, sim, state.round, run_info) if out is not None else None
    reporter = progress if callable(progress) else None
    bar = None
    if progress is True:
        from driftlab.experiments.progress import round_progress

        bar = round_progress(progress_label or config.algorithm.name, config.rounds, state.round)
    start_round = last_saved = state.round
    ending = "complete"  # what the trackers are told when the run stops
    try:
        while state.round < config.rounds:
            upcoming = state.round + 1
            evaluate_after = _evaluates(config, upcoming)
            finished, record = run_round(sim, state, evaluate_after, commit=False)
            if out is not None:
                _append_record(out / METRICS_FILE, record)
            # The round counts as done only once its record is on disk; from here to the new
            # state nothing may be interrupted half way.
            with _signals_deferred():
                commit_round(finished)
                state = finished
                records.append(record)
            if trackers is not None:
                trackers.log_round(record)
            if out is not None and (state.round % config.checkpoint_every == 0 or state.round == config.rounds):
                _checkpoint(out, config, state)
                _write_metrics_csv(out, records)
                last_saved = state.round
                info.update("running", state.round)
            if bar is not None:
                bar.update(record)
            if reporter is not None:
                reporter(record)
    except BaseException as error:
        # Never die without a resumable checkpoint.  `state` is the last completed round: the
        # interrupted round's client states were only staged, and are dropped here.
        discard_round(state)
        ending = _status_of(error)
        if out is not None and state.round > last_saved:
            _checkpoint(out, config, state)
        if out is not None:
            _write_metrics_csv(out, records)
        diverged = _divergence_error(error, out, state.round) if isinstance(error, FloatingPointError) else None
        if info is not None:
            info.update(ending, state.round, message=str(diverged or error) or type(error).__name__)
        if diverged is not None:
            raise diverged from error
        raise
    finally:
        if bar is not None:
            bar.close()
        if trackers is not None:
            trackers.close(ending)
    final_params = state.server.params
    if out is not None:
        names = ",".join(sim.model.names)
        write_atomically(
            out / FINAL_MODEL_FILE,
            lambda tmp: save_file({"params": final_params.detach().cpu().contiguous()}, str(tmp), metadata={"parameter_names": names}),
        )
        if state.round == start_round:  # nothing left to run (a finished run resumed): the loop wrote no table
            _write_metrics_csv(out, records)
        info.update("complete", state.round)
    summary = summarize(records, config.evaluation.target_accuracy, sim.model.num_parameters)
    return RunResult(config, records, final_params, sim.model.num_parameters, out, summary)


def _evaluates(config: ExperimentConfig, round_index: int) -> bool:
    return round_index % config.evaluation.every == 0 or round_index == config.rounds


def _status_of(error: BaseException) -> str:
    if isinstance(error, FloatingPointError):
        return "diverged"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return "failed"


def _divergence_error(error: FloatingPointError, out: Path | None, last_healthy: int) -> FloatingPointError:
    """The engine's divergence message completed with exactly what the run kept."""
    if out is None:
        kept = "no checkpoint exists: the run has no output directory"
    elif last_healthy == 0:
        kept = "no checkpoint exists and no round was recorded: the run diverged in its first round"
    else:
        kept = (
            f"the checkpoint of round {last_healthy}, the last healthy round, is kept in {out / CHECKPOINT_FILE}; "
            f"{out / METRICS_FILE} and {METRICS_CSV_FILE} hold rounds 1-{last_healthy}"
        )
    return FloatingPointError(f"{str(error).rstrip('.')}. {kept[0].upper()}{kept[1:]}")



@dataclass
class _RunInfo:
    """``run.json``: what a report needs besides the metrics (status, parameter count, wall time, machine).

    Wall time accumulates over resumes, so an interrupted-and-resumed run reports
    the compute it really took.
    """

    path: Path
    content: dict[str, Any]
    started: float
    previous_seconds: float

    @classmethod
    def start(cls, out: Path, config: ExperimentConfig, sim: Simulation, start_round: int, extra: dict[str, Any]) -> "_RunInfo":
        path = out / RUN_INFO_FILE
        previous: dict[str, Any] = {}
        if start_round > 0 and path.exists():
            try:
                previous = json.loads(path.read_text())
            except (json.JSONDecodeError, OSError):
                previous = {}  # informational only; a damaged file must not stop a resume
        import driftlab

        content = {
            "format": 1,
            "status": "running",
            "rounds": config.rounds,
            "rounds_done": start_round,
            "num_parameters": sim.model.num_parameters,
            "wall_seconds": float(previous.get("wall_seconds", 0.0)) if start_round > 0 else 0.0,
            "resumed_from_round": start_round if start_round > 0 else None,
            "machine": {
                "platform": platform.platform(),
                "processor": _processor_name(),
                "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "device": str(sim.device),
                "backend": getattr(sim.backend, "name", type(sim.backend).__name__),  # what backend=auto resolved to
            },
            "versions": {"driftlab": driftlab.__version__, "torch": torch.__version__, "python": platform.python_version()},
        }
        content.update(extra)
        info = cls(path, content, time.perf_counter(), content["wall_seconds"])
        info.update("running", start_round)
        return info

    def update(self, status: str, rounds_done: int, message: str | None = None) -> None:
        self.content.update(status=status, rounds_done=rounds_done, wall_seconds=self.previous_seconds + time.perf_counter() - self.started)
        if message is not None:
            self.content["message"] = message
        else:
            self.content.pop("message", None)
        text = json.dumps(self.content, indent=2) + "\n"
        write_atomically(self.path, lambda tmp: tmp.write_text(text))


def _processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def read_run_info(out: str | Path) -> dict[str, Any] | None:
    """The ``run.json`` of a run directory, or None when absent or unreadable."""
    path = Path(out) / RUN_INFO_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


@dataclass(frozen=True)
class _ClientRecord:
    """What a checkpoint keeps per client: the algorithm's state and, when evaluated, the latest local model."""

    state: Any
    latest_model: torch.Tensor | None = None


def _checkpoint(out: Path, config: ExperimentConfig, state: SimulationState) -> None:
    stores = disk_stores(state)  # these stay in their files: the checkpoint records their version
    clients = {client_id: _ClientRecord(client_state) for client_id, client_state in state.clients.items()} if "clients" not in stores else {}
    if state.latest_models is not None and "latest_models" not in stores:
        for client_id, params in state.latest_models.items():
            clients[client_id] = _ClientRecord(clients[client_id].state if client_id in clients else None, params)
    save_checkpoint(out / CHECKPOINT_FILE, state.round, state.server, clients, config.fingerprint(), stores)


def _output_directory(out_dir: str | Path) -> Path:
    """``out_dir`` as a directory path; a ConfigError, before any work, for a path that cannot be one."""
    if not str(out_dir).strip():
        raise ConfigError("the output directory (--out) is empty; give a directory such as runs/NAME")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        kind = "a file" if out.is_file() else "not a directory (a device or another special file)"
        raise ConfigError(f"--out {out} is {kind}; give a directory: a new or empty one, or a run's directory with --resume")
    return out


def _claim_run_directory(out: Path, config: ExperimentConfig, resume: bool) -> Any:
    """Check ``out``, create and lock it, clear interrupted writes and, for a new run, write config.json first.

    Returns the open lock file; closing it releases the lock.  config.json comes before
    any data loading, so a run killed at any later moment resumes with the documented
    ``driftlab run DIR/config.json --out DIR --resume``.
    """
    _check_run_directory(out, config, resume)  # before creating or writing anything
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create the output directory {out}: {error.strerror or error}; choose another --out directory") from None
    lock = _lock_run_directory(out)
    try:
        _check_run_directory(out, config, resume)  # again: another process may have written it before we held the lock
        _remove_interrupted_writes(out)
        if not resume:
            _write_config(out, config)
    except BaseException:
        lock.close()
        raise
    return lock


def _lock_run_directory(out: Path) -> Any:
    """An exclusive ``flock`` on ``out/.lock`` (which records our PID), or RunDirectoryBusy.

    The lock file is never deleted: a process still waiting on a deleted inode would
    believe it holds the lock while a third one locks the new file.
    """
    import fcntl  # POSIX only; imported here so that importing driftlab works everywhere

    path = out / LOCK_FILE
    try:
        handle = open(path, "a+")
    except OSError as error:
        raise ConfigError(f"cannot write in the output directory {out}: {error.strerror or error}; choose another --out directory") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read(32).strip()
        handle.close()
        who = f"another driftlab process (PID {holder})" if holder.isdigit() else "another driftlab process"
        raise RunDirectoryBusy(
            f"{out} is being written by {who}; wait for it to finish or stop it, or choose another --out directory"
        ) from None
    except OSError as error:
        handle.close()
        raise ConfigError(f"cannot lock the output directory {out} ({error.strerror or error}); choose an --out directory on a local disk") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def _remove_interrupted_writes(out: Path) -> None:
    """Delete the ``.NAME.tmp-PID`` files of writes a kill interrupted; called with the lock held, so no live writer owns one."""
    for entry in out.iterdir():
        if _INTERRUPTED_WRITE.match(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)


def _visible_entries(out: Path) -> list[str]:
    """What ``out`` holds besides our lock and interrupted writes; [] when it does not exist."""
    try:
        if not out.is_dir():
            return []
        return sorted(e.name for e in out.iterdir() if e.name != LOCK_FILE and not _INTERRUPTED_WRITE.match(e.name))
    except OSError as error:
        raise ConfigError(f"cannot read the output directory {out}: {error.strerror or error}") from None


def _check_run_directory(out: Path, config: ExperimentConfig, resume: bool) -> None:
    """Refuse a folder this run may not write into, reading it only.

    A new run goes into a new or empty folder, or one a driftlab run left before recording
    any round (only its config.json); ``resume`` needs a run of the same configuration there.
    Nothing else is ever written into: the folder may be the user's.
    """
    names = _visible_entries(out)
    if not names:
        if resume:
            where = "does not exist" if not out.exists() else "is empty"
            raise ConfigError(f"nothing to resume in {out}: it {where}; run without --resume to start the run")
        return
    has_results = any(name in names for name in (METRICS_FILE, CHECKPOINT_FILE, FINAL_MODEL_FILE))
    stored_path = out / CONFIG_FILE
    stored, complete = None, False
    if CONFIG_FILE in names:
        try:
            stored, complete = _read_run_config(stored_path)
        except ConfigError:
            if resume:
                raise
    if not resume:
        if has_results:
            raise ConfigError(f"{out} already holds a run; pass --resume to continue it, or choose another --out directory")
        if complete:
            return  # a run stopped before recording any round: nothing to lose
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ConfigError(
            f"{out} is not empty and holds no driftlab run ({shown}); driftlab writes only into a new or empty "
            "directory or its own run's: choose another --out directory"
        )
    if not has_results and not complete:
        what = f"{stored_path} was not written by a driftlab run" if stored is not None else "no config.json, metrics.jsonl or checkpoint"
        raise ConfigError(f"nothing to resume in {out}: it holds no driftlab run ({what}); run without --resume into a new or empty directory")
    if stored is not None and stored.fingerprint() != config.fingerprint():
        raise ConfigError(
            f"cannot resume: the configuration differs from the one in {stored_path} in more than rounds/device/checkpoint_every/log/state/memory_budget; "
            f"resume with `driftlab run {stored_path} --out {out} --resume`"
        )


_MAX_CONFIG_BYTES = 1 << 20  # a resolved config is a few KB


def _read_run_config(path: Path) -> tuple[ExperimentConfig, bool]:
    """The configuration stored in a run's config.json, and whether it is complete (every key, as a run writes it)."""
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, far more than a configuration")
        raw = json.loads(path.read_bytes().decode("utf-8"))
        stored = config_from_record(raw)
    except ConfigError:
        raise  # a plugin it records cannot be imported: the message says which and how to fix it
    except (OSError, ValueError, TypeError, RecursionError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(
            f"{path} is not the configuration of a driftlab run ({reason}); restore it, or start the run again with a new --out directory"
        ) from None
    return stored, json.loads(json.dumps(stored.to_dict())) == raw


def _prepare_output(
    out: Path, config: ExperimentConfig, sim: Simulation, state: SimulationState, resume: bool
) -> tuple[list[dict[str, Any]], SimulationState]:
    """For a resume: the checkpointed state and the records up to it.

    Everything (checkpoint, metrics) is checked before metrics.jsonl and config.json are
    rewritten, so a refused resume leaves the directory exactly as it was.
    """
    if not resume:
        return [], state
    metrics_path = out / METRICS_FILE
    checkpoint_path = out / CHECKPOINT_FILE
    if checkpoint_path.exists():
        client_init = sim.algorithm.client_state_init
        initial = state.server.params
        keeps_latest = state.latest_models is not None
        template = lambda: _ClientRecord(client_init(initial) if client_init else None, initial if keeps_latest else None)  # noqa: E731
        loaded = load_checkpoint(checkpoint_path, state.server, template, config.fingerprint(), sim.device)
        if loaded.round > config.rounds:
            raise ConfigError(
                f"cannot resume: the checkpoint in {out} is at round {loaded.round}, past rounds={config.rounds}; "
                f"set rounds to at least {loaded.round}"
            )
        if loaded.store_names() and not disk_stores(state):  # written with the disk store: resume with it
            state = SimulationState(0, state.server, *_client_stores(config, sim, "disk", out / CLIENT_STATE_DIR))
        for name, store in disk_stores(state).items():
            if name in loaded.store_names():
                store.restore(loaded.store_tables, f"store/{name}", checkpoint_path)
        for client_id, record in loaded.client_states.items():
            state.clients.put(client_id, record.state)
            if keeps_latest and record.latest_model is not None:
                state.latest_models.put(client_id, record.latest_model)
        state = SimulationState(loaded.round, loaded.server_state, state.clients, state.latest_models)
        commit_round(state)
    records = _read_records(metrics_path, up_to_round=state.round)
    for record in records:
        # The old last round was evaluated because it was last; with more rounds it may not be.
        if not _evaluates(config, record["round"]):
            for key in EVALUATION_KEYS:
                record.pop(key, None)
    # Rewrite the metrics file without the rounds that will be recomputed.
    write_atomically(metrics_path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in records)))
    _write_config(out, config)
    return records, state


def _write_config(out: Path, config: ExperimentConfig) -> None:
    write_atomically(out / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(config.to_dict(), indent=2) + "\n"))


def _read_records(path: Path, up_to_round: int) -> list[dict[str, Any]]:
    """The records of rounds 1..``up_to_round`` (the checkpoint's) in ``path``, every line checked.

    Only a last line that is not JSON may be dropped: a kill mid-append tears it.  Any
    other damage, or a missing round the checkpoint covers, is an error: resuming would
    silently lose recorded rounds.  Records after ``up_to_round`` are dropped (recomputed).
    """
    fix = f"restore {path.name} from a backup, or start the run again with a new --out directory"
    if not path.exists():
        if up_to_round == 0:
            return []
        raise ConfigError(f"cannot resume: {path} is missing, but the checkpoint beside it is at round {up_to_round}; {fix}")
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as error:
        raise ConfigError(f"cannot resume: cannot read {path}: {error.strerror or error}") from None
    if lines[-1] == b"":
        lines.pop()  # the newline that ends the last complete line
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):
            if number == len(lines):
                break  # torn by a kill mid-write; that round is recomputed
            raise ConfigError(f"cannot resume: {path} line {number} is not JSON, and only a last line torn by a kill may be; {fix}") from None
        problem = _record_problem(record, number)
        if problem is not None:
            raise ConfigError(f"cannot resume: {path} line {number} {problem}; {fix}")
        records.append(record)
    if len(records) < up_to_round:
        held = f"rounds 1-{len(records)}" if records else "no round"
        raise ConfigError(
            f"cannot resume: {path} holds {held}, but the checkpoint beside it is at round {up_to_round}: "
            f"the records of rounds {len(records) + 1}-{up_to_round} are missing; {fix}"
        )
    return records[:up_to_round]


def _record_problem(record: Any, line_number: int) -> str | None:
    if not isinstance(record, dict):
        return f"is {json.dumps(record)[:40]}, not a round's record (a JSON object)"
    round_index = record.get("round")
    if not isinstance(round_index, int) or isinstance(round_index, bool):
        return f"has no round number (round={json.dumps(round_index)[:40]})"
    if round_index != line_number:
        return f"holds round {round_index} where round {line_number} belongs (records run 1, 2, 3, ... without gaps or repeats)"
    return None


def _append_record(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        # allow_nan=False: the engine never returns a non-finite number, and metrics.jsonl stays strict JSON
        handle.write(json.dumps(record, allow_nan=False) + "\n")
        handle.flush()


def _write_metrics_csv(out: Path, records: list[dict[str, Any]]) -> None:
    """metrics.csv from the run's records: what metrics.jsonl holds, as a table (nothing before the first record)."""
    if not records:
        return
    columns = list(dict.fromkeys(key for record in records for key in record))

    def cell(value: Any) -> str:
        if value is None:
            return ""
        # New records are finite (the engine stops a diverged round); a NaN in a record resumed from an
        # older version's metrics.jsonl is written as NaN, never as a number and never as a crash.
        return value if isinstance(value, str) else json.dumps(value)

    def write(temporary: Path) -> None:
        with open(temporary, "w", newline="") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(columns)
            writer.writerows([cell(record.get(key)) for key in columns] for record in records)

    write_atomically(out / METRICS_CSV_FILE, write)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then act on them (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        signal.raise_signal(received[0])


def install_termination_handler() -> None:
    """Turn SIGTERM into KeyboardInterrupt so a terminated run writes its checkpoint first."""

    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt(f"terminated by signal {signum}")

    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, handler)


__all__ = ["RunResult", "RunDirectoryBusy", "run", "build_simulation", "install_termination_handler", "read_run_info"]
