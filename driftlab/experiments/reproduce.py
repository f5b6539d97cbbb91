"""``driftlab reproduce``: regenerate the tables of docs/reproduction.md from the shipped sweeps (issue 29).

Every table of docs/reproduction.md that a sweep's report prints is copied from a *record*,
``docs/reproduction/NAME.md``: a header saying which tree printed it and how, then the report
``driftlab sweep NAME`` wrote (``report/report.md``, its figures left out), verbatim::

    # Recorded output of `driftlab sweep NAME`

    - commit: <40 hex digits>[+dirty]     git rev-parse HEAD of the tree that ran; +dirty: tracked files changed
    - command: driftlab sweep NAME [--scale S] [key=value ...]
    - date: 2026-11-27 11:53 UTC           when the sweep started
    - machine: cores, processor, torch; load average before and after
    - wall: 7.7 minutes

    <!-- the report, as driftlab sweep wrote it -->
    # driftlab report
    ...

In the doc, markers say where each table comes from (a marker is a whole line)::

    <!-- regenerated from docs/reproduction/NAME.md; tables=SELECTOR | SELECTOR -->
    ... the record's tables, as ``render_block`` writes them ...
    <!-- end regenerated -->

    <!-- not regenerated: sweep=NAME; REASON -->           right above a table of NAME's report typed by hand:
                                                            ``driftlab reproduce NAME`` replaces it with a regenerated block
    <!-- not regenerated: sweep=NAME; derived; REASON -->  numbers worked out from NAME's runs or tables: left as they are
    <!-- not regenerated: REASON -->                       a table no sweep's report prints
    <!-- paper numbers: SOURCE -->                          numbers quoted from a paper

A SELECTOR names tables of the report by the headings above them, matched from the last, each a shell-style
pattern: ``Accuracy`` selects every setting's accuracy table, ``IID, 10% > Accuracy`` one of them,
``Communication*97.2%*`` the communication tables of that target, reached or not. Without ``tables=`` a block holds
every table of the report but the runs' (wall times, machines). A not-regenerated marker of a sweep may
carry ``tables=`` too: the tables its conversion will hold. The path a marker cites is relative to the
folder above the doc's (the repository root, for docs/reproduction.md).

``driftlab reproduce NAME ... --out DIR`` runs each sweep with ``driftlab sweep NAME --out DIR/NAME`` itself,
in a child process (a partial DIR/NAME resumes exactly), writes its record, then rewrites every block of
NAME in the doc. ``driftlab/experiments/reproduction_docs_test.py`` checks that every block is exactly
what ``render_block`` makes of the record it cites, and that no numeric table of the doc is unmarked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Callable, Sequence

from driftlab.errors import ConfigError

HEADER_FIELDS = ("commit", "command", "date", "machine", "wall")
REPORT_START = "<!-- the report, as driftlab sweep wrote it -->"
END_MARKER = "<!-- end regenerated -->"
RUNS_HEADING = "Runs"  # the report's table of wall times and machines: left out of a block unless selected
SELECTOR_SEPARATOR = " | "
PATH_SEPARATOR = " > "

_REGENERATED = re.compile(r"<!-- regenerated from (?P<cited>[^\s;]+\.md)(?:; tables=(?P<tables>.+?))? -->")
_NOT_REGENERATED = re.compile(r"<!-- not regenerated: (?P<body>.+?) -->")
_PAPER = re.compile(r"<!-- paper numbers: (?P<source>.+?) -->")
# a line that looks like one of our markers; one that matches none of the exact forms above is an error
_MARKER_LIKE = re.compile(r"<!--\s*(regenerated|end regenerated|not regenerated|paper numbers)\b", re.IGNORECASE)
_HEADER_LINE = re.compile(r"^- (?P<key>[a-z]+): (?P<value>.*)$")
_COMMIT = re.compile(r"^[0-9a-f]{40}(\+dirty)?$")
# A number as a table prints it: sign, digits with thousands commas, decimals, exponent, percent; "± 0.03" keeps its ±.
NUMBER = re.compile(r"(?<![\w.])(?:±\s?)?[+−-]?\d[\d,]*(?:\.\d+)?(?:e[+−-]?\d+)?%?(?!\w)")
_STATED_TIME = re.compile(
    r"(?:[Aa]bout\s)?\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)?\s(?:minutes|hours)(?:\sper\sdecay)?(?:\son\s\d+(?:\sbusy)?\scores)?"
)


class ReproduceError(ConfigError):
    """A marker, a record or a sweep outcome that stops ``driftlab reproduce``; the message says what to fix."""


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class ReportTable:
    """One markdown table of a report: the headings above it (``("IID, 10%", "Accuracy")``) and its lines."""

    path: tuple[str, ...]
    lines: tuple[str, ...]

    @property
    def title(self) -> str:
        return " — ".join(self.path)


@dataclass(frozen=True)
class Record:
    """A recorded output: its header fields and the report text below the header."""

    header: dict[str, str]
    report: str

    @property
    def tables(self) -> list[ReportTable]:
        return report_tables(self.report)


def parse_record(text: str, origin: str = "the record") -> Record:
    """Read a record; a missing header field or a missing report line is an error naming what to add."""
    lines = text.splitlines()
    if REPORT_START not in lines:
        raise ReproduceError(
            f"{origin} has no line {REPORT_START!r} before its report; write it with `driftlab reproduce`, or add that line"
        )
    cut = lines.index(REPORT_START)
    header = {}
    for line in lines[:cut]:
        match = _HEADER_LINE.match(line)
        if match:
            header[match["key"]] = match["value"].strip()
    missing = [key for key in HEADER_FIELDS if not header.get(key)]
    if missing:
        raise ReproduceError(
            f"{origin} lacks {', '.join(f'`- {key}: ...`' for key in missing)} in its header (above {REPORT_START!r}); "
            f"a record's header has {', '.join(HEADER_FIELDS)} (write `not recorded` where a value is unknown)"
        )
    return Record(header, "\n".join(lines[cut + 1 :]).strip("\n") + "\n")


def format_record(sweep: str, header: dict[str, str], report: str) -> str:
    """A record's text: the title, the header (``HEADER_FIELDS`` first, then any others), and the report."""
    missing = [key for key in HEADER_FIELDS if not header.get(key)]
    if missing:
        raise ReproduceError(f"a record of {sweep} needs {', '.join(missing)} in its header")
    keys = [*HEADER_FIELDS, *(key for key in header if key not in HEADER_FIELDS)]
    lines = [f"# Recorded output of `driftlab sweep {sweep}`", "", *(f"- {key}: {header[key]}" for key in keys), ""]
    lines += [
        "The tables of docs/reproduction.md between `<!-- regenerated from ... -->` markers that cite this file are",
        "copied from the report below (`driftlab reproduce` writes both; `reproduction_docs_test.py` checks them).",
        "Figures are left out.",
        "",
        REPORT_START,
        report.strip("\n"),
        "",
    ]
    return "\n".join(lines)


