"""The headline items: what the five papers claim in their main tables and figures, and how far the page shows each.

``docs/reproduction/items.toml`` lists every headline item (a table, a row of one, or a figure) of the papers,
each as::

    [[item]]
    paper = "FedDyn"                      # the paper, as the page names it
    what = "Table 2, MNIST, 10%: 98.2%"   # the table, row or figure
    sweeps = ["feddyn-table2-partial@paper"]   # record keys (NAME or NAME@SCALE, ``records.record_key``)
    status = "missed"                     # one of STATUSES
    section = "FedDyn (Acar et al. 2021), Table 2: MNIST, 100 clients"   # the page's heading with the evidence
    note = "..."                          # one line: why this status

The status table at the top of docs/reproduction.md is *generated* from that file and the records
(``render_items``, between ``ITEMS_START`` and ``ITEMS_END``): each item's sweeps, which of them have a record
(its commit and date) and how many seeds the record ran. ``driftlab reproduce`` rewrites it after every sweep, and
``item_problems`` refuses a status the records do not support: a verdict ("reproduced", "qualitative",
"not comparable", "missed") or "run" needs a record of one of its sweeps, "shipped" a shipped sweep and no record
yet, "no sweep" no sweep; a verdict names the page's section that holds its evidence. The verdict itself is a
reading of the tables, so it is written by hand; what it rests on is not.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from driftlab.experiments.reproduce.records import ReproduceError, parse_record, split_key

ITEMS_FILE = "items.toml"  # in the record folder, docs/reproduction/
ITEMS_START = "<!-- headline items: generated from docs/reproduction/items.toml and the records -->"
ITEMS_END = "<!-- end headline items -->"
# in the order the page counts them, from the least shown to the most
STATUSES = ("no sweep", "shipped", "run", "missed", "not comparable", "qualitative", "reproduced")
VERDICTS = ("missed", "not comparable", "qualitative", "reproduced")
_FIELDS = {"paper", "what", "sweeps", "status", "section", "note"}


@dataclass(frozen=True)
class Item:
    """One headline item of a paper and what the page shows of it."""

    paper: str
    what: str
    sweeps: tuple[str, ...]
    status: str
    section: str | None
    note: str


def load_items(path: Path) -> list[Item]:
    """The items of ``path`` (items.toml); a ReproduceError naming the item and the field for a malformed one."""
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ReproduceError(f"{path}: {error}") from None
    entries = table.get("item")
    if not isinstance(entries, list) or not entries:
        raise ReproduceError(f"{path}: no [[item]] tables; each headline item is one [[item]]")
    items = []
    for number, entry in enumerate(entries, 1):
        where = f"{path}, item {number}"
        unknown = set(entry) - _FIELDS
        missing = {"paper", "what", "status", "note"} - set(entry)
        if unknown or missing:
            raise ReproduceError(
                f"{where}: {'unknown field(s) ' + ', '.join(sorted(unknown)) if unknown else ''}"
                f"{'; ' if unknown and missing else ''}{'missing ' + ', '.join(sorted(missing)) if missing else ''}; "
                f"the fields are {', '.join(sorted(_FIELDS))}"
            )
        if entry["status"] not in STATUSES:
            raise ReproduceError(f"{where}: status {entry['status']!r} is none of {', '.join(STATUSES)}")
        sweeps = entry.get("sweeps", [])
        if not isinstance(sweeps, list) or not all(isinstance(s, str) and s for s in sweeps):
            raise ReproduceError(f"{where}: sweeps is a list of sweep names (NAME or NAME@SCALE)")
        items.append(
            Item(entry["paper"], entry["what"], tuple(sweeps), entry["status"], entry.get("section"), entry["note"])
        )
    return items


def recorded(record_dir: Path, key: str) -> tuple[str, str, int | None] | None:
    """``(commit, date, seeds)`` of the record of ``key``, or None without one; seeds is the most any of its
    tables' ``seeds`` column holds (None: the report prints no such column)."""
    path = record_dir / f"{key}.md"
    if not path.is_file():
        return None
    record = parse_record(path.read_text(encoding="utf-8"), str(path))
    counts = []
    for table in record.tables:
        rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.lines]
        if len(rows) > 2 and "seeds" in rows[0]:
            column = rows[0].index("seeds")
            counts += [int(row[column]) for row in rows[2:] if column < len(row) and row[column].isdigit()]
    return record.header["commit"], record.header["date"], (max(counts) if counts else None)


def headings(doc: str) -> set[str]:
    """The text of every markdown heading of ``doc`` outside code fences."""
    found, fence = set(), False
    for line in doc.splitlines():
        if line.strip().startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            found.add(line.lstrip("#").strip())
    return found


