"""Reports over finished (or unfinished) runs: the tables and figures the papers use to compare methods.

``make_report(inputs, out_dir)`` reads run directories (``config.json`` +
``metrics.jsonl`` [+ ``run.json``]), sweep directories (``sweep.json``) or any
folder holding them, and writes into ``out_dir``::

    report.md       per setting: communication to reach each target, accuracy, local SGD steps, run info, plots
    targets.csv     rounds, model-equivalents and bits to each target (one row per setting, target, method)
    savings.csv     the savings ratios of the communication tables (one row per method and baseline)
    accuracy.csv    final and best test accuracy and BMTA (or train loss and distance) as mean and std over seeds
    steps.csv       total local SGD steps, steps to each target, and their fraction of the reference method
    runs.csv        one row per run: directory, seed, status, rounds done, wall time, machine, round it was cut to
    <setting>-*.png the figures (<setting>: the sweep's directory name for the setting, else its label's slug)

What is measured, and where it comes from:

- Rounds and communication to reach a target test accuracy (FedDyn, Acar et al.
  2021, Tables 1 and 2): the first *evaluated* round with ``test_accuracy >=
  target``; communication in model-equivalents relative to one FedAvg round,
  ``Σ_{t ≤ hit} upload_bits_t / (32 · P · |S_t|)`` (P parameters, |S_t| selected
  clients), so a SCAFFOLD round counts 2 and a compressed upload a fraction; and
  the exact bits up and down. A method that never reaches the target gets a
  "N+" entry (N rounds run) and ratios against it are bounds.
- Final and best test accuracy as mean ± sample standard deviation over seeds
  (AdaBest Table 2), and EFL's BMTA, the best over rounds of the mean local
  test accuracy of the clients.
- Total local SGD steps and the steps spent to reach a target, as a fraction of
  a reference method (the decaying-K paper's Table 1).
- ``‖h‖`` and ``‖θ‖`` per round (AdaBest Figure 1) and FedProx's dissimilarity
  ``B(θ)²`` and gradient variance (Li et al. 2020, Definition 2, Figure 4).

Curves are means over seeds with a band of ± one sample standard deviation, the
± of the tables; each caption names what its figure draws. Rows, legends and
file names use a sweep's own labels. Stand-alone runs of one setting with
different ``rounds`` are compared up to the shortest one's last round (a note
names the runs cut); a sweep's runs keep the lengths the sweep planned.

Example:
    >>> from driftlab.experiments.report import make_report
    >>> report = make_report(["driftlab-demo"], "driftlab-demo/report", targets=[0.6])  # doctest: +SKIP
    >>> print(report.markdown)                                                          # doctest: +SKIP
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from driftlab.algorithms import registry
from driftlab.experiments.config import ConfigError, with_plugins_loaded
from driftlab.experiments.runner import CONFIG_FILE, METRICS_FILE, RUN_INFO_FILE
from driftlab.experiments.sweep import SWEEP_FILE, slug
from driftlab.metrics.summary import cumulative_bits_through, first_round_reaching, model_equivalents_through

# FedAvg with another server optimizer is a method of its own in the literature (Reddi et al. 2020, FedOpt).
SERVER_OPTIMIZER_LABELS = {"momentum": "FedAvgM", "adam": "FedAdam", "adagrad": "FedAdagrad", "yogi": "FedYogi"}
# Config keys that do not change what a run computes, or only how long it runs: runs differing only
# in these (and the seed) are seeds of one method.
IGNORED_KEYS = ("seed", "rounds", "device", "checkpoint_every", "backend", "evaluation.target_accuracy", "log", "plugins")
# Sections that define the problem rather than the method. The model is included: the same
# algorithm on another network is another setting, not another row of the same table.
SETTING_SECTIONS = ("data", "model", "sampling", "availability")
REQUIRED_RECORD_KEYS = ("round", "num_selected", "local_steps", "upload_bits", "download_bits")


# ---------------------------------------------------------------- data


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
    def finished(self) -> bool:
        if self.truncated_from is not None:
            return True  # it ran every compared round and more
        return self.status in ("complete", "diverged", "failed") and not (self.status == "complete" and self.rounds_done < self.rounds_planned)

    @property
    def stopped_early(self) -> bool:
        """Whether the run ended before the rounds it is compared over (diverged, interrupted, failed)."""
        return self.truncated_from is None and not (self.status == "complete" and self.rounds_done >= self.rounds_planned)

    @property
    def num_parameters(self) -> int | None:
        value = (self.info or {}).get("num_parameters")
        return int(value) if value else None

    @property
    def diverged_at(self) -> int | None:
        """The round whose update made the server model non-finite (the runner records the rounds before it)."""
        return self.rounds_done + 1 if self.status == "diverged" and self.truncated_from is None else None

    @property
    def is_classifier(self) -> bool:
        return any("test_accuracy" in r for r in self.records)


@dataclass(frozen=True)
class PendingRun:
    """A run a sweep planned that has no metrics yet."""

    path: Path
    setting: str
    method: str
    seed: int


@dataclass(frozen=True)
class TargetOutcome:
    """One run against one target: where it got, and what it spent getting there (or in total, if it did not)."""

    reached: bool
    rounds: int
    model_equivalents: float | None  # None when the parameter count is unknown (no run.json)
    upload_bits: int
    download_bits: int
    local_steps: int
    diverged_at: int | None = None  # set when the run diverged without reaching the target


@dataclass(frozen=True)
class TargetRow:
    """One method against one target, over its seeds (a row of FedDyn Tables 1 and 2).

    ``lower_bound`` is set when some seed did not reach the target: the numbers are
    then means over seeds of what was spent, counting a non-reaching seed's whole
    run, so the true cost is at least that much.
    """

    setting: str
    target: float
    method: str
    seeds: int
    seeds_reached: int
    seeds_diverged: int
    rounds: float
    model_equivalents: float | None
    upload_bits: float
    download_bits: float
    local_steps: float
    lower_bound: bool
    diverged_at: int | None


@dataclass(frozen=True)
class Savings:
    """``baseline``'s model-equivalents over ``method``'s: how many times less ``method`` communicates.

    ``bound`` is "=" for an exact ratio, ">" when the baseline never reached the
    target (its cost is a lower bound), "<" when ``method`` never did, and None
    when the ratio says nothing (both unbounded, a divergence, or no parameter count).
    """

    setting: str
    target: float
    method: str
    baseline: str
    ratio: float | None
    bound: str | None


@dataclass(frozen=True)
class Spread:
    """Mean, sample standard deviation (ddof=1; None for one seed) and count of a value over seeds."""

    mean: float
    std: float | None
    count: int


@dataclass(frozen=True)
class AccuracyRow:
    setting: str
    method: str
    seeds: int
    final_accuracy: Spread | None
    best_accuracy: Spread | None
    best_client_accuracy: Spread | None  # EFL's BMTA
    final_train_loss: Spread | None
    final_distance: Spread | None


@dataclass(frozen=True)
class StepsRow:
    setting: str
    method: str
    reference: str
    total_steps: float
    total_fraction: float | None
    to_target: dict[float, TargetRow]  # steps to each target live in the row's ``local_steps``
    target_fraction: dict[float, float | None]


@dataclass
class Setting:
    label: str
    methods: dict[str, list[RunData]]  # method label -> its runs (seeds), in report order
    pending: list[PendingRun] = field(default_factory=list)
    cut_round: int | None = None  # stand-alone runs of different lengths are compared up to this round

    @property
    def runs(self) -> list[RunData]:
        return [run for runs in self.methods.values() for run in runs]

    @property
    def is_classifier(self) -> bool:
        return any(run.is_classifier for run in self.runs)


@dataclass
class Report:
    """What ``make_report`` wrote, and the numbers behind it."""

    markdown: str
    files: list[Path]
    runs: list[RunData]
    settings: list[Setting]
    targets: list[TargetRow]
    savings: list[Savings]
    accuracy: list[AccuracyRow]
    steps: list[StepsRow]


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
                "is skipped, so the file is damaged: resume the run to rewrite it, or delete the run directory"
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
    try:
        with_plugins_loaded(config)  # the plugins the run used: their algorithms are labelled as their registry entries say
    except ConfigError as error:
        raise ConfigError(f"{path / CONFIG_FILE}: {error}") from None
    records, torn = read_metrics(path / METRICS_FILE)
    info_path = path / RUN_INFO_FILE
    info = read_json_file(info_path) if info_path.exists() else None
    return RunData(path=path, config=config, records=records, info=info, seed=int(config.get("seed", 0)), torn_line=torn)


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
    return parts[1] if entry.get("setting") and len(parts) == 4 and parts[0] == "runs" else None


def read_sweep(path: Path) -> tuple[dict[str, Any], list[RunData], list[PendingRun]]:
    """A sweep's document, its runs labelled by setting/method/seed as sweep.json says, and the planned runs not started."""
    sweep_file = path / SWEEP_FILE
    document = read_json_file(sweep_file)
    if not isinstance(document, dict) or not isinstance(document.get("runs"), list):
        raise ConfigError(f"{sweep_file} has no list of runs; is this a sweep directory written by `driftlab sweep`?")
    if document.get("format", 1) != 1:
        raise ConfigError(f"{sweep_file} has format {document.get('format')!r}; this driftlab reads format 1 (upgrade driftlab)")
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
        run.setting, run.method, run.sweep = setting, str(entry.get("method") or algorithm_label(flatten_config(run.config))), name
        run.seed = int(entry.get("seed", run.seed))
        run.setting_dir = _setting_dir(entry)
        runs.append(run)
    return document, runs, pending


