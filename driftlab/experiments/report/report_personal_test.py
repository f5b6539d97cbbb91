"""Reports of personalized runs (issue 26): EFL's BMTA of the clients' own models beside the server model's.

Hand-built runs as in report_test.py (its helpers), with numbers worked out on paper.
"""

from __future__ import annotations

import pytest

from driftlab.experiments.report import make_report
from driftlab.experiments.report.report_test import _config, _csv, _markdown_row, _records, _write_run
from driftlab.experiments.report.tables import best_round, is_personal


def _personal_runs(root):
    """APFL with own models over two seeds; FedAvg without (its clients' own model is the server model)."""
    for seed, own, own_std in (
        (0, [0.60, 0.90, 0.80], [0.10, 0.05, 0.02]),
        (1, [0.70, 0.80, 0.95], [0.20, 0.04, 0.03]),
    ):
        _write_run(
            root / f"apfl-{seed}",
            _config("apfl", seed=seed, rounds=3),
            _records(
                [0.5, 0.6, 0.7],
                client_test_accuracy_mean=[0.4, 0.5, 0.55],
                client_test_accuracy_std=[0.3, 0.2, 0.1],
                personal_test_accuracy_mean=own,
                personal_test_accuracy_std=own_std,
            ),
        )
    _write_run(
        root / "fedavg",
        _config("fedavg", rounds=3),
        _records(
            [0.5, 0.8, 0.7], client_test_accuracy_mean=[0.45, 0.75, 0.75], client_test_accuracy_std=[0.2, 0.1, 0.3]
        ),
    )
    return root


def test_best_round_takes_the_spread_recorded_at_the_best_mean():
    records = [{"a": 0.5, "s": 0.1}, {"x": 1}, {"a": 0.9, "s": 0.3}, {"a": 0.9, "s": 0.7}, {"a": 0.2}]
    assert best_round(records, "a", "s") == (0.9, 0.3)  # first of tied rounds
    assert best_round([{"a": 0.4}], "a", "s") == (0.4, None)
    assert best_round([{"x": 1}], "a", "s") == (None, None)


def test_both_bmtas_with_their_client_spreads_by_hand(tmp_path):
    report = make_report([_personal_runs(tmp_path / "runs")], tmp_path / "report", plots=False)
    assert is_personal(report.runs)
    rows = {row.method: row for row in report.accuracy}
    apfl, fedavg = rows["APFL"] if "APFL" in rows else rows["apfl"], rows["FedAvg"]
    # own models: seed 0 best 0.90 (round 2, σ 0.05), seed 1 best 0.95 (round 3, σ 0.03)
    assert apfl.personal_source == "own"
    assert apfl.best_personal_accuracy.mean == pytest.approx(
        0.925
    ) and apfl.best_personal_accuracy.std == pytest.approx(0.05 / 2**0.5)
    assert apfl.best_personal_accuracy_spread.mean == pytest.approx(0.04)
    # server model on the clients' splits: 0.55 at round 3 (σ 0.1) in both seeds
    assert apfl.best_client_accuracy.mean == pytest.approx(
        0.55
    ) and apfl.best_client_accuracy_spread.mean == pytest.approx(0.1)
    # FedAvg keeps no own models: its own-model BMTA is its server model's on the clients' splits, first best round 2
    assert fedavg.personal_source == "server"
    assert (
        fedavg.best_personal_accuracy == fedavg.best_client_accuracy
        and fedavg.best_client_accuracy.mean == pytest.approx(0.75)
    )
    assert fedavg.best_personal_accuracy_spread.mean == pytest.approx(0.1) and fedavg.best_personal_accuracy.std is None

    table = report.markdown.split("### Accuracy")[1]
    header = _markdown_row(table, "method")
    assert header[2:6] == [
        "final accuracy, server model, global test set",
        "best accuracy, server model, global test set",
        "BMTA, own model, own split",
        "BMTA, server model, clients' splits",
    ]
    assert _markdown_row(table, apfl.method)[2:6] == [
        "70.00 ± 0.00%",
        "70.00 ± 0.00%",
        "92.50 ± 3.54% (clients σ 4.00)",
        "55.00 ± 0.00% (clients σ 10.00)",
    ]
    assert _markdown_row(table, "FedAvg")[4:6] == ["75.00% (clients σ 10.00) ‡", "75.00% (clients σ 10.00)"]
    assert "‡ keeps no personal models" in table and "EFL's Table 2 reports FedAvg" in table
    assert "best mean client test accuracy" not in table  # the unlabelled column of unpersonalized reports is gone

    csv_rows = {row["method"]: row for row in _csv(tmp_path / "report" / "accuracy.csv")}
    columns = list(csv_rows["FedAvg"])
    assert columns[columns.index("bmta_std") + 1 : columns.index("final_train_loss_mean")] == [
        "bmta_client_std",
        "personal_bmta_mean",
        "personal_bmta_std",
        "personal_bmta_client_std",
        "personal_model",
    ]
    assert (csv_rows["FedAvg"]["personal_model"], csv_rows[apfl.method]["personal_model"]) == ("server", "own")
    assert float(csv_rows[apfl.method]["personal_bmta_mean"]) == pytest.approx(0.925)
    assert float(csv_rows[apfl.method]["personal_bmta_client_std"]) == pytest.approx(0.04)


