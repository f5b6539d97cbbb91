"""The life of a run, written once for every way of running its rounds: the simulator and a deployment.

``run_rounds(driver, out, config, sim, state)`` does everything around the
rounds; a *round driver* (``RoundDriver``) does the rounds themselves.  The
simulator's driver (``runner.SimulatorDriver``) trains the clients in this
process; a deployment's (``driftlab.deploy.server``) asks nodes over a
transport.  Both therefore write the same run directory, log to the same
trackers, defer the same signals and stop the same way on divergence.

With an output directory a run writes config.json (its caller, which claims the
directory), metrics.jsonl/csv, checkpoints, the final model and run.json there
(``driftlab.experiments.run.run_directory`` lists them).  ``resume=True`` continues
from the checkpoint: metrics of rounds after it are dropped and recomputed,
which gives bit-identical models and metrics (wall times aside) because every
random draw derives from (seed, round, client id).  The checkpoint's checksum,
config.json and every line of metrics.jsonl are checked before anything is
rewritten (``prepare_output``).

A round runs in two steps so that an interruption never leaves half of one:
``driver.run_round`` stages it (client states kept aside, nothing recorded),
its record is appended to metrics.jsonl, and only then ``driver.commit`` makes
it take effect, with SIGINT/SIGTERM held until that is done.  Every
``checkpoint_every`` rounds (and after the last) the checkpoint, metrics.csv
and run.json are written.  Trackers (``config.log``) get every round once.

A round that diverges (the engine's ``FloatingPointError``: a non-finite
model, a loss above ``evaluation.divergence_factor`` times the initial
model's, a norm above ``evaluation.norm_growth_factor`` times its starting
scale) is neither recorded nor checkpointed: the run stops with status
"diverged" and a message naming the round, the values, and the checkpoint of
the last healthy round (or that none exists).  A run whose evaluated train loss
stays high is flagged once (``driftlab.experiments.run.instability``) and goes on.

``evaluation.stop_at`` ends a run early once a metric reaches a target or stops improving
(``driftlab.experiments.run.stopping``): after the evaluated round that meets a rule the run is checkpointed and
finishes as any completed run does (final model, status "complete"), with run.json's ``"stopped"`` naming the
round and why.  The rules are decided from the records alone, so a resume replays them over metrics.jsonl: a
run killed before it stopped stops at the same round, a stopped run resumed with its rule runs nothing more
(raising ``rounds`` changes nothing: its target was met), and one resumed with a looser rule (or none) goes on
from its checkpoint, or from round 0 when it dropped it (the same numbers).  A rule tightened on a resume, met
at a round already run, ends the run at its last round: rounds run are never undone.

However the loop ends, run.json gets its status (complete, interrupted,
diverged, failed): the last completed round is checkpointed on the way out,
and a step of that which fails is named in the message and never hides the
error that stopped the run.  Ctrl-C or SIGTERM raises ``RunInterrupted``,
which says what was saved and how to continue (``driver.how_to_continue``).
A completed run with ``keep_checkpoint = false`` drops its checkpoint.

run.json lists the run's segments, one per process that ran its rounds, with the settings each ran
with; a resume that changes one that can change the last bits (the device, torch's threads on a CPU,
what ``memory_budget`` gives) warns, naming it (``driftlab.experiments.run.segments``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import shutil
import signal
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
from safetensors.torch import load_file

from driftlab.algorithms import registry
from driftlab.errors import ConfigError
from driftlab.experiments.config import ExperimentConfig
from driftlab.experiments.run import run_directory, segments
from driftlab.experiments.run.assembly import client_stores
from driftlab.experiments.run.instability import INSTABILITY_KEY, InstabilityWatch, UnstableRunWarning
from driftlab.experiments.run.loading import write_final_state_dict
from driftlab.experiments.run.run_directory import (
    CHECKPOINT_FILE,
    CLIENT_STATE_DIR,
    CONFIG_FILE,
    FINAL_MODEL_FILE,
    METRICS_CSV_FILE,
    METRICS_FILE,
    STOPPED_KEY,
    read_run_info,
)
from driftlab.experiments.run.stopping import Stop, StopWatch
from driftlab.experiments.run.trackers import open_trackers
from driftlab.metrics.summary import summarize
from driftlab.simulation.evaluation import EVALUATION_KEYS, reference_losses
from driftlab.simulation.round.checkpointing import checkpointed_parts, completed_state, record_template, restored_state
from driftlab.simulation.round.engine import commit_round
from driftlab.simulation.round.setup import Simulation, SimulationState, disk_stores
from driftlab.simulation.state.checkpoint import load_checkpoint, save_checkpoint, save_tensors, write_atomically


class RoundDriver(Protocol):
    """Who runs a run's rounds; ``run_rounds`` does the rest (module docstring).

    ``run_round`` stages round ``state.round + 1`` and returns the state after
    it with the round's record, nothing committed; ``commit`` makes a staged
    round take effect (called once its record is on disk, signals held),
    ``discard`` forgets what a stopped round staged.  The hooks let a driver do
    what only it needs: ``prepare`` once the output is prepared (a resumed
    state given), ``before_rounds`` inside the run (what fails there is
    recorded in run.json), ``round_done`` after each committed round's
    checkpoint (if one is written that round).
    """

    checkpoints_every_round: bool  # a checkpoint after every round, whatever checkpoint_every says

    def prepare(self, state: SimulationState) -> None: ...

    def before_rounds(self, state: SimulationState) -> None: ...

    def run_round(self, state: SimulationState, evaluate_after: bool) -> tuple[SimulationState, dict[str, Any]]: ...

    def commit(self, state: SimulationState) -> None: ...

    def discard(self, state: SimulationState) -> None: ...

    def round_done(self, state: SimulationState) -> None: ...

    def how_to_continue(self, out: Path) -> str:
        """How a stopped run in ``out`` continues, as said after "continue with" (e.g. a command in backquotes)."""
        ...


def run_rounds(
    driver: RoundDriver,
    out: Path | None,
    config: ExperimentConfig,
    sim: Simulation,
    state: SimulationState,
    *,
    resume: bool = False,
    progress: bool | Callable[[dict[str, Any]], None] = False,
    progress_label: str | None = None,
    run_info: dict[str, Any] | None = None,
) -> RunResult:
    """The run of ``config`` from ``state`` (or, with ``resume``, its checkpoint in ``out``) to its last round.

    ``out``, when given, is claimed (locked, checked, config.json written) by the caller.
    """
    records: list[dict[str, Any]] = []
    before = (
        segments.read_before(out) if out is not None and resume else None
    )  # before prepare_output rewrites config.json
    if out is not None:
        records, state = prepare_output(out, config, sim, state, resume)
    driver.prepare(state)
    watch = InstabilityWatch(
        config.evaluation.instability_factor,
        config.evaluation.instability_rounds,
        lambda: reference_losses(sim).get("train_loss"),
    )
    watch.replay(records)  # a resumed run knows whether it was flagged, and how long its loss has been high
    # A resumed run decides from its records as it did when it ran them: met already, it is finished.
    stopping = StopWatch(config.evaluation.stop_rules)
    stop = stopping.replay(records)
    # Opening a tracker logs the records it lacks, so every round reaches it once however the last process ended.
    trackers = open_trackers(out, config, records) if out is not None and config.log else None

    run_info = run_info or {}
    entries = {**run_info, INSTABILITY_KEY: watch.flagged} if watch.flagged is not None else run_info
    segment = None  # this process's entry in run.json's segments, when it runs any round
    if out is not None:
        history = segments.kept_segments(before, state.round)
        if state.round < config.rounds and stop is None:
            segment = segments.current_segment(config, sim, state, state.round)
            changed = segments.changes(history[-1] if history else None, segment, out)
            for message in changed:
                warnings.warn(message, segments.ResumeChangeWarning, stacklevel=4)  # driftlab.run's caller
            if changed:
                segment["changed"] = changed
            history.append(segment)
        entries = {**entries, segments.SEGMENTS_KEY: history}
    info = start_run_info(out, config, sim, state.round, entries) if out is not None else None
    reporter = progress if callable(progress) else None
    bar = None
    start_round = last_saved = state.round
    ending = "complete"  # what the trackers are told when the run stops
    try:  # from here on (run.json says "running") every way out writes run.json's status
        if progress is True:
            from driftlab.experiments.run.progress import round_progress

            bar = round_progress(progress_label or config.algorithm.name, config.rounds, state.round)
        driver.before_rounds(state)
        while state.round < config.rounds and stop is None:
            upcoming = state.round + 1
            finished, record = driver.run_round(state, evaluates_after(config, upcoming))
            unstable = watch.observe(record)
            if unstable is not None:
                record[INSTABILITY_KEY] = unstable
            if out is not None:
                run_directory.append_record(out / METRICS_FILE, record)
            # The round counts as done only once its record is on disk; from here to the new
            # state nothing may be interrupted half way.
            with _signals_deferred():
                driver.commit(finished)
                state = finished
                records.append(record)
            if trackers is not None:
                trackers.log_round(record)
            if unstable is not None:
                _tell_instability(unstable, watch.flagged, bar, info, last_saved)
            stop = stopping.observe(record)
            due = (
                driver.checkpoints_every_round
                or state.round % config.checkpoint_every == 0
                or state.round == config.rounds
                or stop is not None
            )
            if out is not None and due:
                write_checkpoint(out, config, sim, state)
                run_directory.write_metrics_csv(out, records)
                last_saved = state.round
                _ran(segment, state.round)
                info.update("running", state.round)
            driver.round_done(state)
            if bar is not None:
                bar.update(record)
            if reporter is not None:
                reporter(record)
    except BaseException as error:
        ending = _status_of(error)
        # A second Ctrl-C must not cut the checkpoint or run.json short: the run is stopping already.
        with _signals_ignored():
            _ran(segment, state.round)
            replacement = _save_on_the_way_out(
                error, ending, out, config, driver, sim, state, records, last_saved, info
            )
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
        _finish_output(out, sim, records, final_params, info, wrote_table=state.round > start_round)
        _ran(segment, state.round)
        if stop is not None:
            info.content[STOPPED_KEY] = stop.info(state.round)
        info.update("complete", state.round)
        if not config.keep_checkpoint:
            drop_checkpoint(out)
    summary = summarize(records, config.evaluation.target_accuracy, sim.model.num_parameters)
    stopped = None if stop is None else stop.info(state.round)
    return RunResult(config, records, final_params, sim.model.num_parameters, out, summary, stopped)


def _ran(segment: dict[str, Any] | None, rounds_done: int) -> None:
    """Extend this process's segment in run.json to ``rounds_done`` (written with run.json's next update)."""
    if segment is not None:
        segment["rounds"][1] = rounds_done


def _finish_output(
    out: Path,
    sim: Simulation,
    records: list[dict[str, Any]],
    final_params: torch.Tensor,
    info: run_directory.RunInfo,
    wrote_table: bool,
) -> None:
    """A completed run's final model, its metrics.csv (when no round of this process wrote it) and run.json's "initial"."""
    names = ",".join(sim.model.names)
    write_atomically(
        out / FINAL_MODEL_FILE,
        lambda tmp: save_tensors(
            {"params": final_params.detach().cpu().contiguous()}, str(tmp), metadata={"parameter_names": names}
        ),
    )
    # the same model under the module's own state_dict names, for load_model and torch's load_state_dict
    write_final_state_dict(out, sim.model, final_params, sim.data.input_shape, sim.data.num_classes)
    if not wrote_table:  # nothing left to run (a finished run resumed): the loop wrote no table
        run_directory.write_metrics_csv(out, records)
    if sim.initial_losses is not None:
        # The initial model's losses the divergence test already computed (nothing is evaluated for this):
        # the report's curves start from them at round 0.
        accuracy = {} if sim.initial_accuracy is None else {"test_accuracy": sim.initial_accuracy}
        info.content["initial"] = {**sim.initial_losses, **accuracy}


@dataclass
class RunResult:
    """A finished (or interrupted) run: its config, per-round records and final server model."""

    config: ExperimentConfig
    records: list[dict[str, Any]]
    final_params: torch.Tensor
    num_parameters: int
    out_dir: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    # run.json's "stopped" entry when evaluation.stop_at ended the run ({"round", "met_at", "metric", "reason", "rule"})
    stopped: dict[str, Any] | None = None

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


def resume_command(out: Path) -> str:
    """The command that continues the run in ``out``, with ``out`` as the run was given it (relative paths stay relative)."""
    return f"driftlab run {shlex.quote(str(out / CONFIG_FILE))} --out {shlex.quote(str(out))} --resume"


def _save_on_the_way_out(
    error: BaseException,
    ending: str,
    out: Path | None,
    config: ExperimentConfig,
    driver: RoundDriver,
    sim: Simulation,
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

    attempt("dropping the stopped round's client states", lambda: driver.discard(state))
    checkpointed = last_saved
    if out is not None and state.round > last_saved:
        if attempt(f"writing the checkpoint of round {state.round}", lambda: write_checkpoint(out, config, sim, state)):
            checkpointed = state.round
    if out is not None:
        attempt("writing metrics.csv", lambda: run_directory.write_metrics_csv(out, records))
    replacement: BaseException | None = None
    if isinstance(error, FloatingPointError):
        replacement = _divergence_error(error, out, state.round, checkpointed)
    elif isinstance(error, KeyboardInterrupt) and not isinstance(error, RunInterrupted):
        cause = f"{error}: " if str(error) else ""  # "terminated by signal 15"
        replacement = RunInterrupted(cause + _interruption_text(out, state.round, checkpointed, driver))
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
            (replacement or error).add_note(
                f'writing {info.path} failed ({type(failure).__name__}: {failure}): it may still say "running"'
            )
    return replacement


def _interruption_text(out: Path | None, recorded: int, checkpointed: int, driver: RoundDriver) -> str:
    """What an interrupted run saved, and how to continue it (``driver.how_to_continue``)."""
    if out is None:
        return "nothing was saved: the run has no output directory (--out)"
    if checkpointed > 0:
        return f"round {checkpointed} is checkpointed in {out}; continue with {driver.how_to_continue(out)}"
    done = (
        "no round was completed" if recorded == 0 else f"no checkpoint could be written for {_rounds_up_to(recorded)}"
    )
    return f"{done}, so {out} holds no checkpoint, only the run's config.json; start it again with {driver.how_to_continue(out)}"


def _rounds_up_to(last: int) -> str:
    return "round 1" if last == 1 else f"rounds 1-{last}"


def _divergence_error(
    error: FloatingPointError, out: Path | None, recorded: int, checkpointed: int
) -> FloatingPointError:
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


def _tell_instability(
    message: str, flagged: dict[str, Any], bar: Any, info: run_directory.RunInfo | None, last_saved: int
) -> None:
    """Say once that the run is unstable: in run.json at once, above the progress bar or as a ``UnstableRunWarning``."""
    if info is not None:
        info.content[INSTABILITY_KEY] = flagged
        info.update("running", last_saved)
    if bar is not None:
        bar.warn(message)
    else:
        warnings.warn(message, UnstableRunWarning, stacklevel=5)


def start_run_info(
    out: Path, config: ExperimentConfig, sim: Simulation, start_round: int, extra: dict[str, Any]
) -> run_directory.RunInfo:
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


def write_checkpoint(out: Path, config: ExperimentConfig, sim: Simulation, state: SimulationState) -> None:
    """``state`` as the run's checkpoint (atomically; disk client stores stay in their files, recorded by version):
    its client records, the stores it references and the engine section the extras of ``sim`` write
    (``round.checkpointing``)."""
    clients, stores, engine_tensors = checkpointed_parts(sim, state)
    save_checkpoint(
        out / CHECKPOINT_FILE, state.round, state.server, clients, config.fingerprint(), stores, engine_tensors
    )


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
        loaded = load_checkpoint(
            checkpoint_path, state.server, record_template(sim, state), config.fingerprint(), sim.device
        )
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
        state = restored_state(sim, state, loaded)
        commit_round(state)
    else:
        state = (
            _completed_without_checkpoint(out, config, state) or state
        )  # else: nothing kept, it runs again from round 0
    records = _kept_records(metrics_path, config, state.round)
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


def _completed_without_checkpoint(
    out: Path, config: ExperimentConfig, state: SimulationState
) -> SimulationState | None:
    """A run that completed ``config.rounds`` rounds and dropped its checkpoint, at its last round with its final model;
    None for any other run without a checkpoint (killed before its first, or completed with fewer rounds: such a
    run starts again from round 0, which gives the same numbers since every draw derives from seed, round and client id)."""
    info = read_run_info(out) or {}
    done = info.get("rounds_done")
    if isinstance(done, int) and done > config.rounds:  # a run is extended, never cut short (its records would be lost)
        raise ConfigError(
            f"cannot resume: the run in {out} has {done} rounds done, past rounds={config.rounds}; set rounds to at least {done}"
        )
    final = out / FINAL_MODEL_FILE
    if not run_directory.finished(info, config.rounds) or not final.is_file():
        return None
    if done != config.rounds and _stop_met(out, config, done) is None:
        return None  # a stop rule ended it, and the rule it resumes with is not met: it runs again, from round 0
    initial = state.server.params
    params = load_file(str(final)).get("params")
    if params is None or params.shape != initial.shape:
        return None
    server = _CompletedServer(params.to(device=initial.device, dtype=initial.dtype))
    return completed_state(state, done, server)


def _stop_met(out: Path, config: ExperimentConfig, done: int) -> Stop | None:
    """The stop rule of ``config`` that the records of rounds 1..``done`` in ``out`` meet, if any."""
    return StopWatch(config.evaluation.stop_rules).replay(_kept_records(out / METRICS_FILE, config, done))


def _kept_records(path: Path, config: ExperimentConfig, up_to_round: int) -> list[dict[str, Any]]:
    """The records of rounds 1..``up_to_round`` a resume keeps: evaluations ``config`` would not make dropped."""
    records = run_directory.read_records(path, up_to_round=up_to_round)
    for record in records:
        # The old last round was evaluated because it was last; with more rounds it may not be.
        if not evaluates_after(config, record["round"]):
            for key in EVALUATION_KEYS:
                record.pop(key, None)
    return records


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then act on them (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def defer(signum: int, frame: Any) -> None:  # noqa: ARG001 - the signal module calls handler(signum, frame)
        received.append(signum)

    previous = {sig: signal.signal(sig, defer) for sig in (signal.SIGINT, signal.SIGTERM)}
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


__all__ = [
    "RoundDriver",
    "RunInterrupted",
    "RunResult",
    "drop_checkpoint",
    "evaluates_after",
    "install_termination_handler",
    "prepare_output",
    "resume_command",
    "run_rounds",
    "start_run_info",
    "write_checkpoint",
]
