"""Smoke test of the executor-overhead benchmark: one local sweep measured, every number there (no timing assertions)."""

from __future__ import annotations

import executor_overhead  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import pytest

from driftlab.executors import ExecutorOptions


@pytest.mark.slow
def test_a_measured_sweep_reports_start_up_total_and_each_runs_overhead(tmp_path):
    measured = executor_overhead.measure(ExecutorOptions("local", jobs=2), tmp_path, "[0, 1]", (0,))
    assert set(measured) == {"startup_s", "total_s", "per_run_overhead_s"}
    assert len(measured["per_run_overhead_s"]) == 2
    assert 0 <= measured["startup_s"] < measured["total_s"]
    assert all(0 < overhead < measured["total_s"] for overhead in measured["per_run_overhead_s"])
