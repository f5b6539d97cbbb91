"""Running a sweep: its pending runs through an executor, one fresh interpreter per run, and that interpreter's entry point.

Running the same sweep again skips complete runs, resumes interrupted ones from
their checkpoints (bit-identical to an uninterrupted run), retries failed ones and
leaves diverged ones alone (they would diverge again: every random draw derives
from seed, round and client id). Raising ``rounds`` extends finished runs. Each
run's process stops, checkpointed, when the sweep that started it dies, however it
dies; a run whose directory another live process holds is reported as running
elsewhere and never given a second writer.

Where runs execute is the executor's business (``driftlab.executors``: local
processes, SLURM jobs through submitit, Ray tasks, an executor a plugin registers);
every one starts each run through the same entry point (``driftlab.executors.worker``),
which calls what this module names in each task (``RUN_ENTRY``: ``runner.run_recorded``),
so results are the same byte for byte. This module imports the executors; they never
import the sweep. ``worker_main``, ``die_with_parent``, ``process_gone`` and the exit
codes are re-exported from there, where they now live.

Successive halving (``halving = {first = R, eta = 3}`` in the sweep file, or ``run_sweep(..., halving="R:3")``;
Jamieson and Talwalkar 2016, Li et al. 2018 "Hyperband") runs the values of a sweep's tuned axes in rungs. The unit
is one tuned value of one method in one setting, with all its seeds (so the values it keeps are those the report's
pick, a mean over seeds, can choose among). All values run to round r_0 = R; at each rung r_i the n values still in
are ranked by the mean over seeds of the tuning rule on validation at r_i (``report.tuning.ranked_values``), the best
⌈n/eta⌉ run on to r_{i+1} = r_i·eta (the last rung is the sweep's rounds) and the others stop there: they keep
their checkpoint (``keep_checkpoint``), and ``halving.json`` in their directory says "stopped by halving at round
r_i". Untuned runs run to their rounds in the first rung. Running the sweep again without halving
(``halving="off"`` where the file asks for it) extends the stopped runs through exact resume; the fingerprint
ignores ``rounds``, so an extended run is the run made straight, byte for byte. Running it again with halving
reuses each rung's ranking (``halving-rungs.json`` in the sweep directory) and runs nothing that ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from driftlab.errors import ConfigError
from driftlab.executors import processes, worker
from driftlab.executors.processes import (
    EXIT_BUSY,
    EXIT_COMPLETE,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
)
from driftlab.executors.processes import (
    EXIT_FAILED as EXIT_FAILED,
)
from driftlab.executors.processes import (
    process_gone as process_gone,
)
from driftlab.executors.registry import ExecutorEntry, ExecutorOptions, resolve
from driftlab.executors.slurm import LOG_FOLDER as SLURM_LOG_FOLDER
from driftlab.executors.tasks import Events, RunTask, TaskResult

# re-exported: the worker's entry point lived here, and driftlab.experiments.sweep still offers it
from driftlab.executors.worker import die_with_parent as die_with_parent
from driftlab.executors.worker import worker_main as worker_main
from driftlab.experiments.config import ExperimentConfig, config_from_record
from driftlab.experiments.report.read import read_metrics
from driftlab.experiments.report.tuning import ValueRuns, check_metric, mean_score, ranked_values
from driftlab.experiments.run.run_directory import CONFIG_FILE, METRICS_FILE, finished, read_run_info, write_atomically
from driftlab.experiments.sweep.directory import (
    FAILURE_FILE,
    HALVING_FILE,
    HALVING_RUNGS_FILE,
    JOBS_FILE,
    SWEEP_FILE,
    RunStatus,
    run_status,
)
from driftlab.experiments.sweep.planning import PlannedRun, plan, sweep_document
from driftlab.experiments.sweep.spec import SweepSpec, parse_halving
from driftlab.owned_folder import OwnedFolder, claim

# What each run's worker runs (``RunTask.entry``): named, not imported, as it travels to the worker's own interpreter.
RUN_ENTRY = "driftlab.experiments.run.runner:run_recorded"


@dataclass(frozen=True)
class RunOutcome:
    run: PlannedRun
    status: RunStatus
    message: str = ""
    seconds: float = 0.0


def run_sweep(
    spec: SweepSpec,
    out_dir: str | Path,
    *,
    jobs: int | None = None,
    scale: str | None = None,
    extra_overrides: Sequence[str] = (),
    retry_diverged: bool = False,
    log: Callable[[str], None] = print,
    executor: ExecutorOptions | None = None,
    threads: int | None = None,
    trackers: Sequence[str] | None = None,
    halving: str | None = None,
    force: bool = False,
) -> list[RunOutcome]:
    """Run every pending run of ``spec`` on ``executor`` (default: up to ``jobs`` local processes); returns each run's outcome.

    Locally, threads are split between processes (``torch.set_num_threads``), so a
    2-core machine runs two single-threaded runs at once; other executors use
    ``threads``, by default their entry's (``Layout``: SLURM's --slurm-cpus, else 1).
    Ctrl-C or SIGTERM stops every run at its last completed round, checkpointed; run
    the sweep again to resume, on any executor. An executor a plugin registers can be
    named: the sweep's plugins are imported (by planning its runs) before it is looked up.

    ``halving`` ("R:ETA", or "off"; None: the sweep file's ``halving``) runs the tuned axes' values by successive
    halving (the module's docstring); "off" runs every run to its rounds, extending the runs halving stopped.

    The sweep writes only its own names into ``out_dir`` (``SWEEP_NAMES``), and refuses before running anything when
    one of them is there and driftlab did not write it; ``force`` replaces such files (``driftlab.owned_folder``).
    """
    if threads is not None and threads < 1:
        raise ConfigError(f"threads per run must be at least 1, got {threads}")
    if halving is not None:
        spec = dataclasses.replace(spec, halving=parse_halving(halving))
        if spec.halving is not None and spec.tuning is None:
            raise ConfigError(
                f'--halving {halving}: halving stops the runs of a tuned axis, and sweep {spec.name} has none; mark an axis role = "tuned"'
            )
    out = Path(out_dir)
    runs = plan(spec, scale, extra_overrides)  # imports the plugins of the sweep and its base config
    entry, options = _executor(executor or ExecutorOptions(), jobs)
    entry.check(options)
    if trackers is not None:  # --log: not an override, so a sweep's runs can be resumed with logging turned on or off
        runs = [dataclasses.replace(r, config=r.config.model_copy(update={"log": tuple(trackers)})) for r in runs]
    from driftlab.experiments.run.trackers import check_trackers_installed

    check_trackers_installed([name for r in runs for name in r.config.log])  # before any run starts
    document = sweep_document(spec, runs, scale, extra_overrides)
    # With force, a user's sweep.json, jobs.json or halving-rungs.json is replaced, never read as the sweep's own.
    replaced = (
        OwnedFolder.read(out, "driftlab sweep").foreign(SWEEP_NAMES, earlier_sweep) if force and out.is_dir() else []
    )
    claim(out, SWEEP_NAMES, "driftlab sweep", force=force, recognise=earlier_sweep)
    with _exclusive(out):
        for name in (JOBS_FILE, HALVING_RUNGS_FILE):
            if name in replaced and (out / name).is_file():
                _write_json(out / name, {})
        if SWEEP_FILE not in replaced:
            _check_existing(out, document)
        for r in runs:
            check_run_directory(out / r.dir, r.config)
        _write_json(out / SWEEP_FILE, document)
        execution = _Execution(spec, out, entry, options, threads, retry_diverged, log)
        return _run_halving(execution, runs) if spec.halving is not None else _run_planned(execution, runs)


def _executor(executor: ExecutorOptions, jobs: int | None) -> tuple[ExecutorEntry, Any]:
    """The executor's entry and options, with ``jobs`` (``run_sweep``'s parallel processes) set on options that have it."""
    entry, options = resolve(executor)
    if jobs is None:
        return entry, options
    if "jobs" not in entry.option_names():
        names = ", ".join(entry.option_names()) or "none"
        raise ConfigError(f"jobs={jobs}: executor {entry.name!r} has no jobs option (its options: {names})")
    return entry, dataclasses.replace(options, jobs=jobs)


@dataclass(frozen=True)
class _Execution:
    """What every batch of a sweep's runs is executed with: the sweep, its folder, the executor and the run settings."""

    spec: SweepSpec
    out: Path
    entry: ExecutorEntry
    options: Any
    threads: int | None
    retry_diverged: bool
    log: Callable[[str], None]


def _run_planned(execution: _Execution, runs: list[PlannedRun], title: str = "") -> list[RunOutcome]:
    spec, out, entry, options, log = execution.spec, execution.out, execution.entry, execution.options, execution.log
    threads = execution.threads
    outcomes: dict[str, RunOutcome] = {}
    todo: list[PlannedRun] = []
    for r in runs:
        status = run_status(out / r.dir, r.config.rounds)
        if status == "complete" or (status == "diverged" and not execution.retry_diverged):
            outcomes[r.dir] = RunOutcome(r, status, _message(out / r.dir))
        else:
            todo.append(r)
            # it runs on (to a later rung, or to its rounds): halving no longer holds it stopped
            (out / r.dir / HALVING_FILE).unlink(missing_ok=True)
    skipped = len(runs) - len(todo)
    layout = entry.layout_for(options, len(todo))
    threads = threads or layout.threads
    log(
        f"sweep {spec.name}{title}: {len(runs)} runs, {skipped} already finished, {len(todo)} to run {layout.where} x {threads} thread(s)"
    )

    by_key = {r.dir: r for r in todo}
    done = skipped
    submitted: dict[str, Any] = {}

    def started(task: RunTask, resume: bool, job: dict[str, Any]) -> None:
        if job.get("job_id"):
            submitted[task.key] = job
            _write_json(out / JOBS_FILE, {"executor": entry.name, "runs": submitted})
            log(f"  submit  {_name(by_key[task.key])}  (job {job['job_id']})" + ("  (resuming)" if resume else ""))
        else:
            log(f"  start  {_name(by_key[task.key])}" + ("  (resuming)" if resume else ""))

    def finished(result: TaskResult) -> None:
        nonlocal done
        r = by_key[result.task.key]
        done += 1
        if not result.started:
            outcomes[r.dir] = RunOutcome(r, "running", _elsewhere(result.holder))
            log(f"  running  {_name(r)}  [{done}/{len(runs)}]  {outcomes[r.dir].message}")
            return
        status = _status_from_exit(result.exit_code)
        message = (
            _elsewhere(processes.run_directory_holder(out / r.dir) or 0)
            if status == "running"
            else _message(out / r.dir)
        )
        outcome = RunOutcome(
            r, status, message or result.job.get("error", "") or _exit_message(result.exit_code), result.seconds
        )
        outcomes[r.dir] = outcome
        log(
            f"  {status:<8s} {_name(r)}  [{done}/{len(runs)}, {_duration(outcome.seconds)}]"
            + (f"  {outcome.message}" if outcome.message else "")
        )

    def interrupted() -> None:
        log(
            "sweep interrupted: stopping runs at their last completed round (checkpointed); run the same command again to resume"
        )

    # Run directories as the sweep names them, with its working directory: an executor whose workers run
    # elsewhere makes them absolute (``executors.tasks.absolute``).
    tasks = [
        RunTask(r.dir, out / r.dir, r.config.to_dict(), threads, _name(r), os.getcwd(), entry=RUN_ENTRY) for r in todo
    ]
    submitted.update(_read_jobs(out).get("runs", {}))  # jobs.json keeps the jobs of earlier invocations too
    entry.execute(tasks, options, Events(started, finished, interrupted))
    return [outcomes[r.dir] for r in runs if r.dir in outcomes]


def _run_halving(execution: _Execution, runs: list[PlannedRun]) -> list[RunOutcome]:
    """The sweep's runs by successive halving over each (setting, method)'s tuned values (the module's docstring)."""
    spec, out, log = execution.spec, execution.out, execution.log
    assert spec.halving is not None and spec.tuning is not None
    halving, tuning = spec.halving, spec.tuning
    outcomes: dict[str, RunOutcome] = {}
    groups: dict[tuple[str, str], list[PlannedRun]] = {}
    for r in runs:
        if r.tuned:
            groups.setdefault((r.setting, r.tuned_method), []).append(r)
    active = {key: list(group) for key, group in groups.items()}
    batch = [r for r in runs if not r.tuned]  # untuned runs go to their rounds with the first rung
    decisions_path = out / HALVING_RUNGS_FILE
    try:
        decisions = list(json.loads(decisions_path.read_text()).get("rungs", []))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        decisions = []
    rung_index = 0
    while active or batch:
        rung = halving.first * halving.eta**rung_index
        deciding: dict[tuple[str, str], int] = {}
        reached = 0  # the round this rung takes the tuned runs to: below `rung` when they end sooner
        for key, group in active.items():
            full = max(r.config.rounds for r in group)
            at = min(rung, full)
            reached = max(reached, at)
            if at < full:
                deciding[key] = at
            batch += [_at_round(r, at) if at < r.config.rounds else r for r in group]
        ready = [r for r in batch if not _reached(out / r.dir, r.config.rounds)]
        for r in batch:
            if r not in ready:
                outcomes[r.dir] = RunOutcome(r, "complete", "")
        title = f", halving rung {rung_index + 1} (round {reached})" if active else ""
        for outcome in _run_planned(execution, ready, title):
            outcomes[outcome.run.dir] = outcome
        unsettled = [r for r in batch if outcomes[r.dir].status not in ("complete", "diverged")]
        if unsettled:
            log(
                f"sweep {spec.name}: {len(unsettled)} run(s) did not finish round {rung} ({', '.join(sorted({outcomes[r.dir].status for r in unsettled}))}), "
                "so halving cannot rank them yet; run the same command again to go on"
            )
            break
        batch = []
        for key, at in deciding.items():
            kept, stopped = _halve(active[key], at, tuning, halving.eta, out, decisions)
            _write_json(decisions_path, {"rungs": decisions})
            for r, message in stopped:
                _write_json(out / r.dir / HALVING_FILE, {"round": at, "message": message})
                outcomes[r.dir] = RunOutcome(_at_round(r, at), "stopped", message)
            active[key] = kept
            total = len({r.tuned for r in kept}) + len({r.tuned for r, _ in stopped})
            log(
                f"  halving {' / '.join(filter(None, key))} at round {at}: {len({r.tuned for r in kept})} of {total} values go on"
            )
        active = {key: group for key, group in active.items() if key in deciding}
        rung_index += 1
    planned = {r.dir: r for r in runs}
    return [dataclasses.replace(outcomes[d], run=planned[d]) for d in planned if d in outcomes]


def _at_round(r: PlannedRun, rounds: int) -> PlannedRun:
    """The run stopped at ``rounds`` (a rung), keeping its checkpoint so that it can be extended without rerunning."""
    return dataclasses.replace(r, config=r.config.model_copy(update={"rounds": rounds, "keep_checkpoint": True}))


def _reached(run_dir: Path, rounds: int) -> bool:
    """Whether the run has already done ``rounds`` rounds (a sweep run again: a rung it passed before needs no work)."""
    info = read_run_info(run_dir) or {}
    if (run_dir / FAILURE_FILE).exists():
        return False
    done = info.get("status") in ("complete", "running", "interrupted") and int(info.get("rounds_done", 0)) >= rounds
    return done or finished(info, rounds)  # or ended by its evaluation.stop_at before the rung


def _halve(
    group: list[PlannedRun], rung: int, tuning: Any, eta: int, out: Path, decisions: list[dict[str, Any]]
) -> tuple[list[PlannedRun], list[tuple[PlannedRun, str]]]:
    """The runs of the best ⌈n/eta⌉ tuned values at ``rung``, and the others with why.

    Values are ranked on their records up to the rung the first time; the ranking is kept in the sweep's
    ``halving-rungs.json`` (``decisions``) and reused when the sweep runs again, because a run extended past a rung
    no longer holds that rung's evaluation when the straight run would not have evaluated it."""
    by_value: dict[str, list[PlannedRun]] = {}
    for r in group:
        by_value.setdefault(r.tuned, []).append(r)
    where = [group[0].setting, group[0].tuned_method]
    stored = next(
        (
            d
            for d in decisions
            if d.get("group") == where
            and d.get("round") == rung
            and d.get("eta") == eta
            and set(d.get("order", ())) == set(by_value)
        ),
        None,
    )
    if stored is None:
        values = {}
        for value, value_runs in by_value.items():
            records = []
            for r in value_runs:
                path = out / r.dir / METRICS_FILE
                records.append(tuple(x for x in read_metrics(path)[0] if x["round"] <= rung) if path.exists() else ())
            values[value] = ValueRuns(
                tuple(records), any(run_status(out / r.dir, rung) == "diverged" for r in value_runs)
            )
        check_metric(
            [rec for v in values.values() for rec in v.records], tuning, f"{group[0].tuned_method} at round {rung}"
        )
        stored = {
            "group": where,
            "round": rung,
            "eta": eta,
            "order": ranked_values(values, tuning),
            "scores": {value: mean_score(runs, tuning) for value, runs in values.items()},
        }
        decisions.append(stored)
    order = stored["order"]
    keep = max(1, -(-len(order) // eta))
    stopped = []
    for rank, value in enumerate(order[keep:], start=keep + 1):
        score = stored["scores"].get(value)
        shown = "diverged or unscored" if score is None else f"{score:.4g}"
        message = (
            f"stopped by halving at round {rung}: {tuning.describe} {shown} ranked {rank} of {len(order)} values of "
            f"{group[0].tuned_method} (the best {keep} go on)"
        )
        stopped += [(r, message) for r in by_value[value]]
    kept_values = set(order[:keep])
    return [r for r in group if r.tuned in kept_values], stopped


def _read_jobs(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / JOBS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


SWEEP_LOCK_FILE = ".sweep.lock"
# What a sweep writes directly in its directory (its report has its own folder's manifest, ``report/``).
SWEEP_NAMES = (SWEEP_FILE, JOBS_FILE, HALVING_RUNGS_FILE, SWEEP_LOCK_FILE, "runs", SLURM_LOG_FOLDER)


def earlier_sweep(entry: Path) -> bool:
    """Whether ``entry`` sits in a sweep directory a driftlab from before manifests wrote: its sweep.json is a plan
    (``sweep_document``), so the sweep resumes there as it always did. An empty .sweep.lock is a sweep's lock: it is
    only ever opened to append nothing, so taking it changes nothing of anyone's."""
    if entry.name == SWEEP_LOCK_FILE and entry.is_file() and entry.stat().st_size == 0:
        return True
    try:
        document = json.loads((entry.parent / SWEEP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and isinstance(document.get("runs"), list) and "name" in document


@contextlib.contextmanager
def _exclusive(out: Path):
    """One sweep process per directory: a second one would run the same runs into the same files."""
    import fcntl

    handle = open(out / SWEEP_LOCK_FILE, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"another `driftlab sweep` is running on {out}; wait for it to finish (or stop it) first"
            ) from None
        yield
    finally:
        handle.close()


def check_run_directory(run_dir: Path, config: ExperimentConfig) -> None:
    """Refuse to count or continue a run directory made from another configuration, or run past the planned rounds."""
    stored = run_dir / CONFIG_FILE
    if not stored.exists():
        return
    try:
        previous = config_from_record(json.loads(stored.read_text()))
    except ConfigError:
        raise
    except (json.JSONDecodeError, ValueError) as error:
        raise ConfigError(
            f"{stored} is not a valid run configuration ({error}); delete {run_dir} to run it again"
        ) from None
    if previous.fingerprint() != config.fingerprint():
        raise ConfigError(
            f"{run_dir} holds a run of another configuration than the sweep now plans (its base or overrides changed); "
            "choose another --out directory, or delete that run directory to run it again"
        )
    done = (read_run_info(run_dir) or {}).get("rounds_done", 0)
    if done > config.rounds:
        raise ConfigError(
            f"{run_dir} has {done} rounds done, more than rounds={config.rounds}; raise rounds to at least {done} "
            "or choose another --out directory (a sweep extends runs, it never shortens them)"
        )


def _check_existing(out: Path, document: dict[str, Any]) -> None:
    path = out / SWEEP_FILE
    if not path.exists():
        return
    try:
        previous = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{path} is not valid JSON ({error}); delete it to re-plan the sweep (run directories are kept)"
        ) from None
    for key in ("name", "scale"):
        if previous.get(key) != document[key]:
            raise ConfigError(
                f"{out} holds sweep {previous.get('name')!r} at scale {previous.get('scale')!r}, not {document['name']!r} at scale "
                f"{document['scale']!r}; choose another --out directory"
            )
    planned = {r["dir"]: r["overrides"] for r in document["runs"]}
    for r in previous.get("runs", []):
        before, now = _without_rounds(r.get("overrides", [])), _without_rounds(planned.get(r["dir"], []))
        if r["dir"] in planned and before != now:
            raise ConfigError(
                f"{out}/{r['dir']} was run with overrides {r.get('overrides')} but the sweep now gives it {planned[r['dir']]}; "
                "only rounds may change when continuing a sweep (and keep_checkpoint); choose another --out directory"
            )


def _without_rounds(overrides: Sequence[str]) -> list[str]:
    # Neither changes a number a run computes (nor its fingerprint): a sweep may be extended, keeping checkpoints or not.
    return [o for o in overrides if not o.replace(" ", "").startswith(("rounds=", "keep_checkpoint="))]


def _elsewhere(pid: int) -> str:
    who = f"pid {pid}" if pid else "another process"
    return f"running elsewhere ({who} holds its directory); run the sweep again once that process has ended"


def _exit_message(code: int | None) -> str:
    if code is not None and code < 0 and code not in (-signal.SIGTERM, -signal.SIGINT):
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"the run's process was killed by {name} (out of memory?); run the sweep again to resume it from its checkpoint"
    if code not in (EXIT_COMPLETE, EXIT_DIVERGED, EXIT_BUSY, EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT):
        return f"the run's process exited with code {code} before it could record why; its error output is above"
    return ""


def _status_from_exit(code: int | None) -> RunStatus:
    statuses: dict[int | None, RunStatus] = {
        EXIT_COMPLETE: "complete",
        EXIT_DIVERGED: "diverged",
        EXIT_BUSY: "running",
        EXIT_INTERRUPTED: "interrupted",
        -signal.SIGTERM: "interrupted",
        -signal.SIGINT: "interrupted",
    }
    return statuses.get(code, "failed")


def _message(run_dir: Path) -> str:
    failure = run_dir / FAILURE_FILE
    if failure.exists():
        return failure.read_text().splitlines()[0] + f"  (details: {failure})"
    info = read_run_info(run_dir) or {}
    return info.get("message", "") if info.get("status") in ("diverged", "failed") else ""


def _name(r: PlannedRun) -> str:
    return " / ".join(part for part in (r.setting, r.method, f"seed {r.seed}") if part)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def _write_json(path: Path, content: dict[str, Any]) -> None:
    text = json.dumps(content, indent=2) + "\n"
    write_atomically(path, lambda tmp: tmp.write_text(text))


# The names re-exported from the executors, where they live: the exit codes, process_gone and the worker's own.
_EXECUTORS_NAMES = [*(name for name in processes.__all__ if name.startswith("EXIT_")), "process_gone", *worker.__all__]
__all__ = sorted(["RunOutcome", "run_sweep", *_EXECUTORS_NAMES])
