"""Reports of timed runs (``[system]``: simulated time to a target and over the run, issue 28) and of asynchronous
FedBuff runs, whose rounds are server updates.

Fixtures as in ``report_test`` (P = 10 parameters, 2 selected clients a round: one upload round is 1 model-equivalent).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Sequence

import pytest

import driftlab
from driftlab.experiments.report import make_report, setting_figures
from driftlab.experiments.report.report_test import (
    PARAMETERS,
    PNG_SIGNATURE,
    SELECTED,
    _config,
    _csv,
    _figure_of,
    _markdown_row,
    _records,
    _row,
    _three_methods,
    _write_run,
)

# ---------------------------------------------------------------- simulated time and asynchronous FedBuff (issue 28)


def _timed_config(
    algorithm: str = "fedavg", seed: int = 0, rounds: int = 5, asynchronous: bool = False, **system
) -> dict:
    """``_config`` with a [system] section (the defaults, ``system`` replaced) and, with ``asynchronous``, FedBuff's."""
    from driftlab.experiments.config import AsynchronousConfig, SystemConfig

    config = _config(algorithm, seed=seed, rounds=rounds)
    config["system"] = {**SystemConfig().model_dump(), **system}
    if asynchronous:
        config["algorithm"]["aggregation"] = "uniform"
        config["asynchronous"] = {**AsynchronousConfig().model_dump(), "concurrency": 4, "buffer": SELECTED}
    return config


def _timed_records(
    accuracies, round_seconds: float | Sequence[float], asynchronous: bool = False, **series
) -> list[dict]:
    """``_records`` on a clock: round t runs from the end of round t − 1 for ``round_seconds`` (one number: every round)."""
    records = _records(accuracies, **series)
    clock = 0.0
    for index, record in enumerate(records):
        seconds = round_seconds if isinstance(round_seconds, (int, float)) else round_seconds[index]
        record.update(time_start=clock, time_end=clock + seconds, num_missed_deadline=0, num_not_awaited=0)
        if asynchronous:
            record.update(mean_staleness=1.5, max_staleness=3, num_dispatched=SELECTED)
        clock += seconds
    return records


def _fedavg_and_fedbuff(root: Path) -> Path:
    """Synchronous FedAvg, 10 s a round, reaches 80% at round 4 (40 s), runs 50 s; FedBuff, 3 s an update (buffer of
    2 uploads, so 640 bits: one model-equivalent an update), reaches 80% at update 5 (15 s) and runs 8 updates (24 s)."""
    _write_run(root / "fedavg", _timed_config(rounds=5), _timed_records([0.5, 0.6, 0.7, 0.8, 0.85], 10.0))
    _write_run(
        root / "fedbuff",
        _timed_config(rounds=8, asynchronous=True),
        _timed_records([0.4, 0.5, 0.6, 0.7, 0.8, 0.82, 0.84, 0.86], 3.0, asynchronous=True),
    )
    return root


