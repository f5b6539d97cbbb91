"""Reading run and sweep directories: what the report compares, grouped by setting, method and seed.

A run directory holds ``config.json``, ``metrics.jsonl`` and (since it exists)
``run.json``; a sweep directory ``sweep.json``, whose labels the sweep's runs keep.
A metrics file torn by a kill mid-write is read up to its torn last line. Runs
outside a sweep are labelled from their configs (``labels``); those of one
setting with different ``rounds`` are cut to the shortest one's last round.
Imports no torch and never a run's plugins: a report reads records (config.json as data), not code.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from driftlab.errors import ConfigError
from driftlab.experiments.report.labels import (
    algorithm_label,
    asynchronous_label,
    flatten_config,
    label_standalone,
    method_order,
    recorded_labels,
)
from driftlab.experiments.report.run_data import RunData
from driftlab.experiments.run.run_directory import CONFIG_FILE, METRICS_FILE, RUN_INFO_FILE
from driftlab.experiments.sweep.directory import SWEEP_FILE

REQUIRED_RECORD_KEYS = ("round", "num_selected", "local_steps", "upload_bits", "download_bits")


@dataclass(frozen=True)
class PendingRun:
    """A run a sweep planned that has no metrics yet."""

    path: Path
    setting: str
    method: str
    seed: int


@dataclass
class Setting:
    label: str
    methods: dict[str, list[RunData]]  # method label -> its runs (seeds), in report order
    pending: list[PendingRun] = field(default_factory=list)
    cut_round: int | None = None  # stand-alone runs of different lengths are compared up to this round
    # Stand-alone asynchronous runs are cut among themselves, to this server update: an update is no round.
    cut_update: int | None = None

    @property
    def runs(self) -> list[RunData]:
        return [run for runs in self.methods.values() for run in runs]

    @property
    def is_classifier(self) -> bool:
        return any(run.is_classifier for run in self.runs)


# ---------------------------------------------------------------- reading


def read_json_file(path: Path) -> Any:
    """A JSON file's content; a ConfigError naming the file and line when it is unreadable or malformed."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); "
            "repair or delete the file (a run directory's files are rewritten by `driftlab run ... --resume`)"
        ) from None


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int | None]:
    """The per-round records of ``metrics.jsonl`` and the line of a torn last record (None if intact).

    A run killed mid-write leaves a partial last line; the rounds before it are
    sound (the runner appends a round only once it is complete), so the report
    reads up to it. A malformed line anywhere else means a damaged file.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}") from None
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    records, torn = [], None
    for position, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if position == len(numbered) - 1:
                torn = number
                break
            raise ConfigError(
                f"{path} line {number} is not valid JSON ({error.msg}, column {error.colno}); only a torn last line "
                "is skipped, so the file was damaged after it was written (a resume refuses it too): restore "
                f"{path.name} from a backup, or run again with a new --out directory"
            ) from None
        missing = [key for key in REQUIRED_RECORD_KEYS if not isinstance(record, dict) or key not in record]
        if missing:
            raise ConfigError(f"{path} line {number} lacks {', '.join(missing)}; is this a driftlab metrics file?")
        records.append(record)
    return records, torn


def read_run(path: Path) -> RunData:
    """A run directory's config, metrics and (when present) run.json."""
    config = read_json_file(path / CONFIG_FILE)
    algorithm = config.get("algorithm") if isinstance(config, dict) else None
    if not isinstance(algorithm, dict) or "name" not in algorithm:
        raise ConfigError(f"{path / CONFIG_FILE} has no algorithm.name; is this a driftlab run directory?")
    # The run's ``plugins`` are never imported: reading a results folder must not run code it holds.
    # A plugin's algorithm is labelled as run.json records it, else by its name in config.json (see ``labels``).
    records, torn = read_metrics(path / METRICS_FILE)
    info_path = path / RUN_INFO_FILE
    info = read_json_file(info_path) if info_path.exists() else None
    return RunData(
        path=path, config=config, records=records, info=info, seed=int(config.get("seed", 0)), torn_line=torn
    )


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / METRICS_FILE).is_file()


