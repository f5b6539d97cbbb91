"""Assembling a run from its configuration: devices, data, model and loss, algorithm, backend and client-state stores.

``build_simulation(config)`` gives the ``Simulation`` and its state before round 1; the
runner (``driftlab.experiments.runner``) runs its rounds and writes the run directory.
Your own model (``model=``), loss (``loss=`` or ``model.loss``) and data (``user_data``:
``driftlab.run(data=...)`` or ``data.loader``) enter here.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Union

import torch
from torch import nn

from driftlab.algorithms import registry
from driftlab.algorithms.plugin_guard import call_from_config
from driftlab.compress import with_compression
from driftlab.data.registry import DEFAULT_DATA_SET, DataSection
from driftlab.data.federated import FederatedDataset, federated_dataset_from_arrays
from driftlab.experiments.compatibility import check_sizes, checked_model
from driftlab.experiments.config import ConfigError, ExperimentConfig, validate_config
from driftlab.plugins import import_function
from driftlab.experiments.datasets import DataSetupError, build_dataset, prepared_custom_data, vocabulary_size
from driftlab.models import registry as models
from driftlab.optim.registry import build_server_optimizer
from driftlab.privacy import accounting
from driftlab.privacy.mechanism import no_form_refusal, with_privacy
from driftlab.privacy.settings import AdaptiveClipping, PrivacySettings
from driftlab.simulation.round.availability import AvailabilityModel, Membership, MembershipEvent
from driftlab.metrics.communication import payload_bits
from driftlab.simulation.round.setup import EvaluationPlan, RoundPlan, Simulation, SimulationState, make_client_stores
from driftlab.simulation.backends.flat import FlatModel, binary_cross_entropy_per_example, objective_per_example
from driftlab.simulation.backends.local_training import SequentialBackend
from driftlab.simulation.backends.precision import check_precision, parameter_dtype
from driftlab.simulation.round.randomness import Stream, torch_seed
from driftlab.simulation.round.sampling import clients_per_round
from driftlab.simulation.seam import Algorithm
from driftlab.simulation.state.memory_budget import MemoryBudget, placed_bytes
from driftlab.simulation.time.plan import AsynchronousPlan, SystemPlan
from driftlab.simulation.time.clock import least_time
from driftlab.simulation.time.profiles import TraceProfiles, devices, profiles_for
from driftlab.simulation.backends.vectorized import VectorizedBackend, auto_backend

BACKENDS = {"sequential": SequentialBackend, "vectorized": VectorizedBackend}


def resolve_devices(name: str) -> tuple[torch.device, ...]:
    """The devices of ``config.device``: one, or several GPUs (``cuda:0,cuda:1``), the first holding the model."""
    if name == "auto":
        return (torch.device("cuda" if torch.cuda.is_available() else "cpu"),)
    names = [part.strip() for part in name.split(",")]
    if any(part.startswith("cuda") for part in names):
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name!r} but CUDA is not available on this machine; use device=cpu (or auto)")
        missing = [part for part in names if part.startswith("cuda:") and int(part[5:]) >= torch.cuda.device_count()]
        if missing:
            raise ConfigError(f"device={name!r}: this machine has {torch.cuda.device_count()} GPU(s), so {', '.join(missing)} does not exist")
    return tuple(torch.device(part) for part in names)


def resolve_device(name: str) -> torch.device:
    return resolve_devices(name)[0]


def resolve_backend(name: str, model: FlatModel | None = None, device: torch.device | None = None) -> str:
    """``auto`` is the rule of ``vectorized.auto_backend`` for the model and device (docs/performance.md);
    without a model, the vectorized backend."""
    if name != "auto":
        return name
    if model is None or device is None:
        return "vectorized"
    return auto_backend(model, device)


def make_backend(config: ExperimentConfig, model: FlatModel, devices: tuple[torch.device, ...], budget: MemoryBudget | None = None):
    """The config's training backend; the vectorized one sizes its chunks from ``budget`` (the run's ``MemoryBudget``)."""
    # several GPUs: auto is the one backend that spreads a round over them
    name = "vectorized" if config.backend == "auto" and len(devices) > 1 else resolve_backend(config.backend, model, devices[0])
    if len(devices) > 1 and name != "vectorized":
        raise ConfigError(f"device={config.device!r} lists several GPUs, which only backend=vectorized uses; set backend=vectorized (or auto)")
    if name == "vectorized":
        several = devices if len(devices) > 1 else None
        return BACKENDS[name](
            precision=config.precision, devices=several, memory_budget=budget or MemoryBudget(), convolution=config.convolution or "grouped"
        )
    return BACKENDS[name](precision=config.precision)


ModelSource = Union[nn.Module, Callable[[tuple[int, ...], int], nn.Module], None]
ExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets) -> one loss per example [B]


def build_model(config: ExperimentConfig, data: FederatedDataset, model: ModelSource, loss: ExampleLoss | None = None) -> FlatModel:
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
        return FlatModel.wrap(module, example_loss=binary_cross_entropy_per_example, is_classifier=False, multi_label=True)
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
    """The configured algorithm with its server optimizer, not yet wrapped by compression.

    A plugin's algorithm comes with its functions guarded (``plugin_guard``): what goes wrong in them names
    the plugin and the function.  A built-in's is exactly what its ``from_config`` returns, given the number of
    clients when its entry ``needs_num_clients`` (``num_clients``, the data's N; None: ``data.num_clients``).
    """
    server_optimizer = build_server_optimizer(config.server)  # a plugin's that fails: a ConfigError naming its file
    entry = registry.ALGORITHMS[config.algorithm.name]
    if registry.is_plugin(entry):
        return call_from_config(entry, config.algorithm, server_optimizer, registry.describe_plugin(entry))
    if entry.needs_num_clients:
        return entry.from_config(config.algorithm, server_optimizer, config.data.num_clients if num_clients is None else num_clients)
    return entry.from_config(config.algorithm, server_optimizer)


def build_algorithm(config: ExperimentConfig, flat_model: FlatModel, num_clients: int | None = None) -> Algorithm:
    """The configured algorithm with its server optimizer, compressed when ``compression.ratio`` < 1, and made
    private by ``[privacy]``: ``with_privacy(with_compression(algorithm))``, so what is clipped and noised is what
    a client sends.  ``num_clients`` is the data's N (``privacy_settings``); None: ``data.num_clients``.
    """
    algorithm = configured_algorithm(config, num_clients)
    entry = registry.ALGORITHMS[config.algorithm.name]
    ratio = config.compression.ratio
    if ratio is None:
        ratio = entry.default_compression_ratio
    built = algorithm
    if ratio < 1:
        try:
            built = with_compression(algorithm, ratio, flat_model.numels)
        except ValueError as error:
            raise ConfigError(f"compression.ratio = {ratio:g}: {error}") from None
    if config.privacy is None:
        return built
    check_privacy_form(config, built)
    settings = privacy_settings(config, config.data.num_clients if num_clients is None else num_clients)
    try:
        return with_privacy(built, settings)
    except ConfigError:
        raise
    except ValueError as error:  # the mechanism's refusal of a form it cannot use: a configuration to change
        raise ConfigError(f"[privacy]: {error}") from None


def check_privacy_form(config: ExperimentConfig, algorithm: Algorithm | None = None) -> None:
    """ConfigError when ``[privacy]`` is set and the algorithm (the configured one, or ``algorithm``) gives no
    ``PrivacyForm``: its refusal (``Algorithm.privacy_refusal``, naming the option to change), or what a plugin
    lacks.  Called before any data is loaded (``build_simulation``) and again on the algorithm that is wrapped."""
    if config.privacy is None:
        return
    algorithm = configured_algorithm(config) if algorithm is None else algorithm
    if algorithm.privacy is not None:
        return
    if algorithm.privacy_refusal is not None:
        raise ConfigError(f"[privacy] with algorithm {config.algorithm.name!r}: {algorithm.privacy_refusal}")
    raise ConfigError(f"[privacy]: {no_form_refusal(config.algorithm.name)}")


def privacy_settings(config: ExperimentConfig, num_clients: int) -> PrivacySettings | None:
    """What ``config.privacy`` resolves to for a run on ``num_clients`` clients (None without ``[privacy]``).

    q is ``sampling.participation`` with poisson sampling, else the fixed cohort m over N (1 with full participation);
    the expected cohort m = q·N is the public denominator of means under central noise; the population is
    ``privacy.population``, else N.  A ``target_epsilon`` is turned into the noise multiplier that spends at most it
    in ``config.rounds`` rounds (``accounting.noise_multiplier_for``; local noise: its multiplier z/2 at q = 1).
    ConfigError, before any round, for δ not below 1/population, a target no noise reaches, or adaptive
    clipping whose count noise leaves the update no privacy.
    """
    privacy = config.privacy
    if privacy is None:
        return None
    if num_clients < 1:
        raise ConfigError("[privacy] needs clients: the data has none")
    sampling = config.sampling
    if sampling.mode == "poisson":
        rate, cohort = sampling.participation, sampling.participation * num_clients
    else:
        cohort = clients_per_round(sampling.participation, num_clients)
        rate = cohort / num_clients
    population = privacy.population if privacy.population is not None else num_clients
    delta = privacy.delta
    if delta is not None and not delta < 1 / population:
        whose = "privacy.population" if privacy.population is not None else "clients"
        raise ConfigError(
            f"privacy.delta = {delta:g} is not below 1/N = {1 / population:g} for N = {population} {whose}: a δ that "
            f"large allows publishing some client's data outright; set privacy.delta below {1 / population:g} (e.g. "
            f"{_suggested_delta(population):g})"
        )
    noise_multiplier = privacy.noise_multiplier
    accounting_rate = rate if privacy.noise_cohort_size is None else min(1.0, privacy.noise_cohort_size / population)
    if privacy.target_epsilon is not None:
        noise_multiplier = _noise_multiplier_for(config, accounting_rate)
    adaptive = None
    if privacy.adaptive:
        count_noise = privacy.count_noise if privacy.count_noise is not None else cohort / 20  # Andrew et al. 2021
        adaptive = AdaptiveClipping(privacy.target_quantile, privacy.clip_learning_rate, count_noise)
    try:
        settings = PrivacySettings(
            clip=privacy.clip,
            noise_multiplier=noise_multiplier,
            seed=config.seed,
            sampling_rate=rate,
            expected_cohort=cohort,
            population=population,
            noise=privacy.noise,
            delta=delta,
            accountant=privacy.accountant,
            noise_cohort_size=privacy.noise_cohort_size,
            adaptive=adaptive,
        )
        settings.update_noise_multiplier  # noqa: B018 - raises when σ_b leaves the update no privacy
    except ValueError as error:
        raise ConfigError(f"[privacy]: {error}") from None
    return settings


def _suggested_delta(population: int) -> float:
    """A power of ten at most 1/(10·N): the usual δ ≪ 1/N."""
    return 10.0 ** math.floor(math.log10(1 / (10 * population)))


def _noise_multiplier_for(config: ExperimentConfig, accounting_rate: float) -> float:
    """The noise multiplier that spends at most ``privacy.target_epsilon`` (within 0.5%) in ``config.rounds`` rounds."""
    privacy = config.privacy
    local = privacy.noise == "local"
    try:
        # local noise: each client's own messages, sensitivity 2C (multiplier z/2), every round (q = 1)
        z = accounting.noise_multiplier_for(
            privacy.target_epsilon, privacy.delta, 1.0 if local else accounting_rate, config.rounds, privacy.accountant
        )
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"privacy.target_epsilon = {privacy.target_epsilon:g}: {error}") from None
    return 2 * z if local else z


def privacy_run_info(config: ExperimentConfig, num_clients: int) -> dict[str, Any]:
    """run.json's ``privacy`` entry: the resolved noise multiplier, accountant, δ, the rates and the run's ε.

    ``epsilon`` is ε after the run's ``rounds`` (its final ε when it completes; the metrics hold each round's),
    ``"inf"`` without noise; absent without δ.  Empty without ``[privacy]``.
    """
    settings = privacy_settings(config, num_clients)
    if settings is None:
        return {}
    info: dict[str, Any] = {
        "noise_multiplier": settings.noise_multiplier,
        "noise": settings.noise,
        "accountant": settings.accountant,
        "delta": settings.delta,
        "sampling_rate": settings.accounting_rate,
        "expected_cohort": settings.expected_cohort,
        "population": settings.population,
        "rounds": config.rounds,
    }
    epsilon = accounting.run_epsilon(settings, config.rounds)
    if epsilon is not None:
        info["epsilon"] = "inf" if math.isinf(epsilon) else epsilon  # strict JSON, as the report reads it
    return {"privacy": info}


def check_asynchronous(config: ExperimentConfig, algorithm: Algorithm | None = None) -> None:
    """ConfigError when ``[asynchronous]`` is set and the algorithm (the configured one, or ``algorithm``) cannot run
    asynchronously: ``Algorithm.asynchronous_problem``'s reason and fix.  Called before any data is loaded."""
    if config.asynchronous is None:
        return
    algorithm = configured_algorithm(config) if algorithm is None else algorithm
    problem = algorithm.asynchronous_problem()
    if problem is not None:
        raise ConfigError(f"[asynchronous]: {problem}")


