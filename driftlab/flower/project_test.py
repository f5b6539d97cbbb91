"""`driftlab flower new` and `driftlab flower check`: the project written, what is refused, the exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from driftlab import cli
from driftlab.experiments.config import load_config
from driftlab.extras import install_hint
from driftlab.flower import project

TINY = """\
seed = 0
rounds = 2

[data]
name = "synthetic"
num_clients = 4

[model]
name = "mlp"
hidden = [8]

[algorithm]
name = "scaffold"

[client]
lr = 0.05
batch_size = 10
steps = 3

[sampling]
participation = 0.5
"""


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


@pytest.fixture
def with_flower(monkeypatch):
    """`driftlab flower` as if Flower were installed (writing a project needs no flwr)."""
    monkeypatch.setattr(project, "flower_installed", lambda: True)


def test_new_writes_a_flower_app_project_of_the_resolved_config(tmp_path, tiny, with_flower, capsys):
    directory = tmp_path / "app"
    assert cli.main(["flower", "new", str(directory), "--config", str(tiny)]) == 0
    written = sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())
    assert written == [
        ".driftlab-written.json",
        "README.md",
        "driftlab_app/__init__.py",
        "driftlab_app/apps.py",
        "driftlab_app/driftlab_config.json",
        "pyproject.toml",
    ]
    pyproject = tomllib.loads((directory / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == "app"
    # flwr 1.41 reads [tool.flwr.app] fab-include (flwr/cli/build.py), whose patterns must each match a file when the
    # app is built: only the app goes into the FAB, never the runs, reports and node states the README puts beside it.
    assert pyproject["tool"]["flwr"]["app"]["fab-include"] == ["pyproject.toml", "README.md", "driftlab_app/**"]
    assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in (directory / "README.md").read_text()
    assert pyproject["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "driftlab_app.apps:server",
        "clientapp": "driftlab_app.apps:client",
    }
    run_config = pyproject["tool"]["flwr"]["app"]["config"]
    assert run_config["out-dir"] == str((directory / "run").resolve())
    assert run_config["resume"] is False and run_config["train-timeout"] > 0
    from driftlab.experiments.config import load_config

    copied = json.loads((directory / "driftlab_app" / "driftlab_config.json").read_text())
    assert copied == load_config(tiny).to_dict()
    apps = (directory / "driftlab_app" / "apps.py").read_text()
    assert "server = server_app(CONFIG)" in apps and "client = client_app(CONFIG, load=load_client_data)" in apps
    compile(apps, "apps.py", "exec")
    readme = (directory / "README.md").read_text()
    assert (
        "flower-superlink --insecure" in readme
        and "flwr run . loopback --stream" in readme
        and "--root-certificates" in readme
    )
    assert "pyproject.toml" in capsys.readouterr().out


def test_new_refuses_a_users_file_of_a_project_name_and_leaves_it_alone_until_forced(
    tmp_path, tiny, with_flower, capsys
):
    directory = tmp_path / "mine"
    directory.mkdir()
    (directory / "pyproject.toml").write_text("# the user's own\n")
    assert cli.main(["flower", "new", str(directory), "--config", str(tiny)]) == 2
    assert capsys.readouterr().err == (
        f"driftlab: error: {directory} already holds pyproject.toml, not written by driftlab (or changed since); nothing was "
        "written: choose another DIR, or pass --force to replace it\n"
    )
    assert (directory / "pyproject.toml").read_text() == "# the user's own\n"
    assert [path.name for path in directory.iterdir()] == ["pyproject.toml"]
    assert cli.main(["flower", "new", str(directory), "--config", str(tiny), "--force"]) == 0
    assert tomllib.loads((directory / "pyproject.toml").read_text())["project"]["name"] == "mine"


def test_new_again_rewrites_its_own_project_but_never_a_file_the_user_edited(tmp_path, tiny, with_flower, capsys):
    directory = tmp_path / "app"
    assert cli.main(["flower", "new", str(directory), "--config", str(tiny)]) == 0
    (directory / "run").mkdir()  # what the app writes beside the project, and the user's own files, are never touched
    (directory / "run" / "metrics.jsonl").write_text("{}\n")
    (directory / "notes.md").write_text("mine")
    assert cli.main(["flower", "new", str(directory), "--config", "synthetic-fedavg"]) == 0  # unchanged files: replaced
    assert (
        json.loads((directory / "driftlab_app" / "driftlab_config.json").read_text())["algorithm"]["name"] == "fedavg"
    )
    apps = directory / "driftlab_app" / "apps.py"
    apps.write_text(apps.read_text() + "\n# the user's load_client_data\n")
    edited = apps.read_bytes()
    assert cli.main(["flower", "new", str(directory), "--config", str(tiny)]) == 2
    assert (
        f"{directory} already holds driftlab_app/apps.py, not written by driftlab (or changed since)"
        in capsys.readouterr().err
    )
    assert apps.read_bytes() == edited and (directory / "notes.md").read_text() == "mine"
    assert (directory / "run" / "metrics.jsonl").read_text() == "{}\n"


def test_new_refuses_a_file_and_an_unknown_config(tmp_path, tiny, with_flower, capsys):
    target = tmp_path / "a-file"
    target.write_text("x")
    assert cli.main(["flower", "new", str(target), "--config", str(tiny)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert cli.main(["flower", "new", str(tmp_path / "app"), "--config", "no-such-preset"]) == 2
    assert "no-such-preset" in capsys.readouterr().err
    assert not (tmp_path / "app").exists()


def test_new_and_check_refuse_a_config_a_deployment_cannot_run_before_writing_or_running(
    tmp_path, with_flower, monkeypatch, capsys
):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        TINY.replace('name = "scaffold"', 'name = "feddyn"') + '\n[evaluation]\nmodel = "all_clients_mean"\n'
    )
    assert cli.main(["flower", "new", str(tmp_path / "app"), "--config", str(bad)]) == 2
    assert 'set evaluation.model = "server"' in capsys.readouterr().err
    assert not (tmp_path / "app").exists()
    from driftlab.experiments.run import runner

    monkeypatch.setattr(runner, "run", lambda *args, **kwargs: pytest.fail("flower check ran an undeployable config"))
    assert cli.main(["flower", "check", str(bad), "--rounds", "1", "--keep", str(tmp_path / "kept")]) == 2
    assert f"the server's model: driftlab flower check {bad} evaluation.model=server" in capsys.readouterr().err
    assert not (tmp_path / "kept").exists()


def test_the_flower_new_help_example_runs(tmp_path, with_flower, capsys):
    with pytest.raises(SystemExit):
        cli.main(["flower", "new", "--help"])
    example = capsys.readouterr().out
    assert "driftlab config synthetic-fedavg algorithm.name=scaffold --toml > scaffold.toml" in " ".join(
        example.split()
    )
    assert cli.main(["config", "synthetic-fedavg", "algorithm.name=scaffold", "--toml"]) == 0
    (tmp_path / "scaffold.toml").write_text(capsys.readouterr().out)
    assert cli.main(["flower", "new", str(tmp_path / "scaffold-app"), "--config", str(tmp_path / "scaffold.toml")]) == 0
    assert (tmp_path / "scaffold-app" / "driftlab_app" / "apps.py").exists()


def test_without_flower_the_command_says_how_to_install_it(tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.setattr(project, "flower_installed", lambda: False)
    assert cli.main(["flower", "new", str(tmp_path / "app"), "--config", str(tiny)]) == 2
    assert install_hint("flower") in capsys.readouterr().err
    assert cli.main(["flower", "check", str(tiny), "--rounds", "1"]) == 2
    assert install_hint("flower") in capsys.readouterr().err
    assert not (tmp_path / "app").exists()


def test_help_imports_neither_torch_nor_flower():
    code = (
        "import sys, contextlib, io\n"
        "from driftlab import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['flower', 'check', '--help'])\n"
        "print(sorted(m for m in ('torch', 'flwr') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


def test_check_exits_1_and_says_so_when_the_models_differ(tiny, with_flower, monkeypatch, capsys):
    pytest.importorskip("flwr")
    import torch
    from safetensors.torch import save_file

    from driftlab.flower import apps

    def simulate_off_by_one_ulp(config, out, *, num_nodes, state_dir, **_):
        import driftlab

        params = driftlab.run(config).final_params
        Path(out).mkdir(parents=True)
        save_file(
            {"params": torch.nextafter(params, torch.full_like(params, float("inf")))},
            str(Path(out) / "final_model.safetensors"),
        )

    monkeypatch.setattr(apps, "simulate", simulate_off_by_one_ulp)
    assert cli.main(["flower", "check", str(tiny), "--rounds", "1"]) == 1
    assert "DIFFERENT (largest difference" in capsys.readouterr().out


CHECK_SECONDS = 300  # a hard limit: Flower's simulation engine must not hang the test run


@pytest.mark.slow
def test_check_runs_the_simulation_engine_and_finds_the_models_equal(tmp_path, tiny):
    pytest.importorskip("flwr")
    keep = tmp_path / "flower-run"
    switches = {
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_AUTH_MODE": "disabled",
    }
    arguments = ["flower", "check", str(tiny), "--rounds", "2", "--nodes", "2", "--keep", str(keep)]
    code = f"import sys\nfrom driftlab import cli\nsys.exit(cli.main({arguments!r}))\n"
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=CHECK_SECONDS,
            env={**os.environ, **switches},
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(
            f"driftlab flower check did not finish within {CHECK_SECONDS} s\n{expired.stdout}\n{expired.stderr}"
        )
    out = result.stdout
    assert (
        "after 2 rounds, the final model of Flower's simulation engine (2 nodes)" in out and "equal bit for bit" in out
    ), result.stderr
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["round"] for line in (keep / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert f"driftlab: run complete: 2 rounds in {keep}" in out  # kept: named; a temporary one is not (_check_log)
    # Flower's actors log "Manually terminating ClientAppActor" (a yellow WARNING) at every normal shutdown; Ray
    # forwards it only when the driver is still reading then, so it comes and goes with timing: not a notice to act on.
    shown = "\n".join(
        line for line in (out + result.stderr).splitlines() if "Manually terminating ClientAppActor" not in line
    )
    assert "DEPRECATED FEATURE" not in shown and "\x1b[93m" not in shown


def test_check_refuses_bad_rounds_nodes_and_a_used_keep_directory_before_running(tmp_path, tiny, with_flower, capsys):
    assert cli.main(["flower", "check", str(tiny), "--rounds", "0"]) == 2
    assert "--rounds 0: give at least 1 round" in capsys.readouterr().err
    assert cli.main(["flower", "check", str(tiny), "--nodes", "5"]) == 2
    assert "--nodes 5: give between 1 and the config's 4 clients" in capsys.readouterr().err
    keep = tmp_path / "kept"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    assert cli.main(["flower", "check", str(tiny), "--keep", str(keep)]) == 2
    assert f"--keep {keep}: give a new or empty directory" in capsys.readouterr().err
    assert (keep / "notes.txt").read_text() == "mine" and len(list(keep.iterdir())) == 1


def test_check_takes_overrides_like_run(tmp_path, tiny, with_flower, monkeypatch, capsys):
    pytest.importorskip("flwr")
    from safetensors.torch import save_file

    from driftlab.flower import apps

    seen = []

    def simulate_exactly(config, out, *, num_nodes, state_dir, **_):
        import driftlab

        seen.append((config.client.lr, config.rounds, config.backend))
        Path(out).mkdir(parents=True)
        save_file({"params": driftlab.run(config).final_params}, str(Path(out) / "final_model.safetensors"))

    monkeypatch.setattr(apps, "simulate", simulate_exactly)
    assert (
        cli.main(["flower", "check", str(tiny), "client.lr=0.07", "--rounds", "1", "sampling.participation=1.0"]) == 0
    )
    assert seen == [(0.07, 1, "sequential")]
    assert "equal bit for bit" in capsys.readouterr().out


def test_check_refuses_a_mean_of_client_models_before_running_with_the_command_that_fixes_it(
    tiny, with_flower, monkeypatch, capsys
):
    from driftlab.flower import project as flower_project

    monkeypatch.setattr(
        "driftlab.experiments.run.runner.run", lambda *a, **k: pytest.fail("ran although the config is refused")
    )
    assert cli.main(["flower", "check", str(tiny), "evaluation.model=all_clients_mean", "client.lr=0.07"]) == 2
    error = capsys.readouterr().err
    assert (
        f'{tiny} sets evaluation.model = "all_clients_mean", a mean of client models, which a deployment\'s server never receives'
        in error
    )
    assert (
        f"check the deployment with the server's model: driftlab flower check {tiny} client.lr=0.07 evaluation.model=server"
        in error
    )
    assert flower_project.refusal(load_config(str(tiny)), "tiny") is None


def test_a_check_without_keep_does_not_name_its_temporary_run_directory(capsys):
    from driftlab.flower.project import _check_log

    _check_log(temporary=True)("run complete: 2 rounds in /tmp/driftlab-flower-check-x/flower-run")
    _check_log(temporary=False)("run complete: 2 rounds in kept")
    _check_log(temporary=True)("round 2: client 1 inactive: no reply")
    assert capsys.readouterr().out.splitlines() == [
        "driftlab: run complete: 2 rounds (in a temporary directory removed when the check ends; --keep DIR keeps it for `driftlab report`)",
        "driftlab: run complete: 2 rounds in kept",
        "driftlab: round 2: client 1 inactive: no reply",
    ]
