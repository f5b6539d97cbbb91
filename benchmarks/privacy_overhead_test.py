"""Smoke tests of the privacy-overhead benchmark: a tiny run reports every number; its private row really is private."""

from __future__ import annotations

import json
import statistics

import privacy_overhead  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import pytest

from driftlab.privacy import accounting


@pytest.fixture(scope="module")
def report():
    """One tiny run (4 clients, 2 and 4 per round, 2 timed rounds), its printed last line parsed."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        returned = privacy_overhead.main(["--quick"])
    last_line = printed.getvalue().strip().splitlines()[-1]
    parsed = json.loads(last_line)
    assert parsed == json.loads(json.dumps(returned))
    return parsed


def test_quick_run_reports_both_rows_side_by_side_at_each_cohort_size(report):
    assert {"machine", "device", "data", "workload", "goal_overhead", "results", "accounting"} <= set(report)
    assert report["data"] == "random" and report["goal_overhead"] == 0.05
    assert report["workload"]["backend"] == "vectorized" and report["workload"]["privacy"] == {
        "clip": 1.0,
        "noise_multiplier": 1.0,
        "noise": "central",
        "delta": 1e-5,
    }
    assert [entry["clients_per_round"] for entry in report["results"]] == [2, 4]
    for entry in report["results"]:
        plain, private = entry["plain"]["round_seconds"], entry["private"]["round_seconds"]
        assert len(plain) == len(private) == 2 and min(plain + private) > 0
        assert entry["plain"]["median_seconds"] == statistics.median(plain)
        assert entry["ratio_of_medians"] == pytest.approx(
            statistics.median(private) / statistics.median(plain), rel=1e-12
        )
        assert entry["median_paired_ratio"] == pytest.approx(
            statistics.median([b / a for a, b in zip(plain, private, strict=True)]), rel=1e-12
        )
        assert entry["overhead"] == pytest.approx(entry["ratio_of_medians"] - 1, abs=1e-12)
        assert entry["within_goal"] == (entry["ratio_of_medians"] <= 1.05)


def test_sampling_is_poisson_below_full_participation_and_the_same_in_both_rows(report):
    partial, full = report["results"]
    assert partial["sampling"] == {"participation": 0.5, "mode": "poisson"}
    assert full["sampling"] == {"participation": 1.0}
    assert full["cohorts"] == [4, 4]  # everyone, every round (the warm-up round is not listed)
    assert all(0 <= size <= 4 for size in partial["cohorts"])


def test_the_private_row_clips_noises_and_accounts_and_the_plain_row_does_not(report):
    for entry in report["results"]:
        metrics, rounds = entry["private_metrics"], entry["rounds_recorded"]
        assert rounds == 3 and not entry["plain_has_privacy_metrics"]
        assert metrics["privacy_clip"] == 1.0
        q = 0.5 if entry["clients_per_round"] == 2 else 1.0
        # central noise on the sum: std z·C; ε after the last round is the accountant's for (q, z, T, δ)
        assert metrics["privacy_noise_std"] == pytest.approx(1.0)
        assert metrics["privacy_epsilon"] == pytest.approx(accounting.epsilon(1.0, q, rounds, 1e-5), rel=1e-9)


def test_accounting_is_timed_for_each_sampling_rate_and_both_accountants(report):
    assert [(e["sampling_rate"], e["accountant"]) for e in report["accounting"]] == [
        (0.5, "rdp"),
        (0.5, "prv"),
        (1.0, "rdp"),
        (1.0, "prv"),
    ]
    for entry in report["accounting"]:
        assert entry["rounds"] == 5 and entry["first_seconds"] > 0 and entry["median_later_seconds"] >= 0
        expected = accounting.epsilon(1.0, entry["sampling_rate"], 5, 1e-5, entry["accountant"])
        assert entry["epsilon_last"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("arguments", "phrase"),
    [
        (["--quick", "--rounds", "0"], "--rounds must be at least 1"),
        (
            ["--quick", "--clients-per-round", "5"],
            "--clients-per-round 5 must be between 1 and the number of clients (4)",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(capsys, arguments, phrase):
    with pytest.raises(SystemExit) as exited:
        privacy_overhead.main(arguments)
    assert exited.value.code == 2 and phrase in capsys.readouterr().err
