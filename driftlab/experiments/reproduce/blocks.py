"""Regenerated blocks: a record's tables as ``render_block`` writes them into the doc, checked and rewritten.

A block is its marker, a line naming the commit and command that printed its tables, each selected table
under its headings, and ``END_MARKER``. ``docs_problems`` checks every block of the doc against the record it
cites, and that no table with numbers is unmarked (``reproduction_docs_test.py`` runs it on the real doc);
``regenerate`` rewrites one sweep's blocks from its record and turns its not-regenerated markers into blocks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from driftlab.experiments.reproduce.items import items_block, items_problems
from driftlab.experiments.reproduce.markers import (
    END_MARKER,
    SELECTOR_SEPARATOR,
    NotRegenerated,
    PaperNumbers,
    Regenerated,
    markdown_tables,
    parse_markers,
    table_under,
)
from driftlab.experiments.reproduce.records import Record, ReproduceError, parse_record, select_tables, split_key

_COMMIT = re.compile(r"^[0-9a-f]{40}(\+dirty)?$")
# A number as a table prints it: sign, digits with thousands commas, decimals, exponent, percent; "± 0.03" keeps its ±.
NUMBER = re.compile(r"(?<![\w.])(?:±\s?)?[+−-]?\d[\d,]*(?:\.\d+)?(?:e[+−-]?\d+)?%?(?!\w)")


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
        if marker.sweep and split_key(marker.sweep)[0] not in shipped:
            problems.append(
                f"{origin}:{line + 1}: {split_key(marker.sweep)[0]!r} is not a shipped sweep (shipped: {', '.join(shipped)})"
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
        sweep, scale = split_key(marker.sweep)
        words = record.header["command"].split()
        runs = f"driftlab sweep {sweep}" + (f" --scale {scale}" if scale else "")
        if words[:3] != ["driftlab", "sweep", sweep] or _scale_of(words) != scale:
            problems.append(f"{cited}: `command: {record.header['command']}` does not run `{runs}`")
        problems += block_problems(lines, marker, record, cited, origin)
    covered = set()
    block = items_block(doc, origin)
    if block is not None:  # the generated status table: checked against items.toml and the records
        covered.update(range(block[0], block[1] + 1))
        problems += items_problems(doc, origin, record_dir, shipped)
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


def _scale_of(words: Sequence[str]) -> str | None:
    """The ``--scale`` of a recorded ``driftlab sweep`` command's words (None: the default scale)."""
    for index, word in enumerate(words):
        if word == "--scale" and index + 1 < len(words):
            return words[index + 1]
        if word.startswith("--scale="):
            return word.removeprefix("--scale=")
    return None


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


__all__ = [
    "Rewrite",
    "block_problems",
    "cited_path",
    "docs_problems",
    "numbers",
    "regenerate",
    "render_block",
]
