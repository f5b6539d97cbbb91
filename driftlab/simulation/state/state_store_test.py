"""The client-state stores: the disk store behaves like the in-memory one, bit for bit, and its checkpoints are atomic."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import driftlab
from driftlab.errors import ClientStateError
from driftlab.experiments.pinned_runs_test import TINY_RUN
from driftlab.experiments.run.testing import without_wall_time
from driftlab.simulation.round.setup import make_client_stores
from driftlab.simulation.state.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from driftlab.simulation.state.memory_budget import MemoryBudget
from driftlab.simulation.state.state_store import DiskClientStore, InMemoryClientStore

REPOSITORY = Path(__file__).resolve().parents[3]


@dataclasses.dataclass(frozen=True)
class State:
    drift: torch.Tensor
    last_round: int
    scale: float = 1.0


def _initial() -> State:
    return State(torch.zeros(2, 3, dtype=torch.float64), 0)


def _state(value: float, round_index: int) -> State:
    return State(
        torch.full((2, 3), value, dtype=torch.float64) + torch.arange(6, dtype=torch.float64).reshape(2, 3) / 7,
        round_index,
        value / 3,
    )


def _disk(directory: Path, num_clients: int = 10, cache_bytes: int = 1 << 20) -> DiskClientStore:
    return DiskClientStore(directory, num_clients, _initial(), _initial, cache_bytes)


def _same(a: State, b: State) -> bool:
    return (
        torch.equal(a.drift, b.drift)
        and a.drift.dtype == b.drift.dtype
        and a.last_round == b.last_round
        and a.scale == b.scale
    )


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_disk_store_stages_commits_and_discards_like_the_memory_store(tmp_path, cache_bytes):
    memory, disk = InMemoryClientStore(_initial), _disk(tmp_path, cache_bytes=cache_bytes)
    for store in (memory, disk):
        store.put(3, _state(1.0, 1))
        store.put(7, _state(2.0, 1))
        assert _same(store.get(3), _initial()) and len(store) == 0  # staged only
        store.commit()
        store.put(3, _state(5.0, 2))
        store.put(1, None)  # a client without state stores nothing
        store.discard()
        store.put(9, _state(-1.5, 2))
        assert [c for c, _ in store.items()] == [3, 7]
        assert [c for c, _ in store.items(include_staged=True)] == [3, 7, 9]
        store.commit()
    assert len(disk) == len(memory) == 3
    for client_id in range(10):
        assert _same(disk.get(client_id), memory.get(client_id))
    disk.prefetch([9, 3, 0])
    assert all(_same(a, b) for (_, a), (_, b) in zip(disk.items(), memory.items(), strict=True))
    # A state handed out is the caller's: changing it in place changes nothing stored.
    disk.get(3).drift.add_(100.0)
    assert _same(disk.get(3), memory.get(3))


def test_disk_store_refuses_a_state_of_another_structure(tmp_path):
    store = _disk(tmp_path)
    with pytest.raises(ClientStateError) as refused:
        store.put(0, State(torch.zeros(2, 3, dtype=torch.float32), 0))
    assert str(refused.value).startswith(
        "the new state of client 0 cannot be stored: state.drift is a float32 tensor of shape (2, 3), not a float64 tensor of "
        "shape (2, 3) as in client_state_init's state (whose layout the disk store's files hold); "
    )


def _checkpointed_store(directory: Path) -> tuple[DiskClientStore, dict[str, torch.Tensor]]:
    """A disk store holding client 2's state (1.0, round 1), and the table a checkpoint of it records."""
    store = _disk(directory)
    store.put(2, _state(1.0, 1))
    store.commit()
    return store, store.checkpoint_table("store/clients")


def test_commits_after_a_checkpoint_never_touch_the_rows_it_refers_to(tmp_path):
    store, table = _checkpointed_store(tmp_path / "clients")
    store.checkpoint_written()
    files_before = {p.name: p.read_bytes() for p in (tmp_path / "clients").glob("*.slot0")}
    for round_index in (2, 3):  # overwritten twice before the next checkpoint
        store.put(2, _state(float(round_index), round_index))
        store.put(4, _state(9.0, round_index))
        store.commit()
    assert {
        p.name: p.read_bytes() for p in (tmp_path / "clients").glob("*.slot0")
    } != files_before  # client 4 is new: slot 0
    reopened = _disk(tmp_path / "clients")
    reopened.restore(table, "store/clients", "ckpt")
    assert _same(reopened.get(2), _state(1.0, 1)) and _same(reopened.get(4), _initial()) and len(reopened) == 1