def without_figures(report: str) -> str:
    """The report without its figures: every ``### Figures`` section, and each image line with the caption below it."""
    out: list[str] = []
    lines = report.splitlines()
    in_figures = False
    after_image = False
    for line in lines:
        if line.startswith("#"):
            in_figures = line.strip() == "### Figures"
            if in_figures:
                continue
        if in_figures:
            continue
        if line.startswith("!["):
            after_image = True
            continue
        if after_image and not line.strip():
            continue
        if after_image and line.startswith("*") and line.rstrip().endswith("*"):
            after_image = False
            continue
        after_image = False
        out.append(line)
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def report_tables(report: str) -> list[ReportTable]:
    """Every markdown table of a report, each with the ``##`` and ``###`` headings above it."""
    tables: list[ReportTable] = []
    path: list[str] = []
    current: list[str] = []
    current_path: tuple[str, ...] = ()
    for line in [*report.splitlines(), ""]:
        if line.startswith("|"):
            if not current:
                current_path = tuple(path)
            current.append(line.rstrip())
            continue
        if current:
            tables.append(ReportTable(current_path, tuple(current)))
            current = []
        heading = re.match(r"^(#{2,3}) (.+?)\s*$", line)
        if heading:
            level = len(heading[1])
            path = [*path[: level - 2], heading[2]]
    return tables


