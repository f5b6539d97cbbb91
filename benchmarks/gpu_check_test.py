"""The prepared GPU command run on a CPU with ``--quick``: every step runs, its files and its JSON are complete, a failing or
slow step is recorded without costing the others (no timing assertions; the numbers mean nothing here)."""

from __future__ import annotations

import json
from pathlib import Path

import gpu_check  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import pytest
import torch

REPOSITORY = Path(gpu_check.__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_check_runs_every_step_and_writes_its_three_files(tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    assert gpu_check.main(["--quick", "--out", str(out), "--work", str(work), "--budget", "400"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads((out / "summary.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == [
        "layer_variants.json",
        "log.txt",
        "summary.json",
    ]  # at most 8 come back
    layers = summary["steps"]["layers"]
    assert layers["status"] == "passed"
    assert {(row["workload"], row["variant"]) for row in layers["variants"] if row["status"] == "ok"} >= {
        ("cnn", "grouped"),
        ("cnn", "unfold"),
        ("cnn", "loop"),
        ("lstm", "bmm"),
        ("lstm", "loop"),
    }
    assert summary["environment"]["torch"] == torch.__version__ and summary["environment"]["quick"] is True
    tests = summary["steps"]["tests"]
    assert tests["status"] == "passed" and tests["failures"] == []
    if not torch.cuda.is_available():
        assert "skipped" in tests["result"] and "passed" not in tests["result"]  # every CUDA test skips cleanly
    speed = summary["steps"]["speed"]
    float32_runs = [label for label, _, _ in gpu_check.SPEED_RUNS if label.endswith(("float32", "chunk-1"))]
    assert sorted(speed["runs"]) == sorted(float32_runs)
    assert all(run["status"] == "passed" for run in speed["runs"].values())
    assert {(row["run"], row["row"]) for row in speed["rows"]} == {
        (label, r) for label in float32_runs for r in ("vectorized", "reference")
    }
    assert all(row["median_seconds"] > 0 for row in speed["rows"])
    assert all(row["median_seconds"] > 0 for row in speed["rows"])
    precision = summary["steps"]["precision"]
    assert precision["status"] == "passed"
    expected = {"float32", "tf32", "bf16"} if torch.cuda.is_available() else {"float32", "bf16"}
    assert set(precision["runs"]) == expected and all(run["rounds"] == 2 for run in precision["runs"].values())


def test_a_step_past_its_limit_is_killed_and_recorded(tmp_path):
    with open(tmp_path / "log.txt", "w") as log:
        step = gpu_check.run_step(["python", "-c", "import time; print('started', flush=True); time.sleep(60)"], 2, log)
        failing = gpu_check.run_step(["python", "-c", "raise SystemExit(3)"], 30, log)
    assert step["status"] == "timed out after 2 s" and step["seconds"] < 30 and "started" in step["output"]
    assert failing["status"] == "failed (exit 3)"
    assert "timed out after 2 s" in (tmp_path / "log.txt").read_text()


def test_steps_past_the_budget_are_skipped_and_said(tmp_path, capsys):
    assert (
        gpu_check.main(
            [
                "--quick",
                "--out",
                str(tmp_path),
                "--work",
                str(tmp_path / "w"),
                "--budget",
                "0",
                "--steps",
                "layers,speed,precision",
            ]
        )
        == 0
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {run["status"] for run in summary["steps"]["speed"]["runs"].values()} == {
        "skipped: out of the command's time budget"
    }
    assert summary["steps"]["precision"]["status"] == "skipped: out of the command's time budget"
    assert summary["steps"]["layers"]["status"] == "skipped: out of the command's time budget"


def test_every_cuda_test_named_exists():
    for test in gpu_check.CUDA_TESTS:
        path, _, name = test.partition("::")
        assert (REPOSITORY / path).is_file(), path
        assert not name or f"def {name}(" in (REPOSITORY / path).read_text(), test


def test_the_speed_runs_cover_the_goals_models_and_precisions():
    runs = {label: arguments for label, arguments, _ in gpu_check.SPEED_RUNS}
    models = {arguments[arguments.index("--model") + 1] for arguments in runs.values()}
    assert models == {"mlp", "cnn", "lstm", "resnet18_gn"}
    for model in models:
        assert {f"{model}-tf32", f"{model}-bf16"} <= set(runs), model
    assert "1000" in runs["mlp-1000-float32"] and "100" in runs["cnn-float32"]
    with_reference = {
        label for label, arguments in runs.items() if "reference" in arguments[arguments.index("--rows") + 1]
    }
    assert with_reference == {"cnn-float32", "mlp-float32", "lstm-float32", "resnet18_gn-float32"}


def test_an_unknown_step_is_refused_with_the_steps_there_are(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--steps", "tests,bogus"]) == 2
    error = capsys.readouterr().err
    assert "unknown step(s) bogus" in error and "environment, tests, layers, speed, precision" in error
    assert not (tmp_path / "summary.json").exists()