def test_a_changed_or_missing_store_file_is_a_checkpoint_error(tmp_path):
    store, table = _checkpointed_store(tmp_path / "clients")
    store.close()
    field_file = next((tmp_path / "clients").glob("00-*.slot0"))
    data = bytearray(field_file.read_bytes())
    data[2 * 48 + 5] ^= 1  # one bit of client 2's row (6 float64 = 48 bytes per row)
    field_file.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"was changed after the checkpoint: the row of client 2 .*delete the checkpoint"
    ):
        _disk(tmp_path / "clients").restore(table, "store/clients", "ckpt")
    field_file.unlink()
    with pytest.raises(CheckpointError, match=rf"{field_file.name} is missing or truncated"):
        _disk(tmp_path / "clients").restore(table, "store/clients", "ckpt")


def test_checkpoint_file_checksums_the_store_table(tmp_path):
    store = _disk(tmp_path / "clients")
    store.put(1, _state(1.0, 1))
    store.commit()
    server = torch.ones(3, dtype=torch.float64)
    save_checkpoint(tmp_path / "c.safetensors", 1, server, {}, "fp", {"clients": store})
    loaded = load_checkpoint(tmp_path / "c.safetensors", server, None, "fp", torch.device("cpu"))
    assert loaded.store_names() == ["clients"] and loaded.client_states == {}
    assert loaded.store_tables["store/clients/client_ids"].tolist() == [1]
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "c.safetensors"))
    with safe_open(str(tmp_path / "c.safetensors"), framework="pt") as handle:
        metadata = handle.metadata()
    tensors["store/clients/slots"] = torch.ones_like(tensors["store/clients/slots"])
    save_file(tensors, str(tmp_path / "c.safetensors"), metadata=metadata)
    with pytest.raises(CheckpointError, match="do not match the sha256"):
        load_checkpoint(tmp_path / "c.safetensors", server, None, "fp", torch.device("cpu"))


