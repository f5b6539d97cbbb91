"""docs/reproduction.md's tables against the recorded outputs they cite (issue 29), and the marker parser and rewriter.

The first tests read the real doc: every ``<!-- regenerated from docs/reproduction/NAME.md -->`` block
must be exactly what ``render_block`` makes of that record (so every number in it is one the report
printed), the record must name a full commit and a ``driftlab sweep NAME`` command of a shipped sweep,
and no table with a number may stand outside a block without a marker saying why. The rest build small
docs and records by hand: a number changed by hand, a table without a marker, broken markers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from driftlab.experiments.reproduce.blocks import docs_problems, numbers, regenerate, render_block
from driftlab.experiments.reproduce.markers import END_MARKER, NotRegenerated, PaperNumbers, Regenerated, parse_markers
from driftlab.experiments.reproduce.records import (
    ReproduceError,
    format_record,
    parse_record,
    report_tables,
    select_tables,
    without_figures,
)
from driftlab.experiments.sweep.shipped import sweep_names

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "reproduction.md"
RECORDS = ROOT / "docs" / "reproduction"


# ---------------------------------------------------------------- the real doc


def test_every_table_of_the_doc_is_regenerated_or_says_why_not():
    problems = docs_problems(DOCS.read_text(encoding="utf-8"), "docs/reproduction.md", RECORDS, DOCS, sweep_names())
    assert problems == [], "\n".join(problems)


def test_every_record_is_cited_and_names_the_commit_and_command_that_printed_it():
    markers = parse_markers(DOCS.read_text(encoding="utf-8"))
    cited = {m.sweep for m in markers if isinstance(m, Regenerated)}
    records = {path.stem for path in RECORDS.glob("*.md")}
    assert records == cited, (
        f"records no block cites: {sorted(records - cited)}; blocks without a record: {sorted(cited - records)}"
    )
    for name in records:
        record = parse_record((RECORDS / f"{name}.md").read_text(encoding="utf-8"), name)
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", record.header["commit"]), name
        assert record.header["command"].split()[:3] == ["driftlab", "sweep", name]
        assert record.tables, f"{name}: the record holds no table"
        assert ".png" not in record.report, f"{name}: figures are left out of a record"


def test_the_doc_marks_the_sweeps_it_cannot_regenerate_yet():
    markers = parse_markers(DOCS.read_text(encoding="utf-8"))
    named = {m.sweep for m in markers if isinstance(m, (Regenerated, NotRegenerated)) and m.sweep}
    # every shipped sweep the doc reports on is named by a marker, so `driftlab reproduce` runs it
    for name in (
        "feddyn-table2-headline",
        "feddyn-table2-full",
        "feddyn-table2-partial",
        "fedprox-figure1",
        "decaying-k-quadratic",
        "feddyn-cifar10-partial",
        "adabest-table2-mnist",
        "efl-table2",
        "dp-fedavg-mnist",
        "fedbuff-femnist",
    ):
        assert name in named
    assert any(isinstance(m, PaperNumbers) for m in markers)


# ---------------------------------------------------------------- hand-made docs and records

SWEEP = "decaying-k-quadratic"
REPORT = """# driftlab report

3 runs in 1 setting, read from `runs/x`.

## decaying-k-quadratic

### Loss and distance

Mean ± sample standard deviation over seeds.

| method | seeds | final distance to the minimizer |
| --- | --- | --- |
| constant K | 1 | 0.0378 |
| decaying K | 1 | 1.11e-16 |

### Local SGD steps

| method | total local steps | fraction of constant K |
| --- | --- | --- |
| constant K | 200000 | 100.0% |
| decaying K | 51720 | 25.9% |

### Runs

| method | seeds | wall time (mean) |
| --- | --- | --- |
| constant K | 0 | 54.5 s |
| decaying K | 0 | 14.8 s |

### Figures

![decaying-k-quadratic: train loss vs rounds](decaying-k-quadratic-loss.png)

