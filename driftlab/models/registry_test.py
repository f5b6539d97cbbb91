"""The model registry: entries checked on registration, [model] as a tagged union, and a plugin's model run end to end."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch import nn

import driftlab
from driftlab import plugins
from driftlab.errors import ConfigError
from driftlab.experiments.config import LEGACY_FLAT_DEFAULTS, describe_keys, load_config
from driftlab.models import MODEL_NAMES, ModelEntry, ModelSection, registry, zoo
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.stacked import StackedNetwork

# Fingerprints of shipped presets recorded before [model] became a tagged union: runs made then must still resume.
PINNED_FINGERPRINTS = {
    "cifar10-feddyn": "09c71e7594b120e7",
    "mnist-fedavg": "6be9a5c5a2cd4c9a",
    "quadratic-decaying-k": "dd27417c9e0465cc",
    "synthetic-fedavg": "78c71c838f8019a6",
}


class _Config(ModelSection):
    name: Literal["probe"] = "probe"


def _build(section, input_shape, num_classes):
    return nn.Linear(input_shape[0], num_classes)


def test_the_zoo_is_registered_in_its_table_order_as_built_ins():
    assert tuple(registry.names()[: len(MODEL_NAMES)]) == MODEL_NAMES == registry.REGISTRY.built_in
    assert registry.names_reading("sequences") == ["lstm", "gru"]
    assert registry.names_reading("objectives") == ["quadratic"] and registry.MODELS["quadratic"].reads_objectives
    assert not registry.REGISTRY.is_plugin(registry.MODELS["cnn"])


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"name": "Probe"}, "lower-case letters"),
        ({"config_type": type("C", (ModelSection,), {})}, 'a field `name: Literal["probe"] = "probe"`'),
        ({"inputs": ("pictures",)}, "inputs must be a non-empty tuple of vectors, images"),
        ({"batched_forward": lambda module, params, inputs: inputs}, "a batched_forward needs module_types"),
    ],
)
def test_an_entry_says_what_is_wrong_with_it(arguments, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        ModelEntry(**{"name": "probe", "config_type": _Config, "build": _build, **arguments})


def test_a_config_type_must_bring_the_keys_every_model_has():
    from pydantic import BaseModel

    class Plain(BaseModel):
        name: Literal["probe"] = "probe"

    with pytest.raises(ValueError, match="must subclass driftlab.models.ModelSection"):
        ModelEntry("probe", Plain, _build)
    with pytest.raises(TypeError, match="register\\(\\) takes a ModelEntry"):
        registry.register("probe")


def test_a_built_in_name_cannot_be_taken():
    entry = ModelEntry(
        "cnn", type("CNN", (ModelSection,), {"__annotations__": {"name": Literal["cnn"]}, "name": "cnn"}), _build
    )
    with pytest.raises(ValueError, match="'cnn' is a built-in model"):
        registry.register(entry)


# ------------------------------------------------------------------ [model] as a tagged union


@pytest.mark.parametrize("preset, fingerprint", sorted(PINNED_FINGERPRINTS.items()))
def test_shipped_presets_keep_their_fingerprints(preset, fingerprint):
    assert load_config(preset).fingerprint() == fingerprint


def test_each_model_records_its_own_keys_only():
    assert load_config(None, ["model.name=cnn"]).to_dict()["model"] == {"name": "cnn"}
    assert load_config(None, ["model.name=mlp"]).to_dict()["model"] == {"name": "mlp", "hidden": [200, 200]}
    lstm = load_config(None, ["model.name=lstm", "model.rnn_hidden=8"])
    assert lstm.to_dict()["model"] == {"name": "lstm", "rnn_hidden": 8, "rnn_layers": 2, "embedding_dim": 8}
    # the same fingerprint as the flat section gave, which held every key of every model at its default
    flat = {**LEGACY_FLAT_DEFAULTS["model"], "name": "lstm", "rnn_hidden": 8}
    assert load_config({"model": flat}).fingerprint() == lstm.fingerprint()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_an_old_config_json_with_every_flat_model_key_at_its_default_still_loads(name):
    flat = {**LEGACY_FLAT_DEFAULTS["model"], "name": name}
    config = load_config({"model": flat})
    assert config.model.name == name
    assert set(config.to_dict()["model"]) <= set(flat)


def test_a_key_of_another_model_is_refused_naming_the_models_that_take_it():
    with pytest.raises(ConfigError, match=r"model.hidden is a key of mlp, not of model.name = 'cnn'"):
        load_config(None, ["model.name=cnn", "model.hidden=[8]"])
    with pytest.raises(
        ConfigError, match=r"model.width is a key of resnet18_gn, resnet18_bn, vgg11, not of model.name = 'mlp'"
    ):
        load_config(None, ["model.name=mlp", "model.width=8"])
    with pytest.raises(ConfigError, match=r"model.hiden: unknown key; .*did you mean model.hidden\?"):
        load_config(None, ["model.name=mlp", "model.hiden=[8]"])
    with pytest.raises(ConfigError, match=r"unknown model 'lstn' \(did you mean 'lstm'\?\)"):
        load_config(None, ["model.name=lstn"])


# ------------------------------------------------------------------ a model of your own, as a plugin

PLUGIN = """
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

import driftlab
from driftlab.models import ModelEntry, ModelSection, layers, register


