"""Smoke test of the client-state scale benchmark: it runs, reports every number, and removes its files (no timing assertions)."""

from __future__ import annotations

import json

import client_state_scale  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import pytest

FIELDS = {
    "peak_rss_mb",
    "distinct_clients_trained",
    "median_round_seconds",
    "median_checkpoint_seconds",
    "checkpoint_bytes_written",
}


def tiny_run(algorithm: str, rounds: int, directory) -> list[str]:
    """The arguments of a tiny run: 40 clients, 4 a round, a checkpoint every 2 rounds, a 16-wide MLP, the disk store
    in ``directory``."""
    shared = f"--clients 40 --per-round 4 --rounds {rounds} --checkpoint-every 2 --hidden 16 --store disk"
    return ["--algorithm", algorithm, *shared.split(), "--dir", str(directory)]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn"])
def test_tiny_run_reports_every_number_and_removes_its_files(capsys, tmp_path, algorithm):
    returned = client_state_scale.main(tiny_run(algorithm, 3, tmp_path))
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert report == json.loads(json.dumps(returned))
    assert FIELDS <= set(report) and report["store"] == "disk"
    assert 4 <= report["distinct_clients_trained"] <= 12 and len(lines) == 1 + 3 + 1  # header, 3 rounds, JSON
    assert report["checkpoint_bytes_written"] > 0 and report["median_checkpoint_seconds"] > 0
    # every trained client's row written once per round it trained in: 4 rows of 60·16+16 + 16·40+40 + 40·10+10 float32 parameters
    assert report["store_bytes_written"] == 3 * 4 * 4 * (60 * 16 + 16 + 16 * 40 + 40 + 40 * 10 + 10)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_run_killed_in_a_checkpoint_resumes_to_the_same_bits(capsys, tmp_path):
    report = client_state_scale.main([*tiny_run("scaffold", 5, tmp_path), "--kill-at-checkpoint", "2"])
    assert report["killed_at_checkpoint"] == 2 and report["killed_resume_identical"] is True
    assert "child run killed in checkpoint 2" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
