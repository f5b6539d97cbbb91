"""Assembling a run: your own data, model and loss, and what they let you state (least squares with a known answer)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import driftlab
from driftlab.data.federated import FederatedArrays, federated_dataset_from_arrays
from driftlab.experiments.config import ConfigError, load_config
from driftlab.experiments.run.assembly import build_model, build_simulation, features_run_info, is_classifier, user_data
from driftlab.simulation.backends.vectorized import LinearReluStack

BACKENDS = ("sequential", "vectorized")


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return 0.5 * (outputs.squeeze(1) - targets) ** 2


def doubled_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return 2.0 * F.cross_entropy(outputs, targets, reduction="none")


def mean_squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs.squeeze(1) - targets) ** 2).mean()  # wrong on purpose: one number for the batch


def least_squares(
    clients: int = 3, rows: int = 20, dimension: int = 3, seed: int = 0
) -> tuple[FederatedArrays, np.ndarray, float]:
    """Clients holding rows (a_i, b_i) of one least-squares problem, client k's rows scaled by a curvature of its own.

    Returns the arrays, the minimiser of (1/n) Σ ½ (a_i·x − b_i)² (numpy's lstsq) and 1/λ_max of that objective's Hessian.
    Equal client sizes make the weighted and the uniform client average the same objective.
    """
    rng = np.random.default_rng(seed)
    scales = np.linspace(0.5, 2.0, clients)
    a = np.concatenate([scale * rng.normal(size=(rows, dimension)) for scale in scales])
    b = rng.normal(size=clients * rows)
    minimizer = np.linalg.lstsq(a, b, rcond=None)[0]
    lr = 1.0 / float(np.linalg.eigvalsh(a.T @ a / len(a)).max())
    arrays = FederatedArrays(a, b, np.repeat(np.arange(clients), rows), a[:5], b[:5])
    return arrays, minimizer, lr


def _exact_rounds(algorithm: str, steps: int, lr: float, backend: str, rounds: int = 300) -> dict:
    """Full participation, every local step on the client's whole data: exact local gradient steps, in float64."""
    return {
        "rounds": rounds,
        "precision": "float64",
        "backend": backend,
        "algorithm": {"name": algorithm},
        "client": {"lr": lr, "steps": steps, "batch_size": 1000},
        "sampling": {"participation": 1.0},
        "evaluation": {"every": rounds},
    }


@pytest.mark.parametrize("backend", ["sequential", pytest.param("vectorized", marks=pytest.mark.slow)])
@pytest.mark.parametrize("algorithm, steps", [("fedavg", 1), ("scaffold", 5)])
def test_federated_least_squares_reaches_the_known_minimizer(algorithm, steps, backend):
    arrays, minimizer, lr = least_squares()
    result = driftlab.run(
        _exact_rounds(algorithm, steps, lr, backend), data=arrays, model=nn.Linear(3, 1, bias=False), loss=squared_error
    )
    assert np.abs(result.final_params.numpy() - minimizer).max() < 1e-12
    assert "test_accuracy" not in result.records[-1]  # floating targets: no accuracy
    assert result.config.data.name == "custom" and result.config.model.loss.endswith(":squared_error")


def test_fedavg_with_several_local_steps_drifts_from_the_minimizer():
    """The test above has teeth: with different curvatures, FedAvg's local steps move its fixed point (SCAFFOLD's do not)."""
    arrays, minimizer, lr = least_squares()
    fedavg = driftlab.run(
        _exact_rounds("fedavg", 5, lr / 4, "sequential"),
        data=arrays,
        model=nn.Linear(3, 1, bias=False),
        loss=squared_error,
    )
    assert np.abs(fedavg.final_params.numpy() - minimizer).max() > 1e-4


def _classification(seed: int = 0) -> FederatedArrays:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0)
    return FederatedArrays(x, y, np.arange(40) % 4, x[:8], y[:8])


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_backends_train_with_your_loss_not_their_own_cross_entropy(backend):
    """A Linear-ReLU stack has a hand-written cross-entropy path on the vectorized backend; another loss must not take it."""
    config = {
        "rounds": 2,
        "backend": backend,
        "client": {"steps": 2, "batch_size": 5, "lr": 0.1},
        "sampling": {"participation": 1.0},
    }
    network = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    doubled = driftlab.run(config, data=_classification(), model=network, loss=doubled_cross_entropy)
    plain = driftlab.run(config, data=_classification(), model=network)
    reference = driftlab.run(
        {**config, "backend": "sequential"}, data=_classification(), model=network, loss=doubled_cross_entropy
    )
    assert torch.allclose(doubled.final_params, reference.final_params, atol=1e-6)
    assert not torch.allclose(doubled.final_params, plain.final_params, atol=1e-4)
    assert "test_accuracy" in doubled.records[-1]  # integer targets: a classifier, by default
    sim, _ = build_simulation(
        doubled.config, network, data=federated_dataset_from_arrays(_classification()), loss=doubled_cross_entropy
    )
    assert LinearReluStack.match(sim.model) is None


