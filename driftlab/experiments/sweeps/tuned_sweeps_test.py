"""The shipped tuned sweeps: the papers' own grids as tuned axes, validation rows in every run, and otherwise the runs
of the untuned sweep each one varies (issue 29, "Tuned axes in sweeps").

FedDyn (Acar et al. 2021, Appendix A.2) selects the CIFAR-10 lr decay from [0.992, 0.998, 1.0] and searched MNIST's
learning rates in [.1, .01] and epochs in [10, 20, 50] (SCAFFOLD's Ks in [120, 240, 600], the same local steps); its α
grids (MNIST [.001, .01, .03, .1], CIFAR-10 [1e-3, 1e-2, 1e-1]) tune FedDyn's runs alone and its μ grids (MNIST
[1, .01, .0001], CIFAR-10 [1e-2, 1e-3, 1e-4]) FedProx's alone.

AdaBest (Varno et al. 2022, Section 4.1 and its Appendix) tuned for 500 rounds FedDyn's μ (our α) over [0.002, 0.02,
0.2] and, above 1% participation, AdaBest's β over [0.94, 0.96, 0.98, 1.0] with AdaBest's μ kept at 0.02; FedAvg and
SCAFFOLD have nothing tuned.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import itertools
import json

import pytest

from driftlab.experiments.config import parse_override
from driftlab.experiments.run.datasets import data_location
from driftlab.experiments.sweep import load_sweep, plan, run_sweep, sweep_names

# tuned sweep -> the untuned sweep it varies
BASES = {
    "feddyn-cifar10-partial-tuned": "feddyn-cifar10-partial",
    "feddyn-cifar10-full-tuned": "feddyn-cifar10-full",
    "feddyn-table2-partial-tuned": "feddyn-table2-partial",
    "adabest-table2-mnist-tuned": "adabest-table2-mnist",
    "adabest-table2-cifar10-tuned": "adabest-table2-cifar10",
}
FEDDYN = sorted(name for name in BASES if name.startswith("feddyn"))
ADABEST = sorted(name for name in BASES if name.startswith("adabest"))
# the methods a tuned axis applies to, per sweep (the others run once per setting and seed, untuned)
TUNED_METHODS = {name: {"FedDyn", "SCAFFOLD", "FedAvg", "FedProx"} for name in FEDDYN} | {
    name: {"FedDyn", "AdaBest"} for name in ADABEST
}
SCALES = [None, "paper"]
# The rounds of a tuned sweep's default scale where it cuts them below its base's (a grid six times the size)
DEFAULT_ROUNDS = {"feddyn-table2-partial-tuned": 20}
CIFAR_DECAYS = {0.992, 0.998, 1.0}  # FedDyn Appendix A.2, CIFAR-10
MNIST_GRID = set(itertools.product([0.1, 0.01], [10, 20, 50]))  # FedDyn Appendix A.2, MNIST: (lr, epochs)
# FedDyn Appendix A.2: FedDyn's α and FedProx's μ, per data set; they tune those methods' runs only
ALPHAS = {"mnist": {0.001, 0.01, 0.03, 0.1}, "cifar10": {1e-3, 1e-2, 1e-1}}
MUS = {"mnist": {1.0, 0.01, 0.0001}, "cifar10": {1e-2, 1e-3, 1e-4}}


def decay(lr) -> float:
    """A client lr's per-round decay: 1 for a constant lr."""
    return 1.0 if isinstance(lr, (int, float)) else lr.decay


def initial(lr) -> float:
    return lr if isinstance(lr, (int, float)) else lr.initial


def tuned_keys(name: str) -> set[tuple[str, ...]]:
    """The config paths the sweep's tuned axes set."""
    assignments = [a for axis in load_sweep(name).tuned_axes for value in axis.values for a in value.set]
    return {tuple(parse_override(a)[0]) for a in assignments}


def without(config, paths) -> str:
    """The config as canonical JSON without the given paths where it has them (nor the seed)."""
    table = config.model_dump(mode="json")
    for path in [*paths, ("seed",)]:
        node = table
        for part in path[:-1]:
            node = node[part]
        node.pop(path[-1], None)  # algorithm.alpha is FedDyn's key alone
    return json.dumps(table, sort_keys=True)


