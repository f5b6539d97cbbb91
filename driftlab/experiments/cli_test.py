"""The `driftlab` command line, run as a user runs it.

Most cases call the entry point in this process (output captured, no interpreter
start per case); the README's flows and the last-resort handler also run as a
real `python -m driftlab.cli` process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import driftlab
from driftlab import cli
from driftlab.data.registry import DATA_SETS
from driftlab.experiments.config import ExperimentConfig, load_config, preset_names
from driftlab.experiments.sweep.testing import FEDPROX_GRID
from driftlab.models.registry import MODELS
from driftlab.optim.registry import REGISTRY as SERVER_REGISTRY

REPO_ROOT = Path(driftlab.__file__).resolve().parents[1]
TINY = ["rounds=2", "client.epochs=none", "client.steps=2", "data.num_clients=5", "sampling.participation=0.4"]


def driftlab_cli(
    *args: object, cwd: Path | None = None, process: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``driftlab ARGS`` as a finished process: run in this process, or with ``process=True`` a real one.

    ``env`` replaces the environment for the call (restored afterwards when run in this process).
    """
    argv = [str(arg) for arg in args]
    env = dict(os.environ if env is None else env)
    if process:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        return subprocess.run(
            [sys.executable, "-m", "driftlab.cli", *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
        )
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as exit_info:  # argparse: usage errors and --help
                code = exit_info.code if isinstance(exit_info.code, int) else 0 if exit_info.code is None else 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["driftlab", *argv], code, out.getvalue(), err.getvalue())


def _assert_clean_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("driftlab: error: "), result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    for fragment in fragments:
        assert fragment in result.stderr


@pytest.mark.slow
def test_run_a_preset_with_overrides_then_resume_it(tmp_path):
    out = tmp_path / "run"
    result = driftlab_cli("run", "synthetic-fedavg", *TINY, "--out", out, "--quiet", process=True)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    assert summary["rounds"] == 2 and summary["target_accuracy"] == 0.7
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["num_reporting"] == 2 and r["local_steps"] == 4 for r in records)
    config = json.loads((out / "config.json").read_text())
    assert config["client"]["steps"] == 2 and "epochs" not in config["client"] and config["client"]["lr"] == 0.01
    assert (out / "final_model.safetensors").exists() and not (
        out / "checkpoint.safetensors"
    ).exists()  # keep_checkpoint=false

    # the README's resume command: the stored config.json is a valid CONFIG, here extended by two rounds
    resumed = driftlab_cli("run", out / "config.json", "--out", out, "--resume", "--quiet", "rounds=4", process=True)
    assert resumed.returncode == 0, resumed.stderr
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def _listed(block: str) -> dict[str, str]:
    """`driftlab presets` output: name (indented 2) -> its description (the lines indented 6, joined)."""
    entries: dict[str, list[str]] = {}
    for line in block.splitlines():
        if line.startswith("      "):
            entries[next(reversed(entries))].append(line.strip())
        elif line.startswith("  "):
            entries[line.strip()] = []
    return {name: " ".join(lines) for name, lines in entries.items()}


def test_presets_command_shows_every_description_whole():
    from driftlab.experiments.sweep import load_sweep, sweep_names

    result = driftlab_cli("presets")
    assert result.returncode == 0
    assert all(len(line) <= 100 for line in result.stdout.splitlines())
    configs, sweeps = result.stdout.split("sweeps (driftlab sweep NAME --out DIR):")
    presets = _listed(configs)
    assert list(presets) == preset_names()
    for name, description in presets.items():
        assert description == cli.preset_description(name) and description, name
    assert presets["demo-synthetic"].startswith("The `driftlab demo` workload: FedProx's synthetic(1,1)")
    assert presets["demo-synthetic"].endswith("2 local epochs, 20% participation.")
    listed = _listed(sweeps)
    assert list(listed) == sweep_names()
    for name, description in listed.items():
        assert description == " ".join(load_sweep(name).description.split()), name  # the whole text, not its first line
    assert "`--scale paper` runs the paper's 3000." in listed["decaying-k-quadratic"]


