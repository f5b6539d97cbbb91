"""A module's buffers (BatchNorm's running statistics) as part of the federated state, beside the flat parameters.

Algorithms see a model as its flat parameter vector θ (``seam.py``) and never
see buffers: the buffers travel beside θ, through the engine and the backends,
and are averaged by ``average_buffers`` alone, so no algorithm changes.

* The server's buffers are the shared module's (``FlatModel.module``): every
  evaluation (``FlatModel.forward``, evaluation mode) reads them there, and
  ``final_state_dict.safetensors`` saves them under the module's own names.
* A round's clients all start local training from those buffers
  (``RoundBuffers.start``); a training-mode forward updates a client's copy
  (BatchNorm: ``r ← (1 − m)·r + m·batch statistic``, ``n ← n + 1``), and each
  client's final buffers are recorded by its task position (``RoundBuffers.record``).
* The server's new buffers are the mean of the reporting clients' final ones,
  weighted as FedAvg weights their models, ``p_k ∝ n_k`` (times the client's
  multiplicity in the sample):

      r ← r_server + Σ_k p_k (r_k − r_server),     Σ_k p_k = 1      (float buffers)
      n ← max_k n_k                                               (integer buffers: num_batches_tracked)

  Flower's ``FedAvg`` (``aggregate``: every ``state_dict`` array weighted by
  ``num_examples``) and FedML's FedAvg (the ``state_dict`` weighted by sample
  counts) average running statistics this way; it is the "FedAvg with BN"
  baseline of FedBN (Li et al., ICLR 2021), which keeps them local instead.
  (PFLlib's ``aggregate_parameters`` averages ``parameters()`` only, so its
  server model keeps the running statistics it started with.)
  Written as a change from the server's value, a buffer no client changed
  (a constant table) stays bit for bit what it was.  ``num_batches_tracked``
  only matters to BatchNorm with ``momentum=None`` (a cumulative average);
  the maximum is the count of the longest single chain of updates that went
  into the average, where a sum would count every client's steps as if one
  model had taken them all one after another.
* Checkpoints hold them as engine tensors ``buffers/<name>``, written and
  restored by the state extra ``ModuleBuffersExtra``, so a resumed run
  continues from the server's buffers.
* The vectorized backend keeps a ``[C, ...]`` stack of each buffer per chunk,
  every client's BatchNorm seeing its own batch (``vectorized_buffers.py``):
  both backends agree to rounding (1e-12 in float64).
* Algorithms' corrections (SCAFFOLD's control variates, FedDyn's linear term,
  ...) act on θ only: buffers get none, as in every implementation cited.

A model without buffers has an empty record: nothing is copied, recorded or
averaged, and its runs are bit for bit those of before.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from driftlab.simulation.backends.modes import trained_buffers


def refuse_running_statistics(module: nn.Module, what: str, why: str) -> None:
    """ValueError when ``module`` has normalisation layers whose running statistics training moves (BatchNorm), which
    ``what`` (a feature or a driver) cannot carry for the reason ``why``; the fix names the alternatives."""
    layers = trained_buffers(module)
    if layers:
        shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
        raise ValueError(
            f"{what} with a model whose normalisation layers keep running statistics ({shown}): {why}; use GroupNorm "
            'or LayerNorm (model.name = "resnet18_gn"), or build the layers with track_running_stats=False'
        )


def has_buffers(module: nn.Module) -> bool:
    """Whether ``module`` registers any buffer (then they are state: averaged, checkpointed)."""
    return any(True for _ in module.buffers())


def module_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every buffer ``module`` registers, by its ``state_dict`` name ({} for a model without buffers)."""
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


