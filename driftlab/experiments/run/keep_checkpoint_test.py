"""A completed run keeps its final model, config and metrics, and drops its checkpoint unless ``keep_checkpoint``:
resuming it still returns the same result, and raising ``rounds`` still gives the numbers of the longer run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import driftlab
from driftlab.experiments.config import ConfigError, load_config
from driftlab.experiments.run.testing import run_records, without_wall_time

# FedDyn keeps a state per client, and the all-clients mean keeps every client's latest model: the heaviest checkpoint.
TINY = [
    "rounds=4",
    "seed=3",
    "data.num_clients=6",
    "sampling.participation=0.5",
    "client.steps=2",
    "checkpoint_every=2",
    "algorithm.name=feddyn",
    "evaluation.model=all_clients_mean",
]


def test_a_completed_run_drops_its_checkpoint_and_a_kept_one_stays(tmp_path):
    light = driftlab.run(None, tmp_path / "light", overrides=TINY)
    assert sorted(p.name for p in (tmp_path / "light").iterdir()) == [
        ".lock",
        "config.json",
        "final_model.safetensors",
        "final_state_dict.safetensors",
        "metrics.csv",
        "metrics.jsonl",
        "run.json",
    ]
    assert torch.equal(load_file(str(tmp_path / "light" / "final_model.safetensors"))["params"], light.final_params)
    kept = driftlab.run(None, tmp_path / "kept", overrides=[*TINY, "keep_checkpoint=true"])
    assert (tmp_path / "kept" / "checkpoint.safetensors").is_file()
    assert torch.equal(kept.final_params, light.final_params)  # the key changes what stays on disk, never a number
    assert load_config(None, [*TINY, "keep_checkpoint=true"]).fingerprint() == load_config(None, TINY).fingerprint()


def test_a_disk_store_run_drops_its_client_state_files_too(tmp_path):
    out = tmp_path / "run"
    driftlab.run(None, out, overrides=[*TINY, "state.store=disk"])
    assert not (out / "client_state").exists() and not (out / "checkpoint.safetensors").exists()
    driftlab.run(None, tmp_path / "kept", overrides=[*TINY, "state.store=disk", "keep_checkpoint=true"])
    assert (tmp_path / "kept" / "client_state").is_dir() and (tmp_path / "kept" / "checkpoint.safetensors").is_file()


def test_resuming_a_completed_run_without_its_checkpoint_runs_nothing_and_returns_its_result(tmp_path):
    out = tmp_path / "run"
    first = driftlab.run(None, out, overrides=TINY)
    seen: list[dict] = []
    again = driftlab.run(None, out, resume=True, overrides=TINY, progress=seen.append)
    assert seen == []  # no round ran again
    assert again.records == first.records == run_records(out)  # wall times included: nothing was recomputed
    assert torch.equal(again.final_params, first.final_params)
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    assert not (out / "checkpoint.safetensors").exists()


@pytest.mark.slow
def test_raising_rounds_of_a_completed_run_without_its_checkpoint_gives_the_longer_runs_numbers(tmp_path):
    longer = [*TINY, "rounds=6"]
    whole = driftlab.run(None, tmp_path / "whole", overrides=longer)
    driftlab.run(None, tmp_path / "run", overrides=TINY)
    extended = driftlab.run(
        None, tmp_path / "run", resume=True, overrides=longer
    )  # from round 0: no checkpoint was kept
    assert (
        without_wall_time(extended.records)
        == without_wall_time(whole.records)
        == without_wall_time(run_records(tmp_path / "run"))
    )
    assert torch.equal(extended.final_params, whole.final_params)
    driftlab.run(None, tmp_path / "kept", overrides=[*TINY, "keep_checkpoint=true"])
    seen: list[dict] = []
    continued = driftlab.run(None, tmp_path / "kept", resume=True, overrides=longer, progress=seen.append)
    assert [r["round"] for r in seen] == [5, 6]  # from the kept checkpoint
    assert without_wall_time(continued.records) == without_wall_time(whole.records)
    assert torch.equal(continued.final_params, whole.final_params)
    assert not (tmp_path / "kept" / "checkpoint.safetensors").exists()  # the longer run's own keep_checkpoint (false)


@pytest.mark.slow
def test_a_sweep_extends_its_completed_runs_and_may_start_keeping_checkpoints(tmp_path):
    from driftlab.experiments.sweep import run_sweep, sweep_from_table

    spec = sweep_from_table(
        {
            "base": "synthetic-fedprox",
            "overrides": ["data.num_clients=6", "client.epochs=1", "rounds=2"],
            "seeds": [0],
            "axes": [{"name": "mu", "values": [{"label": "m", "set": ["algorithm.mu=0.1"]}]}],
        },
        "keep-checkpoint sweep",
        "tiny",
    )
    first = run_sweep(spec, tmp_path / "s", jobs=1, log=lambda _: None)
    run_dir = tmp_path / "s" / first[0].run.dir
    assert first[0].status == "complete" and not (run_dir / "checkpoint.safetensors").exists()
    logged: list[str] = []
    longer = run_sweep(
        spec, tmp_path / "s", jobs=1, extra_overrides=["rounds=3", "keep_checkpoint=true"], log=logged.append
    )
    assert longer[0].status == "complete" and any("(resuming)" in line for line in logged)
    assert (run_dir / "checkpoint.safetensors").is_file()  # kept from now on: a later extension continues from it
    straight = run_sweep(spec, tmp_path / "straight", jobs=1, extra_overrides=["rounds=3"], log=lambda _: None)
    assert without_wall_time(run_records(run_dir)) == without_wall_time(
        run_records(tmp_path / "straight" / straight[0].run.dir)
    )


@pytest.mark.slow
def test_the_demo_runs_again_into_its_folder_and_returns_the_same_runs(tmp_path):
    from driftlab.experiments.run.demo import run_demo

    overrides = ("rounds=1", "client.epochs=none", "client.steps=2")
    first = run_demo(tmp_path, overrides, progress=False)
    again = run_demo(tmp_path, overrides, progress=False)  # its runs completed and dropped their checkpoints
    assert [label for label, _ in again] == [label for label, _ in first]
    for (_, a), (_, b) in zip(first, again, strict=True):
        assert a.records == b.records and torch.equal(a.final_params, b.final_params)


def test_a_completed_run_without_its_checkpoint_is_never_cut_short(tmp_path):
    out = tmp_path / "run"
    driftlab.run(None, out, overrides=TINY)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    with pytest.raises(
        ConfigError, match=r"cannot resume: the run in .* has 4 rounds done, past rounds=3; set rounds to at least 4"
    ):
        driftlab.run(None, out, resume=True, overrides=[*TINY, "rounds=3"])
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == before