def test_a_wrapped_description_never_splits_a_hyphenated_word():
    # "DP-SCAFFOLD" cut after its hyphen would read as "DP- SCAFFOLD" once the lines are joined again
    for padding in range(60, 110):
        lines = cli._wrapped("x" * padding + " DP-SCAFFOLD is ahead").splitlines()
        assert any("DP-SCAFFOLD" in line for line in lines), padding


def test_preset_description_is_the_leading_comment_block():
    text = cli.preset_description("mnist-fedavg")
    assert (
        text.startswith("FedDyn Table 2 setting with FedAvg: MNIST, 100 clients")
        and "seed" not in text
        and "#" not in text
    )


def test_config_command_lists_every_key():
    result = driftlab_cli("config")
    assert result.returncode == 0
    for section in ("client", "sampling", "evaluation"):
        for key in ExperimentConfig.model_fields[section].annotation.model_fields:
            assert f"{section}.{key} = " in result.stdout, f"{section}.{key}"
    for section, registry in (
        ("model", MODELS),
        ("server", SERVER_REGISTRY.entries),
    ):  # one section per model, per optimizer
        for entry in registry.values():
            for key in entry.config_type.model_fields:
                if key not in ("name", "optimizer"):
                    assert f"{section}.{key} = " in result.stdout or f"{section}.{key} (required)" in result.stdout, key
    for data_set in DATA_SETS.values():  # [data] is one section per data set
        for key in data_set.config_type.model_fields:
            assert f"data.{key} = " in result.stdout, f"data.{key} of {data_set.name}"
    for key in ("seed", "rounds", "device", "precision", "checkpoint_every"):
        assert f"  {key} = " in result.stdout


def test_config_command_resolves_a_config():
    result = driftlab_cli("config", "synthetic-fedavg", "client.lr=0.5")
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["client"]["lr"] == 0.5 and resolved["rounds"] == 200


def test_config_command_with_only_overrides(capsys):
    assert cli.main(["config", "client.lr=0.25", "rounds=3"]) == 0  # overrides of the defaults, no CONFIG
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["client"]["lr"] == 0.25 and resolved["rounds"] == 3


def test_config_toml_round_trips_through_a_file(tmp_path, capsys):
    overrides = [
        "rounds=3",
        'client.lr={kind="exponential",initial=0.1,decay=0.99}',
        "client.steps={kind='inverse_time',a=100,b=1}",
        "client.epochs=none",
        "availability.events=[{round=2, join=[1, 2]}, {round=3, leave_range=[0, 2]}]",
        "availability.initially_registered=10",
        "model.name=mlp",
        "model.hidden=[64, 32]",
        "evaluation.target_accuracy=0.55",
    ]
    assert cli.main(["config", "synthetic-fedavg", *overrides, "--toml"]) == 0
    text = capsys.readouterr().out
    assert "[[availability.events]]" in text and 'lr = {kind = "exponential", initial = 0.1, decay = 0.99}' in text
    saved = tmp_path / "my.toml"
    saved.write_text(text)
    original = load_config("synthetic-fedavg", overrides)
    loaded = load_config(saved)
    assert loaded.fingerprint() == original.fingerprint() and loaded.to_dict() == original.to_dict()


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_round_trips_as_toml(tmp_path, name):
    original = load_config(name)
    saved = tmp_path / f"{name}.toml"
    saved.write_text(cli.to_toml(original.to_dict()))
    assert load_config(saved).to_dict() == original.to_dict()


def test_toml_writer_values():
    import tomllib

    table = {
        "a": 1,
        "b": -2.5e-07,
        "c": True,
        "d": 'quote " backslash \\ newline \n tab \t bell \x07 del \x7f é',
        "e": [1, 2.0, "x"],
        "f": float("inf"),
        "s": {"weird key": {"x": 1}, "list": [{"k": 1}], "empty": []},
    }
    text = cli.to_toml(table)
    assert tomllib.loads(text) == table
    assert '"weird key" = {x = 1}' in text and "[[s.list]]" in text
    with pytest.raises(TypeError, match="cannot write"):
        cli.to_toml({"x": object()})


