"""The report as text: number formats, Markdown tables, and the sections of ``report.md``.

Per setting: communication to reach each target (FedDyn Tables 1 and 2; ``N+``
marks a lower bound, ``>``/``<`` a bounded ratio), accuracy (or loss and distance
for a non-classifier) as mean ± sample standard deviation over seeds, local SGD
steps against a reference method, and the runs behind them (seeds, rounds, status,
wall time, machine); a sweep's own description and what was actually run lead. Where a
setting has private runs, an ε column (``format_epsilon``) sits beside accuracy and rounds (what it covers is
noted under the setting's heading by the report's sections, ``driftlab.experiments.report.section``). Where a setting has
timed runs (``[system]``), a "time to target" column sits beside the rounds and a "simulated time" column
ends the accuracy table (``time_note`` says what they measure, and that an asynchronous run's rounds are
server updates). Where a setting has personalized runs (issue 26), its accuracy table names the model and the test
data of every accuracy and shows EFL's BMTA for the clients' own models beside the server model's
(``personal_accuracy_section``).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

from driftlab.experiments.report.epsilon import EpsilonSummary, any_private
from driftlab.experiments.report.read import RunData, Setting
from driftlab.experiments.report.tables import (
    AccuracyRow,
    Savings,
    Spread,
    StepsRow,
    TargetRow,
    accuracy_row,
    any_timed,
    choose_steps_reference,
    is_personal,
    savings,
    steps_rows,
    target_row,
)


def format_bits(bits: float) -> str:
    """Bits in engineering units, three significant digits: ``1.27 Gbit``, ``58.6 kbit``, ``640 bit``."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(bits) >= factor:
            return f"{bits / factor:.3g} {prefix}bit"
    return f"{bits:.3g} bit"


def format_percent(value: Spread | None) -> str:
    """``97.21 ± 0.08%`` over seeds, ``97.21%`` for one seed, ``—`` when never measured."""
    return _format_spread(value, ".2f", ".2f", scale=100, unit="%")


def format_number(value: Spread | None) -> str:
    """``0.3412 ± 0.012`` over seeds, ``0.3412`` for one seed, ``—`` when never measured."""
    return _format_spread(value, ".4g", ".2g")


def _format_spread(value: Spread | None, mean_format: str, std_format: str, scale: float = 1, unit: str = "") -> str:
    if value is None:
        return "—"
    mean = format(scale * value.mean, mean_format)
    if value.std is None:
        return mean + unit
    return f"{mean} ± {format(scale * value.std, std_format)}{unit}"


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


def format_epsilon(value: EpsilonSummary | None) -> str:
    """``2.31`` (the seeds' shared ε), ``2.31 (seeds 2.05–2.57)`` when they differ, ``∞`` without noise, ``—`` when
    not accounted."""
    if value is None or not value.accounted:
        return "—"
    text = _epsilon_text(value.mean)
    return f"{text} (seeds {_epsilon_text(value.low)}–{_epsilon_text(value.high)})" if value.seeds_differ else text


def _epsilon_text(epsilon: float | None) -> str:
    return "—" if epsilon is None else "∞" if epsilon == float("inf") else f"{epsilon:.3g}"


def duration_unit(seconds: float) -> tuple[str, float]:
    """(unit, seconds per unit) a span of ``seconds`` reads best in: s under 2 min, min under 2 h, else h."""
    if seconds < 120:
        return "s", 1.0
    if seconds < 7200:
        return "min", 60.0
    return "h", 3600.0


def format_seconds(seconds: float) -> str:
    unit, per_unit = duration_unit(seconds)
    return f"{seconds / per_unit:.1f} {unit}"


def format_duration(value: Spread | None) -> str:
    """Simulated time over seeds in the mean's unit: ``12.5 ± 0.8 min``, ``45.0 s`` for one seed, ``—`` when untimed."""
    if value is None:
        return "—"
    unit, per_unit = duration_unit(value.mean)
    return _format_spread(
        Spread(value.mean / per_unit, None if value.std is None else value.std / per_unit, value.count),
        ".1f",
        ".1f",
        unit=f" {unit}",
    )


def time_note(setting: Setting) -> list[str]:
    """What the time columns of a setting with timed runs mean, and what an asynchronous run's rounds are; nothing
    for a setting without timed runs."""
    if not any_timed(setting.runs):
        return []
    lines = [
        "Simulated time ([system]: each client's download, local steps and upload at its device's speed and bandwidths; "
        "a synchronous round lasts until its slowest counted client arrives): *time to target* is the simulated time at the "
        "end of the first evaluated round reaching the target (`+`: spent without reaching it), *simulated time* the "
        "whole run's, mean over seeds; —: an untimed run."
    ]
    asynchronous = sorted({run.method for run in setting.runs if run.asynchronous})
    if asynchronous:
        lines.append(
            f"Asynchronous methods ({', '.join(asynchronous)}) aggregate buffered client updates (FedBuff, Nguyen et al. 2022): "
            "their rounds are server updates, each folding the buffer's client updates however stale, so compare them with "
            "synchronous methods by simulated time, not rounds."
        )
    return [" ".join(lines), ""]


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


