"""The headline items table: statuses the records must support, and the table generated from items.toml and them."""

from __future__ import annotations

from pathlib import Path

import pytest

from driftlab import cli
from driftlab.experiments.reproduce import running
from driftlab.experiments.reproduce.blocks import docs_problems
from driftlab.experiments.reproduce.items import (
    ITEMS_END,
    ITEMS_START,
    item_problems,
    load_items,
    recorded,
    render_items,
    rewrite_items,
)
from driftlab.experiments.reproduce.records import ReproduceError, format_record
from driftlab.experiments.sweep.shipped import sweep_names

SWEEP = "decaying-k-quadratic"
REPORT = """# driftlab report

## Accuracy

| method | seeds | final test accuracy |
| --- | --- | --- |
| FedAvg | 3 | 91.00% |
| FedDyn | 2 | 92.00% |
"""
ITEMS = f"""
[[item]]
paper = "Decaying K"
what = "Figure 1, the quadratic"
sweeps = ["{SWEEP}"]
status = "reproduced"
section = "The quadratic"
note = "x* reached"

[[item]]
paper = "Decaying K"
what = "Figure 1 at the paper's scale"
sweeps = ["{SWEEP}@paper"]
status = "shipped"
note = "waits for a run"

[[item]]
paper = "FedDyn"
what = "Table 6 | synthetic"
status = "no sweep"
note = "no loader yet"
"""


def _record(folder: Path, key: str, commit: str = "a" * 40) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    header = {
        "commit": commit,
        "command": f"driftlab sweep {key}",
        "date": "2026-12-02 05:00 UTC",
        "machine": "m",
        "wall": "1 minute",
    }
    (folder / f"{key}.md").write_text(format_record(key, header, REPORT), encoding="utf-8")


def _items(folder: Path, text: str = ITEMS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "items.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_record_gives_its_commit_date_and_the_most_seeds_any_table_ran(tmp_path):
    assert recorded(tmp_path, SWEEP) is None
    _record(tmp_path, SWEEP)
    assert recorded(tmp_path, SWEEP) == ("a" * 40, "2026-12-02 05:00 UTC", 3)
    # a hand-written date and a dirty tree show as the day and +dirty
    _record(tmp_path, SWEEP, commit="c" * 40 + "+dirty")
    path = tmp_path / f"{SWEEP}.md"
    path.write_text(path.read_text().replace("2026-12-02 05:00 UTC", "2026-11-27, the runs 14:07–14:42 UTC"))
    item = load_items(_items(tmp_path))[:1]
    assert f"{SWEEP}: ccccccc+dirty, 2026-11-27, 3 seed(s)" in render_items(item, tmp_path)


def test_the_table_counts_the_statuses_and_shows_each_items_records(tmp_path):
    _record(tmp_path, SWEEP)
    text = render_items(load_items(_items(tmp_path)), tmp_path)
    lines = text.splitlines()
    assert lines[0] == ITEMS_START and lines[-1] == ITEMS_END
    assert "3 headline items: 1 reproduced, 1 shipped, 1 no sweep." in lines
    assert (
        f"| Decaying K | Figure 1, the quadratic | `{SWEEP}` | {SWEEP}: aaaaaaa, 2026-12-02, 3 seed(s) | **reproduced** | x* reached |"
        in lines
    )
    assert (
        f"| Decaying K | Figure 1 at the paper's scale | `{SWEEP}@paper` | — | **shipped** | waits for a run |" in lines
    )
    assert "| FedDyn | Table 6 \\| synthetic | — | — | **no sweep** | no loader yet |" in lines


def test_a_status_the_records_do_not_support_is_refused(tmp_path):
    doc = "# Page\n\n## The quadratic\n"
    items = load_items(_items(tmp_path))
    assert item_problems(items, sweep_names(), tmp_path, doc) == [
        "Decaying K, Figure 1, the quadratic: status 'reproduced' needs a record of one of its sweeps; none of "
        f"['{SWEEP}'] has one"
    ]
    _record(tmp_path, SWEEP)
    _record(tmp_path, f"{SWEEP}@paper")
    assert item_problems(items, sweep_names(), tmp_path, "# Page\n") == [
        "Decaying K, Figure 1, the quadratic: a verdict names the page's section with its evidence; no heading 'The quadratic'",
        f"Decaying K, Figure 1 at the paper's scale: status 'shipped' needs a sweep and no record of it yet ({SWEEP}@paper "
        "has one: give its verdict, or 'run')",
    ]
    bad = load_items(
        _items(tmp_path / "bad", ITEMS.replace('status = "no sweep"', 'sweeps = ["nope"]\nstatus = "no sweep"'))
    )
    assert "FedDyn, Table 6 | synthetic: nope is no shipped sweep" in item_problems(bad, sweep_names(), tmp_path, doc)
    listed = load_items(
        _items(tmp_path / "listed", ITEMS.replace('status = "no sweep"', f'sweeps = ["{SWEEP}"]\nstatus = "no sweep"'))
    )
    assert any("status 'no sweep' but it names" in line for line in item_problems(listed, sweep_names(), tmp_path, doc))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no \\[\\[item\\]\\] tables"),
        ('[[item]]\npaper = "P"\nwhat = "W"\nstatus = "done"\nnote = "n"\n', "status 'done' is none of"),
        (
            '[[item]]\npaper = "P"\nwhat = "W"\nstatus = "run"\nnote = "n"\nverdict = "x"\n',
            "unknown field\\(s\\) verdict",
        ),
        ('[[item]]\npaper = "P"\nstatus = "run"\n', "missing note, what"),
        ('[[item]]\npaper = "P"\nwhat = "W"\nstatus = "run"\nnote = "n"\nsweeps = "x"\n', "sweeps is a list"),
    ],
)
def test_a_malformed_items_file_names_the_item_and_field(tmp_path, text, message):
    with pytest.raises(ReproduceError, match=message):
        load_items(_items(tmp_path, text))


