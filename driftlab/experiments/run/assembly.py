"""Assembling a run from its configuration: data, model and loss, algorithm, backend and client-state stores (the
devices and the backend are ``run.devices``'s).

``build_simulation(config)`` gives the ``Simulation`` and its state before round 1; the
runner (``driftlab.experiments.run.runner``) runs its rounds and writes the run directory.
Your own model (``model=``), loss (``loss=`` or ``model.loss``) and data (``user_data``:
``driftlab.run(data=...)`` or ``data.loader``) enter here.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Callable, Union

import torch
from torch import nn

from driftlab.algorithms import registry
from driftlab.algorithms.plugin_guard import call_from_config
from driftlab.data.federated import FederatedDataset, federated_dataset_from_arrays
from driftlab.data.registry import DEFAULT_DATA_SET, DataSection
from driftlab.experiments.config import ConfigError, ExperimentConfig, validate_config
from driftlab.experiments.run.compatibility import check_sizes, checked_model
from driftlab.experiments.run.datasets import DataSetupError, build_dataset, prepared_custom_data, vocabulary_size
from driftlab.experiments.run.devices import BACKENDS, make_backend, resolve_backend, resolve_device, resolve_devices
from driftlab.features.run import check_feature, configured_features, feature_plan, features_run_info, run_facts
from driftlab.models import registry as models
from driftlab.optim.registry import build_server_optimizer
from driftlab.plugins import import_function
from driftlab.randomness import Stream, torch_seed
from driftlab.simulation.backends.flat import (
    FlatModel,
    binary_cross_entropy_per_example,
    objective_per_example,
    parameter_kinds,
)
from driftlab.simulation.backends.precision import check_precision, parameter_dtype
from driftlab.simulation.round.availability import AvailabilityModel, Membership, MembershipEvent
from driftlab.simulation.round.setup import EvaluationPlan, RoundPlan, Simulation, SimulationState, make_client_stores
from driftlab.simulation.seam import Algorithm
from driftlab.simulation.state.memory_budget import MemoryBudget, placed_bytes

ModelSource = Union[nn.Module, Callable[[tuple[int, ...], int], nn.Module], None]
ExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets) -> one loss per example [B]


def build_model(
    config: ExperimentConfig, data: FederatedDataset, model: ModelSource, loss: ExampleLoss | None = None
) -> FlatModel:
    """The model ``config.model`` names (the zoo's or a plugin's, built by its registry entry), or the user's module or
    factory (``model=``), initialised from (seed, MODEL_INIT), with its loss.

    The loss is ``loss``, else the function ``model.loss`` names, else the data's: cross-entropy on class
    ids, binary cross-entropy on multi-label rows, the objective itself for quadratic data.  Accuracy is
    reported when ``model.classifier`` says so, by default for class-id targets (see ``is_classifier``).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(config.seed, Stream.MODEL_INIT))
        if model is None:
            module = build_configured_model(config, data.input_shape, data.num_classes)
        elif isinstance(model, nn.Module):
            module = copy.deepcopy(model)
        else:
            module = model(data.input_shape, data.num_classes)
    if loss is None and config.model.loss is not None:
        loss = import_function(config.model.loss, "model.loss")
    classifier = is_classifier(config, data, model)
    if loss is not None:
        return FlatModel.wrap(module, example_loss=loss, is_classifier=classifier, multi_label=data.multi_label)
    if model is None and models.MODELS[config.model.name].reads_objectives:
        return FlatModel.wrap(module, example_loss=objective_per_example, is_classifier=False)
    if data.multi_label:
        return FlatModel.wrap(
            module, example_loss=binary_cross_entropy_per_example, is_classifier=False, multi_label=True
        )
    if not data.targets_are_classes:
        raise ConfigError(
            f"the targets of data set {config.data.name!r} are {str(data.train_targets.dtype).removeprefix('torch.')} values, not class ids, "
            "so cross-entropy cannot train on them: give a loss of your own, driftlab.run(..., loss=fn) or "
            'model.loss = "module:function", with fn(outputs, targets) -> one loss per example'
        )
    return FlatModel.wrap(module, is_classifier=classifier)