# ---------------------------------------------------------------- sections


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
    grid = " × ".join(
        f"{axis.get('name')} ∈ {{{', '.join(str(v.get('label')) for v in axis.get('values') or [] if isinstance(v, dict))}}}"
        for axis in axes
    )
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


def cut_note(setting: Setting) -> list[str]:
    """Which runs the report cut to the shortest run's length, and how long they really ran."""
    cut = [run for run in setting.runs if run.truncated_from is not None and not run.asynchronous]
    cut_asynchronous = [run for run in setting.runs if run.truncated_from is not None and run.asynchronous]
    lines = []
    if cut:
        listed = "; ".join(
            f"`{run.path}` ({run.method}, seed {run.seed}, ran {run.truncated_from} rounds)" for run in cut
        )
        lines += [
            f"These runs have different lengths, so every number and figure below compares them up to round {setting.cut_round}, "
            f"the last round of the shortest. Cut to round {setting.cut_round}: {listed}.",
            "",
        ]
    if cut_asynchronous:
        listed = "; ".join(
            f"`{run.path}` ({run.method}, seed {run.seed}, ran {run.truncated_from} updates)"
            for run in cut_asynchronous
        )
        lines += [
            f"These asynchronous runs have different lengths, so every number and figure below compares them up to server update "
            f"{setting.cut_update}, the last of the shortest (synchronous runs are not cut to it: an update is not a round). "
            f"Cut to update {setting.cut_update}: {listed}.",
            "",
        ]
    return lines


def _incomplete_note(runs: Sequence[RunData]) -> str:
    """`` (1 diverged at round 71)``: "final" numbers of a run that stopped early are not final."""
    notes = [_ended_note(run) for run in runs if run.stopped_early]
    return f" ({'; '.join(notes)})" if notes else ""


def _ended_note(run: RunData) -> str:
    if run.status == "diverged":
        return f"diverged at round {run.diverged_at}"
    if run.stopped_at is not None:
        return f"stopped at round {run.stopped_at} by evaluation.stop_at"
    return f"{run.status} at round {run.rounds_done}"


def _status_summary(runs: Sequence[RunData], pending: int) -> str:
    counts: dict[str, int] = {}
    for run in runs:
        if run.truncated_from is not None:
            status = f"cut to round {run.rounds_done}"
        elif run.stopped_at is not None:
            status = f"stopped at round {run.stopped_at} (evaluation.stop_at)"
        else:
            status = run.status if run.finished else "unfinished" if run.status == "complete" else run.status
        counts[status] = counts.get(status, 0) + 1
    if pending:
        counts["not started"] = pending
    return ", ".join(f"{n} {status}" for status, n in counts.items())


def communication_section(setting: Setting, target: float) -> tuple[list[str], list[TargetRow], list[Savings]]:
    """FedDyn Tables 1-2 for one target: rounds, model-equivalents and bits per method, and every pairwise saving."""
    rows = [target_row(setting.label, method, method_runs, target) for method, method_runs in setting.methods.items()]
    private = any_private(setting.runs)
    timed = any_timed(setting.runs)
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
        note = target_note(row, setting.methods[row.method])
        table.append(
            [
                row.method,
                *_epsilon_cell(row.epsilon, private),
                *_with_time(target_cells(row), row, timed),
                *ratios,
                note,
            ]
        )
    header = [
        "method",
        *_epsilon_header(private),
        *_with_time_header(("rounds", "model-equivalents", "upload", "download"), timed),
        *(f"vs {row.method}" for row in rows),
        "note",
    ]
    lines = [f"### Communication to reach {format_target(target)} test accuracy", "", markdown_table(header, table), ""]
    return lines, rows, entries


def unreached_section(setting: Setting, targets: Sequence[float], rows: Sequence[TargetRow]) -> list[str]:
    """One table for the targets no method reached: their tables would be identical (every entry ``N+``).

    ``rows`` are the target rows of one of them (any: unreached, they hold the same rounds and bits).
    """
    listed = ", ".join(format_target(target) for target in targets)
    private = any_private(setting.runs)
    timed = any_timed(setting.runs)
    notes = [target_note(row, setting.methods[row.method]) for row in rows]
    table = [
        [row.method, *_epsilon_cell(row.epsilon, private), *_with_time(target_cells(row), row, timed), note]
        for row, note in zip(rows, notes, strict=True)
    ]
    header = [
        "method",
        *_epsilon_header(private),
        *_with_time_header(("rounds", "model-equivalents", "upload", "download"), timed),
        "note",
    ]
    return [
        f"### Communication: no method reached {listed} test accuracy",
        "",
        f"What each method spent without reaching {'any of these targets' if len(targets) > 1 else 'it'} (lower bounds).",
        "",
        markdown_table(header, table),
        "",
    ]


