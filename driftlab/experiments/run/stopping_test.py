"""``evaluation.stop_at``: the rules on hand-written records, then tiny runs that stop at the hand-checked round,
resume to the same round after a kill, stay finished when resumed, and show as finished in sweeps and reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.experiments.config import ConfigError, load_config
from driftlab.experiments.config.schema import StopAtConfig
from driftlab.experiments.pinned_runs_test import TINY_RUN
from driftlab.experiments.report import make_report
from driftlab.experiments.run import lifecycle
from driftlab.experiments.run.assembly import build_simulation
from driftlab.experiments.run.run_directory import finished, stopped_round
from driftlab.experiments.run.runner import SimulatorDriver
from driftlab.experiments.run.stopping import StopWatch
from driftlab.experiments.run.testing import FEDBUFF_RUN, without_wall_time
from driftlab.experiments.sweep.sweep_status import format_status, sweep_status

# Its test accuracy by round (hand-checked from a run): 0.0976, 0.1398, 0.8522, 0.8522, 0.8522, 0.8707, 0.9446,
# 0.9894; test loss falls every round.
TINY = [
    "rounds=8",
    "data.num_clients=4",
    "sampling.participation=0.5",
    "client.steps=2",
    "seed=3",
    "backend=sequential",
]
AT_90 = 'evaluation.stop_at={metric = "test_accuracy", value = 0.9}'  # first met at round 7 (0.9446)
FLAT_2 = 'evaluation.stop_at={metric = "test_accuracy", patience = 2}'  # best 0.8522 at round 3; rounds 4, 5 flat


def _rule(**fields) -> StopAtConfig:
    return StopAtConfig(**fields)


def _records(*values: float | None, metric: str = "test_accuracy") -> list[dict]:
    return [{"round": t, **({} if v is None else {metric: v})} for t, v in enumerate(values, start=1)]


def _stop_round(rules, records) -> int | None:
    stop = StopWatch(rules).replay(records)
    return None if stop is None else stop.met_at


def test_a_value_is_reached_upwards_for_accuracies_and_downwards_for_losses():
    assert _stop_round([_rule(metric="test_accuracy", value=0.5)], _records(0.2, 0.49, 0.5, 0.7)) == 3
    assert _stop_round([_rule(metric="test_loss", value=1.0)], _records(3.0, 1.2, 0.99, 2.0, metric="test_loss")) == 3
    assert _stop_round([_rule(metric="test_loss", value=1.0, mode="max")], _records(0.5, 1.0, metric="test_loss")) == 2
    assert _stop_round([_rule(metric="test_accuracy", value=0.9)], _records(0.2, 0.5)) is None


def test_patience_counts_evaluated_rounds_without_an_improvement_beyond_min_delta():
    # best 0.5 at round 1; 0.55 improves by more than 0.01 (round 2); 0.555, 0.56 do not (0.01 needed): stop at round 4
    rule = _rule(metric="test_accuracy", patience=2, min_delta=0.01)
    assert _stop_round([rule], _records(0.5, 0.55, 0.555, 0.56, 0.9)) == 4
    # without min_delta every rise counts: never two flat rounds in a row
    assert _stop_round([_rule(metric="test_accuracy", patience=2)], _records(0.5, 0.55, 0.555, 0.56, 0.9)) is None
    # losses improve downwards; rounds without evaluation (None) neither count nor reset
    loss = _rule(metric="test_loss", patience=2)
    assert _stop_round([loss], _records(2.0, None, 1.0, 1.5, None, None, 1.0, 0.5, metric="test_loss")) == 7


def test_the_first_rule_met_stops_and_the_reason_names_it():
    rules = [_rule(metric="test_loss", patience=1), _rule(metric="test_accuracy", value=0.8)]
    records = [
        {"round": 1, "test_loss": 2.0, "test_accuracy": 0.5},
        {"round": 2, "test_loss": 1.0, "test_accuracy": 0.85},
    ]
    stop = StopWatch(rules).replay(records)
    assert (stop.met_at, stop.rule.metric) == (2, "test_accuracy")
    assert stop.reason == "test_accuracy = 0.85 >= 0.8 at round 2"
    info = stop.info(5)  # a rule tightened on a resume, met at round 2 while 5 had run: the run ends at 5
    assert (info["round"], info["met_at"]) == (5, 2) and "ended there" in info["reason"]


def test_a_metric_the_run_does_not_record_is_named_with_what_it_records():
    watch = StopWatch([_rule(metric="personal_test_accuracy_mean", value=0.9)])
    with pytest.raises(
        ConfigError, match=r"watches personal_test_accuracy_mean, but round 1's evaluation recorded test_loss"
    ):
        watch.observe({"round": 1, "test_loss": 1.0})
    assert watch.observe({"round": 2, "round_seconds": 0.1}) is None  # not evaluated: nothing to check


def test_the_config_refuses_an_unknown_metric_and_a_rule_without_a_target():
    with pytest.raises(
        ConfigError, match=r"unknown metric 'accuracy'; an evaluated round records test_loss, train_loss, test_accuracy"
    ):
        load_config(None, ['evaluation.stop_at={metric = "accuracy", value = 0.9}'])
    with pytest.raises(ConfigError, match="give a value, a patience or both"):
        load_config(None, ['evaluation.stop_at={metric = "test_loss"}'])
    with pytest.raises(ConfigError, match="min_delta applies to patience only"):
        load_config(None, ['evaluation.stop_at={metric = "test_loss", value = 1, min_delta = 0.1}'])
    two = load_config(
        None, ['evaluation.stop_at=[{metric = "test_loss", patience = 3}, {metric = "test_accuracy", value = 0.9}]']
    )
    assert [rule.direction for rule in two.evaluation.stop_rules] == ["min", "max"]


def test_stop_at_unset_leaves_the_config_and_its_fingerprint_as_before_and_set_it_only_ends_runs():
    plain, stopping = load_config(None, TINY), load_config(None, [*TINY, AT_90])
    assert "stop_at" not in plain.to_dict()["evaluation"]
    assert load_config(None, [*TINY, "evaluation.stop_at=[]"]).to_dict() == plain.to_dict()
    assert stopping.to_dict()["evaluation"]["stop_at"] == [{"metric": "test_accuracy", "value": 0.9, "min_delta": 0.0}]
    assert stopping.fingerprint() == plain.fingerprint()  # a run resumes with another rule


def _info(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def test_a_run_stops_complete_after_the_round_that_reaches_the_value(tmp_path):
    out = tmp_path / "run"
    result = driftlab.run(None, out, overrides=[*TINY, AT_90])
    assert [r["round"] for r in result.records] == list(range(1, 8))
    assert result.records[-1]["test_accuracy"] >= 0.9 > result.records[-2]["test_accuracy"]
    info = _info(out)
    assert (info["status"], info["rounds"], info["rounds_done"]) == ("complete", 8, 7)
    assert info["stopped"]["round"] == info["stopped"]["met_at"] == 7 and info["stopped"]["metric"] == "test_accuracy"
    assert result.stopped == info["stopped"]
    assert torch.equal(load_file(str(out / "final_model.safetensors"))["params"], result.final_params)
    assert not (out / "checkpoint.safetensors").exists()  # a completed run's, as without keep_checkpoint
    assert stopped_round(info) == 7 and finished(info, 8)
    # the same seven rounds as the run without the rule: stopping changes no number
    full = driftlab.run(None, overrides=TINY)
    assert without_wall_time(result.records) == without_wall_time(full.records[:7])


def test_patience_stops_after_two_flat_evaluated_rounds(tmp_path):
    result = driftlab.run(None, tmp_path / "run", overrides=[*TINY, FLAT_2])
    assert result.records[-1]["round"] == 5
    assert _info(tmp_path / "run")["stopped"]["reason"] == (
        "test_accuracy has not improved on its best, 0.852243 at round 3, for 2 evaluated rounds (round 5)"
    )


class _KilledAt(SimulatorDriver):
    """The simulator's driver, interrupted (as by Ctrl-C) when it is asked for round ``killed_at``."""

    def __init__(self, sim, killed_at: int):
        super().__init__(sim)
        object.__setattr__(self, "killed_at", killed_at)

    def run_round(self, state, evaluate_after):
        if state.round + 1 == self.killed_at:
            raise KeyboardInterrupt
        return super().run_round(state, evaluate_after)


