"""``rounds_long.csv``: every run's per-round records in long ("tidy") form, one row per run, round and metric.

The columns are ``run, method, seed, setting, round, metric, value``: what pandas and seaborn group and plot
without reshaping (``sns.lineplot(data=df[df.metric == "test_accuracy"], x="round", y="value", hue="method")``).
``run`` is the run's directory as the report read it; the rounds are those the report compares (a run cut to the
shortest one stops there).  Every record key holding a number is a metric (``test_accuracy``, ``train_loss``,
``upload_bits``, ...); lists (the reporting clients) and texts are left out, and so is a round that did not
evaluate a metric, so no value is ever empty.  Values are written as Python writes them (``repr``), so they
read back exactly (``nan`` for a NaN an older run recorded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

from driftlab.experiments.report.read import Setting
from driftlab.experiments.report.tables import write_csv

ROUNDS_LONG_CSV = "rounds_long.csv"
COLUMNS = ("run", "method", "seed", "setting", "round", "metric", "value")


def long_rows(settings: Sequence[Setting]) -> Iterator[list[Any]]:
    """The rows of ``rounds_long.csv``: settings, then methods and their runs (seeds) in report order, then rounds,
    then each record's metrics in the record's own key order."""
    for setting in settings:
        for run in setting.runs:
            for record in run.records:
                for metric, value in record.items():
                    if metric != "round" and _is_number(value):
                        yield [str(run.path), run.method, run.seed, setting.label, record["round"], metric, repr(value)]


def _is_number(value: Any) -> bool:
    # bool is an int to Python, but a flag, not a measurement; an older run's NaN is kept ("nan", read back as NaN)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def write_rounds_long_csv(out: Path, settings: Sequence[Setting]) -> list[Path]:
    """``out/rounds_long.csv`` (``COLUMNS``) over every run of ``settings``; the files written, as the other
    optional tables' writers give them."""
    return [write_csv(out / ROUNDS_LONG_CSV, COLUMNS, long_rows(settings))]


__all__ = ["COLUMNS", "ROUNDS_LONG_CSV", "long_rows", "write_rounds_long_csv"]
