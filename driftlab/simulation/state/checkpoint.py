"""Checkpoints: atomic, pickle-free (safetensors), complete enough for an exact resume.

A checkpoint holds the last completed round, the server state and every
client's state, all as named tensors; the rest of a run (minibatches, client
samples, availability) is re-derived from (seed, round, client id).

Writes are atomic: the file is written beside its final name, flushed to disk,
then renamed over the old checkpoint, so a kill at any moment leaves either
the previous checkpoint or the new one, never a torn file.  What a kill leaves
of the write is ``.NAME.tmp-PID``, which the next run in the folder removes
(``run_directory.remove_interrupted_writes``): tensors are written by
``save_tensors``, never by safetensors' ``save_file``, which writes through a
temporary of its own (``.tmpXXXXXX``, mode 0600) that nothing would recognise
as ours.  Files get the mode any new file gets (0666 less the umask).

Every checkpoint carries a SHA-256 of its metadata and of each tensor's name,
dtype, shape and bytes (metadata key ``sha256``); loading verifies it, so a
flipped bit, a tensor re-saved in another dtype or an edited ``round`` is
refused instead of resuming silently to a different model.

With the disk client-state store (``state_store.DiskClientStore``) the
client states stay in the store's files: the checkpoint holds, per store, the
table that pins the store's committed version (which slot holds each client's
rows and their SHA-256), under the checkpoint's own checksum, so a checkpoint
writes only the server state, that table and the rows changed since the last
one (fsync-ed in the store's files); see state_store.py for why this is atomic.
The stages of a write call ``_reached(stage)``, which tests replace to
interrupt a checkpoint at each of them.

A checkpoint exists to continue a run: a run that completes removes it
(``keep_checkpoint = false``, the default; ``runner.drop_checkpoint``) and keeps
its final model, and the engine's own running values go in compactly
(``latest_models.checkpoint_tensors``), so tiny runs stay light on disk.

States are frozen dataclasses of tensors, numbers and nested dataclasses;
``state_to_tensors`` flattens them to ``{"prefix/field/sub": tensor}`` and
``state_from_tensors`` fills a template of the same structure (the freshly
initialised state) back in, so no type information needs to be stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

FORMAT_VERSION = 2  # 2: checksummed (sha256 of metadata and tensors)
_CHECKSUMMED_METADATA = ("format_version", "round", "fingerprint", "client_ids")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, or from another experiment."""


def state_to_tensors(state: Any, prefix: str) -> dict[str, torch.Tensor]:
    if state is None:
        return {}
    if isinstance(state, torch.Tensor):
        return {prefix: state.detach().to("cpu").clone().contiguous()}
    if isinstance(state, bool):
        return {prefix: torch.tensor(state, dtype=torch.bool)}
    if isinstance(state, int):
        return {prefix: torch.tensor(state, dtype=torch.int64)}
    if isinstance(state, float):
        return {prefix: torch.tensor(state, dtype=torch.float64)}
    if dataclasses.is_dataclass(state):
        out: dict[str, torch.Tensor] = {}
        for field in dataclasses.fields(state):
            out.update(state_to_tensors(getattr(state, field.name), f"{prefix}/{field.name}"))
        return out
    if isinstance(state, tuple):
        out = {}
        for index, item in enumerate(state):
            out.update(state_to_tensors(item, f"{prefix}/{index}"))
        return out
    raise TypeError(
        f"cannot checkpoint {prefix!r} of type {type(state).__name__}; states hold tensors, numbers and dataclasses"
    )