def select_tables(tables: Sequence[ReportTable], selectors: Sequence[str] | None, origin: str) -> list[ReportTable]:
    """The tables the selectors name, in the report's order; None: every table but the runs'.

    A selector's ``>``-separated parts must match the last headings above a table, each a shell-style
    pattern (``Communication*97.2%*`` matches the table whether or not a method reached 97.2%). One that
    selects nothing is an error listing the tables there are.
    """
    if selectors is None:
        return [table for table in tables if not table.path or table.path[-1] != RUNS_HEADING]
    chosen: set[int] = set()
    for selector in selectors:
        parts = [part.strip() for part in selector.split(PATH_SEPARATOR.strip())]
        hits = [
            i
            for i, table in enumerate(tables)
            if len(table.path) >= len(parts)
            and all(fnmatchcase(heading, part) for heading, part in zip(table.path[-len(parts) :], parts, strict=True))
        ]
        if not hits:
            known = "; ".join(dict.fromkeys(PATH_SEPARATOR.join(table.path) for table in tables)) or "none"
            raise ReproduceError(
                f"{origin}: no table of the report is under the headings {selector!r}; its tables are under: {known}"
            )
        chosen.update(hits)
    return [tables[i] for i in sorted(chosen)]


# ---------------------------------------------------------------- markers in the doc


@dataclass(frozen=True)
class Regenerated:
    """A regenerated block: lines ``start`` (its marker) to ``end`` (``END_MARKER``), 0-based."""

    start: int
    end: int
    sweep: str
    cited: str
    selectors: tuple[str, ...] | None


@dataclass(frozen=True)
class NotRegenerated:
    """A not-regenerated marker at ``line``, above a table typed by hand."""

    line: int
    sweep: str | None
    derived: bool
    selectors: tuple[str, ...] | None
    reason: str


@dataclass(frozen=True)
class PaperNumbers:
    """A marker above a table of numbers quoted from a paper."""

    line: int
    source: str


Marker = Regenerated | NotRegenerated | PaperNumbers


