"""`driftlab data list|describe|download` and the new data/model keys, run as a user runs them.

Most cases call the command's entry point in this process (its output captured,
the environment and working directory set as for a subprocess) so that no
interpreter starts per case; a few run a real ``python -m driftlab.cli``.

Nothing here touches the network: `driftlab data download` is only called
with names it refuses before any connection is made.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from driftlab.data.download import NOT_DOWNLOADABLE, dataset_names
from driftlab.experiments import cli_test
from driftlab.experiments.config import PARTITIONS
from driftlab.experiments.run.datasets import DATA_SETS
from driftlab.experiments.run.datasets_test import write_leaf, write_mnist
from driftlab.experiments.run.real_data import needs_real_data, real_data_path
from driftlab.models import MODEL_NAMES

PRESET = "synthetic-fedavg"

NEW_KEYS = (
    "data.root",
    "data.partition",
    "data.quotas",
    "data.lognormal_sigma",
    "data.dirichlet_alpha",
    "data.min_client_size",
    "data.classes_per_client",
    "data.client_test_fraction",
    "data.feddyn_kind",
    "data.feddyn_heterogeneity",
    "data.quadratic_dimension",
    "data.max_clients",
    "data.samples_per_client",
    "data.min_samples_per_client",
    "data.vocabulary_size",
    "data.limit_per_class",
    "data.seed",
    "model.hidden",
    "model.rnn_hidden",
    "model.rnn_layers",
    "model.embedding_dim",
    "model.groups",
    "model.resnet_stem",
    "model.width",
)


def _no_run_written(out: Path) -> bool:
    """No metrics, checkpoint or model: at most the config (written first, so a killed run can resume) and the run's lock."""
    return not out.exists() or {p.name for p in out.iterdir()} <= {"config.json", ".lock"}


def driftlab_cli(
    *args: object, cwd: Path | None = None, home: Path | None = None, process: bool = False
) -> subprocess.CompletedProcess:
    """``driftlab ARGS`` without $DRIFTLAB_DATA (so the default data search is what is tested), optionally with another HOME."""
    env = {key: value for key, value in os.environ.items() if key != "DRIFTLAB_DATA"}
    if home is not None:
        env["HOME"] = str(home)
    return cli_test.driftlab_cli(*args, cwd=cwd, process=process, env=env)


def _no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr


