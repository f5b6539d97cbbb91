"""Pre-flight checks of a validated config: sizes against the machine, and the model against the data.

``runner.build_simulation`` calls them before anything large is allocated:

* ``check_sizes(config)``, before the data is built: the number of clients and the
  local work, whose memory grows with numbers a typo can make astronomical
  (``data.num_clients=10**9``, ``client.steps=10**12``);
* ``checked_model(...)``, once the data is built, instead of building the model
  directly: the batch plan of the largest client (``client.epochs=10**9``), the
  model's parameter memory (counted on the ``meta`` device, which allocates
  nothing), then the model itself and one forward pass of a few real training
  examples on the run's device and dtype, without gradients.

Every failure is a ``ConfigError`` that says what was estimated, the limit, and
what to change; a model that does not fit the data names the model, the data's
input shape, dtype and classes, and the models that do fit.  The estimates are
lower bounds of what the run will hold at once, so a refused config could not
have run; the limit is what this process may still allocate under the tightest of
physical memory, its rlimits, its cgroup and its SLURM job (``driftlab.memory_limit``,
named in the message; the GPU's memory for parameters on a CUDA device).  The forward pass draws no random numbers and costs
milliseconds, so it leaves every result of a run unchanged.  (Counting ``gru``
and ``resnet18_gn`` parameters on ``meta`` imports ``torch._dynamo`` once per
process, about 2 s; the vectorized backend's ``vmap`` imports it anyway.)
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from driftlab.data.builtins import QUADRATIC_BYTES_PER_CLIENT_AND_DIMENSION
from driftlab.data.registry import entry_of
from driftlab.experiments.config import ConfigError, ExperimentConfig
from driftlab.experiments.run.datasets import vocabulary_size
from driftlab.memory_limit import MemoryLimit, format_bytes, memory_limit
from driftlab.models import registry as models
from driftlab.optim.schedules import steps_at
from driftlab.simulation.round.sampling import clients_per_round

PROBE_EXAMPLES = 4  # examples of the forward pass: enough to catch batch-dimension mistakes, cheap for any model
INDEX_BYTES = 8  # the batch plan is int64 positions
# What a trained client holds per plan entry at its peak: the plan, and the vectorized backend's batch schedule built
# from it (positions, gathered rows, weights in up to float64, the masks and np.where's temporary: 40 more bytes).
PLAN_ENTRY_BYTES = 48
# Per local step: the sequential backend's list of batch sizes (a Python int and its slot) and the schedule's counts.
PLAN_STEP_BYTES = 48
QUADRATIC_DATA = ("quadratic", "quadratic1d")
# A generated data set's bytes per client are its entry's size_estimate (driftlab.data.builtins measured them);
# a partitioned pooled data set costs an index array per client.
PARTITIONED_BYTES_PER_CLIENT = 200  # a numpy index array object, its rows, and the client's entry in the membership

_size = format_bytes
_GIVEN = "the memory given"  # the name of a limit passed as a byte count (tests, callers that know better)


def _limit(memory_bytes: int | MemoryLimit | None) -> MemoryLimit:
    """``memory_bytes`` as a limit (an int: this many bytes of memory, none of them held); None: the process's own."""
    if memory_bytes is None:
        return memory_limit()
    if isinstance(memory_bytes, MemoryLimit):
        return memory_bytes
    return MemoryLimit(int(memory_bytes), 0, _GIVEN)


def _count(number: int) -> str:
    return f"{number:,}" if number < 10**15 else f"{float(min(number, 10**300)):.3g}"


def _too_large(key: str, what: str, estimate: float, limit: MemoryLimit, fix: str) -> ConfigError:
    return ConfigError(f"{key}: {what} needs at least {_size(estimate)}, more than {_where(limit)}; {fix}")


def _where(limit: MemoryLimit) -> str:
    """The memory a check compared with, in words: which limit, how much of it is left."""
    return f"this machine's {_size(limit.limit)} of memory" if limit.name == _GIVEN else limit.describe()


