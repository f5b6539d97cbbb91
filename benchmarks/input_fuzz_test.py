"""The fuzz and corruption harness runs every kind of case and finds no traceback and no silent acceptance.

It runs in its own interpreter: the harness forks a child per case, which is safest from a process that has
not yet run torch work on threads (as pytest's has).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("input_fuzz.py")


@pytest.mark.slow
def test_every_kind_of_bad_input_gets_a_clear_error_and_valid_controls_run(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(HARNESS), "--cases", "40", "--seed", "7", "--timeout", "120"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    assert summary["failing"] == [], completed.stdout[-4000:]
    assert summary["tracebacks"] == 0 and summary["silent_acceptances"] == 0
    counts = summary["counts"]
    assert counts.get("ok", 0) >= 10 and counts.get("clear-error", 0) >= 60  # valid controls ran; nonsense was refused
    assert summary["cases"] == 40 + len(
        [line for line in completed.stdout.splitlines() if line.startswith("[") and "overrides-" not in line]
    )
    assert summary["peak_rss_mb_while_rejecting"] < 1024