def load_buffers(module: nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """Write ``buffers`` into ``module``'s own (in place: views of them stay valid), cast to each buffer's dtype."""
    own = dict(module.named_buffers())
    unknown = sorted(set(buffers) - set(own))
    if unknown:
        raise KeyError(f"the module has no buffers named {', '.join(unknown)}: pass buffers of the same model")
    with torch.no_grad():
        for name, value in buffers.items():
            own[name].copy_(value)


def average_buffers(
    server: Mapping[str, torch.Tensor],
    clients: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
) -> dict[str, torch.Tensor]:
    """The server's new buffers from the reporting ``clients``' final ones (module docstring): floating buffers the
    ``weights``-weighted mean, written as a change from ``server``; integer buffers the maximum.  No client: the
    server's, unchanged."""
    if len(clients) != len(weights):
        raise ValueError(f"{len(clients)} clients' buffers but {len(weights)} weights")
    if not clients:
        return dict(server)
    total = float(sum(weights))
    if not total > 0.0:
        raise ValueError(f"the buffers' weights must have a positive sum, got {list(weights)}")
    averaged: dict[str, torch.Tensor] = {}
    for name, start in server.items():
        if start.is_floating_point() or start.is_complex():
            change = torch.zeros_like(start)
            for buffers, weight in zip(clients, weights, strict=True):
                change += (buffers[name].to(start.device) - start) * (float(weight) / total)
            averaged[name] = start + change
        else:
            averaged[name] = torch.stack([buffers[name].to(start.device) for buffers in clients]).amax(dim=0)
    return averaged


def own_buffers_record(sim: Any) -> Any:
    """The state extra of ``sim`` (a ``Simulation``) keeping each client's own buffers
    (``driftlab.personal.buffers.ClientBuffers``: FedBN's BatchNorm statistics, with ``[personal_layers]`` keeping
    BatchNorm layers), found by its ``keeps_client_buffers`` mark; None: every buffer is shared."""
    return next((extra for extra in sim.state_extras if getattr(extra, "keeps_client_buffers", False)), None)


CHECKPOINT_PREFIX = "buffers/"  # a checkpoint's engine tensors holding the server's buffers: buffers/<state_dict name>


def buffer_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The server's buffers as a checkpoint's engine tensors (``buffers/<name>``, on the CPU); {} without buffers, so
    a checkpoint of a model without buffers is the file it was."""
    return {CHECKPOINT_PREFIX + name: value.to("cpu").contiguous() for name, value in module_buffers(module).items()}


def restore_buffers(module: nn.Module, engine_tensors: Mapping[str, torch.Tensor]) -> None:
    """Load the server's buffers a checkpoint's engine tensors hold into ``module`` (none: nothing, as for a
    checkpoint written before buffers were state, or of a model without them)."""
    load_buffers(
        module,
        {
            name[len(CHECKPOINT_PREFIX) :]: value
            for name, value in engine_tensors.items()
            if name.startswith(CHECKPOINT_PREFIX)
        },
    )


class ModuleBuffersExtra:
    """The server's buffers as a checkpoint's *state extra* (``round.checkpointing.StateExtra``): written from the
    run's module as ``buffers/<name>``, restored into the resumed run's module; it changes no ``SimulationState``
    field (the module holds them).  A simulation of a model with buffers lists one (``Simulation.checkpointed_extras``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def engine_tensors(self, state: Any, disk_stores: Mapping[str, Any]) -> dict[str, torch.Tensor]:  # noqa: ARG002
        return buffer_tensors(self.module)

    def restored(self, sim: Any, state: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:  # noqa: ARG002
        restore_buffers(sim.model.module, tensors)
        return {}


class RoundBuffers:
    """A round's buffers on their way through a backend: the server's, every client starts from (``start``), and
    each client's after local training, by task position (``final``).  Backends record from several threads.

    ``own`` (by task position) overrides some of ``start`` for a client that keeps buffers of its own (FedBN's
    BatchNorm statistics, kept local): that client starts from ``start_of(position)``."""

    def __init__(
        self, start: Mapping[str, torch.Tensor], own: Mapping[int, Mapping[str, torch.Tensor]] | None = None
    ) -> None:
        self.start = dict(start)
        self.own = {position: dict(buffers) for position, buffers in (own or {}).items()}
        self.final: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def start_of(self, position: int) -> dict[str, torch.Tensor]:
        """The buffers task ``position``'s client starts from: the round's, with its own in their place."""
        return {**self.start, **self.own[position]} if position in self.own else self.start

    def subset(self, positions: Sequence[int]) -> "RoundBuffers":
        """A record for the tasks at ``positions`` (a backend's group of them), indexed by their place in it."""
        return RoundBuffers(self.start, {index: self.own[p] for index, p in enumerate(positions) if p in self.own})

    def record(self, position: int, module: nn.Module) -> None:
        """Keep the buffers ``module`` (the copy that trained task ``position``) holds now."""
        self.keep(position, module_buffers(module))

    def keep(self, position: int, buffers: Mapping[str, torch.Tensor]) -> None:
        """Keep ``buffers`` (copies no one writes to any more) as task ``position``'s final ones."""
        with self._lock:
            self.final[position] = dict(buffers)


__all__ = [
    "CHECKPOINT_PREFIX",
    "ModuleBuffersExtra",
    "RoundBuffers",
    "average_buffers",
    "buffer_tensors",
    "has_buffers",
    "load_buffers",
    "module_buffers",
    "own_buffers_record",
    "restore_buffers",
]
