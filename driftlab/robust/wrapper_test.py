"""``with_robust_aggregation`` and the ``[robust]`` entry: hand-computed rounds, the mean's equivalence, centered
clipping's state through a checkpoint, the plan's checks and the refusals."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import driftlab
from driftlab.algorithms import fedavg, scaffold
from driftlab.attacks.model_updates import SignFlip
from driftlab.attacks.wrapper import with_attack
from driftlab.errors import ConfigError
from driftlab.experiments.run.assembly import build_simulation
from driftlab.experiments.run.testing import quadratic_run, run_records, without_wall_time
from driftlab.features.entry import RunFacts
from driftlab.optim.server import make_server_optimizer
from driftlab.robust import CenteredClipping, Krum, Median, NormBound
from driftlab.robust.feature import FEATURE, REQUIREMENTS
from driftlab.robust.section import RobustConfig
from driftlab.robust.testing import one_round
from driftlab.robust.wrapper import RobustServerState, with_robust_aggregation
from driftlab.simulation.round.engine import run_round

# Five clients' models after local training from θ = 0; client 4 flips its sign.
FINALS = [[1.0, 0.0], [2.0, 1.0], [3.0, 0.0], [4.0, 2.0], [5.0, 1.0]]


def fedavg_uniform():
    return fedavg.build(make_server_optimizer("sgd"), aggregation="uniform")


def test_a_sign_flipper_moves_the_mean_wrong_and_not_the_median():
    attacked = with_attack(fedavg_uniform(), SignFlip(), frozenset({4}), start_round=1, seed=0)
    server, metrics = one_round(attacked, FINALS)
    # mean of (1,0), (2,1), (3,0), (4,2), (−5,−1) = (5, 2)/5; honest it would be (3, 0.8)
    assert torch.allclose(server.params, torch.tensor([1.0, 0.4], dtype=torch.float64))
    assert metrics["attack_byzantine_messages"] == 1.0
    defended = with_attack(with_robust_aggregation(fedavg_uniform(), Median()), SignFlip(), frozenset({4}), 1, 0)
    server, metrics = one_round(defended, FINALS)
    # per coordinate: median(−5, 1, 2, 3, 4) = 2, median(−1, 0, 0, 1, 2) = 0
    assert torch.allclose(server.params, torch.tensor([2.0, 0.0], dtype=torch.float64))
    # the middle values are client 1's (coordinate 0) and client 2's (coordinate 1): each kept in half
    assert metrics["robust_dropped"] == 3.0 and metrics["robust_down_weighted"] == 2.0


def test_krum_keeps_one_client_and_says_it_dropped_the_rest():
    server, metrics = one_round(with_robust_aggregation(fedavg_uniform(), Krum(byzantine=1)), FINALS)
    # n − f − 2 = 2 nearest squared distances: scores 2+4, 2+2, 2+4, 2+5, 2+5: client 1 wins
    assert torch.equal(server.params, torch.tensor([2.0, 1.0], dtype=torch.float64))
    assert metrics["robust_dropped"] == 4.0


@pytest.mark.parametrize("build", [fedavg_uniform, lambda: scaffold.build(make_server_optimizer("sgd"))])
def test_a_rule_that_keeps_every_update_whole_gives_the_algorithms_own_update(build):
    plain, plain_metrics = one_round(build(), FINALS)
    robust, metrics = one_round(with_robust_aggregation(build(), NormBound(max_norm=1e9)), FINALS)
    assert isinstance(robust, RobustServerState) and robust.centre is None
    for name in ("params", "control"):
        if hasattr(plain, name):  # SCAFFOLD's c ← c + Σ_P Δc_k / N too: the carrier holds n times the aggregate
            assert torch.allclose(getattr(robust.inner, name), getattr(plain, name), atol=1e-12)
    assert {
        key: value for key, value in metrics.items() if not key.startswith("robust_")
    }.keys() == plain_metrics.keys()


def test_centered_clipping_carries_its_centre_and_momenta_in_the_server_state():
    rule = CenteredClipping(radius=1.0, momentum=0.5)
    algorithm = with_robust_aggregation(fedavg_uniform(), rule)
    first, _ = one_round(algorithm, [[1.0, 0.0], [0.0, 0.0]], ids=[0, 3])
    # v⁰ = 0, m = x: clip((1,0)) = (1,0), clip(0) = 0, v¹ = ((1,0) + 0)/2
    assert torch.allclose(first.centre, torch.tensor([0.5, 0.0], dtype=torch.float64))
    assert first.seen.tolist() == [True, False, False, True] and first.momenta.shape == (4, 2)
    second, _ = one_round(algorithm, [[3.0, 0.0]], server=first, round_index=2, ids=[0])
    # client 0's change from θ = (0.5, 0): x = (2.5, 0); m = ½ x + ½ (1, 0) = (1.75, 0); clip(m − v) = (1, 0)
    assert torch.allclose(second.centre, torch.tensor([1.5, 0.0], dtype=torch.float64))
    assert torch.allclose(second.momenta[0], torch.tensor([1.75, 0.0], dtype=torch.float64))
    assert torch.equal(second.momenta[3], first.momenta[3])


def _config(**sections) -> dict:
    return quadratic_run(6, 4, 3) | sections


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_a_resumed_run_with_centered_clipping_equals_an_uninterrupted_one(tmp_path, backend):
    robust = {"aggregator": "centered_clipping", "radius": 0.05, "momentum": 0.9, "iterations": 2}
    config = _config(robust=robust, attack={"kind": "sign_flip", "fraction": 0.34}, rounds=5, checkpoint_every=2,
                     backend=backend, evaluation={"instability_rounds": 0})  # fmt: skip
    first = driftlab.run(config, tmp_path / "first")
    assert any(record["robust_down_weighted"] > 0 for record in first.records)
    out, killed = tmp_path / "run", tmp_path / "killed"

    def snapshot(record):  # the directory as a SIGKILL right after round 3 leaves it (checkpoint at round 2)
        if record["round"] == 3:
            shutil.copytree(out, killed)

    driftlab.run(config, out, progress=snapshot)
    resumed = driftlab.run(killed / "config.json", killed, resume=True)  # config.json keeps both sections
    assert torch.equal(resumed.final_params, first.final_params)
    assert without_wall_time(run_records(killed)) == without_wall_time(first.records)


def test_the_section_names_the_key_to_fix():
    with pytest.raises(ValueError, match=r"robust\.radius is required"):
        RobustConfig(aggregator="centered_clipping")
    with pytest.raises(ValueError, match=r"robust\.byzantine is not a parameter of this rule.*takes robust\.beta"):
        RobustConfig(aggregator="trimmed_mean", beta=0.1, byzantine=2)
    with pytest.raises(ValueError, match=r"robust\.momentum: centered_clipping: momentum β must be in \[0, 1\)"):
        RobustConfig(aggregator="centered_clipping", radius=1.0, momentum=1.0)
    assert RobustConfig(aggregator="multi_krum", byzantine=1).settings.selected is None


def test_the_plan_checks_the_rule_against_the_cohort_and_run_json_records_it():
    facts = RunFacts(seed=0, rounds=1, num_clients=10, sampling_mode="uniform", participation=0.4)
    with pytest.raises(ConfigError, match=r"\[robust\] with 4 clients a round: krum with f = 1 .* n > 2f \+ 2 = 4"):
        FEATURE.plan(RobustConfig(aggregator="krum", byzantine=1), facts)
    plan = FEATURE.plan(RobustConfig(aggregator="trimmed_mean", beta=0.2), facts)
    assert FEATURE.run_info(plan) == {"robust": {"aggregator": "trimmed_mean", "beta": 0.2}}


def test_an_algorithm_without_a_release_form_is_refused_naming_both_keys_and_the_fix():
    weighted = fedavg.build(make_server_optimizer("sgd"), aggregation="weighted")
    message = weighted.refusal(REQUIREMENTS)
    assert message.startswith('[robust] with algorithm.name = "fedavg": ') and "uniform" in message
    with pytest.raises(ConfigError, match=r'\[robust\] with algorithm.name = "fednova": '):
        build_simulation(driftlab.load_config(_config(algorithm={"name": "fednova"}, robust={"aggregator": "median"})))


def test_privacy_and_fedbuff_are_refused_in_the_config():
    config = _config(robust={"aggregator": "median"}, privacy={"clip": 1.0}, sampling={"mode": "poisson"})
    with pytest.raises(ValueError, match=r"privacy: \[robust\] aggregates with a statistic"):
        driftlab.load_config(config)
    fedbuff = _config(robust={"aggregator": "median"}, system={"speed_median": 700.0}, asynchronous={"buffer": 2})
    with pytest.raises(ValueError, match=r"asynchronous: \[robust\] aggregates a round's messages together"):
        driftlab.load_config(fedbuff)


def test_a_robust_run_repeats_bit_for_bit():
    config = driftlab.load_config(_config(robust={"aggregator": "geometric_median"}))

    def run() -> list[float]:
        sim, state = build_simulation(config)
        losses = []
        for _ in range(config.rounds):
            state, record = run_round(sim, state)
            losses.append(float(state.server.params.sum()))
        return losses

    first = run()
    assert first == run() and all(math.isfinite(value) for value in first)


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_a_resumed_bucketed_run_equals_an_uninterrupted_one_and_run_json_records_the_bucket_size(tmp_path, backend):
    robust = {"aggregator": "centered_clipping", "radius": 0.05, "momentum": 0.9, "bucket_size": 2}
    config = _config(robust=robust, attack={"kind": "sign_flip", "fraction": 0.34}, rounds=5, checkpoint_every=2,
                     sampling={"participation": 1.0}, backend=backend,
                     evaluation={"instability_rounds": 0})  # fmt: skip
    first = driftlab.run(config, tmp_path / "first")
    run_json = json.loads((tmp_path / "first" / "run.json").read_text())
    assert run_json["robust"] == {"aggregator": "centered_clipping", "radius": 0.05, "momentum": 0.9, "bucket_size": 2}
    unbucketed = driftlab.run(config | {"robust": robust | {"bucket_size": None}}, tmp_path / "unbucketed")
    assert not torch.equal(unbucketed.final_params, first.final_params)  # the buckets are used
    out, killed = tmp_path / "run", tmp_path / "killed"

    def snapshot(record):  # the directory as a SIGKILL right after round 3 leaves it (checkpoint at round 2)
        if record["round"] == 3:
            shutil.copytree(out, killed)

    driftlab.run(config, out, progress=snapshot)
    resumed = driftlab.run(killed / "config.json", killed, resume=True)
    assert torch.equal(resumed.final_params, first.final_params)
    assert without_wall_time(run_records(killed)) == without_wall_time(first.records)


@pytest.mark.parametrize("rule", [{"aggregator": "median"}, {"aggregator": "krum", "byzantine": 1}])
def test_buckets_of_one_run_bit_for_bit_as_no_bucketing(tmp_path, rule):
    config = _config(robust=rule, sampling={"participation": 1.0}, rounds=3)
    plain = driftlab.run(config, tmp_path / "plain")
    ones = driftlab.run(config | {"robust": rule | {"bucket_size": 1}}, tmp_path / "ones")
    assert torch.equal(ones.final_params, plain.final_params)
    assert without_wall_time(ones.records) == without_wall_time(plain.records)


def test_bucket_size_is_a_key_of_every_rule_and_krums_f_counts_buckets_in_the_plan():
    section = RobustConfig(aggregator="median", bucket_size=2)
    assert section.parameters == {} and section.settings == Median()
    with pytest.raises(ValueError, match=r"bucket_size"):
        RobustConfig(aggregator="median", bucket_size=0)
    facts = RunFacts(seed=0, rounds=1, num_clients=24, sampling_mode="uniform", participation=1.0)
    with pytest.raises(
        ConfigError, match=r"\[robust\] with 24 clients a round: krum with f = 5 counts Byzantine buckets"
    ):
        FEATURE.plan(RobustConfig(aggregator="krum", byzantine=5, bucket_size=2), facts)
    paper = RunFacts(seed=7, rounds=1, num_clients=25, sampling_mode="uniform", participation=1.0)  # T = 13 > 12
    plan = FEATURE.plan(RobustConfig(aggregator="krum", byzantine=5, bucket_size=2), paper)
    assert (plan.bucket_size, plan.seed) == (2, 7)
    assert FEATURE.run_info(plan) == {"robust": {"aggregator": "krum", "byzantine": 5, "bucket_size": 2}}


def test_mime_and_efl_say_why_they_give_no_release_form_without_naming_privacy():
    from driftlab.algorithms import efl, mime

    sgd = make_server_optimizer("sgd")
    papers_mime = mime.build(sgd, momentum=0.5, aggregation="uniform", control_variate="current")
    adaptive_efl = efl.build(sgd, incomplete="adaptive", aggregation="uniform")
    for algorithm, phrase in ((papers_mime, "first phase"), (adaptive_efl, "E/s_k")):
        message = algorithm.refusal(REQUIREMENTS)
        assert message.startswith(f'[robust] with algorithm.name = "{algorithm.name}": ') and phrase in message
        assert message.endswith("or remove the feature") and "[privacy]" not in message