*Train loss vs rounds.*
"""
HEADER = {
    "commit": "a" * 40,
    "command": f"driftlab sweep {SWEEP}",
    "date": "2026-11-27",
    "machine": "2 cores",
    "wall": "1.3 minutes",
}


def _setup(tmp_path: Path, body: str, header: dict[str, str] | None = None) -> tuple[Path, Path]:
    """A doc at tmp/docs/reproduction.md with ``body``, and its record folder tmp/docs/reproduction holding SWEEP's record."""
    docs = tmp_path / "docs" / "reproduction.md"
    records = tmp_path / "docs" / "reproduction"
    records.mkdir(parents=True)
    (records / f"{SWEEP}.md").write_text(
        format_record(SWEEP, header or HEADER, without_figures(REPORT)), encoding="utf-8"
    )
    docs.write_text(body, encoding="utf-8")
    return docs, records


def _problems(docs: Path, records: Path) -> list[str]:
    return docs_problems(docs.read_text(encoding="utf-8"), "doc", records, docs, sweep_names())


def _block(records: Path, selectors: tuple[str, ...] | None = ("Local SGD steps",)) -> str:
    record = parse_record((records / f"{SWEEP}.md").read_text(encoding="utf-8"))
    return render_block(record, f"docs/reproduction/{SWEEP}.md", selectors)


def test_a_block_copied_from_its_record_passes_and_says_which_commit_printed_it(tmp_path):
    docs, records = _setup(tmp_path, "")
    block = _block(records)
    docs.write_text(f"# Doc\n\nSome prose.\n\n{block}\n\nMore prose with 3 numbers.\n", encoding="utf-8")
    assert _problems(docs, records) == []
    assert (
        f"*Printed by commit aaaaaaa (`driftlab sweep {SWEEP}`), as recorded in `docs/reproduction/{SWEEP}.md`.*"
        in block
    )
    assert "| decaying K | 51720 | 25.9% |" in block and "0.0378" not in block  # only the selected table


def test_a_number_changed_by_hand_fails_and_is_named(tmp_path):
    docs, records = _setup(tmp_path, "")
    docs.write_text(_block(records).replace("| 25.9% |", "| 26.0% |") + "\n", encoding="utf-8")
    problems = _problems(docs, records)
    assert any(
        "26.0%" in p and "no table of docs/reproduction/decaying-k-quadratic.md prints" in p for p in problems
    ), problems
    assert any("| decaying K | 51720 | 26.0% |" in p for p in problems)


def test_a_row_left_out_by_hand_fails(tmp_path):
    docs, records = _setup(tmp_path, "")
    docs.write_text(_block(records).replace("| constant K | 200000 | 100.0% |\n", "") + "\n", encoding="utf-8")
    assert _problems(docs, records)


def test_a_table_with_numbers_outside_the_markers_fails(tmp_path):
    body = "# Doc\n\n| method | accuracy |\n|---|---|\n| FedAvg | 97.2% |\n"
    docs, records = _setup(tmp_path, body)
    problems = _problems(docs, records)
    assert len(problems) == 1 and problems[0].startswith("doc:3: a table with numbers and no marker"), problems


def test_tables_under_a_marker_or_without_numbers_pass(tmp_path):
    body = (
        "<!-- not regenerated: sweep=fedprox-figure1; printed before this command existed -->\n"
        "| data | loss |\n|---|---|\n| IID | 0.123 |\n\n"
        "<!-- paper numbers: FedDyn Table 2 -->\n\n| FedDyn | 9 |\n|---|---|\n| SCAFFOLD | 18 |\n\n"
        "| method | note |\n|---|---|\n| FedAvg | no numbers here |\n"
    )
    docs, records = _setup(tmp_path, body)
    assert _problems(docs, records) == []


def test_a_marker_must_sit_right_above_its_table(tmp_path):
    body = "<!-- not regenerated: single runs -->\nA line of prose.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    docs, records = _setup(tmp_path, body)
    problems = _problems(docs, records)
    assert any("no table right under it" in p for p in problems) and any(
        "a table with numbers and no marker" in p for p in problems
    )


