"""A model's parameters as one flat vector.

Algorithms, client state, compression and checkpoints all see a model as a
single 1-D tensor ``θ ∈ R^P``: the affine gradient corrections of
algorithms.md (``a_k + D_k ⊙ (θ − θ_ref)``) are then plain vector arithmetic,
per-client state is one row of a table, and a round's clients stack into a
``[C, P]`` matrix for the vectorized backend.  ``FlatModel`` maps that vector
back onto the module's parameters (as views, no copies) for
``torch.func.functional_call``.

``FlatModel.forward`` and ``batch_loss`` run the module in evaluation mode
(every evaluation goes through them); local training runs its own copies in
training mode (``modes.py``).  The module's buffers (BatchNorm's running
statistics) are the server's: the flat vector holds parameters only, buffers
travel beside it (``buffers.py``).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from driftlab.simulation.backends.modes import has_dropout, module_mode


def cross_entropy_per_example(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets, reduction="none")


def binary_cross_entropy_per_example(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Multi-label loss: the mean over labels of the binary cross-entropy with logits (StackOverflow tags)."""
    return F.binary_cross_entropy_with_logits(outputs, targets, reduction="none").mean(dim=1)


# targets: every per-example loss is called as loss(outputs, targets)
def objective_per_example(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: ARG001
    """For models whose output already is each example's objective value (the quadratic clients)."""
    return outputs


# ``functional_call`` swaps the parameters of the module it is given for the length of the call, so a copy of that
# module made meanwhile by another thread (a backend's per-thread copy) would copy the swapped-in tensors, which may
# be part of an autograd graph (a client's computation on its own data runs beside the threads training others).
# FlatModel.forward on the shared module and every copy of it hold this lock.
SHARED_MODULE_LOCK = threading.RLock()


def copy_module(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` never taken while ``FlatModel.forward`` has swapped its parameters."""
    with SHARED_MODULE_LOCK:
        return copy.deepcopy(module)


@dataclass(frozen=True)
class FlatModel:
    """A ``torch.nn.Module`` evaluated at a flat parameter vector.

    Example:
        >>> from driftlab.models import build_model
        >>> flat = FlatModel.wrap(build_model("mlr", (4,), 3))
        >>> theta = flat.initial_parameters()
        >>> theta.shape
        torch.Size([15])
        >>> flat.forward(theta, torch.zeros(2, 4)).shape
        torch.Size([2, 3])
    """

    module: nn.Module
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    example_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_per_example
    is_classifier: bool = True  # outputs are class logits, so accuracy is defined
    multi_label: bool = False  # outputs are one logit per label (recall@5 is reported)
    # Whether the module has dropout layers, whose masks local steps draw from per-step keys (modes.py).
    dropout: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dropout", has_dropout(self.module))

    @staticmethod
    def wrap(
        module: nn.Module,
        example_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_per_example,
        is_classifier: bool = True,
        multi_label: bool = False,
    ) -> "FlatModel":
        """Wrap ``module``; ``example_loss(outputs, targets)`` gives one loss per example (default cross-entropy)."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        return FlatModel(
            module=module,
            names=tuple(name for name, _ in named),
            shapes=tuple(p.shape for _, p in named),
            numels=tuple(p.numel() for _, p in named),
            example_loss=example_loss,
            is_classifier=is_classifier,
            multi_label=multi_label,
        )

    @property
    def num_parameters(self) -> int:
        return sum(self.numels)

    def initial_parameters(self) -> torch.Tensor:
        """The module's current parameters, copied into one flat vector."""
        params = dict(self.module.named_parameters())
        return torch.cat([params[name].detach().reshape(-1) for name in self.names]).clone()

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``theta`` shaped like the module's parameters."""
        pieces = torch.split(theta, self.numels)
        return {name: piece.view(shape) for name, piece, shape in zip(self.names, pieces, self.shapes, strict=True)}

    def forward(self, theta: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The module's outputs at ``theta``, in evaluation mode (no dropout; BatchNorm with its running statistics);
        each submodule's mode is restored after."""
        with SHARED_MODULE_LOCK, module_mode(self.module, training=False):
            return functional_call(self.module, self.unflatten(theta), (inputs,))

    def batch_loss(self, theta: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss over the batch at ``theta``, in evaluation mode (a measurement: FedProx's dissimilarity)."""
        return self.example_loss(self.forward(theta, inputs), targets).mean()

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "FlatModel":
        """Move the module (buffers included) so functional calls run on ``device``."""
        self.module.to(device=device, dtype=dtype)
        return self


RUNNING_NORM = "running_norm"  # the kind of a parameter of a normalisation layer with running statistics


def parameter_kinds(module: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """The kind of each parameter ``names`` lists (``module``'s, by ``named_parameters`` name): ``RUNNING_NORM`` for
    one of a normalisation layer whose running statistics a training-mode forward moves (BatchNorm, InstanceNorm
    with ``track_running_stats``), else the class name of the module that registers it (``"Linear"``)."""
    kinds = []
    for name in names:
        owner = module.get_submodule(name.rpartition(".")[0])
        running = isinstance(owner, nn.modules.batchnorm._NormBase) and owner.track_running_stats
        kinds.append(RUNNING_NORM if running else type(owner).__name__)
    return tuple(kinds)
