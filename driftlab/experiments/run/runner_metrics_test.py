"""What a run writes about its rounds: honest divergence, strict metrics.jsonl, metrics.csv, RunResult.frame()."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import driftlab
from driftlab.cli import main
from driftlab.experiments.run.instability import UnstableRunWarning
from driftlab.experiments.run.real_data import needs_real_data
from driftlab.experiments.run.run_directory import read_run_info
from driftlab.experiments.run.runner import RunResult
from driftlab.experiments.run.testing import without_wall_time

# The quadratic clients, two of them, trained one by one: rounds take milliseconds.
QUADRATIC = ["data.num_clients=2", "backend=sequential"]
# GD steps of size 1e5 on curvatures in [1, 3] multiply |x| by ~1e54 a round: in round 3 x is still finite, ½ z x² is not.
# The norm test (which stops this run in round 1) is off: these runs test the finiteness test.
OVERFLOWING = [
    *QUADRATIC,
    "client.lr=1e5",
    "rounds=6",
    "evaluation.every=1",
    "checkpoint_every=10",
    "evaluation.norm_growth_factor=0",
]
# Synthetic data with a step of 1e6: the round-1 model's loss is ~2.5 million times the initial model's, but finite.
EXPLODING = ["rounds=3", "data.num_clients=4", "client.steps=2", "backend=sequential", "client.lr=1e6"]


def _strict_records(path: Path) -> list[dict]:
    """Every line of a metrics.jsonl, read as strict JSON (NaN and Infinity are not JSON)."""

    def refuse(constant: str):
        raise ValueError(f"{path} holds {constant}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _csv_table(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    return rows[0], rows[1:]


def _assert_csv_matches(out: Path, records: list[dict]) -> None:
    """metrics.csv is ``records`` as a table: every key a column in first-seen order, a row per round,
    empty where a round lacks the key, every other cell the value's JSON text."""
    columns, rows = _csv_table(out / "metrics.csv")
    expected_columns: list[str] = []
    for record in records:
        expected_columns += [key for key in record if key not in expected_columns]
    assert columns == expected_columns
    assert len(rows) == len(records)
    for row, record in zip(rows, records, strict=True):
        assert len(row) == len(columns)
        for column, cell in zip(columns, row, strict=True):
            if record.get(column) is None:
                assert cell == ""
            else:
                assert (cell if isinstance(record[column], str) else json.loads(cell)) == record[column]


def _checkpoint_round(out: Path) -> int:
    with safe_open(str(out / "checkpoint.safetensors"), framework="pt") as handle:
        return int(handle.metadata()["round"])


# ------------------------------------------------------------------ divergence


def _divergence_message(out: Path, preset: str | None, overrides: list[str]) -> str:
    """The message of the FloatingPointError that stops the run of ``preset`` and ``overrides`` into ``out``."""
    with pytest.raises(FloatingPointError) as caught:
        driftlab.run(preset, out, overrides=overrides)
    return str(caught.value)


def test_a_diverged_round_is_neither_recorded_nor_checkpointed(tmp_path):
    out = tmp_path / "run"
    message = _divergence_message(out, "quadratic-constant-k", OVERFLOWING)
    assert message.startswith(
        "the run diverged in round 3: non-finite values test_loss=inf, train_loss=inf; lower client.lr"
    )
    assert (
        f"The checkpoint of round 2, the last healthy round, is kept in {out / 'checkpoint.safetensors'}; "
        f"{out / 'metrics.jsonl'} and metrics.csv hold rounds 1-2" in message
    )
    assert _checkpoint_round(out) == 2  # written on the way out: checkpoint_every=10 had written none
    records = _strict_records(out / "metrics.jsonl")
    assert [r["round"] for r in records] == [1, 2]
    assert all(abs(r["test_loss"]) < float("inf") for r in records)
    _assert_csv_matches(out, records)
    info = read_run_info(out)
    assert (info["status"], info["rounds_done"], info["message"]) == ("diverged", 2, message)
    assert not (out / "final_model.safetensors").exists()


def test_a_loss_far_above_the_initial_models_is_divergence_even_in_round_1(tmp_path):
    out = tmp_path / "run"
    message = _divergence_message(out, None, EXPLODING)
    assert message.startswith("the run diverged in round 1: train_loss is ")
    assert "times the initial model's" in message and "(more than evaluation.divergence_factor=1000)" in message
    assert "lower client.lr" in message and "raise evaluation.divergence_factor (0 = off)" in message
    assert message.endswith("No checkpoint exists and no round was recorded: the run diverged in its first round")
    assert sorted(p.name for p in out.iterdir() if p.name != ".lock") == ["config.json", "run.json"]
    info = read_run_info(out)
    assert (info["status"], info["rounds_done"]) == ("diverged", 0)


