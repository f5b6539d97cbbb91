"""The prepared reproduction command for a GPU, run on a CPU: the sweep it writes, stopping at its budget and resuming."""

from __future__ import annotations

import json
import tomllib

import gpu_reproduce  # benchmarks/ is on sys.path: pytest puts a test file's directory there
import pytest

from driftlab.experiments.sweep.planning import plan
from driftlab.experiments.sweep.shipped import sweep_names, sweep_text
from driftlab.experiments.sweep.spec import load_sweep


@pytest.mark.parametrize("name", sweep_names())
def test_every_shipped_sweep_is_written_back_as_the_same_toml(name):
    sweep = tomllib.loads(sweep_text(name))
    assert tomllib.loads(gpu_reproduce.to_toml(sweep)) == sweep


def test_one_decay_replaces_the_decay_axis_by_one_override():
    sweep = tomllib.loads(sweep_text("feddyn-cifar10-partial"))
    single = gpu_reproduce.one_decay(sweep, 0.998)
    assert [axis["name"] for axis in single["axes"]] == ["partition", "method"]
    assert single["overrides"][-1] == 'client.lr={kind="exponential", initial=0.1, decay=0.998}'
    assert gpu_reproduce.one_decay(sweep, 1)["overrides"][-1] == "client.lr=0.1"
    quadratic = tomllib.loads(sweep_text("decaying-k-quadratic"))
    assert gpu_reproduce.one_decay(quadratic, 0.998) == quadratic  # no decay axis: unchanged


def test_the_written_sweep_plans_eight_runs_at_paper_scale(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(
        gpu_reproduce.to_toml(gpu_reproduce.one_decay(tomllib.loads(sweep_text("feddyn-cifar10-partial")), 0.998))
    )
    planned = plan(load_sweep(path), scale="paper")
    assert len(planned) == 8
    assert {run.config.rounds for run in planned} == {1000}


@pytest.mark.slow
def test_a_stopped_sweep_is_summarised_and_the_next_call_resumes_it(tmp_path, capsys):
    out, runs = tmp_path / "out", tmp_path / "runs"
    arguments = ["--sweep", "decaying-k-quadratic", "--scale", "none", "--runs", str(runs), "--jobs", "2"]
    assert gpu_reproduce.main(["--out", str(out), "--budget", "600", *arguments, "rounds=3"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["status"] == "finished" and first["runs"]
    assert all(run["rounds"] == 3 and run["rounds_this_call"] == 3 for run in first["runs"].values())
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "runs.tar.gz", "summary.json", "sweep.toml"]
    assert gpu_reproduce.main(["--out", str(out), "--budget", "600", *arguments, "rounds=5"]) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(run["rounds"] == 5 and run["rounds_this_call"] == 2 for run in second["runs"].values())


def test_an_unknown_sweep_is_refused_with_the_shipped_ones(tmp_path, capsys):
    assert gpu_reproduce.main(["--sweep", "nope", "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "'nope' is not a shipped sweep" in error and "feddyn-cifar10-partial" in error
    assert not (tmp_path / "out").exists()
