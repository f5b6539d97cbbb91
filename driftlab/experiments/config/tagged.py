"""The tagged-union sections: ``[algorithm]``, ``[data]``, ``[model]`` and ``[server]``, each validated by the config
type of the registry entry its tag names, and the flat form they had before they were split by kind."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator
from pydantic_core import PydanticCustomError

from driftlab.algorithms import registry
from driftlab.config_section import short
from driftlab.data import registry as data_sets
from driftlab.data.registry import DEFAULT_DATA_SET
from driftlab.models import registry as models
from driftlab.optim import registry as server_optimizers
from driftlab.plugins import did_you_mean

DEFAULT_ALGORITHM = "fedavg"


def _algorithm_section(value: Any) -> BaseModel:
    """The ``[algorithm]`` table validated by the config type of the algorithm it names, looked up in the
    registry now (not at import), so an algorithm a plugin registered validates like a built-in."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="python")
    if not isinstance(value, dict):
        raise PydanticCustomError(
            "algorithm_table",
            'expected a table such as [algorithm] name = "fedavg", got {value}',
            {"value": short(value)},
        )
    name = value.get("name", DEFAULT_ALGORITHM)
    entry = registry.lookup(name) if isinstance(name, str) else None
    if entry is None:
        raise PydanticCustomError("unknown_algorithm", "{message}", {"message": unknown_algorithm_message(name)})
    return entry.config_type.model_validate({**value, "name": name})


def unknown_algorithm_message(name: Any) -> str:
    """What to say about an ``algorithm.name`` no registered algorithm has, and how to make it one."""
    known = registry.names()
    guess = did_you_mean(name, known) if isinstance(name, str) else None
    message = (
        f"unknown algorithm {short(name)}{f' (did you mean {guess!r}?)' if guess else ''}; valid algorithms: "
        f"{', '.join(known)}. "
        "An algorithm of your own is imported by naming its module at the top of the config: "
        'plugins = ["my_algorithm.py"] (docs/design.md, "Writing a plugin")'
    )
    problems = registry.load_entry_points()
    if problems:
        message += "; installed plugins that failed to load: " + "; ".join(problems)
    return message


AlgorithmConfig = Annotated[Any, BeforeValidator(_algorithm_section)]


# The flat [model], [data] and [server] sections of driftlab before they became tagged unions (one config type per
# registered model, data set and server optimizer), with their defaults (None values left out, as to_dict leaves them).
# Two uses: a config.json written then names every key of every kind at its default, and such a key of another kind
# at its old default is dropped on reading (it never had an effect); and the fingerprint hashes each section
# completed with these defaults, so every config keeps the fingerprint it had, and old runs still resume.
LEGACY_FLAT_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {
        "name": "mlr",
        "hidden": [200, 200],
        "rnn_layers": 2,
        "embedding_dim": 8,
        "groups": 2,
        "resnet_stem": "cifar",
        "width": 64,
    },
    "data": {
        "name": "synthetic",
        "num_clients": 30,
        "quotas": "balanced",
        "lognormal_sigma": 0.3,
        "dirichlet_alpha": 0.3,
        "min_client_size": 10,
        "classes_per_client": 2,
        "client_test_fraction": 0.0,
        "synthetic_alpha": 1.0,
        "synthetic_beta": 1.0,
        "feddyn_kind": 1,
        "feddyn_heterogeneity": 1.0,
        "quadratic_dimension": 10,
        "quadratic_heterogeneity": 1.0,
        "min_samples_per_client": 0,
        "vocabulary_size": 10000,
        "tag_count": 500,
        "augment": False,
    },
    "server": {"optimizer": "sgd", "lr": 1.0, "momentum": 0.9, "beta1": 0.9, "bias_correction": True},
}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


# section -> (registry_of, tag, default) of every tagged-union section (registered_section), for the merging of tables
TAGGED_SECTIONS: dict[str, tuple[Any, str, str]] = {}


def kind_keys(section: str, name: Any) -> set[str] | None:
    """The keys section ``section`` takes when its tag names ``name`` (None: not a tagged section, or an unknown
    name)."""
    if section not in TAGGED_SECTIONS or not isinstance(name, str):
        return None
    registry_of, _, _ = TAGGED_SECTIONS[section]
    entry = registry_of().lookup(name)
    return None if entry is None else set(entry.config_type.model_fields)