def test_a_method_whose_personal_evaluation_is_off_shows_no_own_model_bmta(tmp_path):
    root = _personal_runs(tmp_path / "runs")
    off = _config("fedavg", rounds=3, evaluation__personal=False)
    off["algorithm"]["mu"] = 0.1
    off["algorithm"]["name"] = "fedprox"
    _write_run(
        root / "fedprox",
        off,
        _records([0.5, 0.6, 0.7], client_test_accuracy_mean=[0.4, 0.5, 0.6], client_test_accuracy_std=[0.1] * 3),
    )
    report = make_report([root], tmp_path / "report", plots=False)
    row = next(row for row in report.accuracy if row.method.startswith("FedProx"))
    assert (
        row.personal_source is None
        and row.best_personal_accuracy is None
        and row.best_client_accuracy.mean == pytest.approx(0.6)
    )
    table = report.markdown.split("### Accuracy")[1]
    assert _markdown_row(table, row.method)[4:6] == ["—", "60.00% (clients σ 10.00)"]
    assert "—: no own-model evaluation" in table


def test_a_report_without_personalized_runs_keeps_its_columns(tmp_path):
    root = tmp_path / "runs"
    _write_run(root / "s0", _config(rounds=2), _records([0.8, 0.85], client_test_accuracy_mean=[0.5, 0.7]))
    report = make_report([root], tmp_path / "report", plots=False)
    assert not is_personal(report.runs) and report.accuracy[0].personal_source is None
    assert "best mean client test accuracy (BMTA)" in report.markdown and "own model" not in report.markdown
    assert "personal_bmta_mean" not in (tmp_path / "report" / "accuracy.csv").read_text()


def test_personalized_runs_get_a_figure_of_both_mean_client_accuracies(tmp_path):
    from driftlab.experiments.report import setting_figures
    from driftlab.experiments.report.report_test import PNG_SIGNATURE

    report = make_report([_personal_runs(tmp_path / "runs")], tmp_path / "report")
    (figure,) = [f for f in setting_figures(report.settings[0], []) if f.suffix == "personal"]
    left, right = figure.figure.axes[:2]
    assert "own model, own split" in left.get_title() and "server model, clients' splits" in right.get_title()
    # the own-model panel draws APFL only (FedAvg has no own models); its seeds' mean at round 2 is (0.90 + 0.80) / 2
    (line,) = left.get_lines()
    assert line.get_label().startswith("apfl") or line.get_label().startswith("APFL")
    assert list(line.get_xdata()) == [1, 2, 3] and line.get_ydata()[1] == pytest.approx(85.0)
    assert len(right.get_lines()) == 2 and "own model on its own test split" in figure.caption
    # a method keeps its colour in the panel where another method has no line
    (same,) = [other for other in right.get_lines() if other.get_label() == line.get_label()]
    assert line.get_color() == same.get_color() != next(o for o in right.get_lines() if o is not same).get_color()
    assert (tmp_path / "report" / "synthetic-personal.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "synthetic-personal.png" in report.markdown
