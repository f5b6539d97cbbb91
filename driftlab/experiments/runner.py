"""Run one experiment: ``driftlab.run(config) -> RunResult``, used by the CLI, sweeps and notebooks.

An output directory holds::

    config.json               the resolved configuration (every key, defaults included)
    metrics.jsonl             one JSON object per round (pandas: ``pd.read_json(path, lines=True)``)
    checkpoint.safetensors    the last checkpoint (atomic, no pickle)
    final_model.safetensors   the final server model, written when the run completes
    run.json                  status (running, complete, interrupted, diverged, failed), rounds done,
                              wall time summed over resumes, parameter count, machine and versions

``resume=True`` continues from the checkpoint: metrics of rounds after it are
dropped and recomputed, which gives bit-identical models and metrics (wall
times aside) because every random draw derives from (seed, round, client id).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import platform
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import torch
from torch import nn
from safetensors.torch import save_file

from driftlab.algorithms import ALGORITHM_MODULES
from driftlab.compress import with_compression
from driftlab.experiments.config import ConfigError, ExperimentConfig, load_config
from driftlab.experiments.datasets import DataSetupError, build_dataset, vocabulary_size
from driftlab.metrics.summary import summarize
from driftlab.models import build_model
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.checkpoint import load_checkpoint, save_checkpoint, write_atomically
from driftlab.simulation.availability import AvailabilityModel, Membership, MembershipEvent
from driftlab.simulation.engine import EVALUATION_KEYS, EvaluationPlan, RoundPlan, Simulation, SimulationState, commit_round, discard_round, run_round
from driftlab.simulation.flat import FlatModel, binary_cross_entropy_per_example, objective_per_example
from driftlab.simulation.local_training import SequentialBackend
from driftlab.simulation.randomness import Stream, torch_seed
from driftlab.simulation.seam import Algorithm
from driftlab.simulation.state_store import InMemoryClientStore
from driftlab.simulation.vectorized import VectorizedBackend

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FILE = "checkpoint.safetensors"
FINAL_MODEL_FILE = "final_model.safetensors"
RUN_INFO_FILE = "run.json"

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
        """The records as a pandas DataFrame (needs pandas)."""
        import pandas as pd

        return pd.DataFrame(self.records)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available on this machine; use device=cpu (or auto)")
    return torch.device(name)


def resolve_backend(name: str) -> str:
    """``auto`` is the vectorized backend: faster than the sequential one for every zoo model (docs/performance.md);
    it falls back to sequential training itself, with a warning, for a module it cannot batch."""
    return "vectorized" if name == "auto" else name


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
    algorithm_module = ALGORITHM_MODULES[config.algorithm.name]
    algorithm = algorithm_module.from_config(config.algorithm, server_optimizer)
    ratio = config.compression.ratio
    if ratio is None:
        ratio = getattr(algorithm_module, "DEFAULT_COMPRESSION_RATIO", 1.0)
    return with_compression(algorithm, ratio, flat_model.numels) if ratio < 1 else algorithm


def build_simulation(config: ExperimentConfig, model: ModelSource = None) -> tuple[Simulation, SimulationState]:
    """Data, model, algorithm and backend for ``config``, and the state before round 1.

    ``model`` replaces the zoo model named by ``config.model``: a module (copied;
    its current weights are the initial model) or a factory
    ``(input_shape, num_classes) -> module`` called under the run's seeded
    initialisation.
    """
    device = resolve_device(config.device)
    dtype = torch.float64 if config.precision == "float64" else torch.float32
    try:
        data = build_dataset(config.data, config.seed)
    except DataSetupError as error:
        raise ConfigError(str(error)) from None
    flat_model = _build_model(config, data, model).to(device, dtype)
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
        every=config.evaluation.every, model=config.evaluation.model, dissimilarity_every=config.evaluation.dissimilarity_every
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
            flat_model, data, algorithm, BACKENDS[resolve_backend(config.backend)](), plan, device, dtype, initial_params, evaluation, membership
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    client_initial = algorithm.client_state_init
    store = InMemoryClientStore((lambda: client_initial(initial_params)) if client_initial else None)
    latest_models = InMemoryClientStore(None) if config.evaluation.model == "all_clients_mean" else None
    return sim, SimulationState(0, algorithm.server_init(initial_params), store, latest_models)


def run(
    config: ExperimentConfig | dict[str, Any] | str | Path | None = None,
    out_dir: str | Path | None = None,
    *,
    resume: bool = False,
    overrides: list[str] | tuple[str, ...] = (),
    progress: bool | Callable[[dict[str, Any]], None] = False,
    model: ModelSource = None,
) -> RunResult:
    """Run an experiment; write to ``out_dir`` when given (required for ``resume``).

    ``model`` trains your own ``torch.nn.Module`` instead of ``config.model``
    (a module, or a factory ``(input_shape, num_classes) -> module``); resume
    such a run by passing the same model again.

    Example:
        >>> import driftlab
        >>> result = driftlab.run({"rounds": 2, "data": {"num_clients": 5}}, overrides=["sampling.participation=0.4"])
        >>> [r["round"] for r in result.records]
        [1, 2]
    """
    if not isinstance(config, ExperimentConfig):
        config = load_config(config, overrides)
    elif overrides:
        config = load_config(config.to_dict(), overrides)
    sim, state = build_simulation(config, model)
    out = Path(out_dir) if out_dir is not None else None
    records: list[dict[str, Any]] = []
    if out is not None:
        records, state = _prepare_output(out, config, sim, state, resume)
    elif resume:
        raise ConfigError("resume needs the output directory of the interrupted run (--out DIR)")

    info = _RunInfo.start(out, config, sim, state.round) if out is not None else None
    reporter = progress if callable(progress) else None
    bar = None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.rounds, initial=state.round, desc=f"{config.algorithm.name}", unit="round", leave=True)
    last_saved = state.round
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
            if out is not None and (state.round % config.checkpoint_every == 0 or state.round == config.rounds):
                _checkpoint(out, config, state)
                last_saved = state.round
                info.update("running", state.round)
            if bar is not None:
                bar.update(1)
                if "test_accuracy" in record:
                    bar.set_postfix(acc=f"{record['test_accuracy']:.3f}")
            if reporter is not None:
                reporter(record)
    except BaseException as error:
        # Never die without a resumable checkpoint.  `state` is the last completed round: the
        # interrupted round's client states were only staged, and are dropped here.
        discard_round(state)
        if out is not None and state.round > last_saved:
            _checkpoint(out, config, state)
        if info is not None:
            info.update(_status_of(error), state.round, message=str(error) or type(error).__name__)
        raise
    finally:
        if bar is not None:
            bar.close()
    final_params = state.server.params
    if out is not None:
        names = ",".join(sim.model.names)
        write_atomically(
            out / FINAL_MODEL_FILE,
            lambda tmp: save_file({"params": final_params.detach().cpu().contiguous()}, str(tmp), metadata={"parameter_names": names}),
        )
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
    def start(cls, out: Path, config: ExperimentConfig, sim: Simulation, start_round: int) -> "_RunInfo":
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
            },
            "versions": {"driftlab": driftlab.__version__, "torch": torch.__version__, "python": platform.python_version()},
        }
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
    clients = {client_id: _ClientRecord(client_state) for client_id, client_state in state.clients.items()}
    if state.latest_models is not None:
        for client_id, params in state.latest_models.items():
            clients[client_id] = _ClientRecord(clients[client_id].state if client_id in clients else None, params)
    save_checkpoint(out / CHECKPOINT_FILE, state.round, state.server, clients, config.fingerprint())


def _prepare_output(
    out: Path, config: ExperimentConfig, sim: Simulation, state: SimulationState, resume: bool
) -> tuple[list[dict[str, Any]], SimulationState]:
    metrics_path = out / METRICS_FILE
    checkpoint_path = out / CHECKPOINT_FILE
    if not resume:
        if metrics_path.exists() or checkpoint_path.exists():
            raise ConfigError(f"{out} already holds a run; pass --resume to continue it, or choose another --out directory")
        out.mkdir(parents=True, exist_ok=True)
        _write_config(out, config)
        return [], state
    if not out.is_dir():
        raise ConfigError(f"cannot resume: {out} does not exist; run without --resume to start")
    stored = out / CONFIG_FILE
    if stored.exists():
        previous = json.loads(stored.read_text())
        if ExperimentConfig.model_validate(previous).fingerprint() != config.fingerprint():
            raise ConfigError(
                f"cannot resume: the configuration differs from the one in {stored} in more than rounds/device/checkpoint_every; "
                f"resume with `driftlab run {stored} --out {out} --resume`"
            )
    if checkpoint_path.exists():
        client_init = sim.algorithm.client_state_init
        initial = state.server.params
        keeps_latest = state.latest_models is not None
        template = lambda: _ClientRecord(client_init(initial) if client_init else None, initial if keeps_latest else None)  # noqa: E731
        loaded = load_checkpoint(checkpoint_path, state.server, template, config.fingerprint(), sim.device)
        for client_id, record in loaded.client_states.items():
            state.clients.put(client_id, record.state)
            if keeps_latest and record.latest_model is not None:
                state.latest_models.put(client_id, record.latest_model)
        if loaded.round > config.rounds:
            raise ConfigError(
                f"cannot resume: the checkpoint in {out} is at round {loaded.round}, past rounds={config.rounds}; "
                f"set rounds to at least {loaded.round}"
            )
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
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # a line torn by a kill mid-write; everything after it is recomputed
        if record.get("round", 0) > up_to_round:
            break
        records.append(record)
    return records


def _append_record(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()


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


__all__ = ["RunResult", "run", "build_simulation", "install_termination_handler", "read_run_info"]
