"""One run directory as a report reads it (``RunData``): its own module, so the labelling and the reading of
runs both name it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driftlab.experiments.run.run_directory import STOPPED_KEY, stopped_round


@dataclass
class RunData:
    """One run directory as the report reads it, and where the report puts it (setting, method, seed)."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    info: dict[str, Any] | None  # run.json; None for runs written before it existed
    setting: str = ""
    method: str = ""
    seed: int = 0
    torn_line: int | None = None  # 1-based line of metrics.jsonl dropped because a kill tore it
    sweep: str | None = None
    # Rounds done before the report cut this run to the shortest run it is compared with (None: not cut).
    truncated_from: int | None = None
    setting_dir: str | None = None  # the sweep's directory name for the setting: a safe, unique file name

    @property
    def rounds_done(self) -> int:
        """The last round the report uses (after a cut to the shortest compared run)."""
        return self.records[-1]["round"] if self.records else 0

    @property
    def rounds_planned(self) -> int:
        return int(self.config.get("rounds", self.rounds_done))

    @property
    def rounds_compared(self) -> int:
        """The rounds this run is compared over: its planned rounds, or the round it was cut to."""
        return self.rounds_done if self.truncated_from is not None else self.rounds_planned

    @property
    def status(self) -> str:
        """run.json's status; without run.json, complete when every planned round is in the metrics."""
        if self.info is not None and "status" in self.info:
            return str(self.info["status"])
        return "complete" if self.rounds_done >= self.rounds_planned else "unfinished"

    @property
    def stopped_at(self) -> int | None:
        """The round at which ``evaluation.stop_at`` ended the run (a finished run, its target met); None otherwise."""
        return stopped_round(self.info)

    @property
    def stop_reason(self) -> str:
        """Why ``evaluation.stop_at`` ended the run, as run.json says ("" when it did not)."""
        return str(((self.info or {}).get(STOPPED_KEY) or {}).get("reason", "")) if self.stopped_at is not None else ""

    @property
    def finished(self) -> bool:
        if self.truncated_from is not None:
            return True  # it ran every compared round and more
        if self.stopped_at is not None:
            return True  # its stop rule ended it: nothing is left to run
        return self.status in ("complete", "diverged", "failed") and not (
            self.status == "complete" and self.rounds_done < self.rounds_planned
        )

    @property
    def stopped_early(self) -> bool:
        """Whether the run ended before the rounds it is compared over (diverged, interrupted, failed, or ended by its
        ``evaluation.stop_at``: its last numbers are at an earlier round than the others')."""
        return self.truncated_from is None and not (
            self.status == "complete" and self.rounds_done >= self.rounds_planned
        )

    @property
    def num_parameters(self) -> int | None:
        value = (self.info or {}).get("num_parameters")
        return int(value) if value else None

    @property
    def diverged_at(self) -> int | None:
        """The round whose update made the server model non-finite (the runner records the rounds before it)."""
        return self.rounds_done + 1 if self.status == "diverged" and self.truncated_from is None else None

    @property
    def initial(self) -> dict[str, float]:
        """The initial model's evaluation (round 0: ``train_loss``, ``test_loss``, ``test_accuracy``) when run.json
        records it under ``"initial"``; empty otherwise (runs written before it was recorded)."""
        initial = (self.info or {}).get("initial")
        if not isinstance(initial, dict):
            return {}
        return {k: float(v) for k, v in initial.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    @property
    def instability(self) -> dict[str, Any] | None:
        """``{"round": R, "message": ...}`` when the runner flagged the run unstable (its loss stayed above the
        initial model's): from run.json, else from the first record holding the flag; None when not flagged."""
        flagged = (self.info or {}).get("instability")
        if isinstance(flagged, dict) and "round" in flagged:
            return {"round": int(flagged["round"]), "message": str(flagged.get("message", ""))}
        for record in self.records:
            if record.get("instability"):
                return {"round": int(record["round"]), "message": str(record["instability"])}
        return None

    @property
    def timed(self) -> bool:
        """Whether the run ran on a simulated clock (a ``[system]`` section): its records carry ``time_start`` and
        ``time_end`` in simulated seconds."""
        return isinstance(self.config.get("system"), dict) or any("time_end" in r for r in self.records)

    @property
    def asynchronous(self) -> bool:
        """Whether the run is asynchronous (FedBuff, an ``[asynchronous]`` section): its "rounds" are server updates,
        each folding the buffer's B client updates, not synchronous rounds."""
        return isinstance(self.config.get("asynchronous"), dict) or any("mean_staleness" in r for r in self.records)

    @property
    def simulated_time(self) -> float | None:
        """The simulated seconds at the end of the last round the report uses (None: untimed, or no timed record)."""
        end = next((r["time_end"] for r in reversed(self.records) if isinstance(r.get("time_end"), (int, float))), None)
        return None if end is None else float(end)

    @property
    def is_classifier(self) -> bool:
        return any("test_accuracy" in r for r in self.records)

    @property
    def machine(self) -> str:
        """The processor and torch threads run.json records ("unknown" without them)."""
        machine = (self.info or {}).get("machine") or {}
        if not machine:
            return "unknown"
        threads = machine.get("torch_threads")
        return (
            f"{machine.get('processor', 'unknown')}, {threads} threads"
            if threads
            else str(machine.get("processor", "unknown"))
        )
