"""Config validation messages, override parsing, presets, `describe_keys`, and the config.json round trip."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

import driftlab
from driftlab.algorithms import ALGORITHMS
from driftlab.data.registry import DATA_SETS
from driftlab.experiments.config import (
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    describe_keys,
    load_config,
    parse_override,
    preset_names,
)
from driftlab.models.registry import MODELS
from driftlab.optim.registry import REGISTRY as SERVER_REGISTRY
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
    assert "server.bias_correction" in _error("server.optimizer=adam", "server.bias_correction=maybe")
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
    for name in ALGORITHMS:
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
        ("{initial=0.1, decay=0.9}", "kind"),
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


def test_a_file_that_puts_a_value_where_a_section_belongs_is_blamed_not_the_override(tmp_path):
    # It used to say "override 'client.lr=0.1': 'client' is a value, not a section": the override was fine.
    path = tmp_path / "c.toml"
    path.write_text('rounds = 3\nclient = 5\nmodel = "mlr"\n')
    message = _error("client.lr=0.1", source=path)
    assert message.startswith(
        f"{path}: line 2: client = 5, but client is a section of keys (override 'client.lr=0.1' sets one"
    )
    assert message.endswith("write [client] and its keys under it, as `driftlab config` lists them")
    assert _error("model.name=mlp", source=path).startswith(
        f"{path}: line 3: model = 'mlr', but model is a section of keys"
    )
    # the same fault in the file a `base` chain starts from: that file is named, the way a base's errors are
    top = tmp_path / "top.toml"
    top.write_text('base = "c.toml"\nrounds = 4\n')
    assert _error("client.lr=0.1", source=top).startswith(
        f"{top}: base 'c.toml': {path}: line 2: client = 5, but client is a section"
    )
    # an earlier override that made client a value is the one named
    assert _error("client=5", "client.lr=0.1").startswith(
        "override 'client=5': client = 5, but client is a section of keys"
    )


def test_an_override_that_reaches_into_a_value_of_the_file_is_blamed_and_the_value_shown(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[client]\nlr = 0.1\n")  # a fine file: client.lr is a value (or a whole schedule table)
    assert _error("client.lr.initial=0.2", source=path) == (
        f"override 'client.lr.initial=0.2': client.lr is a value, not a section (client.lr = 0.1 from {path}: line 2); "
        "set client.lr=... itself"
    )


def test_each_problem_of_a_file_with_overrides_says_whether_the_file_or_an_override_gave_it(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('rounds = 3\n[client]\nlr = "fast"\nlrr = 0.1\n[sampling]\nparticipation = 0.5\n')
    lines = {
        line.split(":")[0].strip(): line
        for line in _error("client.batch_size=-1", "sampling.participation=2", source=path).splitlines()
    }
    assert lines["client.batch_size"].endswith("(got -1) (from override 'client.batch_size=-1')")
    assert lines["client.lr"].endswith(f"got 'fast' (from {path}: line 3)")
    assert lines["client.lrr"].endswith(f"did you mean client.lr? (from {path}: line 4)")
    assert lines["sampling.participation"].endswith("(got 2) (from override 'sampling.participation=2')")
    # a table that both gave keys to names both
    path.write_text('[client.lr]\nkind = "exponential"\ndecay = "slow"\n')
    message = _error("client.lr.initial=0.2", source=path)
    assert f"(from {path}: line 1 and override 'client.lr.initial=0.2')" in message
    assert "(from" not in _error(source=path)  # a file alone: every problem is the file's


def test_overrides_reach_the_config():
    config = load_config(
        "synthetic-fedavg",
        [
            "rounds=7",
            'client.lr={kind="inverse_time", a=1.0, b=10}',
            'client.steps={kind="exponential", initial=8, decay=0.5}',
            "client.epochs=none",
            "server.optimizer=adam",
            "server.bias_correction=false",
            "model.name=mlp",
            "model.hidden=[64, 32]",
            "algorithm.aggregation=uniform",
        ],
    )
    assert config.rounds == 7
    assert config.client.lr == InverseTimeSchedule(a=1.0, b=10)
    assert config.client.steps == ExponentialSchedule(initial=8, decay=0.5)
    assert config.server.optimizer == "adam" and config.server.bias_correction is False
    assert (config.server.beta1, config.server.beta2, config.server.epsilon) == (0.9, None, None)
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
    path.write_text(
        'rounds = 12\n[client]\nlr = {kind = "exponential", initial = 0.2, decay = 0.9}\nsteps = 4\n[data]\nnum_clients = 6\n'
    )
    config = load_config(path, ["seed=5"])
    assert (config.rounds, config.seed, config.data.num_clients, config.client.steps) == (12, 5, 6, 4)
    assert config.client.lr == ExponentialSchedule(initial=0.2, decay=0.9)


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _leaf_keys(annotation, f"{prefix}{name}.")
        elif not (prefix == "" and isinstance(info.get_default(call_default_factory=True), BaseModel)):
            keys.append(f"{prefix}{name}")  # not a tagged section ([algorithm], [data]): those are listed by entry
    return keys


def test_describe_keys_lists_every_key_with_its_default():
    text = describe_keys()
    keys = _leaf_keys(ExperimentConfig)
    for entry in ALGORITHMS.values():
        keys += _leaf_keys(entry.config_type, "algorithm.")
    for data_set in DATA_SETS.values():
        keys += _leaf_keys(data_set.config_type, "data.")
    for model in MODELS.values():
        keys += [key for key in _leaf_keys(model.config_type, "model.") if key != "model.name"]
    for optimizer in SERVER_REGISTRY.entries.values():
        keys += [key for key in _leaf_keys(optimizer.config_type, "server.") if key != "server.optimizer"]
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
        "model.name=mlp",
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
    for change in (
        "client.lr=0.02",
        "seed=1",
        "server.optimizer=adam",
        "sampling.participation=0.2",
        "precision=float64",
    ):
        assert base.fingerprint() != load_config(None, [change]).fingerprint(), change


# ------------------------------------------------------------------ reading config files defensively


def test_non_utf8_config_file_names_the_file(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("rounds = 3\n# café\n".encode("latin-1"))
    message = _error(source=path)
    assert str(path) in message and "not UTF-8" in message and "save it as UTF-8" in message


def test_toml_dates_and_times_are_refused_naming_the_key(tmp_path):
    path = tmp_path / "dates.toml"
    path.write_text("rounds = 3\n[data]\nroot = 1979-05-27T07:32:00Z\n")
    message = _error(source=path)
    assert "data.root" in message and "dates and times are not allowed" in message and "quoted string" in message
    path.write_text("[client]\nlr = 07:32:00\n")
    assert "client.lr" in _error(source=path)
    message = _error("seed=1979-05-27")
    assert "override seed" in message and "dates and times are not allowed" in message


def test_oversized_config_file_is_refused_before_parsing(tmp_path):
    from driftlab.experiments.config import MAX_CONFIG_BYTES

    path = tmp_path / "huge.toml"
    line = b"unknown_key_%07d = 1\n"
    path.write_bytes(b"".join(line % i for i in range(MAX_CONFIG_BYTES // 20 + 10)))
    assert path.stat().st_size > MAX_CONFIG_BYTES
    message = _error(source=path)
    assert str(path) in message and f"larger than {MAX_CONFIG_BYTES:,} bytes" in message
    assert len(message) < 500


def test_deep_nesting_is_a_config_error_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("rounds = " + "[" * 1000 + "1" + "]" * 1000 + "\n")
    assert "nested too deeply" in _error(source=path)
    path.write_text("[" + ".".join(["a"] * 40) + "]\nx = 1\n")  # tomllib builds this without recursing
    message = _error(source=path)
    assert "nested more than 32 levels" in message and "a.a.a" in message
    json_path = tmp_path / "deep.json"
    json_path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested too deeply" in _error(source=json_path)
    assert "nested" in _error("client.lr=" + "[" * 1000 + "]" * 1000)
    deep: dict = {}
    node = deep
    for _ in range(2000):
        node["a"] = {}
        node = node["a"]
    assert "nested more than" in _error(source=deep)


@pytest.mark.parametrize(
    "override, hint",
    [
        ("client.learning_rate=0.1", "; did you mean client.lr?"),  # a name from another library
        ("client.lrr=0.1", "; did you mean client.lr?"),  # a typo
        ("client.Batch_Size=5", "; did you mean client.batch_size?"),
        ("client.participation=0.5", "; did you mean sampling.participation?"),  # a key of another section
        ("algorithm.mu=1", "; mu is a key of 'fedprox', 'adabest', not of 'fedavg'"),  # a key of another algorithm
    ],
)
def test_an_unknown_key_says_what_was_likely_meant(override, hint, built_in_algorithms_only):
    key = override.split("=")[0]
    line = next(line for line in _error(override).splitlines() if line.startswith(f"  {key}:"))
    assert line.endswith(hint), line
    assert line.startswith(f"  {key}: unknown key; valid keys here: ")


def test_an_unknown_key_far_from_every_key_gets_no_guess():
    line = _error("client.zzzqqq=1").splitlines()[1]
    assert (
        line
        == "  client.zzzqqq: unknown key; valid keys here: lr, batch_size, epochs, steps, weight_decay, clip_norm, inexact_gamma"
    )


def test_unknown_presets_and_algorithms_say_what_was_likely_meant(built_in_algorithms_only):
    assert (
        "'synthetic-fedavgg' is neither a config file nor a preset (did you mean 'synthetic-fedavg'?); presets: "
        in _error(source="synthetic-fedavgg")
    )
    assert "unknown algorithm 'FedProx' (did you mean 'fedprox'?); valid algorithms: fedavg, " in _error(
        "algorithm.name=FedProx"
    )
    assert "unknown algorithm 'scafold' (did you mean 'scaffold'?)" in _error("algorithm.name=scafold")
    assert "did you mean" not in _error("algorithm.name=nesterov_avg")


def test_a_dotted_key_of_50000_parts_is_refused_before_tomllib_in_little_memory(tmp_path):
    import tracemalloc

    path = tmp_path / "bomb.toml"
    path.write_text("rounds = 5\n" + "x." * 50_000 + "x = 1\n")  # 100 kB; tomllib needs gigabytes for it
    tracemalloc.start()
    try:
        message = _error(source=path)
        for text in (
            "[" + "x." * 50_000 + "x]\n",
            "a = {" + "x." * 50_000 + "x = 1}\n",
            "a = " + "{b = " * 50_000 + "1" + "}" * 50_000,
        ):
            path.write_text(text)
            assert "nested" in _error(source=path)
        assert "a key has at most 32 dotted parts" in _error("x." * 50_000 + "x=1")
        assert "override client.lr: line 1: a dotted key nested more than 32" in _error(
            "client.lr={" + "x." * 50_000 + "x = 1}"
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message.startswith(f"{path}: line 2: a dotted key nested more than 32 levels deep (starting 'x.x.x.x")
    assert peak < 10_000_000


def test_dots_and_brackets_in_strings_comments_and_numbers_are_not_nesting(tmp_path):
    path = tmp_path / "fine.toml"
    dots = ".".join(["a"] * 40)
    path.write_text(
        f"# {dots} [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n[data]\nroot = \"{dots}\"\nloader = '{dots}:f'\n"
        f"[client]\nlr = 0.5\n[model]\nhidden = [{', '.join(['1'] * 40)}]\n"
        f'[algorithm]\nname = """{dots}\n[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["""\n'
    )
    assert "unknown algorithm" in _error(source=path)  # read and validated: the scan refused nothing


_QUOTED_BOMBS = {  # one key of 50,000 parts in each form tomllib reads (439 kB as basic parts: 7.8 GB for tomllib)
    "basic parts": ".".join(f'"k{i}"' for i in range(50_000)) + " = 1\n",
    "literal parts, blanks around the dots": " . ".join(f"'k{i}'" for i in range(50_000)) + " = 1\n",
    "a [table] header": "[" + ".".join(f'"k.{i}"' for i in range(50_000)) + "]\nx = 1\n",
    "an [[array]] header": "[[ " + "\t.\t".join(f"'k[{i}]'" for i in range(50_000)) + " ]]\n",
    "an inline table": "a = { b = 1, " + ".".join(f'"k\\"{i}"' for i in range(50_000)) + " = 1 }\n",
    "mixed parts in a list of inline tables": "a = [{ b = [{"
    + ".".join(("x", '"y"', "'z'")[i % 3] for i in range(50_000))
    + " = 1}] }]\n",
}


@pytest.mark.parametrize("form", _QUOTED_BOMBS)
def test_a_dotted_key_of_50000_quoted_parts_is_refused_before_tomllib(tmp_path, form):
    # The scan counted only bare dots: each of these passed it, and tomllib then took gigabytes.
    path = tmp_path / "bomb.toml"
    path.write_text('base = "synthetic-fedavg"\n# a comment.with.dots [[[\n' + _QUOTED_BOMBS[form])
    message = _error(source=path)
    assert message.startswith(f"{path}: line 3: a dotted key nested more than 32 levels deep (starting "), message
    assert message.endswith("write [section] and then key = value") and len(message) < 400


def test_error_text_is_bounded():
    table = {f"key_{i}": 1 for i in range(500)}
    message = _error(source=table)
    assert message.count("unknown key") == 20 and "... and 480 more" in message
    assert len(message) < 20 * 400
    long_value = "x" * 100_000
    message = _error(f"data.name={long_value}")
    assert "data.name" in message and "characters" in message and "x" * 1000 not in message and len(message) < 2000


# ------------------------------------------------------------------ values that used to be accepted


@pytest.mark.parametrize(
    "override, key",
    [
        ("rounds=true", "rounds"),
        ("seed=false", "seed"),
        ("client.batch_size=true", "client.batch_size"),
        ("client.weight_decay=true", "client.weight_decay"),
        ("model.hidden=[true, 3]", "model.hidden"),  # with model.name=mlp, below
        ("algorithm.name=efl", None),
    ],
)
def test_booleans_are_not_numbers(override, key):
    if key is None:  # an algorithm's own config (not a section of the schema) is covered too
        message = _error(override, "algorithm.fisher_examples=true")
        key = "algorithm.fisher_examples"
    else:
        message = _error("model.name=mlp", override)
    assert f"{key}: expected a number, got " in message
    adam = load_config(None, ["server.optimizer=adam", "server.bias_correction=false", "data.augment=true"])
    assert adam.server.bias_correction is False


def test_model_widths_must_be_positive():
    message = _error("model.name=mlp", "model.hidden=[0]")
    assert "model.hidden" in message and "greater than or equal to 1" in message
    assert "model.hidden" in _error("model.name=mlp", "model.hidden=[200, -5]")
    assert "model.hidden" in _error("model.name=mlp", f"model.hidden=[{10**9}]")
    assert (
        load_config(None, ["model.name=mlp", "model.hidden=[]"]).model.hidden == ()
    )  # an mlp without hidden layers is mlr


@pytest.mark.parametrize(
    "override",
    [
        "client.lr=1e308",
        "server.lr=2e6",
        'client.lr={kind="exponential", initial=1e7, decay=0.9}',
        'client.lr={kind="inverse_time", a=1e12, b=1}',
    ],
)
def test_learning_rates_above_the_bound_are_refused(override):
    key = override.split("=")[0]
    message = _error(override)
    assert key in message and "1e+06" in message and "typo" in message


def test_learning_rate_bound_itself_is_allowed():
    assert load_config(None, ["client.lr=1e6"]).client.lr == 1e6
    assert (
        load_config(None, ['client.steps={kind="inverse_time", a=1e7, b=0}']).client.steps.a == 1e7
    )  # a count, not a rate


@pytest.mark.parametrize(
    "override, key",
    [
        ('client.lr={kind="exponential", initial=inf, decay=0.9}', "client.lr.initial"),
        ('client.lr={kind="inverse_time", a=1.0, b=inf}', "client.lr.b"),
        ('client.steps={kind="inverse_time", a=nan, b=1}', "client.steps.a"),
        ("client.weight_decay=inf", "client.weight_decay"),
        ("data.synthetic_alpha=inf", "data.synthetic_alpha"),
        ("algorithm.name=fedprox", "algorithm.mu"),
    ],
)
def test_non_finite_numbers_are_refused_anywhere(override, key):
    extra = ["algorithm.mu=inf"] if key == "algorithm.mu" else []
    message = _error(override, *extra)
    assert f"{key}: must be a finite number" in message
    assert message.count("\n  ") == 1  # reported once, not again by the schedule that holds it


def test_schedules_refuse_non_finite_parameters():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="finite"):
        ExponentialSchedule(initial=float("inf"), decay=0.9)
    with pytest.raises(ValidationError, match="finite"):
        InverseTimeSchedule(a=1.0, b=float("inf"))


def test_membership_ranges_must_be_increasing():
    message = _error("availability.events=[{round=2, join_range=[5, 2]}]")
    assert "availability.events.join_range" in message and "got [5, 2]" in message and "write [2, 5]" in message
    assert "leave_range" in _error("availability.events=[{round=2, leave_range=[3, 3]}]")
    assert "join_range" in _error("availability.events=[{round=2, join_range=[-1, 3]}]")
    assert "0 or more" in _error("availability.events=[{round=2, leave=[-1]}]")
    config = load_config(None, ["availability.events=[{round=2, join_range=[2, 5]}]"])
    assert config.availability.events[0].joined() == (2, 3, 4)


def test_batch_size_and_data_root_bounds():
    message = _error("client.batch_size=1000000000")
    assert "client.batch_size" in message and "1000000" in message
    assert load_config(None, ["client.batch_size=1000000"]).client.batch_size == 1_000_000
    assert "data.root" in _error('data.root=""')
    assert "data.root" in _error("data.root=")


def test_rounds_are_bounded_by_what_a_run_can_finish():
    message = _error("rounds=10000000000000")
    assert "rounds" in message and "10000000" in message
    assert load_config(None, ["rounds=10000000"]).rounds == 10_000_000


# ------------------------------------------------------------------ base = "preset-or-file"


def test_config_file_builds_on_a_preset(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "synthetic-fedprox"\nrounds = 7\n[client]\nlr = 0.05\n[algorithm]\nmu = 0.5\n')
    preset = load_config("synthetic-fedprox")
    config = load_config(path)
    assert (config.rounds, config.client.lr, config.algorithm.mu) == (7, 0.05, 0.5)
    assert config.client.batch_size == preset.client.batch_size and config.data == preset.data
    assert config.algorithm.name == preset.algorithm.name
    assert load_config(path, ["rounds=9"]).rounds == 9  # overrides still come last


def test_base_file_is_relative_to_the_file_and_chains(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "common.toml").write_text(
        'base = "synthetic-fedavg"\nseed = 4\n[client]\nlr = {kind = "exponential", initial = 0.2, decay = 0.9}\n'
    )
    (tmp_path / "sub" / "run.toml").write_text(
        'base = "../common.toml"\nrounds = 3\n[client]\nlr = {kind = "inverse_time", a = 1.0, b = 10}\nepochs = "none"\nsteps = 5\n'
    )
    config = load_config(tmp_path / "sub" / "run.toml")
    assert (config.seed, config.rounds, config.client.steps, config.client.epochs) == (4, 3, 5, None)
    assert config.client.lr == InverseTimeSchedule(a=1.0, b=10)  # a schedule table replaces the base's whole


def test_base_switching_algorithm_drops_the_old_algorithms_keys(tmp_path):
    path = tmp_path / "switch.toml"
    path.write_text('base = "synthetic-fedprox"\n[algorithm]\nname = "scaffold"\n')
    assert load_config(path).algorithm.name == "scaffold"


def test_base_cycles_and_bad_bases_are_clear_errors(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('base = "b.toml"\nrounds = 2\n')
    b.write_text('base = "a.toml"\nseed = 1\n')
    message = _error(source=a)
    assert "comes back to itself" in message and "a.toml -> " in message and "b.toml" in message
    a.write_text('base = "a.toml"\n')
    assert "comes back to itself" in _error(source=a)
    a.write_text("base = 3\n")
    assert "`base` must name a preset" in _error(source=a)
    a.write_text('base = "no-such-preset"\n')
    message = _error(source=a)
    assert str(a) in message and "no-such-preset" in message and "neither a config file nor a preset" in message
    a.write_text('base = "b.toml"\n')
    b.write_text("[client]\nlrr = 1\n")
    assert "client.lrr" in _error(source=a)  # the merged table is validated as one


def test_config_file_with_a_base_is_not_taken_for_a_sweep(tmp_path):
    from driftlab.experiments.sweep import is_sweep_source

    config_file, sweep_file = tmp_path / "config.toml", tmp_path / "sweep.toml"
    config_file.write_text('base = "synthetic-fedavg"\nrounds = 3\n')
    sweep_file.write_text('base = "synthetic-fedavg"\nseeds = [0, 1]\noverrides = ["rounds=3"]\n')
    assert not is_sweep_source(config_file) and is_sweep_source(sweep_file)


# ---------------------------------------------------------------- your own data and loss


from driftlab.experiments.config import load_config as _load  # noqa: E402
from driftlab.plugins import import_function  # noqa: E402

DIGEST = "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["data.loader=my_data.py:load"], "data.loader is a key of custom, not of data.name = 'synthetic'"),
        ([f"data.digest={DIGEST}"], "data.digest is a key of custom, not of data.name = 'synthetic'"),
        (["data.name=custom", "data.loader=my_data.py"], 'expected "module:function" or "path/to/file.py:function"'),
        (["data.name=custom", "data.digest=abc"], "data.digest: String should match pattern"),
        (["model.loss=losses.py:"], 'expected "module:function"'),
    ],
)
def test_own_data_and_loss_keys_are_checked(overrides, fragment):
    with pytest.raises(ConfigError, match="invalid configuration") as error:
        _load(None, overrides)
    assert fragment in str(error.value)


def test_a_loader_path_is_taken_from_the_config_files_folder(tmp_path, monkeypatch):
    (tmp_path / "project").mkdir()
    config = tmp_path / "project" / "own.toml"
    config.write_text('[data]\nname = "custom"\nloader = "data/my_data.py:load"\n[model]\nloss = "losses:squared"\n')
    monkeypatch.chdir(tmp_path)
    loaded = _load(config)
    assert loaded.data.loader == f"{(tmp_path / 'project' / 'data' / 'my_data.py').resolve()}:load"
    assert loaded.model.loss == "losses:squared"  # a module name stays a module name
    assert _load(None, ["data.name=custom", "data.loader=x.py:f"]).data.loader == f"{(tmp_path / 'x.py').resolve()}:f"


def test_the_fingerprint_leaves_out_the_loader_path_and_the_digest_a_sweep_plans_without():
    first = _load(None, ["data.name=custom", "data.loader=/a/my_data.py:load", f"data.digest={DIGEST}"])
    moved = _load(None, ["data.name=custom", "data.loader=/b/my_data.py:load"])
    assert first.fingerprint() == moved.fingerprint() != _load(None).fingerprint()
    assert (
        _load(None).fingerprint() == _load(None, ["model.classifier=none"]).fingerprint()
    )  # unset keys leave old fingerprints alone


def test_the_fingerprint_keeps_the_loss_files_name_and_function_not_its_folder():
    here = _load(None, ["model.loss=/a/losses.py:squared"])
    assert here.fingerprint() == _load(None, ["model.loss=/b/checkout/losses.py:squared"]).fingerprint()
    assert here.fingerprint() != _load(None, ["model.loss=/a/losses.py:absolute"]).fingerprint()
    assert here.fingerprint() != _load(None, ["model.loss=/a/other.py:squared"]).fingerprint()


def test_import_function_names_the_key_and_the_fix(tmp_path):
    (tmp_path / "losses.py").write_text(
        "scale = 2.0\ndef squared(outputs, targets):\n    return (outputs - targets) ** 2\n"
    )
    assert import_function(f"{tmp_path / 'losses.py'}:squared", "model.loss").__name__ == "squared"
    with pytest.raises(ConfigError, match=r"^model.loss = .*: .*losses.py' has a float, not a function 'scale'"):
        import_function(f"{tmp_path / 'losses.py'}:scale", "model.loss")
    with pytest.raises(ConfigError, match=r"was defined in a script, which this process cannot import: pass it again"):
        import_function("__main__:my_loss_not_here", "model.loss")


def test_describe_keys_lists_the_own_data_and_loss_keys():
    text = describe_keys()
    for key in ("data.loader", "data.digest", "model.loss", "model.classifier"):
        assert f"  {key} = " in text


# ---------------------------------------------------------------- [system] and [asynchronous]

TIMED = ["system.profiles=lognormal"]
ASYNCHRONOUS = TIMED + ["asynchronous.concurrency=4", "asynchronous.buffer=2"]


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["asynchronous.buffer=2"], "asynchronous", "add a [system] section"),
        (ASYNCHRONOUS + ["privacy.clip=1.0"], "privacy", "remove [privacy], or remove [asynchronous]"),
        (
            ASYNCHRONOUS + ["compression.ratio=0.5"],
            "compression.ratio",
            "uncompressed (ratio 0.5): set compression.ratio = 1",
        ),
        (
            ASYNCHRONOUS + ["algorithm.name=efl"],
            "compression.ratio",
            "(ratio 0.01, efl's default): set compression.ratio = 1",
        ),
        (
            ASYNCHRONOUS + ["availability.inactive_probability=0.1"],
            "availability.inactive_probability",
            "set availability.inactive_probability = 0",
        ),
        (
            ASYNCHRONOUS + ["availability.incomplete_probability=0.1"],
            "availability.incomplete_probability",
            "come from [system]",
        ),
        (ASYNCHRONOUS + ["system.deadline=10"], "system.deadline", "remove system.deadline"),
        (
            ASYNCHRONOUS + ["system.over_selection=0.3"],
            "system.over_selection",
            "over-selection is for synchronous rounds",
        ),
        (
            ASYNCHRONOUS + ["sampling.mode=weighted"],
            "sampling.mode",
            'instead of sampling weighted cohorts: set sampling.mode = "uniform"',
        ),
        (ASYNCHRONOUS + ["sampling.mode=poisson"], "sampling.mode", "asynchronous.concurrency at a time"),
        (
            TIMED + ["system.over_selection=0.3", "sampling.mode=poisson"],
            "system.over_selection",
            "a poisson cohort has no fixed size",
        ),
    ],
)
def test_what_asynchronous_and_over_selection_cannot_be_combined_with(overrides, key, fragment):
    message = _error(*overrides)
    assert f"  {key}: " in message and fragment in message


def test_timed_and_asynchronous_configs_that_combine():
    # a preset's participation (for its synchronous runs) is not read by an asynchronous run, so it is no conflict
    config = load_config(
        None, ASYNCHRONOUS + ["sampling.participation=0.5", "compression.ratio=1", "availability.events=[]"]
    )
    assert config.asynchronous.concurrency == 4 and config.system.profiles == "lognormal"
    timed = load_config(None, TIMED + ["system.deadline=10", "system.over_selection=0.3", "sampling.participation=0.5"])
    assert timed.system.deadline == 10 and timed.asynchronous is None
    assert "  system.over_selection: " in _error(*ASYNCHRONOUS, "system.over_selection=0.3", "sampling.mode=poisson")


def test_a_trace_path_is_taken_from_the_config_files_folder(tmp_path, monkeypatch):
    (tmp_path / "project").mkdir()
    config = tmp_path / "project" / "timed.toml"
    config.write_text('[system]\nprofiles = "trace"\ntrace = "traces/devices.csv"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config(config).system.trace == str((tmp_path / "project" / "traces" / "devices.csv").resolve())
    (tmp_path / "here.csv").write_text("")
    config.write_text(
        '[system]\nprofiles = "trace"\ntrace = "here.csv"\n'
    )  # not beside the config, but in the working directory
    assert load_config(config).system.trace == str((tmp_path / "here.csv").resolve())
    assert load_config(None, ["system.profiles=trace", "system.trace=x.csv"]).system.trace == str(
        (tmp_path / "x.csv").resolve()
    )
    assert load_config(None, ["system.profiles=trace", "system.trace=/abs/x.csv"]).system.trace == "/abs/x.csv"
    assert load_config(None).system is None


def test_describe_keys_lists_the_system_and_asynchronous_keys():
    text = describe_keys()
    for key in (
        "system.profiles",
        "system.trace",
        "system.deadline",
        "system.over_selection",
        "asynchronous.concurrency",
        "asynchronous.buffer",
    ):
        assert f"  {key} = " in text
    assert text.index("\n[system]\n") < text.index("  system.profiles = ") < text.index("\n[asynchronous]\n")


def test_the_features_sections_are_importable_from_the_config_package_as_before():
    import driftlab.experiments.config as config_package
    from driftlab.compress.section import CompressionConfig
    from driftlab.experiments.config import ADAPTIVE_KEYS, AsynchronousConfig, PrivacyConfig, SystemConfig
    from driftlab.features.registry import FEATURES
    from driftlab.privacy import section as privacy_section
    from driftlab.simulation.asynchronous import section as asynchronous_section
    from driftlab.simulation.time import section as time_section

    assert (PrivacyConfig, ADAPTIVE_KEYS) == (privacy_section.PrivacyConfig, privacy_section.ADAPTIVE_KEYS)
    assert (AsynchronousConfig, SystemConfig) == (asynchronous_section.AsynchronousConfig, time_section.SystemConfig)
    assert config_package.CompressionConfig is CompressionConfig
    # every feature's section type is listed and found, from the registry: none is named in the package
    for entry in FEATURES.values():
        if entry.section_type is not None:
            name = entry.section_type.__name__
            assert name in config_package.__all__ and name in dir(config_package)
            assert getattr(config_package, name) is entry.section_type
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchConfig'"):
        config_package.NoSuchConfig  # noqa: B018 - the lookup is what is tested
