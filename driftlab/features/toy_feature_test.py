"""A feature defined here, in the test, plugs in as a registry entry with a section of its own and runs: assembly
refuses what it cannot take, wraps the algorithm with it, run.json records it and checkpoints keep its state, with no
central file touched."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pydantic import BaseModel

import driftlab
from driftlab.experiments.config import load_config
from driftlab.experiments.run.assembly import build_simulation, features_run_info
from driftlab.features import registry
from driftlab.features.capabilities import SHARED_VIEW, Reason, Requirements
from driftlab.features.entry import FeatureEntry, RunFacts
from driftlab.simulation.round.engine import run_round

BASE = {
    "seed": 0,
    "rounds": 2,
    "precision": "float64",
    "data": {"name": "quadratic1d", "num_clients": 4},
    "model": {"name": "quadratic", "start": 0.4},
    "client": {"lr": 0.1, "batch_size": 1000, "steps": 2},
    "sampling": {"participation": 1.0},
    "evaluation": {"every": 1},
}


class ToySection(BaseModel):
    scale: float = 0.5  # the initial model is scaled by this


@dataclasses.dataclass(frozen=True)
class ToyPlan:
    scale: float
    seed: int


def _plan(section: ToySection, facts: RunFacts) -> ToyPlan:
    return ToyPlan(section.scale, facts.seed)


def _wrap(algorithm, plan: ToyPlan):
    return dataclasses.replace(algorithm, server_init=lambda params: algorithm.server_init(params * plan.scale))


TOY = FeatureEntry(
    name="toy",
    plan=_plan,
    requirements=Requirements(
        "[toy]", needs=((SHARED_VIEW, Reason("the toy scales the one broadcast model", "remove [toy]")),)
    ),
    section_type=ToySection,
    wrap=_wrap,
    run_info=lambda plan: {"toy": {"scale": plan.scale, "seed": plan.seed}},
)


@pytest.fixture
def toy():
    registry.register(TOY)  # the conftest restores every registry after the test
    return TOY


def _with_toy(table: dict, scale: float = 0.5):
    return load_config(table).model_copy(update={"toy": ToySection(scale=scale)})


def _two_rounds(config) -> tuple[torch.Tensor, torch.Tensor, dict]:
    sim, state = build_simulation(config)
    start = state.server.params
    for _ in range(2):
        state, record = run_round(sim, state)
    return start, state.server.params, features_run_info(config, sim)


def test_a_feature_of_a_test_wraps_the_algorithm_runs_and_is_recorded(toy):
    plain_start, plain_end, plain_info = _two_rounds(load_config(BASE))
    start, end, info = _two_rounds(_with_toy(BASE))
    assert torch.equal(start, plain_start * 0.5) and float(plain_start) == pytest.approx(0.4)  # the wrap ran: θ⁰ scaled
    assert torch.isfinite(end).all() and not torch.equal(end, plain_end)
    assert info == {"toy": {"scale": 0.5, "seed": 0}} and plain_info == {}


def test_a_feature_of_a_test_is_refused_with_the_one_template(toy):
    config = _with_toy({**BASE, "algorithm": {"name": "fedamp"}})  # FedAMP sends each client a view of its own
    with pytest.raises(driftlab.ConfigError) as refused:
        build_simulation(config)
    assert (
        str(refused.value)
        == '[toy] with algorithm.name = "fedamp": the toy scales the one broadcast model: remove [toy]'
    )


def test_without_its_section_the_feature_is_off(toy):
    sim, state = build_simulation(load_config(BASE))
    assert torch.equal(state.server.params, sim.initial_params)


@dataclasses.dataclass(frozen=True)
class RoundsSeen:
    """A toy state extra: the round it was saved at, in the checkpoint's engine section, and what a resume read."""

    read: list

    def engine_tensors(self, state, disk_stores) -> dict[str, torch.Tensor]:
        return {"toy/round": torch.tensor(state.round)}

    def restored(self, sim, state, tensors) -> dict:
        self.read.append(int(tensors["toy/round"]))
        return {}


def test_a_feature_of_a_test_saves_its_state_in_the_checkpoint_and_reads_it_back(tmp_path):
    from driftlab.simulation.round.checkpointing import checkpointed_parts, record_template, restored_state
    from driftlab.simulation.state.checkpoint import load_checkpoint, save_checkpoint

    seen = RoundsSeen([])
    registry.register(dataclasses.replace(TOY, state_extra=seen))  # the conftest restores every registry
    sim, state = build_simulation(_with_toy(BASE))
    for _ in range(2):
        state, _ = run_round(sim, state)
    clients, stores, engine = checkpointed_parts(sim, state)
    assert sim.state_extras == (seen,) and list(engine) == ["toy/round"] and int(engine["toy/round"]) == 2
    save_checkpoint(tmp_path / "checkpoint", state.round, state.server, clients, "fp", stores, engine)
    fresh_sim, fresh = build_simulation(_with_toy(BASE))
    loaded = load_checkpoint(tmp_path / "checkpoint", fresh.server, record_template(fresh_sim, fresh), "fp", sim.device)
    assert restored_state(fresh_sim, fresh, loaded).round == 2 and seen.read == [2]
    plain, plain_state = build_simulation(load_config(BASE))  # without [toy]: no extra, no engine section
    assert plain.state_extras == () and checkpointed_parts(plain, plain_state)[2] == {}