def is_classifier(config: ExperimentConfig, data: FederatedDataset, model: ModelSource = None) -> bool:
    """Whether accuracy is reported: ``model.classifier`` when set; else yes for class-id targets, and no for
    floating (regression) targets, multi-label rows and the quadratic objectives."""
    if config.model.classifier is not None:
        return config.model.classifier
    quadratic = model is None and models.MODELS[config.model.name].reads_objectives
    return data.targets_are_classes and not data.multi_label and not quadratic


def build_configured_model(config: ExperimentConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The module of the model ``config.model`` names, built by its registry entry from its ``[model]`` section."""
    entry = models.MODELS[config.model.name]
    return models.build_module(entry, config.model, input_shape, num_classes, vocab_size=vocabulary_size(config.data))


def configured_algorithm(config: ExperimentConfig, num_clients: int | None = None) -> Algorithm:
    """The configured algorithm with its server optimizer, not yet wrapped by a feature.

    A plugin's algorithm comes with its functions guarded (``plugin_guard``): what goes wrong in them names
    the plugin and the function.  A built-in's is exactly what its ``from_config`` returns, given the number of
    clients when its entry ``needs_num_clients`` (``num_clients``, the data's N; None: ``data.num_clients``).
    """
    server_optimizer = build_server_optimizer(config.server)  # a plugin's that fails: a ConfigError naming its file
    entry = registry.ALGORITHMS[config.algorithm.name]
    if registry.is_plugin(entry):
        return call_from_config(entry, config.algorithm, server_optimizer, registry.describe_plugin(entry))
    if entry.needs_num_clients:
        return entry.from_config(
            config.algorithm, server_optimizer, config.data.num_clients if num_clients is None else num_clients
        )
    return entry.from_config(config.algorithm, server_optimizer)


def build_algorithm(config: ExperimentConfig, flat_model: FlatModel, num_clients: int | None = None) -> Algorithm:
    """The configured algorithm with its server optimizer, wrapped by each feature that wraps one, in the registry's
    order (``driftlab.features.registry``: compression inside privacy, so what is clipped and noised is what a client
    sends).  ``num_clients`` is the data's N (a feature's plan reads it); None: ``data.num_clients``.
    """
    return _wrapped_algorithm(config, flat_model, num_clients)[0]


def _wrapped_algorithm(
    config: ExperimentConfig, flat_model: FlatModel, num_clients: int | None
) -> tuple[Algorithm, list[tuple[Any, Any]]]:
    """``build_algorithm``'s algorithm and the (entry, plan) of each feature that wrapped it."""
    algorithm = configured_algorithm(config, num_clients)
    facts = run_facts(config, num_clients, flat_model.numels, flat_model.names)
    facts = dataclasses.replace(facts, tensor_kinds=parameter_kinds(flat_model.module, tuple(flat_model.names)))
    wrapped = []
    for entry, section in configured_features(config, facts):
        if entry.wraps:
            check_feature(entry, algorithm)
            wrapped.append((entry, entry.plan(section, facts)))
            algorithm = entry.wrap(algorithm, wrapped[-1][1])
    return algorithm, wrapped


def check_features(config: ExperimentConfig, algorithm: Algorithm | None = None, only: str | None = None) -> None:
    """``check_feature`` for each feature ``config`` turns on (``only``: that one), against the configured algorithm
    (or ``algorithm``).  Called before any data is loaded (``build_simulation``)."""
    facts = run_facts(config)
    features = [(entry, section) for entry, section in configured_features(config, facts) if only in (None, entry.name)]
    if features:
        algorithm = configured_algorithm(config) if algorithm is None else algorithm
        for entry, _ in features:
            check_feature(entry, algorithm)


def round_plan(config: ExperimentConfig) -> RoundPlan:
    """The engine's ``RoundPlan`` for ``config``: the simulator's, and the deployment node's reference for the server's requests."""
    return RoundPlan(
        seed=config.seed,
        participation=config.sampling.participation,
        sampling=config.sampling.mode,
        batch_size=config.client.batch_size,
        client_lr=config.client.lr,
        server_lr=config.server.lr,
        local_epochs=config.client.local_epochs,
        steps=config.client.steps,
        weight_decay=config.client.weight_decay,
        clip_norm=config.client.clip_norm,
        inexact_gamma=config.client.inexact_gamma,
        augment=config.data.augment,
        availability=AvailabilityModel(
            config.availability.inactive_probability, config.availability.incomplete_probability
        ),
    )


# The [evaluation] keys the engine's EvaluationPlan takes as they are (the personal evaluation is its feature's).
EVALUATION_KEYS = (
    "every",
    "model",
    "dissimilarity_every",
    "divergence_factor",
    "norm_growth_factor",
    "train_loss_clients",
)


def evaluation_plan(config: ExperimentConfig) -> EvaluationPlan:
    """The engine's ``EvaluationPlan`` for ``config``: ``EVALUATION_KEYS`` and ``client_spread`` of ``[evaluation]``."""
    section = config.evaluation
    kept = {key: getattr(section, key) for key in EVALUATION_KEYS}
    return EvaluationPlan(**kept, client_spread=bool(section.client_spread))


def build_simulation(
    config: ExperimentConfig,
    model: ModelSource = None,
    state_dir: Path | None = None,
    data: FederatedDataset | None = None,
    loss: ExampleLoss | None = None,
) -> tuple[Simulation, SimulationState]:
    """Data, model, algorithm and backend for ``config``, and the state before round 1.

    A disk client-state store (``state.store``) keeps its files in ``state_dir``
    (a run's ``RUN/client_state``), or in a temporary directory removed with the store.

    ``model`` replaces the zoo model named by ``config.model``: a module (copied;
    its current weights are the initial model) or a factory
    ``(input_shape, num_classes) -> module`` called under the run's seeded
    initialisation.  ``loss`` replaces the model's loss (``build_model``).

    ``data`` is your own data set (``data.name = "custom"``; ``user_data`` builds and
    checks it); without it the config's data set is loaded (your own through ``data.loader``).
    """
    devices = resolve_devices(config.device)
    device = devices[0]
    problem = check_precision(config.precision, device)
    if problem is not None:
        raise ConfigError(problem)
    dtype = parameter_dtype(config.precision)
    check_features(config)  # before the data: what an algorithm lacks for a feature ([privacy], FedBuff, ...)
    check_sizes(config)  # before the data: client counts and local work against the machine's memory
    if data is None:
        data = load_data(config)
    elif config.data.name != "custom":
        raise ConfigError(
            f'data= is your own data, but the config names data set {config.data.name!r}; set data.name = "custom"'
        )
    facts = run_facts(config, data.num_clients)
    configured = configured_features(config, facts)
    # the plans of the features that do not wrap the algorithm (a device trace needs the data's N), before the model
    features = [(entry, entry.plan(section, facts)) for entry, section in configured if not entry.wraps]
    # what of the state each feature on keeps in checkpoints (the clock, the clients in flight)
    extras = tuple(entry.state_extra for entry, _ in configured if entry.state_extra is not None)
    # the batch plan and the model's memory, then one forward pass on real examples (ConfigError on a mismatch)
    flat_model = checked_model(
        config, data, lambda: build_model(config, data, model, loss).to(device, dtype), device, dtype, model
    )
    initial_params = flat_model.initial_parameters().to(device, dtype)
    algorithm, wrapped = _wrapped_algorithm(config, flat_model, data.num_clients)  # a plan may need the data's N
    plan = round_plan(config)
    evaluation = evaluation_plan(config)
    try:
        membership = Membership(
            data.num_clients,
            config.availability.initially_registered,
            tuple(MembershipEvent(e.round, e.joined(), e.left()) for e in config.availability.events),
        )
    except ValueError as error:
        raise ConfigError(f"availability: {error}") from None
    # The one place memory_budget is parsed; the stores, the waves and the backend's chunks are sized from it.
    resident = placed_bytes((data.train_inputs, data.train_targets, data.test_inputs, data.test_targets), dtype)
    budget = MemoryBudget.for_run(config.memory_budget, devices, resident)
    try:
        sim = Simulation(
            flat_model,
            data,
            algorithm,
            make_backend(config, flat_model, devices, budget),
            plan,
            device,
            dtype,
            initial_params,
            evaluation,
            membership,
            memory_budget=budget,
            state_extras=extras,
            **{key: value for entry, made in features for key, value in entry.simulation_fields(made).items()},
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    # checks before any round (a deadline no client meets, a model privacy cannot carry), the personal evaluation's
    # choice
    for entry, made in (*features, *wrapped):
        entry.finish(sim, made)
    store, latest_models = client_stores(config, sim, config.state.store, state_dir)
    started = {key: value for entry, made in features for key, value in entry.state_fields(made).items()}
    return sim, SimulationState(0, algorithm.server_init(initial_params), store, latest_models, **started)


def client_stores(config: ExperimentConfig, sim: Simulation, kind: str, state_dir: Path | None) -> tuple[Any, Any]:
    """The client-state store of ``kind`` (and the latest-models store when every client's model is evaluated);
    a disk store keeps its files in ``state_dir``, or in a temporary directory removed with ``sim``."""

    def directory() -> Path:
        if state_dir is not None:
            return Path(state_dir)
        import shutil
        import tempfile
        import weakref

        temporary = Path(tempfile.mkdtemp(prefix="driftlab-client-state-"))
        weakref.finalize(sim, shutil.rmtree, temporary, True)
        return temporary

    keep_latest = config.evaluation.model == "all_clients_mean"
    clients, latest = make_client_stores(
        kind,
        sim.data.num_clients,
        sim.initial_params,
        sim.algorithm.client_state_init,
        keep_latest,
        directory,
        sim.memory_budget,
    )
    clients.owner = sim.algorithm.plugin  # a state that cannot be stored names the plugin that made it
    return clients, latest


def load_data(config: ExperimentConfig) -> FederatedDataset:
    """The config's data set; your own (``data.loader``) checked against ``data.digest`` when the config records one."""
    try:
        data = build_dataset(config.data, config.seed)
    except DataSetupError as error:
        raise ConfigError(str(error)) from None
    if config.data.name == "custom":
        check_digest(config, data)
    return data


def user_data(config: ExperimentConfig, data: Any) -> tuple[ExperimentConfig, FederatedDataset | None]:
    """The config naming your own data and recording its digest, and that data as a FederatedDataset.

    ``data`` is what ``driftlab.run(data=...)`` was given (FederatedArrays, or a FederatedDataset);
    without it a ``data.name = "custom"`` config's ``data.loader`` is called.  Other configs come back
    unchanged, with None.  A config that records a digest must be given the same data.
    """
    if data is None:
        if config.data.name != "custom":
            return config, None
        dataset = load_data(config)
    else:
        if config.data.name not in ("custom", DEFAULT_DATA_SET):
            raise ConfigError(
                f'data= is your own data, but the config names data set {config.data.name!r}; set data.name = "custom" or leave data.name unset'
            )
        dataset = data if isinstance(data, FederatedDataset) else federated_dataset_from_arrays(data, "data=")
        try:
            dataset = prepared_custom_data(dataset, config.data, config.seed)
        except DataSetupError as error:
            raise ConfigError(str(error)) from None
        if config.data.name == "custom":
            check_digest(config, dataset)
    table = config.to_dict()
    # the keys every data set shares carry over to your own data; the default data set's own keys do not apply to it
    shared = {
        key: value
        for key, value in table["data"].items()
        if key in DataSection.model_fields or config.data.name == "custom"
    }
    table["data"] = {**shared, "name": "custom", "digest": dataset.digest}
    return validate_config(table), dataset


def check_digest(config: ExperimentConfig, data: FederatedDataset) -> None:
    """A ConfigError when the config records a ``data.digest`` and ``data`` is other data."""
    recorded = config.data.digest
    if recorded is not None and recorded != data.digest:
        source = f"data.loader {config.data.loader!r}" if config.data.loader else "data="
        raise ConfigError(
            f"the data given ({source}, digest {data.digest[:12]}...) is not the data this configuration records "
            f"(data.digest {recorded[:12]}...): a resume must be given the data the run started with; "
            "to start a new run on this data, remove data.digest from the config (or choose a new --out directory)"
        )


__all__ = [
    "BACKENDS",
    "ExampleLoss",
    "ModelSource",
    "build_algorithm",
    "build_model",
    "build_simulation",
    "check_feature",
    "check_features",
    "check_digest",
    "client_stores",
    "configured_features",
    "evaluation_plan",
    "feature_plan",
    "features_run_info",
    "is_classifier",
    "load_data",
    "make_backend",
    "resolve_backend",
    "resolve_device",
    "resolve_devices",
    "user_data",
]