# ---------------------------------------------------------------- sizes before the data


def check_sizes(config: ExperimentConfig, memory_bytes: int | MemoryLimit | None = None) -> None:
    """Refuse client counts and local work whose memory cannot exist, before anything is generated.

    ``memory_bytes``: the memory to compare with (None: what this process may still allocate, ``memory_limit()``).
    """
    limit = _limit(memory_bytes)
    room = limit.available
    data = config.data
    per_client = _bytes_per_client(config)
    if per_client and data.num_clients * per_client > room:
        if data.name == "quadratic":
            raise _quadratic_too_large(data.num_clients, data.quadratic_dimension, limit)
        raise _too_large(
            "data.num_clients",
            f"{data.name} data for {_count(data.num_clients)} clients (about {_size(per_client)} each)",
            data.num_clients * per_client,
            limit,
            f"use at most about {_count(room // per_client)} clients here",
        )
    # Every client holds at least one example, so a plan row is at least one index wide.
    plans = (  # (key, its count, what the plan of that many holds, the fix)
        (
            "client.steps",
            _largest_step_count(config),
            f"local steps (which examples each step reads, {INDEX_BYTES} bytes per example)",
            f"use fewer local steps (at most {_count(room // INDEX_BYTES)} for a client of one example, fewer for larger batches)",
        ),
        (
            "client.epochs",
            config.client.local_epochs,
            f"local epochs (every epoch lists each of the client's examples, {INDEX_BYTES} bytes each)",
            "use fewer local epochs",
        ),
    )
    for key, count, holding, fix in plans:
        if count is not None and count * INDEX_BYTES > room:
            raise _too_large(key, f"the batch plan of {_count(count)} {holding}", count * INDEX_BYTES, limit, fix)


def _quadratic_too_large(clients: int, dimension: int, limit: MemoryLimit) -> ConfigError:
    """Quadratic data grow with clients x dimension: name the fixes that keep one of the two, or their product when neither does."""
    products = limit.available // QUADRATIC_BYTES_PER_CLIENT_AND_DIMENSION  # the largest clients x dimension that fits
    fixes = {}
    if products // dimension >= 1:
        fixes["data.num_clients"] = (
            f"at most about {_count(products // dimension)} clients of dimension {_count(dimension)}"
        )
    if products // clients >= 1:
        fixes["data.quadratic_dimension"] = (
            f"a dimension of at most about {_count(products // clients)} for {_count(clients)} clients"
        )
    if fixes:
        keys, fix = " or ".join(fixes), "use " + ", or ".join(fixes.values())
    else:
        keys = "data.num_clients x data.quadratic_dimension"
        fix = f"keep data.num_clients x data.quadratic_dimension under about {_count(products)} (now {_count(clients * dimension)})"
    return _too_large(
        keys,
        f"quadratic data of dimension {_count(dimension)} for {_count(clients)} clients "
        f"(about {_size(QUADRATIC_BYTES_PER_CLIENT_AND_DIMENSION)} per client and dimension)",
        clients * dimension * QUADRATIC_BYTES_PER_CLIENT_AND_DIMENSION,
        limit,
        fix,
    )


def _bytes_per_client(config: ExperimentConfig) -> int:
    data = config.data
    entry = entry_of(data)
    if entry.size_estimate is not None:
        return int(entry.size_estimate(data))
    if entry.natural_clients and data.partition in (None, "natural"):
        return 0  # the data set's own clients: num_clients is not used
    return PARTITIONED_BYTES_PER_CLIENT


def _largest_step_count(config: ExperimentConfig) -> int | None:
    steps = config.client.steps
    if steps is None:
        return None
    # both schedule kinds decrease with the round: round 1 does the most work
    return steps_at(steps, 1)


# ---------------------------------------------------------------- sizes with the data, and the model


