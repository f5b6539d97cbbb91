"""Readers for LEAF's JSON shards: FEMNIST (by writer), Shakespeare (by role), Sent140 (by user).

LEAF (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings") writes
each data set as shard files under ``train/`` and ``test/``, one JSON object
per file:

    {"users": ["f0000_14", ...],                  one id per user, in order
     "num_samples": [154, ...],                   samples per user, same order
     "user_data": {"f0000_14": {"x": [...], "y": [...]}, ...},
     "hierarchies": [...]}                        optional, ignored

with the per-sample ``x`` and ``y`` depending on the data set:

    FEMNIST      x: 784 floats in [0, 1] (28x28, row-major)   y: class id in 0..61
    Shakespeare  x: an 80-character string                    y: the next character
    Sent140      x: a tweet record, text at index 4           y: 0 or 1

The readers accept a directory (``train/`` and ``test/`` anywhere below it,
e.g. LEAF's ``data/femnist/data/``) or a ``.tar.gz``/``.tgz``/``.tar``
archive holding such a tree under any prefix, read by streaming the archive
(nothing is extracted to disk). Only ``*.json`` files whose parent folder is
named ``train`` or ``test`` are read, so LEAF's intermediate folders
(``all_data/``, ``sampled_data/``, ``rem_user_data/``) are ignored.

Federation: one client per train user (natural partition), in the order the
users first appear in the train shards (shards sorted by name, numbers in the
name compared numerically). A client's test split is that user's samples from
the test shards (LEAF's ``-t sample`` split gives every user both). Decisions
where the format leaves room:
  - a train user without test samples gets an empty test split;
  - a test user that appears in no train shard (LEAF's ``-t user`` split)
    holds no client; its samples are still appended to the global test set;
    if no train user has test samples at all, ``client_test_indices`` is None;
  - with ``max_clients``, the first ``max_clients`` train users are kept and
    the test samples of dropped train users are dropped too;
  - a user listed twice within one split (in one shard or across shards) is
    an error: LEAF's own reader silently keeps the last copy.

FEMNIST pixel convention, checked on the real LEAF sample in
``../shared/data/femnist-leaf-subset``: the background is 1.0 and ink is
dark (mean pixel 0.97), i.e. LEAF stores ``gray / 255`` of NIST's white
sheets, the opposite of MNIST. LEAF's and FedProx's models consume the
values as they are, so that is the default; ``invert=True`` gives
``1 - x`` (MNIST-like: ink high, background 0), e.g. for a model pretrained
on MNIST.

Nothing here downloads anything: LEAF's scripts (``preprocess.sh``) make the
shards from the raw sources.

Example:
    >>> ds = load_leaf_femnist("../shared/data/femnist-leaf-subset/femnist-leaf-subset.tar.gz")  # doctest: +SKIP
    >>> ds.num_clients, len(ds.train_targets), len(ds.test_targets), ds.input_shape  # doctest: +SKIP
    (105, 14708, 1685, (1, 28, 28))
"""

from __future__ import annotations

import collections
import json
import os
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import numpy as np
import torch

try:  # optional: about 2.5x faster on FEMNIST's float-heavy shards (the real subset: 1.6 s instead of 3.9 s)
    from orjson import loads as _json_loads
except ImportError:  # pragma: no cover - depends on the environment
    _json_loads = json.loads

from driftlab.data.archive import ArchiveLimits, compression, iter_tar_members, read_capped
from driftlab.data.federated import DataFileError, FederatedDataset, contiguous_ranges
from driftlab.data.partition import kept_clients

__all__ = [
    "LEAF_ALL_LETTERS",
    "LEAF_ARCHIVE_LIMITS",
    "MAX_SHARD_BYTES",
    "SENT140_PAD",
    "SENT140_SEQUENCE_LENGTH",
    "SENT140_UNK",
    "encode_characters",
    "load_leaf_femnist",
    "load_leaf_sent140",
    "load_leaf_shakespeare",
    "read_leaf_shards",
    "sent140_tokens",
]