@pytest.mark.parametrize("rule, killed_at", [(FLAT_2, 5), (AT_90, 7)])
def test_a_run_killed_before_it_stops_resumes_to_the_same_round_and_model(tmp_path, rule, killed_at):
    overrides = [*TINY, rule, "checkpoint_every=3"]
    straight = driftlab.run(None, tmp_path / "straight", overrides=overrides)
    out = tmp_path / "killed"
    out.mkdir()
    config = load_config(None, overrides)
    sim, state = build_simulation(config)
    with pytest.raises(
        KeyboardInterrupt
    ):  # checkpoint at round killed_at - 1; patience mid-count at 4 (one flat round)
        lifecycle.run_rounds(_KilledAt(sim, killed_at), out, config, sim, state)
    assert _info(out)["status"] == "interrupted" and "stopped" not in _info(out)
    resumed = driftlab.run(None, out, resume=True, overrides=overrides)
    assert without_wall_time(resumed.records) == without_wall_time(straight.records)
    assert torch.equal(resumed.final_params, straight.final_params)
    assert _info(out)["stopped"] == _info(tmp_path / "straight")["stopped"]


def test_a_stopped_run_resumed_runs_nothing_even_with_more_rounds_and_a_looser_rule_goes_on(tmp_path):
    out = tmp_path / "run"
    first = driftlab.run(None, out, overrides=[*TINY, AT_90])
    seen: list[dict] = []
    again = driftlab.run(None, out, resume=True, overrides=[*TINY, AT_90, "rounds=20"], progress=seen.append)
    assert seen == [] and again.records == first.records  # finished: its target was met at round 7
    assert torch.equal(again.final_params, first.final_params)
    assert (_info(out)["status"], _info(out)["rounds_done"], _info(out)["stopped"]["round"]) == ("complete", 7, 7)
    # A higher target is not met by round 7: the run goes on (from round 0, its checkpoint dropped: the same numbers)
    higher = driftlab.run(
        None, out, resume=True, overrides=[*TINY, 'evaluation.stop_at={metric = "test_accuracy", value = 0.95}']
    )
    assert higher.records[-1]["round"] == 8 and _info(out)["stopped"]["round"] == 8
    assert without_wall_time(higher.records) == without_wall_time(driftlab.run(None, overrides=TINY).records)


