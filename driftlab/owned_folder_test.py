"""Folders a user names: what a command may write there, the manifest, and what it may delete."""

from __future__ import annotations

import json

import pytest

from driftlab.errors import ConfigError
from driftlab.owned_folder import MANIFEST_FILE, OwnedFolder, claim


def test_a_new_folder_is_created_and_the_names_listed_before_they_are_written(tmp_path):
    folder = tmp_path / "a" / "b"
    claim(folder, ["report.md", "plots"], "driftlab report")
    assert json.loads((folder / MANIFEST_FILE).read_text()) == {
        "format": 1,
        "files": {"plots": "driftlab report", "report.md": "driftlab report"},
    }
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST_FILE]  # listed, not written: that is the command's job


def test_a_users_file_stops_the_claim_and_nothing_is_written(tmp_path):
    (tmp_path / "report.md").write_text("mine")
    (tmp_path / "notes.txt").write_text("mine too")
    with pytest.raises(ConfigError) as info:
        claim(tmp_path, ["report.md", "targets.csv"], "driftlab report")
    assert str(info.value) == (
        f"{tmp_path} already holds report.md, not written by driftlab (or changed since); nothing was written: "
        "choose another --out directory, or pass --force to replace it"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "report.md"]


def test_files_driftlab_listed_may_be_written_again_and_force_takes_the_users(tmp_path):
    claim(tmp_path, ["report.md"], "driftlab report")
    (tmp_path / "report.md").write_text("written by the report")
    claim(tmp_path, ["report.md"], "driftlab report")  # a rerun into its own folder
    (tmp_path / "summary.md").write_text("mine")
    owned = claim(tmp_path, ["summary.md"], "driftlab demo", force=True)
    assert owned.files == {"report.md": "driftlab report", "summary.md": "driftlab demo"}
    assert (tmp_path / "summary.md").read_text() == "mine"  # force allows replacing; claiming alone writes nothing


def test_an_earlier_version_s_file_is_recognised_and_a_link_never_is(tmp_path):
    (tmp_path / "sweep.json").write_text("{}")
    claim(tmp_path, ["sweep.json"], "driftlab sweep", recognise=lambda entry: True)
    (tmp_path / "elsewhere.txt").write_text("mine")
    (tmp_path / "jobs.json").symlink_to(tmp_path / "elsewhere.txt")  # writing jobs.json would write the user's file
    with pytest.raises(ConfigError, match="holds jobs.json"):
        claim(tmp_path, ["jobs.json"], "driftlab sweep", recognise=lambda entry: True)


def test_remove_deletes_only_what_the_manifest_lists(tmp_path):
    owned = claim(tmp_path, ["old.png", "figures"], "driftlab report")
    (tmp_path / "old.png").write_bytes(b"png")
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "a.png").write_bytes(b"png")
    (tmp_path / "mine.png").write_bytes(b"mine")
    assert owned.remove("old.png") and owned.remove("figures") and not owned.remove("mine.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_FILE, "mine.png"]
    assert OwnedFolder.read(tmp_path, "driftlab report").files == {}


def test_a_file_edited_since_driftlab_wrote_it_is_the_users(tmp_path):
    owned = claim(tmp_path, ["app"], "driftlab flower new")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "apps.py").write_text("generated\n")
    owned.record_digests(["app/apps.py"])
    claim(tmp_path, ["app"], "driftlab flower new")  # unchanged: still driftlab's
    (tmp_path / "app" / "apps.py").write_text("generated\nedited by the user\n")
    with pytest.raises(ConfigError, match="holds app/apps.py, not written by driftlab"):
        claim(tmp_path, ["app"], "driftlab flower new")


def test_a_manifest_that_is_not_ours_and_a_file_in_place_of_the_folder_are_refused(tmp_path):
    (tmp_path / MANIFEST_FILE).write_text("not json")
    with pytest.raises(ConfigError, match=f"{MANIFEST_FILE} is not a manifest driftlab wrote"):
        claim(tmp_path, ["a"], "driftlab report")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory; choose another --out directory"):
        claim(tmp_path / "file", ["a"], "driftlab report")
