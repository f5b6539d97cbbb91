"""Tuned sweep axes and successive halving: refusals before any run, where tuned runs live, and exact extension."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driftlab.errors import ConfigError
from driftlab.experiments.sweep import (
    Halving,
    load_sweep,
    parse_halving,
    plan,
    run_status,
    run_sweep,
    sweep_document,
    sweep_from_table,
    sweep_names,
)
from driftlab.experiments.sweep.sweep_status import format_status, sweep_status

TINY = ["data.num_clients=6", "client.epochs=1", "sampling.participation=0.5", "evaluation.every=1"]
LR = {
    "name": "lr",
    "role": "tuned",
    "values": [{"label": f"lr={lr}", "set": [f"client.lr={lr}"]} for lr in (0.001, 0.01, 0.1)],
}


def tuned_spec(**changes):
    table = {
        "base": "synthetic-fedprox",
        "overrides": [*TINY, "rounds=3", "data.validation_fraction=0.2"],
        "seeds": [0, 1],
        "axes": [
            {
                "name": "data",
                "role": "setting",
                "values": [{"label": "syn(0,0)", "set": ["data.synthetic_alpha=0", "data.synthetic_beta=0"]}],
            },
            {
                "name": "method",
                "role": "method",
                "values": [
                    {"label": "FedAvg", "set": ["algorithm.mu=0"]},
                    {"label": "FedProx", "set": ["algorithm.mu=1"]},
                ],
            },
            LR,
        ],
    }
    table.update(changes)
    return sweep_from_table(table, "test sweep", "tuned")


# ---------------------------------------------------------------- planning


def test_tuned_runs_live_under_their_method_and_sweep_json_says_which_value_they_are():
    spec = tuned_spec()
    runs = plan(spec)
    assert len(runs) == 2 * 3 * 2
    assert runs[0].dir == "runs/syn-0-0/fedavg/lr-0.001/seed-0"
    assert (runs[0].setting, runs[0].method, runs[0].tuned, runs[0].tuned_method) == (
        "syn(0,0)",
        "FedAvg (lr=0.001)",
        "lr=0.001",
        "FedAvg",
    )
    assert runs[-1].dir == "runs/syn-0-0/fedprox/lr-0.1/seed-1"
    document = sweep_document(spec, runs, None, [])
    assert document["tuning"] == {"metric": "validation_accuracy", "rule": "final", "axes": ["lr"]}
    assert document["runs"][-1]["tuned"] == "lr=0.1" and document["runs"][-1]["tuned_method"] == "FedProx"
    assert "halving" not in document


def test_a_tuned_axis_without_a_method_axis_tunes_the_algorithm_of_the_base():
    runs = plan(tuned_spec(axes=[LR], seeds=[0]))
    assert [(r.dir, r.method) for r in runs] == [
        ("runs/fedprox/lr-0.001/seed-0", "FedProx (lr=0.001)"),
        ("runs/fedprox/lr-0.01/seed-0", "FedProx (lr=0.01)"),
        ("runs/fedprox/lr-0.1/seed-0", "FedProx (lr=0.1)"),
    ]


@pytest.mark.parametrize("name", [name for name in sweep_names() if not load_sweep(name).tuned_axes])
def test_untuned_sweeps_plan_and_document_as_before(name):
    spec = load_sweep(name)
    assert spec.tuning is None and spec.halving is None
    runs = plan(spec)
    document = sweep_document(spec, runs, None, [])
    assert "tuning" not in document and "halving" not in document
    assert all(set(entry) == {"dir", "setting", "method", "seed", "overrides"} for entry in document["runs"])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"axes": [{**LR, "values": LR["values"][:1]}]}, "tuned axis 'lr' has one value .* nothing to pick"),
        ({"tuning_metric": "validaton_accuracy", "axes": [LR]}, "did you mean 'validation_accuracy'"),
        ({"tuning_rule": "mean", "axes": [LR]}, "tuning_rule must be"),
        ({"tuning_metric": "validation_loss", "axes": []}, 'no axis has role = "tuned"'),
        ({"halving": {"first": 2}, "axes": []}, 'no axis has role = "tuned"'),
        ({"halving": {"first": 0, "eta": 3}, "axes": [LR]}, "first round R >= 1 and eta >= 2"),
        ({"halving": {"first": 2, "eta": 1}, "axes": [LR]}, "first round R >= 1 and eta >= 2"),
        ({"halving": {"start": 2}, "axes": [LR]}, r"`halving` is a table \{ first = R, eta = 3 \}"),
    ],
)
def test_bad_tuning_keys_are_refused_when_the_sweep_is_read(changes, message):
    with pytest.raises(ConfigError, match=message):
        tuned_spec(**changes)


def test_a_tuned_axis_without_validation_data_is_refused_before_any_run(tmp_path):
    spec = tuned_spec(overrides=[*TINY, "rounds=3"])
    with pytest.raises(ConfigError, match=r"data.validation_fraction is unset\); add \"data.validation_fraction=0.1\""):
        run_sweep(spec, tmp_path / "s", jobs=1, log=lambda _: None)
    assert not (tmp_path / "s" / "sweep.json").exists()


def test_halving_is_parsed_and_refused_where_it_cannot_apply(tmp_path):
    assert (
        parse_halving("2:3") == Halving(2, 3) and parse_halving("4") == Halving(4, 3) and parse_halving("off") is None
    )
    assert Halving(2, 3).rungs(20) == [2, 6, 18, 20] and Halving(5, 2).rungs(5) == [5]
    with pytest.raises(ConfigError, match="write R:ETA"):
        parse_halving("two:3")
    untuned = sweep_from_table({"base": "synthetic-fedprox", "overrides": TINY}, "s", "plain")
    with pytest.raises(ConfigError, match="sweep plain has none"):
        run_sweep(untuned, tmp_path / "plain", halving="2:3", log=lambda _: None)
    private = tuned_spec(
        axes=[LR],
        seeds=[0],
        halving={"first": 1},
        overrides=[
            *TINY,
            "rounds=3",
            "data.validation_fraction=0.2",
            "sampling.mode=poisson",
            "privacy.clip=1",
            "privacy.target_epsilon=3",
            "privacy.delta=1e-3",
        ],
    )
    with pytest.raises(ConfigError, match="depends on its rounds"):
        plan(private)


# ---------------------------------------------------------------- running


def records_without_wall_time(run_dir: Path) -> list[str]:
    """metrics.jsonl's lines, each without round_seconds (the one wall-clock number in a record)."""
    lines = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        record.pop("round_seconds")
        lines.append(json.dumps(record))
    return lines


