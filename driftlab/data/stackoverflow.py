"""StackOverflow tag prediction from TFF's files (the decaying-K paper's multi-label task).

TensorFlow Federated distributes Stack Overflow (one client per user; train,
held-out and test splits by time) in two layouts, both read here without
TensorFlow:

  - h5 (``stackoverflow_train.h5``, ``stackoverflow_held_out.h5``,
    ``stackoverflow_test.h5``): group ``examples/<client_id>/`` holding
    per-example datasets ``tokens`` (bytes, space-separated words), ``title``
    (bytes), ``tags`` (bytes, ``|``-separated) and others (``score``,
    ``type``, ``creation_date``; ignored). Needs the optional ``h5py``
    (``pip install h5py``).
  - SQLite (TFF's ``stackoverflow.sqlite``, shipped lzma-compressed: run
    ``xz -d`` first): table ``examples(split_name, client_id,
    serialized_example_proto)`` whose blobs are serialized
    ``tf.train.Example`` protos with the same features, split names
    ``train``, ``heldout``, ``test``; and ``client_metadata(client_id,
    split_name, num_examples)``. Read with the standard library's sqlite3
    and a small decoder of the Example wire format (:func:`parse_tf_example`).

Task (TFF's tag-prediction preprocessing, ``to_ids`` in
``stackoverflow_tag_prediction``): the words of ``tokens + " " + title``
(``include_title``) are split on whitespace; the input is the bag of words
over the ``vocabulary_size`` most frequent words, each count divided by the
number of words of the example including out-of-vocabulary ones (TFF's
``reduce_mean`` of one-hot vectors with one OOV bucket, then dropping the
bucket; newer TFF versions divide by the in-vocabulary count instead); the
target is the multi-hot vector of the example's tags among the ``tag_count``
most frequent tags (others dropped). Unlike TFF, which ships word and tag
counts over its whole train split, both vocabularies are counted here on the
train examples of the kept clients (ties: first seen first).

Memory: inputs are dense float32 ``[N, vocabulary_size]``, 40 kB per example
at 10,000 words (25,000 examples = 1 GB); this is meant for small files and
subsets (``max_clients``, ``max_samples_per_client``), not the full 135
million examples.

Targets are multi-hot, which :class:`driftlab.data.federated.FederatedDataset`
(int64 class ids) does not hold, so the result is a
:class:`MultiLabelFederatedData`. Training on it needs, in the engine: a
multi-label loss, ``torch.nn.functional.binary_cross_entropy_with_logits``
on ``[B, tag_count]`` logits; and metrics for multi-label outputs, e.g.
recall@5 (the share of true tags among the 5 highest logits, TFF's
``recall@5``) or precision/accuracy of ``logits > 0`` against the multi-hot
targets; a model is a linear layer ``vocabulary_size -> tag_count``
(the decaying-K paper's logistic regression).

Example:
    >>> data = load_stackoverflow("so_dir", vocabulary_size=1000, tag_count=50, max_clients=100)  # doctest: +SKIP
    >>> data.train_inputs.shape[1], data.train_targets.shape[1]  # doctest: +SKIP
    (1000, 50)
"""

from __future__ import annotations

import collections
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from driftlab.data.archive import corrupt_file_error
from driftlab.data.federated import DataFileError, FederatedDataset, contiguous_ranges
from driftlab.data.partition import kept_clients

__all__ = ["MultiLabelFederatedData", "load_stackoverflow", "parse_tf_example"]

H5_FILES = {"train": "stackoverflow_train.h5", "heldout": "stackoverflow_held_out.h5", "test": "stackoverflow_test.h5"}
_SQLITE_SUFFIXES = (".sqlite", ".sqlite3", ".db")

Example = tuple[str, str, str]  # (tokens, title, tags)