def test_model_loss_in_the_config_is_imported_by_name():
    config = load_config(
        {"rounds": 1, "model": {"loss": "driftlab.experiments.run.assembly_test:doubled_cross_entropy"}}
    )
    config, data = user_data(config, _classification())
    flat = build_model(config, data, None)
    assert flat.example_loss is doubled_cross_entropy and flat.is_classifier


def test_classifier_false_turns_accuracy_off():
    result = driftlab.run({"rounds": 1, "sampling": {"participation": 1.0}}, data=_classification(), classifier=False)
    assert "test_accuracy" not in result.records[-1] and result.config.model.classifier is False


def test_is_classifier_follows_the_targets_unless_the_config_says():
    classes = federated_dataset_from_arrays(_classification())
    arrays, _, _ = least_squares()
    values = federated_dataset_from_arrays(arrays)
    default = load_config(None)
    assert is_classifier(default, classes) and not is_classifier(default, values)
    assert is_classifier(load_config(None, ["model.classifier=true"]), values)


def test_floating_targets_without_a_loss_ask_for_one():
    arrays, _, _ = least_squares()
    with pytest.raises(
        ConfigError, match=r"float64 values, not class ids.*loss=fn\) or model.loss = \"module:function\""
    ):
        driftlab.run({"rounds": 1}, data=arrays, model=nn.Linear(3, 1))


def test_a_loss_that_reduces_over_the_batch_is_refused():
    arrays, _, _ = least_squares()
    with pytest.raises(ConfigError, match=r"returned \(\) for a batch of .* one value per example"):
        driftlab.run({"rounds": 1}, data=arrays, model=nn.Linear(3, 1), loss=mean_squared_error)


def test_a_loss_that_is_not_a_named_function_is_refused():
    with pytest.raises(ConfigError, match="loss= takes a function defined with def at the top level"):
        driftlab.run({"rounds": 1}, data=_classification(), loss=lambda outputs, targets: outputs.sum(1))


def test_data_with_a_config_naming_another_data_set_is_refused():
    with pytest.raises(
        ConfigError, match=r"data= is your own data, but the config names data set 'mnist'; set data.name = \"custom\""
    ):
        driftlab.run({"rounds": 1, "data": {"name": "mnist"}}, data=_classification())


def test_other_data_than_the_config_records_is_refused():
    config, _ = user_data(load_config(None), _classification(seed=0))
    with pytest.raises(ConfigError, match=r"is not the data this configuration records .*remove data.digest"):
        user_data(config, _classification(seed=1))


def classification_arrays() -> FederatedArrays:
    """The data above as a data loader returns it (``data.loader``)."""
    return _classification()


def test_data_given_in_process_and_through_a_loader_are_the_same_run():
    """Both are prepared alike (client_test_fraction held out) and record the same digest, so either can resume the other."""
    held_out = ["data.client_test_fraction=0.25", "rounds=1", "sampling.participation=1.0"]
    given, given_data = user_data(load_config(None, held_out), _classification())
    loaded, loaded_data = user_data(
        load_config(
            None,
            [*held_out, "data.name=custom", "data.loader=driftlab.experiments.run.assembly_test:classification_arrays"],
        ),
        None,
    )
    assert given.data.digest == loaded.data.digest
    assert (
        [len(rows) for rows in given_data.client_test_indices]
        == [len(rows) for rows in loaded_data.client_test_indices]
        != [0, 0, 0, 0]
    )
    record = driftlab.run(given, data=_classification()).records[-1]
    assert 0.0 <= record["client_test_accuracy_mean"] <= 1.0


