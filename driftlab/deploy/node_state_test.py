import dataclasses
import os

import pytest
import torch

from driftlab.algorithms import efl, scaffold
from driftlab.compress.error_feedback import with_compression
from driftlab.deploy.node_state import NodeClientState, registration_token
from driftlab.optim.server import make_server_optimizer
from driftlab.simulation.state.checkpoint import CheckpointError

RUN = "0123456789abcdef"
P = 12


def _scaffold_states():
    algorithm = scaffold.build(make_server_optimizer("sgd"))
    initial = algorithm.client_state_init(torch.zeros(P))
    states = [scaffold.ClientState(torch.randn(P, generator=torch.Generator().manual_seed(seed))) for seed in range(3)]
    return algorithm, initial, states


def _node(directory, client_id=4, run=RUN):
    algorithm, initial, _ = _scaffold_states()
    return NodeClientState(directory, client_id, run, initial, lambda: algorithm.client_state_init(torch.zeros(P)))


def _equal(a, b):
    return torch.equal(a.control, b.control)


def test_a_client_without_a_committed_state_gets_the_initial_state(tmp_path):
    node = _node(tmp_path)
    assert torch.equal(node.load().control, torch.zeros(P))
    assert node.committed_round is None


def test_a_state_without_an_initial_function_is_none(tmp_path):
    _, initial, _ = _scaffold_states()
    assert NodeClientState(tmp_path, 1, RUN, initial, None).load() is None


