"""Every shipped sweep says where each of its settings comes from, and the settings the papers fix are the ones planned.

A sweep's description ends with three parts, in this order (issue 29):

    From the paper (<which paper, table, section or appendix>): ...
    From the authors' code (<repository and files>): ...      or: From the authors' code: nothing (<why>).
    Our assumptions: ...

``CLAIMS`` lists, per sweep, settings and the part that must name them: a value moved from one
part to another (or dropped) fails here. The planning tests then check that the values the
papers give are what every run is configured with, at the default scale and at ``--scale paper``.
"""

from __future__ import annotations

import math
import re

import pytest

from driftlab.experiments.config import load_config
from driftlab.experiments.sweep import load_sweep, plan
from driftlab.experiments.sweep.shipped import sweep_names

MARKERS = {"paper": "From the paper", "code": "From the authors' code", "ours": "Our assumptions"}


def provenance(description: str) -> dict[str, str]:
    """The text of each provenance part ("paper", "code", "ours"), from just after its marker to the next part,
    whitespace collapsed; a ValueError when a part is missing, repeated or out of order."""
    text = " ".join(description.split())
    starts = []
    for marker in MARKERS.values():
        found = [m.start() for m in re.finditer(re.escape(marker) + r"\b", text)]
        if len(found) != 1:
            raise ValueError(f"{marker!r} occurs {len(found)} times; a description names each source once")
        starts.append(found[0])
    if starts != sorted(starts):
        raise ValueError(f"the parts must come in the order {', '.join(MARKERS.values())}")
    bounds = [*starts, len(text)]
    return {
        part: text[bounds[i] + len(marker) : bounds[i + 1]].strip() for i, (part, marker) in enumerate(MARKERS.items())
    }


def test_provenance_reads_the_three_parts_and_refuses_a_missing_or_misplaced_one():
    described = (
        "Intro. From the paper (X, Table 1): a = 1. From the authors' code (y.py): b = 2. Our assumptions: c = 3."
    )
    assert provenance(described) == {"paper": "(X, Table 1): a = 1.", "code": "(y.py): b = 2.", "ours": ": c = 3."}
    with pytest.raises(ValueError, match="occurs 0 times"):
        provenance("From the paper (X): a. Our assumptions: c.")
    with pytest.raises(ValueError, match="in the order"):
        provenance("Our assumptions: c. From the paper (X): a. From the authors' code: nothing.")


@pytest.mark.parametrize("name", sweep_names())
def test_every_shipped_sweep_says_which_settings_are_the_papers_the_authors_code_s_and_ours(name):
    parts = provenance(load_sweep(name).description)
    assert len(parts["paper"]) > 20, f"{name}: list the values taken from the paper (and where in it)"
    assert parts["code"].startswith(("(", ": nothing")), (
        f"{name}: name the authors' code files, or say there is nothing from it"
    )
    assert len(parts["ours"]) > 10, f"{name}: list what is our assumption (at least the default scale's cuts)"


# The FedDyn paper's CIFAR-10 tuning, and how we read it, which both tuned sweeps (partial and full participation) state.
FEDDYN_TUNED_PAPER = (
    "weight decay 1e-3",
    "5 epochs",
    "batch 50",
    "[0.992, 0.998, 1.0]",
    "α ∈ {1e-3, 1e-2, 1e-1}",
    "μ ∈ {1e-2, 1e-3, 1e-4}",
    "1000 rounds",
    "names no validation set",
)
FEDDYN_TUNED_OURS = ("data.validation_fraction = 0.1", "final validation accuracy", "3 decays × 3 αs")