def test_time_to_target_and_simulated_time_in_the_tables_equal_the_records(tmp_path):
    from driftlab.metrics.summary import summarize

    out = tmp_path / "report"
    report = make_report([_fedavg_and_fedbuff(tmp_path / "runs")], out, targets=[0.8], plots=False)
    setting = report.settings[0]
    assert list(setting.methods) == ["FedAvg", "FedBuff"]  # FedAvg run asynchronously is FedBuff, named apart
    # an update is not a round: FedBuff's 8 updates are not cut to FedAvg's 5 rounds
    assert setting.cut_round is None and setting.cut_update is None
    assert [run.rounds_done for run in setting.runs] == [5, 8]
    fedavg, fedbuff = (_row(report, method, 0.8) for method in ("FedAvg", "FedBuff"))
    assert (fedavg.rounds, fedavg.time, fedavg.model_equivalents) == (4, 40.0, 4.0)
    assert (fedbuff.rounds, fedbuff.time, fedbuff.model_equivalents) == (5, 15.0, 5.0)
    for run in setting.runs:  # the run's own summary, from the same records, says the same
        summary = summarize(run.records, 0.8, PARAMETERS)
        hit = next(r for r in run.records if r["test_accuracy"] >= 0.8)
        assert summary["time_to_target"] == hit["time_end"] == _row(report, run.method, 0.8).time
        assert summary["simulated_time"] == run.records[-1]["time_end"] == run.simulated_time

    communication = report.markdown.split("### Communication to reach 80% test accuracy")[1]
    assert (
        "| method | rounds | time to target | model-equivalents | upload | download | vs FedAvg | vs FedBuff | note |"
        in communication
    )
    assert _markdown_row(communication, "FedAvg")[:4] == ["FedAvg", "4", "40.0 s", "4.0"]
    assert _markdown_row(communication, "FedBuff")[:4] == ["FedBuff", "5", "15.0 s", "5.0"]
    accuracy = report.markdown.split("### Accuracy")[1]
    assert (
        "| method | seeds | final test accuracy | best test accuracy | final train loss | simulated time |" in accuracy
    )
    assert _markdown_row(accuracy, "FedAvg")[-1] == "50.0 s" and _markdown_row(accuracy, "FedBuff")[-1] == "24.0 s"
    assert (
        "Asynchronous methods (FedBuff) aggregate buffered client updates (FedBuff, Nguyen et al. 2022): their rounds are server updates"
        in report.markdown
    )
    assert report.accuracy[1].simulated_time.mean == 24.0

    targets = {row["method"]: row for row in _csv(out / "targets.csv")}
    assert (targets["FedAvg"]["time_to_target"], targets["FedBuff"]["time_to_target"]) == ("40", "15")
    assert list(targets["FedAvg"])[-1] == "time_to_target"
    accuracy_csv = {row["method"]: row for row in _csv(out / "accuracy.csv")}
    assert [accuracy_csv["FedBuff"][k] for k in ("simulated_time_mean", "simulated_time_std")] == ["24", ""]
    runs = {row["method"]: row for row in _csv(out / "runs.csv")}
    assert (runs["FedAvg"]["simulated_time"], runs["FedAvg"]["asynchronous"]) == ("50", "0")
    assert (runs["FedBuff"]["simulated_time"], runs["FedBuff"]["asynchronous"], runs["FedBuff"]["rounds_done"]) == (
        "24",
        "1",
        "8",
    )


def test_time_over_seeds_lower_bounds_and_minutes(tmp_path):
    root = tmp_path / "runs"
    # seed 0 reaches 70% at round 2 (120 + 150 = 270 s); seed 1 never does, so its whole run (3 × 200 s) is spent
    _write_run(root / "s0", _timed_config(seed=0, rounds=3), _timed_records([0.6, 0.7, 0.75], [120.0, 150.0, 90.0]))
    _write_run(root / "s1", _timed_config(seed=1, rounds=3), _timed_records([0.5, 0.6, 0.65], 200.0))
    report = make_report([root], tmp_path / "report", targets=[0.7], plots=False)
    row = _row(report, "FedAvg", 0.7)
    assert (row.time, row.lower_bound) == ((270 + 600) / 2, True)
    communication = report.markdown.split("### Communication to reach 70% test accuracy")[1]
    assert _markdown_row(communication, "FedAvg")[1:3] == ["2.5+", "7.2 min+"]  # 435 s
    accuracy = report.accuracy[0].simulated_time
    assert (accuracy.mean, accuracy.std) == (480.0, pytest.approx(statistics.stdev([360.0, 600.0])))
    # in the mean's unit: 8.0 ± 2.8 min
    assert _markdown_row(report.markdown.split("### Accuracy")[1], "FedAvg")[-1] == "8.0 ± 2.8 min"
    # never reached by anyone: the compact table keeps the time column
    never = make_report([root], tmp_path / "never", targets=[0.95], plots=False)
    table = never.markdown.split("no method reached 95%")[1]
    assert "| method | rounds | time to target | model-equivalents |" in table
    assert _markdown_row(table, "FedAvg")[1:3] == ["3+", "8.0 min+"]


