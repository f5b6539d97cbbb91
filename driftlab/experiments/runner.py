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

A round that diverges (a non-finite model entry, loss or norm, an evaluated loss
above ``evaluation.divergence_factor`` times the initial model's, or a model norm above
``evaluation.norm_growth_factor`` times its starting scale, tested every round) is neither
recorded nor checkpointed: the run stops with FloatingPointError (status "diverged"),
whose message names the round, the values, and the checkpoint of the last healthy round
(or that none exists).  A run whose evaluated train loss stays high is flagged once
(``driftlab.experiments.instability``) and goes on.

However the loop ends, run.json gets its status (complete, interrupted, diverged,
failed): the last completed round is checkpointed on the way out, and a step of that
which fails is named in the message and never hides the error that stopped the run.
Ctrl-C or SIGTERM raises ``RunInterrupted``, which says what was saved and gives the
exact command that continues the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file

from driftlab.algorithms import registry
from driftlab.data.federated import DataFileError, FederatedArrays, FederatedDataset
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
from driftlab.experiments.datasets import DataSetupError
from driftlab.experiments.instability import INSTABILITY_KEY, InstabilityWatch, UnstableRunWarning
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
from driftlab.simulation.engine import (
    EVALUATION_KEYS,
    Simulation,
    SimulationState,
    commit_round,
    discard_round,
    disk_stores,
    reference_losses,
    run_round,
)
from driftlab.simulation import latest_models


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
    clean_up_refused: bool = False,
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

    ``clean_up_refused=True`` (the CLI's ``driftlab run``): a new run refused before its
    first round (a ConfigError or a data error, e.g. a wrong data path) leaves nothing in
    ``out_dir`` when the run created it or found it empty, where it would otherwise leave
    its config.json.  A sweep keeps that config.json: it resumes its failed runs from it.

    Ctrl-C or SIGTERM raises ``RunInterrupted`` (a KeyboardInterrupt) whose message
    says what was saved and gives the exact command that continues the run.

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
    found = run_directory.DirectoryBefore.of(out) if clean_up_refused and not resume else None
    lock = run_directory.claim_run_directory(out, config, resume)
    try:
        return _run_in(out, config, resume, progress, _Inputs(model, dataset, loss), progress_label, run_info or {})
    except RunInterrupted:
        raise
    except KeyboardInterrupt as error:  # before the first round: the directory holds config.json (and an earlier checkpoint)
        where = "its checkpoint is unchanged" if resume else f"{out} holds its config.json"
        raise RunInterrupted(f"the run was interrupted before its next round; {where}: continue with `{resume_command(out)}`") from error
    except REFUSALS:
        if found is not None and not (out / METRICS_FILE).exists():
            run_directory.remove_refused_run(out, found)  # with the lock held: nothing else writes there meanwhile
        raise
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
    watch = InstabilityWatch(
        config.evaluation.instability_factor, config.evaluation.instability_rounds, lambda: reference_losses(sim).get("train_loss")
    )
    watch.replay(records)  # a resumed run knows whether it was flagged, and how long its loss has been high
    # Opening a tracker logs the records it lacks, so every round reaches it once however the last process ended.
    trackers = open_trackers(out, config, records) if out is not None and config.log else None

    entries = {**run_info, INSTABILITY_KEY: watch.flagged} if watch.flagged is not None else run_info
    info = start_run_info(out, config, sim, state.round, entries) if out is not None else None
    reporter = progress if callable(progress) else None
    bar = None
    start_round = last_saved = state.round
    ending = "complete"  # what the trackers are told when the run stops
    try:  # from here on (run.json says "running") every way out writes run.json's status
        if progress is True:
            from driftlab.experiments.progress import round_progress

            bar = round_progress(progress_label or config.algorithm.name, config.rounds, state.round)
        while state.round < config.rounds:
            upcoming = state.round + 1
            evaluate_after = evaluates_after(config, upcoming)
            finished, record = run_round(sim, state, evaluate_after, commit=False)
            unstable = watch.observe(record)
            if unstable is not None:
                record[INSTABILITY_KEY] = unstable
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
            if unstable is not None:
                _tell_instability(unstable, watch.flagged, bar, info, last_saved)
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
        ending = _status_of(error)
        with _signals_ignored():  # a second Ctrl-C must not cut the checkpoint or run.json short: the run is stopping already
            replacement = _save_on_the_way_out(error, ending, out, config, state, records, last_saved, info)
        if replacement is None:
            raise
        raise replacement from error
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
        if sim.initial_losses is not None:
            # The initial model's losses the divergence test already computed (nothing is evaluated for this):
            # the report's curves start from them at round 0.
            accuracy = {} if sim.initial_accuracy is None else {"test_accuracy": sim.initial_accuracy}
            info.content["initial"] = {**sim.initial_losses, **accuracy}
        info.update("complete", state.round)
        if not config.keep_checkpoint:
            drop_checkpoint(out)
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


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C or SIGTERM; the message says what was saved and how to continue (``resume_command``)."""


# Errors that refuse a run before it starts: a configuration or data problem the message says how to fix.
REFUSALS = (ConfigError, DataFileError, DataSetupError)


def resume_command(out: Path) -> str:
    """The command that continues the run in ``out``, with ``out`` as the run was given it (relative paths stay relative)."""
    return f"driftlab run {shlex.quote(str(out / CONFIG_FILE))} --out {shlex.quote(str(out))} --resume"


def _save_on_the_way_out(
    error: BaseException,
    ending: str,
    out: Path | None,
    config: ExperimentConfig,
    state: SimulationState,
    records: list[dict[str, Any]],
    last_saved: int,
    info: run_directory.RunInfo | None,
) -> BaseException | None:
    """After ``error`` stopped the round loop: drop the interrupted round's staged client states, checkpoint the
    last completed round (``state``) and write run.json's status; the exception to raise instead of ``error``
    (None: ``error`` itself).

    Never die without a resumable checkpoint, and never leave run.json at "running": each step is tried on
    its own, so one that fails (a client state no checkpoint can hold, a full disk) is named in the message
    and on the error (a note), and neither hides ``error`` nor stops the steps after it.
    """
    problems: list[str] = []

    def attempt(what: str, action: Callable[[], None]) -> bool:
        try:
            action()
            return True
        except Exception as failure:  # noqa: BLE001 - reported with the original error, which stays the one raised
            problems.append(f"{what} failed ({type(failure).__name__}: {failure})")
            return False

    attempt("dropping the stopped round's client states", lambda: discard_round(state))
    checkpointed = last_saved
    if out is not None and state.round > last_saved:
        if attempt(f"writing the checkpoint of round {state.round}", lambda: write_checkpoint(out, config, state)):
            checkpointed = state.round
    if out is not None:
        attempt("writing metrics.csv", lambda: run_directory.write_metrics_csv(out, records))
    replacement: BaseException | None = None
    if isinstance(error, FloatingPointError):
        replacement = _divergence_error(error, out, state.round, checkpointed)
    elif isinstance(error, KeyboardInterrupt) and not isinstance(error, RunInterrupted):
        cause = f"{error}: " if str(error) else ""  # "terminated by signal 15"
        replacement = RunInterrupted(cause + _interruption_text(out, state.round, checkpointed))
    if problems:
        note = "While stopping, " + "; ".join(problems)
        if replacement is None:
            error.add_note(note)
        else:
            replacement = type(replacement)(f"{str(replacement).rstrip('.')}. {note}")
    if info is not None:
        message = str(replacement or error) or type(error).__name__
        if problems and replacement is None:
            message += ". " + note
        try:
            info.update(ending, state.round, message=message)
        except Exception as failure:  # noqa: BLE001 - nothing more can be written; the error says so
            (replacement or error).add_note(f"writing {info.path} failed ({type(failure).__name__}: {failure}): it may still say \"running\"")
    return replacement


def _interruption_text(out: Path | None, recorded: int, checkpointed: int) -> str:
    """What an interrupted run saved, and how to continue it."""
    if out is None:
        return "nothing was saved: the run has no output directory (--out)"
    if checkpointed > 0:
        return f"round {checkpointed} is checkpointed in {out}; continue with `{resume_command(out)}`"
    done = "no round was completed" if recorded == 0 else f"no checkpoint could be written for {_rounds_up_to(recorded)}"
    return f"{done}, so {out} holds no checkpoint, only the run's config.json; start it again with `{resume_command(out)}`"


def _rounds_up_to(last: int) -> str:
    return "round 1" if last == 1 else f"rounds 1-{last}"


def _divergence_error(error: FloatingPointError, out: Path | None, recorded: int, checkpointed: int) -> FloatingPointError:
    """The engine's divergence message completed with exactly what the run kept (``recorded`` rounds, a checkpoint at ``checkpointed``)."""
    if out is None:
        kept = "no checkpoint exists: the run has no output directory"
    elif recorded == 0:
        kept = "no checkpoint exists and no round was recorded: the run diverged in its first round"
    else:
        if checkpointed == recorded:
            saved = f"the checkpoint of round {recorded}, the last healthy round, is kept in {out / CHECKPOINT_FILE}"
        elif checkpointed > 0:
            saved = f"the checkpoint of round {checkpointed} is kept in {out / CHECKPOINT_FILE} (round {recorded}'s could not be written)"
        else:
            saved = f"no checkpoint exists (round {recorded}'s could not be written)"
        kept = f"{saved}; {out / METRICS_FILE} and {METRICS_CSV_FILE} hold {_rounds_up_to(recorded)}"
    return FloatingPointError(f"{str(error).rstrip('.')}. {kept[0].upper()}{kept[1:]}")


def _tell_instability(message: str, flagged: dict[str, Any], bar: Any, info: run_directory.RunInfo | None, last_saved: int) -> None:
    """Say once that the run is unstable: in run.json at once, above the progress bar or as a ``UnstableRunWarning``."""
    if info is not None:
        info.content[INSTABILITY_KEY] = flagged
        info.update("running", last_saved)
    if bar is not None:
        bar.warn(message)
    else:
        warnings.warn(message, UnstableRunWarning, stacklevel=4)


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
        # The method's name as its registry entry spells it: `driftlab report` reads it as data, never importing a plugin.
        "algorithm_label": registry.label(config.algorithm.name),
        **extra,
    }
    return run_directory.RunInfo.start(out, config.rounds, start_round, sim.model.num_parameters, entries)