def test_run_help_is_short_and_points_to_the_keys_in_driftlab_config():
    result = driftlab_cli("run", "--help")
    assert result.returncode == 0 and "--resume" in result.stdout and len(result.stdout.splitlines()) < 40
    assert "`driftlab config` lists every key with its meaning and default" in result.stdout
    listed = driftlab_cli("config")
    assert listed.returncode == 0
    for key in (
        "client.lr",
        "client.steps",
        "sampling.participation",
        "server.optimizer",
        "data.name",
        "evaluation.every",
    ):
        assert f"\n  {key} = " in listed.stdout, key


def test_config_errors_exit_2_without_a_traceback(tmp_path, capsys):
    _assert_clean_error(
        driftlab_cli("run", "synthetic-fedavg", "client.lrr=0.1", "--out", tmp_path / "a"), "client.lrr", "unknown key"
    )
    assert not (tmp_path / "a").exists()  # stopped before any work
    # the same entry point in-process (no interpreter start-up per case)
    for argv, fragment in [
        (["run", "synthetic-fedavg", "client.lr=-1", "--out", str(tmp_path / "b")], "client.lr"),
        (["run", "no-such-preset", "--out", str(tmp_path / "c")], "no-such-preset"),
        (["config", "synthetic-fedavg", "sampling.participation=2"], "sampling.participation"),
        (
            ["run", "synthetic-fedavg", "algorithm.name=fedfoo", "--out", str(tmp_path / "d")],
            "unknown algorithm 'fedfoo'",
        ),
        (["run", "synthetic-fedavg", "data.name=cifar", "--out", str(tmp_path / "e")], "data.name"),
    ]:
        assert cli.main(argv) == 2
        captured = capsys.readouterr()
        _assert_clean_error(subprocess.CompletedProcess(argv, 2, captured.out, captured.err), fragment)


def test_data_errors_exit_2_without_a_traceback(tmp_path):
    root = tmp_path / "mnist"
    root.mkdir()
    (root / "train-images-idx3-ubyte").write_bytes(
        b"\x00\x00\x08\x03" + (5).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2 + b"\x00" * 100
    )
    result = driftlab_cli("run", "mnist-fedavg", f"data.root={root}", "rounds=1", "--out", tmp_path / "run", "--quiet")
    _assert_clean_error(result, "train-images-idx3-ubyte")
    missing = driftlab_cli(
        "run", "mnist-fedavg", f"data.root={tmp_path / 'nowhere'}", "--out", tmp_path / "run2", "--quiet"
    )
    _assert_clean_error(missing, "nowhere")


def test_run_refusals_exit_2(tmp_path):
    out = tmp_path / "run"
    driftlab.run("synthetic-fedavg", out, overrides=TINY)
    _assert_clean_error(driftlab_cli("run", "synthetic-fedavg", *TINY, "--out", out, "--quiet"), "--resume")
    _assert_clean_error(
        driftlab_cli("run", "synthetic-fedavg", *TINY, "client.lr=0.3", "--out", out, "--resume", "--quiet"),
        "cannot resume",
    )


@pytest.mark.slow
def test_demo_writes_a_table_and_a_plot(tmp_path):
    out = tmp_path / "demo"
    result = driftlab_cli("demo", "rounds=2", "client.epochs=none", "client.steps=3", "--quiet", "--out", out)
    assert result.returncode == 0, result.stderr
    table = (out / "summary.md").read_text()
    assert "| FedAvg |" in table and "| FedAdam |" in table
    assert table in result.stdout or table.strip() in result.stdout
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for label in ("fedavg", "fedadam"):
        lines = (out / label / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["round"] for line in lines] == [1, 2]