# Settings and the part of the description that must name them.
CLAIMS: dict[str, dict[str, tuple[str, ...]]] = {
    "feddyn-table2-partial": {
        "paper": (
            "weight decay 1e-4",
            "lr decay 0.998",
            "α = 0.03 for 10% IID",
            "α = 0.01 for 10% Dirichlet 0.3",
            "FedProx μ = 1e-4",
            "FedDyn 50",
            "SCAFFOLD K = 600",
            "FedAvg 10",
            "batch 50",
        ),
        "code": ("clipped at norm 10", "mean of every client's latest model"),
        "ours": ("FedProx's 10 epochs", "1000 rounds", "5 epochs"),
    },
    "feddyn-table2-full": {
        "paper": (
            "weight decay 1e-4",
            "no lr decay",
            "α = 0.01",
            "FedProx μ = 1e-4",
            "FedDyn 50",
            "SCAFFOLD K = 600",
            "FedAvg 20",
            "500 rounds",
        ),
        "code": ("clipped at norm 10",),
        "ours": ("FedProx's 20 epochs", "5 epochs"),
    },
    "feddyn-table2-headline": {
        "paper": ("weight decay 1e-4", "α = 0.01", "FedDyn 50", "FedAvg 20", "500 rounds"),
        "code": ("clipped at norm 10",),
        "ours": ("FedProx's 20 epochs",),
    },
    "feddyn-cifar10-partial": {
        "paper": ("weight decay 1e-3", "5 epochs", "batch 50", "{0.992, 0.998, 1}", "1000 rounds"),
        "code": ("α = 0.01", "μ = 1e-4", "fc 384", "clipped at norm 10", "augmentation"),
        "ours": ("30 images per client",),
    },
    "feddyn-cifar10-full": {
        "paper": ("weight decay 1e-3", "5 epochs", "batch 50", "{0.992, 0.998, 1}", "1000 rounds"),
        "code": ("α = 0.01", "μ = 1e-4", "fc 384", "clipped at norm 10", "augmentation"),
        "ours": ("20 clients of 150 images",),
    },
    "feddyn-cifar10-partial-tuned": {
        "paper": FEDDYN_TUNED_PAPER,
        "code": ("fc 384", "clipped at norm 10", "augmentation"),
        "ours": (*FEDDYN_TUNED_OURS, "30 images per client"),
    },
    "feddyn-cifar10-full-tuned": {
        "paper": FEDDYN_TUNED_PAPER,
        "code": ("fc 384", "clipped at norm 10", "augmentation"),
        "ours": (*FEDDYN_TUNED_OURS, "20 clients of 150 images"),
    },
    "feddyn-table2-partial-tuned": {
        "paper": (
            "weight decay 1e-4",
            "lr decay 0.998",
            "learning rates in [.1, .01]",
            "epochs in [10, 20, 50]",
            "Ks in [120, 240, 600]",
            "for a fixed 100 communication rounds",
            "α = 0.03 for 10% IID",
            "α = 0.01 for 10% Dirichlet 0.3",
            "FedProx μ = 1e-4",
            "batch 50",
            "names no validation set",
            "µs in [1, .01, .0001]",
            "αs in [.001, .01, .03, .1]",
            "α for FedDyn only and μ for FedProx only",
        ),
        "code": ("clipped at norm 10", "mean of every client's latest model"),
        "ours": (
            "data.validation_fraction = 0.1",
            "SCAFFOLD's K is 110, 220 or 550",
            "halving at round 100",
            "20 rounds",
            "the full product",
        ),
    },
    "feddyn-shakespeare": {
        "paper": (
            "2,000 training and 400 test windows per client",
            "batch 100",
            "lr 1",
            "5 epochs",
            "weight decay 1e-4",
            "α = 0.009",
            "μ = 1e-4",
            "SCAFFOLD K = 100",
            "150 rounds",
        ),
        "code": ("2,000 // 5 = 400", "norm 10"),
        "ours": ("tinyshakespeare", "largest roles"),
    },
    "adabest-table2-cifar10": {
        "paper": ("batch 45", "decaying 0.998", "weight decay 1e-3", "μ = 0.02", "β = 0.96", "1200 rounds"),
        "code": ("nothing",),
        "ours": ("no gradient clipping", "10% of its clients out"),
    },
    "adabest-table2-mnist": {
        "paper": (
            "batch 45",
            "decaying 0.998",
            "weight decay 1e-4",
            "μ = 0.02",
            "β = 0.96",
            "two hidden layers of 100",
        ),
        "code": ("nothing",),
        "ours": ("MNIST (600 images per client) in place of EMNIST-L",),
    },
    "adabest-table2-mnist-tuned": {
        "paper": (
            "batch 45",
            "decaying 0.998",
            "weight decay 1e-4",
            "[0.002, 0.02, 0.2]",
            "[0.94, 0.96, 0.98, 1.0]",
            "500 rounds",
            "validation clients",
        ),
        "code": ("nothing",),
        "ours": (
            "MNIST (600 images per client) in place of EMNIST-L",
            "validation on rows, not clients",
            "halving at round 500",
        ),
    },
    "adabest-table2-cifar10-tuned": {
        "paper": (
            "batch 45",
            "decaying 0.998",
            "weight decay 1e-3",
            "[0.002, 0.02, 0.2]",
            "[0.94, 0.96, 0.98, 1.0]",
            "500 rounds",
            "validation clients",
        ),
        "code": ("nothing",),
        "ours": ("no gradient clipping", "validation on rows, not clients", "halving at round 500"),
    },
    "adabest-figure1-mnist": {
        "paper": (
            "1000 balanced training clients",
            "Dirichlet 0.3",
            "5 clients a round",
            "batch 45",
            "μ = 0.02",
            "8000 rounds",
        ),
        "code": ("nothing",),
        "ours": ("MNIST (60 images per client) in place of CIFAR-100", "β = 0.9", "weight decay 1e-4"),
    },
    "decaying-k-quadratic": {
        "paper": ("γ = 0.1", "K_0 = 10", "d_γ = 0.995", "d_K = 0.995", "the start x_1 = 0.4", "3000"),
        "code": ("nothing",),
        "ours": ("20-point grid", "server lr 1"),
    },
    "decaying-k-femnist": {
        "paper": ("batch 32", "K = 10", "γ = 0.3", "decaying 0.9996", "4000 rounds"),
        "code": ("nothing",),
        "ours": ("105 LEAF writers", "0.992 = 0.9996^20"),
    },
    "decaying-k-time": {
        "paper": ("batch 32", "K = 10", "γ = 0.3", "4000 rounds"),
        "code": ("nothing",),
        "ours": ("the device model",),
    },
    "efl-table2-mnist": {
        "paper": ("exactly m classes", "100 clients", "BMTA"),
        "code": ("nothing",),
        "ours": ("m = 2", "lr 0.05", "λ = 0.5"),
    },
    "fedprox-figure1": {
        "paper": ("30 devices", "E = 20", "batch 10", "lr 0.01", "μ ∈ {0, 1}", "10%"),
        "code": ("200 rounds", "int(LogNormal(4, 2)) + 50", "weighted by sample count"),
        "ours": ("3 seeds",),
    },
    "dp-fedavg-mnist": {"paper": ("fixed denominator",), "code": ("nothing",), "ours": ("C, z, δ",)},
    "dp-scaffold-synthetic": {"paper": ("equal ε",), "code": ("K = 50", "T = 400"), "ours": ("client-level DP",)},
    "fedbuff-femnist": {"paper": ("1/√(1 + τ)",), "code": ("B = 10",), "ours": ("client lr 0.2", "C = 10 and 30")},
}


