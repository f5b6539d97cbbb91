"""Smoke test of the privacy-accounting benchmark script: it runs and reports every number (no timing assertions)."""

from __future__ import annotations

import json

import privacy_accounting  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import pytest

from driftlab.privacy import accounting

pytest.importorskip("opacus")


def test_quick_run_reports_every_row_and_number(capsys):
    report = privacy_accounting.main(["--quick"])
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line) == json.loads(json.dumps(report))
    assert report["workload"]["rounds"] == 20
    rows = [(row["accountant"], row["workload"]) for row in report["results"]]
    assert rows == [(a, w) for a in ("rdp", "prv") for w in ("central_q0.01", "central_q0.1", "local")]
    for row in report["results"]:
        assert 0 < row["first_seconds"] <= row["total_seconds"]
        assert row["median_seconds"] <= row["p95_seconds"] <= row["max_seconds"]
        if row["local"]:
            expected = accounting.local_epsilon(row["z"], 20, 1e-5, row["accountant"])
        else:
            expected = accounting.epsilon(row["z"], row["q"], 20, 1e-5, row["accountant"])
        assert row["epsilon_last"] == expected
    for entry in report["noise_multiplier_for"]:
        eps = accounting.epsilon(entry["noise_multiplier"], 0.01, 20, 1e-5, entry["accountant"])
        assert 0.99 <= eps <= 1.0
