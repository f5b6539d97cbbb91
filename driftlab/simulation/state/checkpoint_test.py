"""Checkpoints: pickle-free, atomic, and a faithful round trip of nested states."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import struct
import subprocess
import sys

import pytest
import torch

from driftlab.simulation.state import checkpoint as checkpoint_module
from driftlab.simulation.state.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    state_from_tensors,
    state_to_tensors,
    write_atomically,
)


@dataclasses.dataclass(frozen=True)
class Inner:
    step: int
    scale: float
    on: bool
    moments: tuple


@dataclasses.dataclass(frozen=True)
class Server:
    params: torch.Tensor
    optimizer_state: Inner
    nothing: object = None


@dataclasses.dataclass(frozen=True)
class Client:
    h: torch.Tensor
    last_round: int


def _server(value: float = 1.0, step: int = 3) -> Server:
    return Server(
        params=torch.arange(5, dtype=torch.float64) * value,
        optimizer_state=Inner(
            step=step, scale=0.1 * value, on=True, moments=(torch.ones(5) * value, torch.full((5,), 2.0 * value))
        ),
    )


def _template() -> Server:
    return Server(torch.zeros(5, dtype=torch.float64), Inner(0, 0.0, False, (torch.zeros(5), torch.zeros(5))))


def test_state_round_trip_keeps_values_types_and_dtypes():
    state = _server(1.5, 7)
    tensors = state_to_tensors(state, "server")
    assert all(isinstance(v, torch.Tensor) for v in tensors.values())
    assert sorted(tensors) == [
        "server/optimizer_state/moments/0",
        "server/optimizer_state/moments/1",
        "server/optimizer_state/on",
        "server/optimizer_state/scale",
        "server/optimizer_state/step",
        "server/params",
    ]
    restored = state_from_tensors(_template(), tensors, "server", torch.device("cpu"))
    assert torch.equal(restored.params, state.params) and restored.params.dtype == torch.float64
    assert restored.optimizer_state.step == 7 and isinstance(restored.optimizer_state.step, int)
    assert restored.optimizer_state.scale == 0.1 * 1.5
    assert restored.optimizer_state.on is True
    assert all(
        torch.equal(a, b) for a, b in zip(restored.optimizer_state.moments, state.optimizer_state.moments, strict=True)
    )


def test_save_and_load_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    clients = {3: Client(torch.ones(5), 2), 11: Client(torch.full((5,), -1.0), 4)}
    save_checkpoint(path, 4, _server(2.0, 4), clients, fingerprint="abc")
    loaded = load_checkpoint(path, _template(), lambda: Client(torch.zeros(5), 0), "abc", torch.device("cpu"))
    assert loaded.round == 4
    assert torch.equal(loaded.server_state.params, _server(2.0).params)
    assert sorted(loaded.client_states) == [3, 11]
    assert torch.equal(loaded.client_states[11].h, clients[11].h) and loaded.client_states[11].last_round == 4


def test_checkpoint_is_plain_safetensors_without_pickle(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, 1, _server(), {}, fingerprint="abc")
    raw = path.read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_length])  # safetensors: 8-byte length, JSON header, raw tensor bytes
    assert header["__metadata__"]["round"] == "1"
    assert b"\x80\x04" not in raw[:2] and b"pickle" not in raw
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file left behind


def test_loading_refuses_other_experiments_and_bad_files(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(path, _template(), None, "abc", torch.device("cpu"))
    save_checkpoint(path, 2, _server(), {}, fingerprint="abc")
    with pytest.raises(CheckpointError, match="different experiment configuration"):
        load_checkpoint(path, _template(), None, "other", torch.device("cpu"))
    with pytest.raises(CheckpointError, match="shape"):
        bigger = Server(torch.zeros(6, dtype=torch.float64), _template().optimizer_state)
        load_checkpoint(path, bigger, None, "abc", torch.device("cpu"))
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path, _template(), None, "abc", torch.device("cpu"))


def test_fingerprint_mismatch_message_names_the_stored_config_file(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, 2, _server(), {}, fingerprint="abc")
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, _template(), None, "other", torch.device("cpu"))
    assert "config.json" in str(error.value)


def test_atomic_write_keeps_the_old_file_when_the_write_dies(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, 2, _server(1.0), {}, fingerprint="abc")
    before = path.read_bytes()
    real_save_tensors = checkpoint_module.save_tensors

    def half_then_die(tensors, filename, metadata=None):
        real_save_tensors(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as handle:
            handle.truncate(len(before) // 2)
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(checkpoint_module, "save_tensors", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, 3, _server(9.0), {}, fingerprint="abc")
    assert path.read_bytes() == before
    assert load_checkpoint(path, _template(), None, "abc", torch.device("cpu")).round == 2
    assert not list(tmp_path.glob(".*tmp*"))


def test_write_atomically_replaces_in_one_rename(tmp_path):
    path = tmp_path / "file.txt"
    path.write_text("old")
    seen = []

    def write(temporary):
        seen.append(temporary)
        assert temporary != path and temporary.parent == path.parent
        temporary.write_text("new")
        assert path.read_text() == "old"  # the target is untouched until the rename

    write_atomically(path, write)
    assert path.read_text() == "new" and not seen[0].exists()


# Run in a process of its own: the kernel kills it (SIGXFSZ) in the middle of the checkpoint write, as soon as a
# write passes the file-size limit, so no Python code (no `finally`, no destructor) runs after the kill.
_KILLED_WRITER = """
import resource, signal, sys
import torch
from driftlab.simulation.state.checkpoint import save_checkpoint

path, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores SIGXFSZ; its default is to kill the process
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
save_checkpoint(path, 3, torch.full((100_000,), 3.0, dtype=torch.float64), {}, fingerprint="abc")
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs SIGXFSZ and RLIMIT_FSIZE")
def test_a_kill_in_the_middle_of_a_checkpoint_write_leaves_only_what_the_next_run_removes(tmp_path):
    """Before save_tensors, safetensors' own temporary (`.tmpXXXXXX`) was left behind, which no run removes."""
    from driftlab.experiments.run.run_directory import remove_interrupted_writes

    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, 2, torch.full((100_000,), 2.0, dtype=torch.float64), {}, fingerprint="abc")
    before = path.read_bytes()
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(path), str(len(before) // 2)], capture_output=True, timeout=300
    )
    assert done.returncode == -signal.SIGXFSZ, done.stderr.decode()[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != path.name)
    assert len(left) == 1 and left[0].startswith(".checkpoint.safetensors.tmp-")  # the torn write
    assert (tmp_path / left[0]).stat().st_size == len(before) // 2
    remove_interrupted_writes(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name] and path.read_bytes() == before


def test_atomically_written_files_get_a_new_files_mode_whatever_the_writer_made(tmp_path):
    """0666 less the umask, as open() creates files: safetensors' own writer made checkpoints 0600, mkstemp does too."""
    previous = os.umask(0o027)
    try:

        def private(temporary):
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT, 0o600))  # as tempfile.mkstemp creates

        write_atomically(tmp_path / "private.txt", private)
        save_checkpoint(tmp_path / "checkpoint.safetensors", 2, _server(), {}, fingerprint="abc")
        assert checkpoint_module.new_file_mode() == 0o640
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "private.txt").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "checkpoint.safetensors").stat().st_mode) == 0o640


# ------------------------------------------------------------------ integrity: checksums and metadata


def _saved(tmp_path):
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint(path, 4, _server(2.0, 4), {3: Client(torch.ones(5), 2)}, fingerprint="abc")
    return path


def _load(path):
    return load_checkpoint(path, _template(), lambda: Client(torch.zeros(5), 0), "abc", torch.device("cpu"))


