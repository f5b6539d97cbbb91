"""The headline experiments that had no sweep (issue 42), shipped as sweeps: each plans at its default scale and at
``--scale paper`` with at least three seeds, says where every setting comes from, sets the values its paper gives,
and its runs start on the data this machine has (a round each, at a tiny scale; the others skip and say which data
they wait for).

(Every shipped sweep is also planned by ``driftlab/experiments/sweep/sweep_test.py`` and its description's three parts are
checked by ``settings_provenance_test.py``.)
"""

from __future__ import annotations

import json
import math
import re

import pytest

from driftlab.experiments.run.datasets import data_location, entry_of
from driftlab.experiments.run.runner import run
from driftlab.experiments.sweep import load_sweep, plan
from driftlab.experiments.sweep.shipped import sweep_names
from driftlab.experiments.sweeps.settings_provenance_test import provenance

# Each new sweep and the table or figure of its paper that its description must name.
NEW_SWEEPS = {
    "feddyn-table1-massive-cifar10": "Table 1",
    "feddyn-table1-cifar100": "Tables 1 and 4",
    "feddyn-table2-dirichlet06-full": "Table 2",
    "feddyn-table2-dirichlet06-partial": "Table 2",
    "feddyn-shakespeare-iid-partial": "Table 2",
    "feddyn-table4-unbalanced": "Table 4",
    "feddyn-table5-1pct": "Table 5",
    "feddyn-table2-dirichlet06-cifar10": "Table 2",
    "feddyn-table5-cifar10": "Table 5",
    "feddyn-table6-synthetic": "Table 6",
    "fedprox-figures2-4": "Figures 2-4",
    "fedprox-figures2-4-sent140": "Figures 2-4",
    "fedprox-stragglers": "Table 1",
    "decaying-k-femnist-k3": "Figure 3",
    "decaying-k-femnist-k33": "Figure 3",
    "decaying-k-shakespeare-k10": "Figure 4",
    "decaying-k-shakespeare-k33": "Figure 4",
    "decaying-k-shakespeare-k100": "Figure 4",
    "decaying-k-stackoverflow-k10": "Figure 2",
    "decaying-k-stackoverflow-k33": "Figure 2",
    "decaying-k-stackoverflow-k100": "Figure 2",
    "adabest-table2-1pct": "Table 2",
    "adabest-table2-full": "Table 2",
    "adabest-table2-iid": "Table 2",
    "adabest-figure3": "Figure 3",
    "efl-figure1-cifar100": "Figure 1",
    "efl-figure2": "Figure 2",
    "efl-figure3": "Figure 3",
    "efl-figure3-sent140": "Figure 3",
}

# The data sets none of this machine's files hold: their sweeps say what they wait for.
WAITING = {"cifar100", "sent140", "stackoverflow"}


def _runs(name: str, scale: str | None = None, overrides=()):
    return plan(load_sweep(name), scale, list(overrides))


def _by_cell(name: str, scale: str | None = None) -> dict[tuple[str, str], object]:
    """Each (setting, method)'s config at seed 0 (the seeds differ in nothing else)."""
    return {(r.setting, r.method): r.config for r in _runs(name, scale) if r.seed == 0}


def _decay(rate) -> float:
    return 1.0 if isinstance(rate, (int, float)) else rate.decay


def _text(name: str) -> str:
    return " ".join(load_sweep(name).description.split())


def test_every_new_sweep_is_shipped():
    assert set(NEW_SWEEPS) <= set(sweep_names())


@pytest.mark.parametrize("name", sorted(NEW_SWEEPS))
def test_plans_at_both_scales_with_at_least_three_seeds(name):
    default, paper = _runs(name), _runs(name, "paper")
    for runs in (default, paper):
        seeds = sorted({r.seed for r in runs})
        assert len(seeds) >= 3, f"{name}: {seeds}"
        assert len({r.dir for r in runs}) == len(runs), f"{name}: two runs share a directory"
        cells = {(r.setting, r.method) for r in runs}
        assert len(runs) == len(cells) * len(seeds), f"{name}: every cell runs every seed"
    assert {(r.setting, r.method) for r in default} == {(r.setting, r.method) for r in paper}
    # the paper's scale is another scale: a run's settings differ, or it runs more seeds
    more_seeds = len({r.seed for r in paper}) > len({r.seed for r in default})
    assert more_seeds or _by_cell(name) != _by_cell(name, "paper")


