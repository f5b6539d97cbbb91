"""Every pair of optional features, and every feature with every built-in algorithm, either runs a round or is refused
with a message naming both (the one refusal template, ``driftlab.features.capabilities.refusal``, or a config
conflict keyed by one and naming the other).  A run is one round of the 1-D quadratics on four clients."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

import driftlab
from driftlab.algorithms import registry

BASE = {
    "seed": 0,
    "rounds": 1,
    "precision": "float64",
    "data": {"name": "quadratic1d", "num_clients": 4},
    "model": {"name": "quadratic"},
    "client": {"lr": 0.1, "batch_size": 1000, "steps": 2},
    "sampling": {"participation": 1.0},
    "evaluation": {"every": 1},
    "algorithm": {"name": "fedavg", "aggregation": "uniform"},  # the one algorithm every feature takes
}

# Each feature's smallest section, and how a message names it.  FedBuff needs the simulated clock, so it brings it.
FEATURES = {
    "privacy": ({"privacy": {"clip": 1.0}}, r"privacy"),
    "compression": ({"compression": {"ratio": 0.5}}, r"compression"),
    "system": ({"system": {}}, r"\[system\]|system\."),
    # (an algorithm the clock refuses is refused naming [system], before FedBuff, as the registry orders them)
    "asynchronous": ({"system": {}, "asynchronous": {"concurrency": 2, "buffer": 1}}, r"asynchronous|\[system\]"),
    "personal": (
        {"data": {"client_test_fraction": 0.5}, "evaluation": {"finetune_steps": 1}},
        r"evaluation\.(personal|finetune_steps)",
    ),
    "personal_layers": ({"data": {"client_test_fraction": 0.5}, "personal_layers": {"keep": []}}, r"personal_layers"),
    "robust": ({"robust": {"aggregator": "median"}}, r"\[robust\]|robust\."),
    "attack": ({"attack": {"kind": "sign_flip", "fraction": 0.25}}, r"\[attack\]|attack\."),
}


def _config(*fragments: dict) -> dict:
    config: dict = {key: dict(value) if isinstance(value, dict) else value for key, value in BASE.items()}
    for fragment in fragments:
        for key, value in fragment.items():
            config[key] = (
                dict(value) if key == "algorithm" else {**config.get(key, {}), **value}
            )  # an algorithm's own defaults
    return config


def _runs_or_names(config: dict, *names: str) -> None:
    try:
        result = driftlab.run(config)
    except driftlab.ConfigError as error:
        message = str(error)
        for name in names:
            assert re.search(name, message), (name, message)
        return
    assert len(result.records) == 1 and torch.isfinite(result.final_params).all()


@pytest.mark.parametrize(("first", "second"), list(itertools.combinations(FEATURES, 2)))
def test_every_pair_of_features_runs_or_is_refused_naming_both(first, second):
    (one, one_name), (other, other_name) = FEATURES[first], FEATURES[second]
    _runs_or_names(_config(one, other), one_name, other_name)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("algorithm", [name for name in registry.ALGORITHMS if name in registry.BUILT_IN] or ["fedavg"])
def test_every_feature_with_every_algorithm_runs_or_is_refused_naming_both(feature, algorithm):
    fragment, name = FEATURES[feature]
    named = rf'algorithm\.name = "{algorithm}"|algorithm {algorithm!r}|{algorithm}\b'
    _runs_or_names(_config(fragment, {"algorithm": {"name": algorithm}}), name, named)


def test_the_pairs_that_run_do_run():
    # a check that the test above is not refusing everything: these pairs are supported
    for fragments in [
        (FEATURES["privacy"][0], FEATURES["system"][0]),
        (FEATURES["compression"][0], FEATURES["personal"][0]),
    ]:
        result = driftlab.run(_config(*fragments))
        assert len(result.records) == 1
    assert len(driftlab.run(_config(FEATURES["asynchronous"][0])).records) == 1