def test_the_docs_check_wants_the_block_current_and_reproduce_keeps_it_so(tmp_path, monkeypatch):
    docs = tmp_path / "docs" / "reproduction.md"
    records = tmp_path / "docs" / "reproduction"
    _items(records)
    stale = f"# Page\n\n{ITEMS_START}\n\n| a | 1 |\n|---|---|\n\n{ITEMS_END}\n\n## The quadratic\n\nText.\n"
    docs.write_text(stale, encoding="utf-8")
    problems = docs_problems(stale, "doc", records, docs, sweep_names())
    assert "doc:3: the headline items block is not what" in "\n".join(problems)
    assert not any("a table with numbers and no marker" in line for line in problems)  # the block's tables are its own
    # `driftlab reproduce SWEEP` records the sweep, then generates the block from the new record
    monkeypatch.setattr(running, "git_commit", lambda tree: "b" * 40)

    def fake_run(name, folder, scale, overrides, force=False):
        (folder / "report").mkdir(parents=True)
        (folder / "report" / "report.md").write_text(REPORT, encoding="utf-8")

    running.reproduce([SWEEP], tmp_path / "runs", docs, records, run=fake_run, log=lambda line: None)
    after = docs.read_text(encoding="utf-8")
    assert docs_problems(after, "doc", records, docs, sweep_names()) == []
    assert f"{SWEEP}: bbbbbbb" in after and after.endswith("## The quadratic\n\nText.\n")
    # --items rewrites it alone, running nothing
    docs.write_text(stale, encoding="utf-8")
    assert cli.main(["reproduce", "--items", "--docs", str(docs)]) == 0
    assert docs.read_text(encoding="utf-8") == after
    assert rewrite_items("no block\n", load_items(records / "items.toml"), records) == "no block\n"