def checked_model(
    config: ExperimentConfig,
    data: Any,
    build: Callable[[], Any],
    device: torch.device,
    dtype: torch.dtype,
    user_model: Any = None,
    memory_bytes: int | MemoryLimit | None = None,
) -> Any:
    """``build()`` (the run's ``FlatModel`` on ``device``/``dtype``) once the plan and the model are known
    to fit in memory, after one forward pass on a few of ``data``'s training examples.

    ``user_model`` is the module or factory passed to ``driftlab.run`` (None: the zoo model ``config.model``).
    """
    limit = _limit(memory_bytes)
    check_plan_size(config, data, limit)
    label = _model_label(config, user_model)
    if user_model is None:
        _check_model_pairing(config, data, label)
        _check_model_memory(config, data, device, dtype, limit, label)
    try:
        flat_model = build()
    except ConfigError:
        raise
    except (ValueError, RuntimeError, IndexError, TypeError, AttributeError) as error:
        if isinstance(error, torch.OutOfMemoryError):
            raise ConfigError(
                f"model {label} does not fit in the memory of {device}: {_first_line(error)}; use a smaller model"
            ) from error
        raise _mismatch(config, data, label, f"building it failed: {_first_line(error)}") from error
    probe_forward(config, data, flat_model, device, dtype, label)
    return flat_model


