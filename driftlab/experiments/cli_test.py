"""The `driftlab` command line, run as a user runs it: a subprocess of `python -m driftlab.cli`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import driftlab
from driftlab import cli
from driftlab.experiments.config import ExperimentConfig, preset_names

REPO_ROOT = Path(driftlab.__file__).resolve().parents[1]
TINY = ["rounds=2", "client.epochs=none", "client.steps=2", "data.num_clients=5", "sampling.participation=0.4"]


def driftlab_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "driftlab.cli", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def _assert_clean_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("driftlab: error: "), result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    for fragment in fragments:
        assert fragment in result.stderr


def test_run_a_preset_with_overrides_then_resume_it(tmp_path):
    out = tmp_path / "run"
    result = driftlab_cli("run", "synthetic-fedavg", *TINY, "--out", out, "--quiet")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    assert summary["rounds"] == 2 and summary["target_accuracy"] == 0.7
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["num_reporting"] == 2 and r["local_steps"] == 4 for r in records)
    config = json.loads((out / "config.json").read_text())
    assert config["client"]["steps"] == 2 and "epochs" not in config["client"] and config["client"]["lr"] == 0.01
    assert (out / "final_model.safetensors").exists() and (out / "checkpoint.safetensors").exists()

    # the README's resume command: the stored config.json is a valid CONFIG, here extended by two rounds
    resumed = driftlab_cli("run", out / "config.json", "rounds=4", "--out", out, "--resume", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_presets_command():
    result = driftlab_cli("presets")
    assert result.returncode == 0
    configs, sweeps = result.stdout.split("sweeps (driftlab sweep NAME --out DIR):")
    assert configs.splitlines()[1:] == [f"  {name}" for name in preset_names()]
    assert "synthetic-fedavg" in configs and "mnist-fedadam" in configs
    from driftlab.experiments.sweep import sweep_names

    assert [line.split()[0] for line in sweeps.strip().splitlines()] == sweep_names()
    assert "fedprox-figure1" in sweeps and "μ = 0 vs μ = 1" in sweeps


def test_config_command_lists_every_key():
    result = driftlab_cli("config")
    assert result.returncode == 0
    for section in ("data", "model", "client", "server", "sampling", "evaluation"):
        for key in ExperimentConfig.model_fields[section].annotation.model_fields:
            assert f"{section}.{key} = " in result.stdout, f"{section}.{key}"
    for key in ("seed", "rounds", "device", "precision", "checkpoint_every"):
        assert f"  {key} = " in result.stdout


def test_config_command_resolves_a_config():
    result = driftlab_cli("config", "synthetic-fedavg", "client.lr=0.5")
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["client"]["lr"] == 0.5 and resolved["rounds"] == 200


def test_config_command_with_only_overrides(capsys):
    assert cli.main(["config", "client.lr=0.25", "rounds=3"]) == 0  # overrides of the defaults, no CONFIG
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["client"]["lr"] == 0.25 and resolved["rounds"] == 3


def test_run_help_mentions_the_keys():
    result = driftlab_cli("run", "--help")
    assert result.returncode == 0
    for key in ("client.lr", "client.steps", "sampling.participation", "server.optimizer", "data.name", "evaluation.every", "--resume"):
        assert key in result.stdout


def test_config_errors_exit_2_without_a_traceback(tmp_path, capsys):
    _assert_clean_error(driftlab_cli("run", "synthetic-fedavg", "client.lrr=0.1", "--out", tmp_path / "a"), "client.lrr", "unknown key")
    assert not (tmp_path / "a").exists()  # stopped before any work
    # the same entry point in-process (no interpreter start-up per case)
    for argv, fragment in [
        (["run", "synthetic-fedavg", "client.lr=-1", "--out", str(tmp_path / "b")], "client.lr"),
        (["run", "no-such-preset", "--out", str(tmp_path / "c")], "no-such-preset"),
        (["config", "synthetic-fedavg", "sampling.participation=2"], "sampling.participation"),
        (["run", "synthetic-fedavg", "algorithm.name=fedfoo", "--out", str(tmp_path / "d")], "unknown algorithm 'fedfoo'"),
        (["run", "synthetic-fedavg", "data.name=cifar", "--out", str(tmp_path / "e")], "data.name"),
    ]:
        assert cli.main(argv) == 2
        captured = capsys.readouterr()
        _assert_clean_error(subprocess.CompletedProcess(argv, 2, captured.out, captured.err), fragment)


def test_data_errors_exit_2_without_a_traceback(tmp_path):
    root = tmp_path / "mnist"
    root.mkdir()
    (root / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + (5).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2 + b"\x00" * 100)
    result = driftlab_cli("run", "mnist-fedavg", f"data.root={root}", "rounds=1", "--out", tmp_path / "run", "--quiet")
    _assert_clean_error(result, "train-images-idx3-ubyte")
    missing = driftlab_cli("run", "mnist-fedavg", f"data.root={tmp_path / 'nowhere'}", "--out", tmp_path / "run2", "--quiet")
    _assert_clean_error(missing, "nowhere")


def test_run_refusals_exit_2(tmp_path):
    out = tmp_path / "run"
    driftlab.run("synthetic-fedavg", out, overrides=TINY)
    _assert_clean_error(driftlab_cli("run", "synthetic-fedavg", *TINY, "--out", out, "--quiet"), "--resume")
    _assert_clean_error(driftlab_cli("run", "synthetic-fedavg", *TINY, "client.lr=0.3", "--out", out, "--resume", "--quiet"), "cannot resume")


def test_demo_writes_a_table_and_a_plot(tmp_path):
    out = tmp_path / "demo"
    result = driftlab_cli("demo", "rounds=2", "client.epochs=none", "client.steps=3", "--quiet", "--out", out)
    assert result.returncode == 0, result.stderr
    table = (out / "summary.md").read_text()
    assert "| FedAvg |" in table and "| FedAdam |" in table
    assert table in result.stdout or table.strip() in result.stdout
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for label in ("fedavg", "fedadam"):
        lines = (out / label / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["round"] for line in lines] == [1, 2]


def test_a_diverging_run_exits_3_with_advice_and_keeps_its_checkpoint(tmp_path):
    out = tmp_path / "diverged"
    result = subprocess.run(
        # gradient descent with step 10 on curvatures in [1, 3] grows |x| ~20x per step: inf within 25 rounds
        [sys.executable, "-m", "driftlab.cli", "run", "quadratic-constant-k", "client.lr=10", "rounds=40", "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3, result.stderr
    assert "diverged" in result.stderr and "lower client.lr" in result.stderr
    assert "Traceback" not in result.stderr
    assert (out / "config.json").exists() and (out / "checkpoint.safetensors").exists()
    rounds_written = len((out / "metrics.jsonl").read_text().splitlines())
    assert 0 < rounds_written < 40


def test_sweep_with_grid_runs_every_variant_then_reports(tmp_path):
    out = tmp_path / "sweep"
    result = driftlab_cli("sweep", "synthetic-fedprox", *TINY, "--grid", "algorithm.mu=[0, 1]", "--seeds", "0,1", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "sweep finished: 4 complete" in result.stdout
    runs = sorted(p.parent.relative_to(out).as_posix() for p in out.glob("runs/*/*/metrics.jsonl"))
    assert runs == ["runs/algorithm.mu-0/seed-0", "runs/algorithm.mu-0/seed-1", "runs/algorithm.mu-1/seed-0", "runs/algorithm.mu-1/seed-1"]
    report = (out / "report" / "report.md").read_text()
    assert "| algorithm.mu=0 | 2 |" in report and "| algorithm.mu=1 | 2 |" in report  # one accuracy row per method, 2 seeds each

    listed = driftlab_cli("sweep", "synthetic-fedprox", *TINY, "--grid", "algorithm.mu=[0, 1]", "--seeds", "0,1", "--out", out, "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()] == ["complete"] * 4

    again = driftlab_cli("report", out, "--out", tmp_path / "again", "--targets", "0.2,0.3", "--no-plots")
    assert again.returncode == 0, again.stderr
    assert "Communication to reach 20% test accuracy" in again.stdout and "Communication to reach 30% test accuracy" in again.stdout
    assert not list((tmp_path / "again").glob("*.png"))


def test_sweep_and_report_errors_are_clean(tmp_path):
    _assert_clean_error(driftlab_cli("sweep", "no-such-thing", "--out", tmp_path / "x"), "neither a sweep nor a config", "fedprox-figure1", "synthetic-fedprox")
    _assert_clean_error(driftlab_cli("sweep", "fedprox-figure1", "--seeds", "0,0", "--out", tmp_path / "x"), "lists a seed twice")
    _assert_clean_error(driftlab_cli("sweep", "synthetic-fedprox", "--seeds", "a,b", "--out", tmp_path / "x"), "--seeds takes comma-separated integers")
    _assert_clean_error(driftlab_cli("sweep", "fedprox-figure1", "--grid", "algorithm.mu=[0]", "--out", tmp_path / "x"), "add axes to it instead of --grid")
    _assert_clean_error(driftlab_cli("sweep", "fedprox-figure1", "--scale", "huge", "--out", tmp_path / "x", "--dry-run"), "no scale 'huge'; its scales: paper")
    _assert_clean_error(driftlab_cli("sweep", "synthetic-fedprox", "--grid", "algorithm.muu=[0]", "--out", tmp_path / "x"), "algorithm.muu: unknown key")
    _assert_clean_error(driftlab_cli("report", tmp_path / "nothing-here", "--out", tmp_path / "r"), "nothing-here")
    _assert_clean_error(driftlab_cli("report", tmp_path, "--out", tmp_path / "r", "--targets", "high"), "--targets takes comma-separated numbers")
    assert not (tmp_path / "x").exists()  # nothing started