def test_a_record_must_name_a_full_commit_and_its_sweep(tmp_path):
    docs, records = _setup(tmp_path, "", {**HEADER, "commit": "6c647c1", "command": "driftlab sweep fedprox-figure1"})
    docs.write_text(_block(records) + "\n", encoding="utf-8")
    problems = _problems(docs, records)
    assert any("is not 40 hex digits" in p for p in problems)
    assert any(f"does not run `driftlab sweep {SWEEP}`" in p for p in problems)


def test_a_block_of_an_unknown_sweep_or_a_missing_record_fails(tmp_path):
    docs, records = _setup(tmp_path, "")
    block = _block(records)
    docs.write_text(block.replace(f"{SWEEP}.md;", "fedprox-figure1.md;", 1) + "\n", encoding="utf-8")
    assert any(
        "the record of fedprox-figure1 would be docs/reproduction/fedprox-figure1.md" in p
        for p in _problems(docs, records)
    )
    docs.write_text(block.replace(f"{SWEEP}.md;", "no-such-sweep.md;", 1) + "\n", encoding="utf-8")
    assert any("'no-such-sweep' is not a shipped sweep" in p for p in _problems(docs, records))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            f"<!-- regenerated from docs/reproduction/{SWEEP}.md -->\n| a |\n",
            "has no <!-- end regenerated --> after it",
        ),
        (f"| a |\n{END_MARKER}\n", "without a `<!-- regenerated from ... -->` above it"),
        ("<!-- not regenrated: typo -->\n", None),  # not one of our markers: an ordinary comment
        ("<!-- not regenerated:typo -->\n", "malformed marker"),
        ("<!-- regenerated from somewhere -->\n", "malformed marker"),
        ("<!-- not regenerated: sweep=x; -->\n", "needs a reason"),
        ("<!-- not regenerated: derived; why -->\n", "`derived` needs the sweep"),
        (
            f"<!-- regenerated from docs/reproduction/{SWEEP}.md -->\n<!-- paper numbers: x -->\n{END_MARKER}\n",
            "a marker inside the regenerated block",
        ),
    ],
)
def test_markers_are_well_formed_and_balanced(body, message):
    if message is None:
        assert parse_markers(body) == []
        return
    with pytest.raises(ReproduceError, match=re.escape(message)):
        parse_markers(body, "doc")


def test_markers_in_code_fences_and_quoted_in_prose_are_not_markers():
    body = f"```\n<!-- regenerated from docs/reproduction/{SWEEP}.md -->\n```\n\nThe markers are `{END_MARKER}` and others.\n"
    assert parse_markers(body) == []


def test_parse_markers_reads_every_field():
    body = (
        f"<!-- regenerated from docs/reproduction/{SWEEP}.md; tables=Accuracy | IID > Local SGD steps -->\n| 1 |\n{END_MARKER}\n\n"
        "<!-- not regenerated: sweep=feddyn-table2-full; tables=Communication*; printed before; gone -->\n| 2 |\n\n"
        "<!-- not regenerated: sweep=dp-fedavg-mnist; derived; from metrics.jsonl -->\n| 3 |\n\n"
        "<!-- paper numbers: EFL Table 2 -->\n| 4 |\n"
    )
    block, hand, derived, paper = parse_markers(body)
    assert block == Regenerated(0, 2, SWEEP, f"docs/reproduction/{SWEEP}.md", ("Accuracy", "IID > Local SGD steps"))
    assert hand == NotRegenerated(4, "feddyn-table2-full", False, ("Communication*",), "printed before; gone")
    assert derived == NotRegenerated(7, "dp-fedavg-mnist", True, None, "from metrics.jsonl")
    assert paper == PaperNumbers(10, "EFL Table 2")


