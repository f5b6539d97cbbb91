"""Tuned axes: each method's tuned value picked on validation data, and the grid it was picked from.

A sweep axis with ``role = "tuned"`` (FedProx's μ, FedDyn's α, a client learning rate) is a grid the report
chooses from rather than compares: for every (setting, method) the pick is the tuned value ``v`` whose runs have
the best mean validation score over seeds,

    v* = argbest_v (1/|S|) Σ_{s ∈ S} score(run(v, s)),

where ``score`` applies the sweep's ``tuning_rule`` to its ``tuning_metric`` (a record key, by default
``validation_accuracy``: the clients' held-out training rows, ``data.validation_fraction``) over the run's
evaluated rounds:

- ``final``: the metric at the last evaluated round;
- ``best``: its best over evaluated rounds (max for accuracies, min for losses);
- ``rounds_to:<target>``: the first evaluated round reaching the target (accuracy ≥ target, loss ≤ target), ∞ when
  none does; a value is ∞ when any seed never reaches it, and values tied there are ordered by their final metric.

A value any of whose runs diverged ranks last; a value stopped by successive halving
(``driftlab.experiments.sweep.execution``) is never picked (it lost at an earlier round). Ties keep the order
the axis lists its values in. The test metrics reported for the method are those of the picked value's runs only:
test data never takes part in the choice (the evaluation protocol of Wang et al., "A Field Guide to Federated
Optimization", arXiv 2107.06917, Section 5). The whole grid, validation and test per value, is an appendix.
A method that no tuned axis applies to (a tuned axis with ``methods = ["FedDyn"]`` leaves FedAvg alone) ran one
configuration: its rows are its runs, as in a sweep without tuned axes, and the appendix does not list it.

This module is pure functions over records and ``RunData`` (no torch); the sweep files' ``tuning_metric`` and
``tuning_rule`` are read with ``tuning_from_keys`` and halving ranks values with ``ranked_values``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from driftlab.errors import ConfigError
from driftlab.experiments.report.run_data import RunData
from driftlab.experiments.sweep.directory import HALVING_FILE

# Record keys a run's metrics may hold that a tuning metric is likely meant to name; a metric close to one of these
# but not one is a misspelling (refused when the sweep is read). Other keys are accepted and checked in the records.
KNOWN_METRICS = (
    "validation_accuracy",
    "validation_loss",
    "test_accuracy",
    "test_loss",
    "train_loss",
    "client_test_accuracy_mean",
    "personal_test_accuracy_mean",
    "test_recall_at_5",
    "distance_to_minimizer",
)
RULES = ("final", "best", "rounds_to:<target>")


@dataclass(frozen=True)
class Tuning:
    """How a tuned value is scored: a record key and a rule over the run's evaluated rounds."""

    metric: str = "validation_accuracy"
    rule: str = "final"

    @property
    def lower_is_better(self) -> bool:
        """Losses and distances fall as a model improves; every other metric (accuracies, recall) rises."""
        return "loss" in self.metric or "distance" in self.metric

    @property
    def target(self) -> float | None:
        return float(self.rule.split(":", 1)[1]) if self.rule.startswith("rounds_to:") else None

    @property
    def describe(self) -> str:
        if self.target is not None:
            return f"rounds to {self.metric} {'≤' if self.lower_is_better else '≥'} {self.target:g}"
        return f"{self.rule} {self.metric}"


def tuning_from_keys(metric: Any, rule: Any, origin: str) -> Tuning:
    """A sweep file's ``tuning_metric`` and ``tuning_rule`` (None: the defaults), refused when misspelt or malformed."""
    metric = Tuning.metric if metric is None else metric
    rule = Tuning.rule if rule is None else rule
    if not isinstance(metric, str) or not metric:
        raise ConfigError(
            f'{origin}: `tuning_metric` must name a record key such as "validation_accuracy", got {metric!r}'
        )
    if metric not in KNOWN_METRICS:
        import difflib

        close = difflib.get_close_matches(metric, KNOWN_METRICS, n=1, cutoff=0.75)
        if close:
            raise ConfigError(
                f"{origin}: tuning_metric {metric!r} is no record key; did you mean {close[0]!r}? "
                f"(known: {', '.join(KNOWN_METRICS)}; any other key of the runs' records may be named too)"
            )
    if not isinstance(rule, str) or not (rule in ("final", "best") or rule.startswith("rounds_to:")):
        raise ConfigError(
            f'{origin}: tuning_rule must be "final", "best" or "rounds_to:<target>" (e.g. "rounds_to:0.8"), got {rule!r}'
        )
    if rule.startswith("rounds_to:"):
        try:
            target = float(rule.split(":", 1)[1])
        except ValueError:
            raise ConfigError(
                f'{origin}: tuning_rule {rule!r}: the target after rounds_to: must be a number, e.g. "rounds_to:0.8"'
            ) from None
        if not math.isfinite(target):
            raise ConfigError(f"{origin}: tuning_rule {rule!r}: the target must be finite")
    return Tuning(metric, rule)


