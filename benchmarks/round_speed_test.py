"""Smoke test of the round-speed benchmark script: it runs and reports every number (no timing assertions)."""

from __future__ import annotations

import json

import round_speed  # benchmarks/ is on sys.path: pytest puts a test file's directory there


def test_quick_run_reports_every_row_and_number(capsys):
    report = round_speed.main(["--quick", "--num-clients", "3", "--samples", "20", "--hidden", "8", "--rounds", "1"])
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line) == json.loads(json.dumps(report))
    assert {"machine", "matmul_gflops", "data", "workload", "results"} <= set(report)
    assert report["data"] == "random" and report["matmul_gflops"] > 0
    assert {entry["key"] for entry in report["results"]} == {"vectorized", "sequential", "reference"}
    for entry in report["results"]:
        assert {
            "row", "clients_per_round", "median_seconds", "round_seconds", "ratio_to_reference", "speedup_vs_reference",
            "peak_rss_mb", "peak_rss_growth_mb", "gflops", "fraction_of_matmul",
        } <= set(entry)
        assert entry["median_seconds"] > 0 and len(entry["round_seconds"]) == 1
    reference = next(entry for entry in report["results"] if entry["key"] == "reference")
    assert reference["ratio_to_reference"] == 1.0
