"""Per-client algorithm state, owned by the simulator and keyed by client id.

Algorithms never keep client state themselves: the engine reads a client's
state from the store before local training and writes the new state back
after ``client_finish``.  Clients that have never trained have no entry; the
store hands out ``initial(θ0)`` for them without storing it, so memory (or
disk) grows with the clients that have actually trained, not with the
registered count.

Writes are staged and take effect together at ``commit()``: a round that is
interrupted half way (Ctrl-C, an error in the server update or evaluation) is
``discard()``-ed, and the store still holds exactly the states of the last
completed round, which is what the runner checkpoints.

Both stores check every state put against the states before it
(``state_difference``): a state of a type a checkpoint cannot hold (a list, a
dict), or one whose structure, dtypes or shapes changed since the first round,
is refused with ``ClientStateError`` naming the client, what changed and the
store's ``owner`` (the algorithm plugin, when one is in use), so no run ends
with a checkpoint it cannot resume.

Two implementations of the same methods:

``InMemoryClientStore``
    states in a dict; checkpoints copy every state into the checkpoint file.

``DiskClientStore``
    one raw ``[N, P]`` array file per state field and slot (the state's
    dataclass flattened as in ``checkpoint.state_to_tensors``; a field of ``P``
    elements of dtype ``D`` is ``N·P·sizeof(D)`` bytes, created sparse on the
    first write, so only rows of clients that trained take disk space; a file
    reads as ``numpy.memmap(path, dtype, shape=(N, P))`` for numpy dtypes).  Rows
    are read and written with ``pread``/``pwrite`` in batches (the engine
    ``prefetch``-es each wave's clients, ``commit`` writes and hashes the
    round's rows on two threads), not through a mapping: pages of a mapping count in the
    process's RSS, and a run touching 26 GB of state must not look like it
    uses 26 GB of memory.  A bounded LRU cache (``cache_bytes``) keeps recently
    read or written rows.  Staged rows stay in memory up to ``cache_bytes``
    too; beyond that they go to a staging file (``staged.bin``, emptied when
    the round commits or is discarded) as they are put, so a round of many
    clients holds none of them.

Incremental, atomic checkpoints of the disk store (copy-on-write row slots):
every field has two files, slot 0 and slot 1, and every client row lives in
one of them.  The checkpoint records, per stored client, its slot and the
SHA-256 of each of its rows (``checkpoint_table``): that table *is* the
version of the store the checkpoint belongs to, and it is written inside the
checkpoint file under the file's own checksum.  A commit never writes the
slot a checkpoint refers to: a row of a client stored in the last checkpoint
goes to the other slot (over and over until the next checkpoint), a client
new since then to slot 0.  So

- a kill mid-round or mid-commit leaves every row the checkpoint refers to
  untouched;
- a checkpoint fsyncs the field files (only rows written since the last one
  are dirty: it writes only what changed), then renames the new checkpoint
  file over the old one; a kill before the rename leaves the old checkpoint,
  whose rows are still untouched, a kill after it the new one, whose rows are
  on disk;
- ``restore`` re-reads the table, checks every referenced row against its
  SHA-256 (``CheckpointError`` for a missing, short or altered file) and goes on
  from there; rows written after the checkpoint are simply not referenced.

No journal, nothing to undo on resume.  The price is disk space: a row can
exist in both slots (at most twice the state of the clients that trained).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np
import torch

from driftlab.errors import ClientStateError
from driftlab.simulation.state.checkpoint import CheckpointError, state_from_tensors, state_to_tensors


class ClientStateStore(Protocol):
    def get(self, client_id: int) -> Any: ...  # the committed state

    def put(self, client_id: int, state: Any) -> None: ...  # staged until commit()

    def commit(self) -> None: ...

    def discard(self) -> None: ...

    def items(self, include_staged: bool = False) -> Iterator[tuple[int, Any]]: ...  # by client id

    def prefetch(self, client_ids: Iterable[int]) -> None: ...  # a hint: these are read next

    def __len__(self) -> int: ...


# ---------------------------------------------------------------- the layout of a client state

# What a checkpoint can hold of a state (``checkpoint.state_to_tensors``), as plain tuples that keep no tensor alive:
#   None | ("tensor", dtype, shape) | ("number", bool | int | float) | ("tuple", (layout, ...))
#   | ("dataclass", type, (field name, ...), (layout, ...))
# Built on every put, so kept cheap (a few microseconds for a state of a few fields): no strings until an error.
Layout = Any
STORABLE = "client states hold tensors, numbers (bool, int, float), tuples and dataclasses of them, or None"
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def state_layout(state: Any) -> Layout:
    """The structure, types, dtypes and shapes of ``state``; ``ClientStateError`` naming where it holds what a
    checkpoint cannot (a list, a dict, a string, another object)."""
    try:
        return _layout(state)
    except _Unstorable:
        raise ClientStateError(_unstorable(state, "state") or f"state cannot be stored: {STORABLE}") from None


class _Unstorable(Exception):
    pass


def _layout(state: Any) -> Layout:
    if state is None:
        return None
    kind = type(state)
    if kind is torch.Tensor or isinstance(state, torch.Tensor):
        return ("tensor", state.dtype, state.shape)
    if kind is tuple:
        return ("tuple", tuple(_layout(item) for item in state))
    names = _FIELD_NAMES.get(kind)
    if names is None and dataclasses.is_dataclass(kind):
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(kind))
    if names is not None:
        return ("dataclass", kind, names, tuple(_layout(getattr(state, name)) for name in names))
    if isinstance(state, (bool, int, float)):
        return ("number", bool if isinstance(state, bool) else int if isinstance(state, int) else float)
    if isinstance(state, tuple):
        return ("tuple", tuple(_layout(item) for item in state))
    raise _Unstorable


def _unstorable(state: Any, path: str) -> str | None:
    """Where in ``state`` (at ``path``) a checkpoint cannot hold a value, and what to do (the message of ``state_layout``)."""
    try:
        _layout(state)
        return None
    except _Unstorable:
        pass
    if dataclasses.is_dataclass(state):
        parts = ((f"{path}.{f.name}", getattr(state, f.name)) for f in dataclasses.fields(state))
    elif isinstance(state, tuple):
        parts = ((f"{path}[{index}]", item) for index, item in enumerate(state))
    else:
        hint = "; return a tuple instead" if isinstance(state, list) else ""
        return f"{path} is a {type(state).__name__}, which a checkpoint cannot hold: {STORABLE}{hint}"
    return next((found for found in (_unstorable(item, where) for where, item in parts) if found is not None), None)


def describe_layout(layout: Layout) -> str:
    """``layout`` in words: "a float32 tensor of shape (609,)", "a ClientState", "an int", "None"."""
    if layout is None:
        return "None"
    kind = layout[0]
    if kind == "tensor":
        return f"a {str(layout[1]).removeprefix('torch.')} tensor of shape {tuple(layout[2])}"
    if kind == "number":
        return f"{'an' if layout[1] is int else 'a'} {layout[1].__name__}"
    if kind == "tuple":
        return f"a tuple of {len(layout[1])}"
    return f"a {layout[1].__qualname__}"


def layout_difference(
    new: Layout, old: Layout, reference: str = "the earlier state", path: str = "state", none_matches: bool = True
) -> str | None:
    """The first place where layout ``new`` differs from ``old`` ("state.control is a float32 tensor of shape (10,),
    not a float32 tensor of shape (9,) as in the earlier state"), or None.  With ``none_matches``, None on either side
    matches anything (a checkpoint restores a field that is None in the template from what was stored, and stores
    nothing for None)."""
    if new == old:
        return None
    changed = f"{path} is {describe_layout(new)}, not {describe_layout(old)} as in {reference}"
    if new is None or old is None:
        return None if none_matches else changed
    if (
        new[0] != old[0]
        or (new[0] in ("number", "dataclass") and new[1] is not old[1])
        or (new[0] == "tuple" and len(new[1]) != len(old[1]))
    ):
        return changed
    if new[0] == "tensor":
        return changed
    if new[0] == "tuple":
        items = ((f"{path}[{index}]", a, b) for index, (a, b) in enumerate(zip(new[1], old[1], strict=True)))
    elif new[0] == "dataclass":
        items = ((f"{path}.{name}", a, b) for name, a, b in zip(new[2], new[3], old[3], strict=True))
    else:
        return None
    found = (layout_difference(a, b, reference, where, none_matches) for where, a, b in items)
    return next((problem for problem in found if problem is not None), None)


def _refuse(client_id: int, problem: str, owner: str | None, fix: str) -> ClientStateError:
    by = f" (made by {owner})" if owner else ""
    return ClientStateError(f"the new state of client {client_id}{by} cannot be stored: {problem}; {fix}")


CHANGED_FIX = (
    "an algorithm's client states must keep one structure, dtype and shape in every round (those of the first round's "
    "states and of client_state_init's), or no checkpoint of them could be resumed"
)


class InMemoryClientStore:
    """Client states in a dict.  ``initial`` builds the state of a client that has not trained yet.

    Every state put is checked against the layout of the first one (and that one against ``initial()``'s),
    None matching anything, as a checkpoint restores it; ``owner`` names the algorithm in the errors.
    """

    def __init__(self, initial: Callable[[], Any] | None, owner: str | None = None) -> None:
        self._initial = initial
        self._states: dict[int, Any] = {}
        self._staged: dict[int, Any] = {}
        self.owner = owner
        self._layout: Layout = None  # of the first state put (None: none yet)

    def get(self, client_id: int) -> Any:
        state = self._states.get(client_id)
        if state is None and self._initial is not None:
            return self._initial()
        return state

    def put(self, client_id: int, state: Any) -> None:
        if state is None:
            return
        self._check(int(client_id), state)
        self._staged[int(client_id)] = state

    def _check(self, client_id: int, state: Any) -> None:
        try:
            layout = state_layout(state)
        except ClientStateError as error:
            raise _refuse(client_id, str(error), self.owner, "change the algorithm's client_finish") from None
        if self._layout is None:
            initial = self._initial() if self._initial is not None else None
            problem = (
                layout_difference(layout, state_layout(initial), "client_state_init's state")
                if initial is not None
                else None
            )
            if problem is not None:
                raise _refuse(client_id, problem, self.owner, CHANGED_FIX)
            self._layout = layout
            return
        problem = layout_difference(layout, self._layout, "the states stored before it")
        if problem is not None:
            raise _refuse(client_id, problem, self.owner, CHANGED_FIX)

    def commit(self) -> None:
        # One dict.update: a signal cannot land half way through it.
        self._states.update(self._staged)
        self._staged = {}

    def discard(self) -> None:
        self._staged = {}

    def items(self, include_staged: bool = False) -> Iterator[tuple[int, Any]]:
        """Committed states by client id; with ``include_staged``, as they will be after ``commit()``."""
        states = {**self._states, **self._staged} if include_staged else self._states
        return iter(sorted(states.items()))

    def prefetch(self, client_ids: Iterable[int]) -> None:
        pass

    def __len__(self) -> int:
        return len(self._states)


@dataclass(frozen=True)
class _Field:
    name: str  # the flattened state key, e.g. "state/drift"
    dtype: torch.dtype
    shape: tuple[int, ...]
    row_bytes: int


_STORE_TABLE_KEYS = ("client_ids", "slots", "sha256")
_READ_BATCH = 64  # rows per batch when ``items`` walks the whole store
COMMIT_THREADS = 2
STAGING_FILE = "staged.bin"  # a round's staged rows beyond the cache's size, in the order they were put


class DiskClientStore:
    """Client states in ``[N, P]`` files under ``directory``; see the module docstring.

    ``template`` is a state of the stored structure (the freshly initialised
    one): it fixes the fields, their dtypes and shapes, and the device states
    are handed out on.  ``initial`` builds the state of a client that has not
    trained (``None``: such a client has no state).
    """

    def __init__(
        self,
        directory: str | Path,
        num_clients: int,
        template: Any,
        initial: Callable[[], Any] | None,
        cache_bytes: int = 256 << 20,
        owner: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.owner = owner  # who makes the states (an algorithm plugin), named when one cannot be stored
        self.num_clients = int(num_clients)
        self._template = template
        self._initial = initial
        self._template_layout = state_layout(template)
        layout = state_to_tensors(template, "state")
        if not layout:
            raise ValueError("DiskClientStore needs a template with at least one tensor or number")
        self._fields = tuple(
            _Field(name, tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size())
            for name, tensor in layout.items()
        )
        self._row_bytes = sum(field.row_bytes for field in self._fields)
        self._cache_bytes = int(cache_bytes)
        self._cache: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._cached_bytes = 0
        # Staged rows by client id: in memory (a list of rows), or the index of their place in the staging file.
        self._staged: dict[int, list[np.ndarray] | int] = {}
        self._staged_in_memory = 0  # bytes
        self._staging_descriptor: int | None = None
        self._staging_rows = 0  # places used in the staging file this round
        self._slot = np.full(self.num_clients, -1, dtype=np.int8)  # committed slot of each client's rows; -1: no state
        self._checkpointed_slot = np.full(
            self.num_clients, -1, dtype=np.int8
        )  # the slots the last checkpoint refers to
        self._sha256 = np.zeros((self.num_clients, len(self._fields), 32), dtype=np.uint8)
        self._descriptors: dict[tuple[int, int], int] = {}
        self._failed: str | None = None  # why a commit broke off; the store then refuses checkpoints
        self.bytes_written = 0  # rows written by commits, and fsync-ed by checkpoints
        # Files left by an earlier process are reused as they are: only rows a restored
        # checkpoint refers to are ever read, and a write replaces a whole row.
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write_manifest()

    # ------------------------------------------------------------------ the store interface

    def get(self, client_id: int) -> Any:
        client_id = int(client_id)
        if self._slot[client_id] < 0:
            return self._initial() if self._initial is not None else None
        rows = self._cache.get(client_id)
        if rows is None:
            rows = self._read_rows(client_id, int(self._slot[client_id]))
            self._remember(client_id, rows)
        else:
            self._cache.move_to_end(client_id)
        return self._decode(rows)

    def put(self, client_id: int, state: Any) -> None:
        if state is None:
            return
        client_id = int(client_id)
        rows = self._encode(state, client_id)
        previous = self._staged.get(client_id)
        if isinstance(previous, int):
            self._write_staged(previous, rows)  # a second put in one round reuses the client's place
        elif previous is not None or self._staged_in_memory + self._row_bytes <= self._cache_bytes:
            self._staged_in_memory += 0 if previous is not None else self._row_bytes
            self._staged[client_id] = rows
        else:
            self._staged[client_id] = self._staging_rows
            self._write_staged(self._staging_rows, rows)
            self._staging_rows += 1

    def commit(self) -> None:
        """Write the staged rows (on ``COMMIT_THREADS`` threads), then make them the committed states at once."""
        if not self._staged:
            return
        ids = np.array(sorted(self._staged), dtype=np.int64)
        # A client in the last checkpoint writes to the slot that checkpoint does not use; a new one to slot 0.
        targets = np.where(self._checkpointed_slot[ids] >= 0, 1 - self._checkpointed_slot[ids], 0).astype(np.int8)
        hashes = np.empty((len(ids), len(self._fields), 32), dtype=np.uint8)

        def write_client(item: tuple[int, int, int]) -> None:
            position, client_id, slot = item
            for index, row in enumerate(self._staged_rows(client_id)):
                self._write_row(index, slot, client_id, row)
                hashes[position, index] = np.frombuffer(hashlib.sha256(row).digest(), dtype=np.uint8)

        try:
            for index in range(len(self._fields)):  # opened here, not by two threads at once
                for slot in set(targets.tolist()):
                    self._descriptor(index, slot, create=True)
            # pwrite and SHA-256 release the GIL: a round's rows are written and hashed on two threads. Order does not
            # matter: no row the last checkpoint refers to is ever written, so a kill at any point leaves it intact.
            with ThreadPoolExecutor(COMMIT_THREADS) as pool:
                for _ in pool.map(write_client, zip(range(len(ids)), ids.tolist(), targets.tolist(), strict=True)):
                    pass
            self.bytes_written += len(ids) * self._row_bytes
        except BaseException as error:
            # Rows of the committed round may be half overwritten: never checkpoint this store again.
            self._failed = f"a commit broke off ({type(error).__name__}: {error})"
            self._cache.clear()
            self._cached_bytes = 0
            raise
        self._slot[ids] = targets
        self._sha256[ids] = hashes
        for client_id in ids.tolist():
            staged = self._staged[client_id]
            if isinstance(staged, list):  # rows from the staging file are not worth a second read into the cache
                self._remember(client_id, staged)
            else:
                self._forget(client_id)  # the cached rows are the replaced state
        self.discard()

    def discard(self) -> None:
        self._staged = {}
        self._staged_in_memory = 0
        if self._staging_rows and self._staging_descriptor is not None:
            os.ftruncate(self._staging_descriptor, 0)  # the staging file never outlives its round's disk space
        self._staging_rows = 0

    def items(self, include_staged: bool = False) -> Iterator[tuple[int, Any]]:
        """Committed states by client id (read in batches); with ``include_staged``, as they will be after ``commit()``."""
        present = set(np.flatnonzero(self._slot >= 0).tolist())
        staged = set(self._staged) if include_staged else set()
        ids = sorted(present | staged)
        for start in range(0, len(ids), _READ_BATCH):
            batch = ids[start : start + _READ_BATCH]
            rows = {c: self._staged_rows(c) for c in batch if c in staged}
            rows.update(self._read_batch([c for c in batch if c not in rows]))
            for client_id in batch:
                yield client_id, self._decode(rows[client_id])

    def prefetch(self, client_ids: Iterable[int]) -> None:
        """Read the rows of ``client_ids`` that have state into the cache, in file order."""
        wanted = [c for c in sorted(set(int(c) for c in client_ids)) if self._slot[c] >= 0 and c not in self._cache]
        for client_id, rows in self._read_batch(wanted).items():
            self._remember(client_id, rows)

    def __len__(self) -> int:
        return int((self._slot >= 0).sum())

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_table(self, prefix: str) -> dict[str, torch.Tensor]:
        """Flush every field file to disk and return the table that pins this version of the store.

        The table goes into the checkpoint file (``prefix/client_ids``, ``prefix/slots``,
        ``prefix/sha256``); call ``checkpoint_written`` once that file is in place.
        """
        if self._failed is not None:
            raise CheckpointError(f"cannot checkpoint the client states in {self.directory}: {self._failed}")
        for descriptor in self._descriptors.values():
            os.fsync(descriptor)
        ids = np.flatnonzero(self._slot >= 0)
        return {
            f"{prefix}/client_ids": torch.from_numpy(ids.astype(np.int64)),
            f"{prefix}/slots": torch.from_numpy(self._slot[ids].astype(np.uint8)),
            f"{prefix}/sha256": torch.from_numpy(self._sha256[ids].copy()),
        }

    def checkpoint_written(self) -> None:
        """The checkpoint with the last ``checkpoint_table`` is on disk: from now on commits spare its slots."""
        self._checkpointed_slot = self._slot.copy()

    def restore(self, tables: dict[str, torch.Tensor], prefix: str, checkpoint: str | Path) -> None:
        """Take the version of the store that a checkpoint's table pins, checking every row it refers to."""
        missing = [key for key in _STORE_TABLE_KEYS if f"{prefix}/{key}" not in tables]
        if missing:
            raise CheckpointError(
                f"checkpoint {checkpoint} has no table of the client states in {self.directory} ({prefix}/{missing[0]})"
            )
        ids = tables[f"{prefix}/client_ids"].numpy().astype(np.int64)
        slots = tables[f"{prefix}/slots"].numpy().astype(np.int8)
        hashes = tables[f"{prefix}/sha256"].numpy()
        if (
            len(ids)
            and (ids.min() < 0 or ids.max() >= self.num_clients)
            or slots.shape != ids.shape
            or hashes.shape != (len(ids), len(self._fields), 32)
        ):
            raise CheckpointError(
                f"checkpoint {checkpoint} describes client states that do not fit this run's store in {self.directory} "
                f"({len(self._fields)} fields, {self.num_clients} clients); resume with the configuration stored beside it"
            )
        fix = (
            f"the checkpoint {checkpoint} refers to them; restore the directory from a backup together with the checkpoint, "
            "or delete the checkpoint to restart the run from round 0"
        )
        self._cache.clear()
        self._cached_bytes = 0
        for start in range(0, len(ids), _READ_BATCH):
            batch = slice(start, start + _READ_BATCH)
            for client_id, slot, expected in zip(
                ids[batch].tolist(), slots[batch].tolist(), hashes[batch], strict=True
            ):
                for index, field in enumerate(self._fields):
                    path = self._path(index, slot)
                    try:
                        row = self._read_row(index, slot, client_id)
                    except (OSError, CheckpointError) as error:
                        raise CheckpointError(
                            f"client state file {path} is missing or truncated ({error}); {fix}"
                        ) from None
                    if hashlib.sha256(row).digest() != expected[index].tobytes():
                        raise CheckpointError(
                            f"client state file {path} was changed after the checkpoint: the row of client {client_id} "
                            f"({field.name}) does not match its sha256; {fix}"
                        )
        self._slot[:] = -1
        self._slot[ids] = slots
        self._sha256[:] = 0
        self._sha256[ids] = hashes
        self._checkpointed_slot = self._slot.copy()
        self.discard()
        self._failed = None

    def close(self) -> None:
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()
        if self._staging_descriptor is not None:
            os.close(self._staging_descriptor)
            self._staging_descriptor = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------ rows and files

    def _path(self, index: int, slot: int) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", self._fields[index].name)
        return self.directory / f"{index:02d}-{safe}.slot{slot}"

    def _write_manifest(self) -> None:
        manifest = {
            "num_clients": self.num_clients,
            "fields": [
                {
                    "name": f.name,
                    "dtype": str(f.dtype).removeprefix("torch."),
                    "shape": list(f.shape),
                    "files": [self._path(i, s).name for s in (0, 1)],
                }
                for i, f in enumerate(self._fields)
            ],
            "note": "each file is a raw [num_clients, prod(shape)] array; which slot holds a client's row is in the run's checkpoint",
        }
        (self.directory / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    def _descriptor(self, index: int, slot: int, create: bool) -> int:
        key = (index, slot)
        descriptor = self._descriptors.get(key)
        if descriptor is None:
            path = self._path(index, slot)
            # 0o666 (less the umask), as open() creates files: os.open's default, 0o777, would make data files executable
            descriptor = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDWR, 0o666)
            size = self.num_clients * self._fields[index].row_bytes
            if create and os.fstat(descriptor).st_size < size:
                os.ftruncate(descriptor, size)  # sparse: rows never written take no disk space
            self._descriptors[key] = descriptor
        return descriptor

    def _write_row(self, index: int, slot: int, client_id: int, row: np.ndarray) -> None:
        descriptor = self._descriptor(index, slot, create=True)
        view = memoryview(row)
        offset = client_id * self._fields[index].row_bytes
        while len(view):
            written = os.pwrite(descriptor, view, offset)
            view, offset = view[written:], offset + written

    def _read_row(self, index: int, slot: int, client_id: int) -> np.ndarray:
        field = self._fields[index]
        row = np.empty(field.row_bytes, dtype=np.uint8)
        if field.row_bytes == 0:
            return row
        done = 0
        descriptor = self._descriptor(index, slot, create=False)
        while done < field.row_bytes:
            count = os.preadv(descriptor, [memoryview(row)[done:]], client_id * field.row_bytes + done)
            if count == 0:
                raise CheckpointError(f"{self._path(index, slot)} ends before the row of client {client_id}")
            done += count
        return row

    def _write_staged(self, place: int, rows: list[np.ndarray]) -> None:
        if self._staging_descriptor is None:
            self._staging_descriptor = os.open(
                self.directory / STAGING_FILE, os.O_RDWR | os.O_CREAT, 0o666
            )  # not executable
        view, offset = memoryview(np.concatenate(rows) if len(rows) > 1 else rows[0]), place * self._row_bytes
        while len(view):
            written = os.pwrite(self._staging_descriptor, view, offset)
            view, offset = view[written:], offset + written

    def _staged_rows(self, client_id: int) -> list[np.ndarray]:
        staged = self._staged[client_id]
        if isinstance(staged, list):
            return staged
        data = np.empty(self._row_bytes, dtype=np.uint8)
        done, offset = 0, staged * self._row_bytes
        while done < self._row_bytes:
            count = os.preadv(self._staging_descriptor, [memoryview(data)[done:]], offset + done)
            if count == 0:
                raise OSError(f"{self.directory / STAGING_FILE} was cut short while this process used it")
            done += count
        bounds = np.cumsum([0] + [field.row_bytes for field in self._fields])
        return [data[bounds[i] : bounds[i + 1]] for i in range(len(self._fields))]

    def _read_rows(self, client_id: int, slot: int) -> list[np.ndarray]:
        return [self._read_row(index, slot, client_id) for index in range(len(self._fields))]

    def _read_batch(self, client_ids: list[int]) -> dict[int, list[np.ndarray]]:
        """Committed rows of ``client_ids`` (cache first), read field by field in file order."""
        out: dict[int, list[np.ndarray]] = {}
        for client_id in client_ids:
            cached = self._cache.get(client_id)
            if cached is not None:
                out[client_id] = cached
        missing = sorted(c for c in client_ids if c not in out)
        by_field = [
            [self._read_row(index, int(self._slot[c]), c) for c in missing] for index in range(len(self._fields))
        ]
        for position, client_id in enumerate(missing):
            out[client_id] = [by_field[index][position] for index in range(len(self._fields))]
        return out

    def _forget(self, client_id: int) -> None:
        if self._cache.pop(client_id, None) is not None:
            self._cached_bytes -= self._row_bytes

    def _remember(self, client_id: int, rows: list[np.ndarray]) -> None:
        if self._row_bytes > self._cache_bytes:
            return
        previous = self._cache.pop(client_id, None)
        if previous is not None:
            self._cached_bytes -= self._row_bytes
        self._cache[client_id] = rows
        self._cached_bytes += self._row_bytes
        while self._cached_bytes > self._cache_bytes:
            self._cache.popitem(last=False)
            self._cached_bytes -= self._row_bytes

    def _encode(self, state: Any, client_id: int) -> list[np.ndarray]:
        try:
            layout = state_layout(state)
        except ClientStateError as error:
            raise _refuse(client_id, str(error), self.owner, "change the algorithm's client_finish") from None
        # The files hold exactly client_state_init's fields: a None there is no field, so it cannot become a tensor.
        problem = layout_difference(
            layout,
            self._template_layout,
            "client_state_init's state (whose layout the disk store's files hold)",
            none_matches=False,
        )
        if problem is not None:
            raise _refuse(
                client_id,
                problem,
                self.owner,
                CHANGED_FIX + " (a field that starts empty needs a tensor of zeros there, not None)",
            )
        tensors = state_to_tensors(state, "state")
        return [tensors[field.name].reshape(-1).view(torch.uint8).numpy() for field in self._fields]

    def _decode(self, rows: list[np.ndarray]) -> Any:
        tensors = {
            field.name: torch.from_numpy(row.copy()).view(field.dtype).reshape(field.shape)
            for field, row in zip(self._fields, rows, strict=True)
        }
        return state_from_tensors(self._template, tensors, "state", _device_of(self._template))


def _device_of(template: Any) -> torch.device:
    for tensor in state_to_tensors(template, "t").values():
        return tensor.device
    return torch.device("cpu")


def state_bytes(template: Any) -> int:
    """Bytes one client's state of ``template``'s structure takes."""
    return sum(t.numel() * t.element_size() for t in state_to_tensors(template, "state").values())
