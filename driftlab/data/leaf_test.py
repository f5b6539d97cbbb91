"""Tests for the LEAF JSON readers, on small shards written in LEAF's format (and the real FEMNIST sample)."""

import gzip
import io
import json
import re
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from driftlab.data.federated import DataFileError
from driftlab.data.leaf import (
    LEAF_ALL_LETTERS,
    encode_characters,
    load_leaf_femnist,
    load_leaf_sent140,
    load_leaf_shakespeare,
    sent140_tokens,
)
from driftlab.data.partition import kept_clients
from driftlab.data.registry import lookup
from driftlab.experiments.run.real_data import needs_real_data, real_data_path
from driftlab.randomness import Stream, generator

REAL_FEMNIST = real_data_path("femnist")  # where the library finds it, or None


def _shard(users: dict[str, tuple[list, list]]) -> dict:
    return {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }


def _write_tree(root: Path, train: list[dict], test: list[dict]) -> Path:
    for split, shards in (("train", train), ("test", test)):
        (root / split).mkdir(parents=True)
        for i, shard in enumerate(shards):
            (root / split / f"all_data_{i}_niid_0_keep_0_{split}_9.json").write_text(json.dumps(shard))
    return root


def _image(value: float) -> list[float]:
    return [value] * 784


def _femnist_tree(root: Path) -> Path:
    train = [
        _shard({"w1": ([_image(1.0), _image(0.5)], [3, 61]), "w2": ([_image(0.25)], [0])}),
        _shard({"w3": ([_image(0.0)] * 3, [1, 2, 3])}),
    ]
    test = [_shard({"w1": ([_image(0.75)], [4])}), _shard({"w3": ([_image(1.0)], [5]), "w9": ([_image(0.0)], [6])})]
    return _write_tree(root, train, test)


def test_femnist_directory_shapes_partition_and_test_splits(tmp_path):
    ds = load_leaf_femnist(_femnist_tree(tmp_path / "femnist" / "data"))
    assert ds.name == "leaf_femnist" and ds.num_classes == 62
    assert ds.train_inputs.shape == (6, 1, 28, 28) and ds.train_inputs.dtype == torch.float32
    assert ds.client_sizes.tolist() == [2, 1, 3]  # w1, w2 (shard 0), then w3 (shard 1)
    assert ds.train_targets.tolist() == [3, 61, 0, 1, 2, 3]
    assert float(ds.train_inputs[1].mean()) == 0.5  # stored as LEAF stores them
    # w2 has no test data; w9 is test-only: in the global test set, in no client split.
    assert [len(t) for t in ds.client_test_indices] == [1, 0, 1]
    assert ds.test_targets.tolist() == [4, 5, 6]
    inverted = load_leaf_femnist(tmp_path / "femnist", invert=True)
    assert torch.equal(inverted.train_inputs, 1 - ds.train_inputs)
    assert load_leaf_femnist(tmp_path, max_clients=2).client_sizes.tolist() == [2, 1]


def test_shards_sorted_numerically(tmp_path):
    train = [_shard({f"u{i}": ([_image(0.0)], [i])}) for i in range(12)]
    root = _write_tree(tmp_path, train, [_shard({})])
    ds = load_leaf_femnist(root)
    assert ds.train_targets.tolist() == list(range(12))  # all_data_2 before all_data_10
    assert ds.client_test_indices is None  # no train user has test data


def test_femnist_tar_gz_under_any_prefix_matches_directory(tmp_path):
    root = _femnist_tree(tmp_path / "tree")
    archive = tmp_path / "leaf.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname="some/prefix/femnist")
        info = tarfile.TarInfo("some/prefix/femnist/all_data/ignored.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{]"))  # malformed but not under train/ or test/: ignored
    from_dir, from_tar = load_leaf_femnist(root), load_leaf_femnist(archive)
    assert torch.equal(from_dir.train_inputs, from_tar.train_inputs)
    assert torch.equal(from_dir.test_targets, from_tar.test_targets)
    assert from_tar.client_sizes.tolist() == [2, 1, 3]


def test_shakespeare_encoding_by_hand(tmp_path):
    assert LEAF_ALL_LETTERS.index("A") == 25 and len(LEAF_ALL_LETTERS) == 80
    assert encode_characters("Ab ").tolist() == [25, 54, 1]
    assert encode_characters("\n}$é").tolist() == [0, 79, 79, 79]  # unknown -> last id, as LEAF's one-hot
    x1 = "a" * 79 + "b"
    train = [_shard({"ROMEO": ([x1, "b" * 80], ["c", "A"]), "JULIET": (["}" * 80], [" "])})]
    test = [_shard({"ROMEO": (["c" * 80], ["d"])})]
    ds = load_leaf_shakespeare(_write_tree(tmp_path, train, test))
    assert ds.train_inputs.shape == (3, 80) and ds.train_inputs.dtype == torch.int64
    assert ds.train_inputs[0, :3].tolist() == [53, 53, 53] and int(ds.train_inputs[0, -1]) == 54
    assert ds.train_targets.tolist() == [55, 25, 1]
    assert ds.num_classes == 80 and ds.client_sizes.tolist() == [2, 1]
    assert [len(t) for t in ds.client_test_indices] == [1, 0]


