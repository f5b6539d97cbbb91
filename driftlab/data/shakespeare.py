"""Shakespeare next-character prediction from raw text with speaker labels (the tiny-shakespeare layout).

The layout (karpathy/char-rnn's ``input.txt``, 1,115,394 characters): speeches
separated by blank lines, each speech a speaker line ``NAME:`` followed by
the speech's lines::

    First Citizen:
    Before we proceed any further, hear me speak.

    All:
    Speak, speak.

Federation as LEAF does it for the Complete Works (Caldas et al. 2018; used by
FedProx Section 5.1 and FedDyn Appendix A.2): one client per speaking role,
next-character samples over 80-character windows. tiny-shakespeare has no
play titles, so a role is a speaker name (``First Citizen`` in two plays is
one role). Names are uppercased with runs of spaces collapsed, as LEAF's
preprocessing uppercases names because some roles are written in two
casings (here ``Nurse``/``NURSE``, ``LADY  CAPULET``/``LADY CAPULET``).

Text of a role (LEAF's ``shake_utils.txt_to_data`` as in the FedProx and LEAF
releases): all of the role's speech lines in file order, joined with a single
space (LEAF writes one line per row and then replaces every newline by a
space), with runs of two or more spaces collapsed to one. So the newline
character of the vocabulary never occurs in the data.

Samples: window start ``t`` gives input ``text[t:t+80]`` and target
``text[t+80]``; a role of ``L`` characters has ``L - 80`` windows.
Characters are encoded with LEAF's 80-character vocabulary
(:data:`driftlab.data.leaf.LEAF_ALL_LETTERS`); a character outside it (in
tiny-shakespeare only ``$``) becomes id 79, the id LEAF's one-hot target
encoder gives it (:func:`driftlab.data.leaf.encode_characters`).

Per-client train/test split without leakage: windows overlap, so a random
split of windows would put most of every test window's text into training
windows. Instead each client's samples are one contiguous run of windows
(like the FedDyn authors' ``ShakespeareObjectCrop``, which takes a
contiguous crop of 2,000 windows at a seeded random start): the first
``n_train`` windows train, then 80 windows are skipped, then ``n_test``
windows test. No character of a test sample (input or target) is in a
training sample of the same client.

Memory: the whole text is kept as one uint8 id array (about 1 MB) and only the
selected windows are materialised. All windows of tiny-shakespeare (no
``samples_per_client``) are about 1.1 million rows: 700 MB as int64,
350 MB as int32 (``token_dtype=torch.int32``; ``torch.nn.Embedding`` accepts
int32 and int64). FedDyn's 100 x 2,000 split is 16 MB.

Example:
    >>> ds = load_shakespeare_text("../shared/data/tinyshakespeare/input.txt.gz",
    ...                            max_clients=100, samples_per_client=2000)  # doctest: +SKIP
    >>> ds.input_shape, ds.num_classes  # doctest: +SKIP
    ((80,), 80)
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from driftlab.data.archive import read_decompressed
from driftlab.data.federated import DataFileError, FederatedDataset, contiguous_ranges
from driftlab.data.leaf import LEAF_ALL_LETTERS, SHAKESPEARE_SEQUENCE_LENGTH, encode_characters

__all__ = ["MAX_TEXT_BYTES", "ShakespeareRole", "load_shakespeare_text", "read_shakespeare_roles"]

# Second entropy word of the crop-start generator (see driftlab.data.synthetic).
# Fixed forever: changing it changes every cropped Shakespeare data set.
_STREAM_TAG = 0x5F3D_0002
_WINDOW = SHAKESPEARE_SEQUENCE_LENGTH
# The most text a file may hold (after decompression): tiny-shakespeare is
# 1.1 MB and LEAF's source, the Complete Works, about 5.5 MB.
MAX_TEXT_BYTES = 64 << 20
_BLOCK_SEPARATOR = re.compile(r"\n[ \t\r]*\n")
_SPACE_RUNS = re.compile(r"  +")


@dataclass(frozen=True)
class ShakespeareRole:
    """One speaking role: its name, its text (module docstring) and its speeches count."""

    name: str
    text: str
    speeches: int

    @property
    def windows(self) -> int:
        """Number of 80-character next-character samples: ``max(len(text) - 80, 0)``."""
        return max(len(self.text) - _WINDOW, 0)


def read_shakespeare_roles(path: str | os.PathLike) -> list[ShakespeareRole]:
    """Parse a tiny-shakespeare style file (plain or gzipped) into roles, in order of first appearance.

    Raises:
        DataFileError: the file is missing, larger than
            :data:`MAX_TEXT_BYTES` once decompressed, not UTF-8 text, corrupt
            (``... is corrupt (...): download it again``, a bad gzip CRC
            included), or does not start with a speaker line ``NAME:`` (the
            message gives the line); a file with no speech at all.
    """
    path = Path(path)
    text = _read_text(path)
    lines_by_role: dict[str, list[str]] = {}
    speeches: dict[str, int] = {}
    current: str | None = None
    for start, block in _blocks(text):
        lines = block.split("\n")
        head = lines[0].strip()
        if head.endswith(":") and len(head) > 1:
            current = " ".join(head[:-1].split()).upper()
            body = lines[1:]
            speeches[current] = speeches.get(current, 0) + 1
            lines_by_role.setdefault(current, [])
        elif current is None:
            raise DataFileError(
                f"{path}: line {text.count(chr(10), 0, start) + 1}: expected a speaker line 'NAME:' before the first "
                f"speech, got {head!r:.80}; the tiny-shakespeare layout is a 'NAME:' line, the speech, then a blank line"
            )
        else:  # a block without a speaker line continues the previous speech
            body = lines
        lines_by_role[current].extend(line.strip() for line in body if line.strip())
    if not lines_by_role:
        raise DataFileError(f"{path}: no speech found; expected blocks of a 'NAME:' line followed by the speech")
    return [
        ShakespeareRole(name, _SPACE_RUNS.sub(" ", " ".join(lines)), speeches[name])
        for name, lines in lines_by_role.items()
    ]


def _blocks(text: str):
    """``(offset, block)`` for every non-blank block of lines separated by blank lines."""
    position = 0
    for separator in _BLOCK_SEPARATOR.finditer(text + "\n\n"):
        block = text[position : separator.start()]
        if block.strip():
            leading = len(block) - len(block.lstrip("\n"))
            yield position + leading, block.strip("\n")
        position = separator.end()


def load_shakespeare_text(
    path: str | os.PathLike,
    *,
    min_samples_per_client: int = 0,
    max_clients: int | None = None,
    samples_per_client: int | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    token_dtype: torch.dtype = torch.int64,
) -> FederatedDataset:
    """Shakespeare as a :class:`FederatedDataset`: one client per role, 80-character windows.

    Procedure (module docstring for text, encoding and split):
        1. a role is eligible when it has at least ``min_samples_per_client``
           windows and enough windows for its sample: ``samples_per_client
           + 80`` with a test split (the 80 skipped windows), else
           ``samples_per_client``; without ``samples_per_client`` it needs
           more than 80 windows (with a test split) so that it keeps a
           training sample;
        2. clients are the eligible roles, largest (most windows) first,
           ties in order of first appearance, cut to ``max_clients``;
        3. with ``samples_per_client = n``, each client takes a contiguous
           run of windows at a start drawn uniformly from all starts that fit
           (seeded, one draw per client in client order): the first
           ``floor((1 - test_fraction) n)`` windows train, 80 are skipped,
           the remaining ones test. Without ``samples_per_client`` the run is
           the whole role (start 0) and ``n = windows - 80`` (or ``windows``
           without a test split).
    The global test set is the union of the client test splits.

    The FedDyn authors' counts, 2,000 train and 400 test windows per client
    (their Table 3: 200,000 and 40,000 for 100 clients; their
    ``ShakespeareObjectCrop_noniid``: a 2,000-window crop and a test crop of
    2,000 // 5), are ``max_clients=100, samples_per_client=2400,
    test_fraction=1/6`` (the preset ``shakespeare-feddyn``);
    ``samples_per_client=2000`` at the default ``test_fraction=0.2`` gives
    1,600 train + 400 test. Note that tiny-shakespeare has fewer than 100
    roles that large (88 with the 2,480 windows that 2,400 + 80 skipped
    need; 98 with 2,080), so fewer clients come back: check
    ``num_clients``. The authors pick their 100 roles at random among those
    large enough (from LEAF's Complete Works); here the largest are taken.

    Args:
        path: the text file, plain or gzipped (detected from the content).
        min_samples_per_client: minimum windows of a role to become a client.
        max_clients: keep at most this many clients (the largest roles).
        samples_per_client: windows per client, train and test together;
            None takes every window of every eligible role.
        test_fraction: in [0, 1); fraction of each client's windows for its test split.
        seed: non-negative integer; only the crop starts are random.
        token_dtype: dtype of the input ids, ``torch.int64`` (default),
            ``torch.int32`` or ``torch.uint8`` (a model must cast uint8 before
            an embedding); targets are always int64.

    Returns:
        Inputs ``[N, 80]`` of token ids, int64 targets in 0..79, 80 classes,
        contiguous client ranges and ``client_test_indices`` (None when
        ``test_fraction`` is 0). Named ``"shakespeare"`` or
        ``"shakespeare(clients=K,samples=n)"``.

    Raises:
        DataFileError: see :func:`read_shakespeare_roles`.
        ValueError: bad arguments, or no role is eligible (the message gives
            the largest role's window count).
    """
    _check_arguments(min_samples_per_client, max_clients, samples_per_client, test_fraction, seed, token_dtype)
    roles = read_shakespeare_roles(path)
    gap = _WINDOW if test_fraction > 0 else 0
    needed = max(min_samples_per_client, (samples_per_client + gap) if samples_per_client else gap + 1)
    order = sorted(range(len(roles)), key=lambda i: (-roles[i].windows, i))
    chosen = [
        roles[i]
        for i in order
        if roles[i].windows >= needed and _train_count(roles[i], samples_per_client, gap, test_fraction) >= 1
    ]
    if not chosen:
        largest = max(role.windows for role in roles)
        raise ValueError(
            f"no role of {path} is eligible: a client needs at least {needed} windows (min_samples_per_client="
            f"{min_samples_per_client}, samples_per_client={samples_per_client}, plus {gap} skipped windows between "
            f"train and test) but the largest role has {largest}; lower the requirements"
        )
    if max_clients is not None:
        chosen = chosen[:max_clients]

    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _STREAM_TAG])))
    train_starts, test_starts, ids = [], [], []
    offset = 0
    for role in chosen:
        role_ids = encode_characters(role.text)
        if samples_per_client is None:
            start, n = 0, role.windows - gap
        else:
            start, n = int(rng.integers(0, role.windows - samples_per_client - gap + 1)), samples_per_client
        n_train = _split_count(n, test_fraction)
        train_starts.append(offset + start + np.arange(n_train))
        test_starts.append(offset + start + n_train + gap + np.arange(n - n_train))
        ids.append(role_ids)
        offset += len(role_ids)
    corpus = np.concatenate(ids)
    train_x, train_y = _windows(corpus, np.concatenate(train_starts), token_dtype)
    test_x, test_y = _windows(corpus, np.concatenate(test_starts), token_dtype)
    name = (
        "shakespeare"
        if samples_per_client is None and max_clients is None
        else (f"shakespeare(clients={len(chosen)},samples={samples_per_client if samples_per_client else 'all'})")
    )
    return FederatedDataset(
        name=name,
        train_inputs=train_x,
        train_targets=train_y,
        test_inputs=test_x,
        test_targets=test_y,
        client_indices=contiguous_ranges([len(s) for s in train_starts]),
        num_classes=len(LEAF_ALL_LETTERS),
        client_test_indices=contiguous_ranges([len(s) for s in test_starts]) if test_fraction > 0 else None,
    )


def _windows(corpus: np.ndarray, starts: np.ndarray, token_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``corpus[s:s+80]`` and targets ``corpus[s+80]`` for the given starts, gathered without a full copy."""
    view = np.lib.stride_tricks.sliding_window_view(corpus, _WINDOW)  # [len-79, 80] view, no copy
    inputs = torch.from_numpy(view[starts]).to(token_dtype)
    targets = torch.from_numpy(corpus[starts + _WINDOW].astype(np.int64))
    return inputs, targets


def _split_count(n: int, test_fraction: float) -> int:
    # The epsilon keeps products such as 0.7 * 90 == 62.99999999999999 from losing a training sample.
    return int(math.floor((1.0 - test_fraction) * n + 1e-9))


def _train_count(role: ShakespeareRole, samples_per_client: int | None, gap: int, test_fraction: float) -> int:
    n = samples_per_client if samples_per_client is not None else role.windows - gap
    return _split_count(n, test_fraction) if n > 0 else 0


def _read_text(path: Path) -> str:
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataFileError(
            f"{path} {what}; expected a Shakespeare text with speaker labels ('NAME:' line, speech, blank line), "
            "plain or gzipped, such as tiny-shakespeare's input.txt"
        )
    raw = read_decompressed(path, MAX_TEXT_BYTES, "a Shakespeare text")
    try:
        return raw.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as error:
        raise DataFileError(f"{path}: not UTF-8 text ({error}); expected a plain-text Shakespeare file") from error


def _check_arguments(
    min_samples_per_client: int,
    max_clients: int | None,
    samples_per_client: int | None,
    test_fraction: float,
    seed: int,
    token_dtype: torch.dtype,
) -> None:
    if min_samples_per_client < 0:
        raise ValueError(f"min_samples_per_client must be >= 0, got {min_samples_per_client}")
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be at least 1 or None, got {max_clients}")
    if samples_per_client is not None and samples_per_client < 1:
        raise ValueError(f"samples_per_client must be at least 1 or None, got {samples_per_client}")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if samples_per_client is not None and _split_count(samples_per_client, test_fraction) < 1:
        raise ValueError(
            f"samples_per_client={samples_per_client} with test_fraction={test_fraction} leaves no training "
            "sample per client; raise samples_per_client or lower test_fraction"
        )
    if not (isinstance(seed, (int, np.integer)) and seed >= 0):
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if token_dtype not in (torch.int64, torch.int32, torch.uint8):
        raise ValueError(f"token_dtype must be torch.int64, torch.int32 or torch.uint8, got {token_dtype}")
