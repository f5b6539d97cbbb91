"""``[personal_layers]`` through the config and the run (``feature.py``): plans, refusals, runs and resume."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import driftlab
from driftlab.errors import ConfigError
from driftlab.experiments.run.assembly import build_simulation
from driftlab.features.entry import RunFacts
from driftlab.models import build_model
from driftlab.personal import feature
from driftlab.personal.section import PersonalLayersConfig

FACTS = RunFacts(seed=0, rounds=1, num_clients=2, sampling_mode="uniform", participation=1.0, tensor_sizes=(6, 2))
BASE = {
    "rounds": 4,
    "data": {"num_clients": 6, "client_test_fraction": 0.2},
    "client": {"epochs": 1},
    "sampling": {"participation": 0.5},
    "evaluation": {"every": 1},
    "model": {"name": "mlp"},
    "algorithm": {"name": "fedavg", "aggregation": "uniform"},
}
BASE_BACKENDS = ("sequential", "vectorized")
MLP_NAMES, MLP_SIZES = zip(
    *((name, p.numel()) for name, p in build_model("mlp", (60,), 10).named_parameters()), strict=True
)


def test_nothing_kept_plans_without_names_and_records_the_split() -> None:
    plan = feature.plan(PersonalLayersConfig(), FACTS)
    assert plan.part.spans == () and plan.part.num_parameters == 8
    assert feature.run_info(plan) == {
        "personal_layers": {
            "personal": [],
            "personal_parameters": 0,
            "shared_parameters": 8,
            "personal_first_steps": 0,
        }
    }


def test_patterns_need_the_models_names_and_an_unknown_one_lists_them() -> None:
    with pytest.raises(ConfigError, match=r"RunFacts\.tensor_names"):
        feature.plan(PersonalLayersConfig(keep=("head",)), FACTS)
    named = dataclasses.replace(FACTS, tensor_sizes=MLP_SIZES, tensor_names=MLP_NAMES)
    assert feature.plan(PersonalLayersConfig(keep=("head",)), named).part.personal == MLP_NAMES[-2:]
    sim = SimpleNamespace(model=SimpleNamespace(names=("fc1.weight", "fc2.weight"), numels=(6, 2)))
    assert feature.used_plan(sim, PersonalLayersConfig(keep=("head",))).part.personal == ("fc2.weight",)
    with pytest.raises(ConfigError, match=r"'conv\*' matches none .* are: fc1\.weight, fc2\.weight"):
        feature.used_plan(sim, PersonalLayersConfig(keep=("conv*",)))


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"privacy": {"clip": 1.0, "noise_multiplier": 1.0}, "sampling": {"mode": "poisson"}}, "privacy"),
        ({"compression": {"ratio": 0.1}}, "compression.ratio"),
        ({"asynchronous": {"concurrency": 2, "buffer": 1}}, "asynchronous"),
    ],
)
def test_what_needs_one_shared_view_is_refused_by_the_config(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(
        ConfigError,
        match=rf"{key}: .* needs one view shared by every client.*remove .* or "
        r"\[personal_layers\]",
    ):
        driftlab.load_config({**BASE, **extra, "personal_layers": {"keep": ["head"]}})


def test_an_algorithm_without_a_release_form_is_refused_before_the_data() -> None:
    config = driftlab.load_config({**BASE, "algorithm": {"name": "fedavg"}, "personal_layers": {"keep": ["head"]}})
    with pytest.raises(ConfigError, match=r'\[personal_layers\] with .*set algorithm\.aggregation = "uniform"'):
        driftlab.run(config)


def test_nothing_kept_runs_as_the_plain_algorithm_bit_for_bit() -> None:
    plain = driftlab.run(driftlab.load_config(BASE))
    wrapped = driftlab.run(driftlab.load_config({**BASE, "personal_layers": {"keep": []}}))
    assert torch.equal(plain.final_params, wrapped.final_params)
    assert [r["test_accuracy"] for r in plain.records] == [r["test_accuracy"] for r in wrapped.records]


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_fedper_resumes_exactly_and_keeps_the_servers_head(backend: str, tmp_path: Path) -> None:
    table = {**BASE, "backend": backend, "keep_checkpoint": True, "personal_layers": {"keep": ["head"]}}
    straight = driftlab.run(driftlab.load_config(table), tmp_path / "straight")
    driftlab.run(driftlab.load_config({**table, "rounds": 2, "checkpoint_every": 1}), tmp_path / "resumed")
    resumed = driftlab.run(driftlab.load_config({**table, "checkpoint_every": 1}), tmp_path / "resumed", resume=True)
    assert torch.equal(straight.final_params, resumed.final_params)
    drop = ("round_seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in straight.records] == [
        {k: v for k, v in r.items() if k not in drop} for r in resumed.records
    ]
    assert all("personal_test_accuracy_mean" in record for record in straight.records)
    head = straight.final_params.numel() - 2010  # the mlp's last layer: 200·10 + 10 entries
    initial = build_simulation(driftlab.load_config(table))[0].initial_params
    assert torch.equal(straight.final_params[head:], initial[head:])
    info = json.loads((tmp_path / "straight" / "run.json").read_text())["personal_layers"]
    assert info["personal"] == list(MLP_NAMES[-2:]) and info["personal_parameters"] == 2010


def test_fedrep_agrees_on_both_backends() -> None:
    table = {
        **BASE,
        "rounds": 2,
        "precision": "float64",
        "client": {"steps": 4},
        "personal_layers": {"keep": ["head"], "personal_first_steps": 2},
    }
    runs = {backend: driftlab.run(driftlab.load_config({**table, "backend": backend})) for backend in BASE_BACKENDS}
    sequential, vectorized = runs["sequential"], runs["vectorized"]
    torch.testing.assert_close(sequential.final_params, vectorized.final_params, rtol=0, atol=1e-12)
    for first, second in zip(sequential.records, vectorized.records, strict=True):
        assert first["personal_test_accuracy_mean"] == pytest.approx(second["personal_test_accuracy_mean"], abs=1e-12)