def test_shakespeare_rejects_wrong_lengths(tmp_path):
    root = _write_tree(tmp_path, [_shard({"A": (["short"], ["x"])})], [_shard({})])
    with pytest.raises(DataFileError, match=r"train_9\.json.*80 characters"):
        load_leaf_shakespeare(root)


def test_sent140_tokens_vocabulary_from_train_and_padding(tmp_path):
    assert sent140_tokens("I can't WAIT!! :)") == ["i", "can't", "wait", "!", "!"]

    def record(text):
        return ["1", "Mon Apr 06", "NO_QUERY", "user", text]

    train = [_shard({"u1": ([record("good good day"), record("bad day")], [1, 0]), "u2": ([record("good")], [1])})]
    test = [_shard({"u1": ([record("day unseen " + "good " * 30)], [1])})]
    ds = load_leaf_sent140(_write_tree(tmp_path, train, test), vocabulary_size=4)
    # counts on train: good 3, day 2, bad 1 -> ids 2, 3; 'bad' is beyond vocabulary_size=4 -> UNK (1)
    assert ds.train_inputs.shape == (3, 25) and ds.train_inputs.dtype == torch.int64
    assert ds.train_inputs[0, :4].tolist() == [2, 2, 3, 0]
    assert ds.train_inputs[1, :3].tolist() == [1, 3, 0]
    assert ds.test_inputs[0, :3].tolist() == [3, 1, 2] and int(ds.test_inputs[0, -1]) == 2  # truncated at 25
    assert ds.train_targets.tolist() == [1, 0, 1] and ds.num_classes == 2


def test_sent140_max_clients_keeps_the_first_users_or_a_seeded_random_choice(tmp_path):
    # user i has i + 1 tweets, so a client's size names its user
    users = {f"u{i}": ([["1", "Mon", "NO_QUERY", f"u{i}", "good day"]] * (i + 1), [1] * (i + 1)) for i in range(6)}
    root = _write_tree(tmp_path, [_shard(users)], [_shard({})])
    entry = lookup("sent140")
    assert entry.config_type(client_choice="first") == entry.config_type()  # the default stored as unset
    first = entry.load(entry.config_type(max_clients=3, client_choice="first"), 5, root)
    assert first.client_sizes.tolist() == [1, 2, 3]
    chosen = entry.load(entry.config_type(max_clients=3, client_choice="random"), 5, root)
    expected = kept_clients(6, 3, generator(5, Stream.CLIENT_SUBSET))  # the data seed's draw, kept in file order
    assert chosen.client_sizes.tolist() == [int(i) + 1 for i in expected]
    seen = {
        tuple(entry.load(entry.config_type(max_clients=3, client_choice="random"), s, root).client_sizes.tolist())
        for s in range(12)
    }
    assert len(seen) > 3 and {size for sizes in seen for size in sizes} == set(range(1, 7))
    with pytest.raises(ValueError, match="data.max_clients is unset"):
        entry.config_type(client_choice="random")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("user_data"), "missing key.*'user_data'"),
        (lambda d: d.__setitem__("num_samples", [5, 1]), "num_samples says user 'w1' has 5"),
        (lambda d: d.__setitem__("num_samples", [2]), "'num_samples' has 1 entries"),
        (lambda d: d["users"].append("ghost"), "lists 3 users|'ghost' is in 'users'"),
        (lambda d: d["user_data"]["w1"].pop("y"), "'x' and 'y'"),
        (lambda d: d["user_data"]["w1"]["y"].__setitem__(0, 62), r"class ids in 0\.\.61"),
        (lambda d: d["user_data"]["w1"]["x"].__setitem__(0, [0.5] * 10), "784 numbers"),  # ragged rows
    ],
)
def test_malformed_shards_name_the_file(tmp_path, mutate, message):
    shard = _shard({"w1": ([_image(1.0), _image(0.5)], [3, 1]), "w2": ([_image(0.0)], [0])})
    mutate(shard)
    root = _write_tree(tmp_path, [shard], [_shard({})])
    with pytest.raises(DataFileError, match=message) as error:
        load_leaf_femnist(root)
    assert "all_data_0_niid_0_keep_0_train_9.json" in str(error.value)


