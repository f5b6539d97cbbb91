"""How many clients a chunk of the vectorized backend holds: its memory per client against the budget.

A chunk of ``C`` clients holds, per client, its rows of ``Θ``, of a gradient (or
correction-terms) buffer, of a scratch buffer and of the correction rows that
differ per client; its batch's activations and their gradients; its loss-term
tensors and local-step state; and its batch schedule.  ``chunk_clients`` divides
the chunks' budget (``MemoryBudget.chunk_bytes``: the round's share on a CPU,
this process's part of a GPU) by that, shared by the chunks in flight, and caps
it on a CPU (``CPU_CHUNK_CLIENTS``; one client for convolutional and recurrent
networks, whose per-client kernels are already efficient: docs/performance.md).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from driftlab.simulation.backends.flat import FlatModel
from driftlab.simulation.backends.local_training import ClientTask, TrainingData
from driftlab.simulation.backends.objectives import as_local_objective
from driftlab.simulation.backends.stacked import StackedNetwork, has_convolutions, has_recurrent_layers
from driftlab.simulation.backends.vectorized_gradients import LinearReluStack
from driftlab.simulation.backends.vectorized_layout import affine_correction
from driftlab.simulation.seam import GradientCorrection

# On a CPU the per-step working set of more than ~16 MLP clients spills out of the
# last-level cache and every elementwise pass becomes a trip to DRAM; measured in
# docs/performance.md.  GPUs have no such knee, so they use the memory budget alone.
CPU_CHUNK_CLIENTS = 16


def per_client_correction_rows(corrections: Sequence[GradientCorrection]) -> int:
    """How many ``[P]`` rows per client ``StackedCorrection.stack`` will hold (shared rows and scalars cost nothing)."""

    def varies(values: list) -> bool:
        present = [v for v in values if v is not None]
        return bool(present) and not all(v is present[0] and len(present) == len(values) for v in present)

    linear = varies([c.linear for c in corrections])
    quadratic = any(isinstance(c.quadratic, torch.Tensor) for c in corrections) and varies(
        [c.quadratic for c in corrections]
    )
    reference = (
        varies([c.reference for c in corrections]) if any(c.reference is not None for c in corrections) else False
    )
    return int(linear) + int(quadratic) + int(reference)


def objective_elements(tasks: Sequence[ClientTask]) -> int:
    """Floats per client of loss-term tensors and local-step state (an upper bound: shared tensors are counted too)."""
    most = 0
    for task in tasks:
        if not isinstance(task.correction, GradientCorrection):
            objective = as_local_objective(task.correction)
            term, step = objective.loss_term, objective.local_step
            count = sum(t.numel() for t in term.tensors) if term is not None else 0
            count += sum(t.numel() for t in step.initial_state) if step is not None else 0
            most = max(most, count)
    return most


def bytes_per_client(
    engine,
    model: FlatModel,
    start_params: torch.Tensor,
    tasks: Sequence[ClientTask],
    data: TrainingData,
    convolution: str = "grouped",
) -> int:
    """A chunk's bytes per client of ``tasks`` (module docstring): parameter-sized rows, activations, objective
    tensors and batch schedule; with ``convolution="unfold"`` or ``"mixed"`` the unfolded layers' patch columns too."""
    element = start_params.element_size()
    # θ, a gradient (or correction-terms) buffer and a scratch buffer, plus the correction rows that differ per client.
    params_rows = 3 + per_client_correction_rows([affine_correction(task) for task in tasks])
    width = max((task.batches.shape[1] for task in tasks), default=1)
    steps = max(task.num_steps for task in tasks)
    if isinstance(engine, LinearReluStack):
        activations = engine.activation_elements(engine.flat_inputs(data.inputs[:1]).shape[1])
    else:
        first = data.batch(torch.zeros(1, dtype=torch.long, device=data.inputs.device))[0]
        activations = engine.activation_elements(first, start_params)
        if isinstance(engine, StackedNetwork):  # the patch columns of the layers this convolution choice unfolds
            activations += engine.unfold_elements(first, start_params, convolution)
    if data.augment is not None:  # the augmented copy of the batch and the augmentation's temporaries (flip, padding)
        activations += 5 * data.inputs[0].numel()
    if data.normalisation is not None:  # the normalised copy of the gathered pixels
        activations += data.inputs[0].numel()
    parameters = params_rows * model.num_parameters + width * activations + objective_elements(tasks)
    return element * parameters + steps * width * (8 + element)


def chunk_clients(per_client: int, budget_bytes: int, num_tasks: int, workers: int = 1, cap: int | None = None) -> int:
    """Clients per chunk: as many as ``budget_bytes`` holds at ``per_client`` bytes each, the budget shared by
    ``workers`` chunks in flight, at most ``cap``, and split evenly over the workers; at least one."""
    size = max(1, budget_bytes // (workers * per_client))
    return int(min(size, cap or size, math.ceil(num_tasks / workers)))


def default_cap(engine, model: FlatModel, device: torch.device) -> int | None:
    """The most clients a chunk holds whatever the budget: none on a GPU; on a CPU ``CPU_CHUNK_CLIENTS``, or one
    for convolutional and recurrent networks on the batched layers."""
    if device.type != "cpu":
        return None
    if isinstance(engine, StackedNetwork) and (has_convolutions(model.module) or has_recurrent_layers(model.module)):
        return 1
    return CPU_CHUNK_CLIENTS
