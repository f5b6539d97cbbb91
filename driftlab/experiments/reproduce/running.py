"""Running ``driftlab reproduce``: each sweep in a child process, then its record and the doc's blocks rewritten.

``driftlab reproduce NAME ... --out DIR`` runs each sweep with ``driftlab sweep NAME --out DIR/NAME`` itself,
in a child process (a partial DIR/NAME resumes exactly), writes its record (the commit the call started from,
the command, date, machine and wall time above the report), then rewrites every block of NAME in the doc.
``dry_run`` says what would run and be written; ``list_markers`` prints each marker of the doc.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

from driftlab.experiments.reproduce.blocks import cited_path, regenerate
from driftlab.experiments.reproduce.items import (
    ITEMS_END,
    ITEMS_FILE,
    ITEMS_START,
    items_block,
    load_items,
    rewrite_items,
)
from driftlab.experiments.reproduce.markers import (
    SELECTOR_SEPARATOR,
    NotRegenerated,
    Regenerated,
    marker_sweeps,
    parse_markers,
)
from driftlab.experiments.reproduce.records import (
    SCALE_SEPARATOR,
    ReproduceError,
    format_record,
    parse_record,
    record_key,
    split_key,
    without_figures,
)
from driftlab.owned_folder import claim, first_line, refusal

_STATED_TIME = re.compile(
    r"(?:[Aa]bout\s)?\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)?\s(?:minutes|hours)(?:\sper\sdecay)?(?:\son\s\d+(?:\sbusy)?\scores)?"
)


def git_commit(tree: Path) -> str:
    """``git rev-parse HEAD`` of ``tree``, with ``+dirty`` if tracked files changed; a sentence if it is no git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return f"unknown ({tree} is not a git checkout)"
    return head + ("+dirty" if status.strip() else "")


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "processor unknown"


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


def machine_line(load_before: str, load_after: str) -> str:
    import torch

    return f"{os.cpu_count()} cores, {_processor()}, torch {torch.__version__}; load average {load_before} before, {load_after} after"


def source_checkout() -> Path:
    """The folder holding the driftlab package being run (a git checkout when installed with ``pip install -e``)."""
    return Path(__file__).resolve().parents[3]  # driftlab/experiments/reproduce/running.py


def default_docs() -> Path:
    """docs/reproduction.md under the current folder, else the one of the driftlab checkout being run."""
    here = Path("docs/reproduction.md")
    return here if here.is_file() else source_checkout() / "docs" / "reproduction.md"


def stated_time(description: str) -> str:
    """The run time a sweep's description states ("about 12 minutes on 2 cores"), or ``"no time stated"``."""
    found = [" ".join(match.group(0).split()) for match in _STATED_TIME.finditer(description)]
    return "; ".join(dict.fromkeys(found)) or "no time stated"


def _check_names(names: Sequence[str], shipped: Sequence[str], where: str) -> None:
    unknown = [name for name in names if split_key(name)[0] not in shipped]
    if unknown:
        raise ReproduceError(
            f"{where}: {', '.join(map(repr, unknown))} not a shipped sweep; shipped sweeps: {', '.join(shipped)} "
            f"(NAME{SCALE_SEPARATOR}SCALE names a sweep at a named scale)"
        )


def keyed(names: Sequence[str], scale: str | None, where: str) -> list[str]:
    """The record keys of ``names`` (``record_key``): ``--scale S`` keys a bare NAME as NAME@S; a key that names a
    scale of its own keeps it, and one that contradicts ``--scale`` is an error."""
    keys = []
    for name in names:
        sweep, own = split_key(name)
        if own is not None and scale is not None and own != scale:
            raise ReproduceError(f"{where}: {name!r} names scale {own!r}, and --scale says {scale!r}; give one of them")
        keys.append(record_key(sweep, own if own is not None else scale))
    return keys


def sweep_command(sweep: str, scale: str | None, overrides: Sequence[str]) -> str:
    return " ".join(["driftlab", "sweep", sweep, *(["--scale", scale] if scale else []), *overrides])


def run_shipped_sweep(sweep: str, out: Path, scale: str | None, overrides: Sequence[str], force: bool = False) -> None:
    """``driftlab sweep SWEEP --out OUT [--scale S] [--force] [overrides]``, the command itself in a child process; errors
    unless it finished and wrote its report. (A child, not a call: the experiments layer does not import the command line.)"""
    argv = [
        "sweep",
        sweep,
        "--out",
        str(out),
        *(["--scale", scale] if scale else []),
        *(["--force"] if force else []),
        *overrides,
    ]
    report = out / "report" / "report.md"
    started = time.time()
    code = subprocess.run([sys.executable, "-m", "driftlab.cli", *argv], check=False).returncode
    if code != 0:
        raise ReproduceError(
            f"`driftlab {' '.join(argv)}` exited with code {code} (1: a run failed, 4: runs held by other processes, "
            "130: interrupted); its messages are above. Fix that and run `driftlab reproduce` again: finished runs are kept"
        )
    if not report.is_file() or report.stat().st_mtime < started:
        raise ReproduceError(f"`driftlab {' '.join(argv)}` wrote no report ({report}); did every run fail?")