# LEAF's character vocabulary for Shakespeare (``models/utils/language_utils.py``,
# ``ALL_LETTERS``): 80 characters; a character's id is its position here.
LEAF_ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
# LEAF encodes a character outside the vocabulary with ``ALL_LETTERS.find(c) == -1``;
# its one-hot target encoder then marks position -1, i.e. the last id. driftlab
# uses that last id (79, '}') for inputs and targets alike, so models keep 80 classes
# and an embedding of 80 rows (a raw -1 would crash ``torch.nn.Embedding``).
_UNKNOWN_CHARACTER_ID = len(LEAF_ALL_LETTERS) - 1
_CHARACTER_TABLE = np.full(128, _UNKNOWN_CHARACTER_ID, dtype=np.uint8)
_CHARACTER_TABLE[[ord(c) for c in LEAF_ALL_LETTERS]] = np.arange(len(LEAF_ALL_LETTERS), dtype=np.uint8)

FEMNIST_CLASSES = 62
SHAKESPEARE_SEQUENCE_LENGTH = 80
# Sent140: LEAF's ``line_to_indices(..., max_words=25)``; ids 0 and 1 are reserved.
SENT140_SEQUENCE_LENGTH = 25
SENT140_PAD = 0
SENT140_UNK = 1
_SENT140_TEXT_FIELD = 4
# LEAF's ``split_line``: words (letters, digits, underscore, apostrophe) and the punctuation marks . , ! ? ;
_SENT140_TOKEN_RE = re.compile(r"[\w']+|[.,!?;]")

_SPLITS = ("train", "test")
_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")

# Caps on what is read, checked before the bytes are: a shard file is read
# whole and parsed, so MAX_SHARD_BYTES bounds the memory one shard takes
# before it can be refused. LEAF's largest shards are a few hundred MB (its
# Shakespeare and Sent140 keep one file per split; FEMNIST writes 100 writers
# per file, about 120 MB); the real FEMNIST sample's largest is 4.2 MB.
MAX_SHARD_BYTES = 512 << 20
# An archive of LEAF's data folder: the real FEMNIST sample has 43 entries and
# 86 MB of shards; LEAF's folders of intermediate JSON (all_data/,
# sampled_data/, rem_user_data/) may come along and are streamed past.
LEAF_ARCHIVE_LIMITS = ArchiveLimits(max_members=100_000, max_member_bytes=MAX_SHARD_BYTES, max_total_bytes=16 << 30)

Shard = tuple[str, dict]  # (human-readable source, parsed JSON)


# --------------------------------------------------------------------------- public loaders


def load_leaf_femnist(
    path: str | os.PathLike, *, max_clients: int | None = None, invert: bool = False
) -> FederatedDataset:
    """LEAF FEMNIST as a :class:`FederatedDataset`, one client per writer.

    Used by FedProx (Li et al. 2020, Section 5.1), the decaying-K paper and
    EFL; 62 classes (digits, upper- and lower-case letters).

    Args:
        path: a directory or a ``.tar.gz``/``.tgz``/``.tar`` holding LEAF's
            ``train/*.json`` and ``test/*.json`` (module docstring).
        max_clients: keep only the first this many writers (train order).
        invert: return ``1 - x`` instead of LEAF's values (background 1.0,
            ink near 0; see the module docstring). Default: as LEAF stores them.

    Returns:
        float32 inputs ``[N, 1, 28, 28]`` in [0, 1], int64 targets in 0..61,
        contiguous client index ranges and per-writer test splits; named
        ``"leaf_femnist"``.

    Raises:
        DataFileError: missing train/ or test/ shards, malformed JSON, missing
            keys, ``num_samples`` disagreeing with the data, an image that is
            not 784 numbers in [0, 1], or a label outside 0..61; the message
            names the file.
    """

    def convert(xs: list, ys: list, where: str) -> tuple[np.ndarray, np.ndarray]:
        try:
            images = np.asarray(xs, dtype=np.float32)
        except (ValueError, TypeError) as error:
            raise DataFileError(
                f"{where}: 'x' must be a list of images of 784 numbers (28x28) each ({error})"
            ) from error
        if images.ndim != 2 or images.shape[1] != 28 * 28:
            raise DataFileError(
                f"{where}: expected every FEMNIST image to be 784 numbers (28x28), got an array of shape {images.shape}"
            )
        if images.size and (not np.isfinite(images).all() or images.min() < 0.0 or images.max() > 1.0):
            raise DataFileError(f"{where}: FEMNIST pixels must lie in [0, 1], found [{images.min()}, {images.max()}]")
        return images.reshape(-1, 1, 28, 28), _integer_labels(ys, FEMNIST_CLASSES, where)

    dataset = _load_leaf(path, "femnist", convert, FEMNIST_CLASSES, max_clients)
    if invert:
        dataset.train_inputs.neg_().add_(1.0)
        dataset.test_inputs.neg_().add_(1.0)
    return dataset


