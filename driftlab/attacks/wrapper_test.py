"""``with_attack`` and the ``[attack]`` entry: hand-computed forged rounds, the seeded draws, run.json's record of the
Byzantine ids, the round metric and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

import driftlab
from driftlab.algorithms import fedavg
from driftlab.attacks.byzantine import byzantine_clients, noise_generator
from driftlab.attacks.feature import FEATURE, REQUIREMENTS
from driftlab.attacks.model_updates import GaussianNoise, InnerProduct, LittleIsEnough, SignFlip, alie_z_max
from driftlab.attacks.section import AttackConfig
from driftlab.attacks.wrapper import with_attack
from driftlab.errors import ConfigError
from driftlab.experiments.run.testing import quadratic_run
from driftlab.features.entry import RunFacts
from driftlab.optim.server import make_server_optimizer
from driftlab.robust.testing import one_round

# Three honest clients (0, 1, 2) and two attackers (3, 4), all from θ = 0.
FINALS = [[1.0, 0.0], [2.0, 2.0], [3.0, 4.0], [9.0, 9.0], [8.0, 8.0]]
ATTACKERS = frozenset({3, 4})


def fedavg_uniform():
    return fedavg.build(make_server_optimizer("sgd"), aggregation="uniform")


def test_alie_sends_the_honest_mean_minus_z_deviations_from_every_attacker():
    server, metrics = one_round(with_attack(fedavg_uniform(), LittleIsEnough(z=1.0), ATTACKERS, 1, seed=0), FINALS)
    # honest μ = (2, 2), σ = (1, 2): x̃ = (1, 0) from both; mean of (1,0), (2,2), (3,4), (1,0), (1,0) = (8, 6)/5
    assert torch.allclose(server.params, torch.tensor([1.6, 1.2], dtype=torch.float64))
    assert metrics["attack_byzantine_messages"] == 2.0
    paper, _ = one_round(with_attack(fedavg_uniform(), LittleIsEnough(), ATTACKERS, 1, seed=0), FINALS)
    z = alie_z_max(5, 2)  # n = 5 reporting, f = 2 of them attacking: Φ⁻¹(4/5)
    forged = torch.tensor([2.0, 2.0], dtype=torch.float64) - z * torch.tensor([1.0, 2.0], dtype=torch.float64)
    expected = (torch.tensor([6.0, 6.0], dtype=torch.float64) + 2 * forged) / 5
    assert torch.allclose(paper.params, expected)


def test_ipm_sends_minus_epsilon_times_the_honest_mean():
    server, _ = one_round(with_attack(fedavg_uniform(), InnerProduct(epsilon=0.5), ATTACKERS, 1, seed=0), FINALS)
    # x̃ = −0.5 (2, 2) = (−1, −1): mean of (1,0), (2,2), (3,4), (−1,−1), (−1,−1) = (4, 4)/5
    assert torch.allclose(server.params, torch.tensor([0.8, 0.8], dtype=torch.float64))


def test_gaussian_noise_is_drawn_from_the_seed_round_and_client():
    attacked = with_attack(fedavg_uniform(), GaussianNoise(std=2.0), frozenset({4}), 1, seed=11)
    server, _ = one_round(attacked, FINALS, round_index=3)
    noise = torch.randn(2, generator=noise_generator(11, 3, 4), dtype=torch.float64) * 2.0
    honest = torch.tensor(FINALS[:4], dtype=torch.float64).sum(dim=0)
    assert torch.allclose(server.params, (honest + noise) / 5)
    again, _ = one_round(
        with_attack(fedavg_uniform(), GaussianNoise(std=2.0), frozenset({4}), 1, seed=11), FINALS, round_index=3
    )
    other, _ = one_round(
        with_attack(fedavg_uniform(), GaussianNoise(std=2.0), frozenset({4}), 1, seed=12), FINALS, round_index=3
    )
    assert torch.equal(again.params, server.params) and not torch.equal(other.params, server.params)


def test_before_the_start_round_and_without_enough_honest_clients_everyone_is_honest():
    plain, _ = one_round(fedavg_uniform(), FINALS)
    early, metrics = one_round(with_attack(fedavg_uniform(), SignFlip(), ATTACKERS, start_round=2, seed=0), FINALS)
    assert torch.equal(early.params, plain.params) and metrics["attack_byzantine_messages"] == 0.0
    # ALIE needs two honest vectors for σ: with one honest client the attackers send their own messages
    lonely, metrics = one_round(with_attack(fedavg_uniform(), LittleIsEnough(), frozenset({1, 2, 3, 4}), 1, 0), FINALS)
    assert torch.equal(lonely.params, plain.params) and metrics["attack_byzantine_messages"] == 0.0


def facts(seed: int = 5, num_clients: int = 20) -> RunFacts:
    return RunFacts(seed=seed, rounds=3, num_clients=num_clients, sampling_mode="uniform", participation=1.0)


def test_the_byzantine_clients_are_drawn_from_the_seed_and_recorded():
    section = AttackConfig(kind="ipm", epsilon=0.1, fraction=0.25)
    plan = FEATURE.plan(section, facts())
    assert plan.clients == byzantine_clients(section.byzantine, 5, 20) and len(plan.clients) == 5
    assert FEATURE.plan(section, facts()).clients == plan.clients
    assert FEATURE.plan(section, facts(seed=6)).clients != plan.clients
    assert FEATURE.run_info(plan) == {
        "attack": {"kind": "ipm", "epsilon": 0.1, "start_round": 1, "byzantine_clients": list(plan.clients)}
    }
    with pytest.raises(ConfigError, match=r"attack.clients names ids \[25\] .*name ids below 20"):
        FEATURE.plan(AttackConfig(kind="sign_flip", clients=(3, 25)), facts())


def test_the_section_names_the_key_to_fix():
    with pytest.raises(ValueError, match=r"attack\.epsilon is required: attack\.kind = 'ipm' takes attack\.epsilon"):
        AttackConfig(kind="ipm", fraction=0.1)
    with pytest.raises(ValueError, match=r"attack\.std is not a parameter of this rule"):
        AttackConfig(kind="sign_flip", fraction=0.1, std=1.0)
    with pytest.raises(ValueError, match=r"attack\.std: gaussian_noise: std must be ≥ 0"):
        AttackConfig(kind="gaussian_noise", fraction=0.1, std=-1.0)
    with pytest.raises(ValueError, match="give exactly one of fraction"):
        AttackConfig(kind="sign_flip", fraction=0.1, clients=(1,))


def _config(**sections) -> dict:
    return quadratic_run(8, 3, 2) | sections


def test_an_attacked_run_records_its_attackers_counts_their_messages_and_repeats(tmp_path):
    attack = {"kind": "gaussian_noise", "std": 0.5, "fraction": 0.25, "start_round": 2}
    first = driftlab.run(_config(attack=attack), tmp_path / "run")
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())
    ids = byzantine_clients(AttackConfig(**attack).byzantine, 2, 8)
    assert recorded["attack"]["byzantine_clients"] == list(ids) and len(ids) == 2
    counts = [record["attack_byzantine_messages"] for record in first.records]
    assert counts[0] == 0.0 and all(count == int(count) for count in counts)
    again = driftlab.run(_config(attack=attack))
    assert torch.equal(again.final_params, first.final_params)
    other = driftlab.run(_config(attack=attack, seed=3))
    assert not torch.equal(other.final_params, first.final_params)


def test_an_algorithm_without_a_release_form_is_refused_naming_both_keys():
    weighted = fedavg.build(make_server_optimizer("sgd"), aggregation="weighted")
    assert weighted.refusal(REQUIREMENTS).startswith('[attack] with algorithm.name = "fedavg": ')
    with pytest.raises(ConfigError, match=r'\[attack\] with algorithm.name = "fednova": '):
        driftlab.run(_config(algorithm={"name": "fednova"}, attack={"kind": "sign_flip", "fraction": 0.25}))
