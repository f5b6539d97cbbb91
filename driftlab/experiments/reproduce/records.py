"""Records: the recorded output of one ``driftlab sweep NAME``, from which docs/reproduction.md's tables are copied.

A record, ``docs/reproduction/NAME.md`` (``NAME@SCALE.md`` for a sweep run at a named scale, ``--scale SCALE``:
its own record and blocks, so a paper-scale run never replaces the default scale's), is a header saying which tree printed it and how, then the report
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

A report's tables are found by the headings above them (``report_tables``) and chosen by selectors
(``select_tables``, the syntax is in ``markers``). ``ReproduceError``, the error of the whole command, is here,
the module every other one imports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Sequence

from driftlab.errors import ConfigError

HEADER_FIELDS = ("commit", "command", "date", "machine", "wall")
REPORT_START = "<!-- the report, as driftlab sweep wrote it -->"
RUNS_HEADING = "Runs"  # the report's table of wall times and machines: left out of a block unless selected
PATH_SEPARATOR = " > "

_HEADER_LINE = re.compile(r"^- (?P<key>[a-z]+): (?P<value>.*)$")


class ReproduceError(ConfigError):
    """A marker, a record or a sweep outcome that stops ``driftlab reproduce``; the message says what to fix."""


SCALE_SEPARATOR = "@"


def record_key(sweep: str, scale: str | None) -> str:
    """The name of a sweep's record, blocks and run folder at ``scale``: ``NAME``, or ``NAME@SCALE`` at a named scale."""
    return f"{sweep}{SCALE_SEPARATOR}{scale}" if scale else sweep


def split_key(key: str) -> tuple[str, str | None]:
    """``(NAME, SCALE)`` of a record key (``record_key``); SCALE is None at the default scale."""
    sweep, separator, scale = key.partition(SCALE_SEPARATOR)
    return sweep, (scale if separator else None)


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


__all__ = [
    "HEADER_FIELDS",
    "REPORT_START",
    "SCALE_SEPARATOR",
    "Record",
    "ReportTable",
    "ReproduceError",
    "format_record",
    "parse_record",
    "record_key",
    "report_tables",
    "select_tables",
    "split_key",
    "without_figures",
]
