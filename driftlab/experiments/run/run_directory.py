"""A run's output directory: its file names, claiming and locking it, and reading and writing its files.

An output directory holds::

    config.json               the resolved configuration (every key, defaults included)
    metrics.jsonl             one JSON object per round, strict JSON (pandas: ``pd.read_json(path, lines=True)``)
    metrics.csv               the same records as a table: one column per key (first-seen order), one row per
                              round, empty where a round lacks a key, lists JSON-encoded; rewritten from the
                              run's records at every checkpoint and when the run ends or stops (after
                              a kill it may trail metrics.jsonl until the next checkpoint)
    checkpoint.safetensors    the last checkpoint (atomic, no pickle); a completed run removes it unless keep_checkpoint
    client_state/             with the disk client-state store: its files, which the checkpoint refers to (removed with it)
    final_model.safetensors   the final server model, written when the run completes
    run.json                  status (running, complete, interrupted, diverged, failed), rounds done,
                              wall time summed over resumes, parameter count, machine and versions,
                              "instability": {"round", "message"} when the run was flagged unstable, and
                              "stopped": {"round", "met_at", "metric", "reason", "rule"} when evaluation.stop_at
                              ended it (status complete, rounds done below rounds: finished all the same)
    .lock                     flock'ed by the process writing the directory (holds its PID)
    tensorboard/ mlruns/ wandb/   with ``log = [...]``: the trackers' files (driftlab.experiments.run.trackers)

A run writes only into a new or empty directory, or into a run of its own
configuration (with ``resume``); one process at a time (RunDirectoryBusy).

Importing this module imports no torch, so reports and sweep status read run
directories cheaply.  Reading a stored configuration (``read_run_config``,
``check_run_directory``) imports the config module, and with it the algorithm
registry; writing files uses the checkpoint module's atomic write.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from driftlab.errors import ConfigError
from driftlab.run_files import LOCK_FILE, RUN_INFO_FILE, RunDirectoryBusy, read_run_info

if TYPE_CHECKING:
    from driftlab.experiments.config import ExperimentConfig

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
METRICS_CSV_FILE = "metrics.csv"
CHECKPOINT_FILE = "checkpoint.safetensors"
CLIENT_STATE_DIR = "client_state"  # the disk client-state store's files (state.store), which checkpoints refer to
FINAL_MODEL_FILE = "final_model.safetensors"
FINAL_STATE_DICT_FILE = "final_state_dict.safetensors"  # the final model under the module's state_dict names (loading)
RUN_FILES = (
    CONFIG_FILE,
    METRICS_FILE,
    METRICS_CSV_FILE,
    CHECKPOINT_FILE,
    FINAL_MODEL_FILE,
    FINAL_STATE_DICT_FILE,
    RUN_INFO_FILE,
)
# What write_atomically leaves of a write a kill interrupted: `.NAME.tmp-PID`.
_INTERRUPTED_WRITE = re.compile(r"^\.(" + "|".join(re.escape(name) for name in RUN_FILES) + r")\.tmp-\d+$")
_MAX_CONFIG_BYTES = 1 << 20  # a resolved config is a few KB
STOPPED_KEY = "stopped"  # run.json's entry of a run that evaluation.stop_at ended (driftlab.experiments.run.stopping)


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``driftlab.simulation.state.checkpoint.write_atomically``, imported when first needed (it imports torch)."""
    from driftlab.simulation.state.checkpoint import write_atomically as write_file

    write_file(path, write)


def output_directory(out_dir: str | Path) -> Path:
    """``out_dir`` as a directory path; a ConfigError, before any work, for a path that cannot be one."""
    if not str(out_dir).strip():
        raise ConfigError("the output directory (--out) is empty; give a directory such as runs/NAME")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        kind = "a file" if out.is_file() else "not a directory (a device or another special file)"
        raise ConfigError(
            f"--out {out} is {kind}; give a directory: a new or empty one, or a run's directory with --resume"
        )
    return out


