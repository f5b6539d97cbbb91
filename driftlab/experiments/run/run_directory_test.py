"""The run directory's files, read and written without a run (the runner's tests cover them inside runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from driftlab.errors import ConfigError
from driftlab.experiments.config import load_config
from driftlab.experiments.run import run_directory

PACKAGE_DIR = Path(run_directory.__file__).resolve().parents[2]  # driftlab/


def test_importing_it_imports_no_torch():
    """Reports and sweep status read run directories without paying for torch (driftlab/__init__ aside, stubbed here)."""
    code = (
        "import sys, types\n"
        f"package = types.ModuleType('driftlab'); package.__path__ = [{str(PACKAGE_DIR)!r}]; sys.modules['driftlab'] = package\n"
        "import driftlab.experiments.run.run_directory as m\n"
        "print(sorted(name for name in ('torch', 'numpy', 'pydantic') if name in sys.modules), m.CONFIG_FILE)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["[]", "config.json"]


def test_read_run_info_is_none_for_a_missing_or_damaged_file(tmp_path):
    assert run_directory.read_run_info(tmp_path) is None
    (tmp_path / run_directory.RUN_INFO_FILE).write_text("{not json")
    assert run_directory.read_run_info(tmp_path) is None
    (tmp_path / run_directory.RUN_INFO_FILE).write_text('{"status": "complete"}')
    assert run_directory.read_run_info(tmp_path) == {"status": "complete"}


def test_run_info_sums_wall_time_over_resumes(tmp_path):
    first = run_directory.RunInfo.start(
        tmp_path, rounds=4, start_round=0, num_parameters=7, entries={"machine": {"cpu_count": 1}}
    )
    first.previous_seconds = 2.5  # as if the first process had run 2.5 s
    first.update("interrupted", 2)
    resumed = run_directory.RunInfo.start(tmp_path, rounds=4, start_round=2, num_parameters=7, entries={})
    info = run_directory.read_run_info(tmp_path)
    assert info["status"] == "running" and info["resumed_from_round"] == 2 and info["num_parameters"] == 7
    assert resumed.previous_seconds >= 2.5
    assert list(info)[:5] == ["format", "status", "rounds", "rounds_done", "num_parameters"]


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_read_records_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / run_directory.METRICS_FILE
    _write_lines(path, [json.dumps({"round": 1}), json.dumps({"round": 2}), '{"round": 3, "lo'])
    assert run_directory.read_records(path, up_to_round=2) == [{"round": 1}, {"round": 2}]
    _write_lines(path, [json.dumps({"round": 1}), "{torn", json.dumps({"round": 3})])
    with pytest.raises(ConfigError, match=r"line 2 is not JSON, and only a last line torn by a kill may be"):
        run_directory.read_records(path, up_to_round=3)


def test_read_records_refuses_a_gap_the_checkpoint_covers(tmp_path):
    path = tmp_path / run_directory.METRICS_FILE
    _write_lines(path, [json.dumps({"round": 1}), json.dumps({"round": 3})])
    with pytest.raises(ConfigError, match=r"line 2 holds round 3 where round 2 belongs"):
        run_directory.read_records(path, up_to_round=2)
    _write_lines(path, [json.dumps({"round": 1})])
    with pytest.raises(ConfigError, match=r"holds rounds 1-1, but the checkpoint beside it is at round 3"):
        run_directory.read_records(path, up_to_round=3)


def test_metrics_csv_has_a_column_per_key_in_first_seen_order(tmp_path):
    run_directory.write_metrics_csv(
        tmp_path, [{"round": 1, "loss": 0.5}, {"round": 2, "accuracy": 0.25, "clients": [1, 2]}]
    )
    assert (
        tmp_path / run_directory.METRICS_CSV_FILE
    ).read_text() == 'round,loss,accuracy,clients\n1,0.5,,\n2,,0.25,"[1, 2]"\n'


def test_a_new_run_refuses_a_folder_of_the_users(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"is not empty and holds no driftlab run \(notes.txt\)"):
        run_directory.claim_run_directory(tmp_path, load_config(None), resume=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_the_lock_names_the_process_holding_it(tmp_path):
    config = load_config(None)
    held = run_directory.claim_run_directory(tmp_path / "run", config, resume=False)
    try:
        with pytest.raises(
            run_directory.RunDirectoryBusy, match=r"being written by another driftlab process \(PID \d+\)"
        ):
            run_directory.lock_run_directory(tmp_path / "run")
    finally:
        held.close()
    assert json.loads((tmp_path / "run" / run_directory.CONFIG_FILE).read_text()) == json.loads(
        json.dumps(config.to_dict())
    )


def test_resuming_with_other_data_names_the_data_not_just_the_config(tmp_path):
    custom = ["data.name=custom", "data.loader=my_data.py:load"]
    started = load_config(None, [*custom, f"data.digest={'a' * 64}"])
    run_directory.claim_run_directory(tmp_path, started, resume=False).close()
    (tmp_path / run_directory.METRICS_FILE).write_text(json.dumps({"round": 1}) + "\n")
    other = load_config(None, [*custom, f"data.digest={'b' * 64}"])
    with pytest.raises(
        ConfigError,
        match=r"started on data with digest aaaaaaaaaaaa\.\.\. .* given data with digest bbbbbbbbbbbb\.\.\.; resume with the data the run started with",
    ):
        run_directory.check_run_directory(tmp_path, other, resume=True)
    with pytest.raises(ConfigError, match=r"but this run was given the config's own data set"):
        run_directory.check_run_directory(tmp_path, load_config(None), resume=True)
    run_directory.check_run_directory(tmp_path, started, resume=True)  # the same data: no error


def test_a_refused_run_removes_only_what_it_created(tmp_path):
    config = load_config(None)
    new = tmp_path / "a" / "b"
    before = run_directory.DirectoryBefore.of(new)
    assert before.missing == (new, tmp_path / "a") and before.empty and not before.had_lock
    lock = run_directory.claim_run_directory(new, config, resume=False)
    (tmp_path / "a" / "notes.txt").write_text("someone else's")  # written beside it meanwhile: keeps its folder
    run_directory.remove_refused_run(new, before)
    lock.close()
    assert not new.exists() and sorted(p.name for p in (tmp_path / "a").iterdir()) == ["notes.txt"]

    used = tmp_path / "used"  # empty but for the lock file an earlier run left: that file stays
    run_directory.claim_run_directory(used, config, resume=False).close()
    (used / "config.json").unlink()
    before = run_directory.DirectoryBefore.of(used)
    assert before.empty and before.had_lock
    lock = run_directory.claim_run_directory(used, config, resume=False)
    run_directory.remove_refused_run(used, before)
    lock.close()
    assert [p.name for p in used.iterdir()] == [".lock"]

    earlier = tmp_path / "earlier"  # an earlier run's config.json: not the refused run's to remove
    run_directory.claim_run_directory(earlier, config, resume=False).close()
    before = run_directory.DirectoryBefore.of(earlier)
    run_directory.remove_refused_run(earlier, before)
    assert (earlier / "config.json").exists()


@pytest.mark.parametrize("name", ["metrics.csv", "config.json", "run.json", "notes.txt"])
def test_a_users_file_in_a_run_directory_is_never_touched(tmp_path, name):
    # config.json too, and a complete one: `driftlab config X > DIR/config.json` then `driftlab run ... --out DIR`
    content = json.dumps(load_config(None).to_dict(), indent=2).encode() if name == "config.json" else b"mine\n"
    (tmp_path / name).write_bytes(content)
    with pytest.raises(
        ConfigError, match=rf"is not empty and holds no driftlab run \({name}\); .*choose another --out directory"
    ):
        run_directory.claim_run_directory(tmp_path, load_config(None, ["rounds=3"]), resume=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name] and (tmp_path / name).read_bytes() == content
