"""The report's "Over seeds" section (report/seeds.py): CIs and paired comparisons, worked out by hand."""

from __future__ import annotations

import csv
import math

import pytest

from driftlab.errors import ConfigError
from driftlab.experiments.report import make_report
from driftlab.experiments.report.report_test import _config, _records, _write_run
from driftlab.experiments.report.statistics import t_quantile, t_two_sided_p

# Final accuracies per seed; rounds to 0.8 follow from the curves.
FEDAVG = {0: [0.70, 0.80, 0.84], 1: [0.72, 0.79, 0.82], 2: [0.75, 0.81, 0.83]}  # reach 0.8 at rounds 2, 3, 2
SCAFFOLD = {0: [0.80, 0.86, 0.88], 1: [0.81, 0.85, 0.87], 2: [0.79, 0.84, 0.87]}  # rounds 1, 1, 2


def _runs(root, seeds=(0, 1, 2)):
    for name, curves in (("fedavg", FEDAVG), ("scaffold", SCAFFOLD)):
        for seed in seeds:
            _write_run(root / name / f"seed-{seed}", _config(name, seed=seed, rounds=3), _records(curves[seed]))


def test_the_over_seeds_section_gives_t_intervals_and_paired_comparisons_with_the_baseline(tmp_path):
    _runs(tmp_path / "runs")
    report = make_report([tmp_path / "runs"], tmp_path / "report", targets=[0.8], plots=False)
    assert "### Over seeds: confidence intervals and paired comparisons" in report.markdown
    rows = {row["method"]: row for row in csv.DictReader(open(tmp_path / "report" / "seeds.csv"))}
    # FedAvg: finals 0.84, 0.82, 0.83: mean 0.83, std 0.01, CI 0.83 ± t(0.975, 2) · 0.01/√3
    half = t_quantile(0.975, 2) * 0.01 / math.sqrt(3)
    assert float(rows["FedAvg"]["final_accuracy_mean"]) == pytest.approx(0.83, abs=1e-12)
    assert float(rows["FedAvg"]["final_accuracy_ci_low"]) == pytest.approx(0.83 - half, abs=1e-12)
    # rounds to 0.8: FedAvg 2, 3, 2 (mean 7/3, std 1/√3); SCAFFOLD 1, 1, 2
    assert float(rows["FedAvg"]["rounds_to_0.8_mean"]) == pytest.approx(7 / 3)
    assert float(rows["FedAvg"]["rounds_to_0.8_std"]) == pytest.approx(1 / math.sqrt(3))
    assert rows["SCAFFOLD"]["rounds_to_0.8_reached"] == "3"
    # SCAFFOLD − FedAvg by seed: 0.04, 0.05, 0.04: mean 0.04333, std 0.005774, t = 13.0
    differences = [0.04, 0.05, 0.04]
    mean = sum(differences) / 3
    std = math.sqrt(sum((d - mean) ** 2 for d in differences) / 2)
    assert float(rows["SCAFFOLD"]["difference_mean"]) == pytest.approx(mean, abs=1e-12)
    assert float(rows["SCAFFOLD"]["paired_t_p"]) == pytest.approx(
        t_two_sided_p(mean / (std / math.sqrt(3)), 2), rel=1e-9
    )
    assert float(rows["SCAFFOLD"]["sign_flip_p"]) == 0.25  # three seeds: never below 2/8
    assert rows["FedAvg"]["difference_mean"] == ""  # the baseline itself
    assert "| SCAFFOLD | 3 | 87.33% |" in report.markdown and "+4.33 (3 seeds)" in report.markdown


def test_a_named_baseline_is_used_and_a_wrong_one_is_refused(tmp_path):
    _runs(tmp_path / "runs")
    report = make_report([tmp_path / "runs"], tmp_path / "report", targets=[0.8], plots=False, baseline="SCAFFOLD")
    assert "vs SCAFFOLD: difference, points" in report.markdown and "-4.33 (3 seeds)" in report.markdown
    with pytest.raises(ConfigError, match="--baseline 'FedProx' is not a method of these runs"):
        make_report([tmp_path / "runs"], tmp_path / "other", targets=[0.8], plots=False, baseline="FedProx")


def test_one_seed_per_method_writes_no_over_seeds_section(tmp_path):
    _runs(tmp_path / "runs", seeds=(0,))
    report = make_report([tmp_path / "runs"], tmp_path / "report", targets=[0.8], plots=False)
    assert "Over seeds" not in report.markdown and not (tmp_path / "report" / "seeds.csv").exists()
