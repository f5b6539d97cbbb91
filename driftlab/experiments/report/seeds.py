"""The report's "Over seeds" section: 95% confidence intervals and paired comparisons with a named baseline.

Written for each setting where some method ran at least two seeds (a one-seed report is as before).  Per method,
from each seed's final record and its rounds to each target (``statistics``):

* final test accuracy: mean and Student's t 95% CI over seeds;
* rounds to each target: mean ± sample std over the seeds that reached it, and how many did;
* against the baseline (``--baseline``, else the setting's first method),
  over the seeds both ran, paired by seed (same data, initialisation and client samples): the mean difference of
  final test accuracy in points with its 95% CI, the paired t-test's two-sided p and the exact sign-flip p.

The same numbers go to ``seeds.csv``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from driftlab.errors import ConfigError
from driftlab.experiments.report.render import markdown_table
from driftlab.experiments.report.run_data import RunData
from driftlab.experiments.report.statistics import PairedComparison, Summary, paired, summarize
from driftlab.experiments.report.tables import write_csv

ACCURACY = "test_accuracy"


@dataclass(frozen=True)
class SeedsRow:
    setting: str
    method: str
    seeds: int
    final: Summary | None  # final test accuracy over seeds
    rounds_to: dict[
        float, tuple[Summary | None, int]
    ]  # target -> (rounds over the seeds that reached it, how many did)
    versus: PairedComparison | None  # against the baseline (None for the baseline itself, or no shared seed)


def final_accuracy(run: RunData) -> float | None:
    values = [record[ACCURACY] for record in run.records if record.get(ACCURACY) is not None]
    return float(values[-1]) if values else None


def rounds_to_target(run: RunData, target: float) -> int | None:
    return next(
        (
            int(record["round"])
            for record in run.records
            if record.get(ACCURACY) is not None and record[ACCURACY] >= target
        ),
        None,
    )


def baseline_for(methods: Sequence[str], requested: str | None) -> str:
    """The method others are compared with: ``requested`` when it is one of ``methods``, else the first."""
    return requested if requested in methods else methods[0]


def check_baseline(requested: str | None, all_methods: set[str]) -> None:
    if requested is not None and requested not in all_methods:
        raise ConfigError(
            f"--baseline {requested!r} is not a method of these runs; the methods are: {', '.join(sorted(all_methods))}"
        )


def seeds_rows(
    setting: str, methods: dict[str, list[RunData]], targets: Sequence[float], baseline: str
) -> list[SeedsRow]:
    """One ``SeedsRow`` per method of a setting, in the setting's order."""
    finals = {method: {run.seed: final_accuracy(run) for run in runs} for method, runs in methods.items()}
    finals = {
        method: {seed: value for seed, value in values.items() if value is not None}
        for method, values in finals.items()
    }
    rows = []
    for method, runs in methods.items():
        values = list(finals[method].values())
        rounds = {}
        for target in targets:
            reached = [r for r in (rounds_to_target(run, target) for run in runs) if r is not None]
            rounds[target] = (summarize(reached) if reached else None, len(reached))
        versus = None if method == baseline else paired(finals[method], finals[baseline])
        rows.append(SeedsRow(setting, method, len(runs), summarize(values) if values else None, rounds, versus))
    return rows


def _points(value: float) -> str:
    return f"{100 * value:+.2f}"


def _interval(low: float | None, high: float | None, scale: float = 100, digits: int = 2) -> str:
    if low is None or high is None:
        return "—"
    return f"[{scale * low:.{digits}f}, {scale * high:.{digits}f}]"


def _p(value: float | None) -> str:
    return "—" if value is None else (f"{value:.3f}" if value >= 0.001 else f"{value:.1e}")


def seeds_section(rows: Sequence[SeedsRow], targets: Sequence[float], baseline: str) -> list[str]:
    """Markdown for one setting (nothing when no method has two seeds)."""
    if not any(row.seeds >= 2 for row in rows):
        return []
    header = ["method", "seeds", "final test accuracy", "95% CI"]
    header += [f"rounds to {100 * t:g}% (seeds)" for t in targets]
    header += [f"vs {baseline}: difference, points", "95% CI", "paired t p", "sign-flip p"]
    table = []
    for row in rows:
        final = row.final
        cells = [
            row.method,
            str(row.seeds),
            "—" if final is None else f"{100 * final.mean:.2f}%",
            "—" if final is None else _interval(final.low, final.high),
        ]
        for target in targets:
            summary, reached = row.rounds_to[target]
            if summary is None:
                cells.append(f"— (0/{row.seeds})")
            elif summary.count >= 2:
                cells.append(f"{summary.mean:.1f} ± {summary.std:.1f} ({reached}/{row.seeds})")
            else:
                cells.append(f"{summary.mean:.0f} ({reached}/{row.seeds})")
        versus = row.versus
        if row.method == baseline:
            cells += ["(baseline)", "", "", ""]
        elif versus is None:
            cells += ["— (no shared seed)", "", "", ""]
        else:
            cells += [
                f"{_points(versus.mean_difference)} ({versus.count} seeds)",
                _interval(versus.low, versus.high),
                _p(versus.p_value),
                _p(versus.p_sign_flip),
            ]
        table.append(cells)
    note = (
        "Final test accuracy with Student's t 95% confidence interval over seeds; rounds to a target as mean ± sample std over "
        f"the seeds that reached it; each method against {baseline} paired by seed (the same seed gives both the same data, "
        "initialisation and client samples): the mean difference of final test accuracy, its 95% CI, the paired t-test's "
        "two-sided p and the exact sign-flip test's (no normality assumed; with n seeds it cannot go below 2/2ⁿ, 0.25 for 3)."
    )
    return [
        "### Over seeds: confidence intervals and paired comparisons",
        "",
        note,
        "",
        markdown_table(header, table),
        "",
    ]


def write_seeds_csv(out: Path, rows: Sequence[SeedsRow], targets: Sequence[float]) -> list[Path]:
    """``seeds.csv``: one row per setting and method (nothing when no setting had two seeds)."""
    if not rows:
        return []
    header = ["setting", "method", "seeds", "final_accuracy_mean", "final_accuracy_ci_low", "final_accuracy_ci_high"]
    for target in targets:
        header += [f"rounds_to_{target:g}_mean", f"rounds_to_{target:g}_std", f"rounds_to_{target:g}_reached"]
    header += [
        "difference_mean",
        "difference_ci_low",
        "difference_ci_high",
        "paired_t_p",
        "sign_flip_p",
        "paired_seeds",
    ]

    def number(value: Any) -> str:
        return "" if value is None else repr(float(value))

    lines = []
    for row in rows:
        final = row.final
        cells = [
            row.setting,
            row.method,
            row.seeds,
            number(final and final.mean),
            number(final and final.low),
            number(final and final.high),
        ]
        for target in targets:
            summary, reached = row.rounds_to[target]
            std = summary.std if summary is not None and summary.count >= 2 else None
            cells += [number(summary.mean if summary is not None else None), number(std), reached]
        versus = row.versus
        cells += [
            number(versus and versus.mean_difference),
            number(versus and versus.low),
            number(versus and versus.high),
            number(versus and versus.p_value),
            number(versus and versus.p_sign_flip),
            versus.count if versus else "",
        ]
        lines.append(cells)
    return [write_csv(out / "seeds.csv", header, lines)]