def state_from_tensors(template: Any, tensors: dict[str, torch.Tensor], prefix: str, device: torch.device) -> Any:
    if template is None:
        return tensors[prefix].to(device) if prefix in tensors else None
    if isinstance(template, torch.Tensor):
        stored = _take(tensors, prefix)
        if stored.shape != template.shape:
            raise CheckpointError(
                f"checkpoint entry {prefix!r} has shape {tuple(stored.shape)}, the run expects {tuple(template.shape)}"
            )
        return stored.to(device=template.device, dtype=template.dtype)
    if isinstance(template, bool):
        return bool(_take(tensors, prefix).item())
    if isinstance(template, int):
        return int(_take(tensors, prefix).item())
    if isinstance(template, float):
        return float(_take(tensors, prefix).item())
    if dataclasses.is_dataclass(template):
        values = {
            field.name: state_from_tensors(getattr(template, field.name), tensors, f"{prefix}/{field.name}", device)
            for field in dataclasses.fields(template)
        }
        return dataclasses.replace(template, **values)
    if isinstance(template, tuple):
        return tuple(
            state_from_tensors(item, tensors, f"{prefix}/{index}", device) for index, item in enumerate(template)
        )
    raise TypeError(f"cannot restore {prefix!r} of type {type(template).__name__}")