def test_the_tuned_sweeps_are_shipped_with_an_untuned_base_each():
    assert set(BASES) <= set(sweep_names()) and set(BASES.values()) <= set(sweep_names())
    assert {name for name in sweep_names() if load_sweep(name).tuned_axes} == set(BASES)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(BASES))
def test_every_run_is_tuned_on_validation_rows(name, scale):
    spec = load_sweep(name)
    assert spec.tuned_axes and all(axis.role == "tuned" for axis in spec.tuned_axes)
    assert (spec.tuning.metric, spec.tuning.rule) == ("validation_accuracy", "final")
    runs = plan(spec, scale)
    tuned = [run for run in runs if run.tuned_method in TUNED_METHODS[name]]
    assert tuned and all(run.tuned for run in tuned) and {run.tuned_method for run in tuned} == TUNED_METHODS[name]
    assert all(not run.tuned and not run.tuned_method for run in runs if run not in tuned)
    assert {run.config.data.validation_fraction for run in runs} == {0.1}


def grids(name: str, scale: str | None) -> dict[tuple[str, str], set]:
    """Each (setting, method)'s tuned values, as the configs of its runs hold them."""
    found: dict[tuple[str, str], set] = {}
    for run in plan(load_sweep(name), scale):
        lr, epochs = run.config.client.lr, run.config.client.epochs
        value = decay(lr) if "cifar10" in name else (initial(lr), epochs)
        found.setdefault((run.setting, run.tuned_method), set()).add(value)
    return found


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", ["feddyn-cifar10-partial-tuned", "feddyn-cifar10-full-tuned"])
def test_cifar10_tunes_every_methods_lr_decay_over_the_papers_three(name, scale):
    found = grids(name, scale)
    assert len(found) == 8 and all(values == CIFAR_DECAYS for values in found.values())
    assert all(initial(run.config.client.lr) == 0.1 for run in plan(load_sweep(name), scale))
    assert tuned_keys(name) == {("client", "lr"), ("algorithm", "alpha"), ("algorithm", "mu")}


@pytest.mark.parametrize("scale", SCALES)
def test_mnist_tunes_every_methods_lr_and_epochs_over_the_papers_search_space(scale):
    name = "feddyn-table2-partial-tuned"
    found = grids(name, scale)
    assert len(found) == 8 and all(values == MNIST_GRID for values in found.values())
    runs = plan(load_sweep(name), scale)
    # a constant lr at the default scale (as feddyn-table2-partial), the paper's 0.998 per round at its scale
    assert {decay(run.config.client.lr) for run in runs} == ({0.998} if scale == "paper" else {1.0})
    assert tuned_keys(name) == {("client", "lr"), ("client", "epochs"), ("algorithm", "alpha"), ("algorithm", "mu")}


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", FEDDYN)
def test_alpha_and_mu_are_tuned_over_the_papers_grids_for_feddyn_and_fedprox_alone(name, scale):
    data = "cifar10" if "cifar10" in name else "mnist"
    shared = CIFAR_DECAYS if data == "cifar10" else MNIST_GRID  # the grid every method is tuned over
    found: dict[tuple[str, str, int], list] = {}
    runs = plan(load_sweep(name), scale)
    for run in runs:
        lr, algorithm = run.config.client.lr, run.config.algorithm
        value = decay(lr) if data == "cifar10" else (initial(lr), run.config.client.epochs)
        extra = (
            algorithm.alpha if run.tuned_method == "FedDyn" else algorithm.mu if run.tuned_method == "FedProx" else None
        )
        found.setdefault((run.setting, run.tuned_method, run.seed), []).append((value, extra))
        if run.tuned_method in ("SCAFFOLD", "FedAvg"):  # neither tuned over α nor μ, nor given one
            assert "α=" not in run.tuned and "μ=" not in run.tuned and not hasattr(algorithm, "alpha")
    assert len(found) == 8 * len({run.seed for run in runs})  # 2 settings × 4 methods, each with every seed
    for (_, method, _), values in found.items():
        assert len(values) == len(set(values))  # no configuration twice
        if method == "FedDyn":
            assert set(values) == set(itertools.product(shared, ALPHAS[data]))
        elif method == "FedProx":
            assert set(values) == set(itertools.product(shared, MUS[data]))
        else:  # once per setting, seed and value of the shared grid: the α and μ axes do not multiply them
            assert sorted(values, key=str) == sorted(((v, None) for v in shared), key=str)