def test_invalid_json_missing_splits_and_duplicates(tmp_path):
    root = _write_tree(tmp_path / "a", [_shard({"w": ([_image(0)], [0])})], [_shard({})])
    (root / "test" / "all_data_0_niid_0_keep_0_test_9.json").write_text('{"users": [')
    with pytest.raises(DataFileError, match=r"test_9\.json: not valid JSON"):
        load_leaf_femnist(root)
    (tmp_path / "b" / "train").mkdir(parents=True)
    with pytest.raises(DataFileError, match="no train/\\*.json"):
        load_leaf_femnist(tmp_path / "b")
    with pytest.raises(DataFileError, match="does not exist"):
        load_leaf_femnist(tmp_path / "nowhere")
    twice = _shard({"w": ([_image(0)], [0])})
    root = _write_tree(tmp_path / "c", [twice, twice], [_shard({})])
    with pytest.raises(DataFileError, match="listed again"):
        load_leaf_femnist(root)


def test_corrupt_archive(tmp_path):
    bad = tmp_path / "leaf.tar.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(DataFileError, match=r"leaf\.tar\.gz is corrupt \(.*\): download it again"):
        load_leaf_femnist(bad)


def _femnist_tar_gz(tmp_path: Path) -> Path:
    """A LEAF FEMNIST tar.gz whose shards hold random pixels, so that gzip stores much of it verbatim."""
    rng = np.random.default_rng(0)
    users = {f"w{i}": ([rng.random(784).tolist() for _ in range(3)], [1, 2, 3]) for i in range(4)}
    archive = tmp_path / "leaf.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for split in ("train", "test"):
            data = json.dumps(_shard(users)).encode()
            info = tarfile.TarInfo(f"femnist/{split}/all_data_0_{split}_9.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def test_bit_flip_in_the_tarball_is_caught_by_the_gzip_crc(tmp_path):
    archive = _femnist_tar_gz(tmp_path)
    good = load_leaf_femnist(archive)
    raw = bytearray(archive.read_bytes())
    raw[-8] ^= 0x01  # the stored CRC-32: every member still reads, the stream no longer matches it
    archive.write_bytes(bytes(raw))
    with tarfile.open(archive, "r|gz") as tar:  # what tarfile alone sees: nothing wrong
        assert sum(1 for m in tar if m.isfile()) == 2
    with pytest.raises(DataFileError, match=r"leaf\.tar\.gz is corrupt \(CRC check failed.*\): download it again"):
        load_leaf_femnist(archive)
    assert good.num_clients == 4


def _stored_leaf_archive(tmp_path: Path, train_json: bytes | None = None, level: int = 0) -> tuple[Path, bytes]:
    """A LEAF tar.gz from ``archive_test.tar_bytes``; level 0 stores the tar verbatim, so a flipped byte reaches the JSON."""
    from driftlab.data.archive_test import tar_bytes

    good = json.dumps(_shard({"w": ([_image(0.5), _image(0.25)], [1, 2])})).encode()
    tar = tar_bytes(
        {"femnist/train/all_data_0_train_9.json": train_json or good, "femnist/test/all_data_0_test_9.json": good}
    )
    archive = tmp_path / "leaf.tar.gz"
    archive.write_bytes(gzip.compress(tar, compresslevel=level, mtime=0))
    return archive, tar


def test_a_flipped_byte_inside_a_shard_is_a_damaged_download_not_bad_json(tmp_path):
    archive, _ = _stored_leaf_archive(tmp_path)
    assert load_leaf_femnist(archive).num_clients == 1
    raw = bytearray(archive.read_bytes())
    raw[raw.index(b'"users"')] ^= 0x20  # the first shard's opening quote becomes a control character
    archive.write_bytes(bytes(raw))
    # the stream before its trailer: the first shard no longer parses, and only the CRC at the very end says why
    garbled = zlib.decompressobj(-zlib.MAX_WBITS).decompress(
        bytes(raw[10:])
    )  # raw deflate after the header: no CRC check
    with tarfile.open(fileobj=io.BytesIO(garbled)) as opened:
        with pytest.raises(json.JSONDecodeError):
            json.loads(opened.extractfile("femnist/train/all_data_0_train_9.json").read())
    with pytest.raises(DataFileError) as error:
        load_leaf_femnist(archive)
    message = str(error.value)
    assert re.search(r"leaf\.tar\.gz is corrupt \(CRC check failed .*\): download it again", message), message
    assert "JSON" not in message and "preprocessing" not in message


@pytest.mark.parametrize("compressed", [True, False], ids=["tar.gz", "plain-tar"])
def test_bad_json_in_an_intact_archive_is_blamed_on_the_shard(tmp_path, compressed):
    archive, tar = _stored_leaf_archive(tmp_path, train_json=b'{"users": [')
    if not compressed:
        archive = archive.with_suffix("")  # leaf.tar
        archive.write_bytes(tar)
    with pytest.raises(DataFileError) as error:
        load_leaf_femnist(archive)
    message = str(error.value)
    assert f"{archive}:femnist/train/all_data_0_train_9.json: not valid JSON" in message
    if compressed:
        assert message.endswith("(the archive's own checksums match, so the shard was damaged before it was archived)")
    else:
        assert message.endswith(
            "(a plain tar carries no checksum of its content, so if the archive was downloaded, download it again)"
        )


def test_every_single_bit_flip_in_the_compressed_data_is_an_error_or_exact(tmp_path):
    archive = _femnist_tar_gz(tmp_path)
    raw = archive.read_bytes()
    reference = load_leaf_femnist(archive)
    rng = np.random.default_rng(1)
    for position in rng.choice(np.arange(10, len(raw)), size=12, replace=False):
        flipped = bytearray(raw)
        flipped[position] ^= 1 << int(rng.integers(8))
        archive.write_bytes(bytes(flipped))
        try:
            result = load_leaf_femnist(archive)
        except DataFileError as error:
            assert "leaf.tar.gz" in str(error)
            continue
        assert torch.equal(result.train_inputs, reference.train_inputs), f"bit flip at byte {position} changed the data"


def test_shard_larger_than_the_cap_is_refused_before_reading(tmp_path, monkeypatch):
    import driftlab.data.leaf as leaf

    root = _femnist_tree(tmp_path)
    monkeypatch.setattr(leaf, "MAX_SHARD_BYTES", 1000)
    with pytest.raises(
        DataFileError, match=r"train_9\.json is [\d,]+ bytes, more than the 1,000 allowed for one LEAF shard"
    ):
        load_leaf_femnist(root)


def test_archive_member_larger_than_the_cap_is_refused_before_reading(tmp_path, monkeypatch):
    import driftlab.data.leaf as leaf
    from driftlab.data.archive import ArchiveLimits

    archive = _femnist_tar_gz(tmp_path)
    monkeypatch.setattr(leaf, "LEAF_ARCHIVE_LIMITS", ArchiveLimits(100, 1000, 1 << 30))
    with pytest.raises(
        DataFileError,
        match=r"leaf\.tar\.gz: member femnist/train/all_data_0_train_9\.json is [\d,]+ bytes, more than the 1,000",
    ):
        load_leaf_femnist(archive)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"[1, 2, 3]", "expected a JSON object with 'users'.*got a JSON list"),
        (b'{"users": {}, "num_samples": [], "user_data": {}}', r"wrong types \('users' is a JSON object"),
        (
            b'{"users": ["w"], "num_samples": ["1"], "user_data": {"w": {"x": [], "y": []}}}',
            "'num_samples' must hold non-negative integers, found '1'",
        ),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON|expected a JSON object"),  # no RecursionError
        (b"\xff\xfe{}", "not valid JSON"),
        (b"", "not valid JSON"),
    ],
    ids=["list", "users-object", "count-string", "deep-nesting", "not-utf8", "empty"],
)
def test_malformed_json_is_a_clear_error(tmp_path, content, message):
    root = _write_tree(tmp_path, [_shard({"w": ([_image(0)], [0])})], [_shard({})])
    (root / "train" / "all_data_0_niid_0_keep_0_train_9.json").write_bytes(content)
    with pytest.raises(DataFileError, match=message) as error:
        load_leaf_femnist(root)
    assert "all_data_0_niid_0_keep_0_train_9.json" in str(error.value)


@needs_real_data("femnist")
def test_real_femnist_subset():
    ds = load_leaf_femnist(REAL_FEMNIST)
    assert ds.num_clients == 105
    assert len(ds.train_targets) == 14_708 and len(ds.test_targets) == 1_685
    assert ds.input_shape == (1, 28, 28) and int(ds.train_targets.max()) <= 61
    assert sum(len(t) for t in ds.client_test_indices) == 1_685
    assert float(ds.train_inputs.mean()) > 0.9  # background 1.0, as LEAF stores it


def test_deep_nesting_without_orjson_is_a_clear_error(tmp_path, monkeypatch):
    import driftlab.data.leaf as leaf

    monkeypatch.setattr(leaf, "_json_loads", json.loads)  # the standard library recurses
    root = _write_tree(tmp_path, [_shard({"w": ([_image(0)], [0])})], [_shard({})])
    (root / "train" / "all_data_0_niid_0_keep_0_train_9.json").write_bytes(
        b'{"users": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    )
    with pytest.raises(DataFileError, match=r"train_9\.json: not valid JSON"):
        load_leaf_femnist(root)