def system_plan(config: ExperimentConfig, num_clients: int) -> SystemPlan | None:
    """The engine's ``SystemPlan`` for ``config.system`` on ``num_clients`` clients (None without ``[system]``); a
    trace that cannot be used is a ConfigError naming the file, line and column."""
    system = config.system
    if system is None:
        return None
    try:
        profiles = profiles_for(system, config.seed, num_clients)
        return SystemPlan(profiles, system.deadline, system.deadline_mode, system.over_selection)
    except ValueError as error:
        raise ConfigError(f"system.trace: {error}" if system.profiles == "trace" else f"[system]: {error}") from None


def personal_evaluation(config: ExperimentConfig, sim: Simulation) -> bool:
    """Whether rounds evaluate each client's own model (``evaluation.personal``); ConfigError, before any round, for a
    request that cannot be met: no personal models and no fine-tuning, fine-tuning beside an algorithm's own personal
    models, no client test splits, an asynchronous run."""
    evaluation = config.evaluation
    name = config.algorithm.name
    own = sim.algorithm.personalization is not None
    if evaluation.finetune_steps and own:
        raise ConfigError(
            f"evaluation.finetune_steps = {evaluation.finetune_steps} fine-tunes the server model as each client's own model, "
            f"but algorithm {name!r} keeps its own personalized models ({sim.algorithm.personalization.description}); remove "
            "evaluation.finetune_steps (the personal column then evaluates the algorithm's models)"
        )
    if evaluation.personal is False:
        if evaluation.finetune_steps:
            raise ConfigError(
                "evaluation.finetune_steps is set but evaluation.personal = false turns the personal evaluation off; remove one"
            )
        return False
    capable = own or bool(evaluation.finetune_steps)
    if evaluation.personal and not capable:
        raise ConfigError(
            f"evaluation.personal = true, but algorithm {name!r} keeps no per-client models (every client predicts with the "
            "server model, which client_test_accuracy_mean already evaluates on each client's split); set "
            "evaluation.finetune_steps = s for FedAvg + local fine-tuning, or use apfl, ditto or fedamp, or remove evaluation.personal"
        )
    requested = bool(evaluation.personal) or bool(evaluation.finetune_steps)
    if sim.client_test_rows is None:
        if requested:
            raise ConfigError(
                "the personalized evaluation tests each client's own model on that client's own test split, and the clients "
                "have none: set data.client_test_fraction (for example 0.2), or remove evaluation.personal / "
                "evaluation.finetune_steps"
            )
        return False
    if sim.asynchronous is not None:
        if requested:
            raise ConfigError(
                "the personalized evaluation runs after synchronous rounds; an asynchronous run evaluates the server model "
                "only: remove evaluation.personal / evaluation.finetune_steps, or [asynchronous]"
            )
        return False
    return capable