def find_sources(root: Path) -> tuple[list[Path], list[Path]]:
    """Sweep directories and stand-alone run directories at or beneath ``root`` (a sweep's runs belong to it)."""
    if (root / SWEEP_FILE).is_file():
        return [root], []
    if is_run_dir(root):
        return [], [root]
    sweeps, runs = [], []
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        child_sweeps, child_runs = find_sources(child)
        sweeps += child_sweeps
        runs += child_runs
    return sweeps, runs


def _setting_dir(entry: dict[str, Any]) -> str | None:
    """The setting's part of a sweep run's directory, ``runs/<setting>/<method>/seed-<s>`` (None without setting axes)."""
    parts = str(entry["dir"]).split("/")
    # a tuned run (``tuned`` in its entry) has one more part: runs/<setting>/<method>/<tuned value>/seed-<s>
    return (
        parts[1]
        if entry.get("setting") and len(parts) == (5 if entry.get("tuned") else 4) and parts[0] == "runs"
        else None
    )


def read_sweep(path: Path) -> tuple[dict[str, Any], list[RunData], list[PendingRun]]:
    """A sweep's document, its runs labelled by setting/method/seed as sweep.json says, and the planned runs not started."""
    sweep_file = path / SWEEP_FILE
    document = read_json_file(sweep_file)
    if not isinstance(document, dict) or not isinstance(document.get("runs"), list):
        raise ConfigError(f"{sweep_file} has no list of runs; is this a sweep directory written by `driftlab sweep`?")
    if document.get("format", 1) != 1:
        raise ConfigError(
            f"{sweep_file} has format {document.get('format')!r}; this driftlab reads format 1 (upgrade driftlab)"
        )
    name = str(document.get("name") or path.name)
    runs, pending = [], []
    for index, entry in enumerate(document["runs"]):
        if not isinstance(entry, dict) or "dir" not in entry:
            raise ConfigError(f"{sweep_file}: runs[{index}] has no 'dir'")
        # A sweep without setting axes compares its methods in one setting named after the sweep.
        setting = str(entry.get("setting") or name)
        run_dir = path / entry["dir"]
        if not is_run_dir(run_dir):
            pending.append(PendingRun(run_dir, setting, str(entry.get("method", "")), int(entry.get("seed", 0))))
            continue
        run = read_run(run_dir)
        fallback = algorithm_label(flatten_config(run.config), recorded_labels([run]))
        fallback = asynchronous_label(fallback) if run.asynchronous else fallback
        run.setting, run.method, run.sweep = setting, str(entry.get("method") or fallback), name
        run.seed = int(entry.get("seed", run.seed))
        run.setting_dir = _setting_dir(entry)
        runs.append(run)
    return document, runs, pending


def cut_to_shortest(runs: Sequence[RunData]) -> int | None:
    """Cut runs of different lengths to the shortest one's planned rounds; the round they were cut to, or None.

    Final accuracy at round 50 against final accuracy at round 100 compares
    lengths, not methods. A cut run keeps its records up to that round and says
    how far it really got (``truncated_from``).
    """
    if len({run.rounds_planned for run in runs}) < 2:
        return None
    cut = min(run.rounds_planned for run in runs)
    for run in runs:
        if run.rounds_done > cut:
            run.truncated_from = run.rounds_done
            run.records = [record for record in run.records if record["round"] <= cut]
    return cut


# ---------------------------------------------------------------- discovery


