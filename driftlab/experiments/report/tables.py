"""The numbers behind the report's tables, and the CSV files that hold them unformatted.

What each number measures, and which paper's table it reproduces: ``driftlab.experiments.report``.
Timed runs (``[system]``) add the simulated time to reach each target and the whole run's simulated time
(FedBuff, Nguyen et al. 2022, compares methods by time to a target accuracy); a report without timed runs has
the columns it always had.

Personalized runs (records with ``personal_test_accuracy_mean``, or ``client_test_accuracy_std``: the
evaluation of issue 26) add EFL's BMTA for each client's own model beside the server model's, each with the
standard deviation over clients at its best round (``best_round``). Three accuracies, never to be confused:

- ``test_accuracy``: the server model on the global test set;
- ``client_test_accuracy_mean``/``_std``: the server model on each client's own test split, mean and std over clients;
- ``personal_test_accuracy_mean``/``_std``: each client's own model (APFL, Ditto, FedAMP, or the server model after
  ``evaluation.finetune_steps`` local steps) on its own test split.

BMTA (Ma et al., EFL, Table 2: "the best mean testing accuracy ... the average of the testing accuracy on all
participants") of one run is ``max_t mean_k acc_k^t``; the row's number is its mean ± sample std over seeds. A method
without personal models gives each client the server model, so its own-model BMTA is the server model's on the
clients' splits (``personal_source = "server"``), as EFL's Table 2 reports FedAvg.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from driftlab.experiments.report.epsilon import EpsilonSummary, any_private, epsilon_summary
from driftlab.experiments.report.read import RunData, Setting
from driftlab.metrics.summary import cumulative_bits_through, first_round_reaching, model_equivalents_through


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
    time: float | None = None  # simulated seconds at the end of the round reached (or of the last round); None: untimed


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
    epsilon: EpsilonSummary | None = None  # ε at the end of the runs (not at the round that reached the target)
    time: float | None = (
        None  # mean over seeds of the simulated seconds to the target (spent, on lower bounds); None unless every seed is timed
    )


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
    epsilon: EpsilonSummary | None = None  # ε at the end of the runs: what releasing every round's model cost
    simulated_time: Spread | None = None  # the timed seeds' simulated seconds at their last compared round
    # Personalized runs only (``is_personal``): the std over clients at each seed's best round (server model on the
    # clients' splits), and the BMTA of each client's own model on its own split with its std over clients.
    best_client_accuracy_spread: Spread | None = None
    best_personal_accuracy: Spread | None = None
    best_personal_accuracy_spread: Spread | None = None
    personal_source: str | None = (
        None  # "own": the runs' own models; "server": none kept, the server model's; None: off
    )


@dataclass(frozen=True)
class StepsRow:
    setting: str
    method: str
    reference: str
    total_steps: float
    total_fraction: float | None
    to_target: dict[float, TargetRow]  # steps to each target live in the row's ``local_steps``
    target_fraction: dict[float, float | None]


def target_outcome(run: RunData, target: float) -> TargetOutcome:
    """Rounds, model-equivalents, bits and local steps through the first evaluated round reaching ``target``.

    Model-equivalents: ``Σ_{t ≤ hit} upload_bits_t / (32 · P · |S_t|)`` (FedDyn Tables 1, 2):
    one FedAvg round is 1, a SCAFFOLD round (model and control variate) 2.
    A timed run's ``time`` is the simulated ``time_end`` of that round.
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
        time=time_through(spent),
    )


def time_through(records: Sequence[dict[str, Any]]) -> float | None:
    """The simulated ``time_end`` of the last of ``records`` that has one (None: untimed records)."""
    end = _last(records, "time_end")
    return None if end is None else float(end)


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
        epsilon=epsilon_summary(runs),
        time=None if any(o.time is None for o in outcomes) else statistics.fmean(o.time for o in outcomes),
    )