def check_deadline(sim: Simulation) -> None:
    """ConfigError, before any round, when no client can meet ``system.deadline``: not one step and the model both ways
    (``deadline_mode = "partial"``), or not its whole first-round work (``"drop"``); every round would select
    clients and wait out the deadline for nothing."""
    system = sim.system
    if system is None or system.deadline is None:
        return
    view_bits = payload_bits(sim.algorithm.broadcast(sim.algorithm.server_init(sim.initial_params)))
    partial = system.deadline_mode == "partial"

    def work(client_id: int) -> tuple[int, int]:
        num_samples = int(sim.client_sizes[client_id])
        planned = sim.plan.planned_steps(num_samples, 1)
        return (min(1, planned) if partial else planned), min(sim.plan.batch_size, num_samples)

    least = least_time(devices(system.profiles, sim.data.num_clients), view_bits, work, system.deadline)
    if least > system.deadline:
        what = "to receive the model, do one local step and send its message" if partial else "for its whole first-round work"
        # rounded up at 6 digits, so the deadline the message names is one that works
        enough = float(f"{math.ceil(least / 10 ** (math.floor(math.log10(least)) - 5)) * 10 ** (math.floor(math.log10(least)) - 5):.6g}")
        raise ConfigError(
            f"system.deadline = {system.deadline:g} s: no client can meet it; the fastest needs {least:.9g} s {what} "
            f"({view_bits:,} bits each way); raise system.deadline to at least {enough:g}, or remove it"
        )


