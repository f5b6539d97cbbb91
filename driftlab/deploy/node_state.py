"""A client's algorithm state kept on the node's disk between rounds of a deployment.

In a deployment the server cannot hold client states (SCAFFOLD's ``c_k``,
FedDyn's ``λ_k``, an error-feedback residual): each node keeps the states of
its clients, one safetensors file per client, ``client-<id>.safetensors`` in
the node's state directory, flattened as checkpoints flatten states
(``checkpoint.state_to_tensors``) and filled back into a template of the
state's structure.

A round's new state only becomes the client's state once the server has
used the reply it belongs to, so client and server never disagree about it
(SCAFFOLD's ``c`` is the mean of the ``c_k`` only if every ``c_k`` the clients
keep went into ``c``):

``stage(round, state)``
    writes ``client-<id>.round-<t>.staged.safetensors`` after the client sends
    its reply of round ``t``; any other staged file of the client is removed
    (a client trains from its committed state, so at most one staged state
    can still be confirmed).
``commit(round)``
    when the server confirms it aggregated that reply: the staged file is
    renamed over the committed one.
``drop(round)``
    when the server says the reply was not aggregated (late, rejected) or
    the round was abandoned: the staged file is deleted.
``load()``
    the committed state, or the algorithm's initial state for a client that
    has none yet.  Staged files are never loaded.

Every write is atomic (a temporary file beside the final name, fsync, one
rename, fsync of the directory, via ``checkpoint.write_atomically``), and a
commit is a single rename, so a kill at any moment leaves the last committed
file intact.  A node restarted on the same directory (a new ``NodeClientState``)
restores the committed state, removes temporary files a kill left behind and
staged files of rounds not after the committed one (stale), and keeps a newer
staged file, which a confirmation arriving after the restart still commits.

Each file records the run's config fingerprint, the client id and the round,
under a SHA-256 of those and of every tensor (``checkpoint.checkpoint_checksum``).
A file of another run is never loaded: ``load()`` (and ``stage``, which needs
the committed round) raises ``CheckpointError``
naming both fingerprints (give each run its own state directory, or delete the
file to start that client from its initial state).  So does a file of another
client, an edited or truncated file, or one whose tensors do not fit the
template.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Callable

import torch

from driftlab.simulation.state.checkpoint import (
    CheckpointError,
    checkpoint_checksum,
    read_tensors,
    save_tensors,
    state_from_tensors,
    state_to_tensors,
    write_atomically,
)

NODE_STATE_FORMAT = "driftlab-node-state/1"
_PREFIX = "state"


class NodeClientState:
    """The state of client ``client_id`` of the run ``run_fingerprint`` in ``directory`` (module docstring).

    ``template`` is a state of the stored structure (the freshly initialised
    one): it fixes the fields, dtypes, shapes and the device states are
    loaded to.  ``initial`` builds the state of a client with no committed
    file (``None``: such a client has no state and ``load()`` returns None).
    """

    def __init__(
        self,
        directory: str | Path,
        client_id: int,
        run_fingerprint: str,
        template: Any,
        initial: Callable[[], Any] | None,
    ) -> None:
        self.directory = Path(directory)
        self.client_id = int(client_id)
        self.run_fingerprint = str(run_fingerprint)
        self._template = template
        self._initial = initial
        self._layout = {
            name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in state_to_tensors(template, _PREFIX).items()
        }
        self._committed_round: int | None = None
        self.directory.mkdir(parents=True, exist_ok=True)
        self._clean_up()

    @property
    def path(self) -> Path:
        """The committed state's file."""
        return self.directory / f"client-{self.client_id}.safetensors"

    def staged_path(self, round: int) -> Path:
        return self.directory / f"client-{self.client_id}.round-{int(round)}.staged.safetensors"

    # ------------------------------------------------------------------ the protocol

    def load(self) -> Any:
        """The committed state, or ``initial()`` for a client that has none; CheckpointError for an unusable file."""
        if not self.path.exists():
            return self._initial() if self._initial is not None else None
        tensors, round = self._read(self.path)
        self._committed_round = round
        # Tensors go to the template's device (state_from_tensors); the device argument only serves None fields.
        return state_from_tensors(self._template, tensors, _PREFIX, torch.device("cpu"))

    @property
    def committed_round(self) -> int | None:
        """The round of the committed state (None: none committed yet); CheckpointError for an unusable file."""
        if self._committed_round is None and self.path.exists():
            self._committed_round = self._read(self.path)[1]
        return self._committed_round

    @property
    def staged_round(self) -> int | None:
        """The round of the staged state waiting for the server's word (None: nothing staged)."""
        staged = self._staged_files()
        return staged[-1][0] if staged else None

    def stage(self, round: int, state: Any) -> None:
        """Write ``state``, the client's state after its reply of ``round``, as staged; it counts only after ``commit(round)``."""
        round = int(round)
        committed = self.committed_round
        if committed is not None and round <= committed:
            raise ValueError(
                f"cannot stage round {round} for client {self.client_id}: round {committed} is already committed"
            )
        tensors = state_to_tensors(state, _PREFIX)
        self._check_layout(tensors)
        metadata = self._metadata(round)
        metadata["sha256"] = checkpoint_checksum(tensors, metadata)
        write_atomically(self.staged_path(round), lambda temporary: save_tensors(tensors, temporary, metadata=metadata))
        for other, path in self._staged_files():
            if other != round:
                path.unlink(missing_ok=True)

    def commit(self, round: int) -> None:
        """The server aggregated the reply of ``round``: its staged state becomes the client's state (one rename)."""
        staged = self.staged_path(round)
        if not staged.exists():
            raise ValueError(
                f"client {self.client_id} has no staged state of round {round} to commit (never staged, dropped, "
                f"already committed, or replaced by a later round's); committed round: {self.committed_round}"
            )
        _, staged_round = self._read(staged)
        if staged_round != int(round):
            raise CheckpointError(f"{staged} holds round {staged_round}, not round {round}; delete it")
        os.replace(staged, self.path)
        _fsync_directory(self.directory)
        self._committed_round = staged_round

    def drop(self, round: int) -> None:
        """The reply of ``round`` was not aggregated: forget its staged state (nothing happens if there is none)."""
        self.staged_path(round).unlink(missing_ok=True)

    # ------------------------------------------------------------------ files

    def _metadata(self, round: int) -> dict[str, str]:
        # The keys checkpoint_checksum covers, plus this file's own format.
        return {
            "format_version": NODE_STATE_FORMAT,
            "round": str(round),
            "fingerprint": self.run_fingerprint,
            "client_ids": json.dumps([self.client_id]),
        }

    def _read(self, path: Path) -> tuple[dict[str, torch.Tensor], int]:
        """The tensors and round of a state file, after every check of the module docstring."""
        fix = f"delete {path} to start client {self.client_id} from its initial state, or point the node at another state directory"
        tensors, metadata = read_tensors(
            path, lambda error: f"client state file {path} is unreadable, corrupt or truncated ({error}); {fix}"
        )
        if metadata.get("format_version") != NODE_STATE_FORMAT:
            raise CheckpointError(
                f"{path} is not a driftlab node state file (format {metadata.get('format_version')!r}); {fix}"
            )
        if metadata.get("fingerprint") != self.run_fingerprint:
            raise CheckpointError(
                f"client state file {path} belongs to the run with config fingerprint {metadata.get('fingerprint')!r}, "
                f"this run's is {self.run_fingerprint!r}; a state file of another run is never loaded: {fix}"
            )
        if metadata.get("client_ids") != json.dumps([self.client_id]):
            raise CheckpointError(
                f"client state file {path} holds the state of client(s) {metadata.get('client_ids')}, not of client {self.client_id}; {fix}"
            )
        if metadata.get("sha256") != checkpoint_checksum(tensors, metadata):
            raise CheckpointError(
                f"client state file {path} was changed after it was written (its sha256 does not match); {fix}"
            )
        round_text = metadata.get("round", "")
        if not round_text.isascii() or not round_text.isdigit():
            raise CheckpointError(f"client state file {path} has round {round_text!r}; {fix}")
        try:
            self._check_layout(tensors)
        except ValueError as error:
            raise CheckpointError(
                f"client state file {path} does not fit this run's client state ({error}); {fix}"
            ) from None
        return tensors, int(round_text)

    def _check_layout(self, tensors: dict[str, torch.Tensor]) -> None:
        if tensors.keys() != self._layout.keys():
            raise ValueError(
                f"a client state with fields {sorted(tensors)} does not fit the layout {sorted(self._layout)}; "
                "an algorithm's client states must keep the structure of client_state_init's"
            )
        for name, tensor in tensors.items():
            dtype, shape = self._layout[name]
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"client state field {name} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}"
                )

    def _staged_files(self) -> list[tuple[int, Path]]:
        pattern = re.compile(rf"client-{self.client_id}\.round-([0-9]+)\.staged\.safetensors")
        found = []
        for path in self.directory.iterdir():
            match = pattern.fullmatch(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def _clean_up(self) -> None:
        """Remove what a killed process left: temporary files, and staged files not newer than the committed state."""
        temporary = re.compile(rf"\.client-{self.client_id}\.(round-[0-9]+\.staged\.)?safetensors\.tmp-[0-9]+")
        for path in self.directory.iterdir():
            if temporary.fullmatch(path.name):
                path.unlink(missing_ok=True)
        try:
            committed = self.committed_round
        except CheckpointError:
            return  # load() reports the unusable file; keep everything as it is until then
        for round, path in self._staged_files():
            if committed is not None and round <= committed:
                path.unlink(missing_ok=True)


TOKEN_BYTES = 16


def registration_token(directory: str | Path, client_id: int) -> bytes:
    """The secret this node proves it holds client ``client_id`` with, in ``directory/client-<id>.token``.

    Made (``secrets.token_bytes``) and written atomically the first time it is
    asked for, so it is on disk before it is ever sent: the server pins the
    first token a client registers with and accepts the client later only
    from a node that sends the same token (``driftlab.deploy.server`` module docstring).
    A file of another length is refused (CheckpointError), never replaced: a
    new token would lose the client for the run.
    """
    path = Path(directory) / f"client-{int(client_id)}.token"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_bytes(TOKEN_BYTES)
        write_atomically(
            path, lambda temporary: temporary.write_bytes(token), mode=0o600
        )  # a secret: the owner's alone
    token = path.read_bytes()
    if len(token) != TOKEN_BYTES:
        raise CheckpointError(
            f"{path} holds {len(token)} bytes, a registration token has {TOKEN_BYTES}: it was damaged or replaced; restore it "
            "from a backup (without it the server does not give this node the client again in this run)"
        )
    return token


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
