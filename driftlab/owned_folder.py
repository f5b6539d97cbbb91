"""Folders a user names: driftlab writes there only files it wrote itself, and deletes only those.

A command that writes fixed names into a folder the user chose (``report --out``'s ``report.md``, ``demo --out``'s
``summary.md``, a sweep's ``sweep.json``) first *claims* those names (``claim``): it refuses, before writing
anything, when any of them already exists in the folder and was not written by driftlab, naming the files and the
fix (another folder, or ``--force``). The names a command writes are listed in the folder's manifest
``.driftlab-written.json`` *before* they are written, with the command that wrote them, so a command killed mid-write
still owns what it left, and running it again into its own folder replaces its own files, as expected.

``--force`` lets a command replace files of the names it writes; nothing else in the folder is ever touched, and
``OwnedFolder.remove`` deletes only what the manifest lists.  Folders written by driftlab versions before the
manifest are recognised by their content (``recognise``: a sweep's ``sweep.json``, a report's first line), so they
stay resumable.

A command whose files are meant to be edited (``flower new``'s project) also records what it wrote
(``record_digests``): a file changed since is the user's work, refused like a file of theirs.

Used by ``demo``, ``sweep``, ``report``, ``reproduce``, ``data download`` and ``flower new``; ``run`` keeps its own
stricter rule (a new or empty folder, or its own run: ``driftlab.experiments.run.run_directory``).

The manifest::

    {"format": 1, "files": {"report.md": "driftlab report", "accuracy.csv": "driftlab report", ...},
     "digests": {"driftlab_app/apps.py": "<sha256>", ...}}

Files and folders are created with Python's defaults, ``0o666`` and ``0o777`` less the umask: no data or result
file is executable.

This module imports only the standard library and ``driftlab.errors``, so every layer (``driftlab.data``'s
downloads included) uses it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from driftlab.errors import ConfigError

MANIFEST_FILE = ".driftlab-written.json"
MANIFEST_FORMAT = 1
_MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists file names: megabytes would be no manifest of ours
_SHOWN = 5  # names listed in a refusal; the rest are counted

Recognise = Callable[[Path], bool]  # whether an existing entry was written by an earlier driftlab (before manifests)


@dataclass
class OwnedFolder:
    """A folder a user named, and the names in it driftlab wrote (its manifest)."""

    path: Path
    command: str  # what writes now, recorded beside each name it claims: "driftlab report"
    files: dict[str, str] = field(default_factory=dict)  # name -> the command that wrote it
    # relative path -> SHA-256 of what was written, for files meant to be edited (a Flower project's apps.py): a file
    # whose content changed since is the user's work now, and is not replaced without --force
    digests: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, folder: str | Path, command: str) -> "OwnedFolder":
        """The folder's manifest (none yet: nothing listed); a ConfigError when the file there is not one of ours."""
        path = Path(folder)
        manifest = path / MANIFEST_FILE
        try:
            if not manifest.is_file():
                if os.path.lexists(manifest):
                    raise ValueError("it is not a plain file")
                return cls(path, command)
            if manifest.stat().st_size > _MAX_MANIFEST_BYTES:
                raise ValueError(f"{manifest.stat().st_size} bytes")
            content = json.loads(manifest.read_text(encoding="utf-8"))
            files = content.get("files") if isinstance(content, dict) else None
            digests = content.get("digests", {}) if isinstance(content, dict) else None
            for table in (files, digests):
                if not isinstance(table, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in table.items()
                ):
                    raise ValueError('it has no "files" table of names')
        except (OSError, ValueError) as error:  # json's errors are ValueErrors
            reason = getattr(error, "strerror", None) or str(error).splitlines()[0][:200]
            raise ConfigError(
                f"{manifest} is not a manifest driftlab wrote ({reason}); choose another folder, or remove that file"
            ) from None
        return cls(path, command, dict(files), dict(digests))

    def owns(self, name: str) -> bool:
        """Whether the manifest lists ``name`` (a file or folder directly in this folder) as driftlab's."""
        return name in self.files

    def foreign(self, names: Iterable[str], recognise: Recognise | None = None) -> list[str]:
        """The ``names`` that exist here but driftlab did not write (a broken link counts: writing would follow it),
        or that hold a file edited since driftlab wrote it (``record_digests``)."""
        refused = []
        for name in dict.fromkeys(names):
            entry = self.path / name
            if not os.path.lexists(entry):
                continue
            if self.owns(name):
                refused += self.edited(name)
                continue
            if recognise is not None and not entry.is_symlink() and recognise(entry):
                continue
            refused.append(name)
        return refused

    def record(self, names: Iterable[str]) -> None:
        """List ``names`` as written by this command, in the manifest, before they are written."""
        new = {name: self.command for name in names if self.files.get(name) != self.command}
        if new:
            self.files.update(new)
            self._save()

    def record_digests(self, relative_paths: Iterable[str]) -> None:
        """Remember the content of files just written (paths relative to the folder), so a later edit is noticed."""
        import hashlib

        for relative in relative_paths:
            self.digests[relative] = hashlib.sha256((self.path / relative).read_bytes()).hexdigest()
        self._save()

    def edited(self, name: str) -> list[str]:
        """The files under ``name`` (itself, or in it when a folder) whose content differs from what driftlab wrote."""
        import hashlib

        changed = []
        for relative, digest in self.digests.items():
            if relative == name or relative.startswith(name + "/"):
                path = self.path / relative
                try:
                    if path.is_symlink() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                        changed.append(relative)
                except FileNotFoundError:
                    pass  # removed since: nothing of the user's to lose
                except OSError:
                    changed.append(relative)
        return changed

    def remove(self, name: str) -> bool:
        """Delete ``name`` (a file, or a folder and what is in it) when the manifest lists it; returns whether it did.

        What the manifest does not list is never deleted, whatever its name: it may be the user's.
        """
        if not self.owns(name):
            return False
        import shutil

        entry = self.path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)
        del self.files[name]
        self.digests = {k: v for k, v in self.digests.items() if k != name and not k.startswith(name + "/")}
        self._save()
        return True

    def _save(self) -> None:
        """Write the manifest through a temporary file and a rename, so a kill never leaves half of one."""
        content: dict[str, object] = {"format": MANIFEST_FORMAT, "files": dict(sorted(self.files.items()))}
        if self.digests:
            content["digests"] = dict(sorted(self.digests.items()))
        text = json.dumps(content, indent=1) + "\n"
        target = self.path / MANIFEST_FILE
        temporary = self.path / f".{MANIFEST_FILE}.tmp-{os.getpid()}"
        try:
            temporary.write_text(text, encoding="utf-8")
            os.replace(temporary, target)
        finally:
            if temporary.exists():
                temporary.unlink()