def reproduce(
    names: Sequence[str],
    out: Path,
    docs: Path,
    record_dir: Path,
    scale: str | None = None,
    overrides: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
    run: Callable[..., None] = run_shipped_sweep,
    force: bool = False,
) -> list[Path]:
    """Run each sweep (default: every one a marker names), write its record, rewrite its blocks; returns the records written.

    The doc is rewritten after each sweep, so a failure later keeps what earlier sweeps regenerated.
    A hand-typed table a conversion replaces is kept in ``OUT/replaced-tables.md``.

    Before anything runs, ``out`` must hold no ``NAME`` or ``replaced-tables.md`` but driftlab's, and the record
    folder no ``NAME.md`` but a record (``driftlab.owned_folder``); ``force`` replaces them, and is passed on to
    each ``driftlab sweep``.
    """
    from driftlab.experiments.sweep.shipped import sweep_names

    log = log or (lambda line: print(line, flush=True))  # flushed: the sweeps' child processes write to the same stream
    shipped = sweep_names()
    doc = docs.read_text(encoding="utf-8")
    markers = parse_markers(doc, str(docs))  # a broken marker stops us before any run
    names = list(names) or marker_sweeps(markers)
    _check_names(names, shipped, "driftlab reproduce")
    names = keyed(names, scale, "driftlab reproduce")
    if not names:
        raise ReproduceError(f"{docs} has no marker naming a sweep, and no NAME was given; name the sweeps to run")
    _check_records(record_dir, names, force)
    claim(out, [*names, REPLACED_TABLES], "driftlab reproduce", force=force, recognise=_earlier_reproduction)
    written = []
    # Once, before anything is written: the records and the doc this command rewrites would make the tree "dirty"
    # for every sweep after the first, though the code that runs them is the same.
    commit = git_commit(source_checkout())
    for name in names:  # record keys: NAME, or NAME@SCALE, whose runs, record and blocks are the scale's own
        sweep, sweep_scale = split_key(name)
        load_before, started, clock = _load(), datetime.now(timezone.utc), time.monotonic()
        log(f"reproduce: {sweep_command(sweep, sweep_scale, overrides)} --out {out / name}")
        run(sweep, out / name, sweep_scale, overrides, **({"force": True} if force else {}))
        minutes = (time.monotonic() - clock) / 60
        header = {
            "commit": commit,
            "command": sweep_command(sweep, sweep_scale, overrides),
            "date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_line(load_before, _load()),
            "wall": f"{minutes:.1f} minutes",
        }
        report = without_figures((out / name / "report" / "report.md").read_text(encoding="utf-8"))
        record_dir.mkdir(parents=True, exist_ok=True)
        record_file = record_dir / f"{name}.md"
        record_file.write_text(
            format_record(sweep_command(sweep, sweep_scale, ()).removeprefix("driftlab sweep "), header, report),
            encoding="utf-8",
        )
        written.append(record_file)
        record = parse_record(record_file.read_text(encoding="utf-8"), str(record_file))
        rewrite = regenerate(docs.read_text(encoding="utf-8"), name, record, cited_path(record_file, docs), str(docs))
        docs.write_text(items_rewritten(rewrite.text, record_dir, str(docs)), encoding="utf-8")
        log(f"reproduce: wrote {record_file}; {len(rewrite.regenerated)} block(s) of {name} in {docs} regenerated")
        if rewrite.converted:
            replaced = out / REPLACED_TABLES
            with replaced.open("a", encoding="utf-8") as file:
                for line, table in rewrite.converted:
                    file.write(f"## {docs}:{line}, replaced by the tables of {name}\n\n{table}\n\n")
            log(
                f"reproduce: {len(rewrite.converted)} hand-typed table(s) of {name} replaced by its report's (lines "
                f"{', '.join(str(line) for line, _ in rewrite.converted)}); they are kept in {replaced}: check the prose around them"
            )
        for line in rewrite.derived:
            log(
                f"reproduce: {docs}:{line}: a table derived from {name} by hand is not regenerated; check it against {record_file}"
            )
    return written


def items_rewritten(doc: str, record_dir: Path, origin: str) -> str:
    """``doc`` with its headline items block generated afresh from ``record_dir``'s items.toml and records (``items``);
    unchanged without a block or an items file."""
    path = record_dir / ITEMS_FILE
    if items_block(doc, origin) is None or not path.is_file():
        return doc
    return rewrite_items(doc, load_items(path), record_dir, origin)


