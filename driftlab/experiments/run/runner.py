"""Run one experiment: ``driftlab.run(config) -> RunResult``, used by the CLI, sweeps and notebooks.

With an output directory the run writes config.json, metrics.jsonl/csv, checkpoints,
the final model and run.json there (``driftlab.experiments.run.run_directory`` lists them
and claims, locks and checks the directory); ``driftlab.experiments.run.assembly`` builds
the simulation from the config, and ``driftlab.experiments.run.lifecycle`` runs it: the
lifecycle a deployment's server shares (resume, checkpoints, trackers, divergence,
interruption), driving the simulator's rounds through ``SimulatorDriver``.

config.json is written first, before any data is loaded (your own data, ``data=`` or
``data.loader``, is read before it, to record its digest), so a run killed at any
moment resumes with ``driftlab run DIR/config.json --out DIR --resume``.  A run
writes only into a new or empty directory, or into a run of its own
configuration (with ``resume``); one process at a time (RunDirectoryBusy).
Ctrl-C or SIGTERM raises ``RunInterrupted``, which says what was saved and gives the
exact command that continues the run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from driftlab.algorithms import registry
from driftlab.data.federated import DataFileError, FederatedArrays, FederatedDataset
from driftlab.errors import ConfigError
from driftlab.experiments.config import ExperimentConfig, config_from_record, load_config, read_config_source
from driftlab.experiments.run import run_directory
from driftlab.experiments.run.assembly import (  # noqa: F401  (importable from here as before the split)
    BACKENDS,
    ExampleLoss,
    ModelSource,
    build_simulation,
    client_stores,
    features_run_info,
    resolve_backend,
    resolve_device,
    resolve_devices,
    user_data,
)
from driftlab.experiments.run.datasets import DataSetupError
from driftlab.experiments.run.lifecycle import (  # noqa: F401  (the lifecycle's names stay importable from here)
    RunInterrupted,
    RunResult,
    drop_checkpoint,
    evaluates_after,
    install_termination_handler,
    prepare_output,
    resume_command,
    run_rounds,
    start_run_info,
    write_checkpoint,
)
from driftlab.experiments.run.run_directory import (  # noqa: F401  (the file names stay importable from here)
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
from driftlab.experiments.run.trackers import check_trackers_installed
from driftlab.simulation.asynchronous.engine import asynchronous_problem, run_update
from driftlab.simulation.round.engine import commit_round, discard_round, run_round
from driftlab.simulation.round.setup import Simulation, SimulationState


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
            raise ConfigError(
                f"log={list(config.log)} needs an output directory (--out DIR): a tracker run is tied to the run's directory"
            )
        return _run_in(None, config, resume, progress, _Inputs(model, dataset, loss), progress_label, {})
    out = run_directory.output_directory(out_dir)
    found = run_directory.DirectoryBefore.of(out) if clean_up_refused and not resume else None
    lock = run_directory.claim_run_directory(out, config, resume)
    try:
        return _run_in(out, config, resume, progress, _Inputs(model, dataset, loss), progress_label, run_info or {})
    except RunInterrupted:
        raise
    except (
        KeyboardInterrupt
    ) as error:  # before the first round: the directory holds config.json (and an earlier checkpoint)
        where = "its checkpoint is unchanged" if resume else f"{out} holds its config.json"
        raise RunInterrupted(
            f"the run was interrupted before its next round; {where}: continue with `{resume_command(out)}`"
        ) from error
    except REFUSALS:
        if found is not None and not (out / METRICS_FILE).exists():
            run_directory.remove_refused_run(out, found)  # with the lock held: nothing else writes there meanwhile
        raise
    finally:
        lock.close()


def run_recorded(run_dir: str, config_table: dict[str, Any], resume: bool, run_info: dict[str, Any]) -> None:
    """The sweep workers' entry (``RunTask.entry`` names it; ``driftlab.executors.worker`` calls it in the run's own
    interpreter): run, or resume, the resolved config table ``config_table`` (``ExperimentConfig.to_dict()``, its
    plugins imported by ``config_from_record``) in ``run_dir``, with ``run_info`` (the executor's job, the GPUs it
    placed the run on) added to run.json. Raises what ``run`` raises; the worker turns that into its exit code."""
    run(config_from_record(config_table), Path(run_dir), resume=resume, run_info=run_info)


def _with_algorithm(
    config: ExperimentConfig | dict[str, Any] | str | Path | None,
    overrides: Sequence[str],
    entry: registry.AlgorithmEntry,
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
            f'example, got {loss!r}; config.json records it as model.loss = "module:function" so that a resume uses the same loss'
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
    # each feature's run.json entry ([privacy]'s resolved noise and ε, [system]'s profiles and trace digest)
    if out is not None:
        features = features_run_info(config, sim)
        if resume:
            check_trace_unchanged(out, features)
        run_info = {**features, **run_info}
    driver = AsynchronousDriver(sim) if sim.asynchronous is not None else SimulatorDriver(sim)
    return run_rounds(
        driver,
        out,
        config,
        sim,
        state,
        resume=resume,
        progress=progress,
        progress_label=progress_label,
        run_info=run_info,
    )


def check_trace_unchanged(out: Path, system: dict[str, Any]) -> None:
    """Refuse to resume a run whose device trace (``system.trace``) is not the file it started with: its bytes set
    every client's timing, and so who reports and when (the fingerprint holds the trace's file name only)."""
    started = (read_run_info(out) or {}).get("system") or {}
    before, now = started.get("sha256"), system.get("system", {}).get("sha256")
    if isinstance(before, str) and now is not None and before != now:
        raise ConfigError(
            f"cannot resume: the run in {out} started with a device trace of SHA-256 {before[:12]}... ({started.get('trace')}), "
            f"but system.trace ({system['system'].get('trace')}) now has SHA-256 {now[:12]}...; resume with the trace the run "
            "started with, or start a new run in another --out directory"
        )


@dataclass(frozen=True)
class SimulatorDriver:
    """The simulator's rounds (``lifecycle.RoundDriver``): ``engine.run_round`` trains every client in this process,
    their new states staged in the stores until ``commit`` (``commit_round``) or ``discard`` (``discard_round``)."""

    sim: Simulation
    checkpoints_every_round: bool = False  # every config.checkpoint_every rounds

    def prepare(self, state: SimulationState) -> None:
        """Nothing to prepare: the stores hold the clients' states."""

    def before_rounds(self, state: SimulationState) -> None:
        """Nothing to wait for: every client is in this process."""

    def run_round(self, state: SimulationState, evaluate_after: bool) -> tuple[SimulationState, dict[str, Any]]:
        return run_round(self.sim, state, evaluate_after, commit=False)

    def commit(self, state: SimulationState) -> None:
        commit_round(state)

    def discard(self, state: SimulationState) -> None:
        discard_round(state)

    def round_done(self, state: SimulationState) -> None:
        """Nobody else to tell: the checkpoint holds the clients' states."""

    def how_to_continue(self, out: Path) -> str:
        return f"`{resume_command(out)}`"


@dataclass(frozen=True)
class AsynchronousDriver(SimulatorDriver):
    """FedBuff's server updates (``driftlab.simulation.asynchronous``): each "round" is one server update, the clients
    in flight carried in ``SimulationState.in_flight``; refuses, before any work, a simulation that cannot run so."""

    def __post_init__(self) -> None:
        problem = asynchronous_problem(self.sim)
        if problem is not None:
            raise ConfigError(f"[asynchronous]: {problem}")

    def run_round(self, state: SimulationState, evaluate_after: bool) -> tuple[SimulationState, dict[str, Any]]:
        return run_update(self.sim, state, evaluate_after)


# Errors that refuse a run before it starts: a configuration or data problem the message says how to fix.
REFUSALS = (ConfigError, DataFileError, DataSetupError)


__all__ = [
    "RunResult",
    "RunDirectoryBusy",
    "RunInterrupted",
    "SimulatorDriver",
    "AsynchronousDriver",
    "run",
    "run_recorded",
    "resume_command",
    "build_simulation",
    "install_termination_handler",
    "read_run_info",
]
