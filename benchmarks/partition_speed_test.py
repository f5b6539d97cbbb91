"""Smoke test of the partition-speed benchmark script: it runs and reports every number (no timing assertions)."""

from __future__ import annotations

import json

import numpy as np
import partition_speed  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import pytest


def test_quick_run_reports_every_row_and_number(capsys):
    report = partition_speed.main(["--quick"])
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line) == json.loads(json.dumps(report))
    assert {"machine", "workload", "results"} <= set(report)
    assert report["workload"]["num_clients"] == 20 and report["workload"]["alpha"] == 0.03
    assert [entry["key"] for entry in report["results"]] == [
        "client_prior",
        "classwise",
        "classwise_min10",
        "reference",
    ]
    for entry in report["results"]:
        assert {
            "row",
            "finished",
            "median_seconds",
            "seconds",
            "note",
            "ratio_to_reference",
            "speedup_vs_reference",
        } <= set(entry)
    assert "empty_clients_median" in report["results"][1]
    assert "raised" in report["results"][2]


def test_the_reference_loop_is_a_partition_and_stops_at_its_time_limit():
    labels = np.repeat(np.arange(3), 20)
    quotas = np.array([25, 20, 15])
    clients = partition_speed.feddyn_reference_partition(labels, quotas, 1.0, seed=0, time_limit=30)
    assert [len(c) for c in clients] == [25, 20, 15]
    assert sorted(np.concatenate(clients).tolist()) == list(range(60))
    with pytest.raises(partition_speed.TimeLimitReached):
        partition_speed.feddyn_reference_partition(
            np.zeros(20000, dtype=np.int64), np.array([20000]), 1.0, seed=0, time_limit=0.0
        )
