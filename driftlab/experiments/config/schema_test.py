"""The schema's layout is pinned: every shipped preset's ``to_dict()`` (its config.json) and fingerprint are the ones
recorded before ``experiments/config.py`` became a package and the feature sections moved into their packages.

A change of field order or of a default changes ``to_dict()``, and a fingerprint changes which old runs resume; a
new preset is pinned by adding its line (computed with ``_pins``), an existing pin is never updated.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from driftlab.experiments.config import ExperimentConfig, load_config
from driftlab.experiments.sweep.shipped import preset_names

# preset -> (sha256 of to_dict() as sorted JSON, first 16 hex digits; fingerprint())
PINNED = {
    "cifar10-feddyn": ("544a51fc4dc3024e", "09c71e7594b120e7"),
    "demo-synthetic": ("5b135d87fa4efab9", "cbc9307fcd342276"),
    "mnist-adabest": ("b47a22647a0e1e79", "a2d3ecd831ea796b"),
    "mnist-efl": ("fc47e4e05b09c37c", "62b0bcf50c67fd28"),
    "mnist-fedadam": ("8c2afde5079ff5d8", "e366e8c8ad9b6594"),
    "mnist-fedavg": ("7457e81a769acc5d", "6be9a5c5a2cd4c9a"),
    "mnist-feddyn": ("716ee750a1ae2273", "c34969e46c80121c"),
    "mnist-scaffold": ("36709b8ed2d34379", "6e4c7f1150e9cb5a"),
    "quadratic-constant-k": ("1758d09cb03db06a", "eed311588efc7ee6"),
    "quadratic-decaying-k": ("20813f60d04afb47", "dd27417c9e0465cc"),
    "shakespeare-feddyn": ("0ccb511606a67b70", "f5cab79f3946de9e"),
    "synthetic-dp-scaffold": ("ca29ed2a9d2e3699", "22659ede8454ae65"),
    "synthetic-efl-low-participation": ("47d9175e46fd3b98", "d1b75e4ffcbf2336"),
    "synthetic-fedavg": ("e6bf28e62a93759a", "78c71c838f8019a6"),
    "synthetic-fedavgm-chain": ("23cc19c9ef60ad9a", "b03ad892fdc5fe2c"),
    "synthetic-fedbuff": ("96eb208097d4fb56", "9e1d8e13b85acd88"),
    "synthetic-fedprox": ("aeb5ed2031a95a72", "3408a0cf8d96f2ce"),
    "cifar10-fedbn": ("fd01ca4468548e76", "76138b290c75cff0"),
    "cifar10-fedper": ("d04407db59a71719", "863c21ead5dd2880"),
    "cifar10-fedrep": ("9ef3318a0d60ed49", "0a97934597142465"),
    "cifar10-lg-fedavg": ("ddb4ce8fac90f891", "b96d64f52430ed02"),
}
DEFAULTS = ("6b30b74676d75f58", "ea8971b1a98a1a71")


def _pins(config: ExperimentConfig) -> tuple[str, str]:
    table = json.dumps(config.to_dict(), sort_keys=True).encode()
    return hashlib.sha256(table).hexdigest()[:16], config.fingerprint()


def test_every_shipped_preset_is_pinned():
    assert sorted(PINNED) == preset_names()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_presets_config_json_and_fingerprint_are_unchanged(name):
    assert _pins(load_config(name)) == PINNED[name]


def test_the_defaults_config_json_and_fingerprint_are_unchanged():
    assert _pins(load_config(None)) == DEFAULTS


def test_the_sections_keep_their_order():
    assert list(ExperimentConfig.model_fields) == [
        "seed",
        "rounds",
        "device",
        "precision",
        "convolution",
        "backend",
        "checkpoint_every",
        "keep_checkpoint",
        "data",
        "model",
        "plugins",
        "algorithm",
        "client",
        "server",
        "sampling",
        "availability",
        "compression",
        "evaluation",
        "state",
        "personal_layers",
        "privacy",
        "system",
        "asynchronous",
        "robust",
        "attack",
        "memory_budget",
        "log",
    ]


def test_the_convolution_choices_are_the_batched_layers():
    from typing import Literal, get_args, get_origin

    from driftlab.models.layers import CONVOLUTIONS

    choices = [
        arm for arm in get_args(ExperimentConfig.model_fields["convolution"].annotation) if arm is not type(None)
    ]
    assert len(choices) == 1 and get_origin(choices[0]) is Literal and get_args(choices[0]) == CONVOLUTIONS
    for kind in CONVOLUTIONS[1:]:
        assert load_config(None, [f"convolution={kind}"]).convolution == kind