def test_an_untimed_run_beside_timed_ones_has_no_time(tmp_path):
    # stand-alone: a timed and an untimed run are two settings, named "timed" and "untimed" rather than by every [system] key
    _write_run(tmp_path / "alone" / "timed", _timed_config(rounds=3), _timed_records([0.5, 0.6, 0.7], 1.0))
    _write_run(tmp_path / "alone" / "untimed", _config(rounds=3), _records([0.5, 0.6, 0.7]))
    _write_run(
        tmp_path / "alone" / "slow", _timed_config(rounds=3, speed_median=10.0), _timed_records([0.5, 0.6, 0.7], 5.0)
    )
    labels = [s.label for s in make_report([tmp_path / "alone"], tmp_path / "r0", plots=False).settings]
    assert sorted(labels) == [
        "synthetic, timed, system.speed_median=10",
        "synthetic, timed, system.speed_median=100",
        "synthetic, untimed",
    ]
    # in a sweep's setting the untimed method's cells are "—" and it is left out of the time figure
    runs = []
    for method, config, records in (
        ("timed", _timed_config(rounds=3), _timed_records([0.5, 0.6, 0.7], 1.0)),
        ("untimed", _config(rounds=3), _records([0.5, 0.6, 0.7])),
    ):
        runs.append({"dir": f"runs/{method}/seed-0", "setting": "", "method": method, "seed": 0, "overrides": []})
        _write_run(tmp_path / "sweep" / f"runs/{method}/seed-0", config, records)
    (tmp_path / "sweep" / "sweep.json").write_text(
        json.dumps({"format": 1, "name": "mixed", "base": "b", "runs": runs})
    )
    report = make_report([tmp_path / "sweep"], tmp_path / "report", targets=[0.6])
    communication = report.markdown.split("### Communication to reach 60% test accuracy")[1]
    assert _markdown_row(communication, "untimed")[1:3] == ["2", "—"] and _markdown_row(communication, "timed")[
        1:3
    ] == ["2", "2.0 s"]
    assert _markdown_row(report.markdown.split("### Accuracy")[1], "untimed")[-1] == "—"
    time = next(f for f in setting_figures(report.settings[0], [0.6]) if f.suffix == "time")
    assert time.caption.endswith("; target line: 60% dotted; untimed runs not drawn: untimed")
    assert [line.get_label() for line in time.figure.axes[0].get_lines()] == ["timed", "target 60%"]
    assert "![mixed: " in report.markdown and "](mixed-time.png)" in report.markdown


def test_the_time_figure_starts_at_0_in_a_unit_chosen_by_the_span_and_labels_asynchronous_runs(tmp_path):
    root = _fedavg_and_fedbuff(tmp_path / "runs")
    for name in ("fedavg", "fedbuff"):
        info = json.loads((root / name / "run.json").read_text())
        info["initial"] = {"train_loss": 2.5, "test_accuracy": 0.1}
        (root / name / "run.json").write_text(json.dumps(info))
    report = make_report([root], tmp_path / "report", targets=[0.8])
    pngs = sorted(p.name for p in report.files if p.suffix == ".png")
    assert (
        "synthetic-time.png" in pngs and (tmp_path / "report" / "synthetic-time.png").read_bytes()[:8] == PNG_SIGNATURE
    )
    figure = next(f for f in setting_figures(report.settings[0], [0.8]) if f.suffix == "time")
    accuracy, loss = figure.figure.axes
    assert (accuracy.get_xlabel(), loss.get_xlabel()) == ("simulated time (s)", "simulated time (s)")  # 50 s: seconds
    curves = {line.get_label(): line for line in accuracy.get_lines()}
    assert set(curves) == {"FedAvg", "FedBuff", "target 80%"}  # "FedBuff" says asynchronous already
    assert list(curves["FedAvg"].get_xdata()) == [0, 10, 20, 30, 40, 50]  # from time 0: run.json's initial model
    assert list(curves["FedAvg"].get_ydata()) == pytest.approx([10, 50, 60, 70, 80, 85])
    assert list(curves["FedBuff"].get_xdata()) == [0, 3, 6, 9, 12, 15, 18, 21, 24]
    assert figure.caption.startswith("test accuracy and train loss vs simulated time (s;")
    # the per-round figures say what an asynchronous run's rounds are
    rounds = _figure_of(report.settings[0], "accuracy")
    assert rounds.figure.axes[0].get_xlabel() == "communication round (asynchronous runs: server update)"
    assert rounds.caption.startswith("test accuracy vs rounds (asynchronous runs: server updates)")
    # an asynchronous run under another label gets its legend entry; hours when the span is long
    from driftlab.experiments.report.plots import curve_label, time_axis

    assert curve_label("FedAvg (buffer 2)", report.settings[0].methods["FedBuff"]) == "FedAvg (buffer 2), asynchronous"
    long = _write_run(tmp_path / "long" / "run", _timed_config(rounds=3), _timed_records([0.5, 0.6, 0.7], 3600.0))
    long_report = make_report([long], tmp_path / "long-report", plots=False)
    assert time_axis(long_report.settings[0]) == ("h", 1 / 3600)
    axis = _figure_of(long_report.settings[0], "time").figure.axes[0]
    assert axis.get_xlabel() == "simulated time (h)" and list(axis.get_lines()[0].get_xdata()) == [1, 2, 3]