@dataclass(frozen=True, eq=False)
class MultiLabelFederatedData(FederatedDataset):
    """A :class:`~driftlab.data.federated.FederatedDataset` with multi-hot targets
    (``multi_label=True``) that also names its input and target columns.

    Attributes (besides FederatedDataset's):
        train_inputs: float32 ``[N, vocabulary_size]`` bag-of-words frequencies.
        train_targets: float32 ``[N, num_labels]`` multi-hot (0/1).
        vocabulary: the words of the input columns, in column order.
        labels: the tags of the target columns, in column order.
    """

    vocabulary: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        for split in ("train", "test"):
            inputs = getattr(self, f"{split}_inputs")
            if inputs.dtype != torch.float32 or inputs.dim() != 2 or inputs.shape[1] != len(self.vocabulary):
                raise ValueError(
                    f"{split}_inputs must be float32 [N, {len(self.vocabulary)}] (one column per vocabulary word), "
                    f"got {inputs.dtype} of shape {tuple(inputs.shape)}"
                )

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def load_stackoverflow(
    path: str | os.PathLike,
    *,
    vocabulary_size: int = 10_000,
    tag_count: int = 500,
    max_clients: int | None = None,
    max_samples_per_client: int | None = None,
    include_title: bool = True,
    test_split: str = "test",
    client_rng: np.random.Generator | None = None,
) -> MultiLabelFederatedData:
    """StackOverflow tag prediction as :class:`MultiLabelFederatedData`, one client per user.

    Args:
        path: a directory holding TFF's ``stackoverflow_train.h5`` and the
            h5 file of ``test_split``, or TFF's SQLite file (``.sqlite``).
        vocabulary_size: input columns, the most frequent train words.
        tag_count: target columns, the most frequent train tags.
        max_clients: keep the first this many train clients (sorted by id,
            the order of both layouts), or with ``client_rng`` this many drawn at
            random (:func:`driftlab.data.partition.kept_clients`), kept in id order.
        max_samples_per_client: keep each client's first this many examples,
            in train and in test.
        include_title: add the title's words to the tokens (TFF does).
        test_split: ``"test"`` or ``"heldout"``.
        client_rng: draws the kept clients; None keeps the first.

    Returns:
        Clients are the kept train clients; a client's test split is its
        examples in ``test_split`` (empty if none); test clients that are not
        kept train clients are left out. Named
        ``"stackoverflow(words=V,tags=T)"``.

    Raises:
        DataFileError: missing files (naming them), an unreadable h5/SQLite
            file, a file without TFF's structure, or no train example.
        ImportError: an h5 layout without h5py installed (says ``pip install h5py``).
    """
    if vocabulary_size < 1 or tag_count < 1:
        raise ValueError(f"vocabulary_size and tag_count must be at least 1, got {vocabulary_size} and {tag_count}")
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be at least 1 or None, got {max_clients}")
    if max_samples_per_client is not None and max_samples_per_client < 1:
        raise ValueError(f"max_samples_per_client must be at least 1 or None, got {max_samples_per_client}")
    if test_split not in ("test", "heldout"):
        raise ValueError(f"test_split must be 'test' or 'heldout', got {test_split!r}")
    path = Path(path)
    if path.is_file() and path.name.endswith(_SQLITE_SUFFIXES):
        reader = _SqliteReader(path)
    elif path.is_file() and path.name.endswith(".lzma"):
        raise DataFileError(
            f"{path} is lzma-compressed; decompress it first (xz -d {path.name}) and pass the .sqlite file"
        )
    elif path.is_dir():
        reader = _H5Reader(path, test_split)
    else:
        raise DataFileError(
            f"{path} does not exist or is neither a directory nor a .sqlite file; expected a directory with TFF's "
            f"{H5_FILES['train']} and {H5_FILES[test_split]}, or TFF's stackoverflow.sqlite. driftlab does not "
            "download data"
        )
    with reader:
        clients = reader.client_ids("train")
        clients = [clients[i] for i in kept_clients(len(clients), max_clients, client_rng)]
        train = {c: reader.examples("train", c, max_samples_per_client) for c in clients}
        train = {c: examples for c, examples in train.items() if examples}
        if not train:
            raise DataFileError(f"{reader.source('train')}: no train example found; expected TFF's Stack Overflow data")
        test_clients = set(reader.client_ids(test_split))
        test = {c: reader.examples(test_split, c, max_samples_per_client) if c in test_clients else [] for c in train}

    def words(example: Example) -> list[str]:
        tokens, title, _ = example
        return (f"{tokens} {title}" if include_title else tokens).split()

    def tags(example: Example) -> list[str]:
        return [tag for tag in example[2].split("|") if tag]

    word_counts = collections.Counter(w for examples in train.values() for e in examples for w in words(e))
    tag_counts = collections.Counter(t for examples in train.values() for e in examples for t in tags(e))
    vocabulary = tuple(w for w, _ in word_counts.most_common(vocabulary_size))
    labels = tuple(t for t, _ in tag_counts.most_common(tag_count))
    word_ids = {w: i for i, w in enumerate(vocabulary)}
    tag_ids = {t: i for i, t in enumerate(labels)}

    def encode(examples: list[Example]) -> tuple[np.ndarray, np.ndarray]:
        inputs = np.zeros((len(examples), len(vocabulary)), dtype=np.float32)
        targets = np.zeros((len(examples), len(labels)), dtype=np.float32)
        for row, example in enumerate(examples):
            example_words = words(example)
            ids = [word_ids[w] for w in example_words if w in word_ids]
            if example_words:
                np.add.at(inputs[row], ids, 1.0 / len(example_words))
            targets[row, [tag_ids[t] for t in tags(example) if t in tag_ids]] = 1.0
        return inputs, targets

    train_parts = [encode(train[c]) for c in train]
    test_parts = [encode(test[c]) for c in train]
    has_test = any(len(test[c]) for c in train)
    return MultiLabelFederatedData(
        name=f"stackoverflow(words={len(vocabulary)},tags={len(labels)})",
        train_inputs=torch.from_numpy(np.concatenate([x for x, _ in train_parts])),
        train_targets=torch.from_numpy(np.concatenate([y for _, y in train_parts])),
        test_inputs=torch.from_numpy(np.concatenate([x for x, _ in test_parts])),
        test_targets=torch.from_numpy(np.concatenate([y for _, y in test_parts])),
        client_indices=contiguous_ranges([len(y) for _, y in train_parts]),
        client_test_indices=contiguous_ranges([len(y) for _, y in test_parts]) if has_test else None,
        num_classes=len(labels),
        multi_label=True,
        vocabulary=vocabulary,
        labels=labels,
    )