@pytest.mark.slow
def test_halving_stops_the_worst_values_and_extending_them_gives_the_straight_runs_bytes(tmp_path):
    spec = tuned_spec(
        axes=[LR], seeds=[0], overrides=[*TINY, "rounds=6", "evaluation.every=4", "data.validation_fraction=0.2"]
    )
    logged: list[str] = []
    halved = run_sweep(spec, tmp_path / "halved", jobs=2, halving="2:3", log=logged.append)
    # rungs: every value to round 2, the best ⌈3/3⌉ = 1 on to round 6
    assert sorted(o.status for o in halved) == ["complete", "stopped", "stopped"]
    assert any("halving FedProx at round 2: 1 of 3 values go on" in line for line in logged)
    assert any("halving rung 1 (round 2)" in line for line in logged) and any(
        "halving rung 2 (round 6)" in line for line in logged
    )
    stopped = [o for o in halved if o.status == "stopped"]
    for outcome in stopped:
        run_dir = tmp_path / "halved" / outcome.run.dir
        assert json.loads((run_dir / "halving.json").read_text())["round"] == 2
        assert json.loads((run_dir / "run.json").read_text())["rounds_done"] == 2
        assert (run_dir / "checkpoint.safetensors").exists()  # kept, so extending it continues from round 2
        assert run_status(run_dir, 6) == "stopped"
        assert outcome.message.startswith("stopped by halving at round 2: final validation_accuracy")
    states = {s.dir: s for s in sweep_status(tmp_path / "halved")}
    assert sorted(s.state for s in states.values()) == ["done", "stopped", "stopped"]
    text = format_status(list(states.values()))
    assert "stopped      " + stopped[0].run.dir + "  2/6 rounds" in text and "    stopped by halving at round 2" in text

    # the report picks among the values that went on, and says which halving stopped
    from driftlab.experiments.report import make_report

    report = make_report([tmp_path / "halved"], tmp_path / "report", plots=False)
    assert {run.path.parent.name for run in report.runs} == {
        Path(o.run.dir).parent.name for o in halved if o.status == "complete"
    }
    assert report.markdown.count("| stopped by halving at round 2 |") == 2

    # the same command again reuses the rung's ranking and runs nothing
    logged.clear()
    again = run_sweep(spec, tmp_path / "halved", jobs=2, halving="2:3", log=logged.append)
    assert sorted(o.status for o in again) == ["complete", "stopped", "stopped"]
    assert not any("(resuming)" in line or "  start  " in line for line in logged)

    # without halving the stopped runs are extended (from their checkpoints) to the run made straight, byte for byte
    logged.clear()
    extended = run_sweep(spec, tmp_path / "halved", jobs=2, halving="off", log=logged.append)
    assert [o.status for o in extended] == ["complete"] * 3 and sum("(resuming)" in line for line in logged) == 2
    straight = run_sweep(spec, tmp_path / "straight", jobs=2, log=lambda _: None)
    for outcome in straight:
        halved_dir, straight_dir = tmp_path / "halved" / outcome.run.dir, tmp_path / "straight" / outcome.run.dir
        assert not (halved_dir / "halving.json").exists()
        assert records_without_wall_time(halved_dir) == records_without_wall_time(straight_dir)
        assert (halved_dir / "final_model.safetensors").read_bytes() == (
            straight_dir / "final_model.safetensors"
        ).read_bytes()
        assert json.loads((halved_dir / "config.json").read_text())["rounds"] == 6
    # round 2 was evaluated only because it ended a rung: the extended run's record drops it, as the straight run never had it
    assert ["validation_accuracy" in json.loads(line) for line in records_without_wall_time(halved_dir)] == [
        False,
        False,
        False,
        True,
        False,
        True,
    ]


