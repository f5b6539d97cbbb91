"""Tests for the StackOverflow tag-prediction reader, on tiny files in TFF's h5 and SQLite layouts."""

import sqlite3

import numpy as np
import pytest
import torch

from driftlab.data.federated import DataFileError
from driftlab.data.partition import kept_clients
from driftlab.data.stackoverflow import load_stackoverflow, parse_tf_example

# client -> list of (tokens, title, tags)
TRAIN = {
    "00001": [("how to sort a list", "sort list", "python|sorting"), ("list of list", "nested", "python")],
    "00002": [("java list sort", "sort", "java|sorting")],
    "00003": [("unique words here", "t", "rust")],
}
TEST = {"00001": [("sort a dict", "dict", "python|dict")], "00009": [("ignored", "x", "python")]}


# ---------------------------------------------------------------- minimal protobuf writer for tf.train.Example


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _example(features: dict) -> bytes:
    entries = b""
    for key, value in features.items():
        if isinstance(value, str):
            feature = _len_field(1, _len_field(1, value.encode()))  # bytes_list
        else:
            feature = _len_field(3, _len_field(1, b"".join(_varint(v) for v in value)))  # packed int64_list
        entries += _len_field(1, _len_field(1, key.encode()) + _len_field(2, feature))
    return _len_field(1, entries)


def _write_sqlite(path):
    connection = sqlite3.connect(path)
    with connection:
        connection.execute(
            "CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, serialized_example_proto BLOB NOT NULL)"
        )
        connection.execute(
            "CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL, num_examples INTEGER NOT NULL)"
        )
        for split, clients in (("train", TRAIN), ("test", TEST)):
            for client in sorted(clients, reverse=True):  # insertion order must not matter
                for tokens, title, tags in clients[client]:
                    blob = _example({"tokens": tokens, "title": title, "tags": tags, "score": [3]})
                    connection.execute("INSERT INTO examples VALUES (?, ?, ?)", (split, client, blob))
                connection.execute(
                    "INSERT INTO client_metadata VALUES (?, ?, ?)", (client, split, len(clients[client]))
                )
    connection.close()
    return path


def _check_tiny(data):
    assert data.num_clients == 3 and data.client_sizes.tolist() == [2, 1, 1]
    # train word counts: list 5, sort 4, ...; tags: python 2, sorting 2, java 1, rust 1
    assert data.vocabulary[:2] == ("list", "sort")
    assert data.labels == ("python", "sorting", "java", "rust")
    assert data.train_inputs.dtype == torch.float32 and data.train_targets.dtype == torch.float32
    # first example: "how to sort a list sort list" -> 7 words, list 2/7, sort 2/7
    row = data.train_inputs[0]
    assert row[0].item() == pytest.approx(2 / 7) and row[1].item() == pytest.approx(2 / 7)
    assert data.train_targets[0].tolist() == [1, 1, 0, 0]
    assert data.train_targets[2].tolist() == [0, 1, 1, 0]
    # client 00001 has one test example; 00009 is not a train client and is left out
    assert [len(t) for t in data.client_test_indices] == [1, 0, 0] and len(data.test_targets) == 1
    assert data.test_targets[0].tolist() == [1, 0, 0, 0]  # 'dict' is not among the train tags


def test_parse_tf_example_roundtrip():
    parsed = parse_tf_example(_example({"tokens": "a b", "score": [5, 300]}))
    assert parsed == {"tokens": [b"a b"], "score": [5, 300]}
    with pytest.raises(ValueError):
        parse_tf_example(b"\x0a\xff")