def savings(row: TargetRow, baseline: TargetRow) -> Savings:
    """How many times fewer model-equivalents ``row`` needs than ``baseline`` (see ``Savings``)."""
    ratio, bound = None, None
    comparable = (
        row.model_equivalents
        and baseline.model_equivalents is not None
        and row.diverged_at is None
        and baseline.diverged_at is None
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


PERSONAL_KEYS = ("personal_test_accuracy_mean", "client_test_accuracy_std")


def is_personal(runs: Sequence[RunData]) -> bool:
    """Whether some run recorded the personalized evaluation's columns (issue 26): the tables then show both BMTAs."""
    return any(key in record for run in runs for record in run.records for key in PERSONAL_KEYS)


def best_round(records: Sequence[dict[str, Any]], key: str, spread_key: str) -> tuple[float | None, float | None]:
    """``(max_t r_t[key], r_t*[spread_key])``: the best value over rounds and the spread recorded in that round.

    The first such round on ties; (None, None) when no record has ``key``, a None spread when that round has none.
    """
    best: dict[str, Any] | None = None
    for record in records:
        if key in record and (best is None or record[key] > best[key]):
            best = record
    return (None, None) if best is None else (best[key], best.get(spread_key))


def personal_evaluation_off(run: RunData) -> bool:
    """Whether the run's config turned the personalized evaluation off (``evaluation.personal = false``)."""
    return run.config.get("evaluation", {}).get("personal") is False


def accuracy_row(setting: str, method: str, runs: Sequence[RunData], personal: bool = False) -> AccuracyRow:
    """Final and best test accuracy, BMTA (best over rounds of the mean client test accuracy), final loss and distance.

    ``personal``: also each client's own model's BMTA and both BMTAs' std over clients at their best rounds. A method
    whose runs recorded no own models (and did not turn the evaluation off) takes the server model's: its clients'
    own model is the server model.
    """
    row = _plain_accuracy_row(setting, method, runs)
    if not personal:
        return row
    server = [best_round(run.records, "client_test_accuracy_mean", "client_test_accuracy_std") for run in runs]
    own = [best_round(run.records, "personal_test_accuracy_mean", "personal_test_accuracy_std") for run in runs]
    source: str | None = "own"
    if all(best is None for best, _ in own):
        off = all(personal_evaluation_off(run) for run in runs)
        source, own = (None, []) if off or row.best_client_accuracy is None else ("server", server)
    return dataclasses.replace(
        row,
        best_client_accuracy_spread=spread([spread_ for _, spread_ in server]),
        best_personal_accuracy=spread([best for best, _ in own]),
        best_personal_accuracy_spread=spread([spread_ for _, spread_ in own]),
        personal_source=source,
    )


def _plain_accuracy_row(setting: str, method: str, runs: Sequence[RunData]) -> AccuracyRow:
    return AccuracyRow(
        setting=setting,
        method=method,
        seeds=len(runs),
        final_accuracy=spread([_last(run.records, "test_accuracy") for run in runs]),
        best_accuracy=spread([_best(run.records, "test_accuracy") for run in runs]),
        best_client_accuracy=spread([_best(run.records, "client_test_accuracy_mean") for run in runs]),
        final_train_loss=spread([_last(run.records, "train_loss") for run in runs]),
        final_distance=spread([_last(run.records, "distance_to_minimizer") for run in runs]),
        epsilon=epsilon_summary(runs),
        simulated_time=spread([run.simulated_time for run in runs]),
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


def steps_rows(
    setting: Setting, targets_by_method: dict[str, dict[float, TargetRow]], reference: str
) -> list[StepsRow]:
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
        rows.append(
            StepsRow(
                setting.label,
                method,
                reference,
                total,
                total / reference_total if reference_total else None,
                to_target,
                fractions,
            )
        )
    return rows


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


EPSILON_COLUMNS = ("epsilon", "epsilon_min", "epsilon_max", "delta")

# accuracy.csv with personalized runs, after bmta_mean/_std (the server model on the clients' splits): the std over
# clients at the best round, then the own models' BMTA, its std over clients, and whose models those are
PERSONAL_COLUMNS = (
    "bmta_client_std",
    "personal_bmta_mean",
    "personal_bmta_std",
    "personal_bmta_client_std",
    "personal_model",
)


def personal_columns(row: AccuracyRow) -> list[str]:
    """The ``PERSONAL_COLUMNS`` of a row: client stds are means over seeds; ``personal_model`` is own, server or empty."""
    return [
        _mean_column(row.best_client_accuracy_spread),
        *_spread_columns(row.best_personal_accuracy),
        _mean_column(row.best_personal_accuracy_spread),
        row.personal_source or "",
    ]


def _mean_column(value: Spread | None) -> str:
    return "" if value is None else _csv_number(value.mean)


def any_timed(runs: Sequence[RunData]) -> bool:
    """Whether some run ran on a simulated clock: the tables then carry simulated time."""
    return any(run.timed for run in runs)


def epsilon_columns(value: EpsilonSummary | None) -> list[str]:
    """ε's mean, min and max over seeds (``inf``: no noise; empty: not accounted) and δ (``;`` between several)."""
    if value is None:
        return ["", "", "", ""]
    deltas = ";".join(_csv_number(delta) for delta in value.deltas)
    return [_csv_number(value.mean), _csv_number(value.low), _csv_number(value.high), deltas]


def write_tables(
    out: Path,
    target_rows: Sequence[TargetRow],
    savings_rows: Sequence[Savings],
    accuracy_rows: Sequence[AccuracyRow],
    steps_rows_: Sequence[StepsRow],
    targets: Sequence[float],
    settings: Sequence[Setting],
) -> list[Path]:
    """The tables' numbers, unformatted: fractions (not percentages), bits, and explicit bound flags.

    When some run is private, targets.csv and accuracy.csv end with ε at the end of the runs and its δ
    (``EPSILON_COLUMNS``); when some run is timed, simulated seconds come before them: ``time_to_target``
    (targets.csv), ``simulated_time_mean``/``_std`` (accuracy.csv) and ``simulated_time`` (runs.csv), empty for
    untimed runs. When some run is personalized (``is_personal``), accuracy.csv adds ``PERSONAL_COLUMNS`` after
    ``bmta_std``. A report without private, timed or personalized runs has the columns it always had.
    """
    every_run = [run for setting in settings for run in setting.runs]
    private = any_private(every_run)
    timed = any_timed(every_run)
    personal = is_personal(every_run)
    extra_header = list(EPSILON_COLUMNS) if private else []

    def extra(value: EpsilonSummary | None) -> list[str]:
        return epsilon_columns(value) if private else []

    def time_header(*names: str) -> list[str]:
        return list(names) if timed else []

    files = [
        write_csv(
            out / "targets.csv",
            [
                "setting",
                "target",
                "method",
                "seeds",
                "seeds_reached",
                "seeds_diverged",
                "lower_bound",
                "rounds",
                "model_equivalents",
                "upload_bits",
                "download_bits",
                "local_steps",
                "diverged_at_round",
                *time_header("time_to_target"),
                *extra_header,
            ],
            [
                [
                    r.setting,
                    _csv_number(r.target),
                    r.method,
                    r.seeds,
                    r.seeds_reached,
                    r.seeds_diverged,
                    int(r.lower_bound),
                    _csv_number(r.rounds),
                    _csv_number(r.model_equivalents),
                    _csv_number(r.upload_bits),
                    _csv_number(r.download_bits),
                    _csv_number(r.local_steps),
                    "" if r.diverged_at is None else r.diverged_at,
                    *([_csv_number(r.time)] if timed else []),
                    *extra(r.epsilon),
                ]
                for r in target_rows
            ],
        ),
        write_csv(
            out / "savings.csv",
            ["setting", "target", "method", "baseline", "ratio", "bound"],
            [
                [s.setting, _csv_number(s.target), s.method, s.baseline, _csv_number(s.ratio), s.bound or ""]
                for s in savings_rows
            ],
        ),
        write_csv(
            out / "accuracy.csv",
            [
                "setting",
                "method",
                "seeds",
                "final_accuracy_mean",
                "final_accuracy_std",
                "best_accuracy_mean",
                "best_accuracy_std",
                "bmta_mean",
                "bmta_std",
                *(PERSONAL_COLUMNS if personal else ()),
                "final_train_loss_mean",
                "final_train_loss_std",
                "final_distance_mean",
                "final_distance_std",
                *time_header("simulated_time_mean", "simulated_time_std"),
                *extra_header,
            ],
            [
                [
                    r.setting,
                    r.method,
                    r.seeds,
                    *_spread_columns(r.final_accuracy),
                    *_spread_columns(r.best_accuracy),
                    *_spread_columns(r.best_client_accuracy),
                    *(personal_columns(r) if personal else []),
                    *_spread_columns(r.final_train_loss),
                    *_spread_columns(r.final_distance),
                    *(_spread_columns(r.simulated_time) if timed else []),
                    *extra(r.epsilon),
                ]
                for r in accuracy_rows
            ],
        ),
    ]
    target_columns = [
        column for t in targets for column in (f"steps_to_{_csv_number(t)}", f"fraction_to_{_csv_number(t)}")
    ]
    steps_table = []
    for r in steps_rows_:
        cells = [r.setting, r.method, r.reference, _csv_number(r.total_steps), _csv_number(r.total_fraction)]
        for t in targets:
            row = r.to_target.get(t)
            cells += ["", ""] if row is None else [_csv_number(row.local_steps), _csv_number(r.target_fraction[t])]
        steps_table.append(cells)
    files.append(
        write_csv(
            out / "steps.csv",
            ["setting", "method", "reference", "total_steps", "total_fraction", *target_columns],
            steps_table,
        )
    )
    # the round evaluation.stop_at ended each run at: a column only where one did (other reports stay as they were)
    stopped = any(run.stopped_at is not None for s in settings for run in s.runs)
    files.append(
        write_csv(
            out / "runs.csv",
            [
                "setting",
                "method",
                "seed",
                "path",
                "status",
                "rounds_done",
                "rounds",
                "num_parameters",
                "wall_seconds",
                "machine",
                "cut_to_round",
                *(["stopped_at_round"] if stopped else []),
                *time_header("simulated_time", "asynchronous"),
            ],
            [
                [
                    s.label,
                    run.method,
                    run.seed,
                    str(run.path),
                    run.status,
                    run.truncated_from or run.rounds_done,
                    run.rounds_planned,
                    run.num_parameters or "",
                    _csv_number((run.info or {}).get("wall_seconds")),
                    run.machine,
                    run.rounds_done if run.truncated_from is not None else "",
                    *([run.stopped_at if run.stopped_at is not None else ""] if stopped else []),
                    *([_csv_number(run.simulated_time), int(run.asynchronous)] if timed else []),
                ]
                for s in settings
                for run in s.runs
            ],
        )
    )
    return files
