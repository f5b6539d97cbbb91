"""How the ``driftlab`` command line tells the user what went wrong: which errors are the user's to fix (exit code 2),
an unexpected error as one line and a log holding its traceback, a run's warnings as one line each, and the config
or sweep file named on the command line checked to be readable UTF-8 text before a command reads it."""

from __future__ import annotations

import argparse
import codecs
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from driftlab.errors import ConfigError

# Errors whose message says what to fix (exit code 2), besides ConfigError: (module, name). The modules
# import torch, so they are imported by the commands that need them, never here (`driftlab report` and
# `--help` import no torch); an error of a module that was not imported cannot have been raised.
USER_ERRORS = (
    ("driftlab.data.federated", "DataFileError"),
    ("driftlab.experiments.run.datasets", "DataSetupError"),
    ("driftlab.simulation.state.checkpoint", "CheckpointError"),
)


def _user_errors() -> tuple[type[Exception], ...]:
    """ConfigError and those of USER_ERRORS whose module is imported (evaluated when an error is being handled)."""
    loaded = (getattr(sys.modules.get(module), name, None) for module, name in USER_ERRORS)
    return (ConfigError, *(error for error in loaded if error is not None))


def _show_run_warnings_plainly() -> None:
    """A run's own warnings (``UnstableRunWarning``, ``ResumeChangeWarning``) as one ``driftlab: warning: ...`` line,
    without Python's source line."""
    show = warnings.showwarning

    def shown(message, category, filename, lineno, file=None, line=None):  # warnings.showwarning's signature
        if category.__name__ in ("UnstableRunWarning", "ResumeChangeWarning"):
            print(f"driftlab: warning: {message}", file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = shown


ERROR_LOG = "error.log"
MESSAGE_LIMIT = 500  # characters of an unexpected error's message on the terminal; the log has all of it


def _report_unexpected(error: Exception, argv: list[str], args: argparse.Namespace | None, debug: bool) -> int:
    """One short line, the log holding the traceback, exit code 1; the traceback on stderr only with --debug."""
    details = "".join(traceback.format_exception(error))
    log = _write_error_log(details, argv, args)
    message = " ".join(str(error).split())
    if len(message) > MESSAGE_LIMIT:
        message = message[:MESSAGE_LIMIT] + " ..."
    if debug:
        print(details, file=sys.stderr, end="")
    print(
        f"driftlab: error: {type(error).__name__}: {message}"
        if message
        else f"driftlab: error: {type(error).__name__}",
        file=sys.stderr,
    )
    if log is not None:
        print(f"driftlab: full traceback in {log}" + ("" if debug else " (or run again with --debug)"), file=sys.stderr)
    elif not debug:
        print("driftlab: no log could be written; run again with --debug to see the traceback", file=sys.stderr)
    return 1


def _write_error_log(details: str, argv: list[str], args: argparse.Namespace | None) -> Path | None:
    """Append to ``<--out>/error.log`` when that folder exists (appending never loses an earlier log), else a new temp file."""
    import driftlab

    entry = (
        f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}  driftlab {driftlab.__version__}  python {sys.version.split()[0]}\n"
        f"command: driftlab {' '.join(argv)}\ncwd: {os.getcwd()}\n{details}\n"
    )
    out = getattr(args, "out", None) if args is not None else None
    candidates = []
    if out and Path(out).is_dir():
        candidates.append(Path(out) / ERROR_LOG)
    candidates.append(
        Path(tempfile.gettempdir()) / f"driftlab-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    )
    for path in candidates:
        try:
            with open(path, "a", encoding="utf-8", errors="replace") as handle:
                handle.write(entry)
            return path
        except OSError:
            continue
    return None


def _describe_os_error(error: OSError) -> str:
    reason = error.strerror or type(error).__name__
    if error.filename is None:
        return f"{reason} ({error})" if str(error) != reason else reason
    target = f" -> {error.filename2}" if error.filename2 is not None else ""
    return f"{error.filename}{target}: {reason}"


def _check_named_files(args: argparse.Namespace) -> None:
    """A config or sweep file named on the command line must be readable UTF-8 text: say which file, and why, if not."""
    for name in ("config", "sweep"):
        value = getattr(args, name, None)
        if value is not None and Path(value).is_file():
            _check_utf8_text(Path(value))


def _check_utf8_text(path: Path) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes read before the current chunk
    try:
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(1 << 20)  # a chunk at a time: a huge file is refused elsewhere, not read whole here
                pending = len(decoder.getstate()[0])
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    raise ConfigError(
                        f"{path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset {offset - pending + error.start}); "
                        "save it as UTF-8"
                    ) from None
                if not chunk:
                    return
                offset += len(chunk)
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}") from None