@pytest.mark.slow
def test_a_first_rung_beyond_the_runs_last_round_runs_every_value_to_its_end_and_says_that_round(tmp_path):
    # a sweep file's halving sized for --scale paper (first rung 500) at a scale of fewer rounds: nothing is decided
    spec = tuned_spec(axes=[LR], seeds=[0], overrides=[*TINY, "rounds=3", "data.validation_fraction=0.2"])
    logged: list[str] = []
    outcomes = run_sweep(spec, tmp_path / "sweep", jobs=2, halving="500:4", log=logged.append)
    assert [o.status for o in outcomes] == ["complete"] * 3
    assert any("halving rung 1 (round 3)" in line for line in logged) and not any(
        "round 500" in line for line in logged
    )
    assert not any("halving FedProx at round" in line for line in logged)


def test_status_says_a_run_was_stopped_by_halving_and_a_dry_run_lists_it(tmp_path):
    (tmp_path / "sweep.json").write_text(
        json.dumps({"name": "s", "rounds": [6], "runs": [{"dir": "runs/a/lr-1/seed-0"}, {"dir": "runs/a/lr-2/seed-0"}]})
    )
    for name, done in (("lr-1", 6), ("lr-2", 2)):
        run_dir = tmp_path / "runs/a" / name / "seed-0"
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text("{}")
        (run_dir / "metrics.jsonl").write_text("")
        (run_dir / "run.json").write_text(json.dumps({"status": "complete", "rounds": done, "rounds_done": done}))
    message = (
        "stopped by halving at round 2: final validation_accuracy 0.5 ranked 2 of 2 values of FedAvg (the best 1 go on)"
    )
    (tmp_path / "runs/a/lr-2/seed-0/halving.json").write_text(json.dumps({"round": 2, "message": message}))
    states = sweep_status(tmp_path)
    assert [(s.state, s.rounds_done, s.rounds) for s in states] == [("done", 6, 6), ("stopped", 2, 6)]
    assert format_status(states).splitlines()[1:] == [
        "stopped      runs/a/lr-2/seed-0  2/6 rounds",
        f"    {message}",
        "2 runs: 1 done, 1 stopped",
    ]
    assert run_status(tmp_path / "runs/a/lr-2/seed-0", 6) == "stopped"
    assert run_status(tmp_path / "runs/a/lr-1/seed-0", 6) == "complete"