def test_a_tightened_rule_ends_a_resumed_run_at_its_last_round(tmp_path):
    out = tmp_path / "run"
    driftlab.run(None, out, overrides=[*TINY, "rounds=4", "keep_checkpoint=true"])
    lower = 'evaluation.stop_at={metric = "test_accuracy", value = 0.5}'  # met at round 3 (0.8522), but 4 has run
    seen: list[dict] = []
    resumed = driftlab.run(
        None, out, resume=True, overrides=[*TINY, "keep_checkpoint=true", lower], progress=seen.append
    )
    assert seen == [] and resumed.records[-1]["round"] == 4  # rounds run are never undone
    assert (_info(out)["stopped"]["round"], _info(out)["stopped"]["met_at"]) == (4, 3)


def test_a_sweep_counts_a_stopped_run_done_and_the_report_shows_its_round(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"name": "s", "rounds": [8], "runs": [{"dir": "runs/a"}]}))
    driftlab.run(None, sweep / "runs/a", overrides=[*TINY, AT_90])
    [state] = sweep_status(sweep)
    assert (state.state, state.rounds_done, state.rounds) == ("done", 7, 8)
    assert "ended by evaluation.stop_at: test_accuracy = 0.944" in format_status([state])
    make_report([sweep / "runs/a"], tmp_path / "report", plots=False)
    text = (tmp_path / "report" / "report.md").read_text()
    assert "stopped at round 7 (evaluation.stop_at)" in text and "unfinished" not in text
    runs_csv = (tmp_path / "report" / "runs.csv").read_text().splitlines()
    assert runs_csv[0].split(",")[-1] == "stopped_at_round" and runs_csv[1].split(",")[-1] == "7"