def _resave(path, edit_tensors=None, edit_metadata=None):
    """Rewrite a checkpoint the way a user or a tool would: same safetensors layout, edited content."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_metadata:
        edit_metadata(metadata)
    save_file(tensors, str(path), metadata=metadata)


def _assert_refused(path, *fragments):
    before = path.read_bytes()
    with pytest.raises(CheckpointError) as error:
        _load(path)
    message = str(error.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    assert path.read_bytes() == before  # a refused checkpoint is left exactly as it was


def test_checkpoint_metadata_carries_a_sha256_that_matches(tmp_path):
    path = _saved(tmp_path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["format_version"] == str(checkpoint_module.FORMAT_VERSION) == "2"
    assert len(metadata["sha256"]) == 64
    assert _load(path).round == 4


def test_a_flipped_bit_in_a_tensor_is_refused(tmp_path):
    path = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01  # the last bytes are tensor data: the header comes first
    path.write_bytes(bytes(raw))
    _assert_refused(path, "corrupt or was edited", "checksum", "new --out")


def test_a_tensor_resaved_as_float16_is_refused(tmp_path):
    path = _saved(tmp_path)
    _resave(path, edit_tensors=lambda t: t.update({"server/params": t["server/params"].to(torch.float16)}))
    _assert_refused(path, "corrupt or was edited", "checksum")


def test_an_edited_round_in_the_metadata_is_refused(tmp_path):
    path = _saved(tmp_path)
    _resave(path, edit_metadata=lambda m: m.update(round="2"))
    _assert_refused(path, "corrupt or was edited")


@pytest.mark.parametrize("value", ["-3", "abc", "1.5", "", " 4", "٣"])
def test_a_round_that_is_not_a_round_number_is_refused(tmp_path, value):
    path = _saved(tmp_path)
    _resave(path, edit_metadata=lambda m: m.update(round=value))
    _assert_refused(path, "corrupt or was edited", "round", repr(value))


@pytest.mark.parametrize("value", ["[3, -1]", "not json", "{}", "[true]"])
def test_client_ids_that_are_not_ids_are_refused(tmp_path, value):
    path = _saved(tmp_path)
    _resave(path, edit_metadata=lambda m: m.update(client_ids=value))
    _assert_refused(path, "corrupt or was edited", "client_ids")


def test_a_missing_checksum_is_refused(tmp_path):
    path = _saved(tmp_path)
    _resave(path, edit_metadata=lambda m: m.pop("sha256"))
    _assert_refused(path, "no sha256 checksum")


def test_a_checkpoint_of_the_old_format_gets_a_clear_error(tmp_path):
    path = _saved(tmp_path)
    _resave(path, edit_metadata=lambda m: (m.update(format_version="1"), m.pop("sha256")))
    _assert_refused(path, "format '1'", "reads format 2", "new --out")


def test_a_safetensors_file_that_is_no_checkpoint_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "checkpoint.safetensors"
    save_file({"weight": torch.ones(3)}, str(path))
    _assert_refused(path, "not a driftlab checkpoint")


def test_a_flipped_bit_in_the_header_is_refused_not_a_traceback(tmp_path):
    path = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    (header_length,) = struct.unpack("<Q", raw[:8])
    for offset in range(8, 8 + header_length, 7):
        damaged = bytearray(raw)
        damaged[offset] ^= 0x04
        path.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointError):
            _load(path)


def test_a_checkpoint_passes_its_write_stages_in_order_and_old_checksums_still_hold(tmp_path, monkeypatch):
    stages = []
    monkeypatch.setattr(checkpoint_module, "_reached", stages.append)
    save_checkpoint(tmp_path / "c.safetensors", 2, _server(), {1: Client(torch.ones(2), 1)}, "fp")
    assert stages == ["tables", "written", "renamed", "done"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "c.safetensors"), framework="pt") as handle:
        metadata = handle.metadata()
    # Without disk stores nothing new enters the checksum, so format-2 checkpoints written before them still verify.
    assert "client_stores" not in metadata
    import hashlib

    from safetensors.torch import load_file

    header = {key: metadata[key] for key in ("format_version", "round", "fingerprint", "client_ids")}
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())  # the format-2 checksum as first written
    tensors = load_file(str(tmp_path / "c.safetensors"))
    for name in sorted(tensors):
        digest.update(json.dumps([name, str(tensors[name].dtype), list(tensors[name].shape)]).encode())
        digest.update(tensors[name].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    assert digest.hexdigest() == metadata["sha256"]
    loaded = load_checkpoint(
        tmp_path / "c.safetensors", _template(), lambda: Client(torch.zeros(2), 0), "fp", torch.device("cpu")
    )
    assert loaded.store_tables == {} and loaded.store_names() == []


def test_an_interrupted_checkpoint_leaves_the_previous_one(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "c.safetensors", 1, _server(1.0), {}, "fp")
    before = (tmp_path / "c.safetensors").read_bytes()

    def interrupt(stage):
        if stage == "written":
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "_reached", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "c.safetensors", 2, _server(2.0), {}, "fp")
    assert (tmp_path / "c.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]
