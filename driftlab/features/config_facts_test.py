"""The features' config conflicts as data give the (key, message) pairs config validation listed when they were
written as code (``_privacy_conflicts``, ``_system_conflicts``): same keys, same words, same order.  (Checked over
1,536 combinations of sections against the old functions when they were replaced; two are kept here.)"""

from __future__ import annotations

from driftlab.experiments.config import load_config
from driftlab.experiments.config.schema import ExperimentConfig
from driftlab.features.config_facts import config_conflicts, present
from driftlab.features.registry import FEATURES


def _config(**sections) -> ExperimentConfig:
    table = load_config(None).to_dict()
    for key, value in sections.items():
        table[key] = {**table[key], **value} if isinstance(table.get(key), dict) and key != "algorithm" else value
    return ExperimentConfig.model_validate(table)


def test_everything_fedbuff_and_local_noise_cannot_take_at_once():
    config = _config(
        privacy={"clip": 1.0, "noise": "local", "noise_multiplier": 1.0},
        system={"deadline": 5.0, "over_selection": 0.5},
        asynchronous={"concurrency": 2, "buffer": 1},
        sampling={"mode": "poisson", "participation": 0.5},
        algorithm={"name": "efl"},  # its default compression ratio, 0.01
        availability={"inactive_probability": 0.1},
    )
    remove = "or remove [asynchronous]"
    assert config_conflicts(config, FEATURES.values()) == [
        (
            "privacy.noise",
            "local noise is drawn for the message a client sends, which compression (ratio 0.01) then cuts "
            'down, keeping part of the message and its noise: set compression.ratio = 1, or privacy.noise = "central"',
        ),
        (
            "system.over_selection",
            "a poisson cohort has no fixed size to over-select: set system.over_selection = 0, or "
            'sampling.mode = "uniform"',
        ),
        ("privacy", f"[privacy] is not accounted for asynchronous updates: remove [privacy], {remove}"),
        (
            "compression.ratio",
            "asynchronous messages are sent uncompressed (ratio 0.01, efl's default): set compression.ratio = 1, "
            f"{remove}",
        ),
        (
            "availability.inactive_probability",
            "an asynchronous client's availability and work come from [system] (its device "
            f"and trace windows): set availability.inactive_probability = 0, {remove}",
        ),
        (
            "system.deadline",
            "a deadline times synchronous rounds; an asynchronous server waits for its buffer: remove "
            f"system.deadline, {remove}",
        ),
        ("system.over_selection", f"over-selection is for synchronous rounds: set system.over_selection = 0, {remove}"),
        (
            "sampling.mode",
            "an asynchronous run dispatches idle clients uniformly, asynchronous.concurrency at a time, instead of "
            f'sampling poisson cohorts: set sampling.mode = "uniform", {remove}',
        ),
    ]


def test_fedbuff_without_the_clock_and_privacy_with_a_fixed_cohort():
    config = _config(
        asynchronous={"concurrency": 2, "buffer": 1},
        privacy={"clip": 1.0, "noise_multiplier": 1.0},  # central noise
        sampling={"mode": "uniform", "participation": 0.3},
    )
    assert "[system]" not in present(config) and "a fixed cohort accounted centrally" in present(config)
    assert config_conflicts(config, FEATURES.values()) == [
        (
            "sampling.mode",
            "central noise is accounted for clients sampled independently, not for a fixed cohort of 0.3 of "
            'them: set sampling.mode = "poisson" (or sampling.participation = 1)',
        ),
        (
            "asynchronous",
            "asynchronous rounds run on the simulated clock of [system]: add a [system] section (its defaults "
            "draw lognormal devices), or remove [asynchronous]",
        ),
        ("privacy", "[privacy] is not accounted for asynchronous updates: remove [privacy], or remove [asynchronous]"),
    ]
