"""Run one experiment: ``driftlab.run(config) -> RunResult``, used by the CLI, sweeps and notebooks.

With an output directory the run writes config.json, metrics.jsonl/csv, checkpoints,
the final model and run.json there (``driftlab.experiments.run_directory`` lists them
and claims, locks and checks the directory); ``driftlab.experiments.assembly`` builds
the simulation from the config.

config.json is written first, before any data is loaded (your own data, ``data=`` or
``data.loader``, is read before it, to record its digest), so a run killed at any
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
import json
import os
import platform
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from safetensors.torch import save_file

from driftlab.algorithms import registry
from driftlab.data.federated import FederatedArrays, FederatedDataset
from driftlab.experiments import run_directory
from driftlab.experiments.assembly import (  # noqa: F401  (importable from here as before the split)
    BACKENDS,
    ExampleLoss,
    ModelSource,
    build_simulation,
    client_stores,
    resolve_backend,
    resolve_device,
    resolve_devices,
    user_data,
)
from driftlab.experiments.config import ConfigError, ExperimentConfig, load_config, read_config_source
from driftlab.experiments.run_directory import (  # noqa: F401  (the file names stay importable from here)
    CHECKPOINT_FILE,
    CLIENT_STATE_DIR,
    CONFIG_FILE,
    FINAL_MODEL_FILE,
    LOCK_FILE,
    METRICS_CSV_FILE,
    METRICS_FILE,
    RUN_FILES,
    RUN_INFO_FILE,
    RunDirectoryBusy,
    read_run_info,
)
from driftlab.experiments.trackers import check_trackers_installed, open_trackers
from driftlab.metrics.summary import summarize
from driftlab.simulation.checkpoint import load_checkpoint, save_checkpoint, write_atomically
from driftlab.simulation.engine import EVALUATION_KEYS, Simulation, SimulationState, commit_round, discard_round, disk_stores, run_round
from driftlab.simulation.latest_models import LatestModels


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
    data: FederatedArrays | FederatedDataset | None = None,
    loss: ExampleLoss | None = None,
    classifier: bool | None = None,
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

    ``data`` trains on your own data: a ``driftlab.FederatedArrays`` (train and test
    arrays and each training example's client id; ``FederatedArrays.from_datasets``
    reads torch Datasets).  ``data.name`` becomes ``"custom"`` and config.json records
    the data's SHA-256 (``data.digest``): resume by passing the same data again; other
    data is refused.  Other processes (sweeps, ``driftlab run``) load it through
    ``data.loader = "module:function"`` instead.

    ``loss`` replaces the model's loss: ``loss(outputs, targets)`` returns one loss per
    example ``[B]``; a function defined with ``def`` in a module or script, recorded as
    ``model.loss = "module:function"`` (other processes import that name).
    ``classifier`` sets ``model.classifier``: whether accuracy is reported (default:
    yes for integer class-id targets, no for floating targets).

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
    if loss is not None:
        overrides = [*overrides, f"model.loss={json.dumps(_loss_reference(loss))}"]
    if classifier is not None:
        overrides = [*overrides, f"model.classifier={'true' if classifier else 'false'}"]
    if not isinstance(config, ExperimentConfig):
        config = load_config(config, overrides)
    elif overrides:
        config = load_config(config.to_dict(), overrides)
    config, dataset = user_data(config, data)  # your own data, its digest recorded (before config.json is written)
    if config.log:
        check_trackers_installed(config.log)  # before any work
    if out_dir is None:
        if resume:
            raise ConfigError("resume needs the output directory of the interrupted run (--out DIR)")
        if config.log:
            raise ConfigError(f"log={list(config.log)} needs an output directory (--out DIR): a tracker run is tied to the run's directory")
        return _run_in(None, config, resume, progress, _Inputs(model, dataset, loss), progress_label, {})
    out = run_directory.output_directory(out_dir)
    lock = run_directory.claim_run_directory(out, config, resume)
    try:
        return _run_in(out, config, resume, progress, _Inputs(model, dataset, loss), progress_label, run_info or {})
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


@dataclass(frozen=True)
class _Inputs:
    """What a run was given besides its config: your model, data and loss."""

    model: ModelSource = None
    data: FederatedDataset | None = None
    loss: ExampleLoss | None = None


def _loss_reference(loss: ExampleLoss) -> str:
    """``module:function`` of the user's loss, as config.json records it."""
    module, name = getattr(loss, "__module__", None), getattr(loss, "__qualname__", "")
    if not callable(loss) or not module or not name.isidentifier():
        raise ConfigError(
            f"loss= takes a function defined with def at the top level of a module or script, fn(outputs, targets) -> one loss per "
            f"example, got {loss!r}; config.json records it as model.loss = \"module:function\" so that a resume uses the same loss"
        )
    loaded = sys.modules.get(module)
    if module.startswith(("driftlab_user_", "driftlab_plugin_")) and getattr(loaded, "__file__", None):
        module = loaded.__file__  # imported from its file (model.loss, plugins): other processes import the file too
    return f"{module}:{name}"