@pytest.mark.parametrize("name", sorted(NEW_SWEEPS))
def test_description_names_its_table_its_sources_its_scale_and_its_time(name):
    description = load_sweep(name).description
    text = " ".join(description.split())
    parts = provenance(description)  # the three parts, once each, in order
    assert parts["paper"].startswith("("), f"{name}: From the paper (<where in it>)"
    assert NEW_SWEEPS[name] in parts["paper"], f"{name}: the paper's part names {NEW_SWEEPS[name]}"
    assert parts["code"].startswith(("(", ": nothing")) and len(parts["ours"]) > 20
    assert "`--scale paper`" in text and "TIME_DEFAULT" not in text
    # the default scale's size and time: seeds, rounds, and minutes or CPU-hours
    assert "3 seeds" in text and "rounds" in text
    assert re.search(r"\d+(\.\d+)? (CPU-hours?|minutes)", text), f"{name}: state the default scale's time"


@pytest.mark.parametrize("name", sorted(NEW_SWEEPS))
def test_a_sweep_on_data_this_machine_lacks_says_what_it_waits_for(name):
    names = {r.config.data.name for r in _runs(name)}
    text = _text(name)
    if names & WAITING:
        assert "WAITS FOR DATA" in text, f"{name}: say which files it waits for"
        assert ("official" in text) or ("LEAF" in text) or ("TFF" in text), f"{name}: name the files' format"
    else:
        assert "WAITS FOR DATA" not in text


# ---------------------------------------------------------------- the papers' values hold at both scales


@pytest.mark.parametrize("scale", [None, "paper"])
def test_feddyn_shakespeare_sets_the_appendix_alpha_and_decay_per_participation(scale):
    cells = _by_cell("feddyn-shakespeare-iid-partial", scale)
    alpha = {setting: c.algorithm.alpha for (setting, method), c in cells.items() if method == "FedDyn"}
    assert alpha == {
        "IID, 100%": 0.009,
        "IID, 10%": 0.015,
        "non-IID, 10%": 0.015,
        "IID, 1%": 0.001,
        "non-IID, 1%": 0.001,
    }
    for (setting, method), config in cells.items():
        assert _decay(config.client.lr) == (0.998 if "1%" in setting else 1.0), (setting, method)
        assert config.data.partition == ("iid" if setting.startswith("IID") else "natural")
        assert (config.client.batch_size, config.client.weight_decay, config.client.clip_norm) == (100, 1e-4, 10)
        if method == "FedProx":
            assert config.algorithm.mu == 1e-4
        if method != "FedDyn":
            assert not hasattr(config.algorithm, "alpha")
        if scale == "paper":
            assert (config.data.max_clients, config.data.samples_per_client, config.client.epochs) == (100, 2400, 5)
            assert config.rounds == {"IID, 100%": 150, "IID, 10%": 300, "non-IID, 10%": 300}.get(setting, 1000)


@pytest.mark.parametrize(
    ("name", "participation", "decay", "epochs", "rounds"),
    [
        ("feddyn-table2-dirichlet06-full", 1.0, 1.0, {"FedDyn": 50, "SCAFFOLD": 50, "FedAvg": 20, "FedProx": 20}, 500),
        (
            "feddyn-table2-dirichlet06-partial",
            0.1,
            0.998,
            {"FedDyn": 50, "SCAFFOLD": 50, "FedAvg": 10, "FedProx": 10},
            1000,
        ),
        ("feddyn-table5-1pct", 0.01, 0.998, {"FedDyn": 50, "SCAFFOLD": 50, "FedAvg": 10, "FedProx": 10}, 1000),
    ],
)
def test_feddyn_mnist_rows_run_the_appendix_settings(name, participation, decay, epochs, rounds):
    for scale in (None, "paper"):
        cells = _by_cell(name, scale)
        for (setting, method), config in cells.items():
            assert config.sampling.participation == participation and _decay(config.client.lr) == decay
            assert (config.client.batch_size, config.client.weight_decay, config.client.clip_norm) == (50, 1e-4, 10)
            assert config.model.hidden == (200, 200) and config.evaluation.model == "all_clients_mean"
            if "Dirichlet" in setting:
                assert config.data.partition == "dirichlet" and config.data.dirichlet_alpha == float(
                    setting.split()[1][:-1]
                )
            if method == "FedDyn":
                assert config.algorithm.alpha == 0.01  # .03 is the 10% IID row's only
            if scale == "paper":
                assert config.client.epochs == epochs[method] and config.rounds == rounds
            else:
                assert config.client.epochs == 5