def claim(
    folder: str | Path,
    names: Iterable[str],
    command: str,
    *,
    force: bool = False,
    recognise: Recognise | None = None,
    another: str = "choose another --out directory",
    force_option: str | None = "--force",
) -> OwnedFolder:
    """Check that ``command`` may write ``names`` in ``folder``, then create the folder and list the names as its own.

    A name may be written when the folder does not hold it, when the manifest lists it, when ``recognise`` says an
    earlier driftlab wrote it, or with ``force``.  Otherwise a ConfigError names the files and the fix, and nothing
    at all is written (not even the folder).

    Args:
      folder: the folder the user named (created with its parents when the claim succeeds).
      names: entries directly in ``folder`` the command writes: file names, or folders it creates and fills.
      command: recorded in the manifest beside each name, e.g. ``"driftlab report"``.
      force: replace files of these names whoever wrote them (``--force``); others in the folder are still untouched.
      recognise: for folders written before manifests existed; called with an existing entry's path.
      another: the first fix the refusal offers, e.g. "choose another --out directory".
      force_option: the option that forces, named in the refusal (None: the command has none).

    Example:
      >>> owned = claim("reports/mnist", ["report.md"], "driftlab report")  # doctest: +SKIP
    """
    names = list(dict.fromkeys(names))
    path = Path(folder)
    if os.path.lexists(path) and not path.is_dir():
        raise ConfigError(f"{path} exists and is not a directory; {another}")
    owned = OwnedFolder.read(path, command)
    refused = [] if force else owned.foreign(names, recognise)
    if refused:
        raise ConfigError(refusal(path, refused, another, force_option))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create the directory {path}: {error.strerror or error}; {another}") from None
    owned.record(names)
    return owned


def refusal(folder: Path, refused: list[str], another: str, force_option: str | None = "--force") -> str:
    """One line: which of the folder's files are not driftlab's, that nothing was written, and the fix."""
    shown = ", ".join(refused[:_SHOWN]) + (f" and {len(refused) - _SHOWN} more" if len(refused) > _SHOWN else "")
    them = "it" if len(refused) == 1 else "them"
    fix = f"{another}, or pass {force_option} to replace {them}" if force_option else another
    return f"{folder} already holds {shown}, not written by driftlab (or changed since); nothing was written: {fix}"


def first_line(path: Path, limit: int = 200) -> str:
    """The first line of a file (at most ``limit`` bytes read), '' when it cannot be read: for ``recognise``."""
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).split(b"\n", 1)[0].decode("utf-8", errors="replace")
    except OSError:
        return ""


__all__ = ["MANIFEST_FILE", "OwnedFolder", "claim", "first_line", "refusal"]
