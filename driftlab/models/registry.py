"""The model registry: one entry per model, holding every fact the rest of driftlab needs about it.

An entry names the model's ``[model]`` config type, the function that builds the module, what inputs it
takes (for the messages of a model that does not fit the data) and, optionally, its batched forward for
the vectorized backend::

    ModelEntry(
        name="tiny_cnn",                  # model.name in configs
        config_type=TinyCNNConfig,        # a ModelSection subclass with `name: Literal["tiny_cnn"] = "tiny_cnn"`
        build=build,                      # (section, input_shape, num_classes) -> nn.Module
        inputs=("images",),               # what it reads: vectors, images, square_vectors, sequences, objectives
        description="two 3x3 convolutions and a linear layer",
    )

The built-in models (the zoo) are registered by ``driftlab.models``.  A model of your own registers
itself the same way from a plugin file, with one call at import (``register(entry)``), and a config
names the file under ``plugins``; an installed package declares it in the entry-point group
``driftlab.models`` instead.  ``[model]`` is then validated by the entry's config type: each model
has its own keys, and ``loss`` and ``classifier`` (``ModelSection``) are every model's.

This module imports no model: importing ``driftlab.models.registry`` runs ``driftlab/models/__init__.py``
first, which registers the zoo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from driftlab.models import layers
from driftlab.plugins import Registry, check_config_type, check_entry_name

ENTRY_POINT_GROUP = "driftlab.models"
MAX_WIDTH = 65_536  # hidden widths, embeddings, channels: the model's memory is checked separately (compatibility)
# What a model reads (ModelEntry.inputs): floating feature vectors of any shape, images (channels, height, width),
# flat square images such as (784,), token-id sequences (length,), and the quadratic data sets' objectives.
INPUT_KINDS = ("vectors", "images", "square_vectors", "sequences", "objectives")
Width = Annotated[int, Field(ge=1, le=MAX_WIDTH)]


class ModelSection(BaseModel):
    """The keys every model's ``[model]`` section has; each model's config type subclasses it and adds a
    ``name: Literal["its name"] = "its name"`` field and its own keys (frozen, unknown keys refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    loss: str | None = Field(
        None,
        min_length=1,
        description='a loss of your own: "module:function" or "path/to/file.py:function" of fn(outputs, targets) -> one loss per '
        "example [B]; none = cross-entropy (binary for multi-label data; the objective itself for quadratic data)",
    )
    classifier: bool | None = Field(
        None,
        description="report accuracy (outputs are class scores); none = yes for integer class-id targets, no for floating "
        "targets (regression), multi-label and quadratic data",
    )

    @field_validator("loss")
    @classmethod
    def _loss_is_a_reference(cls, loss: str | None) -> str | None:
        if loss is not None:
            source, separator, name = loss.rpartition(":")
            if not separator or not source or not name.isidentifier():
                shown = loss if len(loss) <= 80 else loss[:65] + "..."
                raise ValueError(f'expected "module:function" or "path/to/file.py:function", got {shown!r}')
        return loss


BatchedForward = Callable[
    [nn.Module, layers.Parameters, Any], Any
]  # (module, params, [C, B, ...] inputs) -> [C, B, classes]


@dataclass(frozen=True)
class ModelEntry:
    """Everything driftlab needs to know about one model besides its code.

    ``build(section, input_shape, num_classes)`` returns the ``nn.Module`` for examples of ``input_shape``
    (without the batch axis) and ``num_classes`` outputs; ``section`` is the validated ``[model]`` table
    (an instance of ``config_type``).  A model whose ``inputs`` include ``"sequences"`` is also given
    ``vocab_size=`` (the data set's token count, or None: then ``num_classes``).  ``inputs`` names what
    it reads (``INPUT_KINDS``; ``"objectives"``: the quadratic data sets, trained on their objective).
    ``batched_forward`` (optional) computes the forward pass of a stack of clients for modules of exactly
    the types in ``module_types`` (``driftlab.models.batched`` holds the zoo's; ``layers`` the pieces);
    without one, the vectorized backend trains the model with ``torch.func.vmap``.
    """

    name: str
    config_type: type
    build: Callable[..., nn.Module]
    inputs: tuple[str, ...] = ("vectors", "images")
    description: str = ""
    batched_forward: BatchedForward | None = None
    module_types: tuple[type, ...] = field(default=())

    def __post_init__(self) -> None:
        check_entry_name("model", self.name)
        check_config_type(
            "model",
            self.name,
            self.config_type,
            ModelSection,
            "driftlab.models.ModelSection (it brings the keys every model has: loss, classifier); "
            "declare it as `class Config(ModelSection): ...`",
        )
        if not callable(self.build):
            raise ValueError(
                f"model {self.name!r}: build must be a function (section, input_shape, num_classes) -> nn.Module"
            )
        unknown = (
            [kind for kind in self.inputs if kind not in INPUT_KINDS]
            if isinstance(self.inputs, tuple)
            else [self.inputs]
        )
        if unknown or not self.inputs:
            raise ValueError(
                f"model {self.name!r}: inputs must be a non-empty tuple of {', '.join(INPUT_KINDS)}; got {self.inputs!r}"
            )
        if self.batched_forward is not None and (
            not callable(self.batched_forward)
            or not self.module_types
            or not all(isinstance(t, type) for t in self.module_types)
        ):
            raise ValueError(
                f"model {self.name!r}: a batched_forward needs module_types, the module classes (exact types) it computes, "
                "e.g. module_types=(TinyCNN,)"
            )

    @property
    def reads_objectives(self) -> bool:
        """Whether the model is the parameter of the quadratic data sets (trained on their objective, no classes)."""
        return "objectives" in self.inputs


REGISTRY: Registry[ModelEntry] = Registry("model", ENTRY_POINT_GROUP, ModelEntry, lambda entry: entry.build)
MODELS: dict[str, ModelEntry] = REGISTRY.entries  # in registration order: the zoo, then plugins


# The kind's registry functions are the Registry's own (driftlab.plugins.Registry documents them).
register = REGISTRY.register
lookup = REGISTRY.lookup
names = REGISTRY.names


def names_reading(kind: str) -> list[str]:
    """The registered models whose ``inputs`` include ``kind`` (for the messages of a model that does not fit the data)."""
    return [name for name, entry in MODELS.items() if kind in entry.inputs]


def build_module(
    entry: ModelEntry, section: Any, input_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None
) -> nn.Module:
    """``entry.build`` for data of ``input_shape`` and ``num_classes``; a sequence model also gets ``vocab_size``."""
    shape = tuple(int(size) for size in input_shape)
    if "sequences" in entry.inputs:
        return entry.build(section, shape, num_classes, vocab_size=vocab_size)
    return entry.build(section, shape, num_classes)


def batched_form(module: nn.Module) -> BatchedForward | None:
    """The batched forward of ``module``: its model's (found by the module's exact type, so a module passed with
    ``model=`` is found too; a subclass may change ``forward``), or the layer-by-layer one of an ``nn.Sequential``;
    None when it has none, or a layer inside has no exact batched form (``layers.supported``)."""
    forward = layers.forward_sequential if type(module) is nn.Sequential else None
    containers: list[type] = []
    for entry in MODELS.values():
        if entry.batched_forward is None:
            continue
        containers += entry.module_types
        if forward is None and type(module) in entry.module_types:
            forward = entry.batched_forward
    if forward is None or not layers.supported(module, tuple(containers)):
        return None
    return forward


__all__ = [
    "ENTRY_POINT_GROUP",
    "INPUT_KINDS",
    "MAX_WIDTH",
    "MODELS",
    "REGISTRY",
    "ModelEntry",
    "ModelSection",
    "Width",
    "batched_form",
    "build_module",
    "lookup",
    "names",
    "names_reading",
    "register",
]