def load_leaf_shakespeare(path: str | os.PathLike, *, max_clients: int | None = None) -> FederatedDataset:
    """LEAF Shakespeare as a :class:`FederatedDataset`, one client per speaking role.

    Next-character prediction (FedProx Section 5.1, FedDyn Appendix A.2, the
    decaying-K paper, EFL): every sample is 80 characters and the character
    that follows. Characters are encoded with LEAF's 80-character vocabulary
    :data:`LEAF_ALL_LETTERS` (id = position); a character outside it gets id
    79, the id LEAF's one-hot target encoder gives it (see
    :func:`encode_characters`).

    Args:
        path: a directory or archive with LEAF's train/ and test/ shards.
        max_clients: keep only the first this many roles (train order).

    Returns:
        int64 inputs ``[N, 80]`` (token ids), int64 targets in 0..79, 80
        classes, per-role test splits; named ``"leaf_shakespeare"``.
    """

    def convert(xs: list, ys: list, where: str) -> tuple[np.ndarray, np.ndarray]:
        if not all(isinstance(x, str) and len(x) == SHAKESPEARE_SEQUENCE_LENGTH for x in xs):
            bad = next(x for x in xs if not (isinstance(x, str) and len(x) == SHAKESPEARE_SEQUENCE_LENGTH))
            raise DataFileError(
                f"{where}: every Shakespeare 'x' must be a string of {SHAKESPEARE_SEQUENCE_LENGTH} characters, "
                f"found {bad!r:.120}"
            )
        if not all(isinstance(y, str) and len(y) == 1 for y in ys):
            bad = next(y for y in ys if not (isinstance(y, str) and len(y) == 1))
            raise DataFileError(f"{where}: every Shakespeare 'y' must be one character, found {bad!r:.40}")
        inputs = encode_characters("".join(xs)).reshape(len(xs), SHAKESPEARE_SEQUENCE_LENGTH)
        return inputs.astype(np.int64), encode_characters("".join(ys)).astype(np.int64)

    return _load_leaf(path, "shakespeare", convert, len(LEAF_ALL_LETTERS), max_clients)