def test_regression_targets_keep_their_kind_when_clients_hold_out_test_rows():
    arrays, _, _ = least_squares()
    result = driftlab.run(
        {"rounds": 1, "data": {"client_test_fraction": 0.2}}, data=arrays, model=nn.Linear(3, 1), loss=squared_error
    )
    assert "test_loss" in result.records[-1] and "client_test_accuracy_mean" not in result.records[-1]


def test_a_loss_imported_from_a_file_is_recorded_by_its_path(tmp_path):
    from driftlab.plugins import import_function

    (tmp_path / "losses.py").write_text(
        "def squared(outputs, targets):\n    return 0.5 * (outputs.squeeze(1) - targets) ** 2\n"
    )
    loss = import_function(f"{tmp_path / 'losses.py'}:squared", "model.loss")
    arrays, _, _ = least_squares()
    result = driftlab.run({"rounds": 1}, data=arrays, model=nn.Linear(3, 1), loss=loss)
    assert result.config.model.loss == f"{(tmp_path / 'losses.py').resolve()}:squared"


# ---------------------------------------------------------------- [system] and [asynchronous]


def _timed_simulation(table: dict, model=None):
    config, data = user_data(load_config(table), _classification())
    return config, *build_simulation(config, model, data=data)


def test_system_gives_the_plan_and_starts_the_clock_at_zero():
    from driftlab.simulation.time.plan import SystemPlan
    from driftlab.simulation.time.profiles import LognormalProfiles

    config, sim, state = _timed_simulation(
        {"seed": 3, "system": {"speed_median": 50.0, "deadline": 20.0, "over_selection": 0.5}}
    )
    assert sim.system == SystemPlan(LognormalProfiles(3, 50.0, 0.5, 2e7, 5e6, 0.5), 20.0, "partial", 0.5)
    assert state.clock == 0.0 and sim.asynchronous is None
    assert features_run_info(config, sim, only="system") == {"system": {"profiles": "lognormal"}}
    untimed, sim, state = _timed_simulation({"seed": 3})
    assert sim.system is None and state.clock is None and features_run_info(untimed, sim, only="system") == {}


def test_a_trace_is_read_for_the_datas_clients_and_recorded_by_its_digest(tmp_path):
    trace = tmp_path / "devices.csv"
    trace.write_text(
        "client,speed,download,upload,start,end\n" + "".join(f"{k},{k + 1},1e6,1e5,0,100\n" for k in range(4))
    )
    config, sim, _ = _timed_simulation({"system": {"profiles": "trace", "trace": str(trace)}})
    assert sim.system.profiles.profile(2, 50.0).speed == 3.0 and sim.system.profiles.profile(2, 100.0) is None
    assert features_run_info(config, sim, only="system") == {
        "system": {"profiles": "trace", "trace": str(trace), "sha256": hashlib.sha256(trace.read_bytes()).hexdigest()}
    }


def test_a_bad_trace_is_a_config_error_before_the_model_is_built(tmp_path):
    trace = tmp_path / "devices.csv"
    trace.write_text("client,speed,download,upload\n0,1,1,1\n1,1,1,1\n")  # the data has 4 clients
    built = []

    def factory(input_shape, num_classes):
        built.append(input_shape)
        return nn.Linear(4, 3)

    with pytest.raises(
        ConfigError, match=r"^system.trace: .*devices.csv: 2 of the data set's 4 clients have no row \(client 2, 3\)"
    ):
        _timed_simulation({"system": {"profiles": "trace", "trace": str(trace)}}, model=factory)
    assert built == []


def test_asynchronous_gives_the_plan_for_an_algorithm_that_may_run_so():
    from driftlab.simulation.time.plan import AsynchronousPlan

    table = {"system": {}, "asynchronous": {"concurrency": 3, "buffer": 2, "staleness": "constant"}}
    _, sim, state = _timed_simulation({**table, "algorithm": {"name": "fedavg", "aggregation": "uniform"}})
    assert sim.asynchronous == AsynchronousPlan(3, 2, "constant") and state.clock == 0.0