def collect(inputs: Sequence[str | Path]) -> tuple[list[Setting], list[dict[str, Any]]]:
    """The settings (with methods and seeds in report order) of every run under ``inputs``, and the sweep documents."""
    if not inputs:
        raise ConfigError("no inputs: pass run directories, sweep directories or folders that hold them")
    sweep_dirs, run_dirs = [], []
    for raw in inputs:
        path = Path(raw).expanduser()
        if path.is_file() and path.name in (CONFIG_FILE, METRICS_FILE, RUN_INFO_FILE, SWEEP_FILE):
            path = path.parent  # a run's or sweep's own file stands for its directory
        if not path.exists():
            raise ConfigError(
                f"{raw}: no such directory; pass a run directory, a sweep directory or a folder that holds them"
            )
        if not path.is_dir():
            raise ConfigError(f"{raw} is a file; pass the run or sweep directory (or a folder holding run directories)")
        found_sweeps, found_runs = find_sources(path)
        if not found_sweeps and not found_runs:
            raise ConfigError(
                f"{raw} is not a run directory (config.json + metrics.jsonl), not a sweep directory (sweep.json), "
                "and holds none beneath it; point at the --out directory of `driftlab run`, `driftlab sweep` or `driftlab demo`"
            )
        sweep_dirs += found_sweeps
        run_dirs += found_runs

    documents, seen = [], set()
    labelled: list[RunData] = []
    pending: list[PendingRun] = []
    for sweep_dir in _unique(sweep_dirs):
        document, runs, planned = read_sweep(sweep_dir)
        documents.append(document)
        for run in runs:
            if run.path.resolve() not in seen:  # two inputs can reach the same run
                seen.add(run.path.resolve())
                labelled.append(run)
        pending += planned
    # Runs picked out of a sweep (its runs/iid folder, say) keep the sweep's labels rather than raw config keys.
    loose = [path for path in _unique(run_dirs) if path.resolve() not in seen]
    for sweep_dir in _unique(filter(None, (_enclosing_sweep(path) for path in loose))):
        wanted = {path.resolve() for path in loose}
        try:
            document, runs, _ = read_sweep(sweep_dir)
        except ConfigError:
            continue  # a damaged sweep.json above them: label them as stand-alone runs
        picked = [run for run in runs if run.path.resolve() in wanted and run.path.resolve() not in seen]
        if picked:
            documents.append(document)
            seen.update(run.path.resolve() for run in picked)
            labelled += picked
    standalone = [read_run(path) for path in loose if path.resolve() not in seen]
    label_standalone(standalone)
    # Settings in the order their first run was found; methods in the papers' order within them.
    setting_order = {label: index for index, label in reversed(list(enumerate(run.setting for run in standalone)))}
    standalone.sort(key=lambda run: (setting_order[run.setting], method_order(run)))
    if not labelled and not standalone:
        planned = f" ({len(pending)} planned runs have not started: run the sweep first)" if pending else ""
        raise ConfigError(f"no runs found under {', '.join(map(str, inputs))}{planned}")

    settings: dict[str, Setting] = {}
    for run in [*labelled, *standalone]:
        setting = settings.setdefault(run.setting, Setting(run.setting, {}))
        setting.methods.setdefault(run.method, []).append(run)
    for planned_run in pending:
        settings.setdefault(planned_run.setting, Setting(planned_run.setting, {})).pending.append(planned_run)
    for setting in settings.values():
        for method, runs in setting.methods.items():
            runs.sort(key=lambda run: run.seed)
            for first, second in itertools.pairwise(runs):
                if first.seed == second.seed:
                    # Averaging them would pass off two different runs (say, two scales of one sweep) as seeds.
                    where = f" in setting {setting.label!r}" if setting.label else ""
                    raise ConfigError(
                        f"{first.path} and {second.path} are both seed {first.seed} of {method!r}{where} "
                        "(two sweeps with the same labels, or one run copied twice); report them separately"
                    )
        # A sweep plans its runs' lengths (some give each method its own); stand-alone runs are compared like with like,
        # and an asynchronous run's server updates are not rounds: FedBuff's 200 updates are not cut to FedAvg's 50 rounds.
        standalone_runs = [run for run in setting.runs if run.sweep is None]
        setting.cut_round = cut_to_shortest([run for run in standalone_runs if not run.asynchronous])
        setting.cut_update = cut_to_shortest([run for run in standalone_runs if run.asynchronous])
    return [s for s in settings.values() if s.methods], documents


def _enclosing_sweep(run_dir: Path) -> Path | None:
    """The sweep directory above ``run_dir``, if any (its sweep.json may or may not list the run)."""
    for parent in run_dir.resolve().parents:
        if (parent / SWEEP_FILE).is_file():
            return parent
    return None


def _unique(paths: Iterable[Path]) -> list[Path]:
    seen, unique = set(), []
    for path in paths:
        if path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append(path)
    return unique
