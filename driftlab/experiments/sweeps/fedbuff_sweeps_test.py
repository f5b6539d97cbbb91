"""The shipped simulated-time sweeps and preset compare what they say (issue 28).

``fedbuff-femnist``: every arm meets the same devices and differs only in how the server aggregates; the synchronous
cohort is FedBuff's buffer.  ``decaying-k-time``: decaying-k-femnist with a clock, nothing else.  The numbers the
descriptions state are the timing model's.  (Every shipped sweep is also planned at each of its scales by
``driftlab/experiments/sweep/sweep_test.py``.)
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from driftlab.experiments.config import load_config
from driftlab.experiments.run.assembly import build_configured_model, check_features, load_data
from driftlab.experiments.run.datasets import data_location
from driftlab.experiments.sweep import load_sweep, plan
from driftlab.experiments.sweep.shipped import preset_description
from driftlab.simulation.round.sampling import clients_per_round
from driftlab.simulation.time.clock import client_timing
from driftlab.simulation.time.plan import DeviceProfile

SYNCHRONOUS = "FedAvg, synchronous"
MEDIAN_DEVICE = DeviceProfile(speed=100.0, download=2e7, upload=5e6)  # [system]'s default medians


def _runs(name: str, scale: str | None):
    return plan(load_sweep(name), scale)


def _text(name: str) -> str:
    return " ".join(load_sweep(name).description.split())


def _femnist_cnn_floats() -> int:
    config = load_config("mnist-fedavg", ["data.name=femnist", "model.name=femnist_cnn"])
    return sum(p.numel() for p in build_configured_model(config, (1, 28, 28), 62).parameters())


@pytest.mark.parametrize("scale", [None, "paper"])
def test_fedbuff_arms_meet_the_same_devices_and_differ_only_in_aggregation(scale):
    runs = _runs("fedbuff-femnist", scale)
    by_seed: dict[int, dict[str, dict]] = {}
    for run in runs:
        by_seed.setdefault(run.seed, {})[run.method] = run.config.model_dump()
    assert sorted(by_seed) == [0, 1, 2]  # at both scales
    for seed, arms in by_seed.items():
        assert set(arms) == {SYNCHRONOUS, "FedBuff C=10 B=10", "FedBuff C=30 B=10"}, seed
        synchronous = arms[SYNCHRONOUS]
        assert synchronous["system"] is not None and synchronous["system"]["profiles"] == "lognormal"
        assert synchronous["asynchronous"] is None
        for label, arm in arms.items():
            # the devices ([system], drawn from the seed), the data, the model, the local work and the server rule
            assert arm["system"] == synchronous["system"] and arm["seed"] == seed, label
            assert arm["algorithm"] == {**synchronous["algorithm"], "aggregation": "uniform"}, label
            rest = {key: value for key, value in arm.items() if key not in ("sampling", "asynchronous")}
            assert rest == {
                key: value for key, value in synchronous.items() if key not in ("sampling", "asynchronous")
            }, label
            if label != SYNCHRONOUS:
                concurrency = int(re.search(r"C=(\d+)", label).group(1))
                assert arm["asynchronous"] == {"concurrency": concurrency, "buffer": 10, "staleness": "sqrt"}, label
                assert arm["sampling"] == {"participation": 0.1, "mode": "uniform"}  # the defaults FedBuff asks for


@pytest.mark.parametrize("scale", [None, "paper"])
def test_the_synchronous_cohort_is_fedbuffs_buffer_and_every_fedbuff_arm_may_run_asynchronously(scale):
    for run in _runs("fedbuff-femnist", scale):
        config = run.config
        check_features(config, only="asynchronous")  # raises ConfigError when the algorithm has no asynchronous rule
        if config.asynchronous is None:
            assert clients_per_round(config.sampling.participation, config.data.num_clients) == 10
        else:
            assert config.asynchronous.buffer == 10 and config.asynchronous.buffer <= config.asynchronous.concurrency


def test_fedbuff_description_states_the_sweeps_settings_and_the_timing_models_seconds():
    text = _text("fedbuff-femnist")
    default, paper = _runs("fedbuff-femnist", None), _runs("fedbuff-femnist", "paper")
    assert {(r.config.rounds, r.config.evaluation.every, r.config.client.lr) for r in default} == {(200, 5, 0.2)}
    assert "200 in every arm, test accuracy every 5, 3 seeds" in text and "client lr 0.2" in text
    assert {(r.config.rounds, r.config.client.lr, r.config.server.lr, r.config.server.momentum) for r in paper} == {
        (600, 0.1, 0.7, 0.9)
    }
    assert "(client lr 0.1, server momentum 0.9 at lr 0.7) in every arm, 600 updates, 3 seeds" in text
    assert load_sweep("fedbuff-femnist").targets == (0.6, 0.7) and "to 60% and 70%" in text

    floats = _femnist_cnn_floats()
    assert f"{floats:,} floats" in text
    timing = client_timing(MEDIAN_DEVICE, floats * 32, steps=5, samples_per_step=32, upload_bits=floats * 32)
    assert f"{timing.download:.1f} s down and {timing.upload:.1f} s up" in text
    assert f"a median writer's epoch {timing.compute:.1f} s" in text


def test_a_median_writer_does_five_steps_of_batch_32_in_one_epoch():
    run = _runs("fedbuff-femnist", None)[0]
    if data_location(run.config.data) is None:
        pytest.skip("the FEMNIST sample is not on this machine")
    sizes = load_data(run.config).client_sizes
    median = int(np.median(sizes))
    assert median == 152 and -(-median // run.config.client.batch_size) == 5  # ⌈152 / 32⌉ steps of 32 examples


@pytest.mark.parametrize("scale", [None, "paper"])
def test_decaying_k_time_is_decaying_k_femnist_with_a_clock(scale):
    timed, untimed = _runs("decaying-k-time", scale), _runs("decaying-k-femnist", scale)
    assert [(r.method, r.seed) for r in timed] == [(r.method, r.seed) for r in untimed]
    for clocked, plain in zip(timed, untimed, strict=True):
        with_clock, without = clocked.config.model_dump(), plain.config.model_dump()
        assert with_clock.pop("system") == {**with_clock_defaults(), "profiles": "lognormal"}
        assert without.pop("system") is None
        assert with_clock == without, clocked.method
    spec, reference = load_sweep("decaying-k-time"), load_sweep("decaying-k-femnist")
    assert spec.steps_reference == reference.steps_reference
    assert spec.targets == (*reference.targets, 0.8)  # 80%: where decaying K's shorter rounds pay off


def with_clock_defaults() -> dict:
    return load_config("synthetic-fedavg", ["system.profiles=lognormal"]).model_dump()["system"]


def test_decaying_k_time_description_states_the_timing_models_seconds():
    text = _text("decaying-k-time")
    floats = _femnist_cnn_floats()
    timing = client_timing(MEDIAN_DEVICE, floats * 32, steps=10, samples_per_step=32, upload_bits=floats * 32)
    assert f"{floats:,} floats ({timing.download:.1f} s down and {timing.upload:.1f} s up" in text
    assert f"against {timing.compute:.1f} s for a median device's 10 steps of batch 32" in text


def test_the_synthetic_fedbuff_preset_reaches_its_target_when_it_says_and_sooner_than_synchronous_fedavg():
    import driftlab

    config = load_config("synthetic-fedbuff")
    assert (config.asynchronous.concurrency, config.asynchronous.buffer) == (20, 10) and config.system is not None
    check_features(config, only="asynchronous")
    description = preset_description("synthetic-fedbuff")
    stated = re.search(r"after (\d+) simulated seconds, synchronous FedAvg .* after (\d+)\.", description)
    # each run stops a little after the update its description names: the records before are the full run's
    fedbuff = driftlab.run("synthetic-fedbuff", overrides=["rounds=60"]).summary
    synchronous_config = load_config("synthetic-fedbuff", ["asynchronous=none", "rounds=100"])
    assert clients_per_round(synchronous_config.sampling.participation, synchronous_config.data.num_clients) == 10
    synchronous = driftlab.run(synchronous_config).summary
    assert round(fedbuff["time_to_target"]) == int(stated.group(1))
    assert round(synchronous["time_to_target"]) == int(stated.group(2))
    assert fedbuff["time_to_target"] < synchronous["time_to_target"]