def test_a_staged_state_counts_only_once_committed(tmp_path):
    _, _, (first, second, _) = _scaffold_states()
    node = _node(tmp_path)
    node.stage(3, first)
    assert torch.equal(node.load().control, torch.zeros(P))  # staged is not the client's state yet
    node.commit(3)
    assert _equal(node.load(), first) and node.committed_round == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client-4.safetensors"]
    node.stage(5, second)
    node.drop(5)
    assert _equal(node.load(), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client-4.safetensors"]
    node.drop(5)  # dropping twice, or a round never staged, does nothing


def test_commit_needs_the_staged_round(tmp_path):
    _, _, (first, second, _) = _scaffold_states()
    node = _node(tmp_path)
    with pytest.raises(ValueError, match="client 4 has no staged state of round 2 to commit"):
        node.commit(2)
    node.stage(2, first)
    node.stage(3, second)  # trained again from the committed state: round 2 can no longer be confirmed
    with pytest.raises(ValueError, match="no staged state of round 2"):
        node.commit(2)
    node.commit(3)
    assert _equal(node.load(), second)
    with pytest.raises(ValueError, match="cannot stage round 3 for client 4: round 3 is already committed"):
        node.stage(3, first)


def test_a_restarted_node_restores_the_committed_state_and_ignores_stale_staged_files(tmp_path):
    _, _, (first, second, third) = _scaffold_states()
    node = _node(tmp_path)
    node.stage(2, first)
    node.commit(2)
    node.stage(4, second)
    stale = tmp_path / "client-4.round-1.staged.safetensors"
    stale.write_bytes((tmp_path / "client-4.round-4.staged.safetensors").read_bytes())
    leftover = tmp_path / ".client-4.round-6.staged.safetensors.tmp-12345"  # a kill during a write
    leftover.write_bytes(b"half a file")
    other_client = tmp_path / "client-5.round-1.staged.safetensors"
    other_client.write_bytes(b"not ours")

    restarted = _node(tmp_path)
    assert _equal(restarted.load(), first) and restarted.committed_round == 2
    assert not stale.exists() and not leftover.exists() and other_client.exists()
    restarted.commit(4)  # the confirmation of the reply sent before the restart still arrives
    assert _equal(_node(tmp_path).load(), second)
    restarted.stage(5, third)
    assert _equal(_node(tmp_path).load(), second)


def test_a_crash_between_the_temporary_write_and_the_rename_leaves_the_committed_file(tmp_path, monkeypatch):
    _, _, (first, second, _) = _scaffold_states()
    node = _node(tmp_path)
    node.stage(1, first)
    node.commit(1)
    before = (tmp_path / "client-4.safetensors").read_bytes()

    def crash(source, destination):
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        node.stage(2, second)
    monkeypatch.undo()
    assert (tmp_path / "client-4.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client-4.safetensors"]
    assert _equal(_node(tmp_path).load(), first)

    node.stage(2, second)
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        node.commit(2)
    monkeypatch.undo()
    assert (tmp_path / "client-4.safetensors").read_bytes() == before
    assert _equal(_node(tmp_path).load(), first)


def test_a_file_of_another_run_is_never_loaded(tmp_path):
    _, _, (first, _, _) = _scaffold_states()
    node = _node(tmp_path, run="feedfacefeedface")
    node.stage(1, first)
    node.commit(1)
    ours = _node(tmp_path)
    with pytest.raises(
        CheckpointError,
        match="belongs to the run with config fingerprint 'feedfacefeedface', this run's is '0123456789abcdef'",
    ):
        ours.load()
    with pytest.raises(CheckpointError, match="another run is never loaded"):
        ours.stage(2, first)
    assert _equal(node.load(), first)  # the other run's file is left as it was


def test_a_file_of_another_client_or_an_edited_file_is_refused(tmp_path):
    _, _, (first, _, _) = _scaffold_states()
    node = _node(tmp_path, client_id=4)
    node.stage(1, first)
    node.commit(1)
    os.rename(tmp_path / "client-4.safetensors", tmp_path / "client-9.safetensors")
    with pytest.raises(CheckpointError, match=r"holds the state of client\(s\) \[4\], not of client 9"):
        _node(tmp_path, client_id=9).load()
    path = tmp_path / "client-9.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    os.rename(path, tmp_path / "client-4.safetensors")
    with pytest.raises(CheckpointError, match="was changed after it was written"):
        _node(tmp_path, client_id=4).load()
    (tmp_path / "client-4.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable, corrupt or truncated"):
        _node(tmp_path, client_id=4).load()


def test_a_state_of_another_structure_is_refused(tmp_path):
    node = _node(tmp_path)
    with pytest.raises(
        ValueError, match=r"client state field state/control is torch.float64 \(12,\), expected torch.float32 \(12,\)"
    ):
        node.stage(1, scaffold.ClientState(torch.zeros(P, dtype=torch.float64)))
    with pytest.raises(ValueError, match="does not fit the layout"):
        node.stage(1, efl.ClientState(torch.zeros(P), torch.zeros(P)))


def test_nested_states_with_numbers_and_none_round_trip(tmp_path):
    # Error feedback around SCAFFOLD: a nested dataclass (the inner state and the residual).
    sgd = make_server_optimizer("sgd")
    algorithm = with_compression(scaffold.build(sgd), 0.25, (8, 4))
    initial = algorithm.client_state_init(torch.zeros(P))
    state = dataclasses.replace(
        initial, residual=torch.arange(P, dtype=torch.float32), inner=scaffold.ClientState(torch.ones(P))
    )
    node = NodeClientState(tmp_path, 0, RUN, initial, lambda: algorithm.client_state_init(torch.zeros(P)))
    node.stage(7, state)
    node.commit(7)
    loaded = NodeClientState(tmp_path, 0, RUN, initial, None).load()
    assert torch.equal(loaded.residual, state.residual) and torch.equal(loaded.inner.control, state.inner.control)


def test_staged_round_names_the_state_waiting_for_the_server(tmp_path):
    _, _, (first, second, _) = _scaffold_states()
    node = _node(tmp_path)
    assert node.staged_round is None
    node.stage(2, first)
    assert node.staged_round == 2
    node.stage(3, second)  # a later round's state replaces it
    assert node.staged_round == 3
    assert _node(tmp_path).staged_round == 3  # a restarted node still knows it
    node.commit(3)
    assert node.staged_round is None and node.committed_round == 3


def test_a_registration_token_is_made_once_kept_across_restarts_and_survives_the_state_clean_up(tmp_path):
    token = registration_token(tmp_path / "run", 4)
    assert len(token) == 16 and (tmp_path / "run" / "client-4.token").read_bytes() == token
    assert (tmp_path / "run" / "client-4.token").stat().st_mode & 0o777 == 0o600  # a secret: the owner's alone
    _node(tmp_path / "run", client_id=4)  # a restarted node's clean-up keeps the token
    assert registration_token(tmp_path / "run", 4) == token
    assert registration_token(tmp_path / "run", 5) != token  # one secret per client
    (tmp_path / "run" / "client-4.token").write_bytes(b"short")
    with pytest.raises(
        CheckpointError, match="client-4.token holds 5 bytes, a registration token has 16: it was damaged or replaced"
    ):
        registration_token(tmp_path / "run", 4)


def test_a_staged_state_file_has_a_new_files_mode_and_no_temporary_of_safetensors(tmp_path):
    import os

    _, _, (first, _, _) = _scaffold_states()
    old = os.umask(0o027)
    try:
        node = _node(tmp_path)
        node.stage(3, first)
    finally:
        os.umask(old)
    (staged,) = list(tmp_path.iterdir())  # written by save_tensors: nothing but the staged file is left
    assert staged.stat().st_mode & 0o777 == 0o640  # safetensors' save_file would have left it 0600
    node.commit(3)
    assert _equal(node.load(), first)