def item_problems(items: Sequence[Item], shipped: Sequence[str], record_dir: Path, doc: str) -> list[str]:
    """Every status the sweeps and records do not support, one line each (module docstring)."""
    problems = []
    titles = headings(doc)
    for item in items:
        where = f"{item.paper}, {item.what}"
        unknown = [key for key in item.sweeps if split_key(key)[0] not in shipped]
        if unknown:
            problems.append(f"{where}: {', '.join(unknown)} is no shipped sweep")
            continue
        with_record = [key for key in item.sweeps if recorded(record_dir, key) is not None]
        if item.status == "no sweep" and item.sweeps:
            problems.append(f"{where}: status 'no sweep' but it names {', '.join(item.sweeps)}; say 'shipped'")
        elif item.status == "shipped" and (not item.sweeps or with_record):
            problems.append(
                f"{where}: status 'shipped' needs a sweep and no record of it yet"
                + (f" ({', '.join(with_record)} has one: give its verdict, or 'run')" if with_record else "")
            )
        elif item.status not in ("no sweep", "shipped") and not with_record:
            problems.append(
                f"{where}: status {item.status!r} needs a record of one of its sweeps; none of {list(item.sweeps)} has one"
            )
        if item.status in VERDICTS and item.section not in titles:
            problems.append(
                f"{where}: a verdict names the page's section with its evidence; no heading {item.section!r}"
            )
    return problems


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_items(items: Sequence[Item], record_dir: Path) -> str:
    """The generated block: the counts per status, then one row per item with its sweeps' records."""
    counts = {status: sum(item.status == status for item in items) for status in STATUSES}
    summary = ", ".join(f"{counts[status]} {status}" for status in reversed(STATUSES) if counts[status])
    lines = [
        ITEMS_START,
        "",
        f"{len(items)} headline items: {summary}.",
        "",
        "| paper | item | sweeps | records (commit, date, seeds) | status | why |",
        "|---|---|---|---|---|---|",
    ]
    for item in items:
        records = []
        for key in item.sweeps:
            found = recorded(record_dir, key)
            if found is not None:
                commit, date, seeds = found
                day = re.match(r"\d{4}-\d{2}-\d{2}", date)
                short = commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")
                records.append(
                    f"{key}: {short}, {day.group(0) if day else date}, {seeds if seeds is not None else '?'} seed(s)"
                )
        sweeps = ", ".join(f"`{key}`" for key in item.sweeps) or "—"
        lines.append(
            f"| {_cell(item.paper)} | {_cell(item.what)} | {sweeps} | {_cell('; '.join(records)) or '—'} | "
            f"**{item.status}** | {_cell(item.note)} |"
        )
    lines += ["", ITEMS_END]
    return "\n".join(lines)


def items_block(doc: str, origin: str = "the doc") -> tuple[int, int] | None:
    """The first and last line (0-based) of the doc's generated items block, or None when it has none."""
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == ITEMS_START]
    ends = [i for i, line in enumerate(lines) if line.strip() == ITEMS_END]
    if not starts and not ends:
        return None
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ReproduceError(
            f"{origin}: the headline items block needs one {ITEMS_START} line and one {ITEMS_END} after it"
        )
    return starts[0], ends[0]


def rewrite_items(doc: str, items: Sequence[Item], record_dir: Path, origin: str = "the doc") -> str:
    """``doc`` with its items block rendered afresh (unchanged when it has none)."""
    block = items_block(doc, origin)
    if block is None:
        return doc
    lines = doc.splitlines()
    lines[block[0] : block[1] + 1] = render_items(items, record_dir).splitlines()
    return "\n".join(lines) + ("\n" if doc.endswith("\n") else "")


def items_problems(doc: str, origin: str, record_dir: Path, shipped: Sequence[str]) -> list[str]:
    """What is wrong with the doc's items block: no items file, statuses the records do not support, or a block that
    is not what the items file and the records give (``driftlab reproduce --items`` rewrites it)."""
    block = items_block(doc, origin)
    if block is None:
        return []
    path = record_dir / ITEMS_FILE
    if not path.is_file():
        return [f"{origin}:{block[0] + 1}: the headline items block is generated from {path}, which does not exist"]
    items = load_items(path)
    problems = item_problems(items, shipped, record_dir, doc)
    if doc.splitlines()[block[0] : block[1] + 1] != render_items(items, record_dir).splitlines():
        problems.append(
            f"{origin}:{block[0] + 1}: the headline items block is not what {path} and the records give; "
            "run `driftlab reproduce --items` to rewrite it"
        )
    return problems


__all__ = [
    "ITEMS_END",
    "ITEMS_FILE",
    "ITEMS_START",
    "STATUSES",
    "Item",
    "item_problems",
    "items_block",
    "items_problems",
    "load_items",
    "recorded",
    "render_items",
    "rewrite_items",
]