def _run_in(
    out: Path | None,
    config: ExperimentConfig,
    resume: bool,
    progress: bool | Callable[[dict[str, Any]], None],
    given: _Inputs,
    progress_label: str | None,
    run_info: dict[str, Any],
) -> RunResult:
    """The run itself; ``out``, when given, is claimed (locked, checked, config.json written) by the caller."""
    state_dir = out / CLIENT_STATE_DIR if out is not None else None
    sim, state = build_simulation(config, given.model, state_dir, data=given.data, loss=given.loss)
    records: list[dict[str, Any]] = []
    if out is not None:
        records, state = prepare_output(out, config, sim, state, resume)
    # Opening a tracker logs the records it lacks, so every round reaches it once however the last process ended.
    trackers = open_trackers(out, config, records) if out is not None and config.log else None

    info = start_run_info(out, config, sim, state.round, run_info) if out is not None else None
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
            evaluate_after = evaluates_after(config, upcoming)
            finished, record = run_round(sim, state, evaluate_after, commit=False)
            if out is not None:
                run_directory.append_record(out / METRICS_FILE, record)
            # The round counts as done only once its record is on disk; from here to the new
            # state nothing may be interrupted half way.
            with _signals_deferred():
                commit_round(finished)
                state = finished
                records.append(record)
            if trackers is not None:
                trackers.log_round(record)
            if out is not None and (state.round % config.checkpoint_every == 0 or state.round == config.rounds):
                write_checkpoint(out, config, state)
                run_directory.write_metrics_csv(out, records)
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
            write_checkpoint(out, config, state)
        if out is not None:
            run_directory.write_metrics_csv(out, records)
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
            run_directory.write_metrics_csv(out, records)
        info.update("complete", state.round)
    summary = summarize(records, config.evaluation.target_accuracy, sim.model.num_parameters)
    return RunResult(config, records, final_params, sim.model.num_parameters, out, summary)


def evaluates_after(config: ExperimentConfig, round_index: int) -> bool:
    """Whether round ``round_index`` is evaluated: every ``evaluation.every`` rounds, and the last."""
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



def start_run_info(out: Path, config: ExperimentConfig, sim: Simulation, start_round: int, extra: dict[str, Any]) -> run_directory.RunInfo:
    """``run.json`` as "running", with the parameter count, machine and versions (and a sweep's ``extra`` entries)."""
    import driftlab

    entries = {
        "machine": {
            "platform": platform.platform(),
            "processor": run_directory.processor_name(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": str(sim.device),
            "backend": getattr(sim.backend, "name", type(sim.backend).__name__),  # what backend=auto resolved to
        },
        "versions": {"driftlab": driftlab.__version__, "torch": torch.__version__, "python": platform.python_version()},
        **extra,
    }
    return run_directory.RunInfo.start(out, config.rounds, start_round, sim.model.num_parameters, entries)


LATEST_SUM, LATEST_COUNT = "latest_models_sum", "latest_models_count"  # the checkpoint's engine/ tensors


@dataclass(frozen=True)
class _ClientRecord:
    """What a checkpoint keeps per client: the algorithm's state and, when evaluated, the latest local model."""

    state: Any
    latest_model: torch.Tensor | None = None


def write_checkpoint(out: Path, config: ExperimentConfig, state: SimulationState) -> None:
    """``state`` as the run's checkpoint (atomically; disk client stores stay in their files, recorded by version)."""
    stores = disk_stores(state)  # these stay in their files: the checkpoint records their version
    clients = {client_id: _ClientRecord(client_state) for client_id, client_state in state.clients.items()} if "clients" not in stores else {}
    if state.latest_models is not None and "latest_models" not in stores:
        for client_id, params in state.latest_models.items():
            clients[client_id] = _ClientRecord(clients[client_id].state if client_id in clients else None, params)
    engine_tensors = {}
    if state.latest_sum is not None:  # the running sum of the latest models: resumed as is, so the bits go on unchanged
        engine_tensors = {LATEST_SUM: state.latest_sum.total, LATEST_COUNT: torch.tensor(state.latest_sum.count, dtype=torch.int64)}
    save_checkpoint(out / CHECKPOINT_FILE, state.round, state.server, clients, config.fingerprint(), stores, engine_tensors)


def prepare_output(
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
            state = SimulationState(0, state.server, *client_stores(config, sim, "disk", out / CLIENT_STATE_DIR))
        for name, store in disk_stores(state).items():
            if name in loaded.store_names():
                store.restore(loaded.store_tables, f"store/{name}", checkpoint_path)
        for client_id, record in loaded.client_states.items():
            state.clients.put(client_id, record.state)
            if keeps_latest and record.latest_model is not None:
                state.latest_models.put(client_id, record.latest_model)
        latest_sum = None
        if keeps_latest and LATEST_SUM in loaded.engine_tensors and LATEST_COUNT in loaded.engine_tensors:
            latest_sum = LatestModels(loaded.engine_tensors[LATEST_SUM], int(loaded.engine_tensors[LATEST_COUNT]))
        state = SimulationState(loaded.round, loaded.server_state, state.clients, state.latest_models, latest_sum)
        commit_round(state)
    records = run_directory.read_records(metrics_path, up_to_round=state.round)
    for record in records:
        # The old last round was evaluated because it was last; with more rounds it may not be.
        if not evaluates_after(config, record["round"]):
            for key in EVALUATION_KEYS:
                record.pop(key, None)
    # Rewrite the metrics file without the rounds that will be recomputed.
    run_directory.write_records(metrics_path, records)
    run_directory.write_config(out, config)
    return records, state


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
