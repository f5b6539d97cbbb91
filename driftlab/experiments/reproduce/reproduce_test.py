"""``driftlab reproduce`` end to end on a cheap shipped sweep, in a copy of a small doc (issue 29).

``decaying-k-quadratic`` with ``rounds=3`` runs its three one-parameter runs in seconds: the command
runs it as ``driftlab sweep`` does, writes the record, rewrites the doc's block, and a second call
resumes (nothing runs again) and changes nothing but the record's date, machine and wall time.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from driftlab import cli
from driftlab.experiments.reproduce import running
from driftlab.experiments.reproduce.blocks import docs_problems, render_block
from driftlab.experiments.reproduce.records import parse_record
from driftlab.experiments.reproduce.running import git_commit, source_checkout, stated_time
from driftlab.experiments.sweep.shipped import sweep_names

SWEEP = "decaying-k-quadratic"
CITED = f"docs/reproduction/{SWEEP}.md"
DOC = f"""# A small doc

Some prose with a number, 42.

<!-- regenerated from {CITED}; tables=Local SGD steps -->

*Printed by an older commit.*

| method | total local steps |
|---|---|
| constant K, constant γ | 1 |

<!-- end regenerated -->

<!-- not regenerated: sweep={SWEEP}; tables=Loss and distance; typed by hand before this command existed -->
| method | final distance |
|---|---|
| constant K, constant γ | 0.0378 |