LATEST_SUM, LATEST_COUNT = latest_models.SUM, latest_models.COUNT  # the checkpoint's engine/ tensors (latest_models.checkpoint_tensors)


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
        in_file = state.latest_models if "latest_models" not in stores else None  # compact beside the models it sums
        engine_tensors = latest_models.checkpoint_tensors(state.latest_sum, in_file)
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
        if keeps_latest:
            latest_sum = latest_models.from_checkpoint_tensors(loaded.engine_tensors, state.latest_models, initial)
        state = SimulationState(loaded.round, loaded.server_state, state.clients, state.latest_models, latest_sum)
        commit_round(state)
    else:
        state = _completed_without_checkpoint(out, config, state) or state  # else: nothing kept, it runs again from round 0
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
def _signals_ignored() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM until the block ends (main thread only): the run is already stopping."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def drop_checkpoint(out: Path) -> None:
    """Remove a completed run's checkpoint and disk client-state files (``keep_checkpoint = false``): what stays is
    its final model, config and metrics, all that reports, plots and a resume of the same rounds read."""
    (out / CHECKPOINT_FILE).unlink(missing_ok=True)
    shutil.rmtree(out / CLIENT_STATE_DIR, ignore_errors=True)


@dataclass(frozen=True)
class _CompletedServer:
    """The server state of a completed run resumed without its checkpoint: its final model, and nothing left to run."""

    params: torch.Tensor