# ---------------------------------------------------------------- labelling stand-alone runs


def flatten_config(config: dict[str, Any]) -> dict[str, Any]:
    """``{"client": {"lr": 0.1}}`` -> ``{"client.lr": 0.1}``; values (schedules, lists) stay whole."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                flat[f"{key}.{sub_key}"] = sub_value
        else:
            flat[key] = value
    return flat


def display_value(value: Any) -> str:
    """A config value as a reader wants it: ``0.01``, ``exponential(initial=10, decay=0.97)``."""
    if isinstance(value, dict) and "kind" in value:
        rest = ", ".join(f"{k}={display_value(v)}" for k, v in value.items() if k != "kind")
        return f"{value['kind']}({rest})"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def algorithm_label(flat: dict[str, Any]) -> str:
    """The method's name as the papers spell it: FedAvg, FedAdam (FedAvg + server Adam), SCAFFOLD, ..."""
    name = str(flat.get("algorithm.name"))
    optimizer = flat.get("server.optimizer", "sgd")
    if name == "fedavg" and optimizer in SERVER_OPTIMIZER_LABELS:
        return SERVER_OPTIMIZER_LABELS[optimizer]
    label = registry.label(name)
    return label if optimizer == "sgd" else f"{label} + server {optimizer}"


def _frozen(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _split_keys(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(setting keys, method keys) of a flattened config, without the ignored keys."""
    kept = {k: v for k, v in flat.items() if k not in IGNORED_KEYS}
    setting = {k: v for k, v in kept.items() if k.split(".")[0] in SETTING_SECTIONS}
    method = {k: v for k, v in kept.items() if k not in setting}
    return setting, method


def _differing_keys(tables: Sequence[dict[str, Any]]) -> list[str]:
    keys = sorted({key for table in tables for key in table})
    return [key for key in keys if len({_frozen(table.get(key)) for table in tables}) > 1]


def _describe(table: dict[str, Any], keys: Iterable[str]) -> str:
    return ", ".join(f"{key}={display_value(table[key])}" for key in keys if key in table)


def label_standalone(runs: Sequence[RunData]) -> None:
    """Give runs outside a sweep a setting and a method label from their configs.

    Runs whose configs agree except for the seed (and rounds, device, backend,
    checkpointing) are seeds of one method; two of them that claim one seed are
    told apart by those keys instead: "FedAvg (rounds=50)", "FedAvg (rounds=100)".
    Settings are told apart by the data/model/sampling/availability keys that
    differ between runs (else the data set's name); methods by their algorithm's
    name, plus the keys that differ when several methods share that name:
    "FedProx (algorithm.mu=0)".
    """
    splits = [_split_keys(flatten_config(run.config)) for run in runs]
    by_data: dict[str, list[int]] = {}
    for index, (setting, _) in enumerate(splits):
        by_data.setdefault(display_value(setting.get("data.name", "runs")), []).append(index)
    # Runs on different data sets are told apart by the data set's name alone; only runs on one
    # data set need the keys that differ between them ("synthetic, sampling.participation=0.1").
    for data_name, indices in by_data.items():
        setting_keys = [key for key in _differing_keys([splits[i][0] for i in indices]) if key != "data.name"]
        for index in indices:
            runs[index].setting = ", ".join(filter(None, [data_name, _describe(splits[index][0], setting_keys)]))
    by_setting: dict[str, list[int]] = {}
    for index, run in enumerate(runs):
        by_setting.setdefault(run.setting, []).append(index)
    for indices in by_setting.values():
        methods: dict[str, dict[str, Any]] = {}  # frozen method keys -> method keys
        for index in indices:
            methods.setdefault(_frozen(splits[index][1]), splits[index][1])
        by_name: dict[str, list[dict[str, Any]]] = {}
        for table in methods.values():
            by_name.setdefault(algorithm_label(table), []).append(table)
        labels = {}
        for name, tables in by_name.items():
            differing = _differing_keys(tables)
            for table in tables:
                detail = _describe(table, differing)
                labels[_frozen(table)] = f"{name} ({detail})" if detail else name
        for index in indices:
            runs[index].method = labels[_frozen(splits[index][1])]
    _split_same_seed_runs(runs)


def _split_same_seed_runs(runs: Sequence[RunData]) -> None:
    """Tell apart runs of one method that claim the same seed by the ignored keys they differ in: "FedAvg (rounds=50)".

    Averaging them as seeds would pass off two runs of one seed as two seeds; a
    short and a long run of one config are two rows instead (compared up to the
    shorter one, see ``cut_to_shortest``).
    """
    groups: dict[tuple[str, str], list[RunData]] = {}
    for run in runs:
        groups.setdefault((run.setting, run.method), []).append(run)
    for group in groups.values():
        seeds = [run.seed for run in group]
        if len(set(seeds)) == len(seeds):
            continue
        tables = [{k: v for k, v in flatten_config(run.config).items() if k in IGNORED_KEYS and k != "seed"} for run in group]
        differing = _differing_keys(tables)
        for run, table in zip(group, tables):
            detail = _describe(table, differing)
            if detail:  # no detail: the same config twice, which ``collect`` refuses
                run.method = f"{run.method[:-1]}, {detail})" if run.method.endswith(")") else f"{run.method} ({detail})"


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


def _method_order(run: RunData) -> tuple:
    """Papers' order: FedAvg (and its server-optimizer variants), FedProx, SCAFFOLD, FedDyn, AdaBest, EFL."""
    flat = flatten_config(run.config)
    names = list(registry.ALGORITHMS)
    name = flat.get("algorithm.name")
    return (names.index(name) if name in names else len(names), flat.get("server.optimizer", "sgd") != "sgd", run.method)


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
            raise ConfigError(f"{raw}: no such directory; pass a run directory, a sweep directory or a folder that holds them")
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
    standalone.sort(key=lambda run: (setting_order[run.setting], _method_order(run)))
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
            for first, second in zip(runs, runs[1:]):
                if first.seed == second.seed:
                    # Averaging them would pass off two different runs (say, two scales of one sweep) as seeds.
                    where = f" in setting {setting.label!r}" if setting.label else ""
                    raise ConfigError(
                        f"{first.path} and {second.path} are both seed {first.seed} of {method!r}{where} "
                        "(two sweeps with the same labels, or one run copied twice); report them separately"
                    )
        # A sweep plans its runs' lengths (some give each method its own); stand-alone runs are compared like with like.
        setting.cut_round = cut_to_shortest([run for run in setting.runs if run.sweep is None])
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


# ---------------------------------------------------------------- the numbers


def target_outcome(run: RunData, target: float) -> TargetOutcome:
    """Rounds, model-equivalents, bits and local steps through the first evaluated round reaching ``target``.

    Model-equivalents: ``Σ_{t ≤ hit} upload_bits_t / (32 · P · |S_t|)`` (FedDyn Tables 1, 2):
    one FedAvg round is 1, a SCAFFOLD round (model and control variate) 2.
    A run that never reaches the target reports its whole run instead.
    """
    hit = first_round_reaching(run.records, target)
    through = hit["round"] if hit is not None else run.rounds_done
    spent = [r for r in run.records if r["round"] <= through]
    upload, download = cumulative_bits_through(run.records, through)
    equivalents = model_equivalents_through(run.records, through, run.num_parameters) if run.num_parameters else None
    return TargetOutcome(
        reached=hit is not None,
        rounds=through,
        model_equivalents=equivalents,
        upload_bits=upload,
        download_bits=download,
        local_steps=sum(r["local_steps"] for r in spent),
        diverged_at=run.diverged_at if hit is None else None,
    )


def target_row(setting: str, method: str, runs: Sequence[RunData], target: float) -> TargetRow:
    """One method's seeds against one target: means over seeds; a lower bound unless every seed reached it."""
    outcomes = [target_outcome(run, target) for run in runs]
    equivalents = [o.model_equivalents for o in outcomes]
    diverged = [o.diverged_at for o in outcomes if o.diverged_at is not None]
    return TargetRow(
        setting=setting,
        target=target,
        method=method,
        seeds=len(outcomes),
        seeds_reached=sum(o.reached for o in outcomes),
        seeds_diverged=len(diverged),
        rounds=statistics.fmean(o.rounds for o in outcomes),
        model_equivalents=None if None in equivalents else statistics.fmean(equivalents),
        upload_bits=statistics.fmean(o.upload_bits for o in outcomes),
        download_bits=statistics.fmean(o.download_bits for o in outcomes),
        local_steps=statistics.fmean(o.local_steps for o in outcomes),
        lower_bound=not all(o.reached for o in outcomes),
        diverged_at=min(diverged) if diverged else None,
    )


def savings(row: TargetRow, baseline: TargetRow) -> Savings:
    """How many times fewer model-equivalents ``row`` needs than ``baseline`` (see ``Savings``)."""
    ratio, bound = None, None
    comparable = (
        row.model_equivalents and baseline.model_equivalents is not None
        and row.diverged_at is None and baseline.diverged_at is None
        and not (row.lower_bound and baseline.lower_bound)
    )
    if comparable:
        ratio = baseline.model_equivalents / row.model_equivalents
        bound = "<" if row.lower_bound else ">" if baseline.lower_bound else "="
    return Savings(row.setting, row.target, row.method, baseline.method, ratio, bound)


def spread(values: Sequence[float]) -> Spread | None:
    """Mean and sample standard deviation (ddof=1, as AdaBest Table 2 reports over seeds)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    std = statistics.stdev(values) if len(values) >= 2 else None
    return Spread(statistics.fmean(values), std, len(values))


def _last(records: Sequence[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in reversed(records) if key in r), None)


def _best(records: Sequence[dict[str, Any]], key: str) -> Any:
    return max((r[key] for r in records if key in r), default=None)


def accuracy_row(setting: str, method: str, runs: Sequence[RunData]) -> AccuracyRow:
    """Final and best test accuracy, BMTA (best over rounds of the mean client test accuracy), final loss and distance."""
    return AccuracyRow(
        setting=setting,
        method=method,
        seeds=len(runs),
        final_accuracy=spread([_last(run.records, "test_accuracy") for run in runs]),
        best_accuracy=spread([_best(run.records, "test_accuracy") for run in runs]),
        best_client_accuracy=spread([_best(run.records, "client_test_accuracy_mean") for run in runs]),
        final_train_loss=spread([_last(run.records, "train_loss") for run in runs]),
        final_distance=spread([_last(run.records, "distance_to_minimizer") for run in runs]),
    )


def has_constant_work(run: RunData) -> bool:
    """Whether the clients' local work (client.steps, or client.epochs when steps is unset) is a number, not a schedule."""
    client = run.config.get("client", {})
    work = client.get("steps") if client.get("steps") is not None else client.get("epochs", 1)
    return not isinstance(work, dict)


def total_steps(runs: Sequence[RunData]) -> float:
    return statistics.fmean(sum(r["local_steps"] for r in run.records) for run in runs)


def choose_steps_reference(setting: Setting, requested: str | None) -> str:
    """The method local SGD steps are compared with (decaying-K Table 1 compares with constant K).

    ``requested`` when the setting has it; else the method with constant local work
    (steps or epochs, not a schedule) that spent the most steps; else the one that spent the most.
    """
    if requested is not None and requested in setting.methods:
        return requested
    constant = [method for method, runs in setting.methods.items() if all(has_constant_work(run) for run in runs)]
    candidates = constant or list(setting.methods)
    return max(candidates, key=lambda method: total_steps(setting.methods[method]))


def steps_rows(setting: Setting, targets_by_method: dict[str, dict[float, TargetRow]], reference: str) -> list[StepsRow]:
    reference_total = total_steps(setting.methods[reference])
    rows = []
    for method, runs in setting.methods.items():
        total = total_steps(runs)
        to_target = targets_by_method.get(method, {})
        fractions = {}
        for target, row in to_target.items():
            base = targets_by_method[reference][target]
            # A fraction of a lower bound, or of a diverged run, is no fraction at all.
            exact = not row.lower_bound and not base.lower_bound and base.local_steps > 0
            fractions[target] = row.local_steps / base.local_steps if exact else None
        rows.append(StepsRow(setting.label, method, reference, total, total / reference_total if reference_total else None, to_target, fractions))
    return rows


# ---------------------------------------------------------------- formatting


def format_bits(bits: float) -> str:
    """Bits in engineering units, three significant digits: ``1.27 Gbit``, ``58.6 kbit``, ``640 bit``."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(bits) >= factor:
            return f"{bits / factor:.3g} {prefix}bit"
    return f"{bits:.3g} bit"


def format_percent(spread_: Spread | None) -> str:
    """``97.21 ± 0.08%`` over seeds, ``97.21%`` for one seed, ``—`` when never measured."""
    if spread_ is None:
        return "—"
    if spread_.std is None:
        return f"{100 * spread_.mean:.2f}%"
    return f"{100 * spread_.mean:.2f} ± {100 * spread_.std:.2f}%"


def format_number(spread_: Spread | None) -> str:
    if spread_ is None:
        return "—"
    if spread_.std is None:
        return f"{spread_.mean:.4g}"
    return f"{spread_.mean:.4g} ± {spread_.std:.2g}"


def format_count(value: float) -> str:
    """Whole numbers as such (``9``), means over seeds with one decimal (``9.5``)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def format_target(target: float) -> str:
    return f"{100 * target:g}%"


def format_savings(entry: Savings) -> str:
    """``3.4×``; ``>3.4×`` against a baseline that never reached the target; ``<3.4×`` for one that did not reach it itself."""
    if entry.ratio is None:
        return "—"
    prefix = "" if entry.bound == "=" else entry.bound
    return f"{prefix}{entry.ratio:.1f}×"


def format_seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    cells = [list(header), ["---"] * len(header), *[list(row) for row in rows]]
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in cells)


def target_cells(row: TargetRow) -> tuple[str, str, str, str]:
    """Rounds, model-equivalents, upload and download of a row, with "+" on lower bounds."""
    plus = "+" if row.lower_bound else ""
    if row.diverged_at is not None:
        rounds = f"diverged at round {row.diverged_at}"
    else:
        rounds = f"{format_count(row.rounds)}{plus}"
    equivalents = "" if row.model_equivalents is None else f"{row.model_equivalents:.1f}{plus}"
    return rounds, equivalents, f"{format_bits(row.upload_bits)}{plus}", f"{format_bits(row.download_bits)}{plus}"


def target_note(row: TargetRow, runs: Sequence[RunData]) -> str:
    notes = []
    if row.seeds > 1 and 0 < row.seeds_reached < row.seeds:
        notes.append(f"{row.seeds_reached}/{row.seeds} seeds reached")
    elif row.seeds_reached == 0:
        notes.append("not reached" if row.seeds == 1 else f"0/{row.seeds} seeds reached")
    if row.seeds_diverged:
        notes.append(f"{row.seeds_diverged}/{row.seeds} diverged")
    unfinished = sum(not run.finished for run in runs)
    if unfinished:
        notes.append(f"{unfinished} unfinished")
    return "; ".join(notes)


# ---------------------------------------------------------------- plots


# Target lines: a dash pattern and a grey each, told apart in the legend, in print and without colour.
TARGET_STYLES = (
    ("dotted", ":", "black"),
    ("dashed", "--", "dimgray"),
    ("dash-dotted", "-.", "black"),
    ("long-dashed", (0, (8, 4)), "dimgray"),
    ("densely dotted", (0, (1, 1)), "black"),
)
BAND_LEGEND = "shaded: ± 1 sample std over seeds"
BAND_NOTE = (
    "Lines are means over seeds; shaded bands are the mean ± one sample standard deviation over seeds "
    "(ddof = 1, the ± of the tables), drawn where at least two seeds recorded the value."
)
# Short names for captions, long ones for the panels' titles.
PANEL_NAMES = {"drift_norm": "‖h‖", "model_norm": "‖θ‖", "dissimilarity_b2": "B(θ)²", "gradient_variance": "gradient variance"}


@dataclass(frozen=True)
class Series:
    """One method's curve: x, the mean over seeds, and the sample standard deviation (None where under 2 seeds recorded it)."""

    x: list[float]
    mean: list[float]
    std: list[float | None]


@dataclass
class ReportFigure:
    """A figure of one setting, built but not yet saved, and a caption saying what it draws."""

    suffix: str  # the file is <setting>-<suffix>.png
    caption: str
    figure: Any  # matplotlib.figure.Figure
    banded: bool  # whether it shows a ± std band (BAND_NOTE applies)


def _series(runs: Sequence[RunData], key: str, x_key: str = "round") -> Series:
    """Mean and sample standard deviation of ``key`` over seeds at each round where some seed recorded it.

    ``x_key="bits"`` puts the round at the cumulative bits up and down (mean over seeds at that round).
    """
    by_round: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        bits = 0
        for record in run.records:
            bits += record["upload_bits"] + record["download_bits"]
            value = record.get(key)
            if value is None or not math.isfinite(value):
                continue
            x = bits if x_key == "bits" else record["round"]
            by_round.setdefault(record["round"], []).append((x, value))
    series = Series([], [], [])
    for round_ in sorted(by_round):
        points = by_round[round_]
        values = [v for _, v in points]
        series.x.append(statistics.fmean(x for x, _ in points))
        series.mean.append(statistics.fmean(values))
        series.std.append(statistics.stdev(values) if len(values) >= 2 else None)
    return series


def _draw(axis, setting: Setting, key: str, x_key: str = "round", scale: float = 1.0) -> tuple[bool, bool]:
    """Plot ``key`` per method, the mean over seeds with a ± sample-std band; whether a line and whether a band were drawn."""
    drawn = banded = False
    for method, runs in setting.methods.items():
        series = _series(runs, key, x_key)
        if not series.x:
            continue
        (line,) = axis.plot(
            series.x, [scale * m for m in series.mean], label=method + (f" ({len(runs)} seeds)" if len(runs) > 1 else ""), linewidth=1.5,
            # Markers show where the measurements are when they are sparse (evaluation or dissimilarity every N rounds).
            marker="o" if len(series.x) <= 30 else None, markersize=3,
        )
        if any(std is not None for std in series.std):
            # NaN leaves a gap where fewer than two seeds recorded the value.
            low = [math.nan if s is None else scale * (m - s) for m, s in zip(series.mean, series.std)]
            high = [math.nan if s is None else scale * (m + s) for m, s in zip(series.mean, series.std)]
            axis.fill_between(series.x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
            banded = True
        drawn = True
    return drawn, banded


def _legend(axis, banded: bool) -> None:
    from matplotlib.patches import Patch

    handles, labels = axis.get_legend_handles_labels()
    if banded:
        handles.append(Patch(facecolor="gray", alpha=0.3, label=BAND_LEGEND))
        labels.append(BAND_LEGEND)
    axis.legend(handles, labels, fontsize="small")


def _drawable(setting: Setting, key: str) -> bool:
    """Whether some run recorded a finite ``key`` (what ``_draw`` needs to draw a line)."""
    return any(isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) for run in setting.runs for r in run.records)


def _all_positive(setting: Setting, key: str) -> bool:
    values = [r[key] for run in setting.runs for r in run.records if key in r and r[key] is not None]
    return bool(values) and all(v > 0 for v in values)


def target_style(index: int) -> tuple[str, Any, str, float]:
    """(name, dash pattern, colour, width) of the ``index``-th target line; every index gets its own."""
    name, dash, colour = TARGET_STYLES[index % len(TARGET_STYLES)]
    extra = index // len(TARGET_STYLES)
    return (f"{'thick ' * extra}{name}", dash, colour, 1.2 + 1.0 * extra)


def _captioned(what: str, banded: bool) -> str:
    return what + ("; lines: mean over seeds, shaded: ± 1 sample std" if banded else "")


def setting_figures(setting: Setting, targets: Sequence[float]) -> list[ReportFigure]:
    """The figures of one setting whose data exists, each captioned from what was actually drawn on it."""
    # The object-oriented API needs no pyplot state or backend switch, so a report made
    # inside a notebook leaves its plotting setup alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figures: list[ReportFigure] = []

    def panel(axis, key: str, title: str, ylabel: str, x_key: str = "round", scale: float = 1.0, log_y: bool = False) -> bool:
        """Draw one quantity on ``axis``; whether it has a ± std band."""
        _, banded = _draw(axis, setting, key, x_key, scale)
        axis.set_title(title)
        axis.set_xlabel("cumulative bits sent (upload + download)" if x_key == "bits" else "communication round")
        axis.set_ylabel(ylabel)
        if x_key == "bits":
            axis.set_xscale("log")
        else:
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        if log_y and _all_positive(setting, key):
            axis.set_yscale("log")
        axis.grid(alpha=0.3, which="both")
        return banded

    if setting.is_classifier and _drawable(setting, "test_accuracy"):
        for suffix, x_key, what in (("accuracy", "round", "rounds"), ("accuracy-vs-bits", "bits", "bits sent")):
            figure = Figure(figsize=(7, 4.5))
            axis = figure.subplots()
            banded = panel(axis, "test_accuracy", f"{setting.label}: test accuracy vs {what}", "test accuracy (%)", x_key, scale=100)
            styles = []
            for index, target in enumerate(targets):
                name, dash, colour, width = target_style(index)
                axis.axhline(100 * target, color=colour, linestyle=dash, linewidth=width, label=f"target {format_target(target)}")
                styles.append(f"{format_target(target)} {name}")
            _legend(axis, banded)
            caption = _captioned(f"test accuracy vs {what}", banded)
            if styles:
                caption += f"; target {'lines' if len(styles) > 1 else 'line'}: {', '.join(styles)}"
            figures.append(ReportFigure(suffix, caption, figure, banded))
    # Training loss is what FedProx's Figure 1 plots; for the quadratic, also the distance to x*.
    curves = [("train_loss", "loss", "train loss")]
    if not setting.is_classifier:
        curves.append(("distance_to_minimizer", "distance", "distance to the minimizer ‖θ − x*‖"))
    for key, suffix, ylabel in curves:
        if _drawable(setting, key):
            figure = Figure(figsize=(7, 4.5))
            axis = figure.subplots()
            # Log scale only when every value is positive: the quadratic's objective ½zx² − x is negative near x*.
            banded = panel(axis, key, f"{setting.label}: {ylabel} vs rounds", ylabel, log_y=True)
            _legend(axis, banded)
            figures.append(ReportFigure(suffix, _captioned(f"{ylabel} vs rounds", banded), figure, banded))

    for suffix, panels in (
        ("norms", (("drift_norm", "norm of the drift estimate ‖h‖", "‖h‖"), ("model_norm", "norm of the server model ‖θ‖", "‖θ‖"))),
        (
            "dissimilarity",
            (("dissimilarity_b2", "dissimilarity B(θ)²", "B(θ)²"), ("gradient_variance", "gradient variance E‖∇F_k − ∇f‖²", "E‖∇F_k − ∇f‖²")),
        ),
    ):
        present = [(key, title, ylabel) for key, title, ylabel in panels if _drawable(setting, key)]
        if not present:
            continue
        figure = Figure(figsize=(6 * len(present), 4.5))
        axes = figure.subplots(1, len(present), squeeze=False)[0]
        banded = False
        for axis, (key, title, ylabel) in zip(axes, present):
            panel_banded = panel(axis, key, f"{setting.label}: {title}", ylabel, log_y=True)
            _legend(axis, panel_banded)
            banded = banded or panel_banded
        what = " and ".join(PANEL_NAMES[key] for key, _, _ in present) + " vs rounds"
        figures.append(ReportFigure(suffix, _captioned(what, banded), figure, banded))
    return figures


def plot_setting(setting: Setting, out_dir: Path, targets: Sequence[float], stem: str | None = None) -> list[tuple[ReportFigure, Path]]:
    """Save the figures of one setting as ``<stem>-<suffix>.png`` (stem: the setting's slug); (figure, path) of each."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    written = []
    for item in setting_figures(setting, targets):
        item.figure.tight_layout()
        path = out_dir / f"{stem or slug(setting.label)}-{item.suffix}.png"
        FigureCanvasAgg(item.figure)
        item.figure.savefig(path, dpi=120)
        written.append((item, path))
    return written


# ---------------------------------------------------------------- CSV


def _csv_number(value: float | None) -> str:
    """Integers without a trailing ``.0`` (bits, rounds); other numbers at full precision; None as empty."""
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _spread_columns(value: Spread | None) -> list[str]:
    return ["", ""] if value is None else [_csv_number(value.mean), _csv_number(value.std)]


# ---------------------------------------------------------------- the report


def _targets_for(targets: Sequence[float] | None, documents: Sequence[dict[str, Any]], runs: Sequence[RunData]) -> list[float]:
    if targets is not None:
        chosen = [float(t) for t in targets]
    elif any(document.get("targets") for document in documents):
        chosen = [float(t) for document in documents for t in document.get("targets") or ()]
    else:
        chosen = [float(run.config["evaluation"]["target_accuracy"]) for run in runs if run.config.get("evaluation", {}).get("target_accuracy") is not None]
    bad = [t for t in chosen if not 0 < t <= 1]
    if bad:
        raise ConfigError(f"target accuracies must be fractions in (0, 1], got {bad}; write 0.97 for 97%")
    return sorted(set(chosen))


def _reference_for(steps_reference_: str | None, documents: Sequence[dict[str, Any]], settings: Sequence[Setting]) -> str | None:
    if steps_reference_ is not None:
        methods = {method for setting in settings for method in setting.methods}
        if steps_reference_ not in methods:
            raise ConfigError(f"steps_reference {steps_reference_!r} is not a method of these runs; the methods are: {', '.join(sorted(methods))}")
        return steps_reference_
    return next((document["steps_reference"] for document in documents if document.get("steps_reference")), None)


def _machine(run: RunData) -> str:
    machine = (run.info or {}).get("machine") or {}
    if not machine:
        return "unknown"
    threads = machine.get("torch_threads")
    return f"{machine.get('processor', 'unknown')}, {threads} threads" if threads else str(machine.get("processor", "unknown"))


def sweep_summary(document: dict[str, Any], runs: Sequence[RunData]) -> str:
    """A sweep's name, base, scale and description, then what was actually run: rounds and seeds read from its runs.

    A sweep file's description speaks of its default scale ("200 rounds, about 10
    minutes"); sweep.json keeps it apart from a note of what this sweep changed
    (``run_note``: the scale, command-line overrides). Older sweep.json files have
    the description alone, so the rounds and seeds of the runs themselves are always stated.
    """
    if "spec_description" in document:
        description, note = document.get("spec_description") or "", str(document.get("run_note") or "")
    else:
        description, note = document.get("description") or "", ""
    description = " ".join(str(description).split()) or _axes_description(document)
    line = f"Sweep **{document.get('name', '')}** (base `{document.get('base', '')}`, scale {document.get('scale', 'default')}): {description}"
    if note:
        line += f" *{note}*"
    as_run = _as_run(document, runs)
    return f"{line} As run: {as_run}." if as_run else line


def _axes_description(document: dict[str, Any]) -> str:
    """``algorithm.mu ∈ {mu=0, mu=1}; seeds 0, 1`` for a sweep without a description (a --grid sweep of an older driftlab)."""
    axes = [axis for axis in document.get("axes") or [] if isinstance(axis, dict)]
    grid = " × ".join(f"{axis.get('name')} ∈ {{{', '.join(str(v.get('label')) for v in axis.get('values') or [] if isinstance(v, dict))}}}" for axis in axes)
    return f"grid {grid}." if grid else "(no description)."


def _as_run(document: dict[str, Any], runs: Sequence[RunData]) -> str:
    """``20 rounds, seeds 0, 1`` or ``10 rounds (FedDyn, SCAFFOLD), 32 rounds (FedAvg); seed 0``, from the runs' configs."""
    by_rounds: dict[int, list[str]] = {}
    for run in runs:
        methods = by_rounds.setdefault(run.rounds_planned, [])
        if run.method not in methods:
            methods.append(run.method)
    if len(by_rounds) == 1:
        rounds = f"{next(iter(by_rounds))} rounds"
    else:
        rounds = ", ".join(f"{n} rounds ({', '.join(methods)})" for n, methods in sorted(by_rounds.items()))
    seeds = document.get("seeds") if isinstance(document.get("seeds"), list) else sorted({run.seed for run in runs})
    seeds_text = f"seed{'s' if len(seeds) != 1 else ''} {', '.join(map(str, seeds))}" if seeds else ""
    return "; ".join(filter(None, [rounds if runs else "", seeds_text]))


_SAFE_STEM = re.compile(r"[a-z0-9][a-z0-9.+_-]*")


def figure_stems(settings: Sequence[Setting]) -> dict[str, str]:
    """A file-name stem per setting, unique within the report.

    A sweep's setting keeps its directory name under ``runs/`` (sweep.py makes it
    safe and unique: ``lr=-1`` and ``lr=1`` differ); other settings use the slug
    of their label, numbered when two slugs collide.
    """
    stems: dict[str, str] = {}
    used: set[str] = set()
    for setting in settings:
        directory = next((run.setting_dir for run in setting.runs if run.setting_dir), None)
        base = directory if directory and _SAFE_STEM.fullmatch(directory) else slug(setting.label)
        stem, number = base, 2
        while stem in used:
            stem, number = f"{base}-{number}", number + 1
        used.add(stem)
        stems[setting.label] = stem
    return stems


def _cut_note(setting: Setting) -> list[str]:
    """Which runs the report cut to the shortest run's length, and how long they really ran."""
    cut = [run for run in setting.runs if run.truncated_from is not None]
    if not cut:
        return []
    listed = "; ".join(f"`{run.path}` ({run.method}, seed {run.seed}, ran {run.truncated_from} rounds)" for run in cut)
    return [
        f"These runs have different lengths, so every number and figure below compares them up to round {setting.cut_round}, "
        f"the last round of the shortest. Cut to round {setting.cut_round}: {listed}.",
        "",
    ]


def _incomplete_note(runs: Sequence[RunData]) -> str:
    """`` (1 diverged at round 71)``: "final" numbers of a run that stopped early are not final."""
    notes = [
        f"diverged at round {run.diverged_at}" if run.status == "diverged" else f"{run.status} at round {run.rounds_done}"
        for run in runs
        if run.stopped_early
    ]
    return f" ({'; '.join(notes)})" if notes else ""


def _status_summary(runs: Sequence[RunData], pending: int) -> str:
    counts: dict[str, int] = {}
    for run in runs:
        if run.truncated_from is not None:
            status = f"cut to round {run.rounds_done}"
        else:
            status = run.status if run.finished else "unfinished" if run.status == "complete" else run.status
        counts[status] = counts.get(status, 0) + 1
    if pending:
        counts["not started"] = pending
    return ", ".join(f"{n} {status}" for status, n in counts.items())


def make_report(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    targets: Sequence[float] | None = None,
    steps_reference: str | None = None,
    plots: bool = True,
) -> Report:
    """Read the runs under ``inputs`` and write ``report.md``, CSV tables and figures into ``out_dir``.

    Args:
      inputs: run directories, sweep directories, or folders holding either anywhere beneath them.
        A run reachable from two inputs counts once.
      out_dir: where the report goes (created).
      targets: target test accuracies (fractions); default: the sweeps' targets, else the runs'
        ``evaluation.target_accuracy``.
      steps_reference: the method label whose local SGD steps the others are compared with; default:
        the sweep's ``steps_reference``, else the method with constant local work that spent most steps.
      plots: write the PNG figures.

    Returns:
      A ``Report`` with the Markdown text, the files written and every number in the tables.

    Raises:
      ConfigError: an input that holds no runs, a malformed file (named, with its line), a bad target
        or an unknown ``steps_reference``.
    """
    settings, documents = collect(inputs)
    runs = [run for setting in settings for run in setting.runs]
    chosen_targets = _targets_for(targets, documents, runs)
    requested_reference = _reference_for(steps_reference, documents, settings)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    target_rows: list[TargetRow] = []
    savings_rows: list[Savings] = []
    accuracy_rows: list[AccuracyRow] = []
    steps_rows_: list[StepsRow] = []
    files: list[Path] = []
    lines = ["# driftlab report", ""]
    sources = ", ".join(f"`{p}`" for p in inputs)
    lines.append(f"{len(runs)} runs in {len(settings)} setting{'s' if len(settings) != 1 else ''}, read from {sources}.")
    for document in documents:
        lines.append(sweep_summary(document, [run for run in runs if run.sweep == str(document.get("name"))]))
    lines.append("")
    if chosen_targets and any(s.is_classifier for s in settings):
        lines += [
            "Communication is counted as in FedDyn (Acar et al. 2021) Tables 1 and 2: model-equivalents are uploaded bits "
            "over 32 · parameters · selected clients, summed over rounds, so one FedAvg round counts 1 and one SCAFFOLD round 2; "
            "bits are exact. A method that did not reach a target shows `N+`: the N rounds (and the communication) it spent "
            "without reaching it, a lower bound; ratios against it are bounds (`>`, `<`). With several seeds an entry is the mean "
            "over seeds, each seed that missed the target counted at the rounds it ran, so it is `+` unless every seed reached it. "
            "The savings column \"vs X\" is X's model-equivalents over this method's.",
            "",
        ]
    unknown_parameters = [run for run in runs if run.num_parameters is None]
    if unknown_parameters:
        lines += [f"{len(unknown_parameters)} runs have no run.json (parameter count unknown): their model-equivalent cells are empty.", ""]
    torn = [run for run in runs if run.torn_line is not None]
    for run in torn:
        lines.append(f"`{run.path / METRICS_FILE}` line {run.torn_line} was torn (the run was killed mid-write) and is ignored.")
    if torn:
        lines.append("")

    stems = figure_stems(settings)
    for setting in settings:
        lines += [f"## {setting.label}", ""]
        lines += _cut_note(setting)
        by_method: dict[str, dict[float, TargetRow]] = {method: {} for method in setting.methods}
        if setting.is_classifier:
            for target in chosen_targets:
                section, rows, entries = _communication_section(setting, target)
                lines += section
                target_rows += rows
                savings_rows += entries
                for row in rows:
                    by_method[row.method][target] = row
            if not chosen_targets:
                lines += ["No target accuracy given (pass targets, or set evaluation.target_accuracy in the runs): no communication tables.", ""]
        section, rows = _accuracy_section(setting)
        lines += section
        accuracy_rows += rows
        section, rows = _steps_section(setting, by_method, chosen_targets if setting.is_classifier else [], requested_reference)
        lines += section
        steps_rows_ += rows
        lines += _runs_section(setting)

        if plots:
            figures = plot_setting(setting, out, chosen_targets if setting.is_classifier else [], stems[setting.label])
            files += [path for _, path in figures]
            if figures:
                lines += ["### Figures", ""]
                if any(figure.banded for figure, _ in figures):
                    lines += [BAND_NOTE, ""]
                for figure, path in figures:
                    lines += [f"![{setting.label}: {figure.caption}]({path.name})", "", f"*{figure.caption[0].upper()}{figure.caption[1:]}.*", ""]

    markdown = "\n".join(lines).rstrip() + "\n"
    report_path = out / "report.md"
    report_path.write_text(markdown)
    files.insert(0, report_path)
    files += _write_tables(out, target_rows, savings_rows, accuracy_rows, steps_rows_, chosen_targets, settings)
    return Report(markdown, files, runs, settings, target_rows, savings_rows, accuracy_rows, steps_rows_)


def _communication_section(setting: Setting, target: float) -> tuple[list[str], list[TargetRow], list[Savings]]:
    """FedDyn Tables 1-2 for one target: rounds, model-equivalents and bits per method, and every pairwise saving."""
    rows = [target_row(setting.label, method, method_runs, target) for method, method_runs in setting.methods.items()]
    entries, table = [], []
    for row in rows:
        ratios = []
        for baseline in rows:
            if baseline.method == row.method:
                ratios.append("·")
                continue
            entry = savings(row, baseline)
            entries.append(entry)
            ratios.append(format_savings(entry))
        table.append([row.method, *target_cells(row), *ratios, target_note(row, setting.methods[row.method])])
    header = ["method", "rounds", "model-equivalents", "upload", "download", *(f"vs {row.method}" for row in rows), "note"]
    lines = [f"### Communication to reach {format_target(target)} test accuracy", "", markdown_table(header, table), ""]
    return lines, rows, entries


def _accuracy_section(setting: Setting) -> tuple[list[str], list[AccuracyRow]]:
    """Final and best accuracy and BMTA (AdaBest Table 2, EFL Table 2), or loss and distance for a non-classifier."""
    rows = [accuracy_row(setting.label, method, method_runs) for method, method_runs in setting.methods.items()]
    if setting.is_classifier:
        show_bmta = any(row.best_client_accuracy for row in rows)
        header = [
            "method", "seeds", "final test accuracy", "best test accuracy",
            *(["best mean client test accuracy (BMTA)"] if show_bmta else []), "final train loss",
        ]
        table = [
            [row.method, str(row.seeds), format_percent(row.final_accuracy), format_percent(row.best_accuracy),
             *([format_percent(row.best_client_accuracy)] if show_bmta else []), format_number(row.final_train_loss)]
            for row in rows
        ]
        note = "Mean ± sample standard deviation over seeds (AdaBest Table 2)."
        for row, method_runs in zip(table, setting.methods.values()):
            row[0] += _incomplete_note(method_runs)
        if show_bmta:
            note += " BMTA is EFL's best over rounds of the mean local test accuracy of the clients."
        title = "### Accuracy"
    else:
        header = ["method", "seeds", "final train loss", "final distance to the minimizer"]
        table = [
            [row.method + _incomplete_note(method_runs), str(row.seeds), format_number(row.final_train_loss), format_number(row.final_distance)]
            for row, method_runs in zip(rows, setting.methods.values())
        ]
        note, title = "Mean ± sample standard deviation over seeds.", "### Loss and distance"
    return [title, "", note, "", markdown_table(header, table), ""], rows


def _steps_section(
    setting: Setting, by_method: dict[str, dict[float, TargetRow]], targets: Sequence[float], requested_reference: str | None
) -> tuple[list[str], list[StepsRow]]:
    """Total local SGD steps and steps to each target, as fractions of the reference method's (decaying-K Table 1)."""
    reference = choose_steps_reference(setting, requested_reference)
    rows = steps_rows(setting, by_method if targets else {}, reference)
    header = ["method", "total local steps", f"fraction of {reference}"]
    for target in targets:
        header += [f"steps to {format_target(target)}", "fraction"]
    table = []
    for row in rows:
        cells = [row.method, format_count(round(row.total_steps, 1)), _format_fraction(row.total_fraction)]
        for target in targets:
            to_target = row.to_target[target]
            plus = "+" if to_target.lower_bound else ""
            cells += [f"{format_count(round(to_target.local_steps, 1))}{plus}", _format_fraction(row.target_fraction[target])]
        table.append(cells)
    lines = [
        "### Local SGD steps",
        "",
        f"Total local SGD steps over all clients and rounds (mean over seeds), as in the decaying-K paper's Table 1, relative to {reference}.",
        "",
        markdown_table(header, table),
        "",
    ]
    return lines, rows


def _runs_section(setting: Setting) -> list[str]:
    """Seeds, rounds, status, wall time, parameter count and machine per method: what a reproduction note cites."""
    pending_by_method: dict[str, int] = {}
    for planned in setting.pending:
        pending_by_method[planned.method] = pending_by_method.get(planned.method, 0) + 1
    table = []
    for method, method_runs in setting.methods.items():
        walls = [float(run.info["wall_seconds"]) for run in method_runs if run.info and run.info.get("wall_seconds") is not None]
        done = sorted({run.rounds_done for run in method_runs})
        planned_rounds = max(run.rounds_compared for run in method_runs)
        done_text = f"{done[0]}" if len(done) == 1 else f"{done[0]}–{done[-1]}"
        parameters = {run.num_parameters for run in method_runs} - {None}
        table.append([
            method,
            ", ".join(str(run.seed) for run in method_runs),
            f"{done_text}/{planned_rounds}",
            _status_summary(method_runs, pending_by_method.pop(method, 0)),
            format_seconds(statistics.fmean(walls)) if walls else "—",
            ", ".join(str(p) for p in sorted(parameters)) or "unknown",
            "; ".join(sorted({_machine(run) for run in method_runs})),
        ])
    for method, count in pending_by_method.items():
        table.append([method, "", "0", f"{count} not started", "—", "—", "—"])
    header = ["method", "seeds", "rounds done", "status", "wall time (mean)", "parameters", "machine"]
    return ["### Runs", "", markdown_table(header, table), ""]


def _format_fraction(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _write_tables(
    out: Path,
    target_rows: Sequence[TargetRow],
    savings_rows: Sequence[Savings],
    accuracy_rows: Sequence[AccuracyRow],
    steps_rows_: Sequence[StepsRow],
    targets: Sequence[float],
    settings: Sequence[Setting],
) -> list[Path]:
    """The tables' numbers, unformatted: fractions (not percentages), bits, and explicit bound flags."""
    files = [
        write_csv(
            out / "targets.csv",
            ["setting", "target", "method", "seeds", "seeds_reached", "seeds_diverged", "lower_bound", "rounds",
             "model_equivalents", "upload_bits", "download_bits", "local_steps", "diverged_at_round"],
            [[r.setting, _csv_number(r.target), r.method, r.seeds, r.seeds_reached, r.seeds_diverged, int(r.lower_bound),
              _csv_number(r.rounds), _csv_number(r.model_equivalents), _csv_number(r.upload_bits), _csv_number(r.download_bits),
              _csv_number(r.local_steps), "" if r.diverged_at is None else r.diverged_at] for r in target_rows],
        ),
        write_csv(
            out / "savings.csv",
            ["setting", "target", "method", "baseline", "ratio", "bound"],
            [[s.setting, _csv_number(s.target), s.method, s.baseline, _csv_number(s.ratio), s.bound or ""] for s in savings_rows],
        ),
        write_csv(
            out / "accuracy.csv",
            ["setting", "method", "seeds", "final_accuracy_mean", "final_accuracy_std", "best_accuracy_mean", "best_accuracy_std",
             "bmta_mean", "bmta_std", "final_train_loss_mean", "final_train_loss_std", "final_distance_mean", "final_distance_std"],
            [[r.setting, r.method, r.seeds, *_spread_columns(r.final_accuracy), *_spread_columns(r.best_accuracy),
              *_spread_columns(r.best_client_accuracy), *_spread_columns(r.final_train_loss), *_spread_columns(r.final_distance)]
             for r in accuracy_rows],
        ),
    ]
    target_columns = [column for t in targets for column in (f"steps_to_{_csv_number(t)}", f"fraction_to_{_csv_number(t)}")]
    steps_table = []
    for r in steps_rows_:
        cells = [r.setting, r.method, r.reference, _csv_number(r.total_steps), _csv_number(r.total_fraction)]
        for t in targets:
            row = r.to_target.get(t)
            cells += ["", ""] if row is None else [_csv_number(row.local_steps), _csv_number(r.target_fraction[t])]
        steps_table.append(cells)
    files.append(write_csv(out / "steps.csv", ["setting", "method", "reference", "total_steps", "total_fraction", *target_columns], steps_table))
    files.append(
        write_csv(
            out / "runs.csv",
            ["setting", "method", "seed", "path", "status", "rounds_done", "rounds", "num_parameters", "wall_seconds", "machine", "cut_to_round"],
            [[s.label, run.method, run.seed, str(run.path), run.status, run.truncated_from or run.rounds_done, run.rounds_planned,
              run.num_parameters or "", _csv_number((run.info or {}).get("wall_seconds")), _machine(run), run.rounds_done if run.truncated_from is not None else ""]
             for s in settings for run in s.runs],
        )
    )
    return files


__all__ = [
    "Report",
    "ReportFigure",
    "RunData",
    "cut_to_shortest",
    "figure_stems",
    "label_standalone",
    "make_report",
    "read_metrics",
    "savings",
    "setting_figures",
    "spread",
    "sweep_summary",
    "target_outcome",
    "target_row",
]
