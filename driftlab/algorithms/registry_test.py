"""The registry's entries, and plugins: registered from a config's `plugins`, an entry point or `run(algorithm=...)`,
imported in every process that reads a config (run, resume, sweep workers, report), and refused clearly when broken."""

from __future__ import annotations

import json
import shutil
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import driftlab
from driftlab import plugins
from driftlab.algorithms import AlgorithmEntry, fedavg, registry
from driftlab.experiments.cli_test import REPO_ROOT, driftlab_cli
from driftlab.experiments.config import describe_keys, load_config

EXAMPLE = REPO_ROOT / "examples" / "nesterov_plugin"
TINY = ["rounds=2", "data.num_clients=6", "client.epochs=1", "sampling.participation=0.5"]

# A plugin module: FedAvg whose aggregation is a hyperparameter of its own, registered with one call.
TOY_PLUGIN = """
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from driftlab.algorithms import AlgorithmEntry, fedavg, register


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["{name}"] = "{name}"
    flavour: Literal["weighted", "uniform"] = Field("uniform", description="the toy's aggregation")


def from_config(config, server_optimizer):
    return fedavg.build(server_optimizer, aggregation=config.flavour, incomplete="keep")


register(AlgorithmEntry("{name}", Config, from_config, label="{label}"))
"""


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as the built-ins leave it; whatever a test registers is gone afterwards."""
    # Only the built-ins: plugins imported earlier in this process (the examples' doctests) are left out too.
    built_ins = {name: registry.ALGORITHMS[name] for name in registry.BUILT_IN}
    monkeypatch.setattr(registry.REGISTRY, "entries", built_ins)
    monkeypatch.setattr(registry, "ALGORITHMS", built_ins)
    monkeypatch.setattr(plugins, "_loaded_paths", {})
    monkeypatch.setattr(registry.REGISTRY, "_entry_point_problems", [])  # no installed entry points in these tests
    return registry


def write_plugin(folder: Path, name: str, label: str = "Toy", file: str = "toy.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file
    path.write_text(TOY_PLUGIN.replace("{name}", name).replace("{label}", label))
    return path


def test_built_in_entries_hold_the_facts_the_runner_sweeps_reports_and_shared_tests_read():
    entries = registry.ALGORITHMS
    assert list(registry.BUILT_IN) == [
        "fedavg",
        "fedprox",
        "scaffold",
        "feddyn",
        "adabest",
        "efl",
        "fednova",
        "fedgate",
        "vrlsgd",
        "mimelite",
        "mime",
        "apfl",
        "ditto",
        "fedamp",
    ]
    assert [entries[name].label for name in registry.BUILT_IN] == [
        "FedAvg",
        "FedProx",
        "SCAFFOLD",
        "FedDyn",
        "AdaBest",
        "EFL",
        "FedNova",
        "FedGATE",
        "VRL-SGD",
        "MimeLite",
        "Mime",
        "APFL",
        "Ditto",
        "FedAMP",
    ]
    assert {name for name in registry.BUILT_IN if entries[name].owns_server_step} == {
        "feddyn",
        "adabest",
        "mimelite",
        "mime",
        "fedamp",
    }
    assert {name for name in registry.BUILT_IN if not entries[name].keeps_partial_work} == {
        "fedavg",
        "fedgate",
        "apfl",
        "ditto",
    }
    assert {name for name in registry.BUILT_IN if entries[name].needs_num_clients} == {"fedamp"}
    assert {
        name: entries[name].default_compression_ratio
        for name in registry.BUILT_IN
        if entries[name].default_compression_ratio != 1
    } == {"efl": 0.01}
    assert entries["fedavg"].module == "driftlab.algorithms.fedavg" and entries["fedavg"].config_type is fedavg.Config


def test_config_error_is_one_class_wherever_it_is_imported_from():
    from driftlab.errors import ConfigError
    from driftlab.experiments import config

    assert config.ConfigError is ConfigError is driftlab.ConfigError


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "Bad Name"}, "lower-case letters"),
        ({"name": "other"}, 'name: Literal\\["other"\\] = "other"'),
        ({"label": " "}, "label must be a non-empty string"),
        ({"default_compression_ratio": 0.0}, r"default_compression_ratio must be in \(0, 1\]"),
        ({"from_config": None}, "from_config must be a function"),
    ],
)
def test_an_entry_is_checked_when_it_is_made(change, message):
    fields = {
        "name": "fedavg",
        "config_type": fedavg.Config,
        "from_config": fedavg.from_config,
        "label": "FedAvg",
        **change,
    }
    with pytest.raises(ValueError, match=message):
        AlgorithmEntry(**fields)


def test_a_name_is_registered_once(fresh_registry):
    with pytest.raises(ValueError, match="'fedavg' is a built-in algorithm"):
        registry.register(AlgorithmEntry("fedavg", fedavg.Config, lambda config, optimizer: None, label="Mine"))
    entry = registry.ALGORITHMS["fedavg"]
    assert registry.register(entry) is entry  # the same entry again (a module imported twice) is fine


def test_a_plugin_file_relative_to_the_config_validates_runs_and_is_recorded(fresh_registry, tmp_path, monkeypatch):
    plugin = write_plugin(tmp_path / "project", "toy_relative", label="Toy relative")
    config_file = tmp_path / "project" / "experiment.toml"
    config_file.write_text(
        'plugins = ["toy.py"]\nrounds = 2\n[algorithm]\nname = "toy_relative"\nflavour = "weighted"\n'
    )
    monkeypatch.chdir(tmp_path)  # not the config's folder: the path is taken from the config file's
    config = load_config(config_file, TINY[1:])
    assert (config.algorithm.name, config.algorithm.flavour) == ("toy_relative", "weighted")
    assert config.plugins == (str(plugin.resolve()),)
    assert (
        load_config(None, ["plugins=project/toy.py", "algorithm.name=toy_relative"]).plugins == config.plugins
    )  # one, from cwd
    with pytest.raises(driftlab.ConfigError, match=r"algorithm\.flavour: Input should be 'weighted' or 'uniform'"):
        load_config(config_file, ["algorithm.flavour=median"])
    with pytest.raises(driftlab.ConfigError, match=r"algorithm\.mu: unknown key; valid keys here: name, flavour"):
        load_config(config_file, ["algorithm.mu=1"])
    assert f"[algorithm] when algorithm.name = 'toy_relative' (plugin {plugin.resolve()})" in describe_keys()
    assert '  algorithm.flavour = "uniform"\n      the toy\'s aggregation' in describe_keys()

    result = driftlab.run(config_file, tmp_path / "run", overrides=TINY[1:])
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["plugins"] == [str(plugin.resolve())]
    assert recorded["algorithm"] == {"name": "toy_relative", "flavour": "weighted"}
    # FedAvg with the same aggregation and partial-work rule gives the same numbers: the plugin is what ran
    same = driftlab.run(None, overrides=[*TINY, "algorithm.name=fedavg", "algorithm.incomplete=keep"])
    assert torch.equal(result.final_params, same.final_params)


def test_where_the_plugin_file_is_does_not_change_the_fingerprint(fresh_registry, tmp_path):
    first = write_plugin(tmp_path / "a", "toy_moved")
    plain = load_config(None, [*TINY, f"plugins=['{first}']", "algorithm.name=toy_moved"])
    assert load_config(None, TINY).to_dict().get("plugins") is None  # configs of built-ins read as before
    assert plain.fingerprint() == plain.model_copy(update={"plugins": ("/elsewhere/toy.py",)}).fingerprint()


def test_an_unknown_algorithm_says_how_to_add_one(fresh_registry):
    with pytest.raises(driftlab.ConfigError) as raised:
        load_config(None, ["algorithm.name=nesterov_avg"])
    message = str(raised.value)
    assert "algorithm: unknown algorithm 'nesterov_avg'; valid algorithms: fedavg, fedprox" in message
    assert 'plugins = ["my_algorithm.py"]' in message and "Writing a plugin" in message


def test_a_plugin_that_cannot_be_imported_stops_with_one_clear_line(fresh_registry, tmp_path):
    with pytest.raises(driftlab.ConfigError) as raised:
        load_config(None, ["plugins=['no_such_plugin_module']", "algorithm.name=toy"])
    assert str(raised.value) == (
        "plugins: cannot import plugin 'no_such_plugin_module': ModuleNotFoundError: No module named 'no_such_plugin_module'; "
        'install the package that provides it, or name its .py file instead (plugins = ["path/to/module.py"], relative to the config file)'
    )
    broken = tmp_path / "broken.py"
    broken.write_text("import driftlab\nraise RuntimeError('the plugin is broken\\nsecond line')\n")
    with pytest.raises(driftlab.ConfigError) as raised:
        load_config(None, [f"plugins=['{broken}']"])
    message = str(raised.value)
    assert message.startswith(
        f"plugins: cannot import plugin '{broken}': RuntimeError: the plugin is broken (raised at {broken.resolve()}, line 2); check the path"
    )
    assert "second line" not in message and "Traceback" not in message
    assert not any(
        name.startswith("driftlab_plugin_broken") for name in sys.modules
    )  # a failed import leaves nothing behind
    missing = tmp_path / "missing.py"
    with pytest.raises(
        driftlab.ConfigError, match=f"cannot import plugin '{missing}': FileNotFoundError: no such file"
    ):
        load_config(None, [f"plugins=['{missing}']"])


def test_the_cli_reports_a_broken_plugin_without_a_traceback(tmp_path):
    config_file = tmp_path / "experiment.toml"
    config_file.write_text('plugins = ["absent.py"]\n[algorithm]\nname = "absent_algorithm"\n')
    result = driftlab_cli("run", config_file, "--out", tmp_path / "out", *TINY)
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"driftlab: error: plugins: cannot import plugin '{tmp_path / 'absent.py'}': FileNotFoundError"
    )
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_driftlab_config_lists_the_keys_of_a_plugins_algorithm(fresh_registry, tmp_path):
    plugin = write_plugin(tmp_path, "toy_listed")
    listed = driftlab_cli("config", f"plugins=['{plugin}']")
    assert listed.returncode == 0, listed.stderr
    assert (
        f"[algorithm] when algorithm.name = 'toy_listed' (plugin {plugin.resolve()})\n  algorithm.name = \"toy_listed\""
        in listed.stdout
    )
    assert '  algorithm.flavour = "uniform"' in listed.stdout


def test_an_entry_point_registers_its_algorithm_and_a_broken_one_is_named(fresh_registry, tmp_path, monkeypatch):
    write_plugin(tmp_path, "toy_entry_point", file="toy_entry_point_module.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    points = [
        metadata.EntryPoint(name="toy", value="toy_entry_point_module", group=registry.ENTRY_POINT_GROUP),
        metadata.EntryPoint(name="gone", value="gone_module_of_a_package", group=registry.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(
        plugins.metadata, "entry_points", lambda group: points if group == registry.ENTRY_POINT_GROUP else []
    )
    monkeypatch.setattr(registry.REGISTRY, "_entry_point_problems", None)  # not read yet in this "process"
    assert load_config(None, ["algorithm.name=toy_entry_point"]).algorithm.flavour == "uniform"
    with pytest.raises(driftlab.ConfigError) as raised:
        load_config(None, ["algorithm.name=toy_missing"])
    valid = "fedavg, fedprox, scaffold, feddyn, adabest, efl, fednova, fedgate, vrlsgd, mimelite, mime, apfl, ditto, fedamp, toy_entry_point"
    assert f"valid algorithms: {valid}." in str(raised.value)
    assert "installed plugins that failed to load: entry point gone = 'gone_module_of_a_package'" in str(raised.value)
    monkeypatch.delitem(sys.modules, "toy_entry_point_module")


def test_an_algorithm_owning_its_server_step_refuses_a_server_optimizer():
    with pytest.raises(
        driftlab.ConfigError, match=r"server\.optimizer: adabest has its own server step .* use sgd \(got 'yogi'\)"
    ):
        load_config(None, ["algorithm.name=adabest", "server.optimizer=yogi"])


def test_run_takes_an_algorithm_entry_and_records_its_plugin(fresh_registry, tmp_path):
    plugin = write_plugin(tmp_path / "code", "toy_object", label="Toy object")
    config = load_config(None, [f"plugins=['{plugin}']", "algorithm.name=toy_object"])  # imports the file once
    entry = registry.ALGORITHMS["toy_object"]
    fresh_registry.ALGORITHMS.pop("toy_object")  # as if the entry had only been built in this script
    result = driftlab.run("synthetic-fedprox", tmp_path / "run", overrides=TINY, algorithm=entry)
    assert (
        result.config.algorithm.name == "toy_object" and result.config.algorithm.flavour == "uniform"
    )  # fedprox's mu dropped
    assert json.loads((tmp_path / "run" / "config.json").read_text())["plugins"] == [str(plugin.resolve())]
    assert config.plugins == (str(plugin.resolve()),)
    with pytest.raises(driftlab.ConfigError, match="algorithm= takes a driftlab.algorithms.AlgorithmEntry"):
        driftlab.run(None, overrides=TINY, algorithm=fedavg)


@pytest.mark.slow
def test_a_plugin_run_resumes_and_reports_in_fresh_interpreters(fresh_registry, tmp_path):
    plugin = write_plugin(tmp_path / "code", "toy_fresh", label="Toy fresh")
    out = tmp_path / "run"
    driftlab.run(
        None, out, overrides=[*TINY, f"plugins=['{plugin}']", "algorithm.name=toy_fresh", "checkpoint_every=1"]
    )
    resumed = driftlab_cli("run", out / "config.json", "--out", out, "--resume", "rounds=3", "--quiet", process=True)
    assert resumed.returncode == 0, resumed.stderr
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    report = driftlab_cli("report", out, "--out", tmp_path / "report", "--no-plots", process=True)
    assert report.returncode == 0, report.stderr
    assert "| Toy fresh |" in (tmp_path / "report" / "report.md").read_text()
    plugin.unlink()  # the plugin is gone: a resume says so, naming it; a report reads records only and never needed it
    again = driftlab_cli("run", out / "config.json", "--out", out, "--resume", "rounds=4", "--quiet", process=True)
    assert (
        again.returncode == 2
        and f"cannot import plugin '{plugin.resolve()}'" in again.stderr
        and "Traceback" not in again.stderr
    )
    report = driftlab_cli("report", out, "--out", tmp_path / "report2", "--no-plots", process=True)
    assert report.returncode == 0, report.stderr
    assert "| Toy fresh |" in (tmp_path / "report2" / "report.md").read_text()


@pytest.mark.slow
def test_the_nesterov_example_sweep_runs_resumes_and_reports_from_the_repository_root(tmp_path):
    """`driftlab sweep examples/nesterov_plugin/sweep.toml`: each run is a fresh interpreter, so a plugin that were
    not imported there would silently train plain FedAvg; the Nesterov runs must differ from FedAvg's."""
    out = tmp_path / "sweep"
    first = driftlab_cli(
        "sweep", EXAMPLE / "sweep.toml", "--out", out, "--jobs", "2", "rounds=6", cwd=REPO_ROOT, process=True
    )
    assert first.returncode == 0, first.stderr
    runs = {
        path.parent.parent.name + "/" + path.parent.name: path.parent
        for path in (out / "runs").glob("*/seed-*/metrics.jsonl")
    }
    assert sorted(runs) == ["fedavg/seed-0", "fedavg/seed-1", "nesterov-fedavg/seed-0", "nesterov-fedavg/seed-1"]
    for seed in (0, 1):
        fedavg_records = [
            json.loads(line) for line in (runs[f"fedavg/seed-{seed}"] / "metrics.jsonl").read_text().splitlines()
        ]
        nesterov_records = [
            json.loads(line)
            for line in (runs[f"nesterov-fedavg/seed-{seed}"] / "metrics.jsonl").read_text().splitlines()
        ]
        assert len(nesterov_records) == 6 and "momentum_norm" in nesterov_records[-1]
        assert nesterov_records[-1]["train_loss"] != fedavg_records[-1]["train_loss"]
        recorded = json.loads((runs[f"nesterov-fedavg/seed-{seed}"] / "config.json").read_text())
        assert recorded["algorithm"] == {"name": "nesterov_avg", "momentum": 0.5, "aggregation": "weighted"}
        assert recorded["plugins"] == [str((EXAMPLE / "nesterov_avg.py").resolve())]
    report = (out / "report" / "report.md").read_text()
    assert "| FedAvg | 2 |" in report and "| Nesterov FedAvg | 2 |" in report
    # Run again: nothing to do; raise rounds: every run resumes from its checkpoint, the plugin imported again.
    again = driftlab_cli(
        "sweep", EXAMPLE / "sweep.toml", "--out", out, "--jobs", "2", "rounds=6", cwd=REPO_ROOT, process=True
    )
    assert again.returncode == 0 and "4 already finished, 0 to run" in again.stdout
    longer = driftlab_cli(
        "sweep",
        EXAMPLE / "sweep.toml",
        "--out",
        out,
        "--jobs",
        "2",
        "rounds=8",
        "--no-report",
        cwd=REPO_ROOT,
        process=True,
    )
    assert longer.returncode == 0, longer.stderr
    resumed = [json.loads(line) for line in (runs["nesterov-fedavg/seed-0"] / "metrics.jsonl").read_text().splitlines()]
    assert [record["round"] for record in resumed] == list(range(1, 9)) and not list(out.rglob("failure.txt"))
    shutil.rmtree(out / "report")
    reported = driftlab_cli("report", out, "--out", out / "report", "--no-plots", cwd=tmp_path, process=True)
    assert reported.returncode == 0, reported.stderr
    assert "| Nesterov FedAvg | 2 |" in (out / "report" / "report.md").read_text()


def test_one_plugin_file_imported_as_a_module_and_by_its_path_registers_once(fresh_registry, tmp_path, monkeypatch):
    # The full test run imports examples/*.py for their doctests and again by path as plugins.
    import importlib

    path = write_plugin(tmp_path, "toy_twice", file="toy_twice_module.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("toy_twice_module")
    plugins.import_file(path)  # a second module object of the same file: the same algorithm, not a clash
    assert list(fresh_registry.ALGORITHMS).count("toy_twice") == 1
    other = write_plugin(tmp_path / "elsewhere", "toy_twice", file="toy_twice_module.py")
    with pytest.raises(ValueError, match="'toy_twice' is already registered"):
        plugins.import_file(other)  # another file under the same name still clashes
    monkeypatch.delitem(sys.modules, "toy_twice_module")
