"""Markers: the lines of docs/reproduction.md that say where each of its tables comes from.

Their forms (a marker is a whole line)::

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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from driftlab.experiments.reproduce.records import ReproduceError

END_MARKER = "<!-- end regenerated -->"
SELECTOR_SEPARATOR = " | "

_REGENERATED = re.compile(r"<!-- regenerated from (?P<cited>[^\s;]+\.md)(?:; tables=(?P<tables>.+?))? -->")
_NOT_REGENERATED = re.compile(r"<!-- not regenerated: (?P<body>.+?) -->")
_PAPER = re.compile(r"<!-- paper numbers: (?P<source>.+?) -->")
# a line that looks like one of our markers; one that matches none of the exact forms above is an error
_MARKER_LIKE = re.compile(r"<!--\s*(regenerated|end regenerated|not regenerated|paper numbers)\b", re.IGNORECASE)


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


__all__ = [
    "END_MARKER",
    "NotRegenerated",
    "PaperNumbers",
    "Regenerated",
    "markdown_tables",
    "marker_sweeps",
    "parse_markers",
    "table_under",
]