def _selectors(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    parts = tuple(part.strip() for part in text.split(SELECTOR_SEPARATOR.strip()) if part.strip())
    return parts or None


def _not_regenerated(body: str, line: int, origin: str) -> NotRegenerated:
    sweep, derived, selectors = None, False, None
    rest = body
    while True:
        field, sep, after = rest.partition(";")
        field = field.strip()
        if not sep:
            break
        if field.startswith("sweep="):
            sweep = field.removeprefix("sweep=").strip()
        elif field.startswith("tables="):
            selectors = _selectors(field.removeprefix("tables="))
        elif field == "derived":
            derived = True
        else:
            break
        rest = after
    reason = rest.strip()
    if reason.startswith(("sweep=", "tables=")) or reason == "derived":
        raise ReproduceError(
            f"{origin}:{line + 1}: the marker's fields end with `;` and a reason follows: <!-- not regenerated: sweep=NAME; WHY -->"
        )
    if not reason:
        raise ReproduceError(
            f"{origin}:{line + 1}: a not-regenerated marker needs a reason after its fields: <!-- not regenerated: sweep=NAME; WHY -->"
        )
    if sweep == "":
        raise ReproduceError(f"{origin}:{line + 1}: `sweep=` names no sweep; write sweep=NAME, or leave the field out")
    if derived and sweep is None:
        raise ReproduceError(
            f"{origin}:{line + 1}: `derived` needs the sweep the numbers come from: sweep=NAME; derived; WHY"
        )
    return NotRegenerated(line, sweep, derived, selectors, reason)


def parse_markers(doc: str, origin: str = "the doc") -> list[Marker]:
    """Every marker of the doc, checked: well formed, every block ended by ``END_MARKER``, none nested."""
    markers: list[Marker] = []
    lines = doc.splitlines()
    open_block: tuple[int, str, tuple[str, ...] | None] | None = None
    fence = False
    for index, raw in enumerate(lines):
        line = raw.strip()
        if line.startswith("```"):
            fence = not fence
        if fence or not line.startswith("<!--"):  # a marker is a whole line; prose may quote one in backticks
            continue
        where = f"{origin}:{index + 1}"
        if line == END_MARKER:
            if open_block is None:
                raise ReproduceError(
                    f"{where}: {END_MARKER} without a `<!-- regenerated from ... -->` above it; delete it or add the opening marker"
                )
            start, cited, selectors = open_block
            markers.append(Regenerated(start, index, _sweep_of(cited), cited, selectors))
            open_block = None
            continue
        regenerated = _REGENERATED.fullmatch(line)
        not_regenerated = _NOT_REGENERATED.fullmatch(line)
        paper = _PAPER.fullmatch(line)
        if open_block is not None and (regenerated or not_regenerated or paper):
            raise ReproduceError(
                f"{where}: a marker inside the regenerated block opened at line {open_block[0] + 1}; "
                f"end that block with {END_MARKER} first"
            )
        if regenerated:
            open_block = (index, regenerated["cited"], _selectors(regenerated["tables"]))
        elif not_regenerated:
            markers.append(_not_regenerated(not_regenerated["body"], index, origin))
        elif paper:
            markers.append(PaperNumbers(index, paper["source"].strip()))
        elif _MARKER_LIKE.match(line):
            raise ReproduceError(
                f"{where}: malformed marker {line!r}; the forms are "
                "`<!-- regenerated from docs/reproduction/NAME.md[; tables=A | B] -->`, "
                f"`{END_MARKER}`, `<!-- not regenerated: [sweep=NAME; [derived; ]]WHY -->` "
                "and `<!-- paper numbers: SOURCE -->`, each a whole line"
            )
    if open_block is not None:
        raise ReproduceError(
            f"{origin}:{open_block[0] + 1}: the regenerated block opened here has no {END_MARKER} after it; add one below its last table"
        )
    return sorted(markers, key=lambda m: m.start if isinstance(m, Regenerated) else m.line)


def _sweep_of(cited: str) -> str:
    return Path(cited).stem


def marker_sweeps(markers: Sequence[Marker]) -> list[str]:
    """The sweeps the markers name, in the doc's order, each once."""
    names = [m.sweep for m in markers if isinstance(m, (Regenerated, NotRegenerated)) and m.sweep]
    return list(dict.fromkeys(names))


def table_under(lines: Sequence[str], line: int) -> tuple[int, int] | None:
    """The first and last line of the markdown table right under ``line`` (blank lines between allowed), or None."""
    index = line + 1
    while index < len(lines) and not lines[index].strip():
        index += 1
    if index >= len(lines) or not lines[index].lstrip().startswith("|"):
        return None
    end = index
    while end + 1 < len(lines) and lines[end + 1].lstrip().startswith("|"):
        end += 1
    return index, end


def markdown_tables(doc: str) -> list[tuple[int, int]]:
    """The first and last line (0-based) of every markdown table of the doc outside code fences."""
    tables: list[tuple[int, int]] = []
    lines = doc.splitlines()
    fence = False
    start = None
    for index, line in enumerate([*lines, ""]):
        if line.strip().startswith("```"):
            fence = not fence
        is_row = not fence and line.lstrip().startswith("|")
        if is_row and start is None:
            start = index
        elif not is_row and start is not None:
            if index - start >= 2 and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[start + 1]):
                tables.append((start, index - 1))
            start = None
    return tables


# ---------------------------------------------------------------- blocks


def cited_path(record_file: Path, docs: Path) -> str:
    """How a marker cites a record: relative to the folder above the doc's (the repository root for docs/reproduction.md)."""
    root = docs.resolve().parent.parent
    return Path(os.path.relpath(record_file.resolve(), root)).as_posix()


def provenance(record: Record, cited: str) -> str:
    """The block's first line: the commit and command that printed its tables, and the record holding them."""
    commit = record.header["commit"]
    if _COMMIT.match(commit):
        printed = f"commit {commit[:7]}" + (" with uncommitted changes" if commit.endswith("+dirty") else "")
    else:
        printed = f"a tree whose commit was {commit}"
    return f"*Printed by {printed} (`{record.header['command']}`), as recorded in `{cited}`.*"