def test_claims_name_shipped_sweeps_only():
    assert set(CLAIMS) <= set(sweep_names())


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_each_setting_is_credited_to_its_source(name):
    parts = provenance(load_sweep(name).description)
    assert parts["paper"].startswith("("), (
        f"{name}: name the paper and its table, section or appendix: From the paper (...)"
    )
    for part, phrases in CLAIMS[name].items():
        for phrase in phrases:
            assert phrase in parts[part], f"{name}: {phrase!r} belongs in {MARKERS[part]!r}: {parts[part]!r}"


# ---------------------------------------------------------------- the values hold


def decay(lr) -> float:
    """A client lr's per-round decay: 1 for a constant lr."""
    return 1.0 if isinstance(lr, (int, float)) else lr.decay


def runs(name: str, scale: str | None = None) -> dict[tuple[str, str], object]:
    """Each (setting, method)'s config, seed aside (seeds differ in nothing but the seed)."""
    return {(run.setting, run.method): run.config for run in plan(load_sweep(name), scale)}


@pytest.mark.parametrize("scale", [None, "paper"])
def test_feddyn_table2_partial_sets_the_appendix_alpha_per_setting_at_every_scale(scale):
    configs = runs("feddyn-table2-partial", scale)
    assert configs["IID, 10%", "FedDyn"].algorithm.alpha == 0.03
    assert configs["Dirichlet 0.3, 10%", "FedDyn"].algorithm.alpha == 0.01
    assert all(
        c.client.weight_decay == 1e-4 and c.client.batch_size == 50 and c.client.clip_norm == 10
        for c in configs.values()
    )
    # the setting's α reaches FedDyn only: the other methods start their [algorithm] section afresh
    assert all(not hasattr(c.algorithm, "alpha") for (_, method), c in configs.items() if method != "FedDyn")
    assert configs["IID, 10%", "FedProx"].algorithm.mu == 1e-4
    if scale == "paper":
        epochs = {method: c.client.epochs for (setting, method), c in configs.items() if setting == "IID, 10%"}
        assert epochs == {"FedDyn": 50, "SCAFFOLD": 50, "FedAvg": 10, "FedProx": 10}
        assert {decay(c.client.lr) for c in configs.values()} == {0.998} and {c.rounds for c in configs.values()} == {
            1000
        }