def check_plan_size(config: ExperimentConfig, data: Any, memory_bytes: int | MemoryLimit | None = None) -> None:
    """The batch plans of a round's clients fit: ``local_training.batch_plan`` allocates a client's whole epochs at a
    time, ``[⌈steps / per_epoch⌉ · per_epoch, min(B, n_k)]`` int64, before its first step, and a round builds the plans
    of a wave's clients together (a wave may hold the whole round), so the largest client's plan times the round's
    clients must fit."""
    limit = _limit(memory_bytes)
    sizes = data.client_sizes
    if len(sizes) == 0:
        return
    # A poisson round's size varies around this expected count and may exceed it; the estimate stays a lower bound of
    # what the run holds (a round of the expected size), and the engine's waves (setup.wave_size) bound any round's models.
    together = min(len(sizes), clients_per_round(config.sampling.participation, len(sizes)))
    room = limit.available // together
    each = f" for each of the {_count(together)} clients a round trains together" if together > 1 else ""
    largest = int(sizes.max())
    batch = config.client.batch_size
    width = min(batch, largest)
    per_epoch = math.ceil(largest / width)
    epochs = config.client.local_epochs
    steps = epochs * per_epoch if epochs is not None else _largest_step_count(config)
    rows = -(-steps // per_epoch) * per_epoch  # the plan is cut from whole epochs
    per_row = width * PLAN_ENTRY_BYTES + PLAN_STEP_BYTES
    estimate = rows * per_row
    if estimate <= room:
        return
    estimate *= together
    if epochs is not None:
        most = max(1, room // (per_epoch * per_row))
        raise _too_large(
            "client.epochs",
            f"the batch plan of the largest client ({_count(largest)} examples: {_count(epochs)} epochs x {_count(per_epoch)} steps "
            f"x ({_count(width)} examples x {PLAN_ENTRY_BYTES} bytes + {PLAN_STEP_BYTES} bytes), with what the backends build from it){each}",
            estimate,
            limit,
            f"use at most about {_count(most)} local epochs here",
        )
    raise _too_large(
        "client.steps",
        f"the batch plan of the largest client ({_count(largest)} examples: {_count(steps)} steps, cut from whole epochs of {_count(per_epoch)} steps, "
        f"so {_count(rows)} rows x ({_count(width)} examples x {PLAN_ENTRY_BYTES} bytes + {PLAN_STEP_BYTES} bytes), with what the backends "
        f"build from it){each}",
        estimate,
        limit,
        f"use at most about {_count(max(1, room // per_row // per_epoch * per_epoch))} local steps here, or a smaller client.batch_size",
    )


def _check_model_pairing(config: ExperimentConfig, data: Any, label: str) -> None:
    # The quadratic "model" is the parameter x of the quadratic clients: it runs on any even-width
    # vectors without an error, and any classifier runs on the quadratics' [a, b] rows, so only
    # the names can tell these mismatches.
    quadratic_data = config.data.name in QUADRATIC_DATA
    objective_model = models.MODELS[config.model.name].reads_objectives
    if quadratic_data and not objective_model:
        raise _mismatch(config, data, label, "quadratic data are objectives ½·a·x² − b·x, not examples to classify")
    if objective_model and not quadratic_data:
        raise _mismatch(config, data, label, "the quadratic model is the parameter of the quadratic data sets only")


def _check_model_memory(
    config: ExperimentConfig, data: Any, device: torch.device, dtype: torch.dtype, limit: MemoryLimit, label: str
) -> None:
    """Parameters counted on the meta device (nothing allocated), times the copies a round holds at once."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            entry = models.MODELS[config.model.name]
            module = models.build_module(
                entry, config.model, data.input_shape, data.num_classes, vocab_size=vocabulary_size(config.data)
            )
    except (ValueError, RuntimeError, IndexError, TypeError) as error:
        raise _mismatch(config, data, label, _first_line(error)) from error
    parameters = sum(p.numel() for p in module.parameters())
    # sampling.mode "poisson": the expected clients of a round (a round may have more, trained in waves of setup.wave_size)
    per_round = max(1, math.ceil(config.sampling.participation * data.num_clients))
    copies = 2 + per_round  # the server model, its update, and one local model per client of a round
    estimate = parameters * copies * torch.empty((), dtype=dtype).element_size()
    memory, where = limit.available, _where(limit)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        where = f"{device}'s {_size(memory)} of memory"
    if estimate > memory:
        raise ConfigError(
            f"model {label}: {_count(parameters)} parameters x {_count(copies)} copies (server model, update, one per client of a round) "
            f"need at least {_size(estimate)}, more than {where}; use a smaller model{_size_keys(config)} "
            "or fewer clients per round (sampling.participation)"
        )


def _size_keys(config: ExperimentConfig) -> str:
    """`` (model.hidden)``: the keys of the configured model's own section, which set its size."""
    own = [
        key for key in type(config.model).model_fields if key not in models.ModelSection.model_fields and key != "name"
    ]
    return f" ({', '.join(f'model.{key}' for key in own)})" if own else ""


def probe_forward(
    config: ExperimentConfig, data: Any, flat_model: Any, device: torch.device, dtype: torch.dtype, label: str
) -> None:
    """One forward pass and loss on the first training examples of the first client, as training will do them."""
    rows = torch.tensor(data.client_indices[0][:PROBE_EXAMPLES].tolist(), dtype=torch.long)
    inputs, targets = data.train_inputs[rows], data.train_targets[rows]
    if getattr(data, "input_normalisation", None) is not None:  # uint8 pixels: the model sees them normalised
        inputs = data.input_normalisation(inputs)
    # the engine casts floating inputs and targets to the run's dtype and keeps integer ones
    inputs = inputs.to(device, dtype if inputs.is_floating_point() else inputs.dtype)
    targets = targets.to(device, dtype if targets.is_floating_point() else targets.dtype)
    try:
        with torch.no_grad():
            theta = flat_model.initial_parameters().to(device, dtype)
            outputs = flat_model.forward(theta, inputs)
            if flat_model.is_classifier or flat_model.multi_label:
                expected = (len(rows), data.num_classes)
                if tuple(outputs.shape) != expected:
                    raise _mismatch(
                        config,
                        data,
                        label,
                        f"it returns outputs of shape {tuple(outputs.shape)} for {len(rows)} examples; expected {expected}",
                    )
            losses = flat_model.example_loss(outputs, targets)
            if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (len(rows),):
                shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
                raise ConfigError(
                    f"the loss {getattr(flat_model.example_loss, '__name__', 'given')} returned {shape} for a batch of {len(rows)} examples; "
                    f"a loss returns one value per example, shape ({len(rows)},): reduce over every axis but the first "
                    "(e.g. ((outputs - targets) ** 2).flatten(1).sum(1)), and do not take the mean over the batch"
                )
    except ConfigError:
        raise
    except (ValueError, RuntimeError, IndexError, TypeError, AttributeError) as error:
        raise _mismatch(
            config, data, label, f"a forward pass on {len(rows)} training examples failed: {_first_line(error)}"
        ) from error


def _model_label(config: ExperimentConfig, user_model: Any) -> str:
    if user_model is None:
        return repr(config.model.name)
    if isinstance(user_model, nn.Module):
        return f"{type(user_model).__name__} (your module)"
    return f"{getattr(user_model, '__qualname__', type(user_model).__name__)} (your model factory)"


def _mismatch(config: ExperimentConfig, data: Any, label: str, reason: str) -> ConfigError:
    inputs = data.train_inputs
    if config.data.name in QUADRATIC_DATA:
        kind = "quadratic objectives, no classes"
    elif not data.targets_are_classes:
        kind = f"targets of shape {tuple(data.train_targets.shape[1:])}, not class ids"
    else:
        kind = f"{data.num_classes} tags, multi-label" if data.multi_label else f"{data.num_classes} classes"
    return ConfigError(
        f"model {label} does not fit data set {config.data.name!r} (inputs of shape {tuple(inputs.shape[1:])}, "
        f"{str(inputs.dtype).removeprefix('torch.')}; {kind}): {reason}. {models_that_fit(config.data.name, data)}"
    )


def models_that_fit(data_name: str, data: Any) -> str:
    """Which registered models take this data, in words (from each entry's ``inputs``)."""
    shape = tuple(data.train_inputs.shape[1:])
    vectors, images, sequences = (
        models.names_reading("vectors"),
        models.names_reading("images"),
        models.names_reading("sequences"),
    )
    image_only = [name for name in images if name not in vectors]
    if data_name in QUADRATIC_DATA:
        return f"Quadratic data take model.name={_either(models.names_reading('objectives'))} only."
    integers = not data.train_inputs.is_floating_point() and getattr(data, "input_normalisation", None) is None
    if integers and (data.train_inputs.dtype == torch.uint8 or len(shape) != 1):
        # uint8 or multi-axis integers are pixels, not token ids: the fix is their dtype, not a sequence model
        dtype = str(data.train_inputs.dtype).removeprefix("torch.")
        fitting = _either(image_only + vectors) if len(shape) == 3 else _either(vectors)
        return (
            f"The inputs are {dtype} values, which only {'/'.join(sequences)} read (as token ids, one sequence (length,) per example); "
            f"the other models compute in floating point: give float32 inputs (e.g. pixels / 255), or keep uint8 pixels and "
            f"pass input_normalisation=driftlab.data.pixels.PixelNormalisation(mean, std) to FederatedArrays; then use {fitting}."
        )
    if integers:
        return (
            f"Token sequences take model.name={_either(sequences)} (as shakespeare and sent140 do); "
            f"for vector data (synthetic, mnist, stackoverflow) use {_either(vectors)}, for images {_either(image_only)}."
        )
    if len(shape) == 3:
        return f"Images take model.name={_either(images)}; {'/'.join(sequences)} need token sequences (shakespeare, sent140)."
    square = [name for name in models.names_reading("square_vectors") if name not in vectors]
    square_fits = len(shape) == 1 and math.isqrt(shape[0]) ** 2 == shape[0] and square
    flat_images = f" (or {_either(square)}, for flat square images)" if square_fits else ""
    needs_images = [name for name in image_only if name not in square]
    return (
        f"Vectors take model.name={_either(vectors)}{flat_images}; {_either(needs_images, 'and')} need images (cifar10, cifar100), "
        f"{'/'.join(sequences)} need token sequences (shakespeare, sent140)."
    )


def _either(names: list[str], word: str = "or") -> str:
    """``a, b or c``."""
    return f"{', '.join(names[:-1])} {word} {names[-1]}" if len(names) > 1 else "".join(names)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line if len(line) <= 300 else line[:300] + "..."


__all__ = ["check_sizes", "checked_model", "check_plan_size", "probe_forward", "models_that_fit"]