def render_block(record: Record, cited: str, selectors: tuple[str, ...] | None, origin: str = "the block") -> str:
    """A regenerated block: its marker, the provenance line, each selected table under its headings, the end marker."""
    marker = (
        f"<!-- regenerated from {cited}"
        + (f"; tables={SELECTOR_SEPARATOR.join(selectors)}" if selectors else "")
        + " -->"
    )
    lines = [marker, "", provenance(record, cited), ""]
    for table in select_tables(record.tables, selectors, origin):
        lines += [f"*{table.title}*", "", *table.lines, ""]
    lines.append(END_MARKER)
    return "\n".join(lines)


def numbers(text: str) -> list[str]:
    """The numeric tokens of ``text``: ``97.99``, ``± 0.03`` (as ``±0.03``), ``−13.9``, ``51,720``, ``1.1e-16``, ``25.9%``."""
    return [re.sub(r"\s", "", token) for token in NUMBER.findall(text)]


def block_problems(doc_lines: Sequence[str], block: Regenerated, record: Record, cited: str, origin: str) -> list[str]:
    """Why a block is not what ``render_block`` makes of its record (empty: it is exactly that)."""
    where = f"{origin}:{block.start + 1}"
    try:
        expected = render_block(record, cited, block.selectors, where)
    except ReproduceError as error:
        return [str(error)]
    actual = "\n".join(line.rstrip() for line in doc_lines[block.start : block.end + 1])
    if actual == expected:
        return []
    record_numbers = set(numbers("\n".join(line for table in record.tables for line in table.lines)))
    foreign = [
        token for token in numbers(actual) if token not in record_numbers and token not in set(numbers(expected))
    ]
    problems = []
    if foreign:
        problems.append(
            f"{where}: numbers in the block that no table of {cited} prints: {', '.join(dict.fromkeys(foreign))}"
        )
    expected_lines = expected.splitlines()
    actual_lines = actual.splitlines()
    for offset, (want, have) in enumerate(zip(expected_lines, actual_lines, strict=False)):
        if want != have:
            problems.append(f"{origin}:{block.start + offset + 1}: the block has {have!r} where {cited} gives {want!r}")
            break
    else:
        problems.append(f"{where}: the block has {len(actual_lines)} lines where {cited} gives {len(expected_lines)}")
    problems.append(
        f"{where}: run `driftlab reproduce {block.sweep} --out DIR` or copy the tables from {cited} unchanged"
    )
    return problems


def docs_problems(doc: str, origin: str, record_dir: Path, docs: Path, shipped: Sequence[str]) -> list[str]:
    """Everything wrong with the doc's markers, blocks and tables, one line each (empty: the doc is consistent).

    Checks that every block cites an existing record of a shipped sweep whose header has a full commit and a
    command running that sweep, that the block is exactly what ``render_block`` makes of that record, that
    every sweep a marker names is shipped, and that every table holding a digit is in a block or right under
    a not-regenerated or paper-numbers marker.
    """
    markers = parse_markers(doc, origin)  # a malformed or unbalanced marker raises, with its line
    lines = doc.splitlines()
    problems: list[str] = []
    for marker in markers:
        if isinstance(marker, PaperNumbers):
            continue
        line = marker.start if isinstance(marker, Regenerated) else marker.line
        if marker.sweep and marker.sweep not in shipped:
            problems.append(
                f"{origin}:{line + 1}: {marker.sweep!r} is not a shipped sweep (shipped: {', '.join(shipped)})"
            )
            continue
        if not isinstance(marker, Regenerated):
            continue
        record_file = record_dir / f"{marker.sweep}.md"
        cited = cited_path(record_file, docs)
        if marker.cited != cited or not record_file.is_file():
            problems.append(
                f"{origin}:{line + 1}: the block cites {marker.cited}, but the record of {marker.sweep} would be {cited}, and it must exist"
            )
            continue
        try:
            record = parse_record(record_file.read_text(encoding="utf-8"), cited)
        except ReproduceError as error:
            problems.append(str(error))
            continue
        if not _COMMIT.match(record.header["commit"]):
            problems.append(
                f"{cited}: `commit: {record.header['commit']}` is not 40 hex digits (git rev-parse HEAD), with +dirty or not"
            )
        if record.header["command"].split()[:3] != ["driftlab", "sweep", marker.sweep]:
            problems.append(
                f"{cited}: `command: {record.header['command']}` does not run `driftlab sweep {marker.sweep}`"
            )
        problems += block_problems(lines, marker, record, cited, origin)
    covered = set()
    for marker in markers:
        if isinstance(marker, Regenerated):
            covered.update(range(marker.start, marker.end + 1))
        else:
            under = table_under(lines, marker.line)
            if under is None:
                problems.append(
                    f"{origin}:{marker.line + 1}: the marker has no table right under it; move it above its table or delete it"
                )
            else:
                covered.update(range(under[0], under[1] + 1))
    for first, last in markdown_tables(doc):
        if first not in covered and any(re.search(r"\d", line) for line in lines[first : last + 1]):
            problems.append(
                f"{origin}:{first + 1}: a table with numbers and no marker; put it in a regenerated block "
                "(`driftlab reproduce`), or mark it with `<!-- not regenerated: sweep=NAME; WHY -->` or `<!-- paper numbers: SOURCE -->`"
            )
    return problems


