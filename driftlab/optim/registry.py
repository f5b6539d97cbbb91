"""The server-optimizer registry: what a ``[server]`` section can name, and the transformations a chain is built from.

Two registries (``driftlab.plugins.Registry``, as for every kind of plugin):

* ``REGISTRY``, the server optimizers (entry-point group ``driftlab.server_optimizers``): ``[server]
  optimizer = NAME`` picks one, and the rest of the section is validated by its config type::

      ServerOptimizerEntry(
          name="adam",                    # server.optimizer in configs
          config_type=AdamConfig,         # a ServerOptimizerConfig subclass: `optimizer: Literal["adam"] = "adam"`,
                                          # server.lr from the base, and the optimizer's own keys
          build=build_adam,               # (section) -> driftlab.optim.server.ServerOptimizer
          label="FedAdam",                # how messages and `driftlab config` name it
      )

* ``TRANSFORMATIONS``, the stages of a chain stated in TOML (entry-point group
  ``driftlab.server_transformations``): ``optimizer = "chain"`` takes a list of them, each a table whose
  ``name`` picks the stage::

      [server]
      optimizer = "chain"
      lr = 0.5
      [[server.transforms]]
      name = "clip_by_global_norm"
      max_norm = 2.0
      [[server.transforms]]
      name = "scale_by_momentum"
      beta = 0.5
      [[server.transforms]]
      name = "scale_by_learning_rate"     # where server.lr is applied: exactly one stage of a chain does it

A second registry rather than entries of the first: a stage is not a server step (it transforms the update,
the chain subtracts it), and an optimizer name and a stage name never stand in each other's place.

The built-ins are registered by ``driftlab.optim`` (``driftlab/optim/built_in.py``) through the same
``register`` a plugin calls at import::

    from driftlab.optim.registry import ServerOptimizerEntry, ServerOptimizerConfig, register
    register(ServerOptimizerEntry("sign_sgd", SignSgdConfig, build_sign_sgd))

and a config names the plugin under ``plugins`` (docs/design.md, "A server optimizer of your own, and chains
in TOML").  This module imports no implementation: importing it runs ``driftlab/optim/__init__.py`` first,
which registers the built-ins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from driftlab.errors import ConfigError
from driftlab.optim.schedules import Rate
from driftlab.optim.server import ServerOptimizer, UpdateTransformation
from driftlab.plugins import Registry, check_config_type, check_entry_name, did_you_mean, one_line

ENTRY_POINT_GROUP = "driftlab.server_optimizers"
TRANSFORMATION_GROUP = "driftlab.server_transformations"
TAG = "optimizer"  # the key of [server] that names the entry
DEFAULT = "sgd"


class ServerOptimizerConfig(BaseModel):
    """The keys every ``[server]`` section has, whatever its optimizer: the rate ``server.lr``.

    A config type subclasses it and adds ``optimizer: Literal["NAME"] = "NAME"`` and its own keys.  The settings
    are those of every config section: unknown keys refused, frozen, no inf/NaN.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    lr: Rate = Field(1.0, description="server learning rate η_g: a number or a schedule table")


class TransformationConfig(BaseModel):
    """The base of a chain stage's config type: subclasses add ``name: Literal["NAME"] = "NAME"`` and their keys."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


@dataclass(frozen=True)
class ServerOptimizerEntry:
    """A server optimizer a config can name: ``build(section)`` returns the ``ServerOptimizer`` for a validated
    ``[server]`` section of ``config_type``; ``label`` is how messages name it (its name when None)."""

    name: str
    config_type: type
    build: Callable[[Any], ServerOptimizer]
    label: str | None = None

    def __post_init__(self) -> None:
        _check_entry(
            "server optimizer",
            self,
            ServerOptimizerConfig,
            "driftlab.optim.registry.ServerOptimizerConfig (it holds server.lr, which every optimizer has)",
            "(section) -> ServerOptimizer",
            tag=TAG,
        )
        if self.label is not None and (not isinstance(self.label, str) or not self.label.strip()):
            raise ValueError(f"server optimizer {self.name!r}: label must be a non-empty string or None")


@dataclass(frozen=True)
class TransformationEntry:
    """A stage a TOML chain can name: ``build(config)`` returns the ``UpdateTransformation``.

    ``applies_lr``: the stage multiplies the update by the rate passed to the chain (``server.lr`` of the round);
    a chain needs exactly one such stage, or ``server.lr`` would be ignored (or applied twice).
    """

    name: str
    config_type: type
    build: Callable[[Any], UpdateTransformation]
    applies_lr: bool = False

    def __post_init__(self) -> None:
        _check_entry(
            "server transformation",
            self,
            TransformationConfig,
            "driftlab.optim.registry.TransformationConfig",
            "(config) -> UpdateTransformation",
        )


def _check_entry(kind: str, entry: Any, base: type, base_text: str, build_signature: str, tag: str = "name") -> None:
    """What both kinds of entry need: a valid name, a config type subclassing ``base``, and a ``build`` function."""
    check_entry_name(kind, entry.name)
    check_config_type(kind, entry.name, entry.config_type, base, base_text, tag)
    if not callable(entry.build):
        raise ValueError(f"{kind} {entry.name!r}: build must be a function {build_signature}")


REGISTRY: Registry[ServerOptimizerEntry] = Registry(
    "server optimizer", ENTRY_POINT_GROUP, ServerOptimizerEntry, lambda entry: entry.build
)
TRANSFORMATIONS: Registry[TransformationEntry] = Registry(
    "server transformation", TRANSFORMATION_GROUP, TransformationEntry, lambda entry: entry.build
)


def register(entry: ServerOptimizerEntry | TransformationEntry) -> ServerOptimizerEntry | TransformationEntry:
    """Add a server optimizer or a chain stage to its registry (what a plugin module calls at import); returns it."""
    if isinstance(entry, TransformationEntry):
        return TRANSFORMATIONS.register(entry)
    if not isinstance(entry, ServerOptimizerEntry):
        raise TypeError(f"register() takes a ServerOptimizerEntry or a TransformationEntry, got {type(entry).__name__}")
    return REGISTRY.register(entry)


# The kind's registry functions are the Registry's own (driftlab.plugins.Registry documents them).
lookup = REGISTRY.lookup
names = REGISTRY.names


def label(name: str) -> str:
    """How messages name a server optimizer: its entry's label, else its name."""
    entry = REGISTRY.entries.get(name)
    return entry.label if entry is not None and entry.label else name


