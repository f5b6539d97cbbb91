"""The vectorized training backend: all clients of a round do local SGD together.

Client ``k`` runs ``K_k`` steps of corrected local SGD from ``θ_k = θ^{t−1}``:
the update of algorithms.md ("Local training") and the seam (``seam.py``),
written out in ``vectorized_step.py``, which does one chunk's steps.  Here the
``C`` clients of a chunk are stacked into a ``[C, P]`` matrix ``Θ`` and every
step is a handful of batched operations on ``Θ`` whatever ``C`` is:

* the step's minibatch of every client is gathered with one index operation
  (``rows[s]``, a ``[C, B]`` table of sample rows), and augmented, when
  ``TrainingData.augment`` is set, in one call with the ``[C, B]`` keys
  ``example_keys(augment_key_k, s, i)``, the same keys the sequential backend
  uses (padding slots get keys too; their weight is 0);
* a short last batch is padded; the loss is the masked mean
  ``ℓ_k = Σ_i w_ki ℓ(θ_k; x_i)`` with ``w_ki = 1/|batch_k|`` on real examples and
  ``0`` on padding, which is the sequential per-batch mean;
* clients are sorted by descending step count, so the clients still training at
  step ``s`` are a prefix ``Θ[:n_s]``; finished clients keep their parameters
  and cost nothing (grouping by step count comes for free);
* the loss gradient comes from batched layers (``bmm``, a hand-written backward)
  for stacks of ``Linear``/``ReLU`` with cross-entropy, and from
  ``torch.func.vmap(grad(...))`` of ``functional_call`` for any other module.
  A module that ``vmap`` cannot handle falls back to the sequential backend with
  a logged warning.  Local steps run the module in training mode; its dropout
  masks come from each client's step key (``modes.py``), the sequential
  backend's masks, so both backends train a model with ``nn.Dropout`` alike;
  other random operations cannot be vmapped and fall back, with that reason.
  A model with buffers (BatchNorm's running statistics, state beside θ:
  ``buffers.py``) carries a ``[C, ...]`` stack of each per chunk, every
  client's BatchNorm seeing its own unpadded batch (``vectorized_buffers``);
  its clients with a loss term train on the sequential backend.

Without clipping the update is fused into the weight-gradient GEMM
(``W ← W − η_l δᵀh`` is one ``baddbmm_``), so the parameters are read and written
once per step and no ``[C, P]`` gradient is materialised; the correction terms
``E = a + D ⊙ (θ − θ_ref) + wd · θ`` (taken at the step's starting ``θ``) are
then applied as ``θ ← θ − η_l E``.  With clipping the gradient must be complete
before its norm is known, so it is written to a ``[C, P]`` buffer and the step
above is applied in place, in the same order as ``local_training.corrected_step``.

Non-affine local objectives (``objectives.LocalObjective``) take a general
path: clients with a loss term get their gradient from
``vmap(grad(objectives.objective_loss))`` (the term's per-client tensors
stacked as rows, or shared), and a local step of the algorithm's own is applied
client by client to the stack's rows after ``corrected_gradient_``.  A round's
clients are split into groups (affine; a given loss-term function; local step
only) and each group is chunked and trained on its own, so affine clients run
exactly the code above.

Chunks of clients are sized from the run's memory budget
(``memory_budget.MemoryBudget.chunk_bytes``: the round's share of ``memory_budget``
on a CPU, this process's part of a GPU, split with the runs sharing it), so a
round of 1,000 clients never holds more than a chunk's parameters, gradients and
activations per worker.  On a CPU the chunks (batched layers or ``vmap``) run on one thread
each, as many at once as torch has intra-op threads (``_map_chunks``): a
client's GEMMs are too small to split well over threads, and single-threaded
kernels are not starved when other processes load the machine.  Every chunk is deterministic, so the
results do not depend on the chunking or the threads (up to GEMM summation
order); docs/performance.md has the measurements behind these choices.

The backend is split by job: ``vectorized_layout`` (a chunk's corrections and
batches as rows on its device), ``vectorized_engine`` (what a gradient engine
offers), ``vectorized_gradients`` (the gradient engines), ``vectorized_step`` (a
chunk's local steps), ``vectorized_plan`` (clients per chunk from the memory
budget) and this module (the backend: grouping, chunking, devices and threads,
the fallback to the sequential backend).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from driftlab.models.layers import CONVOLUTIONS, convolution
from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import (
    ClientTask,
    LocalWork,
    SequentialBackend,
    TrainingBackend,
    TrainingData,
    map_on_threads,
)
from driftlab.simulation.backends.precision import local_arithmetic
from driftlab.simulation.backends.stacked import StackedNetwork, has_recurrent_layers
from driftlab.simulation.backends.vectorized_buffers import BufferedGradient, ChunkBuffers, buffered_problem
from driftlab.simulation.backends.vectorized_gradients import (
    LinearReluStack,
    TermGradients,
    VmappedGradient,
    gradient_engine,
    stacked_problem,
    vmap_problem,
)
from driftlab.simulation.backends.vectorized_layout import (
    BatchSchedule,
    StackedCorrection,
    group_key,
    loss_term_of,
    normalized_objective,
)
from driftlab.simulation.backends.vectorized_plan import CPU_CHUNK_CLIENTS, bytes_per_client, chunk_clients, default_cap
from driftlab.simulation.backends.vectorized_step import (
    corrected_gradient_,
    corrected_step_,
    correction_terms,
    train_chunk,
)
from driftlab.simulation.seam import GradientCorrection
from driftlab.simulation.state.memory_budget import MemoryBudget

logger = logging.getLogger(__name__)


class VectorizedBackend(TrainingBackend):
    """Trains a round's clients as ``[C, P]`` stacks, chunk by chunk (module docstring).

    Args:
        memory_budget_bytes: bytes the chunks in flight may use for parameters,
            gradients, corrections, activations and batch schedules, on any
            device (for direct callers and tests); default: ``memory_budget``'s.
        memory_budget: the run's ``MemoryBudget``, which gives the chunks' bytes
            per device (``MemoryBudget.chunk_bytes``: on a CPU the round's share,
            1 GiB without a configured budget; on a GPU this process's part of
            80% of its memory, split with the runs sharing it). Default: the
            unconfigured budget.
        max_chunk_clients: at most this many clients per chunk; default on a CPU
            ``CPU_CHUNK_CLIENTS``, or one client for convolutional and recurrent
            networks, whose per-client kernels (oneDNN's convolutions and fused
            LSTM/GRU) are already efficient (docs/performance.md); no limit beyond
            the budget on a GPU.
        batched_layers: use the batched layers (``LinearReluStack``,
            ``stacked.StackedNetwork``) where the model allows (``False`` forces
            ``vmap``; for benchmarks and tests).
        parallel_chunks: on a CPU, train one chunk per intra-op thread at once,
            each single-threaded (see ``_map_chunks``); ``False``: one chunk at a
            time with multi-threaded kernels.
        precision: ``precision.PRECISIONS``; ``tf32`` and ``bf16`` change the local
            steps' gradients only (``precision.local_arithmetic``).
        convolution: how the batched layers compute convolutions, ``layers.CONVOLUTIONS``: ``grouped`` (one
            grouped convolution per layer), ``unfold`` (im2col and a matrix product per client), ``channels_last``
            (the grouped convolutions on channels-last tensors) or ``mixed`` (unfold for a 3-channel first layer,
            grouped elsewhere); the same function to rounding (the config's ``convolution``). Chunks of one client
            use the module's own layer.
        devices: train the chunks on these devices, chunk ``j`` on
            ``devices[j mod len(devices)]``, and gather the models on the device of
            the start parameters.  The assignment depends only on the chunk's
            index, so a fixed device list gives bit-identical reruns.  Default: the
            start parameters' device.
    """

    name = "vectorized"

    def __init__(
        self,
        memory_budget_bytes: int | None = None,
        max_chunk_clients: int | None = None,
        batched_layers: bool = True,
        parallel_chunks: bool = True,
        precision: str = "float32",
        devices: Sequence[torch.device | str] | None = None,
        memory_budget: MemoryBudget | None = None,
        convolution: str = "grouped",
    ) -> None:
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be positive, got {memory_budget_bytes}")
        if max_chunk_clients is not None and max_chunk_clients < 1:
            raise ValueError(f"max_chunk_clients must be at least 1, got {max_chunk_clients}")
        if devices is not None and not devices:
            raise ValueError("devices must list at least one device")
        if convolution not in CONVOLUTIONS:
            raise ValueError(f"convolution must be one of {', '.join(CONVOLUTIONS)}, got {convolution!r}")
        self.memory_budget_bytes = memory_budget_bytes
        self.memory_budget = memory_budget if memory_budget is not None else MemoryBudget()
        self.max_chunk_clients = max_chunk_clients
        self.batched_layers = batched_layers
        self.parallel_chunks = parallel_chunks
        self.precision = precision
        self.convolution = convolution
        self.devices = None if devices is None else tuple(torch.device(d) for d in devices)
        self._engine_of: tuple[nn.Module, object] | None = None  # (module, its engine or None), the last model trained
        self._fallback: SequentialBackend | None = None
        self._buffered_of: tuple[nn.Module, BufferedGradient | None] | None = None  # as _engine_of, with buffers
        self._term_engines: dict[
            tuple, VmappedGradient | None
        ] = {}  # (module, term function) -> engine, see _term_engine
        self._replicas: dict[torch.device, TrainingData] = {}
        self._replicated: TrainingData | None = None  # the data the replicas were made from

    def train_round(self, work: LocalWork) -> Iterator[tuple[int, torch.Tensor, int]]:
        """The round's clients (``TrainingBackend``); with ``work.buffers``, each client's own stacked
        (``vectorized_buffers``)."""
        if not work.tasks:
            return
        if work.buffers is not None:
            engine = self._buffered_engine(work)
        else:
            engine = self._engine(work.model, work.start_params, work.tasks, work.data)
        if engine is None:
            yield from self._fallback.train_round(work)
            return
        if all(isinstance(task.correction, GradientCorrection) for task in work.tasks):
            yield from self._train_group(engine, work)
            return
        tasks = [normalized_objective(task) for task in work.tasks]
        groups: dict[tuple, list[int]] = {}
        for position, task in enumerate(tasks):
            groups.setdefault(group_key(task.correction), []).append(position)
        buffers = work.buffers
        for key, positions in groups.items():
            group = dataclasses.replace(
                work,
                tasks=[tasks[p] for p in positions],
                buffers=None if buffers is None else buffers.subset(positions),
            )
            group_engine = engine
            if key[0] == "term":  # the model's VmappedGradient, with the group's loss terms; none with buffers
                group_engine = None if buffers is not None else self._term_engine(group)
            if group_engine is None:
                trained = self._fallback_backend().train_round(group)
            else:
                trained = self._train_group(group_engine, group)
            for index, final, done in trained:
                if buffers is not None:
                    buffers.keep(positions[index], group.buffers.final.pop(index))
                yield positions[index], final, done

    def _buffered_engine(self, work: LocalWork) -> BufferedGradient | None:
        """The gradient engine for a model whose buffers are state (``vectorized_buffers``), or ``None`` (noted once
        per module) when ``vmap`` cannot run it: its clients then train on the sequential backend."""
        model = work.model
        if self._buffered_of is not None and self._buffered_of[0] is model.module:
            engine = self._buffered_of[1]
        else:
            engine = BufferedGradient(model)
            problem = buffered_problem(engine, work.buffers.start_of(0), work.start_params, work.tasks[0], work.data)
            if problem is not None:
                logger.warning(
                    "vectorized backend: %s with its buffers cannot be vmapped (%s); training its clients one by one "
                    "with the sequential backend",
                    type(model.module).__name__,
                    _random_hint(problem),
                )
                engine = None
            self._buffered_of = (model.module, engine)
        self._fallback_backend()
        return engine

    def _fallback_backend(self) -> SequentialBackend:
        if self._fallback is None:
            self._fallback = SequentialBackend(precision=self.precision)
        return self._fallback

    def _train_group(self, engine, work: LocalWork) -> Iterator[tuple[int, torch.Tensor, int]]:
        """Chunk ``work.tasks`` (clients whose objectives one engine serves) and train the chunks; with
        ``work.buffers`` (the engine a ``BufferedGradient``), each chunk's clients from the round's, recorded after."""
        model, start_params, tasks, data, buffers = work.model, work.start_params, work.tasks, work.data, work.buffers
        home = start_params.device
        devices = self.devices or (home,)
        # Grouping by step count: neighbours in this order finish together, so chunks waste little.
        order = sorted(range(len(tasks)), key=lambda position: -tasks[position].num_steps)
        workers = self.workers(start_params, len(tasks), devices)
        # Which clients share a chunk can change the last bits on the vmap path (not with the batched layers,
        # whose clients never mix), so there the chunks are cut as for one worker: the same on any machine.
        split = workers if isinstance(engine, (LinearReluStack, StackedNetwork)) else 1
        chunk_size = self.chunk_size(engine, model, start_params, tasks, data, split)
        chunks = list(enumerate(order[start : start + chunk_size] for start in range(0, len(order), chunk_size)))
        starts = {device: start_params.to(device) for device in devices}

        def train(chunk: tuple[int, list[int]]) -> tuple[list[int], torch.Tensor, list[int]]:
            index, positions = chunk
            device = devices[index % len(devices)]
            with local_arithmetic(self.precision, device), convolution(self.convolution):
                chunk_engine = engine
                chunk_tasks = [tasks[p] for p in positions]
                if any(
                    loss_term_of(task) is not None for task in chunk_tasks
                ):  # a term group: engine is the model's VmappedGradient
                    chunk_engine = TermGradients(engine, [loss_term_of(task) for task in chunk_tasks], starts[device])
                if buffers is not None:
                    chunk_engine = ChunkBuffers(engine, [buffers.start_of(p) for p in positions], starts[device])
                finals, steps_done = train_chunk(
                    chunk_engine, starts[device], chunk_tasks, work.settings, self._data_on(data, device)
                )
                if buffers is not None:
                    for k, position in enumerate(positions):
                        buffers.keep(position, {n: b.to(home) for n, b in chunk_engine.buffers_of(k).items()})
            return positions, finals.to(home), steps_done

        for positions, finals, steps_done in _map_chunks(train, chunks, workers):
            for k, position in enumerate(positions):
                yield position, finals[k], steps_done[k]

    def _data_on(self, data: TrainingData, device: torch.device) -> TrainingData:
        """``data`` on ``device``: itself on its own device, else a copy made once per data set and device."""
        if data.inputs.device == device:
            return data
        if self._replicated is not data:
            self._replicas, self._replicated = {}, data
        if device not in self._replicas:
            self._replicas[device] = dataclasses.replace(
                data, inputs=data.inputs.to(device), targets=data.targets.to(device)
            )
        return self._replicas[device]

    def workers(self, start_params: torch.Tensor, num_tasks: int, devices: Sequence[torch.device] = ()) -> int:
        """Chunks trained at once: one per listed device when there are several, else one per intra-op thread on a CPU
        (each single-threaded), else one."""
        if len(devices) > 1:
            return min(len(devices), num_tasks)
        if not self.parallel_chunks or start_params.device.type != "cpu":
            return 1
        return max(1, min(torch.get_num_threads(), num_tasks))

    def chunk_size(
        self,
        engine,
        model: FlatModel,
        start_params: torch.Tensor,
        tasks: Sequence[ClientTask],
        data: TrainingData,
        workers: int = 1,
    ) -> int:
        """Clients per chunk: as many as the memory budget holds (shared by ``workers`` chunks in flight),
        capped on a CPU (see ``CPU_CHUNK_CLIENTS``) and split evenly over the workers (``vectorized_plan``)."""
        per_client = bytes_per_client(engine, model, start_params, tasks, data, self.convolution)
        cap = self.max_chunk_clients or default_cap(engine, model, start_params.device)
        return chunk_clients(per_client, self.budget_bytes(start_params.device), len(tasks), workers, cap)

    def budget_bytes(self, device: torch.device) -> int:
        """The memory chunks in flight on ``device`` may use: ``memory_budget_bytes`` when given, else the run's
        ``MemoryBudget.chunk_bytes`` (the round's share on a CPU, this process's part of a GPU)."""
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes
        return self.memory_budget.chunk_bytes(device)

    def _engine(self, model: FlatModel, start_params: torch.Tensor, tasks: Sequence[ClientTask], data: TrainingData):
        """The gradient engine for ``model``, or ``None`` (with a warning, once) when it cannot be batched."""
        if self._engine_of is not None and self._engine_of[0] is model.module:
            engine = self._engine_of[1]
        else:
            engine = gradient_engine(model, self.batched_layers, self.precision)
            if isinstance(engine, StackedNetwork):
                # In float32 whatever the run's precision: the probe compares two layouts of one function. Outside
                # this context a GPU runs it with cuDNN's default TF32 convolutions, the likely reason ResNet-18-GN's
                # layouts differed past the tolerance on an H200 and it trained on the slower vmap path (issue 24).
                with local_arithmetic("float32", start_params.device), convolution(self.convolution):
                    problem = stacked_problem(engine, model, start_params, tasks[0], data)
                if problem is not None:
                    logger.warning(
                        "vectorized backend: no batched layers for %s (%s); using vmap",
                        type(model.module).__name__,
                        problem,
                    )
                    engine = None
            if engine is None:
                engine = VmappedGradient(model)
                problem = vmap_problem(engine, start_params, tasks[0], data)
                if problem is not None:
                    logger.warning(
                        "vectorized backend: %s cannot be vmapped (%s); training its clients one by one with the sequential backend",
                        type(model.module).__name__,
                        _random_hint(problem),
                    )
                    engine = None
            self._engine_of = (model.module, engine)
        if engine is None and self._fallback is None:
            self._fallback = SequentialBackend(precision=self.precision)
        return engine

    def _term_engine(self, group: LocalWork):
        """The model's ``VmappedGradient`` for the clients of ``group`` (one loss-term function) if it can ``vmap`` their
        term, or ``None`` (a warning, once per model and term function: those clients train with the sequential
        backend)."""
        model, start_params, tasks, data = group.model, group.start_params, group.tasks, group.data
        function = loss_term_of(tasks[0]).function
        key = (model.module, function)
        if key not in self._term_engines:
            if any(module is not model.module for module, _ in self._term_engines) or len(self._term_engines) >= 64:
                # A new model, or term functions made anew for every client (define them once in build):
                # old entries would only keep their models and closures alive.
                self._term_engines = {}
            # One VmappedGradient (and its per-thread module copies) per model, whatever the term.
            engine = next((e for e in self._term_engines.values() if e is not None), None) or VmappedGradient(model)
            problem = vmap_problem(engine, start_params, tasks[0], data)
            if problem is None:
                probe = TermGradients(engine, [loss_term_of(tasks[0])] * 2, start_params)
                problem = vmap_problem(probe, start_params, tasks[0], data)
            if problem is not None:
                logger.warning(
                    "vectorized backend: the loss term %s on %s cannot be vmapped (%s); training its clients with the sequential backend",
                    getattr(function, "__qualname__", function),
                    type(model.module).__name__,
                    problem,
                )
                engine = None
            self._term_engines[key] = engine
        if self._term_engines[key] is None and self._fallback is None:
            self._fallback = SequentialBackend(precision=self.precision)
        return self._term_engines[key]


def _random_hint(problem: str) -> str:
    """``problem``, with the reason when the module draws random numbers ``vmap`` cannot (``modes.py``)."""
    if "random operation" not in problem:
        return problem
    return (
        "its forward draws random numbers other than nn.Dropout's masks, which are keyed per client and step; "
        f"vmap cannot draw those per client: {problem.splitlines()[0]}"
    )


def auto_backend(model: FlatModel, device: torch.device) -> str:
    """The backend ``backend=auto`` runs: a rule backed by the measurements in docs/performance.md.

    On a GPU, vectorized for every model but recurrent networks, which train
    one client at a time: on an NVIDIA H200 the batched ``bmm`` recurrence of
    FedDyn's Shakespeare LSTM took 0.894 s a round of 10 clients where a loop
    of one cuDNN LSTM per client took 0.390 s (docs/performance.md, "First
    measurements on a GPU").  On a CPU, vectorized where the
    batched layers apply (the zoo's models, ``nn.Sequential`` of their layers):
    Linear/ReLU stacks train several times faster there, and convolutional and
    recurrent networks at least as fast as one by one (their chunks run one
    single-threaded worker per core, which also keeps them fast when other
    processes load the machine); sequential for other modules, whose
    ``vmap`` path is slower on a CPU.  A rule and not a timing, so that the
    same run always trains the same way.
    """
    if device.type != "cpu":
        return "sequential" if has_recurrent_layers(model.module) else "vectorized"
    return "vectorized" if gradient_engine(model) is not None else "sequential"


def _map_chunks(train: Callable, chunks: list, workers: int) -> Iterator:
    """``train`` over ``chunks``: ``local_training.map_on_threads``, one single-threaded chunk per worker thread.

    Chunk-level parallelism beats intra-op parallelism here: a client's GEMMs
    (50 x 784 x 200 for the standard MLP) are too small to split well over
    threads, and single-threaded kernels cannot be starved by a thread pool
    oversubscribed by other processes.
    """
    return map_on_threads(train, chunks, workers)


__all__ = [
    "BatchSchedule",
    "CPU_CHUNK_CLIENTS",
    "auto_backend",
    "gradient_engine",
    "LinearReluStack",
    "StackedCorrection",
    "VectorizedBackend",
    "VmappedGradient",
    "TermGradients",
    "corrected_gradient_",
    "corrected_step_",
    "correction_terms",
]