def test_divergence_factor_0_turns_the_loss_test_off_but_never_the_finiteness_test():
    result = driftlab.run(
        None, overrides=[*EXPLODING, "rounds=1", "evaluation.divergence_factor=0", "evaluation.norm_growth_factor=0"]
    )
    assert 1e6 < result.records[0]["train_loss"] < float("inf")
    with pytest.raises(FloatingPointError, match="round 1: model_norm is "):  # the norm test still stops it
        driftlab.run(None, overrides=[*EXPLODING, "rounds=1", "evaluation.divergence_factor=0"])
    with pytest.raises(FloatingPointError, match="round 3: non-finite values test_loss=inf"):
        driftlab.run("quadratic-constant-k", overrides=[*OVERFLOWING, "evaluation.divergence_factor=0"])


@pytest.mark.parametrize("key", ["divergence_factor", "norm_growth_factor"])
@pytest.mark.parametrize("factor", ["1", "0.5", "-2"])
def test_a_divergence_factor_that_is_no_growth_is_a_config_error(key, factor):
    with pytest.raises(driftlab.ConfigError, match=f"evaluation.{key}"):
        driftlab.load_config(None, [f"evaluation.{key}={factor}"])


# GD with step 0.9 on the quadratic clients (curvatures in [1, 3], x⁰ = 0): |x| grows ~1.7x a step, 10 steps a round.
# Rounds 1-2 stay below 1000 times the starting scale √1 = 1, round 3 passes it (model_norm 1816); none is evaluated.
GROWING = ["client.lr=0.9", "rounds=20", "evaluation.every=5", "checkpoint_every=1"]


def test_the_norm_test_stops_a_run_between_evaluations_and_keeps_only_healthy_rounds(tmp_path):
    out = tmp_path / "run"
    message = _divergence_message(out, "quadratic-constant-k", GROWING)
    assert message.startswith(
        "the run diverged in round 3: model_norm is 1816, 1.82e+03 times the model's starting scale 1 "
        "(the larger of the initial model's norm and √(number of parameters)), more than evaluation.norm_growth_factor=1000; "
        "lower client.lr (or server.lr), or set client.clip_norm, or raise evaluation.norm_growth_factor (0 = off)"
    )
    assert message.endswith(
        f"The checkpoint of round 2, the last healthy round, is kept in {out / 'checkpoint.safetensors'}; "
        f"{out / 'metrics.jsonl'} and metrics.csv hold rounds 1-2"
    )
    records = _strict_records(out / "metrics.jsonl")
    assert [r["round"] for r in records] == [1, 2] and all(r["model_norm"] <= 1000 for r in records)
    assert _checkpoint_round(out) == 2
    info = read_run_info(out)
    assert (info["status"], info["rounds_done"], info["message"]) == ("diverged", 2, message)
    # The threshold only watches: a run it stopped resumes with another (it is not part of the configuration's identity).
    resumed = driftlab.run(
        "quadratic-constant-k", out, resume=True, overrides=[*GROWING, "rounds=3", "evaluation.norm_growth_factor=0"]
    )
    assert [r["round"] for r in resumed.records] == [1, 2, 3] and resumed.records[2]["model_norm"] > 1000


def test_a_round_1_blow_up_between_evaluations_is_caught_in_round_1(tmp_path):
    # The issue's run at a tiny scale: synthetic data, η_l = 1e6, evaluated every 5 rounds; round 1's model norm is
    # millions of times the starting scale, where only round 5's loss used to be tested (round 1-4 were kept).
    out = tmp_path / "run"
    message = _divergence_message(out, None, [*EXPLODING, "rounds=20", "evaluation.every=5", "checkpoint_every=1"])
    assert (
        message.startswith("the run diverged in round 1: model_norm is ")
        and "more than evaluation.norm_growth_factor=1000" in message
    )
    assert message.endswith("No checkpoint exists and no round was recorded: the run diverged in its first round")
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoint.safetensors").exists()


@needs_real_data("mnist")
@pytest.mark.slow
def test_the_issues_mnist_run_stops_in_the_round_its_norm_explodes(tmp_path):
    # mnist-fedavg with η_l = 1, one epoch, evaluated every 10 rounds: round 1's norm is 444 (the starting scale is
    # √199210 = 446), round 2's 5.4e15, which used to be checkpointed as healthy.
    out = tmp_path / "run"
    with pytest.raises(FloatingPointError) as caught:
        driftlab.run(
            "mnist-fedavg",
            out,
            overrides=["client.lr=1.0", "client.epochs=1", "evaluation.every=10", "rounds=4", "checkpoint_every=1"],
        )
    message = str(caught.value)
    assert (
        message.startswith("the run diverged in round 2: model_norm is ")
        and "times the model's starting scale 446.3" in message
    )
    assert message.endswith(
        f"The checkpoint of round 1, the last healthy round, is kept in {out / 'checkpoint.safetensors'}; "
        f"{out / 'metrics.jsonl'} and metrics.csv hold round 1"
    )
    assert [r["round"] for r in _strict_records(out / "metrics.jsonl")] == [1] and _checkpoint_round(out) == 1


