"""``driftlab demo --out DIR``: it writes only its own names into DIR, and runs again into its own folder."""

from __future__ import annotations

from driftlab import cli

QUICK = ["rounds=1", "client.epochs=none", "client.steps=1", "data.num_clients=5", "sampling.participation=0.4"]


def test_a_users_summary_md_is_left_untouched_the_demo_refused_then_forced_and_rerun(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.md").write_bytes(b"my own summary\n")
    (out / "keep.txt").write_bytes(b"mine")
    assert cli.main(["demo", *QUICK, "--quiet", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"driftlab: error: {out} already holds summary.md, not written by driftlab (or changed since); nothing was written: "
        "choose another --out directory, or pass --force to replace it\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "summary.md"]  # no run started
    assert (out / "summary.md").read_bytes() == b"my own summary\n"

    assert cli.main(["demo", *QUICK, "--quiet", "--out", str(out), "--force"]) == 0
    assert (out / "summary.md").read_text().startswith("| algorithm | final acc |") and (
        out / "keep.txt"
    ).read_bytes() == b"mine"
    (out / "summary.md").write_text("stale")
    assert (
        cli.main(["demo", *QUICK, "--quiet", "--out", str(out)]) == 0
    )  # its own folder: the runs are kept, the table rewritten
    assert (out / "summary.md").read_text().startswith("| algorithm | final acc |")
    capsys.readouterr()


def test_a_users_folder_named_like_a_demo_run_is_refused_before_any_run(tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "scaffold").mkdir(parents=True)
    (out / "scaffold" / "paper.pdf").write_bytes(b"mine")
    assert cli.main(["demo", *QUICK, "--quiet", "--out", str(out)]) == 2
    assert f"{out} already holds scaffold, not written by driftlab" in capsys.readouterr().err
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["scaffold", "scaffold/paper.pdf"]