def test_feddyn_cifar_rows_hold_the_devices_and_sizes_of_tables_1_and_4():
    massive = _by_cell("feddyn-table1-massive-cifar10", "paper")
    assert {
        (c.data.num_clients, c.data.limit_per_class, c.rounds, c.sampling.participation) for c in massive.values()
    } == {(1000, None, 2000, 0.1)}  # all 50,000 images over 1000 devices: 50 each
    unbalanced = _by_cell("feddyn-table4-unbalanced", "paper")
    assert {
        (c.data.quotas, c.data.lognormal_sigma, c.client.epochs, c.client.weight_decay) for c in unbalanced.values()
    } == {("lognormal", 0.3, 5, 1e-3)}
    for name, participations in (("feddyn-table2-dirichlet06-cifar10", {1.0, 0.1}), ("feddyn-table5-cifar10", {0.01})):
        cells = _by_cell(name, "paper")
        assert {c.sampling.participation for c in cells.values()} == participations
        assert {(c.client.epochs, c.client.batch_size, c.client.weight_decay, c.rounds) for c in cells.values()} == {
            (5, 50, 1e-3, 1000)
        }
        assert {c.data.limit_per_class for c in cells.values()} == {None}  # all 500 images of each of the 100 clients
    assert {c.data.dirichlet_alpha for c in _by_cell("feddyn-table2-dirichlet06-cifar10").values()} == {0.6}
    cifar100 = _by_cell("feddyn-table1-cifar100", "paper")
    for (setting, method), config in cifar100.items():
        assert config.data.name == "cifar100" and config.client.weight_decay == 1e-3
        assert config.data.num_clients == (500 if "500" in setting else 100)
        assert config.client.epochs == (5 if setting.endswith("100 devices") else 2), setting
        assert config.rounds == (2000 if "500" in setting else 1000)
        assert (config.data.quotas == "lognormal") == setting.endswith("unbalanced")
        if method == "FedDyn":
            assert config.algorithm.alpha == (0.1 if setting.endswith("unbalanced") else 0.01)


def test_feddyn_table6_runs_each_heterogeneity_type_on_20_devices():
    cells = _by_cell("feddyn-table6-synthetic")
    assert sorted({c.data.feddyn_kind for c in cells.values()}) == [0, 1, 2, 3]
    for config in cells.values():
        assert (config.data.num_clients, config.sampling.participation, config.model.name) == (20, 0.1, "mlr")
        assert (config.client.batch_size, config.client.weight_decay) == (10, 1e-5)
        assert config.client.lr in (1, 0.1) and config.client.epochs in (1, 10, 50)  # points of the paper's grids


FEDPROX_DATA = {  # participation, lr, model, best μ (ours), horizon (ours)
    "MNIST": (0.01, 0.03, "mlr", 1.0, 100),
    "FEMNIST": (0.05, 0.003, "mlr", 1.0, 200),
    "Shakespeare": (0.1, 0.8, "lstm", 0.001, 40),  # 20 rounds at the default scale
}


