"""Running a sweep: its pending runs through an executor, one fresh interpreter per run, and that interpreter's entry point.

Running the same sweep again skips complete runs, resumes interrupted ones from
their checkpoints (bit-identical to an uninterrupted run), retries failed ones and
leaves diverged ones alone (they would diverge again: every random draw derives
from seed, round and client id). Raising ``rounds`` extends finished runs. Each
run's process stops, checkpointed, when the sweep that started it dies, however it
dies; a run whose directory another live process holds is reported as running
elsewhere and never given a second writer.

Where runs execute is the executor's business (``driftlab.executors``: local
processes, SLURM jobs through submitit, Ray tasks); every one starts each run through
``worker_main`` (``start_worker``), so results are the same byte for byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from driftlab.experiments.config import ConfigError, ExperimentConfig, config_from_record
from driftlab.experiments.run_directory import CONFIG_FILE, RunDirectoryBusy, read_run_info, write_atomically
from driftlab.experiments.sweep import directory
from driftlab.experiments.sweep.directory import FAILURE_FILE, JOBS_FILE, SWEEP_FILE, RunStatus, run_status
from driftlab.experiments.sweep.planning import PlannedRun, plan, sweep_document
from driftlab.experiments.sweep.spec import SweepSpec

if TYPE_CHECKING:
    from driftlab.executors import ExecutorOptions


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
) -> list[RunOutcome]:
    """Run every pending run of ``spec`` on ``executor`` (default: up to ``jobs`` local processes); returns each run's outcome.

    Locally, threads are split between processes (``torch.set_num_threads``), so a
    2-core machine runs two single-threaded runs at once; SLURM jobs and Ray tasks
    use ``threads`` (default: --slurm-cpus, else 1). Ctrl-C or SIGTERM stops every
    run at its last completed round, checkpointed; run the sweep again to resume,
    on any executor.
    """
    from driftlab.executors import ExecutorOptions, check_options

    options = executor or ExecutorOptions()
    if jobs is not None:
        options = dataclasses.replace(options, jobs=jobs)
    if threads is not None and threads < 1:
        raise ConfigError(f"threads per run must be at least 1, got {threads}")
    check_options(options)
    out = Path(out_dir)
    runs = plan(spec, scale, extra_overrides)
    if trackers is not None:  # --log: not an override, so a sweep's runs can be resumed with logging turned on or off
        runs = [dataclasses.replace(r, config=r.config.model_copy(update={"log": tuple(trackers)})) for r in runs]
    from driftlab.experiments.trackers import check_trackers_installed

    check_trackers_installed([name for r in runs for name in r.config.log])  # before any run starts
    document = sweep_document(spec, runs, scale, extra_overrides)
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):
        _check_existing(out, document)
        for r in runs:
            check_run_directory(out / r.dir, r.config)
        _write_json(out / SWEEP_FILE, document)
        return _run_planned(spec, out, runs, options, threads, retry_diverged, log)


def _run_planned(
    spec: SweepSpec,
    out: Path,
    runs: list[PlannedRun],
    options: ExecutorOptions,
    threads: int | None,
    retry_diverged: bool,
    log: Callable[[str], None],
) -> list[RunOutcome]:
    from driftlab.executors import Events, RunTask, TaskResult, execute

    outcomes: dict[str, RunOutcome] = {}
    todo: list[PlannedRun] = []
    for r in runs:
        status = run_status(out / r.dir, r.config.rounds)
        if status == "complete" or (status == "diverged" and not retry_diverged):
            outcomes[r.dir] = RunOutcome(r, status, _message(out / r.dir))
        else:
            todo.append(r)
    skipped = len(runs) - len(todo)
    if options.name == "local":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # the cores this process may use
        jobs = max(1, min(options.jobs or cores, max(len(todo), 1)))
        threads = threads or max(1, cores // jobs)
        options = dataclasses.replace(options, jobs=jobs)
        log(f"sweep {spec.name}: {len(runs)} runs, {skipped} already finished, {len(todo)} to run in {jobs} process(es) x {threads} thread(s)")
    else:
        threads = threads or (options.slurm_cpus if options.name == "slurm" else None) or 1
        log(f"sweep {spec.name}: {len(runs)} runs, {skipped} already finished, {len(todo)} to run as {options.name} jobs x {threads} thread(s)")

    by_key = {r.dir: r for r in todo}
    done = skipped
    submitted: dict[str, Any] = {}

    def started(task: RunTask, resume: bool, job: dict[str, Any]) -> None:
        if job.get("job_id"):
            submitted[task.key] = job
            _write_json(out / JOBS_FILE, {"executor": options.name, "runs": submitted})
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
        message = _elsewhere(directory.run_directory_holder(out / r.dir) or 0) if status == "running" else _message(out / r.dir)
        outcome = RunOutcome(r, status, message or result.job.get("error", "") or _exit_message(result.exit_code), result.seconds)
        outcomes[r.dir] = outcome
        log(f"  {status:<8s} {_name(r)}  [{done}/{len(runs)}, {_duration(outcome.seconds)}]" + (f"  {outcome.message}" if outcome.message else ""))

    def interrupted() -> None:
        log("sweep interrupted: stopping runs at their last completed round (checkpointed); run the same command again to resume")

    local = options.name == "local"
    tasks = [RunTask(r.dir, out / r.dir if local else (out / r.dir).absolute(), r.config.to_dict(), threads, _name(r), os.getcwd()) for r in todo]
    previous = _read_jobs(out)
    if previous and not local:
        submitted.update(previous.get("runs", {}))
    execute(tasks, options, Events(started, finished, interrupted))
    return [outcomes[r.dir] for r in runs if r.dir in outcomes]


def _read_jobs(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / JOBS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@contextlib.contextmanager
def _exclusive(out: Path):
    """One sweep process per directory: a second one would run the same runs into the same files."""
    import fcntl

    handle = open(out / ".sweep.lock", "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another `driftlab sweep` is running on {out}; wait for it to finish (or stop it) first") from None
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
        raise ConfigError(f"{stored} is not a valid run configuration ({error}); delete {run_dir} to run it again") from None
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
        raise ConfigError(f"{path} is not valid JSON ({error}); delete it to re-plan the sweep (run directories are kept)") from None
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


def in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ---------------------------------------------------------------- a run's process


def start_worker(
    run_dir: Path, config: dict[str, Any], resume: bool, threads: int, executor: dict[str, Any] | None = None, cwd: str | None = None
) -> subprocess.Popen:
    """A fresh interpreter per run: nothing of the caller's script is re-imported (as multiprocessing's spawn would),
    and it shares the terminal's process group, so Ctrl-C reaches it and it checkpoints.

    ``config`` is the resolved config table; ``executor`` (job id, log paths) goes into the run's run.json;
    ``cwd`` is where relative paths of the config (data.root) are read from: the sweep's working directory.
    """
    arguments = {"run_dir": str(run_dir), "config": config, "resume": resume, "threads": threads, "parent": os.getpid()}
    if executor:
        arguments["executor"] = executor
    arguments = json.dumps(arguments)
    return subprocess.Popen([sys.executable, "-c", "import sys; from driftlab.experiments.sweep.execution import worker_main; worker_main(sys.argv[1])", arguments], cwd=cwd)


# Exit codes of a run's process; a run killed by a signal shows as minus the signal's number.
EXIT_COMPLETE, EXIT_FAILED, EXIT_DIVERGED, EXIT_BUSY, EXIT_INTERRUPTED = 0, 1, 3, 4, 130


def _worker(run_dir: str, config_table: dict[str, Any], resume: bool, threads: int, run_info: dict[str, Any]) -> None:
    """Child process: one run; exits with EXIT_COMPLETE, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_BUSY (another process
    holds the run directory: nothing written) or EXIT_FAILED (see failure.txt)."""
    import torch

    from driftlab.experiments.runner import run

    torch.set_num_threads(threads)
    signal.signal(signal.SIGTERM, _stop_at_first_termination)
    out = Path(run_dir)
    try:
        # The plugins the config records are imported here: this is a fresh interpreter.
        run(config_from_record(config_table), out, resume=resume, run_info=run_info)
    except FloatingPointError:
        sys.exit(EXIT_DIVERGED)  # run.json holds the message
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except RunDirectoryBusy as error:
        print(f"driftlab: {error}", file=sys.stderr)
        sys.exit(EXIT_BUSY)  # the directory is another process's: write nothing into it
    except BaseException as error:  # noqa: BLE001 - any failure is recorded for the sweep and the user
        out.mkdir(parents=True, exist_ok=True)
        detail = str(error) if isinstance(error, ConfigError) else traceback.format_exc()
        (out / FAILURE_FILE).write_text(f"{type(error).__name__}: {error}\n\n{detail}")
        sys.exit(EXIT_FAILED)


def _stop_at_first_termination(signum, frame):  # noqa: ARG001
    """SIGTERM: stop the run (it checkpoints, then exits); later ones are ignored so they cannot cut the checkpoint short.

    A sweep killed outright sends several: the parent-death signal comes again as each of the
    sweep's threads in turn exits and the run is handed to the next.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"terminated by signal {signum}")


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Make this run's process stop (SIGTERM: checkpoint, then exit) when the sweep that started it dies.

    Without this, a sweep killed with SIGKILL leaves its runs going, and the next sweep on the directory
    would start a second writer on each. Linux delivers SIGTERM on the parent's death (prctl); elsewhere
    a daemon thread watches for this process being handed to another parent.
    """
    first_parent = os.getppid()  # `parent`, unless sys.executable is a wrapper that forks
    if not _ask_for_parent_death_signal():
        import threading

        def watch() -> None:
            while os.getppid() == first_parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="driftlab-parent-watch", daemon=True).start()
    if first_parent != parent and process_gone(parent):  # the sweep died before the request above took effect
        sys.exit(EXIT_INTERRUPTED)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting to be reaped has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return Path("/proc/self").exists()  # no /proc at all (macOS): os.kill said it lives
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _ask_for_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def worker_main(arguments: str) -> None:
    """Entry point of a run's interpreter (see ``start_worker``)."""
    parsed = json.loads(arguments)
    die_with_parent(parsed["parent"])
    if parsed.get("executor"):
        if parsed["executor"].get("executor") == "slurm" and hasattr(signal, "SIGUSR2"):
            # SLURM's pre-emption warning (submitit's USR2) may reach every process of the job, and would kill
            # this one outright; the job's own process handles it by stopping this run (SIGTERM: checkpoint, exit).
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    run_info = {"executor": parsed["executor"]} if parsed.get("executor") else {}
    _worker(parsed["run_dir"], parsed["config"], parsed["resume"], parsed["threads"], run_info)


__all__ = ["EXIT_BUSY", "EXIT_COMPLETE", "EXIT_DIVERGED", "EXIT_FAILED", "EXIT_INTERRUPTED", "RunOutcome", "die_with_parent", "process_gone", "run_sweep", "worker_main"]
