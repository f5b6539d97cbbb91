"""The shipped ``efl-table2`` sweep (issue 26): EFL Table 2's methods on its two data sets, each method's own models
evaluated on each client's own split, and every run of it runs.

(Every shipped sweep is also planned at each of its scales by ``driftlab/experiments/sweep/sweep_test.py``.)
"""

from __future__ import annotations

import json

import pytest

from driftlab.experiments.run.datasets import data_location
from driftlab.experiments.run.runner import run
from driftlab.experiments.sweep import load_sweep, plan

TABLE_2 = ["FedAvg", "FedGATE", "VRL-SGD", "APFL", "FedAMP", "EFL"]  # the paper's rows, in its order
EXTRA = ["Ditto (not in Table 2)", "FedAvg + fine-tuning (not in Table 2)"]
ALGORITHMS = ["fedavg", "fedgate", "vrlsgd", "apfl", "fedamp", "efl", "ditto", "fedavg"]

# A round each, as small as the data allow: MNIST over 10 clients, Shakespeare's 3 largest roles of 100 windows.
TINY = [
    "MNIST:rounds=1",
    "Shakespeare:rounds=1",
    "MNIST:data.num_clients=10",
    "Shakespeare:data.max_clients=3",
    "Shakespeare:data.samples_per_client=100",
    "client.epochs=none",
    "client.steps=2",
    "evaluation.every=1",
]


def _runs(scale: str | None = None, overrides=()):
    return plan(load_sweep("efl-table2"), scale, overrides)


@pytest.mark.parametrize("scale", [None, "paper"])
def test_the_table_rows_and_settings_and_what_every_run_shares(scale):
    runs = _runs(scale)
    seeds = [0, 1, 2]  # at both scales
    first_seed = [run for run in runs if run.seed == 0]
    assert [run.setting for run in first_seed[::8]] == ["MNIST", "Shakespeare"]
    assert [run.method for run in first_seed[:8]] == [run.method for run in first_seed[8:]] == TABLE_2 + EXTRA
    assert sorted(run.seed for run in runs) == sorted(seeds * 16)
    for planned in runs:
        config = planned.config
        assert config.algorithm.name == ALGORITHMS[(TABLE_2 + EXTRA).index(planned.method)], planned.method
        # each client's own test split, every client completing, no compression: the comparison the paper makes
        assert config.data.client_test_fraction == 0.2 and config.evaluation.client_spread
        assert config.availability.incomplete_probability == 0 and config.compression.ratio == 1
        assert (config.evaluation.finetune_steps == 10) == planned.method.startswith("FedAvg + fine-tuning")
        if planned.setting == "MNIST":
            # 100 clients each holding exactly m = 2 classes (EFL's m-class non-IID split)
            assert (config.data.name, config.data.partition, config.data.classes_per_client) == (
                "mnist",
                "classes_per_client",
                2,
            )
            assert config.data.num_clients == 100 and config.model.name == "mlp"
            assert (config.rounds, config.client.epochs) == ((500, 5) if scale == "paper" else (100, 1))
        else:
            assert (config.data.name, config.data.partition, config.model.name) == ("shakespeare", "natural", "lstm")
            assert (config.data.max_clients, config.data.samples_per_client) == (
                (100, 2000) if scale == "paper" else (5, 300)
            )
            assert config.rounds == (100 if scale == "paper" else 15)


def test_the_description_states_the_assumed_settings():
    text = " ".join(load_sweep("efl-table2").description.split())
    first_seed = [run for run in _runs() if run.seed == 0]
    mnist, shakespeare = first_seed[0].config, first_seed[8].config
    assert f"m = {mnist.data.classes_per_client}" in text and f"{mnist.rounds} rounds" in text
    assert f"lr {mnist.client.lr}, batch {mnist.client.batch_size}, {mnist.client.epochs} epoch," in text
    assert (
        f"the {shakespeare.data.max_clients} largest roles" in text
        and f"{shakespeare.data.samples_per_client} windows" in text
    )
    assert (
        f"batch {shakespeare.client.batch_size}, {shakespeare.client.epochs} epochs" in text
        and f"{shakespeare.rounds} rounds" in text
    )
    assert "Our assumptions" in text and "CIFAR-100 and Sent140" in text


@pytest.mark.slow
def test_every_method_runs_a_round_on_both_data_sets_and_records_its_accuracies(tmp_path):
    runs = _runs(None, TINY)
    if any(data_location(planned.config.data) is None for planned in runs):
        pytest.skip("MNIST or tinyshakespeare is not on this machine")
    for planned in runs:
        out = tmp_path / planned.dir
        run(planned.config, out)
        (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert {"test_accuracy", "client_test_accuracy_mean", "client_test_accuracy_std"} <= set(record), planned.dir
        personal = (
            planned.config.algorithm.name in ("apfl", "fedamp", "ditto") or planned.config.evaluation.finetune_steps
        )
        assert ("personal_test_accuracy_mean" in record) == bool(personal), planned.dir