def parse_tf_example(blob: bytes) -> dict[str, list]:
    """Decode a serialized ``tf.train.Example`` into ``{feature: values}`` without TensorFlow.

    ``bytes_list`` features become lists of ``bytes``, ``int64_list`` lists
    of int, ``float_list`` lists of float. Wire format (proto3):
    ``Example{1: Features{1: map<string, Feature>}}``,
    ``Feature{1: BytesList{1: repeated bytes}, 2: FloatList{1: repeated float},
    3: Int64List{1: repeated int64}}``.

    Raises:
        ValueError: the blob is not a well-formed Example.
    """
    result: dict[str, list] = {}
    for field, _, features in _fields(blob):
        if field != 1:
            continue
        for entry_field, _, entry in _fields(features):
            if entry_field != 1:
                continue
            key, feature = "", b""
            for part_field, _, value in _fields(entry):
                if part_field == 1:
                    key = bytes(value).decode("utf-8")
                elif part_field == 2:
                    feature = value
            result[key] = _feature_values(feature)
    return result


# --------------------------------------------------------------------------- internals


def _feature_values(feature: bytes) -> list:
    values: list = []
    for kind, _, payload in _fields(feature):
        for field, wire, value in _fields(payload):
            if field != 1:
                continue
            if kind == 1:
                values.append(bytes(value))
            elif kind == 2:  # floats: packed (wire 2) or single fixed32 (wire 5)
                values.extend(np.frombuffer(bytes(value), dtype="<f4").tolist())
            elif kind == 3:  # int64: packed varints (wire 2) or a single varint (wire 0)
                if wire == 0:
                    values.append(_signed(value))
                else:
                    position, data = 0, bytes(value)
                    while position < len(data):
                        number, position = _varint(data, position)
                        values.append(_signed(number))
    return values


def _signed(number: int) -> int:
    return number - (1 << 64) if number >= 1 << 63 else number


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if position >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint in protobuf data")
        byte = data[position]
        result |= (byte & 0x7F) << shift
        position += 1
        if not byte & 0x80:
            return result, position
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int, object]]:
    """``(field_number, wire_type, value)`` of a protobuf message: int for varints, bytes otherwise."""
    data = bytes(data)
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(data, position)
        elif wire == 1:
            value, position = data[position : position + 8], position + 8
        elif wire == 2:
            length, position = _varint(data, position)
            value, position = data[position : position + length], position + length
        elif wire == 5:
            value, position = data[position : position + 4], position + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if position > len(data):
            raise ValueError("truncated protobuf data")
        yield field, wire, value


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        return _text(value.item() if value.size == 1 else b"")
    return str(value)


