"""The shipped privacy sweeps compare what they say: equal ε across methods, accountable sampling, true ε figures.

(Every shipped sweep is also planned at each of its scales by ``driftlab/experiments/sweep/sweep_test.py``.)
"""

from __future__ import annotations

import re

import pytest

from driftlab.experiments.sweep import load_sweep, plan
from driftlab.privacy import accounting

PRIVACY_SWEEPS = ("dp-scaffold-synthetic", "dp-fedavg-mnist")


def _runs(name: str, scale: str | None):
    return plan(load_sweep(name), scale)


@pytest.mark.parametrize("scale", [None, "paper"])
def test_dp_scaffold_and_dp_fedavg_differ_only_in_the_algorithm_so_they_spend_the_same_epsilon(scale):
    runs = _runs("dp-scaffold-synthetic", scale)
    by_cell: dict[tuple[str, str, int], dict[str, dict]] = {}
    for run in runs:
        algorithm, noise = run.method.split(", ")
        everything = run.config.model_dump()
        name = everything.pop("algorithm")["name"]
        assert name == {"FedAvg": "fedavg", "SCAFFOLD": "scaffold"}[algorithm]
        by_cell.setdefault((run.setting, noise, run.seed), {})[algorithm] = everything
    assert len(by_cell) == 3 * 5 * 3
    for cell, pair in by_cell.items():
        assert set(pair) == {"FedAvg", "SCAFFOLD"}, cell
        # privacy, sampling, rounds, data, local work: identical, so ε(q, z, T, δ) and the clip are the same
        assert pair["FedAvg"] == pair["SCAFFOLD"], cell
    noised = [run for run in runs if run.config.privacy is not None and run.config.privacy.noise_multiplier > 0]
    assert {run.config.privacy.clip for run in runs if run.config.privacy is not None} == {0.3}
    assert {run.config.privacy.noise_multiplier for run in noised} == {0.3, 1.0, 3.0}


@pytest.mark.parametrize("name", PRIVACY_SWEEPS)
def test_every_noised_run_is_accountable_before_it_starts(name):
    for scale in [None, *load_sweep(name).scales]:
        for run in _runs(name, scale):
            privacy = run.config.privacy
            if run.method.endswith("non-private"):
                assert privacy is None  # the reference is the run without [privacy], not clip = inf
                continue
            if privacy.noise_multiplier == 0:
                assert privacy.delta is None  # clip only: nothing to account
                continue
            sampling, clients = run.config.sampling, run.config.data.num_clients
            assert sampling.mode == "poisson" or sampling.participation == 1
            assert privacy.delta is not None and privacy.delta < 1 / clients
            assert privacy.noise == "central" and privacy.accountant == "rdp"


def test_the_epsilons_the_descriptions_state_are_the_accountants():
    # the rounds and rates the figures below are computed for are the sweeps' own
    planned = [
        ("dp-scaffold-synthetic", 0.2, {None: 200, "paper": 400}),
        ("dp-fedavg-mnist", 0.1, {None: 100, "paper": 200}),
    ]
    for name, q, rounds in planned:
        for scale, count in rounds.items():
            assert {(run.config.rounds, run.config.sampling.participation) for run in _runs(name, scale)} == {
                (count, q)
            }
    scaffold = " ".join(load_sweep("dp-scaffold-synthetic").description.split())
    for z, pattern in [(0.3, r"z = 0\.3 → ([\d.]+)"), (1, r"z = 1 → ([\d.]+)"), (3, r"z = 3 → ([\d.]+)")]:
        stated = float(re.search(pattern, scaffold).group(1))
        assert accounting.epsilon(z, 0.2, 200, 1e-3) == pytest.approx(stated, rel=5e-3), z
    paper = float(re.search(r"ε then ([\d.]+) at z = 1", scaffold).group(1))
    assert accounting.epsilon(1, 0.2, 400, 1e-3) == pytest.approx(paper, rel=5e-3)

    mnist = " ".join(load_sweep("dp-fedavg-mnist").description.split())
    for z, rounds, pattern in [
        (1, 100, r"ε = ([\d.]+) at z = 1 "),
        (2, 100, r"ε = ([\d.]+) at z = 2 "),
        (1, 200, r"ε ([\d.]+) at z = 1,"),
        (2, 200, r"([\d.]+) at z = 2\)"),
    ]:
        stated = float(re.search(pattern, mnist).group(1))
        assert accounting.epsilon(z, 0.1, rounds, 1e-4) == pytest.approx(stated, rel=5e-3), (z, rounds)
