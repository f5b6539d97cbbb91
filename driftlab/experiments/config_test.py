"""Config validation messages, override parsing, presets, `describe_keys`, and the config.json round trip."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

import driftlab
from driftlab.algorithms import ALGORITHM_CONFIGS
from driftlab.experiments.config import (
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    describe_keys,
    load_config,
    parse_override,
    preset_names,
)
from driftlab.optim.schedules import ExponentialSchedule, InverseTimeSchedule


def _error(*overrides, source=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, list(overrides))
    return str(info.value)


# ------------------------------------------------------------------ validation messages


def test_unknown_key_names_the_key_and_the_valid_keys():
    message = _error("client.lrr=0.1")
    assert "client.lrr" in message and "unknown key" in message
    for valid in ("lr", "batch_size", "epochs", "steps", "weight_decay", "clip_norm"):
        assert valid in message
    top = _error("roundz=3")
    assert "roundz" in top and "rounds" in top and "seed" in top
    algorithm = _error("algorithm.mu=0.1")
    assert "algorithm.mu" in algorithm and "aggregation" in algorithm
    section = _error("sampling.fraction=0.5")
    assert "sampling.fraction" in section and "participation" in section and "mode" in section


def test_wrong_type_names_the_key_and_the_value():
    message = _error("rounds=abc")
    assert "rounds" in message and "'abc'" in message
    assert "client.batch_size" in _error("client.batch_size=2.5")
    assert "server.bias_correction" in _error("server.bias_correction=maybe")
    assert "client.lr" in _error('client.lr="fast"')
    assert "client.lr" in _error("client.lr=true")  # a boolean is not a rate


@pytest.mark.parametrize("key", ["client.lr", "server.lr"])
def test_negative_or_zero_learning_rate(key):
    for value in ("-0.1", "0"):
        message = _error(f"{key}={value}")
        assert key in message and "> 0" in message


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_learning_rate_is_rejected(value):
    assert "client.lr" in _error(f"client.lr={value}")


def test_participation_must_be_in_zero_one():
    message = _error("sampling.participation=1.5")
    assert "sampling.participation" in message and "1" in message
    assert "sampling.participation" in _error("sampling.participation=0")
    load_config(None, ["sampling.participation=1.0"])  # the bound itself is allowed


def test_unknown_algorithm_lists_the_algorithms():
    message = _error("algorithm.name=fedfoo")
    assert "unknown algorithm 'fedfoo'" in message
    for name in ALGORITHM_CONFIGS:
        assert name in message


def test_unknown_data_set_lists_the_data_sets():
    message = _error("data.name=cifar")
    assert "data.name" in message and "'cifar'" in message
    for name in ("synthetic", "synthetic_iid", "mnist"):
        assert name in message


def test_other_out_of_range_values():
    assert "rounds" in _error("rounds=0")
    assert "seed" in _error("seed=-1")
    assert "device" in _error("device=tpu")
    assert "sampling.mode" in _error("sampling.mode=stratified")
    assert "client.weight_decay" in _error("client.weight_decay=-1")
    assert "evaluation.every" in _error("evaluation.every=0")


@pytest.mark.parametrize(
    "table, expected",
    [
        ('{initial=0.1, decay=0.9}', "kind"),
        ('{kind="cosine", initial=0.1}', "exponential"),
        ('{kind="exponential", initial=0.1, decay=1.5}', "decay"),
        ('{kind="exponential", initial=-0.1, decay=0.9}', "initial"),
        ('{kind="exponential", initial=0.1}', "decay"),
        ('{kind="inverse_time", a=1.0, b=-2}', "b"),
        ('{kind="exponential", initial=0.1, decay=0.9, warmup=3}', "warmup"),
    ],
)
def test_bad_schedule_tables(table, expected):
    message = _error(f"client.lr={table}")
    assert "client.lr" in message and expected in message
    assert "client.steps" in _error(f"client.steps={table}")


def test_steps_must_be_a_positive_integer():
    assert "client.steps" in _error("client.steps=2.5")
    assert "client.steps" in _error("client.steps=0")
    assert load_config(None, ["client.steps=4.0"]).client.steps == 4


def test_epochs_and_steps_are_exclusive():
    message = _error("client.epochs=2", "client.steps=5")
    assert "client.epochs" in message and "client.steps" in message
    # a preset that sets epochs can switch to steps by clearing epochs
    config = load_config("synthetic-fedavg", ["client.epochs=none", "client.steps=5"])
    assert config.client.steps == 5 and config.client.local_epochs is None
    assert load_config(None).client.local_epochs == 1


def test_message_points_at_driftlab_config():
    assert "driftlab config" in _error("client.lrr=1")


# ------------------------------------------------------------------ overrides


def test_override_values_are_toml_with_bare_strings():
    assert parse_override("client.lr=0.05") == (["client", "lr"], 0.05)
    assert parse_override("rounds=10") == (["rounds"], 10)
    assert parse_override(" rounds = 10 ") == (["rounds"], 10)
    assert parse_override("client.lr=1e-3") == (["client", "lr"], 0.001)
    assert parse_override("server.bias_correction=false") == (["server", "bias_correction"], False)
    assert parse_override("server.bias_correction=true") == (["server", "bias_correction"], True)
    assert parse_override("data.name=mnist") == (["data", "name"], "mnist")
    assert parse_override('data.name="mnist"') == (["data", "name"], "mnist")
    assert parse_override("data.root=/tmp/some dir/mnist") == (["data", "root"], "/tmp/some dir/mnist")
    assert parse_override("device=cuda:0") == (["device"], "cuda:0")
    assert parse_override("client.clip_norm=none") == (["client", "clip_norm"], None)
    assert parse_override("client.clip_norm=null") == (["client", "clip_norm"], None)
    assert parse_override("model.hidden=[64, 32]") == (["model", "hidden"], [64, 32])
    path, value = parse_override('client.lr={kind="exponential", initial=0.1, decay=0.99}')
    assert path == ["client", "lr"] and value == {"kind": "exponential", "initial": 0.1, "decay": 0.99}


def test_malformed_overrides():
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("client.lr")
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("=5")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"client": {"lr": 0.1}}, ["client.lr.initial=0.2"])


def test_overrides_reach_the_config():
    config = load_config(
        "synthetic-fedavg",
        [
            "rounds=7",
            "client.lr={kind=\"inverse_time\", a=1.0, b=10}",
            "client.steps={kind=\"exponential\", initial=8, decay=0.5}",
            "client.epochs=none",
            "server.optimizer=adam",
            "server.bias_correction=false",
            "model.hidden=[64, 32]",
            "algorithm.aggregation=uniform",
        ],
    )
    assert config.rounds == 7
    assert config.client.lr == InverseTimeSchedule(a=1.0, b=10)
    assert config.client.steps == ExponentialSchedule(initial=8, decay=0.5)
    assert config.server.optimizer == "adam" and config.server.bias_correction is False
    assert config.server.optimizer_hyperparameters() == {"beta1": 0.9, "bias_correction": False}
    assert config.model.hidden == (64, 32)
    assert config.algorithm.aggregation == "uniform"
    assert config.data.num_clients == 30  # untouched preset value


def test_apply_overrides_does_not_modify_its_input():
    table = {"client": {"lr": 0.1}}
    out = apply_overrides(table, ["client.lr=0.2", "server.lr=0.5"])
    assert table == {"client": {"lr": 0.1}}
    assert out == {"client": {"lr": 0.2}, "server": {"lr": 0.5}}


# ------------------------------------------------------------------ presets, describe_keys, files


def test_presets_load():
    names = preset_names()
    for expected in ("demo-synthetic", "synthetic-fedavg", "mnist-fedavg", "mnist-fedadam"):
        assert expected in names
    for name in names:
        config = load_config(name)
        assert isinstance(config, ExperimentConfig)
    assert load_config("mnist-fedadam").server.optimizer == "adam"
    assert load_config("demo-synthetic").evaluation.target_accuracy == 0.7


def test_unknown_source():
    message = _error(source="no-such-preset")
    assert "no-such-preset" in message and "synthetic-fedavg" in message


def test_invalid_toml_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("rounds = = 3\n")
    assert "not valid TOML" in _error(source=path)


def test_toml_file_with_sections(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text('rounds = 12\n[client]\nlr = {kind = "exponential", initial = 0.2, decay = 0.9}\nsteps = 4\n[data]\nnum_clients = 6\n')
    config = load_config(path, ["seed=5"])
    assert (config.rounds, config.seed, config.data.num_clients, config.client.steps) == (12, 5, 6, 4)
    assert config.client.lr == ExponentialSchedule(initial=0.2, decay=0.9)


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _leaf_keys(annotation, f"{prefix}{name}.")
        elif not (prefix == "" and name == "algorithm"):
            keys.append(f"{prefix}{name}")
    return keys


def test_describe_keys_lists_every_key_with_its_default():
    text = describe_keys()
    keys = _leaf_keys(ExperimentConfig)
    for algorithm in ALGORITHM_CONFIGS.values():
        keys += _leaf_keys(algorithm, "algorithm.")
    assert len(keys) > 30
    for key in keys:
        assert f"  {key} = " in text, key
    assert "client.lr = 0.01" in text
    assert "sampling.participation = 0.1" in text
    assert "exponential" in text and "inverse_time" in text


def test_config_round_trips_through_config_json(tmp_path):
    overrides = [
        "rounds=2",
        "data.num_clients=5",
        "client.epochs=none",
        'client.steps={kind="exponential", initial=4, decay=0.5}',
        'client.lr={kind="inverse_time", a=1.0, b=10}',
        "client.clip_norm=5",
        "server.optimizer=adam",
        "server.lr=0.01",
        "server.beta2=0.99",
        "model.hidden=[16]",
        "evaluation.target_accuracy=0.5",
    ]
    config = load_config(None, overrides)
    out = tmp_path / "run"
    driftlab.run(config, out)
    stored = json.loads((out / "config.json").read_text())
    assert ExperimentConfig.model_validate(stored) == config
    assert load_config(out / "config.json") == config  # a stored config.json is a valid config source
    assert load_config(out / "config.json").fingerprint() == config.fingerprint()


def test_json_config_file_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    assert "not valid JSON" in _error(source=path)
    path.write_text('{"client": {"lrr": 1}}')
    assert "client.lrr" in _error(source=path)


def test_fingerprint_ignores_length_and_placement_only():
    base = load_config(None)
    assert base.fingerprint() == load_config(None, ["rounds=5", "checkpoint_every=3", "device=auto"]).fingerprint()
    for change in ("client.lr=0.02", "seed=1", "server.optimizer=adam", "sampling.participation=0.2", "precision=float64"):
        assert base.fingerprint() != load_config(None, [change]).fingerprint(), change