@dataclass(frozen=True)
class Rewrite:
    """The doc after regenerating one sweep's blocks, and what changed."""

    text: str
    regenerated: list[int]  # 1-based lines of the new text where a block was rewritten
    converted: list[tuple[int, str]]  # (line, the hand-typed table it replaced) for each converted marker
    derived: list[int]  # lines of derived markers of the sweep, to check by hand


def regenerate(doc: str, sweep: str, record: Record, cited: str, origin: str = "the doc") -> Rewrite:
    """Rewrite every block of ``sweep`` from ``record``, and turn its not-regenerated markers (not derived) into blocks."""
    lines = doc.splitlines()
    trailing_newline = doc.endswith("\n")
    converted: list[tuple[int, str]] = []
    derived: list[int] = []
    for marker in reversed(parse_markers(doc, origin)):
        if isinstance(marker, Regenerated) and marker.sweep == sweep:
            block = render_block(record, cited, marker.selectors, f"{origin}:{marker.start + 1}").splitlines()
            lines[marker.start : marker.end + 1] = block
        elif isinstance(marker, NotRegenerated) and marker.sweep == sweep:
            if marker.derived:
                derived.append(marker.line + 1)
                continue
            under = table_under(lines, marker.line)
            if under is None:
                raise ReproduceError(
                    f"{origin}:{marker.line + 1}: the not-regenerated marker of {sweep} has no table under it to replace"
                )
            block = render_block(record, cited, marker.selectors, f"{origin}:{marker.line + 1}").splitlines()
            converted.append((marker.line + 1, "\n".join(lines[under[0] : under[1] + 1])))
            lines[marker.line : under[1] + 1] = block
    # lines shift as blocks grow: report where each block starts in the new text
    new_text = "\n".join(lines) + ("\n" if trailing_newline else "")
    new_starts = [
        m.start + 1 for m in parse_markers(new_text, origin) if isinstance(m, Regenerated) and m.sweep == sweep
    ]
    return Rewrite(new_text, new_starts, sorted(converted), sorted(derived))


# ---------------------------------------------------------------- running


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
    return Path(__file__).resolve().parents[2]


def default_docs() -> Path:
    """docs/reproduction.md under the current folder, else the one of the driftlab checkout being run."""
    here = Path("docs/reproduction.md")
    return here if here.is_file() else source_checkout() / "docs" / "reproduction.md"


def stated_time(description: str) -> str:
    """The run time a sweep's description states ("about 12 minutes on 2 cores"), or ``"no time stated"``."""
    found = [" ".join(match.group(0).split()) for match in _STATED_TIME.finditer(description)]
    return "; ".join(dict.fromkeys(found)) or "no time stated"


def _check_names(names: Sequence[str], shipped: Sequence[str], where: str) -> None:
    unknown = [name for name in names if name not in shipped]
    if unknown:
        raise ReproduceError(
            f"{where}: {', '.join(map(repr, unknown))} not a shipped sweep; shipped sweeps: {', '.join(shipped)}"
        )