class _H5Reader:
    def __init__(self, root: Path, test_split: str) -> None:
        try:
            import h5py
        except ImportError as error:
            raise ImportError(
                "reading TFF's Stack Overflow .h5 files needs the optional package h5py: pip install h5py "
                "(or pass TFF's stackoverflow.sqlite, which needs nothing extra)"
            ) from error
        self._h5py = h5py
        self._paths = {split: root / H5_FILES[split] for split in ("train", test_split)}
        missing = [str(p) for p in self._paths.values() if not p.is_file()]
        if missing:
            raise DataFileError(
                f"missing {', '.join(missing)}; expected TFF's Stack Overflow h5 files ({', '.join(H5_FILES.values())}) "
                f"in {root}. driftlab does not download data"
            )
        self._files: dict[str, object] = {}

    def __enter__(self) -> "_H5Reader":
        for split, path in self._paths.items():
            try:
                handle = self._h5py.File(path, "r")
            except OSError as error:
                raise DataFileError(f"{path}: not a readable HDF5 file ({error}); fetch it again") from error
            self._files[split] = handle
            if "examples" not in handle:
                raise DataFileError(
                    f"{path}: no 'examples' group; expected TFF's layout examples/<client_id>/{{tokens,title,tags}}"
                )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._files.values():
            handle.close()

    def source(self, split: str) -> str:
        return str(self._paths[split])

    def client_ids(self, split: str) -> list[str]:
        return sorted(self._files[split]["examples"].keys())

    def examples(self, split: str, client: str, limit: int | None) -> list[Example]:
        group = self._files[split]["examples"][client]
        try:
            columns = [group[name][()] for name in ("tokens", "title", "tags")]
        except KeyError as error:
            raise DataFileError(
                f"{self._paths[split]}: examples/{client} lacks {error}; expected datasets tokens, title and tags"
            ) from error
        if not len(columns[0]) == len(columns[1]) == len(columns[2]):
            raise DataFileError(
                f"{self._paths[split]}: examples/{client} has {len(columns[0])} tokens, {len(columns[1])} titles and "
                f"{len(columns[2])} tags; expected one of each per example"
            )
        count = len(columns[0]) if limit is None else min(limit, len(columns[0]))
        return [(_text(columns[0][i]), _text(columns[1][i]), _text(columns[2][i])) for i in range(count)]


class _SqliteReader:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._connection: sqlite3.Connection | None = None

    def __enter__(self) -> "_SqliteReader":
        try:
            self._connection = sqlite3.connect(f"file:{self._path}?mode=ro", uri=True)
            tables = {row[0] for row in self._connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as error:
            raise DataFileError(
                f"{self._path}: not a readable SQLite database ({error}); the file is corrupt or not TFF's "
                "stackoverflow.sqlite: download it again"
            ) from error
        if "examples" not in tables:
            raise DataFileError(
                f"{self._path}: no table 'examples'; expected TFF's schema examples(split_name, client_id, "
                "serialized_example_proto)"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._connection is not None:
            self._connection.close()

    def source(self, split: str) -> str:
        return f"{self._path} (split {split!r})"

    def client_ids(self, split: str) -> list[str]:
        rows = self._query("SELECT DISTINCT client_id FROM examples WHERE split_name = ? ORDER BY client_id", (split,))
        return [row[0] for row in rows]

    def examples(self, split: str, client: str, limit: int | None) -> list[Example]:
        rows = self._query(
            "SELECT serialized_example_proto FROM examples WHERE split_name = ? AND client_id = ? ORDER BY rowid LIMIT ?",
            (split, client, -1 if limit is None else limit),
        )
        result = []
        for (blob,) in rows:
            if not isinstance(blob, bytes):  # bytes(n) of an INTEGER would allocate n bytes
                raise DataFileError(
                    f"{self._path}: client {client!r}: serialized_example_proto holds a {type(blob).__name__}, "
                    "not a BLOB; expected TFF's Stack Overflow schema"
                )
            try:
                features = parse_tf_example(blob)
            except (ValueError, UnicodeDecodeError) as error:
                raise DataFileError(f"{self._path}: client {client!r}: not a tf.train.Example ({error})") from error
            values = [features.get(name, [b""]) for name in ("tokens", "title", "tags")]
            result.append(tuple(_text(v[0]) if v else "" for v in values))
        return result

    def _query(self, sql: str, parameters: tuple) -> list:
        try:
            return self._connection.execute(sql, parameters).fetchall()
        except sqlite3.OperationalError as error:
            raise DataFileError(
                f"{self._path}: query failed ({error}); expected TFF's Stack Overflow schema"
            ) from error
        except sqlite3.DatabaseError as error:  # SQLITE_CORRUPT, SQLITE_NOTADB: damage, not a schema mismatch
            raise corrupt_file_error(self._path, error) from error
