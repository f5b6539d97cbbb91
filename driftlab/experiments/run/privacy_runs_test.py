"""Runs with ``[privacy]`` end to end: off is bit-identical, on is repeatable and resumable, ε is recorded and right,
a target ε is met, and every configuration privacy cannot serve is refused before any work, naming the fix."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

import driftlab
from driftlab.errors import ConfigError
from driftlab.experiments.cli_test import _assert_clean_error, driftlab_cli
from driftlab.experiments.config import load_config
from driftlab.features.run import feature_plan, feature_run_info
from driftlab.privacy import accounting

REPO_ROOT = Path(driftlab.__file__).resolve().parents[1]
NESTEROV_PLUGIN = REPO_ROOT / "examples" / "nesterov_plugin" / "nesterov_avg.py"

BASE = ["rounds=3", "data.num_clients=8", "sampling.participation=0.5", "client.steps=2", "seed=3"]
# Every built-in algorithm in a configuration that has a privacy form: uniform aggregation where it defaults to
# n_k weights, and EFL dropping stragglers (its adaptive weights E/s_k are unbounded); EFL keeps its default
# compression (ratio 0.01), so the compressed form is exercised too.
ALGORITHMS: dict[str, list[str]] = {
    "fedavg": ["algorithm.name=fedavg", "algorithm.aggregation=uniform"],
    "fedprox": ["algorithm.name=fedprox", "algorithm.mu=0.1", "algorithm.aggregation=uniform"],
    "scaffold": ["algorithm.name=scaffold"],
    "feddyn": ["algorithm.name=feddyn", "algorithm.alpha=0.01"],
    "adabest": ["algorithm.name=adabest", "algorithm.mu=0.02", "algorithm.beta=0.9", "algorithm.aggregation=uniform"],
    "efl": ["algorithm.name=efl", "algorithm.aggregation=uniform", "algorithm.incomplete=drop"],
}
OFF = ["privacy.clip=inf", "privacy.noise_multiplier=0"]
DELTA = 1e-3  # below 1/8
PRIVATE = ["privacy.clip=1", "privacy.noise_multiplier=1", f"privacy.delta={DELTA}", "sampling.mode=poisson"]
PRIVACY_METRICS = ("privacy_clip", "privacy_noise_std", "privacy_clipped_fraction")


def _without_wall_time(records: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if key != "round_seconds"} for record in records]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ off: bit-identical to a run without [privacy]


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_clip_inf_and_no_noise_is_bit_identical_to_no_privacy_section(name, backend):
    for sampling in (["sampling.mode=uniform"], ["sampling.mode=poisson"]):
        overrides = [*BASE, *ALGORITHMS[name], f"backend={backend}", *sampling]
        plain = driftlab.run(None, overrides=overrides)
        off = driftlab.run(None, overrides=[*overrides, *OFF])
        assert torch.equal(off.final_params, plain.final_params), (name, backend, sampling)
        assert len(off.records) == len(plain.records)
        for a, b in zip(plain.records, off.records, strict=True):
            assert {key: b[key] for key in a if key != "round_seconds"} == _without_wall_time([a])[0]
            # the fold's metrics are there every round, saying that nothing was clipped or noised (no clip at C = ∞)
            assert (b["privacy_noise_std"], b["privacy_clipped_fraction"]) == (0, 0) and "privacy_clip" not in b


def test_a_config_without_privacy_keeps_its_fingerprint_and_table():
    plain = load_config(None, BASE)
    assert "privacy" not in plain.to_dict()
    assert plain.privacy is None and feature_run_info(plain, "privacy", 8) == {}  # nor does its run.json change
    off = load_config(None, [*BASE, *OFF])
    assert off.fingerprint() != plain.fingerprint()  # [privacy] is part of the run's identity ...
    assert off.to_dict()["privacy"]["clip"] == "inf"  # ... and config.json stays strict JSON
    assert load_config(json.loads(json.dumps(off.to_dict(), allow_nan=False))) == off


def test_describe_keys_lists_the_privacy_keys():
    from driftlab.experiments.config import describe_keys

    text = describe_keys()
    assert "  privacy = none\n" in text and "\n[privacy]\n" in text
    for key in (
        "clip = inf",
        "noise_multiplier = 0.0",
        "target_epsilon = none",
        "delta = none",
        'accountant = "rdp"',
        'noise = "central"',
        "noise_cohort_size = none",
        "population = none",
        "adaptive = false",
        "target_quantile = 0.5",
        "clip_learning_rate = 0.2",
        "count_noise = none",
    ):
        assert f"  privacy.{key}\n" in text, key


# ------------------------------------------------------------------ on: repeatable, resumable, accounted


def test_a_private_run_is_repeatable_and_a_resumed_one_equals_an_uninterrupted_one(tmp_path):
    overrides = [
        *BASE,
        *ALGORITHMS["scaffold"],
        *PRIVATE,
        "rounds=5",
        "checkpoint_every=2",
        "backend=vectorized",
        "evaluation.instability_rounds=0",
    ]  # noise this large makes the loss rise: expected, no warning
    first = driftlab.run(None, tmp_path / "first", overrides=overrides)
    again = driftlab.run(None, overrides=overrides)
    assert torch.equal(first.final_params, again.final_params)
    assert _without_wall_time(first.records) == _without_wall_time(again.records)
    assert any(r["privacy_clipped_fraction"] > 0 for r in first.records)  # clip 1 clips some messages
    assert all(r["privacy_noise_std"] == 1.0 for r in first.records)  # z·C on the sum

    out, killed = tmp_path / "run", tmp_path / "killed"

    def snapshot(record):  # the directory as a SIGKILL right after round 3 leaves it (checkpoint at round 2)
        if record["round"] == 3:
            shutil.copytree(out, killed)

    driftlab.run(None, out, overrides=overrides, progress=snapshot)
    resumed = driftlab.run(None, killed, resume=True, overrides=overrides)
    assert torch.equal(resumed.final_params, first.final_params)
    assert _without_wall_time(_records(killed)) == _without_wall_time(first.records)

    other_seed = driftlab.run(None, overrides=[*overrides, "seed=4"])
    assert not torch.equal(other_seed.final_params, first.final_params)


def test_epsilon_rises_every_round_and_is_the_accountants_in_metrics_csv_trackers_and_run_json(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rounds, q, z = 4, 0.5, 1.0
    out = tmp_path / "run"
    result = driftlab.run(
        {"log": ["tensorboard"]}, out, overrides=[*BASE, *ALGORITHMS["fedavg"], *PRIVATE, f"rounds={rounds}"]
    )
    records = _records(out)
    epsilons = [r["privacy_epsilon"] for r in records]
    assert all(later > earlier for earlier, later in zip(epsilons, epsilons[1:], strict=False))
    assert epsilons == [accounting.epsilon(z, q, t, DELTA) for t in range(1, rounds + 1)]
    assert all(set(PRIVACY_METRICS) <= set(r) for r in records)

    info = json.loads((out / "run.json").read_text())
    assert info["privacy"] == {
        "noise_multiplier": z,
        "noise": "central",
        "accountant": "rdp",
        "delta": DELTA,
        "sampling_rate": q,
        "expected_cohort": 4.0,
        "population": 8,
        "rounds": rounds,
        "epsilon": epsilons[-1],
    }
    with open(out / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    for key in ("privacy_epsilon", *PRIVACY_METRICS):
        assert [float(row[key]) for row in rows] == [r[key] for r in records], key
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("privacy_epsilon")]
    assert [step for step, _ in logged] == list(range(1, rounds + 1))
    assert [value for _, value in logged] == pytest.approx(epsilons, rel=1e-6)  # tensorboard keeps float32
    assert result.records[-1]["privacy_epsilon"] == epsilons[-1]


def test_a_target_epsilon_is_spent_within_one_percent_and_run_json_has_the_noise_it_needed(tmp_path):
    target, rounds = 3.0, 4
    out = tmp_path / "run"
    overrides = [
        *BASE,
        *ALGORITHMS["fedavg"],
        f"rounds={rounds}",
        "sampling.mode=poisson",
        "privacy.clip=1",
        f"privacy.target_epsilon={target}",
        f"privacy.delta={DELTA}",
    ]
    result = driftlab.run(None, out, overrides=overrides)
    final = result.records[-1]["privacy_epsilon"]
    assert 0.99 * target <= final <= target
    z = json.loads((out / "run.json").read_text())["privacy"]["noise_multiplier"]
    assert z == accounting.noise_multiplier_for(target, DELTA, 0.5, rounds)
    assert result.records[0]["privacy_noise_std"] == z  # z·C with C = 1
    # its noise is computed for its rounds: raising them is another run, not a continuation
    assert load_config(None, overrides).fingerprint() != load_config(None, [*overrides, "rounds=8"]).fingerprint()


def test_local_noise_adaptive_clipping_and_a_noise_cohort_are_resolved_and_run(tmp_path):
    config = load_config(None, [*BASE, *ALGORITHMS["feddyn"], *PRIVATE, "privacy.noise=local"])
    assert driftlab.run(config).records[-1]["privacy_epsilon"] == accounting.local_epsilon(1.0, 3, DELTA)

    adaptive = [
        *BASE,
        *ALGORITHMS["fedavg"],
        "sampling.mode=poisson",
        "rounds=4",
        "privacy.clip=0.01",
        "privacy.adaptive=true",
        "privacy.noise_multiplier=1",
        "privacy.count_noise=1",
    ]
    clips = [r["privacy_clip"] for r in driftlab.run(None, overrides=adaptive).records]
    assert clips[0] == 0.01 and clips[-1] > clips[0]  # every norm is above 0.01: the clip grows toward the median
    default_count = [*adaptive, "privacy.count_noise=none", "privacy.noise_multiplier=0.1"]
    settings = feature_plan(load_config(None, default_count), "privacy", 8).settings
    assert settings.adaptive.count_noise == 4 / 20  # m/20 for the expected cohort m = q·N (Andrew et al. 2021)

    cohort = [*BASE, *ALGORITHMS["scaffold"], *PRIVATE, "privacy.noise_cohort_size=40", "privacy.population=800"]
    records = driftlab.run(None, overrides=cohort).records
    assert records[0]["privacy_noise_std"] == pytest.approx(1.0 * 4 / 40)  # z·C·m/M
    assert records[-1]["privacy_epsilon"] == accounting.epsilon(1.0, 40 / 800, 3, DELTA)


# ------------------------------------------------------------------ refused before any work


CONFIG_ERRORS = {
    "clip zero": (["privacy.clip=0"], "privacy.clip: Input should be greater than 0"),
    "clip negative": (["privacy.clip=-1"], "privacy.clip: Input should be greater than 0"),
    "noise without clipping": (["privacy.noise_multiplier=1", "sampling.mode=poisson"], "noise without clipping"),
    "delta of one": (["privacy.delta=1"], "privacy.delta: Input should be less than 1"),
    "delta zero": (["privacy.delta=0"], "privacy.delta: Input should be greater than 0"),
    "target and z": (
        [
            "privacy.clip=1",
            "privacy.target_epsilon=1",
            "privacy.noise_multiplier=1",
            "privacy.delta=1e-3",
            "sampling.mode=poisson",
        ],
        "give privacy.target_epsilon or privacy.noise_multiplier, not both",
    ),
    "target without delta": (
        ["privacy.clip=1", "privacy.target_epsilon=1", "sampling.mode=poisson"],
        "privacy.target_epsilon needs privacy.delta",
    ),
    "fixed cohort": (["privacy.clip=1", "privacy.noise_multiplier=1"], 'set sampling.mode = "poisson"'),
    "weighted sampling": (["privacy.clip=1", "sampling.mode=weighted"], 'set sampling.mode = "poisson"'),
    "membership": (
        ["privacy.clip=1", "availability.initially_registered=4"],
        "remove availability.initially_registered",
    ),
    "local noise compressed": (
        ["privacy.clip=1", "privacy.noise=local", "compression.ratio=0.5"],
        "set compression.ratio = 1",
    ),
    "population alone": (["privacy.population=100"], "set privacy.noise_cohort_size too"),
    "adaptive without a clip": (["privacy.adaptive=true"], "set it to a finite initial clip"),
    "adaptive key alone": (["privacy.clip=1", "privacy.target_quantile=0.9"], "set privacy.adaptive = true"),
    "unknown key": (["privacy.clipnorm=1"], "did you mean privacy.clip?"),
    "adaptive with local noise": (
        ["privacy.clip=1", "privacy.adaptive=true", "privacy.noise=local"],
        'set privacy.noise = "central", or privacy.adaptive = false',
    ),
    "noise cohort with local noise": (
        ["privacy.clip=1", "privacy.noise=local", "privacy.noise_cohort_size=100"],
        "privacy.noise_cohort_size calibrates the central noise",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_a_bad_privacy_setting_is_refused_when_the_config_is_read(case):
    overrides, phrase = CONFIG_ERRORS[case]
    with pytest.raises(ConfigError) as error:
        load_config(None, [*BASE, *ALGORITHMS["fedavg"], *overrides])
    assert phrase in str(error.value)


RUN_ERRORS = {
    "delta not below 1/N": (["privacy.clip=1", "privacy.delta=0.2"], "privacy.delta = 0.2 is not below 1/N = 0.125"),
    "unreachable target": (
        ["privacy.clip=1", "privacy.target_epsilon=1e-5", "privacy.delta=1e-3", "sampling.participation=1"],
        "no noise multiplier up to 1e3 reaches ε = 1e-05",
    ),
    "weighted aggregation": (
        ["algorithm.aggregation=weighted", "privacy.clip=1"],
        'set algorithm.aggregation = "uniform"',
    ),
    "efl adaptive stragglers": (
        ["algorithm.name=efl", "algorithm.aggregation=uniform", "algorithm.incomplete=adaptive", "privacy.clip=1"],
        'set algorithm.incomplete = "drop"',
    ),
    "plugin without a form": (
        [f'plugins=["{NESTEROV_PLUGIN}"]', "algorithm.name=nesterov_avg", "privacy.clip=1"],
        "release=ReleaseForm(release, restore)",
    ),
    "count noise too small": (
        [
            "privacy.clip=1",
            "privacy.noise_multiplier=1",
            "sampling.mode=poisson",
            "privacy.adaptive=true",
            "privacy.count_noise=0.4",
        ],
        "raise privacy.count_noise",
    ),
}


@pytest.mark.parametrize("case", list(RUN_ERRORS))
def test_what_needs_the_data_or_the_algorithm_is_refused_before_the_first_round(tmp_path, case):
    overrides, phrase = RUN_ERRORS[case]
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as error:
        driftlab.run(None, out, overrides=[*BASE, *ALGORITHMS["fedavg"], *overrides])
    assert phrase in str(error.value) and "\n" not in str(error.value)
    assert not (out / "metrics.jsonl").exists()


def test_driftlab_run_exits_2_with_the_one_line_of_a_refused_privacy_setting(tmp_path):
    out = tmp_path / "run"
    overrides = [*BASE, "client.epochs=none", "privacy.clip=1"]
    result = driftlab_cli("run", "synthetic-fedavg", *overrides, "--out", out, "--quiet")
    _assert_clean_error(result, 'set algorithm.aggregation = "uniform"')
    assert result.stderr.count("\n") == 1
    assert not out.exists() or not any(out.iterdir())  # a refused new run leaves nothing