def test_untimed_reports_have_no_time_columns_figure_or_note(tmp_path):
    report = make_report([_three_methods(tmp_path / "runs")], tmp_path / "report", targets=[0.8])
    assert "time to target" not in report.markdown and "simulated time" not in report.markdown
    assert not any(p.name.endswith("-time.png") for p in report.files)
    assert all(row.time is None for row in report.targets) and all(
        row.simulated_time is None for row in report.accuracy
    )
    assert "time_to_target" not in _csv(tmp_path / "report" / "targets.csv")[0]
    assert "simulated_time" not in _csv(tmp_path / "report" / "runs.csv")[0]
    # (byte for byte: test_a_report_without_private_runs_is_byte_identical_to_before_privacy pins these reports' digests)


def test_asynchronous_runs_of_different_lengths_are_cut_among_themselves(tmp_path):
    _write_run(tmp_path / "fedavg", _timed_config(rounds=2), _timed_records([0.5, 0.6], 10.0))
    for seed, updates in ((0, 6), (1, 4)):
        records = _timed_records([0.1 * (i + 1) for i in range(updates)], 2.0, asynchronous=True)
        _write_run(tmp_path / f"fedbuff-{seed}", _timed_config(seed=seed, rounds=updates, asynchronous=True), records)
    report = make_report([tmp_path], tmp_path / "report", plots=False)
    setting = report.settings[0]
    assert (setting.cut_round, setting.cut_update) == (None, 4)
    assert [run.rounds_done for run in setting.methods["FedBuff"]] == [4, 4] and setting.methods["FedAvg"][
        0
    ].rounds_done == 2
    assert "up to server update 4, the last of the shortest (synchronous runs are not cut to it" in report.markdown
    assert "ran 6 updates" in report.markdown and "Cut to round" not in report.markdown


def test_real_timed_and_asynchronous_runs_share_a_setting_and_their_times(tmp_path):
    # FedBuff samples no cohorts, so the synchronous run's participation does not make it another setting
    tiny = ["data.num_clients=6", "client.steps=2", "algorithm.aggregation=uniform", "system.speed_median=100"]
    driftlab.run(None, out_dir=tmp_path / "runs" / "sync", overrides=["rounds=3", "sampling.participation=0.5", *tiny])
    driftlab.run(
        None,
        out_dir=tmp_path / "runs" / "async",
        overrides=["rounds=4", "asynchronous.concurrency=4", "asynchronous.buffer=2", *tiny],
    )
    report = make_report([tmp_path / "runs"], tmp_path / "report", targets=[0.01])
    assert [s.label for s in report.settings] == ["synthetic"] and list(report.settings[0].methods) == [
        "FedAvg",
        "FedBuff",
    ]
    for run in report.runs:
        assert run.timed and run.asynchronous == (run.method == "FedBuff")
        assert _row(report, run.method, 0.01).time == run.records[0]["time_end"] > 0  # any accuracy beats 1% at once
        assert (
            next(r for r in report.accuracy if r.method == run.method).simulated_time.mean
            == run.records[-1]["time_end"]
        )
    assert (tmp_path / "report" / "synthetic-time.png").read_bytes()[:8] == PNG_SIGNATURE