<!-- not regenerated: sweep={SWEEP}; derived; worked out by hand -->
| ratio | 3.9 |
|---|---|
"""
VOLATILE = ("- date: ", "- machine: ", "- wall: ")  # what a second call may change in a record


def _doc(tmp_path: Path) -> tuple[Path, Path, Path]:
    docs = tmp_path / "docs" / "reproduction.md"
    docs.parent.mkdir()
    docs.write_text(DOC, encoding="utf-8")
    return docs, tmp_path / "docs" / "reproduction", tmp_path / "runs"


@pytest.mark.slow
def test_reproduce_runs_the_sweep_records_it_and_rewrites_the_doc_then_resumes(tmp_path, monkeypatch, capfd):
    docs, records, out = _doc(tmp_path)
    # fixed, so that the second call's record can be compared whole while commits land in the checkout
    monkeypatch.setattr(running, "git_commit", lambda tree: "0123456789abcdef0123456789abcdef01234567+dirty")
    argv = ["reproduce", SWEEP, "rounds=3", "--out", str(out), "--docs", str(docs)]
    assert cli.main(argv) == 0
    printed = capfd.readouterr().out
    assert "3 runs, 0 already finished" in printed and f"wrote {records / SWEEP}.md" in printed
    assert (
        "1 hand-typed table(s) of decaying-k-quadratic replaced" in printed
        and "derived from decaying-k-quadratic by hand" in printed
    )

    record_text = (records / f"{SWEEP}.md").read_text(encoding="utf-8")
    record = parse_record(record_text)
    assert record.header["command"] == f"driftlab sweep {SWEEP} rounds=3"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", record.header["date"])
    assert re.fullmatch(r"\d+ cores, .+, torch .+; load average \S+ before, \S+ after", record.header["machine"])
    assert re.fullmatch(r"\d+\.\d minutes", record.header["wall"])
    assert "| decaying K, constant γ | 600 | 100.0% |" in record_text  # 3 rounds of K = 10 on 20 clients
    assert ".png" not in record_text
    assert (out / SWEEP / "report" / "report.md").is_file()

    doc = docs.read_text(encoding="utf-8")
    assert render_block(record, CITED, ("Local SGD steps",)) in doc
    assert render_block(record, CITED, ("Loss and distance",)) in doc  # the hand-typed table, converted
    assert "| constant K, constant γ | 1 |\n" not in doc and "| constant K, constant γ | 0.0378 |" not in doc
    assert doc.startswith("# A small doc\n\nSome prose with a number, 42.\n") and doc.endswith(
        "| ratio | 3.9 |\n|---|---|\n"
    )
    assert docs_problems(doc, "doc", records, docs, sweep_names()) == []
    assert "| constant K, constant γ | 0.0378 |" in (out / "replaced-tables.md").read_text(encoding="utf-8")

    metrics = sorted(out.glob(f"{SWEEP}/runs/**/metrics.jsonl"))
    assert len(metrics) == 3
    before = {path: path.read_bytes() for path in metrics}
    assert cli.main(argv) == 0
    assert "3 runs, 3 already finished, 0 to run" in capfd.readouterr().out  # resumed: nothing ran again
    assert {path: path.read_bytes() for path in metrics} == before
    assert docs.read_text(encoding="utf-8") == doc

    def stable(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith(VOLATILE)]

    assert stable((records / f"{SWEEP}.md").read_text(encoding="utf-8")) == stable(record_text)


def test_dry_run_says_what_would_run_and_writes_nothing(tmp_path, capsys):
    docs, records, out = _doc(tmp_path)
    assert cli.main(["reproduce", "--dry-run", "--out", str(out), "--docs", str(docs)]) == 0
    printed = capsys.readouterr().out
    assert (
        f"driftlab sweep {SWEEP} --out {out / SWEEP}: 3 runs, 0 complete, 3 to run; stated: about 2 minutes on 2 cores"
        in printed
    )
    assert "regenerate 1 block(s) and convert 1 hand-typed table(s)" in printed
    assert not out.exists() and not records.exists()
    assert docs.read_text(encoding="utf-8") == DOC


def test_list_prints_each_marker(tmp_path, capsys):
    docs, _, _ = _doc(tmp_path)
    assert cli.main(["reproduce", "--list", "--docs", str(docs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].split()[:3] == ["5", "regenerated", SWEEP] and "record unreadable" in lines[0]  # no record yet
    assert lines[1].split()[:4] == ["15", "not", "regenerated", SWEEP]
    assert lines[2].split()[:3] == ["20", "derived", SWEEP]


@pytest.mark.parametrize(
    ("extra", "doc", "message"),
    [
        (["no-such-sweep"], DOC, "'no-such-sweep' not a shipped sweep; shipped sweeps: adabest-figure1-mnist"),
        (
            [],
            f"<!-- regenerated from {CITED} -->\n| 1 |\n",
            "has no <!-- end regenerated --> after it; add one below its last table",
        ),
        ([], "# A doc without markers\n", "has no marker naming a sweep, and no NAME was given"),
    ],
)
def test_bad_input_is_refused_before_any_run(tmp_path, capsys, extra, doc, message):
    docs, _, out = _doc(tmp_path)
    docs.write_text(doc, encoding="utf-8")
    assert cli.main(["reproduce", *extra, "--out", str(out), "--docs", str(docs)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_out_is_required_unless_listing(tmp_path, capsys):
    docs, _, _ = _doc(tmp_path)
    assert cli.main(["reproduce", "--docs", str(docs)]) == 2
    assert "needs --out DIR" in capsys.readouterr().err


def test_the_command_line_module_imports_no_torch():
    # driftlab/cli.py imports add_parser for every `driftlab ... --help`; torch would add seconds to each
    code = "import sys; import driftlab.experiments.reproduce.command; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_git_commit_is_the_checkouts_head_and_says_when_it_is_dirty():
    commit = git_commit(source_checkout())
    head = subprocess.run(
        ["git", "-C", str(source_checkout()), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit) and commit.startswith(head)


def test_source_checkout_is_the_folder_holding_the_driftlab_package():
    assert (
        source_checkout() / "driftlab" / "experiments" / "reproduce" / "running.py" == Path(running.__file__).resolve()
    )


def test_git_commit_outside_a_checkout_says_so(tmp_path):
    assert git_commit(tmp_path).startswith("unknown (")


def test_stated_time_reads_the_sweep_descriptions():
    assert stated_time("runs 1000 rounds (about 2 minutes on 2 cores); `--scale paper`") == "about 2 minutes on 2 cores"
    assert stated_time("About 5 minutes\non 2 cores.") == "About 5 minutes on 2 cores"
    assert stated_time("no time here, 100 rounds") == "no time stated"


def test_every_record_of_one_call_names_the_commit_the_call_started_from(tmp_path, monkeypatch):
    # The call's own writes (records, the doc) dirty the checkout: asked after the first sweep, the second record
    # would say "+dirty" of a tree whose code did not change.
    docs, records, out = _doc(tmp_path)
    answers = iter(["a" * 40, "a" * 40 + "+dirty", "a" * 40 + "+dirty"])
    monkeypatch.setattr(running, "git_commit", lambda tree: next(answers))

    def fake_run(name, folder, scale, overrides):  # a report as the sweep writes it, without running anything
        (folder / "report").mkdir(parents=True)
        tables = [
            f"## {heading}\n\n| method | {column} |\n| --- | --- |\n| {name} | 1 |\n"
            for heading, column in (("Loss and distance", "final distance"), ("Local SGD steps", "total local steps"))
        ]
        (folder / "report" / "report.md").write_text("# driftlab report\n\n" + "\n".join(tables), encoding="utf-8")

    written = running.reproduce([SWEEP, "decaying-k-femnist"], out, docs, records, run=fake_run, log=lambda line: None)
    assert [parse_record(path.read_text(encoding="utf-8")).header["commit"] for path in written] == ["a" * 40] * 2


def _fake_sweep(name, folder, scale, overrides, force=False):
    """A report as the sweep writes it, without running anything (as the test above)."""
    (folder / "report").mkdir(parents=True, exist_ok=True)
    (folder / "sweep.json").write_text("{}")
    tables = [
        f"## {heading}\n\n| method | {column} |\n| --- | --- |\n| {name} | 1 |\n"
        for heading, column in (("Loss and distance", "final distance"), ("Local SGD steps", "total local steps"))
    ]
    (folder / "report" / "report.md").write_text("# driftlab report\n\n" + "\n".join(tables), encoding="utf-8")


def test_a_users_files_in_out_and_records_stop_it_before_any_run_then_force_and_rerun_work(tmp_path, monkeypatch):
    from driftlab.errors import ConfigError

    docs, records, out = _doc(tmp_path)
    monkeypatch.setattr(running, "git_commit", lambda tree: "a" * 40)
    ran: list[tuple[str, bool]] = []

    def fake_run(name, folder, scale, overrides, force=False):
        ran.append((name, force))
        _fake_sweep(name, folder, scale, overrides)

    out.mkdir()
    (out / "replaced-tables.md").write_bytes(b"my own tables\n")
    before = docs.read_bytes()
    with pytest.raises(ConfigError) as info:
        running.reproduce([SWEEP], out, docs, records, run=fake_run, log=lambda line: None)
    assert str(info.value) == (
        f"{out} already holds replaced-tables.md, not written by driftlab (or changed since); nothing was written: "
        "choose another --out directory, or pass --force to replace it"
    )
    records.mkdir()
    (records / f"{SWEEP}.md").write_bytes(b"my own notes on the sweep\n")  # not a record
    with pytest.raises(
        ConfigError,
        match=f"holds {SWEEP}.md, not written by driftlab .*choose another --record folder, or pass --force",
    ):
        running.reproduce([SWEEP], out, docs, records, run=fake_run, log=lambda line: None)
    assert ran == [] and docs.read_bytes() == before
    assert (
        sorted(p.name for p in out.iterdir()) == ["replaced-tables.md"]
        and (out / "replaced-tables.md").read_bytes() == b"my own tables\n"
    )
    assert (records / f"{SWEEP}.md").read_bytes() == b"my own notes on the sweep\n"

    running.reproduce([SWEEP], out, docs, records, run=fake_run, log=lambda line: None, force=True)
    assert ran == [(SWEEP, True)] and parse_record((records / f"{SWEEP}.md").read_text(encoding="utf-8"))
    running.reproduce(
        [SWEEP], out, docs, records, run=fake_run, log=lambda line: None
    )  # its own files now: no force needed
    assert ran == [(SWEEP, True), (SWEEP, False)]


def test_a_named_scale_has_its_own_runs_record_and_blocks(tmp_path, monkeypatch):
    # A paper-scale run must not overwrite the default scale's record or blocks: NAME@SCALE is a record of its own.
    docs, records, out = _doc(tmp_path)
    scaled = f"{SWEEP}@paper"
    text = docs.read_text(encoding="utf-8")
    docs.write_text(
        text + f"\n<!-- not regenerated: sweep={scaled}; tables=Local SGD steps; the paper scale, not yet run -->\n"
        "| method | total local steps |\n|---|---|\n| constant K | 7 |\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(running, "git_commit", lambda tree: "b" * 40)
    ran: list[tuple[str, str | None, str]] = []

    def fake_run(name, folder, scale, overrides, force=False):
        ran.append((name, scale, folder.name))
        _fake_sweep(name, folder, scale, overrides)

    running.reproduce([SWEEP], out, docs, records, scale="paper", run=fake_run, log=lambda line: None)
    assert ran == [(SWEEP, "paper", scaled)]
    assert sorted(path.name for path in records.iterdir()) == [f"{scaled}.md"]
    record = parse_record((records / f"{scaled}.md").read_text(encoding="utf-8"))
    assert record.header["command"] == f"driftlab sweep {SWEEP} --scale paper"
    after = docs.read_text(encoding="utf-8")
    assert f"<!-- regenerated from docs/reproduction/{scaled}.md; tables=Local SGD steps -->" in after
    assert "| constant K | 7 |" not in after  # the scale's hand-typed table was converted...
    assert "| constant K, constant γ | 1 |" in after  # ...and the default scale's block left as it was
    assert f"not regenerated: sweep={SWEEP}; tables=Loss and distance" in after
    # the key names its scale; --scale may repeat it but not contradict it
    running.reproduce([scaled], out, docs, records, run=fake_run, log=lambda line: None)
    assert ran[-1] == (SWEEP, "paper", scaled)
    with pytest.raises(running.ReproduceError, match="names scale 'paper', and --scale says 'small'"):
        running.reproduce([scaled], out, docs, records, scale="small", run=fake_run, log=lambda line: None)
    with pytest.raises(running.ReproduceError, match="'nope@paper' not a shipped sweep"):
        running.reproduce(["nope@paper"], out, docs, records, run=fake_run, log=lambda line: None)


def test_a_scaled_block_must_cite_a_record_of_that_scale(tmp_path, monkeypatch):
    from driftlab.experiments.reproduce.blocks import _scale_of

    assert _scale_of("driftlab sweep x --scale paper rounds=3".split()) == "paper"
    assert _scale_of("driftlab sweep x --scale=paper".split()) == "paper"
    assert _scale_of("driftlab sweep x rounds=3".split()) is None
    docs, records, out = _doc(tmp_path)
    monkeypatch.setattr(running, "git_commit", lambda tree: "c" * 40)
    running.reproduce([f"{SWEEP}@paper"], out, docs, records, run=_fake_sweep, log=lambda line: None)
    cited = f"docs/reproduction/{SWEEP}@paper.md"
    block = render_block(parse_record((records / f"{SWEEP}@paper.md").read_text(encoding="utf-8")), cited, None)
    doc = f"# A doc\n\n{block}\n"
    assert docs_problems(doc, "doc", records, docs, sweep_names()) == []
    record_file = records / f"{SWEEP}@paper.md"
    record_file.write_text(record_file.read_text(encoding="utf-8").replace(" --scale paper", ""), encoding="utf-8")
    problem = f"{cited}: `command: driftlab sweep {SWEEP}` does not run `driftlab sweep {SWEEP} --scale paper`"
    assert problem in docs_problems(doc, "doc", records, docs, sweep_names())
