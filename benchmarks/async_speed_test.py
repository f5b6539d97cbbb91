"""Smoke tests of the FedBuff speed benchmark: a tiny run reports every number, and its counts are the engines'."""

from __future__ import annotations

import json
import statistics

import async_speed  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import pytest


@pytest.fixture(scope="module")
def report():
    """One tiny run (8 clients, synchronous cohorts of 2, FedBuff C = 8 and B = 2, 2 timed blocks), its last line parsed."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        returned = async_speed.main(["--quick", "--threads", "1"])
    parsed = json.loads(printed.getvalue().strip().splitlines()[-1])
    assert parsed == json.loads(json.dumps(returned))
    return parsed


def test_quick_run_reports_every_row_side_by_side(report):
    assert {"machine", "device", "data", "workload", "goal_ratio", "rows", "ratio_per_client", "within_goal"} <= set(
        report
    )
    assert report["data"] == "random" and report["goal_ratio"] == 1.5
    work = report["workload"]
    assert (work["concurrency"], work["buffer"], work["clients_per_round"], work["updates_per_block"]) == (8, 2, 2, 10)
    assert list(report["rows"]) == ["untimed", "synchronous", "asynchronous"]
    for entry in report["rows"].values():
        seconds, clients = entry["block_seconds"], entry["clients_trained"]
        assert len(seconds) == len(clients) == 2 and min(seconds) > 0
        assert entry["median_block_seconds"] == statistics.median(seconds)
        assert entry["median_seconds_per_client"] == statistics.median(
            s / c for s, c in zip(seconds, clients, strict=True)
        )
    rows = report["rows"]
    assert report["ratio_per_client"] == pytest.approx(
        rows["asynchronous"]["median_seconds_per_client"] / rows["synchronous"]["median_seconds_per_client"], rel=1e-12
    )
    assert report["within_goal"] == (report["ratio_per_client"] <= 1.5)


def test_synchronous_rows_train_and_fold_their_cohort_every_round(report):
    for name in ("untimed", "synchronous"):
        entry = report["rows"][name]
        # 10 rounds of 2 clients per block, one backend call per round (one wave), nothing dispatched
        assert entry["clients_trained"] == entry["arrivals"] == [20, 20]
        assert entry["backend_calls"] == [10, 10] and entry["dispatches"] == [0, 0]
    assert report["rows"]["untimed"]["simulated_seconds"] == [None, None]
    assert min(report["rows"]["synchronous"]["simulated_seconds"]) > 0


def test_fedbuff_trains_each_dispatch_at_most_once_and_every_arrival_before_it_is_folded(report):
    entry = report["rows"]["asynchronous"]
    warmup = entry["warmup"]
    assert entry["arrivals"] == [20, 20] and warmup["arrivals"] == 20  # B = 2 arrivals per update, 10 updates per block
    # every client is always available, so each arrival's slot is refilled: as many dispatches as arrivals after the start
    assert entry["dispatches"] == [20, 20]
    arrived = warmup["arrivals"] + sum(entry["arrivals"])
    trained = warmup["clients_trained"] + sum(entry["clients_trained"])
    dispatched = warmup["dispatches"] + sum(entry["dispatches"])
    assert arrived <= trained <= dispatched
    assert entry["mean_staleness"] > 0  # C > B: some changes are folded after others' updates
    assert min(entry["simulated_seconds"]) > 0 and entry["median_events_per_second"] > 0