def test_sqlite_layout(tmp_path):
    data = load_stackoverflow(_write_sqlite(tmp_path / "stackoverflow.sqlite"), vocabulary_size=50, tag_count=4)
    _check_tiny(data)
    assert data.name == f"stackoverflow(words={len(data.vocabulary)},tags=4)"
    small = load_stackoverflow(
        tmp_path / "stackoverflow.sqlite", vocabulary_size=2, tag_count=1, max_clients=1, max_samples_per_client=1
    )
    assert small.input_shape == (2,) and small.client_sizes.tolist() == [1] and small.labels == ("python",)
    # the three train clients (sorted by id) hold 2, 1 and 1 examples: a random pair keeps its draw's, in id order
    for seed in range(4):
        picked = load_stackoverflow(
            tmp_path / "stackoverflow.sqlite", max_clients=2, client_rng=np.random.default_rng(seed)
        ).client_sizes.tolist()
        assert picked == [[2, 1, 1][i] for i in kept_clients(3, 2, np.random.default_rng(seed))]


def test_h5_layout(tmp_path):
    h5py = pytest.importorskip("h5py")
    for name, clients in (("stackoverflow_train.h5", TRAIN), ("stackoverflow_test.h5", TEST)):
        with h5py.File(tmp_path / name, "w") as f:
            for client, examples in clients.items():
                group = f.create_group(f"examples/{client}")
                for column, field in (("tokens", 0), ("title", 1), ("tags", 2)):
                    group.create_dataset(
                        column,
                        data=np.array([e[field].encode() for e in examples], dtype=object),
                        dtype=h5py.string_dtype(),
                    )
    _check_tiny(load_stackoverflow(tmp_path, vocabulary_size=50, tag_count=4))


def test_errors(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        load_stackoverflow(tmp_path / "nothing.sqlite")
    bad = tmp_path / "bad.sqlite"
    sqlite3.connect(bad).execute("CREATE TABLE other (x)").connection.close()
    with pytest.raises(DataFileError, match="no table 'examples'"):
        load_stackoverflow(bad)
    compressed = tmp_path / "stackoverflow.sqlite.lzma"
    compressed.write_bytes(b"x")
    with pytest.raises(DataFileError, match="xz -d"):
        load_stackoverflow(compressed)
    try:
        import h5py  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install h5py"):
            load_stackoverflow(tmp_path)
    else:
        with pytest.raises(DataFileError, match="stackoverflow_train.h5"):
            load_stackoverflow(tmp_path)


def test_sqlite_with_a_non_blob_proto_is_refused_without_allocating(tmp_path):
    path = _write_sqlite(tmp_path / "so.sqlite")
    connection = sqlite3.connect(path)
    with connection:  # an INTEGER where a BLOB belongs: bytes(10**12) would ask for a terabyte
        connection.execute("UPDATE examples SET serialized_example_proto = 1000000000000 WHERE client_id = '00002'")
    connection.close()
    with pytest.raises(
        DataFileError, match=r"so\.sqlite: client '00002': serialized_example_proto holds a int, not a BLOB"
    ):
        load_stackoverflow(path, vocabulary_size=50, tag_count=4)


def test_damaged_sqlite_is_corrupt(tmp_path):
    path = _write_sqlite(tmp_path / "so.sqlite")
    raw = bytearray(path.read_bytes())
    raw[:16] = b"garbage garbage!"  # the header names the file as SQLite
    path.write_bytes(bytes(raw))
    with pytest.raises(
        DataFileError, match=r"so\.sqlite: not a readable SQLite database \(file is not a database\).*download it again"
    ):
        load_stackoverflow(path, vocabulary_size=50, tag_count=4)
    path = _write_sqlite(tmp_path / "pages.sqlite")
    raw = bytearray(path.read_bytes())
    page_size = int.from_bytes(raw[16:18], "big")
    raw[page_size : 2 * page_size] = b"\xff" * page_size  # the second page (a table's b-tree) is garbage
    path.write_bytes(bytes(raw))
    with pytest.raises(
        DataFileError, match=r"pages\.sqlite is corrupt \(database disk image is malformed\): download it again"
    ):
        load_stackoverflow(path, vocabulary_size=50, tag_count=4)