def test_mnist_halving_searches_for_100_rounds_then_runs_the_best_pair_to_the_end():
    spec = load_sweep("feddyn-table2-partial-tuned")
    assert spec.halving is not None
    # ⌈n/eta⌉ = 1 for each method's grid (FedDyn 24 configurations, FedProx 18, SCAFFOLD and FedAvg 6): one goes on
    # configurations per group (a seed's runs): halving ranks configurations, their seeds averaged
    groups = collections.Counter((r.setting, r.tuned_method) for r in plan(spec, "paper") if r.seed == 0)
    sizes = set(groups.values())
    assert (
        sizes == {24, 18, 6}
        and spec.halving.rungs(1000) == [100, 1000]
        and all(-(-n // spec.halving.eta) == 1 for n in sizes)
    )
    assert spec.halving.rungs(plan(spec)[0].config.rounds) == [20]  # the default scale runs every pair to its end
    assert all(load_sweep(name).halving is None for name in FEDDYN if "cifar10" in name)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", ADABEST)
def test_adabest_tunes_feddyns_alpha_and_adabests_beta_over_the_papers_grids_and_nothing_else(name, scale):
    runs = plan(load_sweep(name), scale)
    found: dict[tuple[str, str, int], list] = {}
    for run in runs:
        algorithm, method = run.config.algorithm, run.tuned_method or run.method  # "AdaBest (β=0.94)" is AdaBest's
        value = (
            algorithm.alpha if method == "FedDyn" else (algorithm.mu, algorithm.beta) if method == "AdaBest" else None
        )
        found.setdefault((run.setting, method, run.seed), []).append(value)
    seeds = {run.seed for run in runs}
    assert seeds == ({0, 1, 2, 3, 4} if scale == "paper" else {0, 1, 2})
    assert len(found) == 2 * 4 * len(seeds)  # Dirichlet 0.3 and 0.03 × FedAvg, FedDyn, SCAFFOLD, AdaBest
    for (_, method, _), values in found.items():
        if method == "FedDyn":
            assert sorted(values) == [0.002, 0.02, 0.2]
        elif method == "AdaBest":  # AdaBest's μ kept at 0.02, its β searched
            assert sorted(values) == [(0.02, 0.94), (0.02, 0.96), (0.02, 0.98), (0.02, 1.0)]
        else:
            assert values == [None]
    # the untuned sweep's values are the paper's picks, and each is a value of its grid
    picks = {run.method: run.config.algorithm for run in plan(load_sweep(BASES[name]), scale)}
    assert picks["FedDyn"].alpha == 0.02 and (picks["AdaBest"].mu, picks["AdaBest"].beta) == (0.02, 0.96)
    assert tuned_keys(name) == {("algorithm", "alpha"), ("algorithm", "beta")}


@pytest.mark.parametrize("name", ADABEST)
def test_adabest_halving_searches_for_500_rounds_then_runs_the_best_value_to_the_end(name):
    spec = load_sweep(name)
    groups = collections.Counter((r.setting, r.tuned_method) for r in plan(spec, "paper") if r.tuned)
    assert set(groups.values()) == {3 * 5, 4 * 5}  # FedDyn's 3 αs and AdaBest's 4 βs, 5 seeds each
    assert spec.halving.rungs(1200) == [500, 1200] and all(-(-n // spec.halving.eta) == 1 for n in (3, 4))
    default_rounds = plan(spec)[0].config.rounds
    assert default_rounds == (200 if "mnist" in name else 15)
    assert spec.halving.rungs(default_rounds) == [default_rounds]  # the default scale runs every value to its end


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(BASES))
def test_apart_from_the_tuned_keys_and_the_validation_rows_the_runs_are_the_untuned_sweeps(name, scale):
    removed = [*tuned_keys(name), ("data", "validation_fraction")]
    if name in DEFAULT_ROUNDS and scale is None:
        assert {run.config.rounds for run in plan(load_sweep(name))} == {DEFAULT_ROUNDS[name]}
        removed.append(("rounds",))
    tuned: dict[tuple[str, str], set[str]] = {}
    for run in plan(load_sweep(name), scale):
        method = run.tuned_method or run.method  # a method no tuned axis applies to is planned untuned
        tuned.setdefault((run.setting, method), set()).add(without(run.config, removed))
    untuned: dict[tuple[str, str], set[str]] = {}
    for run in plan(load_sweep(BASES[name]), scale):
        method = run.method.split(", ")[0]  # the CIFAR-10 sweeps compare "FedDyn, lr decay 0.992" and the like
        untuned.setdefault((run.setting, method), set()).add(without(run.config, removed))
    assert tuned == untuned
    assert all(len(configs) == 1 for configs in tuned.values())  # the runs of a method differ in the tuned keys only


@pytest.mark.slow
def test_a_tiny_mnist_tuned_sweep_reports_its_grid_and_picks_each_method_on_validation(tmp_path):
    spec = load_sweep("feddyn-table2-partial-tuned")
    setting, methods, lr, epochs, alpha, mu = spec.axes
    # one setting, two methods, FedAvg's whole grid and FedDyn's with two of its αs: 12 + 6 runs of 2 rounds, 2 clients a round
    setting = dataclasses.replace(setting, values=setting.values[1:])  # Dirichlet 0.3
    methods = dataclasses.replace(methods, values=methods.values[::2])  # FedDyn and FedAvg
    alpha = dataclasses.replace(alpha, values=alpha.values[:2])  # α = 0.001, 0.01
    # one seed: the grid and the pick are under test here, not the seeds
    spec = dataclasses.replace(spec, axes=(setting, methods, lr, epochs, alpha, mu), seeds=(0,))
    tiny = ["rounds=2", "sampling.participation=0.02"]
    if data_location(plan(spec, None, tiny)[0].config.data) is None:
        pytest.skip("MNIST is not on this machine (set DRIFTLAB_DATA)")
    outcomes = run_sweep(spec, tmp_path / "sweep", jobs=2, extra_overrides=tiny, log=lambda _: None)
    assert sorted({o.status for o in outcomes}) == ["complete"] and len(outcomes) == 18

    final: dict[tuple[str, str], float] = {}
    for outcome in outcomes:
        lines = (tmp_path / "sweep" / outcome.run.dir / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert all("validation_accuracy" in r and "test_accuracy" in r for r in records)
        # 60 of each client's 600 rows are held out: an epoch is 11 steps of the 540 left (SCAFFOLD's K is epochs x 11)
        assert records[-1]["local_steps"] == 2 * outcome.run.config.client.epochs * 11
        final[outcome.run.tuned_method, outcome.run.tuned] = records[-1]["validation_accuracy"]

    from driftlab.experiments.report import make_report

    report = make_report([tmp_path / "sweep"], tmp_path / "report", plots=False)
    assert "Tuned grids" in report.markdown
    with (tmp_path / "report" / "tuning.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 18 and {row["setting"] for row in rows} == {"Dirichlet 0.3, 10%"}
    pairs = [f"lr={lr}, E={epochs}" for lr, epochs in itertools.product([0.1, 0.01], [10, 20, 50])]
    expected = {"FedAvg": set(pairs), "FedDyn": {f"{pair}, α={a}" for pair in pairs for a in ("0.001", "0.01")}}
    for method in ("FedDyn", "FedAvg"):
        grid = {row["tuned_value"]: row for row in rows if row["method"] == method}
        assert set(grid) == expected[method]
        (picked,) = [value for value, row in grid.items() if row["picked"] == "1"]
        # the pick is the configuration best on validation (one seed: its final validation accuracy), whatever test says
        assert float(grid[picked]["validation_mean"]) == final[method, picked]
        assert final[method, picked] == max(final[method, value] for value in grid)
        # the setting's note names the pick, and its tables give the test accuracy of the picked configuration's run
        assert f"{method} is reported at its tuned value {picked}, picked on validation" in report.markdown
        assert f"| {method} | 1 | {100 * float(grid[picked]['test_mean']):.2f}% |" in report.markdown