def claim_run_directory(out: Path, config: ExperimentConfig, resume: bool) -> Any:
    """Check ``out``, create and lock it, clear interrupted writes and, for a new run, write config.json first.

    Returns the open lock file; closing it releases the lock.  config.json comes before
    any data loading, so a run killed at any later moment resumes with the documented
    ``driftlab run DIR/config.json --out DIR --resume``.
    """
    check_run_directory(out, config, resume)  # before creating or writing anything
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"cannot create the output directory {out}: {error.strerror or error}; choose another --out directory"
        ) from None
    lock = lock_run_directory(out)
    try:
        check_run_directory(out, config, resume)  # again: another process may have written it before we held the lock
        remove_interrupted_writes(out)
        if not resume:
            write_config(out, config)
    except BaseException:
        lock.close()
        raise
    return lock


@dataclass(frozen=True)
class DirectoryBefore:
    """What a run's output directory was before the run claimed it: which folders of its path the run will
    create, and whether it was empty and had a lock file.  ``remove_refused_run`` undoes exactly the run's part."""

    missing: tuple[Path, ...]  # the folders of ``out``'s path that did not exist, deepest first
    empty: bool  # it held nothing visible (``visible_entries``): whatever is there later is the run's
    had_lock: bool

    @classmethod
    def of(cls, out: Path) -> "DirectoryBefore":
        missing = []
        folder = out
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        return cls(tuple(missing), not visible_entries(out), (out / LOCK_FILE).exists())


def remove_refused_run(out: Path, before: DirectoryBefore) -> None:
    """Remove what a run refused before its first round wrote into ``out`` (its config.json, run.json, lock file,
    client-state folder), with its lock held; nothing of an earlier run is ever removed.

    Only a folder the run created or found empty is cleaned: everything visible in it is the run's.  Folders the
    run created are removed when empty; a lock file that was there before stays (another process may hold it open).
    Best effort: a file that cannot be removed is left, never an error hiding the refusal.
    """
    import shutil

    if not before.empty:
        return
    try:
        for name in visible_entries(out):
            entry = out / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if not before.had_lock:
            (out / LOCK_FILE).unlink(missing_ok=True)
        for folder in before.missing:  # deepest first; a folder someone else wrote into meanwhile is not empty: kept
            folder.rmdir()
    except (OSError, ConfigError):
        pass


