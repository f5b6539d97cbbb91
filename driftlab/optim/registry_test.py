"""The server-optimizer registry: built-in entries and their [server] keys, chains stated in TOML (bit for bit the
named optimizers, checkpointed and resumed exactly), plugin optimizers and stages, and unchanged fingerprints."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors import safe_open

import driftlab
from driftlab.errors import ConfigError
from driftlab.experiments.config import config_from_record, describe_keys, load_config
from driftlab.experiments.pinned_runs_test import BASE as PINNED_BASE
from driftlab.experiments.pinned_runs_test import CASES as PINNED_CASES
from driftlab.optim import registry, server
from driftlab.optim.built_in import ScaleByMomentumConfig, SgdConfig
from driftlab.optim.registry import (
    ServerOptimizerConfig,
    ServerOptimizerEntry,
    TransformationConfig,
    TransformationEntry,
    build_server_optimizer,
)
from driftlab.simulation.state.checkpoint import state_to_tensors

TINY = [
    "rounds=4",
    "data.num_clients=6",
    "sampling.participation=0.5",
    "client.steps=3",
    "seed=1",
    "evaluation.every=2",
]

# A chain stated in TOML for each named optimizer, with the named optimizer's hyperparameters spelt out.
ADAM = ["server.optimizer=adam", "server.lr=0.01", "server.beta2=0.99"]
ADAM_CHAIN = [
    "server.optimizer=chain",
    "server.lr=0.01",
    'server.transforms=[{name="scale_by_adam", beta1=0.9, beta2=0.99, epsilon=1e-8}, '
    '{name="scale_by_learning_rate", bias_correction=true, beta1=0.9, beta2=0.99}]',
]
MOMENTUM = ["server.optimizer=momentum", "server.lr=0.5", "server.momentum=0.8"]
MOMENTUM_CHAIN = [
    "server.optimizer=chain",
    "server.lr=0.5",
    'server.transforms=[{name="scale_by_momentum", beta=0.8}, {name="scale_by_learning_rate"}]',
]


def _section(*overrides: str):
    return load_config(None, list(overrides)).server


def _updates(optimizer: server.ServerOptimizer, steps: int = 4) -> tuple[torch.Tensor, object]:
    generator = torch.Generator().manual_seed(7)
    params = torch.randn(23, generator=generator, dtype=torch.float64)
    state = optimizer.init(params)
    for _ in range(steps):
        params, state = optimizer.update(state, params, torch.randn(23, generator=generator, dtype=torch.float64), 0.05)
    return params, state


# ---------------------------------------------------------------- built-in entries and their keys


def test_the_built_in_optimizers_and_stages_in_order():
    assert registry.REGISTRY.built_in == ("sgd", "momentum", "adam", "adagrad", "yogi", "chain")
    assert registry.TRANSFORMATIONS.built_in == (
        "clip_by_global_norm",
        "scale_by_momentum",
        "scale_by_adam",
        "scale_by_adagrad",
        "scale_by_yogi",
        "scale_by_learning_rate",
    )
    applying = [name for name, entry in registry.TRANSFORMATIONS.entries.items() if entry.applies_lr]
    assert applying == ["scale_by_learning_rate"]


def test_each_optimizer_holds_exactly_its_keys_with_the_flat_sections_defaults():
    keys = {
        name: {key: info.default for key, info in registry.REGISTRY.entries[name].config_type.model_fields.items()}
        for name in ("sgd", "momentum", "adam", "adagrad", "yogi")
    }
    assert keys == {
        "sgd": {"lr": 1.0, "optimizer": "sgd"},
        "momentum": {"lr": 1.0, "optimizer": "momentum", "momentum": 0.9},
        "adam": {"lr": 1.0, "optimizer": "adam", "beta1": 0.9, "beta2": None, "epsilon": None, "bias_correction": True},
        "adagrad": {"lr": 1.0, "optimizer": "adagrad", "epsilon": None},  # not beta1: FedAdagrad's β1 is 0
        "yogi": {"lr": 1.0, "optimizer": "yogi", "beta1": 0.9, "beta2": None, "epsilon": None},
    }


@pytest.mark.parametrize(
    ("overrides", "name", "hyperparameters"),
    [
        ([], "sgd", {}),
        (["server.optimizer=momentum", "server.momentum=0.5"], "momentum", {"beta": 0.5}),
        (
            [
                "server.optimizer=adam",
                "server.beta1=0.25",
                "server.beta2=0.75",
                "server.epsilon=0.125",
                "server.bias_correction=false",
            ],
            "adam",
            {"beta1": 0.25, "beta2": 0.75, "epsilon": 0.125, "bias_correction": False},
        ),
        (["server.optimizer=adam"], "adam", {}),  # none: the optimizer's own defaults
        (["server.optimizer=adagrad", "server.epsilon=0.125"], "adagrad", {"epsilon": 0.125}),
        (
            ["server.optimizer=yogi", "server.beta1=0.25", "server.beta2=0.75", "server.epsilon=0.125"],
            "yogi",
            {"beta1": 0.25, "beta2": 0.75, "epsilon": 0.125},
        ),
    ],
)
def test_a_section_builds_its_optimizer_with_its_own_keys(overrides, name, hyperparameters):
    built = build_server_optimizer(_section(*overrides))
    direct = server.make_server_optimizer(name, **hyperparameters)
    assert built.name == name
    built_params, built_state = _updates(built)
    direct_params, direct_state = _updates(direct)
    assert torch.equal(built_params, direct_params)
    assert type(built_state) is type(direct_state)


def test_a_key_of_another_optimizer_is_refused_naming_its_owners():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["server.optimizer=adam", "server.momentum=0.5"])
    assert "server.momentum is a key of momentum, not of server.optimizer = 'adam'" in str(error.value)
    with pytest.raises(ConfigError, match=r"server.momentm: unknown key.*did you mean server.momentum\?"):
        load_config(None, ["server.optimizer=momentum", "server.momentm=0.5"])
    with pytest.raises(ConfigError, match=r"did you mean server.beta2 \(a key of server.optimizer = 'adam' or 'yogi'"):
        load_config(None, ["server.betaa=0.5"])
    with pytest.raises(ConfigError, match=r"unknown server optimizer 'adamm' \(did you mean 'adam'\?\)"):
        load_config(None, ["server.optimizer=adamm"])


def test_an_old_config_json_with_every_flat_key_at_its_default_still_reads():
    # config.json as runs wrote it before [server] was split (beta2 and epsilon none, so left out), read to resume
    flat = {"optimizer": "adam", "lr": 0.01, "momentum": 0.9, "beta1": 0.9, "bias_correction": True}
    assert config_from_record({"server": flat}).server == _section("server.optimizer=adam", "server.lr=0.01")
    flat = {"optimizer": "sgd", "lr": 1.0, "momentum": 0.9, "beta1": 0.9, "bias_correction": True}
    assert config_from_record({"server": flat}).server == SgdConfig()


def test_own_server_steps_keep_their_messages():
    with pytest.raises(ConfigError, match="feddyn has its own server step and does not use a server optimizer; use"):
        load_config(None, ["algorithm.name=feddyn", "server.optimizer=chain"])
    with pytest.raises(ConfigError, match="feddyn has its own server step; set server.lr = 1"):
        load_config(None, ["algorithm.name=feddyn", "server.lr=0.5"])


def test_describe_keys_lists_every_optimizer_and_stage_with_its_keys():
    text = describe_keys()
    assert '  server.optimizer = "sgd"' in text and "  server.lr = 1.0" in text
    assert "[server] when server.optimizer = 'momentum'" in text and "  server.momentum = 0.9" in text
    assert "[server] when server.optimizer = 'chain'" in text
    assert "[[server.transforms]] name = 'scale_by_learning_rate': a stage of optimizer = \"chain\"; applies" in text
    assert "  server.transforms[].max_norm = (required)" in text
    assert "  server.transforms[].initial_accumulator = 1e-06" in text


# ---------------------------------------------------------------- entries refuse what they cannot use


class _Tagged(ServerOptimizerConfig):
    optimizer: Literal["tagged"] = "tagged"


def test_an_entry_says_what_its_config_type_lacks():
    with pytest.raises(ValueError, match="must subclass driftlab.optim.registry.ServerOptimizerConfig"):
        ServerOptimizerEntry("plain", TransformationConfig, lambda section: server.sgd())
    with pytest.raises(ValueError, match='a field `optimizer: Literal\\["other"\\] = "other"`'):
        ServerOptimizerEntry("other", _Tagged, lambda section: server.sgd())
    with pytest.raises(ValueError, match="lower-case letters"):
        ServerOptimizerEntry("Tagged", _Tagged, lambda section: server.sgd())
    with pytest.raises(ValueError, match="must subclass driftlab.optim.registry.TransformationConfig"):
        TransformationEntry("tagged", _Tagged, lambda config: server.scale_by_learning_rate())
    with pytest.raises(ValueError, match="server optimizer name 'adam' is a built-in server optimizer"):
        registry.register(
            ServerOptimizerEntry(
                "adam",
                type(
                    "AdamToo",
                    (ServerOptimizerConfig,),
                    {"__annotations__": {"optimizer": Literal["adam"]}, "optimizer": "adam"},
                ),
                lambda section: server.sgd(),
            )
        )
    with pytest.raises(TypeError, match="takes a ServerOptimizerEntry or a TransformationEntry"):
        registry.register("adam")  # type: ignore[arg-type]


# ---------------------------------------------------------------- chains stated in TOML


def _chain(stage: dict, **learning_rate) -> list[dict]:
    """``stage``, then the stage that applies server.lr (with ``learning_rate``'s keys): a named optimizer's chain."""
    return [stage, {"name": "scale_by_learning_rate", **learning_rate}]


# each named optimizer's [server] keys, and the chain stated in TOML that is it
CHAINS = {
    "adam": (
        ["server.optimizer=adam", "server.beta2=0.99"],
        _chain({"name": "scale_by_adam", "beta2": 0.99}, bias_correction=True, beta2=0.99),
    ),
    "adam_without_correction": (
        ["server.optimizer=adam", "server.bias_correction=false", "server.epsilon=0.001"],
        _chain({"name": "scale_by_adam", "epsilon": 0.001}),
    ),
    "momentum": (
        ["server.optimizer=momentum", "server.momentum=0.8"],
        _chain({"name": "scale_by_momentum", "beta": 0.8}),
    ),
    "adagrad": (
        ["server.optimizer=adagrad", "server.epsilon=0.01"],
        _chain({"name": "scale_by_adagrad", "epsilon": 0.01}),
    ),
    "yogi": (["server.optimizer=yogi", "server.beta1=0.5"], _chain({"name": "scale_by_yogi", "beta1": 0.5})),
    "sgd": ([], [{"name": "scale_by_learning_rate"}]),
}


@pytest.mark.parametrize("key", CHAINS)
def test_a_toml_chain_of_the_named_optimizers_stages_is_it_bit_for_bit(key):
    named, stages = CHAINS[key]
    chained = build_server_optimizer(load_config({"server": {"optimizer": "chain", "transforms": stages}}).server)
    direct = build_server_optimizer(_section(*named))
    chained_params, chained_state = _updates(chained)
    direct_params, direct_state = _updates(direct)
    assert torch.equal(chained_params, direct_params)
    chained_tensors, direct_tensors = state_to_tensors(chained_state, "o"), state_to_tensors(direct_state, "o")
    assert chained_tensors.keys() == direct_tensors.keys()  # the same checkpoint keys: step, first_moment, ...
    assert all(torch.equal(chained_tensors[name], direct_tensors[name]) for name in direct_tensors)
    assert chained.plain_step == direct.plain_step == (key == "sgd")


def test_the_chain_the_registrys_docstring_shows_reads_as_array_of_tables(tmp_path):
    doc = registry.__doc__ or ""
    shown = doc[doc.index("      [server]") :]  # the module's example of a chain in TOML, up to the blank line
    path = tmp_path / "chain.toml"
    path.write_text(textwrap.dedent(shown[: shown.index("\n\n")]))
    section = load_config(path).server
    assert section.lr == 0.5 and [stage.name for stage in section.transforms] == [
        "clip_by_global_norm",
        "scale_by_momentum",
        "scale_by_learning_rate",
    ]
    assert section.transforms[1] == ScaleByMomentumConfig(beta=0.5)
    optimizer = build_server_optimizer(section)
    params = torch.zeros(4, dtype=torch.float64)
    state = optimizer.init(params)
    params, state = optimizer.update(state, params, torch.full((4,), 3.0, dtype=torch.float64), 0.5)
    # q = (3, 3, 3, 3), norm 6, cut to norm 2: (1, 1, 1, 1); v = 1·q'; θ = −0.5 v
    assert torch.equal(params, torch.full((4,), -0.5, dtype=torch.float64))
    assert torch.equal(state.velocity, torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize(
    ("transforms", "message"),
    [
        (
            '[{name="scale_by_momentum"}]',
            'one stage (scale_by_learning_rate), got 0: add a stage {name = "scale_by_learning_rate"}',
        ),
        ('[{name="scale_by_learning_rate"}, {name="scale_by_learning_rate"}]', "got 2: keep one of"),
        (
            '[{name="scale_by_momentm"}, {name="scale_by_learning_rate"}]',
            "stage 1 names 'scale_by_momentm' (did you mean 'scale_by_momentum'?)",
        ),
        (
            '[{name="scale_by_momentum", betaa=0.5}, {name="scale_by_learning_rate"}]',
            "stage 1 (scale_by_momentum): unknown key(s) betaa; its keys are: beta, nesterov (did you mean beta for",
        ),
        (
            '[{name="scale_by_momentum", beta=1.5}, {name="scale_by_learning_rate"}]',
            "stage 1 (scale_by_momentum): beta: Input should be less than 1",
        ),
        (
            '[{name="scale_by_learning_rate"}, {name="clip_by_global_norm"}]',
            "stage 2 (clip_by_global_norm): max_norm: Field required",
        ),
        (
            '[{name="scale_by_adam"}, {name="scale_by_yogi"}, {name="scale_by_learning_rate"}]',
            "stage 2 (scale_by_yogi) keeps its state under 'first_moment', as stage 1 (scale_by_adam) does",
        ),
        (
            '[{name="scale_by_learning_rate", beta2=0.99}]',
            "beta2 only set Adam's bias correction: add bias_correction = true",
        ),
        ("[]", "expected a non-empty list of tables"),
        ("[{beta=0.5}]", "stage 1 has no name, not a server transformation; valid: clip_by_global_norm"),
    ],
)
def test_a_chain_that_cannot_work_is_refused_saying_why(transforms, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["server.optimizer=chain", f"server.transforms={transforms}"])
    assert message in str(error.value)


def test_a_chain_run_equals_the_named_optimizers_run_bit_for_bit():
    for named, chained in ((ADAM, ADAM_CHAIN), (MOMENTUM, MOMENTUM_CHAIN)):
        direct = driftlab.run(None, overrides=[*TINY, *named])
        toml = driftlab.run(None, overrides=[*TINY, *chained])
        assert torch.equal(direct.final_params, toml.final_params), named[0]
        assert _without_wall_time(direct.records) == _without_wall_time(toml.records)


def _without_wall_time(records: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if key != "round_seconds"} for record in records]


def _metrics(out: Path) -> list[dict]:
    return _without_wall_time([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])


def test_a_chain_checkpoints_and_resumes_exactly(tmp_path):
    """A chain with state in two stages (moments, momentum-free clip) killed after round 3, checkpoint at 2, resumed."""
    overrides = [
        *TINY,
        "checkpoint_every=2",
        "server.optimizer=chain",
        "server.lr=0.01",
        'server.transforms=[{name="clip_by_global_norm", max_norm=0.5}, {name="scale_by_yogi"}, '
        '{name="scale_by_learning_rate"}]',
    ]
    out, killed, straight = tmp_path / "run", tmp_path / "killed", tmp_path / "straight"

    def snapshot(record):
        if record["round"] == 3:
            shutil.copytree(out, killed)

    driftlab.run(None, out, overrides=overrides, progress=snapshot)
    with safe_open(str(killed / "checkpoint.safetensors"), framework="pt") as handle:
        assert int(handle.metadata()["round"]) == 2
        assert any(key.endswith("second_moment") for key in handle.keys())
    assert not (killed / "final_model.safetensors").exists()
    resumed = driftlab.run(None, killed, resume=True, overrides=overrides)
    reference = driftlab.run(None, straight, overrides=overrides)
    assert [r["round"] for r in resumed.records] == [1, 2, 3, 4]
    assert _metrics(killed) == _metrics(straight)
    assert torch.equal(resumed.final_params, reference.final_params)


# ---------------------------------------------------------------- a plugin's optimizer and stage

PLUGIN = '''
"""signSGD on the server (Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", 2018):
a stage that keeps the sign of the update, and the optimizer that chains it with the rate."""
from typing import Literal

import torch

from driftlab.optim import server
from driftlab.optim.registry import (
    ServerOptimizerConfig, ServerOptimizerEntry, TransformationConfig, TransformationEntry, register,
)


class ScaleBySignConfig(TransformationConfig):
    name: Literal["scale_by_sign"] = "scale_by_sign"


def scale_by_sign(config=None):
    return server.UpdateTransformation(init=lambda params: {}, update=lambda u, state, step, lr: (torch.sign(u), {}))


class SignSgdConfig(ServerOptimizerConfig):
    optimizer: Literal["sign_sgd"] = "sign_sgd"


def build_sign_sgd(section):
    return server.chain(scale_by_sign(), server.scale_by_learning_rate(), name="sign_sgd")


class BrokenConfig(ServerOptimizerConfig):
    optimizer: Literal["broken_sgd"] = "broken_sgd"


def build_broken(section):
    raise RuntimeError("no such thing")


register(TransformationEntry("scale_by_sign", ScaleBySignConfig, scale_by_sign))
register(ServerOptimizerEntry("sign_sgd", SignSgdConfig, build_sign_sgd, label="signSGD"))
register(ServerOptimizerEntry("broken_sgd", BrokenConfig, build_broken))
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plugin") / "sign_sgd.py"
    path.write_text(PLUGIN)
    return str(path)


def test_a_plugin_optimizer_is_named_in_a_config_and_trained(plugin, tmp_path):
    overrides = [*TINY, f"plugins=[{json.dumps(plugin)}]", "server.lr=0.001"]
    out = tmp_path / "run"
    result = driftlab.run(None, out, overrides=[*overrides, "server.optimizer=sign_sgd"])
    assert json.loads((out / "config.json").read_text())["server"] == {"optimizer": "sign_sgd", "lr": 0.001}
    assert json.loads((out / "config.json").read_text())["plugins"] == [plugin]
    # the plugin's stage, chained in TOML, is the plugin's optimizer bit for bit; and neither is FedAvg's step
    chained = driftlab.run(
        None,
        overrides=[
            *overrides,
            "server.optimizer=chain",
            'server.transforms=[{name="scale_by_sign"}, {name="scale_by_learning_rate"}]',
        ],
    )
    assert torch.equal(result.final_params, chained.final_params)
    fedavg = driftlab.run(None, overrides=[*overrides, "server.optimizer=sgd"])
    assert not torch.equal(result.final_params, fedavg.final_params)
    one_step = build_server_optimizer(_section(f"plugins=[{json.dumps(plugin)}]", "server.optimizer=sign_sgd"))
    params = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    q = torch.tensor([3.0, -0.5, 0.0], dtype=torch.float64)
    params, _ = one_step.update(one_step.init(params), params, q, 0.25)
    assert torch.equal(params, torch.tensor([0.75, 1.25, 1.0], dtype=torch.float64))
    assert f"[server] when server.optimizer = 'sign_sgd': signSGD (plugin {plugin})" in describe_keys()


def test_a_plugin_optimizer_that_fails_to_build_is_named(plugin):
    with pytest.raises(ConfigError) as error:
        driftlab.run(None, overrides=[*TINY, f"plugins=[{json.dumps(plugin)}]", "server.optimizer=broken_sgd"])
    message = str(error.value)
    assert f"server optimizer plugin 'broken_sgd' ({plugin}): build failed: RuntimeError: no such thing" in message


def test_an_unknown_optimizer_says_how_a_plugin_adds_one():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["server.optimizer=lookahead"])
    assert "A server optimizer of your own is registered by a plugin" in str(error.value)


# ---------------------------------------------------------------- fingerprints from before [server] was split

FINGERPRINTS = {  # recorded with the flat [server] section, before this change
    ("synthetic-fedavg", ()): "78c71c838f8019a6",
    ("mnist-fedadam", ()): "e366e8c8ad9b6594",
    ("mnist-scaffold", ()): "6e4c7f1150e9cb5a",
    ("quadratic-decaying-k", ()): "dd27417c9e0465cc",
    (
        "synthetic-fedavg",
        (
            "server.optimizer=adam",
            "server.lr=0.01",
            "server.beta2=0.99",
            "server.epsilon=0.001",
            "server.bias_correction=false",
        ),
    ): "deb49ae754fd62bf",
    ("synthetic-fedavg", ("server.optimizer=momentum", "server.momentum=0.5")): "3b836e88990e65c0",
    ("synthetic-fedavg", ("server.optimizer=yogi", "server.beta1=0.8", "server.epsilon=0.01")): "007157d23f79d7ec",
    ("synthetic-fedavg", ("server.optimizer=adagrad", "server.epsilon=0.01", "server.lr=0.1")): "3cd0140f7f1781ae",
    ("synthetic-fedavg", ('server.lr={kind="exponential", initial=1.0, decay=0.99}',)): "ed5d0803960ab5f5",
}


@pytest.mark.parametrize(("source", "overrides"), list(FINGERPRINTS))
def test_fingerprints_are_those_of_the_flat_server_section(source, overrides):
    assert load_config(source, list(overrides)).fingerprint() == FINGERPRINTS[(source, overrides)]


def test_the_pinned_fedadam_and_fedavgm_cases_keep_their_fingerprints():
    assert PINNED_CASES["fedadam"] == ["algorithm.name=fedavg", "server.optimizer=adam", "server.lr=0.03"]
    assert PINNED_CASES["fedavgm"] == ["algorithm.name=fedavg", "server.optimizer=momentum", "server.lr=0.5"]
    assert load_config(None, [*PINNED_BASE, *PINNED_CASES["fedadam"]]).fingerprint() == "fe1d2d927decde56"
    assert load_config(None, [*PINNED_BASE, *PINNED_CASES["fedavgm"]]).fingerprint() == "84f5c7ea2b7d7cc7"


def test_the_chain_preset_states_fedavgm_with_clipping():
    config = load_config("synthetic-fedavgm-chain")
    assert config.server.optimizer == "chain" and config.server.lr == 0.5
    stages = [stage.name for stage in config.server.transforms]
    assert stages == ["clip_by_global_norm", "scale_by_momentum", "scale_by_learning_rate"]
    assert config.server.transforms[1] == ScaleByMomentumConfig(beta=0.9, nesterov=True)
    recorded = json.loads(json.dumps(config.to_dict()))  # as config.json holds it, every stage's keys spelt out
    assert recorded["server"]["transforms"][2] == {
        "name": "scale_by_learning_rate",
        "bias_correction": False,
        "beta1": 0.9,
        "beta2": 0.999,
    }
    assert config_from_record(recorded) == config