@pytest.mark.parametrize("name", ["feddyn-table2-full", "feddyn-table2-headline"])
def test_feddyn_table2_full_participation_runs_the_appendix_settings_at_paper_scale(name):
    configs = runs(name, "paper")
    epochs = {method: c.client.epochs for (_, method), c in configs.items()}
    assert epochs == {"FedDyn": 50, "SCAFFOLD": 50, "FedAvg": 20, "FedProx": 20}
    assert {decay(c.client.lr) for c in configs.values()} == {1.0} and {c.rounds for c in configs.values()} == {500}
    assert all(c.client.weight_decay == 1e-4 for c in configs.values())
    assert {c.algorithm.alpha for (_, method), c in configs.items() if method == "FedDyn"} == {0.01}


@pytest.mark.parametrize("name", ["feddyn-cifar10-partial", "feddyn-cifar10-full"])
def test_feddyn_cifar10_runs_every_method_at_each_decay_the_paper_picks_from(name):
    configs = runs(name)
    decays: dict[tuple[str, str], set[float]] = {}
    for (setting, method), config in configs.items():
        algorithm, label = method.split(", ")
        assert label == f"lr decay {decay(config.client.lr):g}"
        decays.setdefault((setting, algorithm), set()).add(decay(config.client.lr))
        assert config.client.weight_decay == 1e-3 and config.client.batch_size == 50 and config.client.lr != 0
    assert len(decays) == 8 and all(found == {0.992, 0.998, 1.0} for found in decays.values())
    paper = runs(name, "paper")
    assert all(c.client.epochs == 5 and c.rounds == 1000 for c in paper.values())


@pytest.mark.parametrize("source", ["shakespeare-feddyn", "feddyn-shakespeare"])
def test_shakespeare_keeps_the_authors_2000_training_and_400_test_windows(source):
    if source in sweep_names():
        data = next(iter(runs(source, "paper").values())).data
    else:
        data = load_config(source).data
    train = math.floor(
        (1 - data.client_test_fraction) * data.samples_per_client + 1e-9
    )  # load_shakespeare_text's split
    assert (data.samples_per_client, train, data.samples_per_client - train) == (2400, 2000, 400)
    assert data.max_clients == 100


def test_efl_table2_mnist_gives_every_client_exactly_m_classes():
    configs = runs("efl-table2-mnist")
    assert {(c.data.partition, c.data.classes_per_client, c.data.num_clients) for c in configs.values()} == {
        ("classes_per_client", 2, 100)
    }


@pytest.mark.parametrize(
    ("name", "weight_decay"),
    [("adabest-table2-cifar10", 1e-3), ("adabest-table2-mnist", 1e-4), ("adabest-figure1-mnist", 1e-4)],
)
def test_adabest_sweeps_train_as_the_adabest_paper_does(name, weight_decay):
    configs = runs(name)
    for (_, method), config in configs.items():
        assert (config.client.batch_size, config.client.epochs, config.client.lr.initial, decay(config.client.lr)) == (
            45,
            5,
            0.1,
            0.998,
        )
        assert config.client.weight_decay == weight_decay
        if method in ("FedDyn", "AdaBest"):
            assert (config.algorithm.alpha if method == "FedDyn" else config.algorithm.mu) == 0.02
    if name.startswith("adabest-table2"):
        assert {c.algorithm.beta for (_, method), c in configs.items() if method == "AdaBest"} == {0.96}
        assert {c.sampling.participation for c in configs.values()} == {0.1}


def test_decaying_k_sweeps_use_table_5_and_section_3_rates_at_paper_scale():
    femnist = runs("decaying-k-femnist", "paper")
    assert {decay(c.server.lr) for c in femnist.values()} == {0.9996}
    assert {(c.client.batch_size, c.rounds) for c in femnist.values()} == {(32, 4000)}
    assert decay(femnist["", "constant K, decaying γ"].client.lr) == 0.9996
    assert femnist["", "decaying K, constant γ"].client.steps.decay == 0.9996
    quadratic = runs("decaying-k-quadratic", "paper")
    assert decay(quadratic["", "constant K, decaying γ"].client.lr) == 0.995
    assert quadratic["", "decaying K, constant γ"].client.steps.decay == 0.995
    assert {c.rounds for c in quadratic.values()} == {3000}
    assert {c.model.start for c in quadratic.values()} == {0.4}  # the paper's x_1 (Section 3)