@pytest.mark.parametrize("scale", [None, "paper"])
def test_fedprox_figures_2_to_4_set_each_data_sets_appendix_values(scale):
    cells = _by_cell("fedprox-figures2-4", scale)
    assert {method for _, method in cells} == {"E=1, μ=0", "E=20, μ=0", "E=50, μ=0", "E=50, best μ"}
    for (setting, method), config in cells.items():
        participation, lr, model, best_mu, rounds = FEDPROX_DATA[setting]
        if scale == "paper" or setting != "Shakespeare":
            assert config.rounds == rounds
        assert (config.sampling.participation, config.client.lr, config.model.name) == (participation, lr, model)
        assert config.client.batch_size == 10 and config.data.client_test_fraction == 0.2
        assert config.evaluation.dissimilarity_every > 0  # Figure 4's curves
        assert config.client.epochs == int(method.split(",")[0][2:])
        assert config.algorithm.mu == (best_mu if method.endswith("best μ") else 0.0)
        if setting == "MNIST":
            assert (config.data.partition, config.data.classes_per_client, config.data.num_clients) == (
                "power_law",
                2,
                1000,
            )


def test_fedprox_stragglers_differ_only_in_how_partial_work_is_used():
    cells = _by_cell("fedprox-stragglers")
    fractions = {setting: c.availability.incomplete_probability for (setting, _), c in cells.items()}
    assert {fraction for fraction in fractions.values()} == {0.0, 0.5, 0.9}
    for (setting, method), config in cells.items():
        assert config.client.epochs == 20
        if method.startswith("FedAvg"):
            assert config.algorithm.name == "fedavg" and config.algorithm.incomplete == "drop"
        else:
            assert config.algorithm.name == "fedprox"
            assert config.algorithm.mu == (0.0 if method.endswith("μ=0") else FEDPROX_DATA[setting.split(",")[0]][3])


# K, d_η (server and γ), d_K of the decaying-K paper's Table 5, and each file's default compression power
DECAYING_K = {
    "decaying-k-femnist-k3": (3, 0.9996, 0.9996, 20),
    "decaying-k-femnist-k33": (33, 0.9996, 0.999, 80),
    "decaying-k-shakespeare-k10": (10, 0.9996, 0.9996, 200),
    "decaying-k-shakespeare-k33": (33, 0.999, 0.9996, 400),
    "decaying-k-shakespeare-k100": (100, 0.996, 0.9996, 1000),
}