# ---------------------------------------------------------------- scores


def run_score(records: Sequence[dict[str, Any]], tuning: Tuning) -> float:
    """One run's number under the rule, in the metric's own units (rounds for rounds_to; ∞ when never reached);
    NaN when no record holds the metric yet (a run not evaluated yet: ``check_metric`` tells that from a misnamed key)."""
    evaluated = [
        (int(r["round"]), float(r[tuning.metric])) for r in records if isinstance(r.get(tuning.metric), (int, float))
    ]
    if not evaluated:
        return math.nan
    if tuning.target is not None:
        reached = (r for r, v in evaluated if (v <= tuning.target if tuning.lower_is_better else v >= tuning.target))
        return float(next(reached, math.inf))
    if tuning.rule == "best":
        values = [v for _, v in evaluated]
        return min(values) if tuning.lower_is_better else max(values)
    return evaluated[-1][1]


def check_metric(runs_records: Sequence[Sequence[dict[str, Any]]], tuning: Tuning, where: str) -> None:
    """ConfigError when no record of any of the runs holds the tuning metric: a key the records do not have (or runs
    made without ``data.validation_fraction``) cannot choose anything. Runs without records yet prove nothing."""
    records = [r for run in runs_records for r in run]
    if not records or any(isinstance(r.get(tuning.metric), (int, float)) for r in records):
        return
    keys = sorted(
        {key for r in records for key, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    )
    raise ConfigError(
        f"tuning_metric {tuning.metric!r} is in no record of the runs of {where}; their records hold {', '.join(keys)}. "
        "Set tuning_metric in the sweep file to one of them (validation metrics need data.validation_fraction in the runs' config)"
    )


def final_value(records: Sequence[dict[str, Any]], metric: str) -> float | None:
    return next((float(r[metric]) for r in reversed(records) if isinstance(r.get(metric), (int, float))), None)


@dataclass(frozen=True)
class ValueRuns:
    """The runs (one per seed) of one tuned value, as the ranking reads them."""

    records: tuple[tuple[dict[str, Any], ...], ...]
    diverged: bool = False  # some seed diverged: the value ranks last


def value_key(value: ValueRuns, tuning: Tuning) -> tuple[float, float]:
    """Sort key (smaller is better) of a tuned value: its mean score over seeds oriented so smaller is better, then
    (for rounds_to) its mean final metric as the tie-break; (∞, ∞) for a diverged value."""
    if value.diverged or not value.records:
        return math.inf, math.inf
    scores = [run_score(records, tuning) for records in value.records]
    if any(math.isnan(s) for s in scores):
        return math.inf, math.inf
    sign = 1.0 if tuning.lower_is_better else -1.0
    if tuning.target is None:
        return sign * statistics.fmean(scores), 0.0
    finals = [final_value(records, tuning.metric) for records in value.records]
    tie = (
        sign * statistics.fmean(f for f in finals if f is not None) if all(f is not None for f in finals) else math.inf
    )
    return (statistics.fmean(scores) if all(math.isfinite(s) for s in scores) else math.inf), tie


def ranked_values(values: Mapping[str, ValueRuns], tuning: Tuning) -> list[str]:
    """The tuned values' labels, best first; ties keep the given order."""
    order = {label: index for index, label in enumerate(values)}
    return sorted(values, key=lambda label: (*value_key(values[label], tuning), order[label]))


def mean_score(value: ValueRuns, tuning: Tuning) -> float | None:
    """The mean over seeds of the rule's number (None for a diverged value or one without scores)."""
    if value.diverged or not value.records:
        return None
    scores = [run_score(records, tuning) for records in value.records]
    return None if any(math.isnan(s) for s in scores) else statistics.fmean(scores)


# ---------------------------------------------------------------- the report's side


def halving_stop(run_dir: Path) -> dict[str, Any] | None:
    """``{"round": r, "message": ...}`` when successive halving stopped the run in ``run_dir`` (None otherwise)."""
    try:
        content = json.loads((run_dir / HALVING_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return content if isinstance(content, dict) and isinstance(content.get("round"), int) else None


@dataclass(frozen=True)
class GridCell:
    """One tuned value of one method in one setting: its validation score and test result over seeds."""

    setting: str
    method: str
    value: str
    seeds: int
    validation: tuple[float, float | None] | None  # mean and sample std over seeds of the rule's number
    test: tuple[float, float | None] | None  # mean and sample std of the final test metric
    test_metric: str
    picked: bool
    stopped_at: int | None = None  # round successive halving stopped the value's runs at
    diverged: bool = False


@dataclass
class TuningResult:
    """What ``apply_tuning`` chose: the tuning of each sweep, and the grid of every tuned (setting, method)."""

    tuning: Tuning
    cells: list[GridCell] = field(default_factory=list)
    untuned: dict[str, list[str]] = field(default_factory=dict)  # setting -> its methods no tuned axis applies to

    def picks(self, setting: str) -> list[GridCell]:
        return [cell for cell in self.cells if cell.setting == setting and cell.picked]


def _mean_std(values: Sequence[float]) -> tuple[float, float | None] | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None
    if any(math.isinf(v) for v in values):
        return math.inf, None  # some seed never reached the target: the mean is unbounded
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _tuned_entries(documents: Sequence[dict[str, Any]]) -> tuple[Tuning | None, dict[str, tuple[str, str]]]:
    """The tuning of the sweeps that have tuned axes, and each tuned run's directory -> (method, tuned value)."""
    tuning, entries = None, {}
    for document in documents:
        raw = document.get("tuning")
        if not isinstance(raw, dict):
            continue
        tuning = Tuning(str(raw.get("metric", Tuning.metric)), str(raw.get("rule", Tuning.rule)))
        for entry in document.get("runs", []):
            if isinstance(entry, dict) and entry.get("tuned"):
                entries[str(entry["dir"])] = (str(entry.get("tuned_method", "")), str(entry["tuned"]))
    return tuning, entries


def apply_tuning(settings: Sequence[Any], documents: Sequence[dict[str, Any]]) -> TuningResult | None:
    """Replace, in each setting, the runs of every tuned value by those of the value picked on validation.

    ``settings`` are the report's (``read.Setting``: label, methods label -> runs); a tuned run is listed in its
    sweep's ``sweep.json`` with ``tuned`` (its value) and ``tuned_method`` (its row). The picked runs take the
    method's label and the place of its first tuned value; the other values' runs leave the tables (they are the
    appendix grid). Returns None when no sweep has a tuned axis (the settings are left as they are)."""
    tuning, entries = _tuned_entries(documents)
    if tuning is None:
        return None
    result = TuningResult(tuning)
    for setting in settings:
        grids: dict[str, dict[str, list[RunData]]] = {}
        for runs in setting.methods.values():
            for run in runs:
                found = _entry_of(run, entries)
                if found is not None:
                    grids.setdefault(found[0], {}).setdefault(found[1], []).append(run)
        if not grids:
            continue
        replaced: dict[str, list[RunData]] = {}
        for label, runs in setting.methods.items():
            found = _entry_of(runs[0], entries) if runs else None
            if found is None:  # a method no tuned axis applies to: its runs are its rows
                replaced[label] = runs
                result.untuned.setdefault(setting.label, []).append(label)
                continue
            method = found[0]
            if method in replaced:
                continue
            cells, picked = grid_cells(setting.label, method, grids[method], tuning)
            result.cells += cells
            if picked is not None:
                for run in picked:
                    run.method = method
                replaced[method] = picked
        setting.methods.clear()
        setting.methods.update(replaced)
    return result


def _entry_of(run: RunData, entries: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    parts = run.path.parts
    for start in range(len(parts)):
        if parts[start] == "runs":
            found = entries.get("/".join(parts[start:]))
            if found is not None:
                return found
    return None


def grid_cells(
    setting: str, method: str, grid: Mapping[str, Sequence[RunData]], tuning: Tuning
) -> tuple[list[GridCell], list[RunData] | None]:
    """The appendix rows of one method's tuned values, and the picked value's runs (None: no value can be picked)."""
    check_metric(
        [run.records for runs in grid.values() for run in runs], tuning, f"{method} in {setting or 'the sweep'}"
    )
    stops = {value: [halving_stop(run.path) for run in runs] for value, runs in grid.items()}
    candidates = {
        value: ValueRuns(
            tuple(tuple(run.records) for run in runs),
            any(run.status == "diverged" for run in runs),
        )
        for value, runs in grid.items()
        if not any(stops[value])
    }
    order = ranked_values(candidates, tuning)
    best = next((value for value in order if mean_score(candidates[value], tuning) is not None), None)
    test_metric = "test_accuracy" if any(run.is_classifier for runs in grid.values() for run in runs) else "test_loss"
    cells = []
    for value, runs in grid.items():
        scores = [run_score(run.records, tuning) for run in runs]
        stopped = [stop["round"] for stop in stops[value] if stop]
        cells.append(
            GridCell(
                setting,
                method,
                value,
                len(runs),
                _mean_std(scores),
                _mean_std([final_value(run.records, test_metric) for run in runs]),
                test_metric,
                value == best,
                min(stopped) if stopped else None,
                any(run.status == "diverged" for run in runs),
            )
        )
    return cells, (list(grid[best]) if best is not None else None)


def _format(value: tuple[float, float | None] | None, metric: str, rounds: bool) -> str:
    if value is None:
        return "—"
    mean, std = value
    if rounds:
        return f"{mean:.1f}" + (f" ± {std:.1f}" if std is not None else "") if math.isfinite(mean) else "not reached"
    if "accuracy" in metric:
        return f"{100 * mean:.2f}%" + (f" ± {100 * std:.2f}" if std is not None else "")
    return f"{mean:.4g}" + (f" ± {std:.2g}" if std is not None else "")


def tuning_note(result: TuningResult | None, setting: str) -> list[str]:
    """The lines under a setting's heading that say which value each tuned method's rows are at, and why."""
    if result is None:
        return []
    lines = []
    rounds = result.tuning.target is not None
    for cell in result.picks(setting):
        score = _format(cell.validation, result.tuning.metric, rounds)
        lines.append(
            f"{cell.method} is reported at its tuned value {cell.value}, picked on validation ({result.tuning.describe}: "
            f"{score} over {cell.seeds} seed{'s' if cell.seeds != 1 else ''}); its test numbers below are at that value. "
            "The grid is in the appendix."
        )
    methods = {cell.method for cell in result.cells if cell.setting == setting}
    for method in sorted(methods - {cell.method for cell in result.picks(setting)}):
        lines.append(
            f"{method}: no tuned value could be picked (every value diverged, was stopped, or has no validation score yet)."
        )
    untuned = result.untuned.get(setting, [])
    if untuned:
        names = _and(untuned)
        lines.append(
            f"{names} {'has' if len(untuned) == 1 else 'have'} no tuned axis (none applies to {'it' if len(untuned) == 1 else 'them'}): "
            f"{'its rows are its' if len(untuned) == 1 else 'their rows are their'} one configuration's runs, and the appendix does not list "
            f"{'it' if len(untuned) == 1 else 'them'}."
        )
    return [*lines, ""] if lines else []


def _and(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def tuning_appendix(result: TuningResult | None) -> list[str]:
    """The appendix: every tuned value of every method and setting, validation score and test metric, the pick marked."""
    if result is None or not result.cells:
        return []
    rounds = result.tuning.target is not None
    lines = [
        "## Appendix: tuned grids",
        "",
        f"Each tuned value's validation score ({result.tuning.describe}, mean ± sample std over seeds), which picks it, "
        "and its final test metric, which does not. ✓ marks the value each method is reported at.",
        "",
    ]
    for setting in dict.fromkeys(cell.setting for cell in result.cells):
        cells = [cell for cell in result.cells if cell.setting == setting]
        test_metric = cells[0].test_metric
        header = f"| method | tuned value | seeds | validation ({result.tuning.describe}) | final {test_metric} | |"
        lines += [f"### {setting}", "", header, "|---|---|---|---|---|---|"]
        for cell in cells:
            status = "✓ picked" if cell.picked else ""
            if cell.stopped_at is not None:
                status = f"stopped by halving at round {cell.stopped_at}"
            elif cell.diverged:
                status = "diverged"
            lines.append(
                f"| {cell.method} | {cell.value} | {cell.seeds} | {_format(cell.validation, result.tuning.metric, rounds)} | "
                f"{_format(cell.test, cell.test_metric, False)} | {status} |"
            )
        lines.append("")
    return lines


def write_tuning_csv(out: Path, result: TuningResult | None) -> list[Path]:
    """tuning.csv: one row per setting, method and tuned value (nothing without tuned axes)."""
    if result is None or not result.cells:
        return []
    import csv

    path = out / "tuning.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "setting",
                "method",
                "tuned_value",
                "seeds",
                "metric",
                "rule",
                "validation_mean",
                "validation_std",
                "test_metric",
                "test_mean",
                "test_std",
                "picked",
                "stopped_at_round",
                "diverged",
            ]
        )
        for c in result.cells:
            validation, test = c.validation or (None, None), c.test or (None, None)
            writer.writerow(
                [
                    c.setting,
                    c.method,
                    c.value,
                    c.seeds,
                    result.tuning.metric,
                    result.tuning.rule,
                    *("" if v is None else repr(v) for v in validation),
                    c.test_metric,
                    *("" if v is None else repr(v) for v in test),
                    int(c.picked),
                    "" if c.stopped_at is None else c.stopped_at,
                    int(c.diverged),
                ]
            )
    return [path]


__all__ = [
    "KNOWN_METRICS",
    "RULES",
    "GridCell",
    "Tuning",
    "TuningResult",
    "ValueRuns",
    "apply_tuning",
    "check_metric",
    "final_value",
    "grid_cells",
    "halving_stop",
    "mean_score",
    "ranked_values",
    "run_score",
    "tuning_appendix",
    "tuning_from_keys",
    "tuning_note",
    "value_key",
    "write_tuning_csv",
]