def _describe_values(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^\s+(\w+): (.*)$", stdout, flags=re.MULTILINE))


# --------------------------------------------------------------------------- data list


@pytest.mark.slow
def test_data_list_names_every_data_set_partition_and_model():
    result = driftlab_cli("data", "list", process=True)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    listed = re.findall(r"^  (\w+)\s", out.split("partitions")[0], flags=re.MULTILINE)
    assert listed == list(DATA_SETS)
    partitions_line = next(line for line in out.splitlines() if line.startswith("partitions"))
    assert partitions_line.split(": ", 1)[1].split(", ") == list(PARTITIONS)
    models_line = next(line for line in out.splitlines() if line.startswith("models"))
    assert models_line.split(": ", 1)[1].split(", ") == list(MODEL_NAMES)
    downloadable = next(line for line in out.splitlines() if line.startswith("downloadable"))
    assert all(name in downloadable for name in dataset_names())
    for name in NOT_DOWNLOADABLE:
        assert f"  {name}: " in out
    for info in DATA_SETS.values():
        if info.location:
            assert info.location in out


def test_data_list_marks_what_is_on_disk_and_where_it_looked(tmp_path, monkeypatch, capsys):
    from driftlab import cli

    data = tmp_path / "data"
    write_mnist(data / "mnist", n_train=10, n_test=5)
    monkeypatch.setenv("DRIFTLAB_DATA", str(data))
    assert cli.main(["data", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    marks = {}
    for previous, line in itertools.pairwise(lines):
        if line.strip().startswith("["):
            marks[previous.split()[0]] = line.strip()
    assert set(marks) == {name for name, info in DATA_SETS.items() if info.location}
    assert marks["mnist"] == f"[present: {data / 'mnist'}]"
    assert marks["fashion_mnist"] == f"[missing: looked in {data / 'fashion-mnist'}]"
    assert "generated" not in marks  # generated data sets need no files


def test_missing_default_files_name_where_driftlab_looked_and_every_fix(tmp_path):
    result = driftlab_cli("data", "describe", PRESET, "data.name=fashion_mnist", cwd=tmp_path)
    assert result.returncode == 2
    _no_traceback(result)
    message = result.stderr
    assert (
        f"looked in {tmp_path / 'shared' / 'data' / 'fashion-mnist'}, {tmp_path.parent / 'shared' / 'data' / 'fashion-mnist'}"
        in message
    )
    for fix in ("data.root=PATH", "DRIFTLAB_DATA=DIR", "driftlab data download fashion_mnist --to DIR"):
        assert fix in message


# --------------------------------------------------------------------------- data describe


def test_data_describe_synthetic_prints_clients_and_samples_per_client():
    result = driftlab_cli("data", "describe", PRESET, "data.num_clients=5", "data.seed=3")
    assert result.returncode == 0, result.stderr
    assert "files: generated" in result.stdout
    values = _describe_values(result.stdout)
    assert values["clients"] == "5"
    assert (
        int(values["samples_per_client_min"])
        <= float(values["samples_per_client_median"])
        <= int(values["samples_per_client_max"])
    )
    assert {"train_samples", "test_samples", "classes_for_80_percent_median"} <= values.keys()


def _describe_mnist_files(folder: Path, *overrides: str, n_train: int = 40) -> tuple[Path, subprocess.CompletedProcess]:
    """``driftlab data describe`` of PRESET on MNIST files of ``n_train`` and 20 test images written in ``folder``."""
    root = write_mnist(folder / "mnist", n_train=n_train, n_test=20)
    return root, driftlab_cli("data", "describe", PRESET, "data.name=mnist", f"data.root={root}", *overrides)


def test_data_describe_a_dirichlet_partition_of_mnist_files(tmp_path):
    root, result = _describe_mnist_files(
        tmp_path, "data.partition=dirichlet", "data.dirichlet_alpha=0.1", "data.num_clients=4", n_train=100
    )
    assert result.returncode == 0, result.stderr
    assert f"files: {root}" in result.stdout
    values = _describe_values(result.stdout)
    assert values["clients"] == "4" and values["train_samples"] == "100" and values["test_samples"] == "20"
    assert values["samples_per_client_min"] == values["samples_per_client_max"] == "25"  # balanced quotas
    assert int(values["classes_for_80_percent_max"]) <= 8


@needs_real_data("mnist")
def test_data_describe_real_mnist_with_a_dirichlet_partition():
    real = real_data_path("mnist")  # given as data.root: driftlab_cli leaves $DRIFTLAB_DATA out
    result = driftlab_cli(
        "data", "describe", "mnist-fedavg", f"data.root={real}", "data.partition=dirichlet", "data.dirichlet_alpha=0.3"
    )
    assert result.returncode == 0, result.stderr
    values = _describe_values(result.stdout)
    assert values["clients"] == "100" and values["train_samples"] == "60000" and values["test_samples"] == "10000"
    assert values["samples_per_client_min"] == values["samples_per_client_max"] == "600"
    # FedDyn reports about 3 classes holding 80% of a client's data at Dirichlet 0.3
    assert 2 <= float(values["classes_for_80_percent_median"]) <= 5


def test_data_describe_a_natural_data_set(tmp_path):
    root = write_leaf(tmp_path / "femnist", "femnist", num_users=3)
    result = driftlab_cli("data", "describe", PRESET, "data.name=femnist", f"data.root={root}")
    assert result.returncode == 0, result.stderr
    values = _describe_values(result.stdout)
    assert (
        values["clients"] == "3"
        and values["samples_per_client_min"] == "6"
        and values["samples_per_client_max"] == "10"
    )


def test_data_describe_missing_files_is_a_clean_error(tmp_path):
    missing = tmp_path / "nowhere"
    result = driftlab_cli("data", "describe", PRESET, "data.name=cifar100", f"data.root={missing}")
    assert result.returncode == 2
    _no_traceback(result)
    assert result.stderr.startswith("driftlab: error: ")
    assert (
        str(missing) in result.stderr
        and "cifar100" in result.stderr
        and "driftlab data download cifar100" in result.stderr
    )


def test_data_describe_natural_partition_of_pooled_data_is_a_clean_error(tmp_path):
    root = write_mnist(tmp_path / "mnist")
    result = driftlab_cli("data", "describe", PRESET, "data.name=mnist", f"data.root={root}", "data.partition=natural")
    assert result.returncode == 2
    _no_traceback(result)
    assert "natural" in result.stderr and "mnist" in result.stderr


def test_data_describe_unknown_data_set_lists_the_valid_names():
    result = driftlab_cli("data", "describe", PRESET, "data.name=imagenet")
    assert result.returncode == 2
    _no_traceback(result)
    assert "data.name" in result.stderr and "cifar10_folder" in result.stderr


def test_data_describe_test_samples_is_the_global_test_set_with_client_splits(tmp_path):
    _, result = _describe_mnist_files(tmp_path, "data.num_clients=4", "data.client_test_fraction=0.2")
    assert result.returncode == 0, result.stderr
    values = _describe_values(result.stdout)
    assert values["train_samples"] == "32"
    assert values["test_samples"] == "20"


def test_too_many_clients_for_the_data_is_a_clean_error(tmp_path):
    _, result = _describe_mnist_files(tmp_path, "data.num_clients=400")
    assert result.returncode == 2
    _no_traceback(result)
    assert "num_clients" in result.stderr


# --------------------------------------------------------------------------- data download (refusals only: no network)


def test_data_download_unknown_name_names_the_valid_ones(tmp_path):
    to = tmp_path / "dl"
    result = driftlab_cli("data", "download", "no_such_data", "--to", to)
    assert result.returncode != 0
    _no_traceback(result)
    assert "no_such_data" in result.stderr
    for name in dataset_names():
        assert name in result.stderr
    assert not to.exists()


@pytest.mark.parametrize("name", sorted(NOT_DOWNLOADABLE))
def test_data_download_of_a_leaf_data_set_explains_why_not(tmp_path, name):
    result = driftlab_cli("data", "download", name, "--to", tmp_path / "dl")
    assert result.returncode != 0
    _no_traceback(result)
    assert "LEAF" in result.stderr and "preprocess.sh" in result.stderr
    assert not (tmp_path / "dl").exists()


def test_data_download_needs_a_destination():
    result = driftlab_cli("data", "download", "mnist")
    assert result.returncode == 2 and "--to" in result.stderr


# --------------------------------------------------------------------------- the keys in the help texts


def _listed_keys(text: str) -> set[str]:
    keys = set()
    for line in text.splitlines():
        key = re.match(r"^\s+((?:\w+\.)*\w+) = ", line)
        if key:
            keys.add(key.group(1))
    return keys


def test_driftlab_config_lists_the_new_keys():
    result = driftlab_cli("config")
    assert result.returncode == 0, result.stderr
    listed = _listed_keys(result.stdout)
    assert set(NEW_KEYS) <= listed, set(NEW_KEYS) - listed
    for name in ("cifar10_folder", "dirichlet_classwise", "resnet18_gn"):
        assert name in result.stdout


def test_the_key_descriptions_list_the_new_keys():
    from driftlab.experiments.config import describe_keys

    listed = _listed_keys(describe_keys())
    assert set(NEW_KEYS) <= listed, set(NEW_KEYS) - listed


def test_config_resolves_the_new_keys():
    result = driftlab_cli(
        "config",
        PRESET,
        "data.name=cifar10",
        "data.partition=dirichlet_classwise",
        "model.name=resnet18_gn",
        "model.width=8",
        "model.resnet_stem=imagenet",
    )
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["data"]["partition"] == "dirichlet_classwise" and resolved["data"]["name"] == "cifar10"
    assert resolved["model"]["width"] == 8 and resolved["model"]["resnet_stem"] == "imagenet"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("data.partition=shards", "data.partition"),
        ("model.resnet_stem=tiny", "model.resnet_stem"),
        ("data.client_test_fraction=1.0", "data.client_test_fraction"),
    ],
)
def test_bad_values_of_the_new_keys_are_refused(override, fragment):
    result = driftlab_cli("config", PRESET, override)
    assert result.returncode == 2
    _no_traceback(result)
    assert fragment in result.stderr


# --------------------------------------------------------------------------- driftlab run on files


@pytest.mark.slow
def test_run_on_tiny_mnist_files_with_client_test_splits(tmp_path):
    root = write_mnist(tmp_path / "mnist", n_train=40, n_test=20)
    out = tmp_path / "run"
    result = driftlab_cli(
        "run",
        PRESET,
        "data.name=mnist",
        f"data.root={root}",
        "data.num_clients=4",
        "data.partition=classes_per_client",
        "data.client_test_fraction=0.25",
        "rounds=1",
        "client.epochs=none",
        "client.steps=1",
        "sampling.participation=0.5",
        "--out",
        out,
        "--quiet",
        process=True,
    )
    assert result.returncode == 0, result.stderr
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= record["test_accuracy"] <= 1.0 and 0.0 <= record["client_test_accuracy_mean"] <= 1.0
    config = json.loads((out / "config.json").read_text())
    assert config["data"]["root"] == str(root) and config["data"]["client_test_fraction"] == 0.25


def test_run_with_missing_files_writes_nothing(tmp_path):
    out = tmp_path / "run"
    missing = tmp_path / "no-mnist"
    result = driftlab_cli("run", "mnist-fedavg", f"data.root={missing}", "--out", out, "--quiet")
    assert result.returncode == 2
    _no_traceback(result)
    assert str(missing) in result.stderr and "driftlab data download mnist" in result.stderr
    assert _no_run_written(out)


def test_run_with_unreadable_files_writes_nothing(tmp_path):
    root = write_mnist(tmp_path / "mnist")
    (root / "t10k-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b truncated")
    out = tmp_path / "run"
    result = driftlab_cli("run", "mnist-fedavg", f"data.root={root}", "--out", out, "--quiet")
    assert result.returncode == 2
    _no_traceback(result)
    assert "t10k-images-idx3-ubyte.gz" in result.stderr
    assert _no_run_written(out)


def test_data_root_with_a_tilde_as_the_download_help_suggests(tmp_path):
    write_mnist(tmp_path / "home" / "data" / "mnist", n_train=200, n_test=20)
    result = driftlab_cli("data", "describe", "mnist-fedavg", "data.root=~/data/mnist", home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert _describe_values(result.stdout)["clients"] == "100"
