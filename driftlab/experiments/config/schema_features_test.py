"""``ExperimentConfig``'s optional feature sections come from the feature registry (``driftlab.features.registry``),
and every shipped preset reads and hashes as it did when they were written into the class by hand: ``to_dict`` and
``fingerprint`` below were recorded from the hand-written class before the change (so old run directories resume and
sweeps keep their run ids), as were the field order and the JSON schema (descriptions, defaults)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from driftlab.experiments.config import ExperimentConfig, load_config
from driftlab.experiments.config.schema_test import PINNED
from driftlab.features.registry import FEATURES

PRESETS = Path(__file__).resolve().parent.parent / "presets"
# demo-synthetic with each optional section set (a target ε's rounds enter the fingerprint)
EXTRA = {
    "privacy+system": [
        "privacy.clip=1",
        "privacy.noise_multiplier=0.5",
        "privacy.delta=1e-5",
        "system.speed_median=50",
        "sampling.mode=poisson",
        "sampling.participation=0.5",
    ],
    "asynchronous": ["system.speed_median=50", "asynchronous.concurrency=4", "asynchronous.buffer=2"],
    "target-epsilon": [
        "privacy.clip=1",
        "privacy.target_epsilon=8",
        "privacy.delta=1e-5",
        "sampling.mode=poisson",
        "sampling.participation=0.5",
    ],
}
SCHEMA = "9ec04b4d858bf004"  # sha256 of the JSON schema, sorted keys, first 16 hex digits (evaluation.stop_at added;
# a section docstring names driftlab.experiments.run.compatibility since experiments/ went into folders; moved on
# purpose 2026-12-02: the [personal_layers], [robust] and [attack] sections, resnet18_bn, data.client_choice and
# cifar100_pfllib, the release-form wording of descriptions; then, on purpose, issue 40's convolution choices
# channels_last and mixed, e79f52631a2b0fed before)
# name -> sha256 of json.dumps(to_dict()) (keys in field order, values by repr), first 16 hex digits; with the
# fingerprint it is checked beside: a preset's is schema_test's pin, the EXTRA configs' are here
TO_DICT = {
    "cifar10-feddyn": "afc69fae06d4bf5a",
    "demo-synthetic": "b6a07efdd4456de1",
    "mnist-adabest": "ded0d9b7b7a45476",
    "mnist-efl": "4eeb3270cfb0e6e8",
    "mnist-fedadam": "b11e171cbf6fee93",
    "mnist-fedavg": "98ecc2fd157d3ef1",
    "mnist-feddyn": "afb4aee6ac5b15af",
    "mnist-scaffold": "7a57357251a10042",
    "quadratic-constant-k": "d8eb817b654ac3c9",
    "quadratic-decaying-k": "02bc4f597c6017d1",
    "shakespeare-feddyn": "bd42fec09491707e",
    "synthetic-dp-scaffold": "cbab887326f34310",
    "synthetic-efl-low-participation": "b57ff8ab56bd03fb",
    "synthetic-fedavg": "f29aa8a5a12dde45",
    "synthetic-fedavgm-chain": "d1eb7216962b6b3c",
    "synthetic-fedbuff": "12676e3c94c057e0",
    "synthetic-fedprox": "bc5d17d3c7f92843",
    "privacy+system": "441e2562020e6710",
    "asynchronous": "dced8b3bd2849be2",
    "target-epsilon": "83479eaf89f88078",
    "cifar10-fedbn": "1873649142dd48ee",
    "cifar10-fedper": "3e1595eae4377241",
    "cifar10-fedrep": "ad223b60115803e1",
    "cifar10-lg-fedavg": "ebff7a91e98a0ddb",
}
EXTRA_FINGERPRINTS = {
    "privacy+system": "9055890b69a05a91",
    "asynchronous": "607f4be7f556262f",
    "target-epsilon": "7090f2bb51bebaf1",
}
EXPECTED = {
    name: (digest, EXTRA_FINGERPRINTS[name] if name in EXTRA else PINNED[name][1]) for name, digest in TO_DICT.items()
}


def _digests(config: ExperimentConfig) -> tuple[str, str]:
    return hashlib.sha256(json.dumps(config.to_dict(), default=repr).encode()).hexdigest()[:16], config.fingerprint()


def test_every_shipped_preset_is_listed():
    assert {path.stem for path in PRESETS.glob("*.toml")} == set(EXPECTED) - set(EXTRA)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_to_dict_and_fingerprint_are_as_recorded(name):
    config = (
        load_config(str(PRESETS / f"{name}.toml"))
        if name not in EXTRA
        else load_config(str(PRESETS / "demo-synthetic.toml"), EXTRA[name])
    )
    assert _digests(config) == EXPECTED[name]


def test_the_schema_is_as_recorded():
    # the fields' order is pinned once, by schema_test.test_the_sections_keep_their_order
    schema = json.dumps(ExperimentConfig.model_json_schema(), sort_keys=True)
    assert hashlib.sha256(schema.encode()).hexdigest()[:16] == SCHEMA


def test_the_optional_sections_are_the_registrys():
    optional = [name for name, entry in FEATURES.items() if entry.config_field is not None]
    assert optional == ["personal_layers", "privacy", "system", "asynchronous", "robust", "attack"]
    for name in optional:
        field = ExperimentConfig.model_fields[name]
        assert field.default is None and FEATURES[name].section_type in field.annotation.__args__
        assert field.description == FEATURES[name].config_field
