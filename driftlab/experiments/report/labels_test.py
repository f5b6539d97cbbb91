from __future__ import annotations

from pathlib import Path

from driftlab.algorithm_labels import BUILT_IN_LABELS
from driftlab.algorithms import registry
from driftlab.experiments.report.labels import algorithm_label, method_order
from driftlab.experiments.report.read import RunData


def _run(algorithm: str, optimizer: str = "sgd", method: str = "") -> RunData:
    return RunData(
        Path(algorithm), {"algorithm": {"name": algorithm}, "server": {"optimizer": optimizer}}, [], None, method=method
    )


def test_built_in_labels_and_order_are_the_registrys():
    # the report reads the table (no torch); the registry's entries are built from it
    assert tuple(BUILT_IN_LABELS) == registry.BUILT_IN
    for name in registry.BUILT_IN:
        assert algorithm_label({"algorithm.name": name}) == registry.ALGORITHMS[name].label
    runs = [_run(name) for name in reversed(registry.BUILT_IN)]
    assert [run.config["algorithm"]["name"] for run in sorted(runs, key=method_order)] == list(registry.BUILT_IN)


def test_server_optimizers_name_fedopt_methods_and_unknown_algorithms_keep_their_name():
    assert algorithm_label({"algorithm.name": "fedavg", "server.optimizer": "adam"}) == "FedAdam"
    assert algorithm_label({"algorithm.name": "fedavg", "server.optimizer": "momentum"}) == "FedAvgM"
    assert algorithm_label({"algorithm.name": "scaffold", "server.optimizer": "adam"}) == "SCAFFOLD + server adam"
    assert algorithm_label({"algorithm.name": "not_registered"}) == "not_registered"
    # an algorithm the registry does not know comes after the built-ins; FedAvg's FedOpt variants after FedAvg
    ordered = sorted(
        [_run("not_registered"), _run("fedprox"), _run("fedavg", "adam", "FedAdam"), _run("fedavg")], key=method_order
    )
    assert [(run.config["algorithm"]["name"], run.method) for run in ordered] == [
        ("fedavg", ""),
        ("fedavg", "FedAdam"),
        ("fedprox", ""),
        ("not_registered", ""),
    ]


def test_asynchronous_runs_are_fedbuff_after_their_synchronous_method_and_keep_the_synchronous_setting():
    from driftlab.experiments.report.labels import asynchronous_label, label_standalone

    assert asynchronous_label("FedAvg") == "FedBuff" and asynchronous_label("FedProx") == "FedBuff (FedProx)"
    system = {"profiles": "lognormal", "speed_median": 100.0, "deadline": None}

    def run(name: str, participation: float, asynchronous: bool) -> RunData:
        config = {
            "algorithm": {"name": name},
            "data": {"name": "synthetic"},
            "sampling": {"participation": participation},
            "system": system,
        }
        if asynchronous:
            config["asynchronous"] = {"concurrency": 10, "buffer": 5}
        return RunData(Path(f"{name}-{asynchronous}"), config, [], None)

    runs = [run("fedprox", 0.1, True), run("fedavg", 0.1, True), run("fedavg", 0.5, False), run("fedprox", 0.5, False)]
    label_standalone(runs)
    assert [r.method for r in runs] == ["FedBuff (FedProx)", "FedBuff", "FedAvg", "FedProx"]
    assert {r.setting for r in runs} == {"synthetic"}  # an asynchronous run's [sampling] defaults differ from nothing
    assert [r.method for r in sorted(runs, key=method_order)] == ["FedAvg", "FedBuff", "FedProx", "FedBuff (FedProx)"]
