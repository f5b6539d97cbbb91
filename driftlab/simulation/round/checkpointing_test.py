"""A state's checkpoint parts: the extras write the engine section's old names, and read it back to the same state."""

from __future__ import annotations

import torch

import driftlab
from driftlab.experiments.run.assembly import build_simulation
from driftlab.simulation.round.checkpointing import checkpointed_parts, completed_state, record_template, restored_state
from driftlab.simulation.round.engine import run_round
from driftlab.simulation.round.latest_models import COUNT, SUM
from driftlab.simulation.state.checkpoint import load_checkpoint, save_checkpoint


def _config(**sections) -> dict:
    config = {
        "data": {"name": "quadratic1d", "num_clients": 4},
        "model": {"name": "quadratic"},
        "client": {"lr": 0.1, "batch_size": 1000, "steps": 2},
        "sampling": {"participation": 0.5},
        "precision": "float64",
        "rounds": 3,
    }
    return config | sections


def _checkpointed(config: dict, tmp_path, rounds: int = 2):
    sim, state = build_simulation(driftlab.load_config(config))
    for _ in range(rounds):
        state, _ = run_round(sim, state)
    clients, stores, engine = checkpointed_parts(sim, state)
    save_checkpoint(tmp_path / "checkpoint", state.round, state.server, clients, "fp", stores, engine)
    _, fresh = build_simulation(driftlab.load_config(config))
    loaded = load_checkpoint(tmp_path / "checkpoint", fresh.server, record_template(sim, fresh), "fp", sim.device)
    return sim, state, engine, restored_state(sim, fresh, loaded)


def test_a_plain_run_has_no_engine_section_and_resumes_its_stores(tmp_path):
    _, state, engine, restored = _checkpointed(_config(algorithm={"name": "scaffold"}), tmp_path)
    assert engine == {}
    assert restored.round == 2 and restored.clock is None and restored.latest_sum is None and restored.in_flight is None
    assert torch.equal(restored.server.params, state.server.params)
    saved = dict(state.clients.items())
    assert sorted(dict(restored.clients.items(include_staged=True))) == sorted(saved)


def test_a_timed_run_evaluating_every_clients_model_writes_the_clock_and_the_sum_by_their_old_names(tmp_path):
    system = {"speed_median": 700.0, "deadline": 6.0, "download_median": 32.0, "upload_median": 32.0}
    config = _config(system=system, evaluation={"model": "all_clients_mean"})
    _, state, engine, restored = _checkpointed(config, tmp_path)
    assert "clock" in engine and COUNT in engine and (SUM in engine or "latest_models_sum_fix_index" in engine)
    assert engine["clock"].item() == state.clock > 0
    assert restored.clock == state.clock
    assert restored.latest_sum.count == state.latest_sum.count
    assert torch.equal(restored.latest_sum.total.view(torch.int64), state.latest_sum.total.view(torch.int64))
    staged = dict(restored.latest_models.items(include_staged=True))
    assert all(torch.equal(staged[k], params) for k, params in state.latest_models.items())


def test_a_completed_state_keeps_the_stores_and_no_extra():
    sim, state = build_simulation(driftlab.load_config(_config(system={"speed_median": 700.0})))
    assert state.clock == 0.0
    done = completed_state(state, 3, state.server)
    assert (done.round, done.clock, done.clients) == (3, None, state.clients)
