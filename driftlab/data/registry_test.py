"""The data-set registry: entries checked when made, [data] validated by the named entry's config type, a data set
of your own from a plugin file named in the config, and configs (old config.json, presets) reading as they did."""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch

import driftlab
from driftlab import plugins
from driftlab.data import registry
from driftlab.data.builtins import QuadraticData, SyntheticData
from driftlab.data.registry import DataSection, DataSetEntry, Download
from driftlab.experiments.config import LEGACY_FLAT_DEFAULTS, describe_keys, load_config
from driftlab.experiments.run.compatibility import check_sizes
from driftlab.experiments.run.datasets import build_dataset, vocabulary_size

TINY = ["rounds=2", "data.num_clients=4", "client.epochs=1", "sampling.participation=1.0", "client.batch_size=8"]

# A plugin file: two Gaussian blobs, pooled (the partition deals them out), with a key of its own.
BLOBS_PLUGIN = """
from typing import Literal

import torch
from pydantic import Field

from driftlab.data.registry import DataSection, DataSetEntry, register


class TwoBlobs(DataSection):
    name: Literal["two_blobs"] = "two_blobs"
    separation: float = Field(2.0, gt=0, description="distance between the two blobs' means")


def load(section, seed, path):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(240) % 2
    inputs = torch.randn(240, 5, generator=generator) + section.separation * labels[:, None].float()
    return inputs[:200], labels[:200], inputs[200:], labels[200:]


register(DataSetEntry("two_blobs", TwoBlobs, load, "two Gaussian blobs, 5 features, 2 classes", num_classes=2,
                      size_estimate=lambda section: 1_000))
"""


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as the built-ins leave it; whatever a test registers is gone afterwards."""
    monkeypatch.setattr(plugins, "_loaded_paths", {})
    yield registry
    for name in [name for name in registry.REGISTRY.entries if name not in registry.REGISTRY.built_in]:
        del registry.REGISTRY.entries[name]


def test_built_in_entries_hold_what_the_loaders_the_download_command_and_the_memory_check_read():
    entries = registry.DATA_SETS
    assert list(registry.REGISTRY.built_in)[:5] == [
        "synthetic",
        "synthetic_iid",
        "feddyn_synthetic",
        "quadratic1d",
        "quadratic",
    ]
    assert registry.REGISTRY.built_in[-1] == "custom"
    assert {name for name, entry in entries.items() if entry.location is None} == {
        "synthetic",
        "synthetic_iid",
        "feddyn_synthetic",
        "quadratic1d",
        "quadratic",
        "custom",
    }
    assert entries["emnist_letters"].download.name == "emnist" and entries["cifar10_folder"].download is None
    assert sorted(registry.downloads()) == [
        "cifar10",
        "cifar100",
        "emnist",
        "fashion_mnist",
        "mnist",
        "shakespeare",
        "stackoverflow",
    ]
    # the memory check's bytes per client: FedProx devices capped by samples_per_client are 6,000 + 800 c bytes
    assert entries["synthetic"].size_estimate(SyntheticData(samples_per_client=10)) == 14_000
    assert entries["synthetic"].size_estimate(SyntheticData()) == 400_000
    assert entries["quadratic"].size_estimate(QuadraticData(quadratic_dimension=3)) == 24_000
    assert vocabulary_size(load_config(None, ["data.name=sent140", "data.vocabulary_size=77"]).data) == 77
    assert vocabulary_size(load_config(None, ["data.name=shakespeare_leaf"]).data) == 80
    assert entries["sent140"].own_keys == ["max_clients", "client_choice", "vocabulary_size"]
    with pytest.raises(ValueError, match="'mnist' is a built-in data set"):
        registry.register(DataSetEntry("mnist", entries["mnist"].config_type, lambda section, seed, path: None, "mine"))
    assert registry.register(entries["mnist"]) is entries["mnist"]  # the same entry again (a module imported twice)


def test_an_entry_is_checked_when_it_is_made():
    class Blobs(DataSection):
        name: Literal["blobs"] = "blobs"

    def load(section, seed, path):
        return None

    with pytest.raises(ValueError, match=r"config_type must subclass driftlab\.data\.registry\.DataSection"):
        DataSetEntry("blobs", dict, load, "blobs")
    with pytest.raises(ValueError, match=r'config_type needs the field `name: Literal\["other"\] = "other"`'):
        DataSetEntry("other", Blobs, load, "blobs")
    with pytest.raises(ValueError, match="lower-case letters"):
        DataSetEntry("Blobs", Blobs, load, "blobs")
    with pytest.raises(ValueError, match="location is its files' path below the data root"):
        DataSetEntry("blobs", Blobs, load, "blobs", location="/abs/blobs")
    with pytest.raises(ValueError, match="num_classes must be a positive integer"):
        DataSetEntry("blobs", Blobs, load, "blobs", num_classes=0)
    with pytest.raises(ValueError, match="description must be a non-empty string"):
        DataSetEntry("blobs", Blobs, load, " ")
    with pytest.raises(ValueError, match="files must be a non-empty tuple"):
        Download("blobs", ())


def test_a_plugin_data_set_is_named_validated_listed_and_trained(fresh_registry, tmp_path):
    plugin = tmp_path / "blobs.py"
    plugin.write_text(BLOBS_PLUGIN)
    config_file = tmp_path / "experiment.toml"
    config_file.write_text('plugins = ["blobs.py"]\n[data]\nname = "two_blobs"\nseparation = 3.0\npartition = "iid"\n')
    config = load_config(config_file, TINY)
    assert (config.data.name, config.data.separation, config.data.num_clients) == ("two_blobs", 3.0, 4)
    with pytest.raises(driftlab.ConfigError, match=r"data\.separation: Input should be greater than 0"):
        load_config(config_file, ["data.separation=0"])
    with pytest.raises(
        driftlab.ConfigError,
        match=r"data\.separaton: unknown key; valid keys here: name, root, .*; did you mean data\.separation\?",
    ):
        load_config(config_file, ["data.separaton=1"])
    with pytest.raises(
        driftlab.ConfigError, match=r"data\.separation is a key of two_blobs, not of data\.name = 'mnist'"
    ):
        load_config(config_file, ["data.name=mnist", "data.separation=3.0"])
    # switching the data set drops the old one's own keys and keeps the shared ones, as switching algorithms does
    switched = load_config(config_file, ["data.name=mnist"])
    assert (switched.data.name, switched.data.partition) == ("mnist", "iid") and not hasattr(
        switched.data, "separation"
    )
    assert f"[data] when data.name = 'two_blobs' (plugin {plugin.resolve()})" in describe_keys()
    assert "  data.separation = 2.0\n      distance between the two blobs' means" in describe_keys()
    # its key reaches the loader, its size estimate the memory check
    near, far = (build_dataset(load_config(config_file, [f"data.separation={s}"]).data, 0) for s in (1.0, 5.0))
    torch.testing.assert_close(
        far.train_inputs - near.train_inputs, 4.0 * near.train_targets[:, None].float().expand(-1, 5)
    )
    assert near.num_classes == 2 and near.num_clients == 30
    with pytest.raises(
        driftlab.ConfigError, match=r"data\.num_clients: two_blobs data for 1,000,000 clients \(about 1000 bytes each\)"
    ):
        check_sizes(load_config(config_file, ["data.num_clients=1000000"]), memory_bytes=100_000_000)

    result = driftlab.run(config_file, tmp_path / "run", overrides=TINY)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["plugins"] == [str(plugin.resolve())]
    assert recorded["data"]["separation"] == 3.0 and "synthetic_alpha" not in recorded["data"]
    assert result.records[-1]["round"] == 2 and result.records[-1]["test_accuracy"] > 0.6  # blobs 3σ apart: learnable
    # config.json reads back, its plugin imported from the path it records, with the fingerprint of the run
    assert load_config(tmp_path / "run" / "config.json").fingerprint() == config.fingerprint()


@pytest.mark.parametrize("name", registry.REGISTRY.built_in)
def test_an_old_config_json_with_every_flat_data_key_at_its_default_loads_for_every_data_set(name):
    flat = {**LEGACY_FLAT_DEFAULTS["data"], "name": name}
    config = load_config({"data": flat})
    assert config.data.name == name
    assert set(config.to_dict()["data"]) <= set(registry.DATA_SETS[name].config_type.model_fields)
    assert config.fingerprint() == load_config(None, [f"data.name={name}"]).fingerprint()


def test_a_key_of_another_data_set_is_refused_naming_the_data_sets_that_take_it():
    with pytest.raises(
        driftlab.ConfigError, match=r"data\.feddyn_kind is a key of feddyn_synthetic, not of data\.name = 'mnist'"
    ):
        load_config(None, ["data.name=mnist", "data.feddyn_kind=2"])
    with pytest.raises(
        driftlab.ConfigError,
        match=r"data\.quadratic_dimension is a key of quadratic, not of data\.name = 'quadratic1d'",
    ):
        load_config(None, ["data.name=quadratic1d", "data.quadratic_dimension=5"])
    with pytest.raises(
        driftlab.ConfigError,
        match=r"data\.max_clients is a key of femnist, shakespeare, shakespeare_leaf, stackoverflow, sent140",
    ):
        load_config(None, ["data.max_clients=5"])
    with pytest.raises(driftlab.ConfigError, match=r"data\.loader is a key of custom"):
        load_config(None, ["data.name=mnist", "data.loader=my_data:load"])
    with pytest.raises(
        driftlab.ConfigError, match=r"deals out examples by class, and quadratic's clients are objectives"
    ):
        load_config(None, ["data.name=quadratic", "data.partition=dirichlet"])
    # your own data takes data.partition: it deals out examples given without client ids (data that brings ids
    # refuses it when loaded, experiments/run/datasets_test.py)
    assert load_config(None, ["data.name=custom", "data.partition=dirichlet"]).data.partition == "dirichlet"
    with pytest.raises(
        driftlab.ConfigError, match=r"client\.num_clients: unknown key; .*did you mean data\.num_clients\?"
    ):
        load_config(None, ["client.num_clients=3"])


# Recorded with the flat [data] section, before it became a tagged union: configs keep their fingerprints, so
# their runs still resume.
PINNED_FINGERPRINTS = {
    ("synthetic-fedavg", ()): "78c71c838f8019a6",
    ("mnist-fedavg", ()): "6be9a5c5a2cd4c9a",
    ("cifar10-feddyn", ()): "09c71e7594b120e7",
    # The preset now keeps the paper's 2,000 + 400 windows per client (issue 29); its old data settings keep the old hash.
    ("shakespeare-feddyn", ("data.samples_per_client=2000", "data.client_test_fraction=0")): "5b3b2b2468ad1a02",
    ("quadratic-constant-k", ()): "eed311588efc7ee6",
    (None, ("data.name=synthetic", "data.synthetic_alpha=0.5", "data.samples_per_client=50")): "667b13456211baec",
    (None, ("data.name=stackoverflow", "data.tag_count=5", "data.vocabulary_size=100")): "2f5f1ee60a945d42",
    (None, ("data.name=custom", "data.loader=x.py:f")): "483bc30b3311ac8d",
}


@pytest.mark.parametrize(("source", "overrides"), list(PINNED_FINGERPRINTS))
def test_fingerprints_are_those_of_the_flat_data_section(source, overrides):
    assert load_config(source, list(overrides)).fingerprint() == PINNED_FINGERPRINTS[(source, overrides)]