def test_the_cli_prints_the_divergence_message_once_and_exits_3(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "quadratic-constant-k", *OVERFLOWING, "--out", str(out), "--quiet"])
    error = capsys.readouterr().err
    assert code == 3
    assert error.startswith("driftlab: error: the run diverged in round 3: non-finite values test_loss=inf")
    assert (
        error.count("kept in") == 1 and f"The checkpoint of round 2, the last healthy round, is kept in {out}" in error
    )
    assert "Traceback" not in error


# ------------------------------------------------------------------ metrics.jsonl and metrics.csv


def test_metrics_csv_holds_what_metrics_jsonl_holds(tmp_path):
    out = tmp_path / "run"
    # evaluation every 2 rounds: round 1 lacks the evaluation keys, which come after all of its own
    overrides = [*QUADRATIC, "rounds=6", "evaluation.every=2"]
    result = driftlab.run("quadratic-constant-k", out, overrides=overrides)
    records = _strict_records(out / "metrics.jsonl")
    assert records == result.records
    _assert_csv_matches(out, records)
    columns, rows = _csv_table(out / "metrics.csv")
    assert columns[0] == "round" and columns.index("round_seconds") < columns.index(
        "test_loss"
    )  # first seen, not per record
    assert [row[columns.index("test_loss")] == "" for row in rows] == [True, False, True, False, True, False]
    assert json.loads(rows[0][columns.index("reporting_clients")]) == [0, 1]