def asynchronous_plan(config: ExperimentConfig) -> AsynchronousPlan | None:
    """The engine's ``AsynchronousPlan`` for ``config.asynchronous`` (None without ``[asynchronous]``)."""
    section = config.asynchronous
    if section is None:
        return None
    try:
        return AsynchronousPlan(section.concurrency, section.buffer, section.staleness)
    except ValueError as error:
        raise ConfigError(f"[asynchronous]: {error}") from None


def system_run_info(config: ExperimentConfig, plan: SystemPlan | None) -> dict[str, Any]:
    """run.json's ``system`` entry: the profiles' kind, and a trace's path and SHA-256 (of the bytes the run read).
    Empty without ``[system]``."""
    if config.system is None or plan is None:
        return {}
    info: dict[str, Any] = {"profiles": config.system.profiles}
    if isinstance(plan.profiles, TraceProfiles):
        info.update(trace=plan.profiles.source, sha256=plan.profiles.sha256)
    return {"system": info}


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
        availability=AvailabilityModel(config.availability.inactive_probability, config.availability.incomplete_probability),
    )


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
    check_privacy_form(config)  # before the data: an algorithm [privacy] cannot make private
    check_asynchronous(config)  # before the data: an algorithm FedBuff cannot run
    check_sizes(config)  # before the data: client counts and local work against the machine's memory
    if data is None:
        data = load_data(config)
    elif config.data.name != "custom":
        raise ConfigError(f'data= is your own data, but the config names data set {config.data.name!r}; set data.name = "custom"')
    system = system_plan(config, data.num_clients)  # a trace needs the data's N; read before the model is built
    # the batch plan and the model's memory, then one forward pass on real examples (ConfigError on a mismatch)
    flat_model = checked_model(config, data, lambda: build_model(config, data, model, loss).to(device, dtype), device, dtype, model)
    initial_params = flat_model.initial_parameters().to(device, dtype)
    algorithm = build_algorithm(config, flat_model, data.num_clients)  # [privacy]'s δ and cohort need the data's N
    plan = round_plan(config)
    evaluation = EvaluationPlan(
        every=config.evaluation.every,
        model=config.evaluation.model,
        dissimilarity_every=config.evaluation.dissimilarity_every,
        divergence_factor=config.evaluation.divergence_factor,
        norm_growth_factor=config.evaluation.norm_growth_factor,
        train_loss_clients=config.evaluation.train_loss_clients,
        client_spread=bool(config.evaluation.client_spread),
    )
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
            flat_model, data, algorithm, make_backend(config, flat_model, devices, budget), plan, device, dtype, initial_params, evaluation,
            membership, memory_budget=budget, system=system, asynchronous=asynchronous_plan(config),
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_deadline(sim)
    if sim.system is not None and algorithm.prelude is not None:
        raise ConfigError(
            f"algorithm {config.algorithm.name!r} has a first phase in every round (Algorithm.prelude), which the simulated "
            "clock does not time (one download, training and one upload per client): remove [system], or for Mime set "
            "algorithm.control_variate = \"previous\" (one phase)"
        )
    if personal_evaluation(config, sim):
        sim.evaluation = dataclasses.replace(sim.evaluation, personal=True, finetune_steps=config.evaluation.finetune_steps or 0)
    store, latest_models = client_stores(config, sim, config.state.store, state_dir)
    clock = None if system is None else 0.0  # simulated seconds; untimed runs keep None (their records are unchanged)
    return sim, SimulationState(0, algorithm.server_init(initial_params), store, latest_models, clock=clock)


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
        kind, sim.data.num_clients, sim.initial_params, sim.algorithm.client_state_init, keep_latest, directory, sim.memory_budget
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
                f"data= is your own data, but the config names data set {config.data.name!r}; set data.name = \"custom\" or leave data.name unset"
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
    shared = {key: value for key, value in table["data"].items() if key in DataSection.model_fields or config.data.name == "custom"}
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
    "asynchronous_plan",
    "check_asynchronous",
    "check_digest",
    "check_privacy_form",
    "client_stores",
    "is_classifier",
    "load_data",
    "make_backend",
    "privacy_run_info",
    "privacy_settings",
    "resolve_backend",
    "resolve_device",
    "resolve_devices",
    "system_plan",
    "system_run_info",
    "user_data",
]