def build_server_optimizer(section: Any) -> ServerOptimizer:
    """The ``ServerOptimizer`` of a validated ``[server]`` section (``config.server``).

    A plugin's ``build`` that raises, or returns something else, is a ConfigError naming the plugin's file.
    """
    entry = REGISTRY.lookup(section.optimizer)
    if entry is None:
        raise ConfigError(REGISTRY.unknown_message(section.optimizer, f"server.{TAG}"))
    if not REGISTRY.is_plugin(entry):
        return entry.build(section)
    try:
        optimizer = entry.build(section)
    except Exception as error:  # a plugin's failure, whatever it is, becomes one message naming it
        raise ConfigError(f"{REGISTRY.describe(entry)}: build failed: {one_line(error)}") from error
    if not isinstance(optimizer, ServerOptimizer):
        raise ConfigError(
            f"{REGISTRY.describe(entry)}: build returned a {type(optimizer).__name__}, not a "
            "driftlab.optim.server.ServerOptimizer (make one with driftlab.optim.server.chain, "
            "or ServerOptimizer(name, init, update))"
        )
    return optimizer


# ---------------------------------------------------------------- the stages of a chain, validated one by one


def _transformation(value: Any, index: int) -> BaseModel:
    """Stage ``index`` (from 1) of ``server.transforms``, validated by its entry's config type; a ValueError
    whose message names the stage, what is wrong, and the keys or names that are allowed."""
    where = f"stage {index}"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="python")
    if not isinstance(value, dict):
        raise ValueError(f'{where}: expected a table such as {{name = "scale_by_learning_rate"}}, got {value!r}'[:300])
    name = value.get("name")
    entry = TRANSFORMATIONS.lookup(name) if isinstance(name, str) else None
    if entry is None:
        given = "has no name" if name is None else f"names {name!r}"
        guess = did_you_mean(name, TRANSFORMATIONS.names()) if isinstance(name, str) else None
        hint = f" (did you mean {guess!r}?)" if guess else ""
        raise ValueError(
            f"{where} {given}{hint}, not a server transformation; valid: {', '.join(TRANSFORMATIONS.names())}. "
            "A transformation of your own is registered by a plugin (TransformationEntry)"
        )
    fields = entry.config_type.model_fields
    unknown = [key for key in value if key not in fields]
    if unknown:
        valid = [key for key in fields if key != "name"]
        guesses = [f"{guess} for {key}" for key in unknown if (guess := did_you_mean(key, valid))]
        raise ValueError(
            f"{where} ({name}): unknown key(s) {', '.join(unknown)}; its keys are: {', '.join(valid) or '(none)'}"
            + (f" (did you mean {', '.join(guesses)}?)" if guesses else "")
        )
    try:
        return entry.config_type.model_validate(value)
    except ValidationError as error:
        details = "; ".join(
            f"{'.'.join(map(str, item['loc'])) or name}: {item['msg'].removeprefix('Value error, ')} "
            f"(got {item.get('input')!r})"
            for item in error.errors(include_url=False)
        )
        raise ValueError(f"{where} ({name}): {details}") from None


def _transformations(value: Any) -> tuple[BaseModel, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise PydanticCustomError(
            "transforms_list",
            "expected a non-empty list of tables ([[server.transforms]] name = ...), got {value}",
            {"value": repr(value)[:200]},
        )
    stages = tuple(_transformation(item, index) for index, item in enumerate(value, start=1))
    rate_stages = [stage.name for stage in stages if TRANSFORMATIONS.entries[stage.name].applies_lr]
    if len(rate_stages) != 1:
        appliers = [name for name, entry in TRANSFORMATIONS.entries.items() if entry.applies_lr]
        fix = f'add a stage {{name = "{appliers[0]}"}}' if not rate_stages else f"keep one of {', '.join(rate_stages)}"
        raise ValueError(
            f"a chain applies server.lr in exactly one stage ({' or '.join(appliers)}), got {len(rate_stages)}: {fix}"
        )
    return stages


Transformations = Annotated[Any, BeforeValidator(_transformations)]