@pytest.mark.slow
def test_a_diverging_run_exits_3_with_advice_and_keeps_its_checkpoint(tmp_path):
    out = tmp_path / "diverged"
    result = subprocess.run(
        # gradient descent with step 0.9 on curvatures in [1, 3] grows |x| ~1.7x per step: in round 3 the model's norm passes
        # 1000 times its starting scale (evaluation.norm_growth_factor), after two healthy rounds
        [
            sys.executable,
            "-m",
            "driftlab.cli",
            "run",
            "quadratic-constant-k",
            "client.lr=0.9",
            "rounds=40",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3, result.stderr
    assert "diverged" in result.stderr and "lower client.lr" in result.stderr
    assert "Traceback" not in result.stderr
    assert (out / "config.json").exists() and (out / "checkpoint.safetensors").exists()
    rounds_written = len((out / "metrics.jsonl").read_text().splitlines())
    assert 0 < rounds_written < 40


@pytest.mark.slow
def test_sweep_with_grid_runs_every_variant_then_reports(tmp_path):
    out = tmp_path / "sweep"
    sweep = ["sweep", "synthetic-fedprox", *TINY, *FEDPROX_GRID, "--out", out]
    result = driftlab_cli(*sweep, process=True)
    assert result.returncode == 0, result.stderr
    assert "sweep finished: 4 complete" in result.stdout
    runs = sorted(p.parent.relative_to(out).as_posix() for p in out.glob("runs/*/*/metrics.jsonl"))
    assert runs == [
        "runs/mu-0/seed-0",
        "runs/mu-0/seed-1",
        "runs/mu-1/seed-0",
        "runs/mu-1/seed-1",
    ]  # labelled by the key's last part
    report = (out / "report" / "report.md").read_text()
    assert "| mu=0 | 2 |" in report and "| mu=1 | 2 |" in report  # one accuracy row per method, 2 seeds each

    listed = driftlab_cli(*sweep, "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()] == ["complete"] * 4

    again = driftlab_cli("report", out, "--out", tmp_path / "again", "--targets", "0.2,0.3", "--no-plots")
    assert again.returncode == 0, again.stderr
    assert (
        "Communication to reach 20% test accuracy" in again.stdout
        and "Communication to reach 30% test accuracy" in again.stdout
    )
    assert not list((tmp_path / "again").glob("*.png"))


def test_sweep_and_report_errors_are_clean(tmp_path):
    _assert_clean_error(
        driftlab_cli("sweep", "no-such-thing", "--out", tmp_path / "x"),
        "neither a sweep nor a config",
        "fedprox-figure1",
        "synthetic-fedprox",
    )
    _assert_clean_error(
        driftlab_cli("sweep", "fedprox-figure1", "--seeds", "0,0", "--out", tmp_path / "x"), "lists a seed twice"
    )
    _assert_clean_error(
        driftlab_cli("sweep", "synthetic-fedprox", "--seeds", "a,b", "--out", tmp_path / "x"),
        "--seeds takes comma-separated integers",
    )
    _assert_clean_error(
        driftlab_cli("sweep", "fedprox-figure1", "--grid", "algorithm.mu=[0]", "--out", tmp_path / "x"),
        "add axes to it instead of --grid",
    )
    _assert_clean_error(
        driftlab_cli("sweep", "fedprox-figure1", "--scale", "huge", "--out", tmp_path / "x", "--dry-run"),
        "no scale 'huge'; its scales: paper",
    )
    _assert_clean_error(
        driftlab_cli("sweep", "synthetic-fedprox", "--grid", "algorithm.muu=[0]", "--out", tmp_path / "x"),
        "algorithm.muu: unknown key",
    )
    _assert_clean_error(driftlab_cli("report", tmp_path / "nothing-here", "--out", tmp_path / "r"), "nothing-here")
    _assert_clean_error(
        driftlab_cli("report", tmp_path, "--out", tmp_path / "r", "--targets", "high"),
        "--targets takes comma-separated numbers",
    )
    assert not (tmp_path / "x").exists()  # nothing started


# ------------------------------------------------------------------ overrides anywhere on the command line


@pytest.mark.parametrize(
    "argv, overrides",
    [
        (["run", "X", "--out", "D", "rounds=2"], ["rounds=2"]),
        (["run", "X", "a.b=1", "--out", "D", "--quiet", "c.d=2", "--resume", "e=3"], ["a.b=1", "c.d=2", "e=3"]),
        (["run", "--out", "D", "X", "rounds=2"], ["rounds=2"]),
        (["sweep", "X", "--grid", "k=[1, 2]", "rounds=6", "--out", "D"], ["rounds=6"]),
        (["config", "X", "--toml", "rounds=3"], ["rounds=3"]),
        (["demo", "--quiet", "rounds=30", "--out", "D", "client.lr=-1"], ["rounds=30", "client.lr=-1"]),
        (["data", "describe", "X", "--debug", "data.num_clients=4"], ["data.num_clients=4"]),
    ],
)
def test_overrides_are_taken_anywhere_after_the_command(argv, overrides):
    assert cli.parse_arguments(argv).overrides == overrides


def test_overrides_after_options_reach_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", "synthetic-fedavg", "--out", str(out), "--quiet", *TINY, "client.lr=0.02"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["rounds"] == 2 and config["client"]["lr"] == 0.02
    capsys.readouterr()
    assert cli.main(["config", "synthetic-fedavg", "--toml", "rounds=3"]) == 0
    assert "\nrounds = 3\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, unknown",
    [
        (
            ["run", "synthetic-fedavg", "--out", "D", "rounds=2", "stray"],
            "unrecognized arguments: stray (overrides are section.key=value)",
        ),
        (["run", "synthetic-fedavg", "--out", "D", "--bogus"], "unrecognized arguments: --bogus"),
        (["presets", "rounds=2"], "unrecognized arguments: rounds=2"),
        (["report", "A", "--out", "R", "rounds=2"], "unrecognized arguments: rounds=2"),
    ],
)
def test_words_that_are_no_override_are_argparse_errors(argv, unknown, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"driftlab: error: {unknown}" in err and "Traceback" not in err


# ------------------------------------------------------------------ the last-resort handler


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """tempfile.gettempdir() for the error logs, inside the test's own folder."""
    import tempfile

    logs = tmp_path / "tmp"
    logs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(logs))
    return logs


def _fail_with(monkeypatch, error: BaseException) -> None:
    def dispatch(args):
        raise error

    monkeypatch.setattr(cli, "_dispatch", dispatch)


def test_an_unexpected_error_is_one_line_a_log_and_exit_1(monkeypatch, capsys, temp_dir):
    _fail_with(monkeypatch, IndexError("index 7 is out of bounds for dimension 0 with size 5"))
    assert cli.main(["presets"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == "driftlab: error: IndexError: index 7 is out of bounds for dimension 0 with size 5"
    (log,) = temp_dir.glob("driftlab-error-*.log")
    assert lines[1] == f"driftlab: full traceback in {log} (or run again with --debug)" and len(lines) == 2
    assert "Traceback" not in captured.err + captured.out
    text = log.read_text()
    assert (
        "Traceback (most recent call last)" in text
        and "IndexError: index 7" in text
        and "command: driftlab presets" in text
    )


def test_the_log_goes_to_an_existing_out_directory_and_keeps_what_was_there(tmp_path, monkeypatch, capsys, temp_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "error.log").write_text("the user's earlier log\n")
    _fail_with(monkeypatch, RuntimeError("boom"))
    assert cli.main(["run", "synthetic-fedavg", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "driftlab: error: RuntimeError: boom",
        f"driftlab: full traceback in {out / 'error.log'} (or run again with --debug)",
    ]
    text = (out / "error.log").read_text()
    assert text.startswith("the user's earlier log\n") and "RuntimeError: boom" in text
    assert not list(temp_dir.iterdir())
    # an --out that does not exist yet: the temporary folder, and nothing created at --out
    assert cli.main(["run", "synthetic-fedavg", "--out", str(tmp_path / "new")]) == 1
    assert not (tmp_path / "new").exists() and len(list(temp_dir.glob("driftlab-error-*.log"))) == 1
    capsys.readouterr()


@pytest.mark.parametrize(
    "argv", [["--debug", "presets"], ["presets", "--debug"], ["data", "list", "--debug"], ["data", "--debug", "list"]]
)
def test_debug_before_or_after_the_command_prints_the_traceback(argv, monkeypatch, capsys, temp_dir):
    _fail_with(monkeypatch, ValueError("bad"))
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().endswith(
        "driftlab: full traceback in " + str(next(temp_dir.glob("*.log")))
    )
    assert "driftlab: error: ValueError: bad" in err


def test_a_huge_error_message_is_cut_on_the_terminal_only(monkeypatch, capsys, temp_dir):
    _fail_with(monkeypatch, RuntimeError("x" * 100_000))
    assert cli.main(["presets"]) == 1
    first = capsys.readouterr().err.splitlines()[0]
    assert len(first) < 600 and first.endswith(" ...")
    assert "x" * 100_000 in next(temp_dir.glob("*.log")).read_text()


def test_known_errors_keep_their_exit_codes(monkeypatch, capsys, temp_dir):
    from driftlab.experiments.config import ConfigError

    _fail_with(monkeypatch, ConfigError("client.lr: must be positive"))
    assert cli.main(["presets"]) == 2
    assert capsys.readouterr().err == "driftlab: error: client.lr: must be positive\n"
    _fail_with(monkeypatch, KeyboardInterrupt())
    assert cli.main(["presets"]) == 130
    assert "interrupted" in capsys.readouterr().err
    _fail_with(monkeypatch, PermissionError(13, "Permission denied", "/data/secret"))
    assert cli.main(["presets"]) == 2
    assert capsys.readouterr().err == "driftlab: error: /data/secret: Permission denied\n"
    from driftlab.data.federated import DataFileError
    from driftlab.experiments.run.datasets import DataSetupError
    from driftlab.simulation.state.checkpoint import CheckpointError

    for error in (
        DataFileError("bad file x.npz"),
        DataSetupError("no data at y"),
        CheckpointError("checkpoint z is damaged"),
    ):
        _fail_with(monkeypatch, error)
        assert cli.main(["presets"]) == 2
        assert capsys.readouterr().err == f"driftlab: error: {error}\n"
    assert not list(temp_dir.iterdir())  # known errors need no log


def test_a_config_file_that_is_not_utf8_is_named(tmp_path, capsys):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes("# réglages\nrounds = 3\n".encode("latin-1"))
    for argv in (
        ["run", str(bad), "--out", str(tmp_path / "run")],
        ["config", str(bad)],
        ["sweep", str(bad), "--out", str(tmp_path / "s")],
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"driftlab: error: {bad} is not UTF-8 text (byte 0xe9 at offset 3); save it as UTF-8\n", err
    assert not (tmp_path / "run").exists() and not (tmp_path / "s").exists()
    truncated = tmp_path / "cut.toml"
    truncated.write_bytes("rounds = 3 # é".encode()[:-1])
    assert cli.main(["config", str(truncated)]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_config_file_is_named(tmp_path, capsys):
    secret = tmp_path / "secret.toml"
    secret.write_text("rounds = 3\n")
    secret.chmod(0)
    assert cli.main(["config", str(secret)]) == 2
    assert capsys.readouterr().err.startswith(f"driftlab: error: cannot read {secret}: Permission denied")


@pytest.mark.slow
def test_an_unexpected_error_in_a_real_process_has_no_traceback(tmp_path):
    """The installed entry point, end to end: the handler is what `python -m driftlab.cli` runs."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    code = "import sys; from driftlab import cli; cli._dispatch = lambda args: [][1]; sys.exit(cli.main())"
    result = subprocess.run(
        [sys.executable, "-c", code, "presets"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and result.stderr.startswith(
        "driftlab: error: IndexError: list index out of range\n"
    )
    (log,) = tmp_path.glob("driftlab-error-*.log")
    assert "Traceback" in log.read_text()


# ------------------------------------------------------------------ progress labels


@pytest.mark.slow
def test_demo_progress_is_one_line_per_run_with_the_demo_labels(tmp_path):
    from driftlab.experiments.run.demo import DEMO_RUNS

    result = driftlab_cli("demo", "rounds=2", "client.epochs=none", "client.steps=1", "--out", tmp_path / "demo")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert [line.split(":")[0] for line in lines] == [label for label, _ in DEMO_RUNS]
    assert all(re.fullmatch(r"[\w-]+: 2 rounds, final accuracy \d\.\d{3}, \d+\.\d s", line) for line in lines), lines
    assert "\r" not in result.stderr


# Run in a child interpreter where `import torch` fails: what succeeds there never imported it.
TORCH_BLOCKED = "import sys; sys.modules['torch'] = None; from driftlab.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.slow
def test_report_status_and_help_import_no_torch(tmp_path):
    sweep = tmp_path / "sweep"
    assert (
        driftlab_cli(
            "run", "synthetic-fedavg", *TINY, "--out", sweep / "runs" / "fedavg" / "seed-0", "--quiet"
        ).returncode
        == 0
    )
    planned = [
        {"dir": f"runs/fedavg/seed-{seed}", "setting": "", "method": "FedAvg", "seed": seed, "overrides": []}
        for seed in (0, 1)
    ]
    (sweep / "sweep.json").write_text(
        json.dumps({"format": 1, "name": "s", "base": "synthetic-fedavg", "rounds": [2], "runs": planned})
    )
    here = driftlab_cli("report", sweep, "--out", tmp_path / "here")
    assert here.returncode == 0, here.stderr

    def blocked(*args: object) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", TORCH_BLOCKED, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )

    report = blocked("report", sweep, "--out", tmp_path / "blocked")
    assert report.returncode == 0, report.stderr
    assert report.stdout == here.stdout.replace(str(tmp_path / "here"), str(tmp_path / "blocked"))
    written = sorted(path.name for path in (tmp_path / "here").iterdir())
    assert "report.md" in written and any(name.endswith(".png") for name in written)
    assert sorted(path.name for path in (tmp_path / "blocked").iterdir()) == written
    for name in written:
        assert (tmp_path / "blocked" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name
    status = blocked("sweep", "--status", sweep)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[:2] == [
        "done         runs/fedavg/seed-0  2/2 rounds",
        "queued       runs/fedavg/seed-1  0/2 rounds",
    ]
    help_text = blocked("--help")
    assert help_text.returncode == 0 and "report" in help_text.stdout, help_text.stderr
    # the block is real: listing the config keys (`driftlab config`) imports the config module, and so torch
    assert "torch" in blocked("config").stderr


def _hold_directory(run_dir: Path) -> subprocess.Popen:
    """Another live process holding ``run_dir`` as a run holds it (its .lock, flocked, with its pid), until stopped."""
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "handle = open(sys.argv[1], 'a+'); fcntl.flock(handle, fcntl.LOCK_EX); handle.write(f'{os.getpid()}\\n'); handle.flush()\n"
            "print('held', flush=True); time.sleep(300)",
            str(run_dir / ".lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_sweep_whose_runs_another_process_holds_exits_4_and_never_says_finished(tmp_path):
    # As after a SIGKILLed `--executor slurm --slurm-local` sweep, whose jobs go on: the rerun runs nothing there.
    from driftlab.experiments.sweep.execution import SWEEP_NAMES
    from driftlab.owned_folder import claim

    out = tmp_path / "sweep"
    claim(
        out, SWEEP_NAMES, "driftlab sweep"
    )  # what the killed sweep wrote first: its runs/ is driftlab's, not a user's
    holders = [_hold_directory(out / "runs" / name / "seed-0") for name in ("mu-0", "mu-1")]
    try:
        result = driftlab_cli("sweep", "synthetic-fedprox", "--grid", "algorithm.mu=[0, 1]", *TINY, "--out", out)
        assert result.returncode == cli.EXIT_RUNS_HELD == 4, result.stderr
        assert "sweep finished" not in result.stdout + result.stderr
        assert "sweep not finished: 2 running" in result.stderr
        for holder, name in zip(holders, ("mu-0", "mu-1"), strict=True):
            assert (
                f"running: runs/{name}/seed-0: running elsewhere (pid {holder.pid} holds its directory)"
                in result.stderr
            )
        assert "run the same command again" in result.stderr
        assert not (out / "report").exists()  # an unfinished sweep is not reported as if it were done
        assert sorted(os.listdir(out / "runs" / "mu-0" / "seed-0")) == [".lock"]  # nothing written beside the holder
        listed = driftlab_cli(
            "sweep", "synthetic-fedprox", "--grid", "algorithm.mu=[0, 1]", *TINY, "--out", out, "--dry-run"
        )
        assert [line.split()[:2] for line in listed.stdout.splitlines()] == [
            ["running", "runs/mu-0/seed-0"],
            ["running", "runs/mu-1/seed-0"],
        ]
    finally:
        for holder in holders:
            os.kill(holder.pid, 15)
            holder.wait(timeout=30)


def test_help_and_presets_import_no_torch_and_list_the_same_as_with_it():
    # `driftlab presets` reads the shipped files alone (driftlab.experiments.sweep.shipped): no torch, pydantic or numpy
    code = (
        "import sys, contextlib, io\nfrom driftlab.cli import main\n"
        "for argv in (['--help'], ['presets'], ['sweep', '--help'], ['report', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "heavy = sorted(name for name in ('torch', 'numpy', 'pydantic', 'matplotlib') if name in sys.modules)\n"
        "assert not heavy, heavy\n"
        "sys.exit(main(['presets']))"
    )
    import shutil

    columns = str(
        shutil.get_terminal_size((100, 24)).columns
    )  # descriptions wrap to the terminal: the same width in both
    env = {**os.environ, "COLUMNS": columns}
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env
    )
    assert child.returncode == 0, child.stderr
    from driftlab.experiments.sweep import load_sweep, sweep_names

    listed = driftlab_cli("presets").stdout
    assert child.stdout == listed
    for name in sweep_names():  # what the light reading prints is the description the sweep loader reads
        assert cli._wrapped(load_sweep(name).description) in listed, name


def test_main_gives_back_the_sigterm_handler_it_found(tmp_path):
    """run turns SIGTERM into KeyboardInterrupt while it works; after main, a SIGTERM is the caller's business again
    (a second one while the process exits must not print a traceback from its shutdown)."""
    import signal

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert cli.main(["run", "synthetic-fedavg", *TINY, "--out", str(tmp_path / "run"), "--quiet"]) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_resume_with_another_thread_count_says_so_in_one_line(tmp_path, capsys):
    import torch

    out = str(tmp_path / "run")
    threads = torch.get_num_threads()
    assert (
        cli.main(["run", "synthetic-fedavg", *TINY, "rounds=1", "keep_checkpoint=true", "--out", out, "--quiet"]) == 0
    )
    capsys.readouterr()
    torch.set_num_threads(threads + 1)
    try:
        assert cli.main(["run", "synthetic-fedavg", *TINY, "--out", out, "--resume", "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)
    error = capsys.readouterr().err
    assert error.startswith(
        f"driftlab: warning: resuming {out} at round 1 with {threads + 1} torch threads, where rounds up to it ran with {threads}"
    )
    assert error.count("\n") == 1 and "segments.py" not in error  # one line, without Python's source line