def _take(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise CheckpointError(
            f"checkpoint has no entry {key!r}; it was written by a different algorithm or configuration"
        ) from None


def save_tensors(
    tensors: dict[str, torch.Tensor], filename: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """``tensors`` as a safetensors file at ``filename``: what ``safetensors.torch.save_file`` writes (the same
    serializer; like it, the header lists several metadata keys in an arbitrary order).

    ``save_file`` (safetensors 0.8) writes a temporary ``.tmpXXXXXX`` beside the file and renames it: inside
    ``write_atomically`` a kill would leave a file no run recognises as its own (and the result would have mode
    0600).  Here the bytes are made in memory (one copy of the file, freed on return) and written by us, so the
    only temporary is ``write_atomically``'s.
    """
    data = save(tensors, metadata=metadata)
    with open(filename, "wb") as handle:
        handle.write(data)


def new_file_mode() -> int:
    """The mode a new file gets: 0666 less the process's umask (read from /proc, without changing it, where it can be)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: the only way to read it is to set it, at once set back
    os.umask(mask)
    return 0o666 & ~mask


def write_atomically(path: Path, write: Callable[[Path], None], mode: int | None = None) -> None:
    """Call ``write(temporary path)``, then move the result over ``path`` in one rename.

    The temporary is ``.NAME.tmp-PID``, what ``run_directory.remove_interrupted_writes`` removes after a kill.  The
    result gets a new file's mode (``new_file_mode``) whatever ``write`` created it with: a writer that renames a
    private temporary of its own over the path (0600) must not make a run's files unreadable to its group.
    ``mode`` replaces that for a file that must stay private (a secret: 0o600).
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(temporary, new_file_mode() if mode is None else mode)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def checkpoint_checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 over the checksummed metadata fields and every tensor's name, dtype, shape and raw bytes."""
    digest = hashlib.sha256()
    header = {key: metadata.get(key) for key in _CHECKSUMMED_METADATA}
    if "client_stores" in metadata:  # only in checkpoints of disk stores, so older checkpoints keep their checksums
        header["client_stores"] = metadata["client_stores"]
    digest.update(json.dumps(header, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.detach().to("cpu").reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _reached(stage: str) -> None:
    """Called at each stage of a checkpoint write ("tables", "written", "renamed", "done"); tests raise here."""


STORE_PREFIX = "store/"
ENGINE_PREFIX = "engine/"


def save_checkpoint(
    path: Path,
    round_index: int,
    server_state: Any,
    client_states: dict[int, Any],
    fingerprint: str,
    stores: dict[str, Any] | None = None,
    engine_tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write the checkpoint of round ``round_index``.

    ``client_states`` go into the file; ``stores`` (name -> ``DiskClientStore``) are
    flushed and referenced by their tables (``store/NAME/...``), and told once the
    file is in place, so their next commits spare the rows it refers to.
    ``engine_tensors`` are the engine's own running values (``engine/NAME``).
    """
    stores = stores or {}
    tensors = state_to_tensors(server_state, "server")
    tensors.update({f"{ENGINE_PREFIX}{name}": tensor.contiguous() for name, tensor in (engine_tensors or {}).items()})
    for client_id, client_state in client_states.items():
        tensors.update(state_to_tensors(client_state, f"client/{client_id}"))
    for name, store in stores.items():
        tensors.update(store.checkpoint_table(f"{STORE_PREFIX}{name}"))
    _reached("tables")
    metadata = {
        "format_version": str(FORMAT_VERSION),
        "round": str(round_index),
        "fingerprint": fingerprint,
        "client_ids": json.dumps(sorted(int(c) for c in client_states)),
    }
    if stores:
        metadata["client_stores"] = json.dumps(sorted(stores))
    metadata["sha256"] = checkpoint_checksum(tensors, metadata)

    def write(temporary: Path) -> None:
        save_tensors(tensors, str(temporary), metadata=metadata)
        _reached("written")

    write_atomically(path, write)
    _reached("renamed")
    for store in stores.values():
        store.checkpoint_written()
    _reached("done")


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    round: int
    server_state: Any
    client_states: dict[int, Any]
    # The tables of disk client-state stores (``store/NAME/...``), checksummed with the rest; {} for in-file states.
    store_tables: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    engine_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # by name, without the prefix

    def store_names(self) -> list[str]:
        return sorted({key[len(STORE_PREFIX) :].split("/", 1)[0] for key in self.store_tables})


def _corrupt(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is corrupt or was edited ({what}); restore it from a backup, "
        f"or delete it to restart the run from round 0, or start again with a new --out directory"
    )


def read_tensors(
    path: Path, unreadable: Callable[[BaseException], str]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and metadata; a ``CheckpointError(unreadable(error))`` when it is unreadable,
    corrupt or truncated (what to do about it is the caller's to say)."""
    from safetensors import safe_open

    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            return tensors, handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(unreadable(error)) from error


def load_checkpoint(
    path: Path, server_template: Any, client_template: Callable[[], Any] | None, fingerprint: str, device: torch.device
) -> LoadedCheckpoint:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; start the run without --resume")
    tensors, metadata = read_tensors(
        path,
        lambda error: (
            f"checkpoint {path} is unreadable, corrupt or truncated ({error}); restore it, "
            "or delete it to restart the run from round 0"
        ),
    )
    version = metadata.get("format_version")
    if version is None:
        raise CheckpointError(
            f"{path} is not a driftlab checkpoint (its metadata has no format_version); restore it or use a new --out directory"
        )
    if version != str(FORMAT_VERSION):
        raise CheckpointError(
            f"checkpoint {path} has format {version!r}, this driftlab reads format {FORMAT_VERSION} only (checkpoints with checksums); "
            "finish that run with the driftlab version that started it, or start it again with a new --out directory"
        )
    round_index = _checkpoint_round(path, metadata.get("round"))
    client_ids = _client_ids(path, metadata.get("client_ids"))
    stored_checksum = metadata.get("sha256")
    if not isinstance(stored_checksum, str):
        raise _corrupt(path, "its metadata has no sha256 checksum")
    if checkpoint_checksum(tensors, metadata) != stored_checksum:
        raise _corrupt(path, "its tensors or metadata do not match the sha256 checksum written with it")
    if metadata.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} belongs to a different experiment configuration; "
            "resume with the config stored beside it (config.json) or use a new --out directory"
        )
    server_state = state_from_tensors(server_template, tensors, "server", device)
    client_states = {}
    for client_id in client_ids:
        template = client_template() if client_template is not None else None
        client_states[client_id] = state_from_tensors(template, tensors, f"client/{client_id}", device)
    store_tables = {key: tensor for key, tensor in tensors.items() if key.startswith(STORE_PREFIX)}
    engine_tensors = {
        key[len(ENGINE_PREFIX) :]: tensor.to(device) for key, tensor in tensors.items() if key.startswith(ENGINE_PREFIX)
    }
    return LoadedCheckpoint(round_index, server_state, client_states, store_tables, engine_tensors)


def _checkpoint_round(path: Path, text: str | None) -> int:
    if text is None or not text.isascii() or not text.isdigit():
        raise _corrupt(path, f"its round is {text!r}, not a round number 0, 1, 2, ...")
    return int(text)


def _client_ids(path: Path, text: str | None) -> list[int]:
    try:
        ids = json.loads(text) if text is not None else None
    except json.JSONDecodeError:
        ids = None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise _corrupt(path, f"its client_ids are {text!r}, not a list of client ids")
    return ids