def instability_note(runs: Sequence[RunData]) -> list[str]:
    """A line naming the runs whose loss stayed above the initial model's (the runner's instability flag) and the diverged ones."""
    unstable = [run for run in runs if run.instability is not None]
    diverged = [run for run in runs if run.diverged_at is not None]
    lines = []
    if unstable:
        listed = "; ".join(
            f"{run.method}, seed {run.seed} (from round {run.instability['round']}: {run.instability['message']})"
            for run in unstable
        )
        lines.append(f"⚠ Unstable (marked † below): {listed}.")
    if diverged:
        lines.append(
            "⚠ Diverged: "
            + "; ".join(f"{run.method}, seed {run.seed} (at round {run.diverged_at})" for run in diverged)
            + "."
        )
    return [" ".join(lines), ""] if lines else []


def stability_mark(runs: Sequence[RunData]) -> str:
    """``†`` after a method some of whose runs the runner flagged unstable (see ``instability_note``)."""
    return " †" if any(run.instability is not None for run in runs) else ""


def accuracy_section(setting: Setting) -> tuple[list[str], list[AccuracyRow]]:
    """Final and best accuracy and BMTA (AdaBest Table 2, EFL Table 2), or loss and distance for a non-classifier."""
    personal = is_personal(setting.runs)
    rows = [
        accuracy_row(setting.label, method, method_runs, personal) for method, method_runs in setting.methods.items()
    ]
    private = any_private(setting.runs)
    timed = any_timed(setting.runs)
    if setting.is_classifier and personal:
        return personal_accuracy_section(setting, rows, private, timed), rows
    if setting.is_classifier:
        show_bmta = any(row.best_client_accuracy for row in rows)
        header = [
            "method",
            "seeds",
            *_epsilon_header(private),
            "final test accuracy",
            "best test accuracy",
            *(["best mean client test accuracy (BMTA)"] if show_bmta else []),
            "final train loss",
            *_time_header(timed),
        ]
        table = [
            [
                row.method,
                str(row.seeds),
                *_epsilon_cell(row.epsilon, private),
                format_percent(row.final_accuracy),
                format_percent(row.best_accuracy),
                *([format_percent(row.best_client_accuracy)] if show_bmta else []),
                format_number(row.final_train_loss),
                *_time_cell(row, timed),
            ]
            for row in rows
        ]
        note = "Mean ± sample standard deviation over seeds (AdaBest Table 2)."
        for row, method_runs in zip(table, setting.methods.values(), strict=True):
            row[0] += stability_mark(method_runs) + _incomplete_note(method_runs)
        if show_bmta:
            note += " BMTA is EFL's best over rounds of the mean local test accuracy of the clients."
        title = "### Accuracy"
    else:
        header = [
            "method",
            "seeds",
            *_epsilon_header(private),
            "final train loss",
            "final distance to the minimizer",
            *_time_header(timed),
        ]
        table = [
            [
                row.method + stability_mark(method_runs) + _incomplete_note(method_runs),
                str(row.seeds),
                *_epsilon_cell(row.epsilon, private),
                format_number(row.final_train_loss),
                format_number(row.final_distance),
                *_time_cell(row, timed),
            ]
            for row, method_runs in zip(rows, setting.methods.values(), strict=True)
        ]
        note, title = "Mean ± sample standard deviation over seeds.", "### Loss and distance"
    return [title, "", note, "", markdown_table(header, table), ""], rows


SERVER_MODEL_MARK = " ‡"


def format_bmta(value: Spread | None, clients: Spread | None) -> str:
    """``98.30 ± 0.05% (clients σ 2.10)``: BMTA over seeds, then the std over clients at the best round (mean over seeds)."""
    text = format_percent(value)
    return text if value is None or clients is None else f"{text} (clients σ {100 * clients.mean:.2f})"