def sweep_command(sweep: str, scale: str | None, overrides: Sequence[str]) -> str:
    return " ".join(["driftlab", "sweep", sweep, *(["--scale", scale] if scale else []), *overrides])


def run_shipped_sweep(sweep: str, out: Path, scale: str | None, overrides: Sequence[str]) -> None:
    """``driftlab sweep SWEEP --out OUT [--scale S] [overrides]``, the command itself in a child process; errors unless it
    finished and wrote its report. (A child, not a call: the experiments layer does not import the command line.)"""
    argv = ["sweep", sweep, "--out", str(out), *(["--scale", scale] if scale else []), *overrides]
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
    run: Callable[[str, Path, str | None, Sequence[str]], None] = run_shipped_sweep,
) -> list[Path]:
    """Run each sweep (default: every one a marker names), write its record, rewrite its blocks; returns the records written.

    The doc is rewritten after each sweep, so a failure later keeps what earlier sweeps regenerated.
    A hand-typed table a conversion replaces is kept in ``OUT/replaced-tables.md``.
    """
    from driftlab.experiments.shipped import sweep_names

    log = log or (lambda line: print(line, flush=True))  # flushed: the sweeps' child processes write to the same stream
    shipped = sweep_names()
    doc = docs.read_text(encoding="utf-8")
    markers = parse_markers(doc, str(docs))  # a broken marker stops us before any run
    names = list(names) or marker_sweeps(markers)
    _check_names(names, shipped, "driftlab reproduce")
    if not names:
        raise ReproduceError(f"{docs} has no marker naming a sweep, and no NAME was given; name the sweeps to run")
    written = []
    # Once, before anything is written: the records and the doc this command rewrites would make the tree "dirty"
    # for every sweep after the first, though the code that runs them is the same.
    commit = git_commit(source_checkout())
    for name in names:
        load_before, started, clock = _load(), datetime.now(timezone.utc), time.monotonic()
        log(f"reproduce: {sweep_command(name, scale, overrides)} --out {out / name}")
        run(name, out / name, scale, overrides)
        minutes = (time.monotonic() - clock) / 60
        header = {
            "commit": commit,
            "command": sweep_command(name, scale, overrides),
            "date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_line(load_before, _load()),
            "wall": f"{minutes:.1f} minutes",
        }
        report = without_figures((out / name / "report" / "report.md").read_text(encoding="utf-8"))
        record_dir.mkdir(parents=True, exist_ok=True)
        record_file = record_dir / f"{name}.md"
        record_file.write_text(format_record(name, header, report), encoding="utf-8")
        written.append(record_file)
        record = parse_record(record_file.read_text(encoding="utf-8"), str(record_file))
        rewrite = regenerate(docs.read_text(encoding="utf-8"), name, record, cited_path(record_file, docs), str(docs))
        docs.write_text(rewrite.text, encoding="utf-8")
        log(f"reproduce: wrote {record_file}; {len(rewrite.regenerated)} block(s) of {name} in {docs} regenerated")
        if rewrite.converted:
            replaced = out / "replaced-tables.md"
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