def test_a_record_without_a_header_field_is_refused_with_the_field_named():
    text = format_record(SWEEP, HEADER, REPORT).replace("- wall: 1.3 minutes\n", "")
    with pytest.raises(ReproduceError, match=r"lacks `- wall: \.\.\.` in its header"):
        parse_record(text, "rec.md")
    with pytest.raises(ReproduceError, match="before its report"):
        parse_record("- commit: x\n", "rec.md")


def test_without_figures_keeps_every_table_and_drops_the_images():
    text = without_figures(REPORT)
    assert "png" not in text and "Train loss vs rounds" not in text and "### Figures" not in text
    assert [t.path for t in report_tables(text)] == [
        (SWEEP, "Loss and distance"),
        (SWEEP, "Local SGD steps"),
        (SWEEP, "Runs"),
    ]
    assert [t.lines for t in report_tables(text)] == [t.lines for t in report_tables(REPORT)]


def test_selectors_match_headings_from_the_last_as_patterns():
    tables = report_tables(REPORT)
    assert [t.path[-1] for t in select_tables(tables, None, "x")] == [
        "Loss and distance",
        "Local SGD steps",
    ]  # all but Runs
    assert [t.path[-1] for t in select_tables(tables, ("Local*", f"{SWEEP} > Runs"), "x")] == [
        "Local SGD steps",
        "Runs",
    ]
    with pytest.raises(
        ReproduceError, match="no table of the report is under the headings 'Accuracy'.*Loss and distance"
    ):
        select_tables(tables, ("Accuracy",), "x")


def test_numbers_are_read_with_signs_decimals_percentages_and_spreads():
    assert numbers("| 97.99 ± 0.03% | −13.9 | +4.8 | 51,720 | 1.1e-16 | 120+ | <1.1× | 6c647c1 |") == [
        "97.99",
        "±0.03%",
        "−13.9",
        "+4.8",
        "51,720",
        "1.1e-16",
        "120",
        "1.1",
    ]


def test_regenerate_rewrites_blocks_converts_hand_tables_and_leaves_the_rest(tmp_path):
    docs, records = _setup(tmp_path, "")
    record = parse_record((records / f"{SWEEP}.md").read_text(encoding="utf-8"))
    cited = f"docs/reproduction/{SWEEP}.md"
    stale = _block(records).replace("51720", "51000")
    body = (
        "# Doc\n\n"
        f"{stale}\n\n"
        f"<!-- not regenerated: sweep={SWEEP}; tables=Loss and distance; typed by hand -->\n"
        "| method | distance |\n|---|---|\n| constant K | 0.04 |\n\n"
        f"<!-- not regenerated: sweep={SWEEP}; derived; worked out by hand -->\n| ratio | 3.9 |\n|---|---|\n\n"
        "<!-- paper numbers: the paper -->\n| 84% |\n|---|\n\nThe end.\n"
    )
    rewrite = regenerate(body, SWEEP, record, cited, "doc")
    expected = (
        "# Doc\n\n"
        f"{render_block(record, cited, ('Local SGD steps',))}\n\n"
        f"{render_block(record, cited, ('Loss and distance',))}\n\n"
        f"<!-- not regenerated: sweep={SWEEP}; derived; worked out by hand -->\n| ratio | 3.9 |\n|---|---|\n\n"
        "<!-- paper numbers: the paper -->\n| 84% |\n|---|\n\nThe end.\n"
    )
    assert rewrite.text == expected
    assert rewrite.converted == [
        (len(stale.splitlines()) + 4, "| method | distance |\n|---|---|\n| constant K | 0.04 |")
    ]
    assert len(rewrite.regenerated) == 2 and len(rewrite.derived) == 1
    docs.write_text(rewrite.text, encoding="utf-8")
    assert _problems(docs, records) == []
    assert regenerate(rewrite.text, SWEEP, record, cited).text == rewrite.text  # a second pass changes nothing
    assert regenerate(body, "fedprox-figure1", record, cited).text == body  # another sweep's markers are left alone