def test_metrics_csv_follows_interrupts_kills_and_resumes(tmp_path):
    overrides = [*QUADRATIC, "rounds=6", "evaluation.every=2", "checkpoint_every=2"]
    reference = driftlab.run("quadratic-constant-k", tmp_path / "reference", overrides=overrides)

    # Ctrl-C after round 3: the run stops with round 3 checkpointed, and metrics.csv rewritten to match
    interrupted = tmp_path / "interrupted"

    def interrupt(record):
        if record["round"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        driftlab.run("quadratic-constant-k", interrupted, overrides=overrides, progress=interrupt)
    records = _strict_records(interrupted / "metrics.jsonl")
    assert [r["round"] for r in records] == [1, 2, 3]
    _assert_csv_matches(interrupted, records)

    # a kill after round 3: metrics.csv is still the table of the round-2 checkpoint, a prefix of metrics.jsonl
    running, killed = tmp_path / "running", tmp_path / "killed"

    def snapshot(record):
        if record["round"] == 3:
            shutil.copytree(running, killed)

    driftlab.run("quadratic-constant-k", running, overrides=overrides, progress=snapshot)
    _assert_csv_matches(killed, _strict_records(killed / "metrics.jsonl")[:2])

    for out in (interrupted, killed):
        resumed = driftlab.run("quadratic-constant-k", out, resume=True, overrides=overrides)
        records = _strict_records(out / "metrics.jsonl")
        assert without_wall_time(records) == without_wall_time(reference.records)
        assert records == resumed.records
        _assert_csv_matches(out, records)


# ------------------------------------------------------------------ RunResult.frame()


def _result() -> RunResult:
    records = [{"round": 1, "test_loss": 0.5}, {"round": 2, "test_loss": 0.25, "reporting_clients": [0, 1]}]
    return RunResult(driftlab.load_config(None), records, torch.zeros(1), 1)


def test_frame_without_pandas_says_how_to_get_it_and_what_works_without(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas now fails, as on a default install
    with pytest.raises(ImportError) as caught:
        _result().frame()
    message = str(caught.value)
    assert "pip install pandas" in message and "result.records" in message and "metrics.csv" in message


def test_frame_with_pandas_has_a_row_per_round():
    pd = pytest.importorskip("pandas")
    frame = _result().frame()
    assert isinstance(frame, pd.DataFrame)
    assert frame["round"].tolist() == [1, 2] and frame["test_loss"].tolist() == [0.5, 0.25]


# ------------------------------------------------------------------ the instability warning

# The issue's run (synthetic-fedavg with η_l = 5 ends "complete" with train loss 199.5 against the initial 2.996) with one
# local epoch: its loss is 25-45 times the initial one from round 1 on, so the default rule (5 rounds) flags it in round 5.
UNSTABLE = ["client.lr=5", "rounds=6", "client.epochs=1"]


def _flag(now: float) -> str:
    """The warning for the unstable run, whose round-5 train loss is ``now``.

    At η_l = 5 the loss is chaotic: its printed digits follow the machine's last bits (125.3 on one CPU, 125.5 on
    another), so a test takes them from the run's own record. The initial model's 2.996 is one forward pass of the
    seeded initial model (2.99600...), far from a rounding boundary of its four printed digits on any machine.
    """
    return (
        f"unstable run: the train loss was above 1.5 times the initial model's 2.996 at every evaluation of rounds 1-5 (now {now:.4g}); "
        "the run goes on, but lower client.lr (or server.lr) or set client.clip_norm to make it converge "
        "(evaluation.instability_factor and evaluation.instability_rounds set this warning; 0 rounds = off)"
    )


def _round_5_flag(records: list[dict]) -> str:
    (round_5,) = [record for record in records if record["round"] == 5]
    assert round_5["train_loss"] > 1.5 * 2.996 * 10  # far above the threshold: the flag does not hang on last bits
    return _flag(round_5["train_loss"])


def _flags(records: list[dict]) -> list[tuple[int, str]]:
    return [(r["round"], r["instability"]) for r in records if "instability" in r]


def test_a_run_whose_loss_stays_above_the_initial_is_flagged_once_in_its_records_run_json_and_a_warning(tmp_path):
    out = tmp_path / "run"
    with pytest.warns(UnstableRunWarning) as warned:
        result = driftlab.run("synthetic-fedavg", out, overrides=UNSTABLE)
    flag = _round_5_flag(result.records)
    assert [str(w.message) for w in warned if w.category is UnstableRunWarning] == [flag]
    assert _flags(result.records) == [(5, flag)] and _flags(_strict_records(out / "metrics.jsonl")) == [(5, flag)]
    info = read_run_info(out)
    assert info["status"] == "complete" and info["instability"] == {"round": 5, "message": flag}
    _assert_csv_matches(out, result.records)


@pytest.mark.slow
def test_the_progress_output_says_it_once(tmp_path, capsys):
    code = main(["run", "synthetic-fedavg", *UNSTABLE, "--out", str(tmp_path / "run")])
    error = capsys.readouterr().err
    flag = _round_5_flag(_strict_records(tmp_path / "run" / "metrics.jsonl"))
    assert code == 0 and error.count("warning: unstable run") == 1 and f"run: warning: {flag}\n" in error
    # --quiet has no progress output: the warning is one line of its own, without Python's source line
    assert main(["run", "synthetic-fedavg", *UNSTABLE, "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert capsys.readouterr().err == f"driftlab: warning: {flag}\n"


@pytest.mark.slow
def test_a_resumed_run_is_flagged_where_an_uninterrupted_one_is_and_never_twice(tmp_path, recwarn):
    whole = driftlab.run("synthetic-fedavg", tmp_path / "whole", overrides=[*UNSTABLE, "keep_checkpoint=true"])
    flag = _round_5_flag(whole.records)
    # Stopped before the flag: the resumed process goes on with the streak of rounds 1-4 and flags round 5.
    driftlab.run("synthetic-fedavg", tmp_path / "split", overrides=[*UNSTABLE, "rounds=4", "keep_checkpoint=true"])
    recwarn.clear()
    resumed = driftlab.run("synthetic-fedavg", tmp_path / "split", resume=True, overrides=UNSTABLE)
    assert [str(w.message) for w in recwarn if w.category is UnstableRunWarning] == [flag]
    assert without_wall_time(resumed.records) == without_wall_time(whole.records)
    assert read_run_info(tmp_path / "split")["instability"] == {"round": 5, "message": flag}
    recwarn.clear()
    # Stopped after the flag: the resumed process knows it from metrics.jsonl and says nothing again.
    longer = driftlab.run("synthetic-fedavg", tmp_path / "whole", resume=True, overrides=[*UNSTABLE, "rounds=8"])
    assert [r["round"] for r in longer.records] == list(range(1, 9)) and not [
        w for w in recwarn if w.category is UnstableRunWarning
    ]
    assert _flags(longer.records) == [(5, flag)] and read_run_info(tmp_path / "whole")["instability"] == {
        "round": 5,
        "message": flag,
    }


@pytest.mark.slow
def test_instability_rounds_0_turns_the_warning_off_and_a_healthy_run_is_never_flagged(recwarn):
    assert (
        _flags(driftlab.run("synthetic-fedavg", overrides=[*UNSTABLE, "evaluation.instability_rounds=0"]).records) == []
    )
    healthy = driftlab.run("synthetic-fedavg", overrides=["rounds=8", "client.epochs=1"]).records
    assert _flags(healthy) == [] and healthy[0]["train_loss"] > 2.996  # above the initial loss, though not for long
    assert not [w for w in recwarn if w.category is UnstableRunWarning]
