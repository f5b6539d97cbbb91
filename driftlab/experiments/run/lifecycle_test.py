"""The run lifecycle with a recording round driver: what it asks of a driver, when, and what it writes around it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from driftlab.experiments.config import load_config
from driftlab.experiments.run import lifecycle
from driftlab.experiments.run.assembly import build_simulation
from driftlab.experiments.run.runner import SimulatorDriver

TINY = [
    "rounds=4",
    "data.num_clients=4",
    "sampling.participation=0.5",
    "client.steps=2",
    "seed=3",
    "backend=sequential",
]


@dataclass
class Recording:
    """The simulator's driver, every call recorded as (hook, round of the state it was given); stops before ``stop_at``."""

    inner: SimulatorDriver
    checkpoints_every_round: bool = False
    stop_at: int | None = None
    calls: list[tuple[str, int]] = field(default_factory=list)

    def prepare(self, state):
        self.calls.append(("prepare", state.round))

    def before_rounds(self, state):
        self.calls.append(("before_rounds", state.round))

    def run_round(self, state, evaluate_after):
        self.calls.append(("run_round", state.round))
        if state.round + 1 == self.stop_at:
            raise KeyboardInterrupt
        return self.inner.run_round(state, evaluate_after)

    def commit(self, state):
        self.calls.append(("commit", state.round))
        self.inner.commit(state)

    def discard(self, state):
        self.calls.append(("discard", state.round))
        self.inner.discard(state)

    def round_done(self, state):
        self.calls.append(("round_done", state.round))

    def how_to_continue(self, out: Path) -> str:
        return f"the recording driver on {out.name}"


def _run(out, *overrides, calls=None, **options):
    config = load_config(None, [*TINY, *overrides])
    sim, state = build_simulation(config)
    driver = Recording(SimulatorDriver(sim), calls=calls if calls is not None else [], **options)
    if out is not None:
        out.mkdir()
    return driver, lifecycle.run_rounds(driver, out, config, sim, state), config


def test_each_round_is_run_then_committed_then_done_and_the_result_is_the_simulators(tmp_path):
    import driftlab

    driver, result, config = _run(tmp_path / "out")
    rounds = [("run_round", t - 1) for t in range(1, 5)]
    expected = [("prepare", 0), ("before_rounds", 0)]
    for _, before in rounds:
        expected += [("run_round", before), ("commit", before + 1), ("round_done", before + 1)]
    assert driver.calls == expected
    assert torch.equal(result.final_params, driftlab.run(config).final_params)
    info = json.loads((tmp_path / "out" / "run.json").read_text())
    assert (info["status"], info["rounds_done"]) == ("complete", 4)
    assert [json.loads(line)["round"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
    ]


def test_a_stopped_round_is_discarded_and_the_last_committed_round_checkpointed_with_the_drivers_advice(tmp_path):
    out = tmp_path / "out"
    calls: list[tuple[str, int]] = []
    with pytest.raises(lifecycle.RunInterrupted) as caught:
        _run(out, "checkpoint_every=100", stop_at=3, calls=calls)
    assert calls[-2:] == [("run_round", 2), ("discard", 2)]  # what round 3 staged is forgotten; round 2 stands
    assert str(caught.value) == f"round 2 is checkpointed in {out}; continue with the recording driver on out"
    info = json.loads((out / "run.json").read_text())
    assert (info["status"], info["rounds_done"]) == ("interrupted", 2)
    assert (out / "checkpoint.safetensors").exists()


def test_a_driver_that_checkpoints_every_round_has_its_checkpoint_before_round_done(tmp_path, monkeypatch):
    written: list[int] = []
    real = lifecycle.write_checkpoint
    monkeypatch.setattr(
        lifecycle,
        "write_checkpoint",
        lambda out, config, sim, state: (written.append(state.round), real(out, config, sim, state)),
    )
    driver, _, _ = _run(
        tmp_path / "every", "checkpoint_every=100", "keep_checkpoint=true", checkpoints_every_round=True
    )
    assert written == [1, 2, 3, 4]
    written.clear()
    _run(tmp_path / "by_config", "checkpoint_every=3", "keep_checkpoint=true")
    assert written == [3, 4]  # every checkpoint_every rounds, and the last


def test_without_an_output_directory_nothing_is_written_and_an_interrupt_says_so(tmp_path):
    driver, result, _ = _run(None)
    assert [r["round"] for r in result.records] == [1, 2, 3, 4] and result.out_dir is None
    with pytest.raises(
        lifecycle.RunInterrupted, match=r"^nothing was saved: the run has no output directory \(--out\)$"
    ):
        _run(None, stop_at=2)