def load_leaf_sent140(
    path: str | os.PathLike,
    *,
    vocabulary_size: int = 10_000,
    max_clients: int | None = None,
    client_rng: np.random.Generator | None = None,
) -> FederatedDataset:
    """LEAF Sent140 as a :class:`FederatedDataset`, one client per Twitter user.

    Binary sentiment (FedProx Section 5.1, EFL). Each tweet's text (field 4
    of LEAF's record ``[id, date, query, user, text]``) is lowercased and
    split into tokens by :func:`sent140_tokens` (LEAF's ``split_line``).
    The vocabulary is built from the train split only (of the kept clients):
    id 0 is padding, id 1 unknown, and ids ``2..vocabulary_size-1`` are the
    ``vocabulary_size - 2`` most frequent train tokens (ties: first seen
    first). Each tweet becomes its first 25 token ids (LEAF's
    ``max_words=25``), padded with 0 at the end. LEAF itself uses a GloVe
    vocabulary and pads with the unknown id; a model here should use an
    embedding of ``vocabulary_size`` rows (``padding_idx=0`` if wanted).

    Args:
        path: a directory or archive with LEAF's train/ and test/ shards.
        vocabulary_size: embedding rows including PAD and UNK, at least 3.
        max_clients: keep only the first this many users (train order), or with ``client_rng`` this many drawn
            at random (:func:`driftlab.data.partition.kept_clients`), kept in train order.
        client_rng: draws the kept users; None keeps the first.

    Returns:
        int64 inputs ``[N, 25]``, int64 targets in {0, 1}, 2 classes, per-user
        test splits; named ``"leaf_sent140"``.
    """
    if vocabulary_size < 3:
        raise ValueError(f"vocabulary_size counts PAD and UNK and must be at least 3, got {vocabulary_size}")

    def convert(xs: list, ys: list, where: str) -> tuple[list[list[str]], np.ndarray]:
        tokens = []
        for record in xs:
            if not (
                isinstance(record, list)
                and len(record) > _SENT140_TEXT_FIELD
                and isinstance(record[_SENT140_TEXT_FIELD], str)
            ):
                raise DataFileError(
                    f"{where}: every Sent140 'x' must be a record [id, date, query, user, text] with the text "
                    f"at index {_SENT140_TEXT_FIELD}, found {record!r:.120}"
                )
            tokens.append(sent140_tokens(record[_SENT140_TEXT_FIELD]))
        return tokens, _integer_labels(ys, 2, where)

    train, test = read_leaf_shards(path)
    users, train_by_user, test_by_user, test_only = _select_users(train, test, max_clients, client_rng)
    train_parts = [convert(*train_by_user[u]) for u in users]
    counts = collections.Counter(token for tokens, _ in train_parts for tweet in tokens for token in tweet)
    vocabulary = {token: i + 2 for i, (token, _) in enumerate(counts.most_common(vocabulary_size - 2))}

    def encode(part: tuple[list[list[str]], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        tokens, labels = part
        ids = np.full((len(tokens), SENT140_SEQUENCE_LENGTH), SENT140_PAD, dtype=np.int64)
        for row, tweet in enumerate(tokens):
            kept = [vocabulary.get(token, SENT140_UNK) for token in tweet[:SENT140_SEQUENCE_LENGTH]]
            ids[row, : len(kept)] = kept
        return ids, labels

    train_arrays = [encode(part) for part in train_parts]
    test_arrays = [encode(convert(*test_by_user[u])) if u in test_by_user else None for u in users]
    extra = [encode(convert(*test_by_user[u])) for u in test_only]
    return _assemble("leaf_sent140", train_arrays, test_arrays, extra, 2, (SENT140_SEQUENCE_LENGTH,), np.int64)


# --------------------------------------------------------------------------- helpers (public)


def encode_characters(text: str) -> np.ndarray:
    """LEAF character ids of ``text``, uint8 ``[len(text)]``.

    ``"\\n"`` is 0, ``" "`` is 1, ``"A"`` is 25, ``"a"`` is 53 (positions in
    :data:`LEAF_ALL_LETTERS`); any character outside the 80-character
    vocabulary is 79, the last id (see the module constants).

    Example:
        >>> encode_characters("Ab ").tolist()
        [25, 54, 1]
    """
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.full(len(codes), _UNKNOWN_CHARACTER_ID, dtype=np.uint8)
    ascii_ = codes < 128
    ids[ascii_] = _CHARACTER_TABLE[codes[ascii_]]
    return ids


def sent140_tokens(text: str) -> list[str]:
    """Lowercased tokens of a tweet as LEAF's ``split_line``: words (``[\\w']+``) and ``. , ! ? ;``.

    Example:
        >>> sent140_tokens("I can't WAIT!! :)")
        ['i', "can't", 'wait', '!', '!']
    """
    return _SENT140_TOKEN_RE.findall(text.lower())


def read_leaf_shards(path: str | os.PathLike) -> tuple[list[Shard], list[Shard]]:
    """Parse and validate every LEAF shard under ``path``: ``(train_shards, test_shards)``.

    Each shard is ``(source, data)`` where ``source`` names the file (for an
    archive: ``archive.tar.gz:member/path.json``) and ``data`` is the JSON
    object, checked to have ``users``, ``num_samples`` and ``user_data`` that
    agree with each other. Shards are sorted by file name (numbers compared
    numerically: ``all_data_2`` before ``all_data_10``).

    Raises:
        DataFileError: ``path`` is missing or not a directory/archive; no
            ``train/*.json`` or no ``test/*.json``; shards under more than one
            ``train/`` folder; a shard that is not valid JSON or not LEAF's
            structure (the message names the file and what was expected).
    """
    path = Path(path)
    if path.is_dir():
        found = _directory_shards(path)
    elif path.is_file():
        if not path.name.endswith(_ARCHIVE_SUFFIXES):
            raise DataFileError(
                f"{path} is a file but not a .tar.gz/.tgz/.tar archive; expected a directory or an archive "
                "holding LEAF's train/*.json and test/*.json shards"
            )
        found = _archive_shards(path)
    else:
        raise DataFileError(
            f"{path} does not exist; expected a directory or a .tar.gz holding LEAF's train/*.json and test/*.json "
            "shards (made by LEAF's preprocess.sh); driftlab does not download data"
        )
    shards: dict[str, list[Shard]] = {}
    for split in _SPLITS:
        entries = found.get(split, [])
        if not entries:
            raise DataFileError(
                f"{path}: no {split}/*.json shards found; expected LEAF's layout with JSON files in a folder "
                f"named '{split}' (e.g. data/train/all_data_0_niid_0_keep_0_train_9.json)"
            )
        parents = sorted({str(PurePosixPath(source).parent) for source, _ in entries})
        if len(parents) > 1:
            raise DataFileError(
                f"{path}: {split} shards in more than one folder ({', '.join(parents)}); point driftlab at one "
                "LEAF data set (the folder holding one train/ and one test/)"
            )
        entries.sort(key=lambda entry: _natural_key(entry[0]))
        shards[split] = [(source, _validated(load(), source)) for source, load in entries]
    return shards["train"], shards["test"]


# --------------------------------------------------------------------------- internals


def _load_leaf(
    path: str | os.PathLike,
    kind: str,
    convert: Callable[[list, list, str], tuple[np.ndarray, np.ndarray]],
    num_classes: int,
    max_clients: int | None,
) -> FederatedDataset:
    train, test = read_leaf_shards(path)
    users, train_by_user, test_by_user, test_only = _select_users(train, test, max_clients)
    train_arrays = [convert(*train_by_user[u]) for u in users]
    test_arrays = [convert(*test_by_user[u]) if u in test_by_user else None for u in users]
    extra = [convert(*test_by_user[u]) for u in test_only]
    sample_shape = train_arrays[0][0].shape[1:]
    dtype = train_arrays[0][0].dtype
    return _assemble(f"leaf_{kind}", train_arrays, test_arrays, extra, num_classes, sample_shape, dtype)


def _select_users(
    train: list[Shard], test: list[Shard], max_clients: int | None, rng: np.random.Generator | None = None
) -> tuple[list[str], dict[str, tuple], dict[str, tuple], list[str]]:
    """Kept train users (in order: ``kept_clients``), their (x, y, where) per split, and test-only users."""
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be at least 1 or None, got {max_clients}")
    train_by_user = _by_user(train, "train")
    test_by_user = _by_user(test, "test")
    users = [u for u, (xs, _, _) in train_by_user.items() if len(xs) > 0]
    if not users:
        raise DataFileError(
            f"{train[0][0]} and the other train shards hold no samples; expected at least one user with data"
        )
    kept = [users[i] for i in kept_clients(len(users), max_clients, rng)]
    test_only = [u for u in test_by_user if u not in train_by_user]
    return kept, train_by_user, test_by_user, test_only


def _by_user(shards: list[Shard], split: str) -> dict[str, tuple[list, list, str]]:
    result: dict[str, tuple[list, list, str]] = {}
    origin: dict[str, str] = {}
    for source, data in shards:
        for user in data["users"]:
            if user in result:
                raise DataFileError(
                    f"{source}: user {user!r} is listed again (first in {origin[user]}); LEAF gives every user "
                    f"one entry per split, so the {split} shards overlap (mixed shards of two LEAF runs?)"
                )
            record = data["user_data"][user]
            result[user] = (record["x"], record["y"], f"{source}: user {user!r}")
            origin[user] = source
    return result


def _assemble(
    name: str,
    train_arrays: list[tuple[np.ndarray, np.ndarray]],
    test_arrays: list[tuple[np.ndarray, np.ndarray] | None],
    extra_test: list[tuple[np.ndarray, np.ndarray]],
    num_classes: int,
    sample_shape: tuple[int, ...],
    dtype: np.dtype,
) -> FederatedDataset:
    """Concatenate per-client arrays into shared tensors with contiguous client ranges."""
    empty = (np.zeros((0, *sample_shape), dtype=dtype), np.zeros(0, dtype=np.int64))
    client_tests = [part if part is not None else empty for part in test_arrays]
    train_x = np.concatenate([x for x, _ in train_arrays])
    train_y = np.concatenate([y for _, y in train_arrays])
    test_parts = client_tests + extra_test
    test_x = np.concatenate([x for x, _ in test_parts])
    test_y = np.concatenate([y for _, y in test_parts])
    test_sizes = np.array([len(y) for _, y in client_tests], dtype=np.int64)
    client_test_indices = contiguous_ranges(test_sizes) if test_sizes.sum() > 0 else None
    return FederatedDataset(
        name=name,
        train_inputs=torch.from_numpy(train_x),
        train_targets=torch.from_numpy(train_y),
        test_inputs=torch.from_numpy(test_x),
        test_targets=torch.from_numpy(test_y),
        client_indices=contiguous_ranges(np.array([len(y) for _, y in train_arrays], dtype=np.int64)),
        num_classes=num_classes,
        client_test_indices=client_test_indices,
    )


def _integer_labels(ys: list, num_classes: int, where: str) -> np.ndarray:
    """Class ids from a JSON list; integral floats (1.0) and bools are accepted, as LEAF writes both."""
    try:
        labels = np.asarray(ys, dtype=np.float64)
    except (ValueError, TypeError) as error:
        raise DataFileError(f"{where}: 'y' must be a list of class ids in 0..{num_classes - 1} ({error})") from error
    if labels.ndim != 1 or (
        labels.size and (np.any(labels != np.round(labels)) or labels.min() < 0 or labels.max() >= num_classes)
    ):
        raise DataFileError(
            f"{where}: 'y' must be a flat list of integer class ids in 0..{num_classes - 1}, "
            f"found {ys[:5]!r:.80} (shape {labels.shape})"
        )
    return labels.astype(np.int64)


def _validated(data: object, source: str) -> dict:
    """Check LEAF's shard structure; return the dict or raise DataFileError naming ``source``."""
    expected = "a JSON object with 'users' (list of ids), 'num_samples' (list of counts) and 'user_data' ({user: {'x': [...], 'y': [...]}})"
    if not isinstance(data, dict):
        raise DataFileError(f"{source}: expected {expected}, got a JSON {type(data).__name__}")
    missing = [key for key in ("users", "num_samples", "user_data") if key not in data]
    if missing:
        raise DataFileError(f"{source}: missing key(s) {', '.join(map(repr, missing))}; expected {expected}")
    users, counts, user_data = data["users"], data["num_samples"], data["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or not isinstance(user_data, dict):
        found = ", ".join(f"{key!r} is a JSON {_json_type(data[key])}" for key in ("users", "num_samples", "user_data"))
        raise DataFileError(f"{source}: wrong types ({found}); expected {expected}")
    if len(users) != len(counts):
        raise DataFileError(
            f"{source}: 'users' lists {len(users)} users but 'num_samples' has {len(counts)} entries; "
            "expected one count per user"
        )
    for user, count in zip(users, counts, strict=True):
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise DataFileError(
                f"{source}: 'num_samples' must hold non-negative integers, found {count!r:.40} for user {user!r:.80}"
            )
        record = user_data.get(user) if isinstance(user, str) else None
        if record is None:
            raise DataFileError(f"{source}: user {user!r} is in 'users' but has no entry in 'user_data'")
        if not isinstance(record, dict) or "x" not in record or "y" not in record:
            raise DataFileError(f"{source}: user_data[{user!r}] must be an object with 'x' and 'y' lists")
        xs, ys = record["x"], record["y"]
        if not isinstance(xs, list) or not isinstance(ys, list):
            raise DataFileError(f"{source}: user_data[{user!r}]['x'] and ['y'] must be lists")
        if len(xs) != len(ys) or len(xs) != count:
            raise DataFileError(
                f"{source}: num_samples says user {user!r} has {count} samples but user_data holds "
                f"{len(xs)} x and {len(ys)} y; expected all three to agree (truncated or edited file?)"
            )
    return data


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _parse_json(raw: bytes, source: str) -> object:
    try:
        return _json_loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise DataFileError(
            f"{source}: not valid JSON ({error}); expected a LEAF shard. The file may be truncated: re-run LEAF's "
            "preprocessing or re-extract the archive"
        ) from error


def _shard_split(parts: tuple[str, ...]) -> str | None:
    """'train'/'test' when the path is ``.../train/<name>.json`` or ``.../test/<name>.json``."""
    if len(parts) >= 2 and parts[-1].endswith(".json") and parts[-2] in _SPLITS:
        return parts[-2]
    return None


def _directory_shards(root: Path) -> dict[str, list[tuple[str, Callable[[], object]]]]:
    found: dict[str, list] = collections.defaultdict(list)
    what = "one LEAF shard (read whole into memory; LEAF's shards are far smaller)"
    for file in sorted(root.rglob("*.json")):
        split = _shard_split(file.parts)
        if split and file.is_file():
            found[split].append(
                (str(file), lambda file=file: _parse_json(read_capped(file, MAX_SHARD_BYTES, what), str(file)))
            )
    return found


def _archive_shards(archive: Path) -> dict[str, list[tuple[str, Callable[[], object]]]]:
    """Stream the archive once, parsing every train/test shard (tar members cannot be revisited cheaply).

    The whole archive is read, to its compression trailer, before any shard
    is used, so a damaged archive is refused even when the damage is after
    the last shard; sizes are held to :data:`LEAF_ARCHIVE_LIMITS`.
    """
    found: dict[str, list] = collections.defaultdict(list)
    unreadable: DataFileError | None = None
    wanted = lambda member: _shard_split(PurePosixPath(member.name).parts) is not None  # noqa: E731
    for name, content in iter_tar_members(archive, LEAF_ARCHIVE_LIMITS, wanted, "a LEAF data archive"):
        source = f"{archive}:{name}"
        try:
            data = _parse_json(content, source)
        except DataFileError as error:
            # A flipped bit garbles a shard long before the gzip CRC at the end is checked: read on, so
            # that a damaged download is reported as one, and blame the JSON only if the archive is intact.
            unreadable = unreadable or error
            continue
        found[_shard_split(PurePosixPath(name).parts)].append((source, lambda data=data: data))
    if unreadable is not None:
        if compression(archive) is None:
            why = "a plain tar carries no checksum of its content, so if the archive was downloaded, download it again"
        else:
            why = "the archive's own checksums match, so the shard was damaged before it was archived"
        raise DataFileError(f"{unreadable} ({why})")
    return found


def _natural_key(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]
