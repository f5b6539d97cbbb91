"""The own-model example: tiny_cnn.py registers a model a config can name, and its sweep against the zoo's CNN
runs from the repository root on real MNIST with no install, resumes without redoing work, and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from driftlab.errors import ConfigError
from driftlab.experiments.config import load_config
from driftlab.experiments.run.real_data import needs_real_data

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _driftlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "driftlab.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_the_plugin_model_is_named_in_a_config_and_its_key_is_checked():
    config = load_config({"plugins": [str(HERE / "tiny_cnn.py")]}, ["model.name=tiny_cnn", "model.channels=4"])
    assert config.model.channels == 4 and config.to_dict()["model"] == {"name": "tiny_cnn", "channels": 4}
    with pytest.raises(ConfigError, match="model.channels: Input should be greater than or equal to 1"):
        load_config({"plugins": [str(HERE / "tiny_cnn.py")]}, ["model.name=tiny_cnn", "model.channels=0"])


@pytest.mark.slow
@needs_real_data("mnist")
def test_the_sweep_runs_resumes_and_reports_from_the_repository_root(tmp_path):
    out = tmp_path / "out"
    first = _driftlab("sweep", "examples/own_model/sweep.toml", "--out", str(out), "--jobs", "1")
    assert first.returncode == 0, first.stderr
    runs = {"zoo-cnn": "cnn", "tiny-cnn-plugin": "tiny_cnn"}
    for folder, model in runs.items():
        config = json.loads((out / "runs" / folder / "seed-0" / "config.json").read_text())
        assert config["model"]["name"] == model
        assert [Path(plugin).name for plugin in config["plugins"]] == ["tiny_cnn.py"]
    written = {
        folder: (out / "runs" / folder / "seed-0" / "final_model.safetensors").stat().st_mtime_ns for folder in runs
    }
    again = _driftlab("sweep", "examples/own_model/sweep.toml", "--out", str(out), "--jobs", "1")
    assert again.returncode == 0, again.stderr
    assert "2 already finished, 0 to run" in again.stdout + again.stderr
    assert {
        folder: (out / "runs" / folder / "seed-0" / "final_model.safetensors").stat().st_mtime_ns for folder in runs
    } == written
    report = _driftlab("report", str(out), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    assert "| tiny CNN (plugin) | 1 |" in text and "| zoo CNN | 1 |" in text
