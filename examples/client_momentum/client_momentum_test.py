"""The client-momentum example end to end: the sweep runs from the repository root with no install of the
example and no edit of driftlab, resumes exactly, and reports the plugin beside FedAvg."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from driftlab.experiments.sweep.testing import sweep_command

ROOT = Path(__file__).resolve().parents[2]
SWEEP = "examples/client_momentum/sweep.toml"


def _sweep(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = sweep_command(SWEEP, "--out", str(out), "--seeds", "0", "--jobs", "1", *overrides)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.slow
def test_the_sweep_runs_resumes_exactly_and_reports_from_the_repository_root(tmp_path):
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    _sweep(
        resumed, "rounds=3", "checkpoint_every=1", "keep_checkpoint=true", "--no-report"
    )  # kept: the next call continues it
    _sweep(resumed, "rounds=5", "checkpoint_every=1")  # the same directory: continues both runs from round 3
    _sweep(straight, "rounds=5", "checkpoint_every=1", "--no-report")

    momentum = resumed / "runs" / "fedavg-client-momentum" / "seed-0"
    config = json.loads((momentum / "config.json").read_text())
    assert config["algorithm"] == {
        "name": "fedavg_client_momentum",
        "momentum": 0.5,
        "aggregation": "weighted",
        "incomplete": "drop",
    }
    assert [Path(p).name for p in config["plugins"]] == ["client_momentum.py"]
    run = json.loads((momentum / "run.json").read_text())
    assert run["status"] == "complete" and run["resumed_from_round"] == 3

    for method in ("fedavg", "fedavg-client-momentum"):  # a resumed run equals an uninterrupted one, bit for bit
        model = f"runs/{method}/seed-0/final_model.safetensors"
        assert (resumed / model).read_bytes() == (straight / model).read_bytes()
    # The plugin really trained with momentum (a plugin lost on the way would train FedAvg: same model).
    assert (resumed / "runs/fedavg/seed-0/final_model.safetensors").read_bytes() != (
        momentum / "final_model.safetensors"
    ).read_bytes()

    report = (resumed / "report" / "report.md").read_text()
    assert "| FedAvg + client momentum | 1 |" in report and "| FedAvg | 1 |" in report