def without_other_kinds_keys(section: str, table: dict[str, Any], name: Any) -> dict[str, Any]:
    """``table`` (a tagged section) switched to ``name``: the keys the new kind does not take are dropped (the old
    kind's own keys), its shared keys kept, as switching ``algorithm.name`` drops the old algorithm's keys."""
    keys = kind_keys(section, name)
    return dict(table) if keys is None else {key: value for key, value in table.items() if key in keys}


def registered_section(section: str, registry_of: Any, tag: str, default: str) -> Any:
    """The type of a config section that is a tagged union over a registry's entries, like ``[algorithm]``.

    ``section`` is the table's name ("model"), ``registry_of()`` returns the ``driftlab.plugins.Registry`` (called at
    validation time, so an entry a plugin registered validates like a built-in), ``tag`` is the key that names the
    entry ("name"; "optimizer" for [server]) and ``default`` the entry used when the tag is absent.  The table is
    validated by the entry's ``config_type``.  A key of the old flat section that the entry does not take is
    dropped when it holds its old default (config.json written before the sections were split), and refused
    otherwise, naming the kinds that take it.
    """

    TAGGED_SECTIONS[section] = (registry_of, tag, default)

    def validate(value: Any) -> BaseModel:
        registry = registry_of()
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="python")
        if not isinstance(value, dict):
            raise PydanticCustomError(
                f"{section}_table",
                'expected a table such as [{section}] {tag} = "{default}", got {value}',
                {"section": section, "tag": tag, "default": default, "value": short(value)},
            )
        name = value.get(tag, default)
        entry = registry.lookup(name) if isinstance(name, str) else None
        if entry is None:
            raise PydanticCustomError(
                f"unknown_{section}", "{message}", {"message": registry.unknown_message(name, f"{section}.{tag}")}
            )
        fields = entry.config_type.model_fields
        legacy = LEGACY_FLAT_DEFAULTS.get(section, {})
        table = {}
        for key, item in value.items():
            if key not in fields and item is None:
                continue  # `data.limit_per_class = none` (a sweep's default for a key of some data sets): the key unset
            if key not in fields and key in legacy and _same_value(item, legacy[key]):
                continue  # an old config.json's key of another kind, at the default it had: it never changed anything
            if key not in fields and key != tag:
                owners = [other for other in registry.names() if key in registry.lookup(other).config_type.model_fields]
                if owners:
                    raise PydanticCustomError(
                        f"{section}_key_of_another_kind",
                        "{message}",
                        {
                            "message": f"{section}.{key} is a key of {', '.join(owners)}, not of {section}.{tag} = "
                            f"{name!r}, whose keys are: {', '.join(k for k in fields if k != tag)}; remove it, or set "
                            f"{section}.{tag} to one of those"
                        },
                    )
            table[key] = item
        return entry.config_type.model_validate({**table, tag: name})

    return Annotated[Any, BeforeValidator(validate)]


def legacy_flat_form(content: dict[str, Any]) -> dict[str, Any]:
    """``content`` (a to_dict table) with each tagged section completed by the old flat defaults it leaves out: the
    form fingerprints are computed from, so a config hashes as it did before the sections became tagged unions."""
    completed = dict(content)
    for section, defaults in LEGACY_FLAT_DEFAULTS.items():
        if isinstance(completed.get(section), dict):
            completed[section] = {**defaults, **completed[section]}
    return completed


# [data]: a tagged union over the registered data sets (driftlab.data.registry); every data set's section subclasses
# driftlab.data.registry.DataSection, the keys all share, and holds its own keys besides.
DataConfig = registered_section("data", lambda: data_sets.REGISTRY, "name", DEFAULT_DATA_SET)

# [model]: a tagged union over the registered models (driftlab.models.registry); every model's section subclasses
# driftlab.models.ModelSection (loss, classifier) and holds its own keys besides (mlp: hidden; lstm: rnn_hidden, ...).
DEFAULT_MODEL = "mlr"
ModelConfig = registered_section("model", lambda: models.REGISTRY, "name", DEFAULT_MODEL)

# [server]: a tagged union over the registered server optimizers (driftlab.optim.registry), named by server.optimizer;
# every optimizer's section subclasses driftlab.optim.registry.ServerOptimizerConfig (lr) and holds its own keys besides
# (momentum: momentum; adam: beta1, beta2, epsilon, bias_correction; chain: transforms, the stages of a chain in TOML).
ServerConfig = registered_section(
    "server", lambda: server_optimizers.REGISTRY, server_optimizers.TAG, server_optimizers.DEFAULT
)