def lock_run_directory(out: Path) -> Any:
    """An exclusive ``flock`` on ``out/.lock`` (which records our PID), or RunDirectoryBusy.

    The lock file is never deleted while a run may follow in the folder: a process still
    waiting on a deleted inode would believe it holds the lock while a third one locks the
    new file (``remove_refused_run`` deletes the one a refused run created, with its folder).
    """
    import fcntl  # POSIX only; imported here so that importing driftlab works everywhere

    path = out / LOCK_FILE
    try:
        handle = open(path, "a+")
    except OSError as error:
        raise ConfigError(
            f"cannot write in the output directory {out}: {error.strerror or error}; choose another --out directory"
        ) from None
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
        raise ConfigError(
            f"cannot lock the output directory {out} ({error.strerror or error}); choose an --out directory on a local disk"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def remove_interrupted_writes(out: Path) -> None:
    """Delete the ``.NAME.tmp-PID`` files of writes a kill interrupted; called with the lock held, so no live writer owns one."""
    for entry in out.iterdir():
        if _INTERRUPTED_WRITE.match(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)


def visible_entries(out: Path) -> list[str]:
    """What ``out`` holds besides our lock and interrupted writes; [] when it does not exist."""
    try:
        if not out.is_dir():
            return []
        return sorted(e.name for e in out.iterdir() if e.name != LOCK_FILE and not _INTERRUPTED_WRITE.match(e.name))
    except OSError as error:
        raise ConfigError(f"cannot read the output directory {out}: {error.strerror or error}") from None


def check_run_directory(out: Path, config: ExperimentConfig, resume: bool) -> None:
    """Refuse a folder this run may not write into, reading it only.

    A new run goes into a new or empty folder, or one a driftlab run left before recording
    any round (only its config.json, beside its lock file); ``resume`` needs a run of the same configuration there.
    Nothing else is ever written into: the folder may be the user's.
    """
    names = visible_entries(out)
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
            stored, complete = read_run_config(stored_path)
        except ConfigError:
            if resume:
                raise
    if not resume:
        if has_results:
            raise ConfigError(
                f"{out} already holds a run; pass --resume to continue it, or choose another --out directory"
            )
        if complete and (out / LOCK_FILE).exists():
            # A run stopped before recording any round (it locks the folder before writing config.json): nothing to
            # lose. A config.json without the lock is the user's, say `driftlab config X > DIR/config.json`: kept.
            return
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ConfigError(
            f"{out} is not empty and holds no driftlab run ({shown}); driftlab writes only into a new or empty "
            "directory or its own run's: choose another --out directory"
        )
    if not has_results and not complete:
        what = (
            f"{stored_path} was not written by a driftlab run"
            if stored is not None
            else "no config.json, metrics.jsonl or checkpoint"
        )
        raise ConfigError(
            f"nothing to resume in {out}: it holds no driftlab run ({what}); run without --resume into a new or empty directory"
        )
    if stored is not None and getattr(stored.data, "digest", None) != getattr(config.data, "digest", None):

        def described(digest: str | None) -> str:
            return f"data with digest {digest[:12]}..." if digest else "the config's own data set"

        raise ConfigError(
            f"cannot resume: the run in {out} was started on {described(getattr(stored.data, 'digest', None))} (data.digest in {stored_path}), "
            f"but this run was given {described(getattr(config.data, 'digest', None))}; resume with the data the run started with "
            "(the same data= or data.loader), or start a new run with a new --out directory"
        )
    if stored is not None and stored.fingerprint() != config.fingerprint():
        raise ConfigError(
            f"cannot resume: the configuration differs from the one in {stored_path} in more than rounds/device/checkpoint_every/log/state/memory_budget; "
            f"resume with `driftlab run {stored_path} --out {out} --resume`"
        )


def read_run_config(path: Path) -> tuple[ExperimentConfig, bool]:
    """The configuration stored in a run's config.json, and whether it is complete (every key, as a run writes it)."""
    from driftlab.experiments.config import config_from_record

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


def write_config(out: Path, config: ExperimentConfig) -> None:
    write_atomically(out / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(config.to_dict(), indent=2) + "\n"))