def test_an_asynchronous_run_stops_too_and_a_copy_taken_mid_run_resumes_to_the_same_update(tmp_path):
    # FedBuff's test accuracy by server update: 0.5458, 0.4883, 0.5373, 0.3305, ...: three flat updates end it at 4
    fedbuff = [
        *FEDBUFF_RUN,
        'evaluation.stop_at={metric = "test_accuracy", patience = 3}',
        "keep_checkpoint=true",
    ]
    out, killed = tmp_path / "run", tmp_path / "killed"

    def snapshot(record):  # as a kill after update 3's record leaves it: checkpoint at 2, records 1-3, "running"
        if record["round"] == 3:
            shutil.copytree(out, killed)

    straight = driftlab.run(None, out, overrides=fedbuff, progress=snapshot)
    assert straight.records[-1]["round"] == 4 and _info(out)["stopped"]["round"] == 4
    assert _info(killed)["status"] == "running"
    resumed = driftlab.run(None, killed, resume=True, overrides=fedbuff)
    assert without_wall_time(resumed.records) == without_wall_time(straight.records)
    assert torch.equal(resumed.final_params, straight.final_params)
    assert _info(killed)["stopped"] == _info(out)["stopped"]


def test_a_deployment_stops_at_the_round_the_simulator_stops_at(tmp_path):
    from driftlab.deploy.server import run_in_process

    # test loss by round: 2.2135, 2.1105, 1.3223, 1.5697, 1.9347, 0.9503: two rounds above the best (round 3) end it at 5
    config = load_config(
        None,
        [
            *TINY_RUN,
            "backend=sequential",
            "rounds=6",
            'evaluation.stop_at={metric = "test_loss", patience = 2}',
        ],
    )
    simulated = driftlab.run(config, tmp_path / "simulated")
    deployed = run_in_process(config, tmp_path / "deployed", tmp_path / "node_state", num_nodes=2)
    assert simulated.records[-1]["round"] == deployed.records[-1]["round"] == 5
    assert torch.equal(deployed.final_params, simulated.final_params)
    assert _info(tmp_path / "deployed")["stopped"] == _info(tmp_path / "simulated")["stopped"]


def test_a_sweep_counts_a_stopped_run_finished_and_a_halving_rung_passed(tmp_path):
    # A second `driftlab sweep` must not start a run its stop rule ended (run_status), nor a rung it stopped before.
    from driftlab.experiments.sweep.directory import run_status
    from driftlab.experiments.sweep.execution import _reached

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stopped = {"status": "complete", "rounds_done": 7, "stopped": {"round": 7, "met_at": 7, "metric": "test_accuracy"}}
    (run_dir / "run.json").write_text(json.dumps(stopped), encoding="utf-8")
    assert run_status(run_dir, 20) == "complete" and _reached(run_dir, 10)
    (run_dir / "run.json").write_text(json.dumps({"status": "complete", "rounds_done": 7}), encoding="utf-8")
    assert run_status(run_dir, 20) == "interrupted" and not _reached(run_dir, 10)  # a shorter run, not a stopped one