def test_the_automatic_choice_of_store_follows_the_budget(tmp_path):
    params = torch.zeros(100, dtype=torch.float64)  # 800 bytes a state
    initial = lambda theta: State(torch.zeros_like(theta), 0)  # noqa: E731
    budget = MemoryBudget(10_000)
    small, _ = make_client_stores("auto", 10, params, initial, False, lambda: tmp_path, budget)
    large, latest = make_client_stores(
        "auto", 10, params, initial, True, lambda: tmp_path, budget
    )  # + 800 of latest model
    assert (
        isinstance(small, InMemoryClientStore)
        and isinstance(large, DiskClientStore)
        and isinstance(latest, DiskClientStore)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clients", "latest_models"]


BASE = ["rounds=4", *TINY_RUN]
ALGORITHMS = {
    "scaffold": ["algorithm.name=scaffold"],
    "feddyn": ["algorithm.name=feddyn", "algorithm.alpha=0.01", "evaluation.model=all_clients_mean"],
    "adabest": ["algorithm.name=adabest", "algorithm.mu=0.02", "algorithm.beta=0.9"],
    "efl": ["algorithm.name=efl"],
}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_disk_store_runs_are_bit_identical_to_memory_store_runs(tmp_path, algorithm):
    overrides = [*BASE, *ALGORITHMS[algorithm]]
    memory = driftlab.run(None, overrides=[*overrides, "state.store=memory"])
    disk = driftlab.run(
        None, tmp_path / "run", overrides=[*overrides, "state.store=disk", "checkpoint_every=1", "keep_checkpoint=true"]
    )
    assert torch.equal(memory.final_params, disk.final_params)
    assert without_wall_time(memory.records) == without_wall_time(disk.records)
    checkpoint = json.loads((tmp_path / "run" / "client_state" / "clients" / "manifest.json").read_text())
    assert checkpoint["num_clients"] == 8
    # A resume with more rounds continues from the disk store's files, and with the memory store too.
    longer = driftlab.run(
        None,
        tmp_path / "run",
        resume=True,
        overrides=[*overrides, "state.store=memory", "rounds=5", "checkpoint_every=1", "keep_checkpoint=true"],
    )
    uninterrupted = driftlab.run(None, overrides=[*overrides, "state.store=memory", "rounds=5"])
    assert torch.equal(longer.final_params, uninterrupted.final_params)
    assert without_wall_time(longer.records) == without_wall_time(uninterrupted.records)


KILLER = textwrap.dedent(
    """
    import os, sys
    import driftlab
    from driftlab.simulation.state import checkpoint, state_store

    stage, occurrence, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    seen = {"count": 0}

    def die_at(name):
        if name == stage:
            seen["count"] += 1
            if seen["count"] == occurrence:
                os._exit(3)  # a kill: no handler runs, nothing is flushed

    checkpoint._reached = die_at
    if stage == "row":
        write_row = state_store.DiskClientStore._write_row
        def dying_write(self, *args):
            die_at("row")
            return write_row(self, *args)
        state_store.DiskClientStore._write_row = dying_write
    driftlab.run(None, out, overrides=sys.argv[4:])
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "occurrence"),
    [
        ("tables", 2),
        ("written", 2),
        ("renamed", 2),
        ("done", 2),
        ("row", 9),
    ],  # 2nd checkpoint; 9th row: mid-commit of round 3
)
def test_a_kill_mid_checkpoint_or_mid_commit_resumes_bit_identically(tmp_path, stage, occurrence):
    overrides = [*BASE, *ALGORITHMS["scaffold"], "rounds=6", "checkpoint_every=2", "state.store=disk"]
    out = tmp_path / "run"
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, stage, str(occurrence), str(out), *overrides],
        env=environment,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == 3, killed.stderr
    resumed = driftlab.run(None, out, resume=True, overrides=overrides)
    uninterrupted = driftlab.run(None, overrides=[*overrides, "state.store=memory"])
    assert torch.equal(resumed.final_params, uninterrupted.final_params)
    assert without_wall_time(resumed.records) == without_wall_time(uninterrupted.records)


def test_a_corrupted_store_file_stops_the_resume_with_a_clear_error(tmp_path):
    overrides = [
        *BASE,
        *ALGORITHMS["adabest"],
        "rounds=2",
        "state.store=disk",
        "keep_checkpoint=true",
    ]  # a completed run keeps it
    driftlab.run(None, tmp_path / "run", overrides=overrides)
    for path in (tmp_path / "run" / "client_state" / "clients").glob("*.slot0"):
        data = bytearray(path.read_bytes())
        for index in range(len(data)):
            data[index] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"client state file .*slot0 was changed after the checkpoint"):
        driftlab.run(None, tmp_path / "run", resume=True, overrides=[*overrides, "rounds=3"])


def test_staged_rows_beyond_the_cache_go_to_the_staging_file(tmp_path):
    row = _initial().drift.numel() * 8 + 8 + 8  # drift, last_round, scale
    memory, disk = InMemoryClientStore(_initial), _disk(tmp_path, cache_bytes=2 * row)  # two rows stay in memory
    for store in (memory, disk):
        for client_id in (5, 1, 8, 3):
            store.put(client_id, _state(float(client_id), 1))
        store.put(8, _state(-8.0, 1))  # a second put in a round replaces the first (8 was spilled)
        store.put(5, _state(-5.0, 1))  # (5 was kept in memory)
    assert (tmp_path / "staged.bin").stat().st_size == 2 * row  # 8 and 3 went to the file
    assert sum(isinstance(v, list) for v in disk._staged.values()) == 2
    assert all(
        _same(a, b)
        for (_, a), (_, b) in zip(disk.items(include_staged=True), memory.items(include_staged=True), strict=True)
    )
    for store in (memory, disk):
        store.commit()
        store.put(3, _state(30.0, 2))  # round 2 reuses the staging file from its start
        store.put(9, _state(90.0, 2))
        store.put(2, _state(20.0, 2))
        store.commit()
    for client_id in range(10):
        assert _same(disk.get(client_id), memory.get(client_id)), client_id
    disk.put(4, _state(4.0, 3))
    disk.put(6, _state(6.0, 3))
    disk.put(7, _state(7.0, 3))
    disk.discard()
    assert [c for c, _ in disk.items(include_staged=True)] == [1, 2, 3, 5, 8, 9]