def _completed_without_checkpoint(out: Path, config: ExperimentConfig, state: SimulationState) -> SimulationState | None:
    """A run that completed ``config.rounds`` rounds and dropped its checkpoint, at its last round with its final model;
    None for any other run without a checkpoint (killed before its first, or completed with fewer rounds: such a
    run starts again from round 0, which gives the same numbers since every draw derives from seed, round and client id)."""
    info = read_run_info(out) or {}
    done = info.get("rounds_done")
    if isinstance(done, int) and done > config.rounds:  # a run is extended, never cut short (its records would be lost)
        raise ConfigError(f"cannot resume: the run in {out} has {done} rounds done, past rounds={config.rounds}; set rounds to at least {done}")
    final = out / FINAL_MODEL_FILE
    if info.get("status") != "complete" or info.get("rounds_done") != config.rounds or not final.is_file():
        return None
    initial = state.server.params
    params = load_file(str(final)).get("params")
    if params is None or params.shape != initial.shape:
        return None
    server = _CompletedServer(params.to(device=initial.device, dtype=initial.dtype))
    return SimulationState(config.rounds, server, state.clients, state.latest_models, None)


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


__all__ = ["RunResult", "RunDirectoryBusy", "RunInterrupted", "run", "resume_command", "build_simulation", "install_termination_handler", "read_run_info"]