@pytest.mark.parametrize(
    "algorithm, fragment",
    [
        ({"name": "fedavg"}, 'set algorithm.aggregation = "uniform"'),  # weighted: not FedBuff's equal-weight mean
        ({"name": "scaffold"}, "scaffold"),
    ],
)
def test_asynchronous_with_an_algorithm_that_cannot_is_refused_before_the_data(algorithm, fragment, monkeypatch):
    from driftlab.experiments.run import assembly

    config = load_config({"system": {}, "asynchronous": {"concurrency": 3, "buffer": 2}, "algorithm": algorithm})
    problem = assembly.configured_algorithm(config).asynchronous_problem()
    assert problem is not None and fragment in problem

    def no_data(config):
        raise AssertionError("the data was loaded before the refusal")

    monkeypatch.setattr(assembly, "load_data", no_data)
    with pytest.raises(ConfigError) as error:
        build_simulation(config)
    assert str(error.value) == problem and problem.startswith(
        "[asynchronous] with algorithm.name = "
    )  # the one template


@pytest.mark.parametrize(
    "mode, fragment",
    [
        ("partial", "to receive the model, do one local step and send its message"),
        ("drop", "for its whole first-round work"),
    ],
)
def test_a_deadline_no_client_can_meet_is_refused_before_any_round(mode, fragment):
    # every client alike (σ = 0): 10 samples/s, links of 1e6 bits/s
    system = {
        "speed_median": 10.0,
        "speed_sigma": 0.0,
        "bandwidth_sigma": 0.0,
        "download_median": 1e6,
        "upload_median": 1e6,
    }
    config, sim, _ = _timed_simulation({"system": system, "client": {"steps": 4, "batch_size": 5}})
    bits = 32 * sim.initial_params.numel()
    one_step = 2 * bits / 1e6 + 5 / 10.0
    need = one_step if mode == "partial" else 2 * bits / 1e6 + 4 * 5 / 10.0
    table = {
        "system": {**system, "deadline": need * 0.99, "deadline_mode": mode},
        "client": {"steps": 4, "batch_size": 5},
    }
    with pytest.raises(ConfigError, match="no client can meet it") as error:
        _timed_simulation(table)
    enough = float(str(error.value).split("at least ")[1].split(",")[0])
    assert fragment in str(error.value) and need <= enough <= need * (1 + 1e-5)
    _timed_simulation({**table, "system": {**table["system"], "deadline": enough}})  # the deadline it names is accepted


def test_auto_on_a_gpu_trains_recurrent_networks_one_by_one_but_several_gpus_always_vectorized():
    from driftlab.experiments.run.assembly import BACKENDS, make_backend
    from driftlab.simulation.backends.flat import FlatModel

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.LSTM(4, 3, batch_first=True), nn.Linear(3, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    model = FlatModel.wrap(Recurrent())
    one, two = (
        (torch.device("cuda:0"),),
        (torch.device("cuda:0"), torch.device("cuda:1")),
    )  # never touched: no GPU needed
    assert isinstance(make_backend(load_config(None, ["backend=auto"]), model, one), BACKENDS["sequential"])
    assert isinstance(make_backend(load_config(None, ["backend=auto"]), model, two), BACKENDS["vectorized"])
    assert isinstance(make_backend(load_config(None, ["backend=vectorized"]), model, one), BACKENDS["vectorized"])
    with pytest.raises(ConfigError, match="only backend=vectorized uses"):
        make_backend(load_config(None, ["backend=sequential"]), model, two)


def test_the_configs_convolution_reaches_the_vectorized_backend_and_grouped_is_the_unset_default():
    from driftlab.experiments.run.assembly import make_backend
    from driftlab.simulation.backends.flat import FlatModel

    model, cpu = (
        FlatModel.wrap(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))),
        (torch.device("cpu"),),
    )
    default, grouped, unfold = (
        load_config(None, extra) for extra in ([], ["convolution=grouped"], ["convolution=unfold"])
    )
    assert default.convolution is None and grouped.convolution is None and "convolution" not in grouped.to_dict()
    assert (
        default.fingerprint() == grouped.fingerprint() != unfold.fingerprint()
    )  # runs made before the key keep theirs
    assert make_backend(default, model, cpu).convolution == "grouped"
    assert make_backend(unfold.model_copy(update={"backend": "vectorized"}), model, cpu).convolution == "unfold"
    with pytest.raises(ConfigError, match="convolution") as error:
        load_config(None, ["convolution=im2col"])
    assert "'grouped'" in str(error.value) and "'unfold'" in str(error.value)
    with pytest.raises(ConfigError, match="backend=sequential trains each client with its own module"):
        load_config(None, ["convolution=unfold", "backend=sequential"])
