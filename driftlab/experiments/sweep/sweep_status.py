"""``driftlab sweep --status DIR``: where each run of a sweep stands, read from its directory alone.

Reads only ``sweep.json``, the sweep's ``jobs.json`` and each run directory (run.json,
failure.txt, the lock a live writer holds), so it tells the same for runs started by any
executor, from any machine that sees the directory. States: done, running, queued
(nothing written yet, possibly submitted), interrupted (resumes on the next sweep),
failed (with the error's last lines), diverged, stopped (by successive halving, at the round
its ``halving.json`` names; the sweep run again without halving extends it). A run that its own
``evaluation.stop_at`` ended is done, its stop round and reason shown under it. Imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from driftlab.errors import ConfigError
from driftlab.experiments.run.run_directory import STOPPED_KEY, read_run_info, stopped_round
from driftlab.experiments.sweep.directory import (
    FAILURE_FILE,
    HALVING_FILE,
    JOBS_FILE,
    SWEEP_FILE,
    run_directory_holder,
    run_status,
)

State = Literal["done", "running", "queued", "interrupted", "failed", "diverged", "stopped"]
STATES: tuple[State, ...] = ("done", "running", "queued", "interrupted", "failed", "diverged", "stopped")
ERROR_LINES = 3  # of a failed run's error shown under it


@dataclass(frozen=True)
class RunState:
    dir: str
    state: State
    rounds_done: int = 0
    rounds: int | None = None
    job_id: str = ""  # the executor's job or task id, when one ran or was submitted
    # the error's last lines (failed, diverged), who holds the directory (running), why halving stopped it, or why
    # its stop rule ended it (done)
    detail: str = ""


def sweep_status(out_dir: str | Path) -> list[RunState]:
    """Each planned run's state, in the order of ``sweep.json``."""
    out = Path(out_dir)
    document_path = out / SWEEP_FILE
    try:
        document = json.loads(document_path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{out} holds no {SWEEP_FILE}, so it is not a sweep directory; give the --out DIR of a `driftlab sweep`"
        ) from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {document_path} ({error}); it is not the plan of a sweep") from None
    try:
        submitted = json.loads((out / JOBS_FILE).read_text()).get("runs", {})
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        submitted = {}
    planned_rounds = document.get("rounds") or []
    return [
        _state(out, run["dir"], planned_rounds[0] if len(planned_rounds) == 1 else None, submitted.get(run["dir"], {}))
        for run in document.get("runs", [])
    ]


def _state(out: Path, name: str, rounds: int | None, submitted: dict) -> RunState:
    run_dir = out / name
    info = read_run_info(run_dir) or {}
    rounds = rounds or info.get("rounds")
    done = int(info.get("rounds_done", 0))
    job_id = str((info.get("executor") or {}).get("job_id", "") or submitted.get("job_id", ""))
    holder = run_directory_holder(run_dir)
    if holder is not None:
        who = f"pid {holder}" if holder else "another process"
        return RunState(name, "running", done, rounds, job_id, f"{who} holds its directory")
    ended = stopped_round(info)
    if ended is not None and not (run_dir / FAILURE_FILE).exists():
        # finished by evaluation.stop_at, before its planned rounds
        reason = info[STOPPED_KEY].get("reason") or f"round {ended}"
        return RunState(name, "done", done, rounds, job_id, f"ended by evaluation.stop_at: {reason}")
    status = run_status(run_dir, rounds) if rounds is not None else "pending"
    if status == "pending":
        return RunState(name, "queued", 0, rounds, str(submitted.get("job_id", "")))
    if status == "failed":
        return RunState(name, "failed", done, rounds, job_id, _error_tail(run_dir, info))
    if status == "diverged":
        return RunState(name, "diverged", done, rounds, job_id, str(info.get("message", "")))
    if status == "stopped":
        return RunState(name, "stopped", done, rounds, job_id, _halving_message(run_dir, done))
    return RunState(name, "done" if status == "complete" else "interrupted", done, rounds, job_id)


def _halving_message(run_dir: Path, done: int) -> str:
    try:
        message = json.loads((run_dir / HALVING_FILE).read_text()).get("message")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        message = None
    return str(message) if message else f"stopped by halving at round {done}"


def _error_tail(run_dir: Path, info: dict) -> str:
    failure = run_dir / FAILURE_FILE
    try:
        text = failure.read_text(errors="replace")
    except OSError:
        text = str(info.get("message", ""))
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-ERROR_LINES:])


def format_status(states: list[RunState]) -> str:
    """One line per run (state, directory, rounds, job id), a failed run's error indented under it, then the counts."""
    lines = []
    for s in states:
        rounds = f"{s.rounds_done}/{s.rounds} rounds" if s.rounds else f"{s.rounds_done} rounds"
        job = f"  job {s.job_id}" if s.job_id else ""
        holder = f"  ({s.detail})" if s.state == "running" and s.detail else ""
        lines.append(f"{s.state:<12s} {s.dir}  {rounds}{job}{holder}")
        if s.state in ("failed", "diverged", "stopped", "done") and s.detail:
            lines.extend(f"    {line}" for line in s.detail.splitlines())
    counts = {state: sum(1 for s in states if s.state == state) for state in STATES}
    lines.append(f"{len(states)} runs: " + ", ".join(f"{n} {state}" for state, n in counts.items() if n))
    return "\n".join(lines)


__all__ = ["STATES", "RunState", "format_status", "sweep_status"]