class TinyCNN(nn.Module):
    def __init__(self, in_channels, size, channels, classes):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, padding=1)
        self.fc = nn.Linear(channels * (size // 2) ** 2, classes)

    def forward(self, inputs):
        return self.fc(torch.max_pool2d(torch.relu(self.conv(inputs)), 2).flatten(1))


class Config(ModelSection):
    name: Literal["tiny_cnn"] = "tiny_cnn"
    channels: int = Field(3, ge=1, le=64)


def build(section, input_shape, num_classes):
    in_channels, size, _ = input_shape
    return TinyCNN(in_channels, size, section.channels, num_classes)


def batched(module, params, inputs):
    x = layers.relu(layers.conv(layers.images(inputs), module.conv, params, "conv."))
    x = layers.elementwise(x, lambda t: torch.max_pool2d(t, 2))
    return layers.linear(x, module.fc, params, "fc.").tensor


register(ModelEntry("tiny_cnn", Config, build, inputs=("images",), batched_forward=batched, module_types=(TinyCNN,)))


def images():
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(48, 1, 6, 6)).astype(np.float32)
    targets = (inputs[:, 0, :3].sum(axis=(1, 2)) > 0).astype(np.int64)
    return driftlab.FederatedArrays(inputs, targets, np.arange(48) % 4, inputs[:12], targets[:12])
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "tiny_cnn.py"
    path.write_text(textwrap.dedent(PLUGIN))
    yield path
    # Forget the plugin, so later tests in this process see the zoo alone (messages list every registered model).
    registry.MODELS.pop("tiny_cnn", None)
    module_name = plugins._loaded_paths.pop(str(path.resolve()), None)
    sys.modules.pop(module_name or "", None)


def _config(plugin: Path, *overrides: str):
    return load_config(
        {"plugins": [str(plugin)]},
        [
            "model.name=tiny_cnn",
            "data.name=custom",
            f"data.loader={plugin}:images",
            "rounds=2",
            "precision=float64",
            "client.batch_size=5",
            "client.epochs=2",
            "sampling.participation=1.0",
            *overrides,
        ],
    )


def test_a_plugin_model_is_named_in_a_config_and_its_own_keys_are_validated(plugin, built_ins_only):
    config = _config(plugin, "model.channels=2")
    assert config.model.name == "tiny_cnn" and config.model.channels == 2
    with pytest.raises(ConfigError, match=r"model.channels: Input should be greater than or equal to 1"):
        _config(plugin, "model.channels=0")
    with pytest.raises(
        ConfigError, match=r"model.kernel: unknown key; valid keys here: loss, classifier, name, channels"
    ):
        _config(plugin, "model.kernel=5")
    with pytest.raises(ConfigError, match=r"model.channels is a key of tiny_cnn, not of model.name = 'cnn'"):
        load_config({"plugins": [str(plugin)]}, ["model.name=cnn", "model.channels=2"])
    assert "[model] when model.name = 'tiny_cnn' (plugin " in describe_keys()


def test_a_plugin_model_trains_alike_on_both_backends_and_config_json_records_the_plugin(
    plugin, tmp_path, built_ins_only
):
    finals = {}
    for backend in ("sequential", "vectorized"):
        result = driftlab.run(_config(plugin, f"backend={backend}"), tmp_path / backend)
        finals[backend] = result.final_params
        recorded = json.loads((tmp_path / backend / "config.json").read_text())
        assert recorded["plugins"] == [str(plugin.resolve())] and recorded["model"] == {
            "name": "tiny_cnn",
            "channels": 3,
        }
    assert finals["sequential"].shape == (1 * 3 * 9 + 3 + 3 * 9 * 2 + 2,)
    torch.testing.assert_close(finals["vectorized"], finals["sequential"], rtol=1e-10, atol=1e-10)
    assert (
        load_config(tmp_path / "vectorized" / "config.json").fingerprint()
        == _config(plugin, "backend=vectorized").fingerprint()
    )


def test_a_plugin_models_batched_forward_gives_each_client_its_own_gradient(plugin, built_ins_only):
    _config(plugin)  # imports the plugin
    entry = registry.lookup("tiny_cnn")
    torch.manual_seed(0)
    model = FlatModel.wrap(entry.build(entry.config_type(), (1, 6, 6), 2)).to("cpu", torch.float64)
    engine = StackedNetwork.match(model)
    assert engine is not None and engine._forward is entry.batched_forward
    generator = torch.Generator().manual_seed(1)
    theta = model.initial_parameters().repeat(3, 1) + 0.05 * torch.randn(
        3, model.initial_parameters().numel(), generator=generator, dtype=torch.float64
    )
    x = torch.randn(3, 4, 1, 6, 6, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 2, (3, 4), generator=generator)
    weights = torch.rand(3, 4, generator=generator, dtype=torch.float64)
    out = torch.empty_like(theta)
    engine.loss_gradient(theta, x, targets, weights, out)
    for k in range(3):
        theta_k = theta[k].clone().requires_grad_()
        (expected,) = torch.autograd.grad(
            (model.example_loss(model.forward(theta_k, x[k]), targets[k]) * weights[k]).sum(), theta_k
        )
        torch.testing.assert_close(out[k], expected, rtol=1e-12, atol=1e-12)


def test_a_zoo_module_passed_directly_finds_its_batched_forward_by_type_and_a_subclass_does_not():
    module = zoo.FedDynCNN(3, 1, 16)
    assert registry.batched_form(module) is registry.MODELS["cnn"].batched_forward

    class Doubled(zoo.FedDynCNN):
        def forward(self, inputs):
            return 2 * super().forward(inputs)

    assert registry.batched_form(Doubled(3, 1, 16)) is None