def dry_run(
    names: Sequence[str], out: Path, docs: Path, record_dir: Path, scale: str | None, overrides: Sequence[str]
) -> list[str]:
    """What ``reproduce`` would run and write, one line per sweep; runs and writes nothing."""
    from driftlab.experiments.shipped import sweep_description, sweep_names
    from driftlab.experiments.sweep import load_sweep, plan, run_status

    shipped = sweep_names()
    markers = parse_markers(docs.read_text(encoding="utf-8"), str(docs))
    names = list(names) or marker_sweeps(markers)
    _check_names(names, shipped, "driftlab reproduce")
    lines = []
    for name in names:
        runs = plan(load_sweep(name), scale, overrides)
        statuses = [run_status(out / name / r.dir, r.config.rounds) for r in runs]
        done = statuses.count("complete")
        blocks = sum(1 for m in markers if isinstance(m, Regenerated) and m.sweep == name)
        hand = sum(1 for m in markers if isinstance(m, NotRegenerated) and m.sweep == name and not m.derived)
        lines.append(
            f"{sweep_command(name, scale, overrides)} --out {out / name}: {len(runs)} runs, {done} complete, {len(runs) - done} to run; "
            f"stated: {stated_time(sweep_description(name))}; would write {record_dir / (name + '.md')}, "
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


# ---------------------------------------------------------------- the command line

DESCRIPTION = """Regenerate the tables of docs/reproduction.md from the shipped sweeps. For each NAME (default: every
sweep a marker of the doc names), run `driftlab sweep NAME --out DIR/NAME` (a partial DIR/NAME resumes
exactly), write the record RECORD/NAME.md (commit, command, date, machine, wall time, then the report's
text, figures left out), and rewrite every `<!-- regenerated from .../NAME.md -->` block of the doc from it;
a `<!-- not regenerated: sweep=NAME; ... -->` marker and the hand-typed table under it become such a block
(the replaced table is kept in DIR/replaced-tables.md). driftlab/experiments/reproduction_docs_test.py checks
that every block is what its record prints."""

EPILOG = """examples:
  driftlab reproduce --list                                   each marker of the doc: line, sweep, status
  driftlab reproduce --dry-run --out runs/reproduction        what would run (runs, stated minutes) and be written
  driftlab reproduce --out runs/reproduction                  every sweep the doc names, at the default scale
  driftlab reproduce decaying-k-quadratic --out runs/repro    one sweep; run it again to resume

docs/reproduction.md's first section describes the markers."""


def add_parser(commands) -> None:
    """``driftlab reproduce``'s arguments, on the command line's subparsers."""
    import argparse

    parser = commands.add_parser(
        "reproduce",
        help="regenerate docs/reproduction.md's tables from the shipped sweeps, recording commit and command",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "sweeps",
        nargs="*",
        metavar="NAME",
        help="shipped sweeps to run (default: every sweep a marker of --docs names); key=value words are overrides for every run",
    )
    parser.add_argument(
        "--out", help="folder of the sweeps' directories, DIR/NAME (created; reused to resume); required unless --list"
    )
    parser.add_argument(
        "--docs", help="the doc to rewrite (default: docs/reproduction.md here, else the driftlab checkout's)"
    )
    parser.add_argument(
        "--record", help="folder of the records NAME.md (default: the doc's folder / the doc's name, docs/reproduction)"
    )
    parser.add_argument("--scale", help="a named scale of every sweep, e.g. paper (default: the default scale)")
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would run and be written; run and change nothing"
    )
    parser.add_argument(
        "--list", action="store_true", help="print each marker of the doc (line, sweep, status) and exit"
    )
    parser.set_defaults(overrides=[])


def command(args) -> int:
    """Run ``driftlab reproduce`` from parsed arguments."""
    names = [word for word in args.sweeps if "=" not in word]
    overrides = [*(word for word in args.sweeps if "=" in word), *args.overrides]
    docs = Path(args.docs) if args.docs else default_docs()
    if not docs.is_file():
        raise ReproduceError(f"{docs} is not a file; give the doc to regenerate with --docs FILE")
    record_dir = Path(args.record) if args.record else docs.parent / docs.stem
    if args.list:
        print("\n".join(list_markers(docs, record_dir)))
        return 0
    if args.out is None:
        raise ReproduceError("driftlab reproduce needs --out DIR, the folder of the sweeps' directories (or --list)")
    if args.dry_run:
        print("\n".join(dry_run(names, Path(args.out), docs, record_dir, args.scale, overrides)))
        return 0
    reproduce(names, Path(args.out), docs, record_dir, args.scale, overrides)
    return 0


__all__ = [
    "END_MARKER",
    "HEADER_FIELDS",
    "REPORT_START",
    "NotRegenerated",
    "PaperNumbers",
    "Record",
    "Regenerated",
    "ReportTable",
    "ReproduceError",
    "Rewrite",
    "add_parser",
    "block_problems",
    "cited_path",
    "command",
    "docs_problems",
    "dry_run",
    "format_record",
    "git_commit",
    "list_markers",
    "markdown_tables",
    "marker_sweeps",
    "numbers",
    "parse_markers",
    "parse_record",
    "regenerate",
    "render_block",
    "report_tables",
    "reproduce",
    "select_tables",
    "stated_time",
    "table_under",
    "without_figures",
]
