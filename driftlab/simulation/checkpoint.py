"""Checkpoints: atomic, pickle-free (safetensors), complete enough for an exact resume.

A checkpoint holds the last completed round, the server state and every
client's state, all as named tensors; the rest of a run (minibatches, client
samples, availability) is re-derived from (seed, round, client id).

Writes are atomic: the file is written beside its final name, flushed to disk,
then renamed over the old checkpoint, so a kill at any moment leaves either
the previous checkpoint or the new one, never a torn file.

States are frozen dataclasses of tensors, numbers and nested dataclasses;
``state_to_tensors`` flattens them to ``{"prefix/field/sub": tensor}`` and
``state_from_tensors`` fills a template of the same structure (the freshly
initialised state) back in, so no type information needs to be stored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1


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
    raise TypeError(f"cannot checkpoint {prefix!r} of type {type(state).__name__}; states hold tensors, numbers and dataclasses")


def state_from_tensors(template: Any, tensors: dict[str, torch.Tensor], prefix: str, device: torch.device) -> Any:
    if template is None:
        return tensors[prefix].to(device) if prefix in tensors else None
    if isinstance(template, torch.Tensor):
        stored = _take(tensors, prefix)
        if stored.shape != template.shape:
            raise CheckpointError(f"checkpoint entry {prefix!r} has shape {tuple(stored.shape)}, the run expects {tuple(template.shape)}")
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
        return tuple(state_from_tensors(item, tensors, f"{prefix}/{index}", device) for index, item in enumerate(template))
    raise TypeError(f"cannot restore {prefix!r} of type {type(template).__name__}")


def _take(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise CheckpointError(f"checkpoint has no entry {key!r}; it was written by a different algorithm or configuration") from None


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(temporary path)``, then move the result over ``path`` in one rename."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_checkpoint(path: Path, round_index: int, server_state: Any, client_states: dict[int, Any], fingerprint: str) -> None:
    tensors = state_to_tensors(server_state, "server")
    for client_id, client_state in client_states.items():
        tensors.update(state_to_tensors(client_state, f"client/{client_id}"))
    metadata = {
        "format_version": str(FORMAT_VERSION),
        "round": str(round_index),
        "fingerprint": fingerprint,
        "client_ids": json.dumps(sorted(int(c) for c in client_states)),
    }
    write_atomically(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    round: int
    server_state: Any
    client_states: dict[int, Any]


def load_checkpoint(
    path: Path, server_template: Any, client_template: Callable[[], Any] | None, fingerprint: str, device: torch.device
) -> LoadedCheckpoint:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; start the run without --resume")
    try:
        tensors = load_file(str(path))
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path} is unreadable ({error}); delete it to restart the run from round 0") from error
    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise CheckpointError(f"checkpoint {path} has format {metadata.get('format_version')!r}, this driftlab reads {FORMAT_VERSION}")
    if metadata.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} belongs to a different experiment configuration; "
            "resume with the config stored beside it (config.json) or use a new --out directory"
        )
    server_state = state_from_tensors(server_template, tensors, "server", device)
    client_states = {}
    for client_id in json.loads(metadata["client_ids"]):
        template = client_template() if client_template is not None else None
        client_states[client_id] = state_from_tensors(template, tensors, f"client/{client_id}", device)
    return LoadedCheckpoint(int(metadata["round"]), server_state, client_states)
