"""Tests for Shakespeare from raw text with speaker labels (tiny-shakespeare layout)."""

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from driftlab.data.federated import DataFileError
from driftlab.data.leaf import LEAF_ALL_LETTERS
from driftlab.data.shakespeare import load_shakespeare_text, read_shakespeare_roles
from driftlab.experiments.run.real_data import needs_real_data, real_data_path

REAL_TEXT = real_data_path("shakespeare")  # where the library finds it, or None

TINY = """First Citizen:
Before we proceed any further,
hear me   speak.

All:
Speak, speak.

First citizen:
You are all resolved$
rather to die.
"""


def _decode(ids) -> str:
    return "".join(LEAF_ALL_LETTERS[i] for i in ids)


def _write(tmp_path: Path, text: str, gz: bool = False) -> Path:
    path = tmp_path / ("input.txt.gz" if gz else "input.txt")
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def test_roles_concatenated_with_spaces_and_uppercased(tmp_path):
    roles = read_shakespeare_roles(_write(tmp_path, TINY))
    assert [r.name for r in roles] == ["FIRST CITIZEN", "ALL"]
    assert roles[0].text == "Before we proceed any further, hear me speak. You are all resolved$ rather to die."
    assert roles[0].speeches == 2 and roles[1].text == "Speak, speak."
    assert roles[1].windows == 0  # 13 characters: no 80-character window


def test_windows_targets_and_unknown_character(tmp_path):
    path = _write(tmp_path, TINY, gz=True)  # gzip detected from content
    ds = load_shakespeare_text(path, test_fraction=0.0)
    text = read_shakespeare_roles(path)[0].text
    assert ds.num_clients == 1 and ds.client_test_indices is None
    assert ds.train_inputs.shape == (len(text) - 80, 80) and ds.train_inputs.dtype == torch.int64
    for t in (0, 1, len(text) - 81):
        expected = text[t : t + 80].replace("$", "}")  # '$' is outside LEAF's vocabulary -> id 79 ('}')
        assert _decode(ds.train_inputs[t].tolist()) == expected
        assert LEAF_ALL_LETTERS[int(ds.train_targets[t])] == text[t + 80].replace("$", "}")
    assert ds.num_classes == 80


def _roles_text(sizes: dict[str, int]) -> str:
    blocks = []
    for i, (name, size) in enumerate(sizes.items()):
        letters = "abcdefghij"[i % 10]
        blocks.append(f"{name}:\n" + (letters * size)[:size])
    return "\n\n".join(blocks) + "\n"


def _random_letters(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=n))


def test_filters_largest_first_and_crop_without_leakage(tmp_path):
    path = _write(tmp_path, _roles_text({"SMALL": 150, "BIG": 900, "MID": 600, "TINY": 100}))
    ds = load_shakespeare_text(path, min_samples_per_client=200, samples_per_client=300, test_fraction=0.2, seed=3)
    # windows: SMALL 70, BIG 820, MID 520, TINY 20; need >= 300 + 80 -> BIG, MID (largest first)
    assert ds.num_clients == 2 and ds.client_sizes.tolist() == [240, 240]
    assert [len(t) for t in ds.client_test_indices] == [60, 60]
    assert len(ds.test_targets) == 120  # global test set = union of client test splits
    assert ds.name == "shakespeare(clients=2,samples=300)"
    assert load_shakespeare_text(path, min_samples_per_client=200, max_clients=1).num_clients == 1
    again = load_shakespeare_text(path, min_samples_per_client=200, samples_per_client=300, seed=3)
    assert torch.equal(again.train_inputs, ds.train_inputs)


def test_test_windows_share_no_character_with_train(tmp_path):
    path = _write(tmp_path, "ROLE:\n" + _random_letters(1000, 0) + "\n")
    role_text = read_shakespeare_roles(path)[0].text
    ds = load_shakespeare_text(path, samples_per_client=400, test_fraction=0.25, seed=1)
    train_ids = ds.train_inputs.numpy()
    # locate the crop: the first train window is unique in this text
    first = _decode(train_ids[0].tolist())
    start = role_text.index(first)
    last_train_char = start + 300 - 1 + 80  # target of the last train window
    first_test = role_text.index(_decode(ds.test_inputs[0].tolist()), start)
    assert first_test == start + 300 + 80 and first_test > last_train_char
    assert len(ds.test_targets) == 100


def test_starts_are_seeded(tmp_path):
    path = _write(tmp_path, "A:\n" + _random_letters(3000, 1) + "\n")
    a, b = (load_shakespeare_text(path, samples_per_client=100, seed=s) for s in (0, 1))
    assert not torch.equal(a.train_inputs, b.train_inputs)


def test_int32_storage_and_errors(tmp_path):
    path = _write(tmp_path, _roles_text({"A": 500}))
    assert load_shakespeare_text(path, token_dtype=torch.int32).train_inputs.dtype == torch.int32
    with pytest.raises(ValueError, match="no role .* is eligible"):
        load_shakespeare_text(path, samples_per_client=1000)
    with pytest.raises(ValueError, match="test_fraction"):
        load_shakespeare_text(path, test_fraction=1.0)
    bad = _write(tmp_path, "no speaker here\nstill none\n")
    with pytest.raises(DataFileError, match=r"input\.txt: line 1: expected a speaker line"):
        read_shakespeare_roles(bad)
    with pytest.raises(DataFileError, match="does not exist"):
        read_shakespeare_roles(tmp_path / "missing.txt")
    corrupt = tmp_path / "c.txt.gz"
    corrupt.write_bytes(gzip.compress(TINY.encode())[:30])
    with pytest.raises(DataFileError, match=r"c\.txt\.gz is corrupt \(.*\): download it again"):
        read_shakespeare_roles(corrupt)


def test_gzip_crc_is_checked(tmp_path):
    # Flip one bit of the stored CRC-32: the text still decompresses, only the trailer is wrong.
    path = _write(tmp_path, TINY, gz=True)
    raw = bytearray(path.read_bytes())
    raw[-8] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(DataFileError, match=r"input\.txt\.gz is corrupt \(CRC check failed.*\): download it again"):
        read_shakespeare_roles(path)


def test_text_larger_than_the_cap_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    import driftlab.data.shakespeare as shakespeare

    monkeypatch.setattr(shakespeare, "MAX_TEXT_BYTES", 1000)
    path = _write(tmp_path, TINY * 100, gz=True)
    with pytest.raises(DataFileError, match=r"input\.txt\.gz decompresses to more than 1,000 bytes"):
        read_shakespeare_roles(path)


@needs_real_data("shakespeare")
def test_real_tiny_shakespeare_feddyn_split():
    roles = read_shakespeare_roles(REAL_TEXT)
    assert len(roles) == 302  # 309 names as written; LEAF's uppercasing merges 7
    assert sum(len(r.text) >= 2000 for r in roles) == 100
    ds = load_shakespeare_text(REAL_TEXT, max_clients=100, samples_per_client=2000)
    assert ds.num_clients == 98 and set(ds.client_sizes.tolist()) == {1600}
    assert len(ds.test_targets) == 98 * 400 and ds.input_shape == (80,)
    assert np.all(ds.train_targets.numpy() < 80)