def personal_accuracy_section(setting: Setting, rows: Sequence[AccuracyRow], private: bool, timed: bool) -> list[str]:
    """The accuracy table of a setting with personalized runs (issue 26): the three accuracies, each named by the model
    evaluated and the test data, and EFL's BMTA (Table 2) for the clients' own models beside the server model's."""
    header = [
        "method",
        "seeds",
        *_epsilon_header(private),
        "final accuracy, server model, global test set",
        "best accuracy, server model, global test set",
        "BMTA, own model, own split",
        "BMTA, server model, clients' splits",
        "final train loss",
        *_time_header(timed),
    ]
    table = []
    for row, method_runs in zip(rows, setting.methods.values(), strict=True):
        own = format_bmta(row.best_personal_accuracy, row.best_personal_accuracy_spread)
        if row.personal_source == "server" and row.best_personal_accuracy is not None:
            own += SERVER_MODEL_MARK
        table.append(
            [
                row.method + stability_mark(method_runs) + _incomplete_note(method_runs),
                str(row.seeds),
                *_epsilon_cell(row.epsilon, private),
                format_percent(row.final_accuracy),
                format_percent(row.best_accuracy),
                own,
                format_bmta(row.best_client_accuracy, row.best_client_accuracy_spread),
                format_number(row.final_train_loss),
                *_time_cell(row, timed),
            ]
        )
    notes = [
        "Three accuracies, each named by the model tested and the test data: the server model on the global test set "
        "(what the communication tables' targets measure); each client's own model on that client's own test split; the "
        "server model on each client's test split. BMTA is EFL's (Ma et al., Table 2) best over evaluated rounds of the "
        "mean over clients of their test accuracy. Mean ± sample standard deviation over seeds; clients σ: the "
        "standard deviation over clients at that best round (mean over seeds).",
    ]
    if any(row.personal_source == "server" and row.best_personal_accuracy is not None for row in rows):
        notes.append(
            "‡ keeps no personal models: each client's own model is the server model, so its own-model BMTA is the "
            "server model's on the clients' splits (as EFL's Table 2 reports FedAvg)."
        )
    if any(row.personal_source is None for row in rows):
        notes.append("—: no own-model evaluation (evaluation.personal = false, or no client test splits).")
    return ["### Accuracy", "", " ".join(notes), "", markdown_table(header, table), ""]


def steps_section(
    setting: Setting,
    by_method: dict[str, dict[float, TargetRow]],
    targets: Sequence[float],
    requested_reference: str | None,
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
            cells += [
                f"{format_count(round(to_target.local_steps, 1))}{plus}",
                _format_fraction(row.target_fraction[target]),
            ]
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


def runs_section(setting: Setting) -> list[str]:
    """Seeds, rounds, status, wall time, parameter count and machine per method: what a reproduction note cites."""
    pending_by_method: dict[str, int] = {}
    for planned in setting.pending:
        pending_by_method[planned.method] = pending_by_method.get(planned.method, 0) + 1
    table = []
    for method, method_runs in setting.methods.items():
        walls = [
            float(run.info["wall_seconds"])
            for run in method_runs
            if run.info and run.info.get("wall_seconds") is not None
        ]
        done = sorted({run.rounds_done for run in method_runs})
        planned_rounds = max(run.rounds_compared for run in method_runs)
        done_text = f"{done[0]}" if len(done) == 1 else f"{done[0]}–{done[-1]}"
        parameters = {run.num_parameters for run in method_runs} - {None}
        table.append(
            [
                method,
                ", ".join(str(run.seed) for run in method_runs),
                f"{done_text}/{planned_rounds}",
                _status_summary(method_runs, pending_by_method.pop(method, 0)),
                format_seconds(statistics.fmean(walls)) if walls else "—",
                ", ".join(str(p) for p in sorted(parameters)) or "unknown",
                "; ".join(sorted({run.machine for run in method_runs})),
            ]
        )
    for method, count in pending_by_method.items():
        table.append([method, "", "0", f"{count} not started", "—", "—", "—"])
    header = ["method", "seeds", "rounds done", "status", "wall time (mean)", "parameters", "machine"]
    return ["### Runs", "", markdown_table(header, table), ""]


def _epsilon_header(private: bool) -> list[str]:
    """The ε column's header where a table has private runs (a note under the setting says what it means); else none."""
    return ["ε"] if private else []


def _epsilon_cell(value: EpsilonSummary | None, private: bool) -> list[str]:
    return [format_epsilon(value)] if private else []


def _with_time_header(columns: Sequence[str], timed: bool) -> list[str]:
    """The communication table's columns, with "time to target" after the rounds where the setting has timed runs."""
    return [columns[0], "time to target", *columns[1:]] if timed else list(columns)


def _with_time(cells: Sequence[str], row: TargetRow, timed: bool) -> list[str]:
    """``target_cells`` with the simulated time to the target after the rounds (``+`` on lower bounds, — when untimed)."""
    if not timed:
        return list(cells)
    time = "—" if row.time is None else f"{format_seconds(row.time)}{'+' if row.lower_bound else ''}"
    return [cells[0], time, *cells[1:]]


def _time_header(timed: bool) -> list[str]:
    return ["simulated time"] if timed else []


def _time_cell(row: AccuracyRow, timed: bool) -> list[str]:
    return [format_duration(row.simulated_time)] if timed else []


def _format_fraction(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"