def read_records(path: Path, up_to_round: int) -> list[dict[str, Any]]:
    """The records of rounds 1..``up_to_round`` (the checkpoint's) in ``path``, every line checked.

    Only a last line that is not JSON may be dropped: a kill mid-append tears it.  Any
    other damage, or a missing round the checkpoint covers, is an error: resuming would
    silently lose recorded rounds.  Records after ``up_to_round`` are dropped (recomputed).
    """
    fix = f"restore {path.name} from a backup, or start the run again with a new --out directory"
    if not path.exists():
        if up_to_round == 0:
            return []
        raise ConfigError(
            f"cannot resume: {path} is missing, but the checkpoint beside it is at round {up_to_round}; {fix}"
        )
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
            raise ConfigError(
                f"cannot resume: {path} line {number} is not JSON, and only a last line torn by a kill may be; {fix}"
            ) from None
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


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace metrics.jsonl by ``records`` (a resume drops the rounds it recomputes)."""
    write_atomically(path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in records)))


def append_record(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        # allow_nan=False: the engine never returns a non-finite number, and metrics.jsonl stays strict JSON
        handle.write(json.dumps(record, allow_nan=False) + "\n")
        handle.flush()


def write_metrics_csv(out: Path, records: list[dict[str, Any]]) -> None:
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


@dataclass
class RunInfo:
    """``run.json``: what a report needs besides the metrics (status, parameter count, wall time, machine).

    Wall time accumulates over resumes, so an interrupted-and-resumed run reports
    the compute it really took.
    """

    path: Path
    content: dict[str, Any]
    started: float
    previous_seconds: float

    @classmethod
    def start(cls, out: Path, rounds: int, start_round: int, num_parameters: int, entries: dict[str, Any]) -> "RunInfo":
        """Write ``run.json`` as "running" at ``start_round`` of ``rounds``, with ``entries`` (machine, versions, ...)."""
        path = out / RUN_INFO_FILE
        previous = read_run_info(out) if start_round > 0 else None
        if not isinstance(previous, dict):
            previous = {}  # informational only; a damaged file must not stop a resume
        content = {
            "format": 1,
            "status": "running",
            "rounds": rounds,
            "rounds_done": start_round,
            "num_parameters": num_parameters,
            "wall_seconds": float(previous.get("wall_seconds", 0.0)) if start_round > 0 else 0.0,
            "resumed_from_round": start_round if start_round > 0 else None,
        }
        content.update(entries)
        info = cls(path, content, time.perf_counter(), content["wall_seconds"])
        info.update("running", start_round)
        return info

    def update(self, status: str, rounds_done: int, message: str | None = None) -> None:
        self.content.update(
            status=status,
            rounds_done=rounds_done,
            wall_seconds=self.previous_seconds + time.perf_counter() - self.started,
        )
        if message is not None:
            self.content["message"] = message
        else:
            self.content.pop("message", None)
        text = json.dumps(self.content, indent=2) + "\n"
        write_atomically(self.path, lambda tmp: tmp.write_text(text))


def stopped_round(info: dict[str, Any] | None) -> int | None:
    """The round at which ``evaluation.stop_at`` ended the run whose run.json is ``info``: a finished run, whatever its
    planned rounds (None: not ended by a stop rule)."""
    stopped = (info or {}).get(STOPPED_KEY)
    if not isinstance(stopped, dict) or (info or {}).get("status") != "complete":
        return None
    ended = stopped.get("round")
    return (
        ended if isinstance(ended, int) and not isinstance(ended, bool) and ended == info.get("rounds_done") else None
    )


def finished(info: dict[str, Any] | None, rounds: int) -> bool:
    """Whether the run whose run.json is ``info`` needs no more rounds for ``rounds``: complete with them all done, or
    ended by its stop rule (a resume finds it finished)."""
    if not isinstance(info, dict) or info.get("status") != "complete":
        return False
    return info.get("rounds_done") == rounds or stopped_round(info) is not None


def processor_name() -> str:
    return cpu_info("model name") or platform.processor() or "unknown"


def cpu_info(field: str) -> str | None:
    """The first ``field`` of ``/proc/cpuinfo`` (``model name``, ``vendor_id``), or None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


__all__ = [
    "CHECKPOINT_FILE",
    "CLIENT_STATE_DIR",
    "CONFIG_FILE",
    "FINAL_MODEL_FILE",
    "FINAL_STATE_DICT_FILE",
    "LOCK_FILE",
    "METRICS_CSV_FILE",
    "METRICS_FILE",
    "RUN_FILES",
    "RUN_INFO_FILE",
    "STOPPED_KEY",
    "RunDirectoryBusy",
    "DirectoryBefore",
    "RunInfo",
    "append_record",
    "check_run_directory",
    "cpu_info",
    "claim_run_directory",
    "lock_run_directory",
    "output_directory",
    "read_records",
    "read_run_config",
    "read_run_info",
    "remove_refused_run",
    "stopped_round",
    "finished",
    "write_config",
    "write_metrics_csv",
    "write_records",
]