@pytest.mark.parametrize("name", sorted(DECAYING_K))
def test_decaying_k_uses_table_5_rates_at_paper_scale_and_their_powers_by_default(name):
    k, d_eta, d_k, power = DECAYING_K[name]
    for scale, exponent in (("paper", 1), (None, power)):
        cells = {method: c for (_, method), c in _by_cell(name, scale).items()}
        assert cells["constant K, constant γ"].client.steps == k
        assert cells["constant K, decaying γ"].client.steps == k
        schedule = cells["decaying K, constant γ"].client.steps
        assert schedule.initial == k and math.isclose(schedule.decay, d_k**exponent, rel_tol=1e-3)
        assert math.isclose(_decay(cells["constant K, decaying γ"].client.lr), d_eta**exponent, rel_tol=1e-3)
        assert all(math.isclose(_decay(c.server.lr), d_eta**exponent, rel_tol=1e-3) for c in cells.values())
        assert {c.client.batch_size for c in cells.values()} == {32}
        assert {c.rounds for c in cells.values()} == ({4000} if scale == "paper" else {4000 // power})


@pytest.mark.parametrize("k", [10, 33, 100])
def test_decaying_k_stackoverflow_runs_fedadam_on_the_appendix_task(k):
    for scale in (None, "paper"):
        cells = {method: c for (_, method), c in _by_cell(f"decaying-k-stackoverflow-k{k}", scale).items()}
        for config in cells.values():
            assert (config.server.optimizer, config.server.lr, config.server.beta1, config.server.beta2) == (
                "adam",
                0.3,
                0.9,
                0.999,
            )
            assert (config.data.vocabulary_size, config.data.tag_count, config.data.samples_per_client) == (
                10_000,
                500,
                250,
            )
            assert config.model.name == "mlr" and config.client.batch_size == 32
        assert cells["decaying K, constant γ"].client.steps.initial == k
        if scale == "paper":
            assert cells["decaying K, constant γ"].client.steps.decay == 0.9996
            assert _decay(cells["constant K, decaying γ"].client.lr) == (0.9996 if k == 100 else 0.999)
            assert {(c.rounds, c.data.max_clients, c.sampling.participation) for c in cells.values()} == {
                (4000, 1000, 0.01)
            }


@pytest.mark.parametrize(
    ("name", "participation", "betas", "rounds"),
    [
        ("adabest-table2-1pct", 0.01, {0.2, 0.4, 0.6}, 1000),
        ("adabest-table2-full", 1.0, {0.98}, 2000),
        ("adabest-table2-iid", 0.1, {0.96}, 1200),
    ],
)
def test_adabest_table2_rows_use_the_papers_beta_per_participation(name, participation, betas, rounds):
    cells = _by_cell(name, "paper")
    assert {c.algorithm.beta for (_, m), c in cells.items() if m.startswith("AdaBest")} == betas
    for (_, method), config in cells.items():
        assert config.sampling.participation == participation and config.rounds == rounds
        assert (config.client.batch_size, config.client.epochs, config.client.lr.initial, _decay(config.client.lr)) == (
            45,
            5,
            0.1,
            0.998,
        )
        assert config.client.weight_decay == 1e-4 and config.model.hidden == (100, 100)
        if method in ("FedDyn",) or method.startswith("AdaBest"):
            assert (config.algorithm.alpha if method == "FedDyn" else config.algorithm.mu) == 0.02
    assert {s for s, _ in cells} <= {f"{p}, {participation:.0%}" for p in ("Dirichlet 0.03", "Dirichlet 0.3", "IID")}


def test_adabest_figure3_samples_ten_clients_a_round_at_both_sizes():
    for (setting, method), config in _by_cell("adabest-figure3", "paper").items():
        clients = config.data.num_clients
        assert clients == int(setting.split()[0]) and round(config.sampling.participation * clients) == 10
        assert (config.data.quotas == "lognormal") == setting.endswith("unbalanced")
        assert config.rounds == (2000 if clients == 1000 else 1200)
        if method == "AdaBest":
            assert config.algorithm.beta == (0.96 if clients == 100 else 0.4)


def test_efl_figures_compare_what_the_paper_varies():
    figure1 = _by_cell("efl-figure1-cifar100")
    assert {
        (c.data.partition, c.data.classes_per_client if c.data.partition != "iid" else None) for c in figure1.values()
    } == {("iid", None), ("classes_per_client", 20), ("classes_per_client", 5)}
    assert {c.model.name for c in figure1.values()} == {"vgg11"} and {c.data.num_clients for c in figure1.values()} == {
        100
    }
    figure2 = _by_cell("efl-figure2")
    assert {c.algorithm.elastic for c in figure2.values()} == {0.0, 0.1, 0.5, 1.0}  # λ = 0 against the others
    assert {c.client.epochs for c in figure2.values()} == {1, 5}
    assert {c.availability.incomplete_probability for c in figure2.values()} == {0.5}
    for name in ("efl-figure3", "efl-figure3-sent140"):
        cells = _by_cell(name)
        assert len({c.sampling.participation for c in cells.values()}) == 3
        assert {c.availability.incomplete_probability for c in cells.values()} == {0.5}
        assert {c.algorithm.name for c in cells.values()} == {"fedavg", "fedprox", "efl"}


# ---------------------------------------------------------------- a round of each on the data here

# Overrides that make a run a round on a handful of clients; the sweep's own settings stay as they are otherwise.
TINY_COMMON = ["rounds=1", "evaluation.every=1", "client.epochs=none", "client.steps=2"]
TINY = {
    "feddyn-table1-massive-cifar10": ["data.num_clients=10", "data.limit_per_class=5", "sampling.participation=0.2"],
    "feddyn-table4-unbalanced": ["data.num_clients=10", "data.limit_per_class=5"],
    "feddyn-table2-dirichlet06-cifar10": ["data.num_clients=10", "data.limit_per_class=5"],
    "feddyn-table5-cifar10": ["data.num_clients=10", "data.limit_per_class=5", "sampling.participation=0.1"],
    "feddyn-table2-dirichlet06-full": ["data.num_clients=10"],
    "feddyn-table2-dirichlet06-partial": ["data.num_clients=10"],
    "feddyn-table5-1pct": ["data.num_clients=10"],
    "feddyn-shakespeare-iid-partial": ["data.max_clients=3", "data.num_clients=3", "data.samples_per_client=100"],
    "feddyn-table6-synthetic": [],
    "fedprox-figures2-4": [
        "MNIST:data.num_clients=20",
        "Shakespeare:data.max_clients=3",
        "Shakespeare:data.samples_per_client=100",
        "evaluation.dissimilarity_every=1",
    ],
    "fedprox-stragglers": [
        "MNIST:data.num_clients=20",
        "Shakespeare:data.max_clients=3",
        "Shakespeare:data.samples_per_client=100",
        "evaluation.dissimilarity_every=1",
    ],
    "decaying-k-femnist-k3": [],
    "decaying-k-femnist-k33": [],
    "decaying-k-shakespeare-k10": ["data.max_clients=3", "data.samples_per_client=100", "sampling.participation=0.5"],
    "decaying-k-shakespeare-k33": ["data.max_clients=3", "data.samples_per_client=100", "sampling.participation=0.5"],
    "decaying-k-shakespeare-k100": ["data.max_clients=3", "data.samples_per_client=100", "sampling.participation=0.5"],
    "adabest-table2-1pct": ["data.num_clients=10", "sampling.participation=0.1"],
    "adabest-table2-full": ["data.num_clients=10"],
    "adabest-table2-iid": ["data.num_clients=10"],
    "efl-figure2": [
        "MNIST:data.num_clients=10",
        "Shakespeare:data.max_clients=3",
        "Shakespeare:data.samples_per_client=100",
    ],
    "efl-figure3": ["data.max_clients=5", "data.samples_per_client=100"],
    # these wait for data this machine lacks: they skip here and run where the files are
    "feddyn-table1-cifar100": ["data.num_clients=10", "sampling.participation=0.2"],
    "adabest-figure3": ["data.num_clients=10", "sampling.participation=0.2"],
    "efl-figure1-cifar100": ["data.num_clients=10", "sampling.participation=0.2", "model.width=8"],
    "fedprox-figures2-4-sent140": [
        "data.max_clients=5",
        "sampling.participation=0.2",
        "evaluation.dissimilarity_every=1",
    ],
    "efl-figure3-sent140": ["data.max_clients=5", "sampling.participation=0.2"],
    "decaying-k-stackoverflow-k10": ["data.max_clients=5", "data.vocabulary_size=100", "data.tag_count=10"],
    "decaying-k-stackoverflow-k33": ["data.max_clients=5", "data.vocabulary_size=100", "data.tag_count=10"],
    "decaying-k-stackoverflow-k100": ["data.max_clients=5", "data.vocabulary_size=100", "data.tag_count=10"],
}


def test_every_new_sweep_has_a_tiny_scale_that_plans():
    assert set(TINY) == set(NEW_SWEEPS)
    for name in TINY:
        assert _first_run_per_data_set(name), name


def _first_run_per_data_set(name: str):
    """The first planned run (seed 0) of each data set the sweep trains on, at the tiny scale."""
    chosen: dict[str, object] = {}
    for planned in _runs(name, None, TINY_COMMON + TINY[name]):
        if planned.seed == 0:
            chosen.setdefault(planned.config.data.name, planned)
    return list(chosen.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_a_round_of_each_data_set_runs_and_records_its_metrics(name, tmp_path):
    runs = _first_run_per_data_set(name)
    missing = [
        r.config.data.name for r in runs if entry_of(r.config.data).location and data_location(r.config.data) is None
    ]
    if missing:
        pytest.skip(f"{', '.join(missing)} not on this machine (set DRIFTLAB_DATA)")
    for planned in runs:
        out = tmp_path / planned.dir
        run(planned.config, out)
        (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert record["round"] == 1 and record["num_reporting"] >= 1, planned.dir
        assert "train_loss" in record and "test_loss" in record, planned.dir
        assert ("test_recall_at_5" if planned.config.data.name == "stackoverflow" else "test_accuracy") in record
        if planned.config.evaluation.dissimilarity_every:  # Figure 4's B(θ)² and gradient variance
            assert {"dissimilarity_b2", "gradient_variance"} <= set(record), sorted(record)