def rewrite_items_block(docs: Path, record_dir: Path) -> bool:
    """``driftlab reproduce --items``: rewrite the doc's headline items block; whether the doc changed."""
    before = docs.read_text(encoding="utf-8")
    if items_block(before, str(docs)) is None:
        raise ReproduceError(f"{docs} has no headline items block ({ITEMS_START} ... {ITEMS_END}); add the two lines")
    if not (record_dir / ITEMS_FILE).is_file():
        raise ReproduceError(f"{record_dir / ITEMS_FILE} does not exist: the items block is generated from it")
    after = items_rewritten(before, record_dir, str(docs))
    if after != before:
        docs.write_text(after, encoding="utf-8")
    return after != before


REPLACED_TABLES = "replaced-tables.md"
_REPLACED_HEADING = re.compile(r"^## .+, replaced by the tables of ")


def _earlier_reproduction(entry: Path) -> bool:
    """Whether ``entry`` in ``--out`` was written by an earlier ``driftlab reproduce``: a sweep directory, or the kept tables."""
    if entry.name == REPLACED_TABLES:
        return bool(_REPLACED_HEADING.match(first_line(entry)))
    return entry.is_dir() and (entry / "sweep.json").is_file()


def _check_records(record_dir: Path, names: Sequence[str], force: bool) -> None:
    """Refuse, before any run, a ``NAME.md`` in the record folder that is not a record (a record marks itself)."""
    refused = []
    for name in names:
        path = record_dir / f"{name}.md"
        if force or not os.path.lexists(path):
            continue
        try:
            parse_record(path.read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError, ReproduceError):
            refused.append(path.name)
    if refused:
        raise ReproduceError(refusal(record_dir, refused, "choose another --record folder"))


def dry_run(
    names: Sequence[str], out: Path, docs: Path, record_dir: Path, scale: str | None, overrides: Sequence[str]
) -> list[str]:
    """What ``reproduce`` would run and write, one line per sweep; runs and writes nothing."""
    from driftlab.experiments.sweep import load_sweep, plan, run_status
    from driftlab.experiments.sweep.shipped import sweep_description, sweep_names

    shipped = sweep_names()
    markers = parse_markers(docs.read_text(encoding="utf-8"), str(docs))
    names = list(names) or marker_sweeps(markers)
    _check_names(names, shipped, "driftlab reproduce")
    lines = []
    for name in keyed(names, scale, "driftlab reproduce"):
        sweep, sweep_scale = split_key(name)
        runs = plan(load_sweep(sweep), sweep_scale, overrides)
        statuses = [run_status(out / name / r.dir, r.config.rounds) for r in runs]
        done = statuses.count("complete")
        blocks = sum(1 for m in markers if isinstance(m, Regenerated) and m.sweep == name)
        hand = sum(1 for m in markers if isinstance(m, NotRegenerated) and m.sweep == name and not m.derived)
        lines.append(
            f"{sweep_command(sweep, sweep_scale, overrides)} --out {out / name}: {len(runs)} runs, {done} complete, "
            f"{len(runs) - done} to run; stated: {stated_time(sweep_description(sweep))}; would write {record_dir / (name + '.md')}, "
            f"regenerate {blocks} block(s) and convert {hand} hand-typed table(s)"
        )
    return lines


def list_markers(docs: Path, record_dir: Path) -> list[str]:
    """Each marker of the doc: its line, sweep and status (for regenerated blocks, the record's commit and date)."""
    lines = []
    for marker in parse_markers(docs.read_text(encoding="utf-8"), str(docs)):
        if isinstance(marker, Regenerated):
            record_file = record_dir / f"{marker.sweep}.md"
            try:
                header = parse_record(record_file.read_text(encoding="utf-8"), str(record_file)).header
                dirty = " with uncommitted changes" if header["commit"].endswith("+dirty") else ""
                source = f"commit {header['commit'][:7]}{dirty}, {header['date']}"
            except (OSError, ReproduceError) as error:
                source = f"record unreadable: {error}"
            tables = SELECTOR_SEPARATOR.join(marker.selectors) if marker.selectors else "all but Runs"
            lines.append(f"{marker.start + 1:5d}  regenerated      {marker.sweep}  (tables: {tables}; {source})")
        elif isinstance(marker, NotRegenerated):
            kind = "derived" if marker.derived else "not regenerated"
            lines.append(f"{marker.line + 1:5d}  {kind:<16s} {marker.sweep or '-'}  ({marker.reason})")
        else:
            lines.append(f"{marker.line + 1:5d}  paper numbers    -  ({marker.source})")
    return lines


__all__ = [
    "dry_run",
    "git_commit",
    "list_markers",
    "reproduce",
    "rewrite_items_block",
    "stated_time",
]
