"""The data-set registry: one entry per data set a config can name as ``data.name``.

An entry holds every fact the rest of driftlab needs about a data set besides its
code: the config type of its ``[data]`` section, how to load it, where its files
are, whether it has clients of its own, and the optional facts the download
command and the memory checks read::

    DataSetEntry(
        name="two_blobs",                      # data.name in configs
        config_type=TwoBlobsData,              # a DataSection with `name: Literal["two_blobs"] = "two_blobs"`
        load=load_two_blobs,                   # (section, seed, path) -> FederatedDataset, or pooled tensors
        description="two Gaussian blobs, 2 classes",
    )

The built-ins are registered by ``driftlab.data`` (``driftlab/data/builtins.py``)
through the same ``register`` a plugin calls at import; a config names the plugin
under ``plugins`` and the data set under ``data.name`` (docs/design.md, "A data
set of your own").  Installed packages declare theirs in the entry-point group
``driftlab.datasets``.

Every ``[data]`` section shares the keys of :class:`DataSection` (where the files
are, how many clients, how the pooled examples are split over them); a data
set's own keys are the fields its config type adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from driftlab.data.download import RemoteFile
from driftlab.errors import ConfigError
from driftlab.plugins import Registry, check_entry_name

ENTRY_POINT_GROUP = "driftlab.datasets"
DEFAULT_DATA_SET = "synthetic"  # the data set of a config that names none
PARTITIONS = ("natural", "iid", "dirichlet", "dirichlet_classwise", "classes_per_client", "power_law")


def default_is_unset(key: str, default: Any) -> Any:
    """A validator of ``key`` that stores its ``default`` as None: the same run (and fingerprint) as leaving the key
    out, for a key added after runs without it were written (``None`` values are left out of ``to_dict``)."""

    def unset(_cls: type, value: Any) -> Any:
        return None if value == default else value

    return field_validator(key)(classmethod(unset))


class DataSection(BaseModel):
    """The keys every ``[data]`` section has, whatever the data set: where its files are, the clients, the split.

    A data set's config type subclasses it, adds its own keys and narrows ``name`` to
    ``Literal["its_name"] = "its_name"``.  The partition keys apply to every data set whose
    examples are pooled and dealt out (``data.partition`` other than ``natural``), and a data
    set with clients of its own can be pooled and split again (FEMNIST made IID).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(DEFAULT_DATA_SET, description="data set; `driftlab data list` describes each")
    root: str | None = Field(
        None,
        min_length=1,
        description="where the data set's official files are; default: its folder under $DRIFTLAB_DATA, else the first of "
        "./shared/data, ../shared/data and the source checkout's ../shared/data that holds it",
    )
    num_clients: int = Field(
        30, ge=1, description="number of clients (devices) of generated data and of partitioned pooled data"
    )
    partition: Literal[PARTITIONS] | None = Field(  # type: ignore[valid-type]
        None,
        description="natural (the data set's own clients), iid, dirichlet (client-prior form, FedDyn), dirichlet_classwise "
        "(Hsu et al.), classes_per_client (shards), power_law (FedProx MNIST); none = natural where it exists, else iid",
    )
    quotas: Literal["balanced", "lognormal"] = Field(
        "balanced", description="client sizes for iid, dirichlet and classes_per_client: balanced or lognormal (FedDyn)"
    )
    lognormal_sigma: float = Field(0.3, ge=0, description="σ of lognormal quotas (FedDyn uses 0.3)")
    dirichlet_alpha: float = Field(
        0.3, gt=0, description="concentration α of the Dirichlet partitions (smaller is more heterogeneous)"
    )
    min_client_size: int = Field(
        10, ge=0, description="dirichlet_classwise: redraw until every client has at least this many samples"
    )
    classes_per_client: int = Field(2, ge=1, description="classes_per_client and power_law: classes each client holds")
    client_test_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="hold out this fraction of every client's data as its local test split "
        "(0 = off; data sets with their own keep theirs)",
    )
    validation_fraction: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="hold out ⌈fraction·n_k⌉ of every client's training rows (after its test split) as its validation rows, "
        "drawn from (seed, client id); they never train, and evaluation reports validation_loss/validation_accuracy on "
        "them apart from the test metrics (unset: no validation split, every run as before)",
    )

    _zero_is_unset = default_is_unset("validation_fraction", 0)  # 0 holds nothing out

    augment: bool = Field(
        False,
        description="image data (CIFAR): train on augmented minibatches as the FedDyn code does, a random horizontal flip, then "
        "with probability 1/2 zero-padding by 4 and a random crop back; draws from (seed, round, client, step, slot), "
        "the same on every backend",
    )
    seed: int | None = Field(
        None, ge=0, description="seed of generation and partitioning; default: the experiment seed"
    )


def named_section(class_name: str, name: str, module: str, base: type[DataSection] = DataSection) -> type:
    """The config type of a data set with no keys beyond ``base``'s: ``base`` with ``name: Literal[name] = name``,
    the class ``class_name`` of ``module`` (where pickle finds it)."""
    return create_model(class_name, __base__=base, __module__=module, name=(Literal[name], name))


@dataclass(frozen=True)
class Download:
    """The files ``driftlab data download NAME --to DIR`` fetches for a data set (``driftlab.data.download``).

    ``name`` is what the command takes; several data sets may share one download (the EMNIST
    splits are one official bundle).
    """

    name: str
    files: tuple[RemoteFile, ...]

    def __post_init__(self) -> None:
        check_entry_name("download", self.name)
        if not self.files or not all(isinstance(remote, RemoteFile) for remote in self.files):
            raise ValueError(
                f"download {self.name!r}: files must be a non-empty tuple of driftlab.data.download.RemoteFile"
            )


@dataclass(frozen=True)
class DataSetEntry:
    """Everything driftlab needs to know about one data set besides its code.

    ``config_type``: a subclass of :class:`DataSection` whose ``name`` field defaults to ``name``.
    ``load(section, seed, path)``: the data set, given its validated ``[data]`` section, the data seed
    and where its files are (``None`` for generated data): a ``FederatedDataset`` (clients of its own),
    or pooled ``(train_x, train_y, test_x, test_y)`` tensors (optionally a ``PixelNormalisation`` fifth)
    that ``data.partition`` splits over ``data.num_clients`` clients.
    ``location``: its files below the data root (``./shared/data``, ``$DRIFTLAB_DATA``); None for generated data.
    ``natural_clients``: it has clients of its own (the default partition is then ``natural``, else ``iid``).
    ``num_classes``: classes of a pooled data set (None: inferred from the labels present).
    ``download``: the files ``driftlab data download`` fetches for it (None: not downloadable).
    ``size_estimate(section)``: bytes each client takes at the peak of generating or loading it, a lower
    bound the memory check multiplies by ``data.num_clients`` before anything is built (None: an index
    array per client when pooled data is split, nothing for clients of its own).
    ``vocabulary(section)``: the token vocabulary sequence models embed (None: not sequence data).
    ``tests_from_fraction``: its loader holds out ``data.client_test_fraction`` of every client itself (Shakespeare,
    whose 80-window gap keeps a client's test text out of its training windows); dealt out again by another
    ``data.partition``, the new clients get those test rows rather than a second share of their training rows.
    """

    name: str
    config_type: type
    load: Callable[[Any, int, Path | None], Any]
    description: str
    location: str | None = None
    natural_clients: bool = False
    num_classes: int | None = None
    download: Download | None = None
    size_estimate: Callable[[Any], int] | None = None
    vocabulary: Callable[[Any], int] | None = None
    tests_from_fraction: bool = False

    def __post_init__(self) -> None:
        check_entry_name("data set", self.name)
        if not (isinstance(self.config_type, type) and issubclass(self.config_type, DataSection)):
            raise ValueError(
                f"data set {self.name!r}: config_type must subclass driftlab.data.registry.DataSection (the keys every "
                f"[data] section shares), got {self.config_type!r}"
            )
        if self.config_type.model_fields["name"].default != self.name:
            raise ValueError(
                f'data set {self.name!r}: config_type needs the field `name: Literal["{self.name}"] = "{self.name}"`'
            )
        if not callable(self.load):
            raise ValueError(
                f"data set {self.name!r}: load must be a function (section, seed, path) -> FederatedDataset"
            )
        if not isinstance(self.description, str) or not self.description.strip():
            raise ValueError(
                f"data set {self.name!r}: description must be a non-empty string (`driftlab data list` shows it)"
            )
        if self.location is not None and (
            not isinstance(self.location, str) or not self.location or Path(self.location).is_absolute()
        ):
            raise ValueError(
                f'data set {self.name!r}: location is its files\' path below the data root, such as "mnist", or None '
                f"for generated data; got {self.location!r}"
            )
        if self.num_classes is not None and (
            isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 1
        ):
            raise ValueError(
                f"data set {self.name!r}: num_classes must be a positive integer or None, got {self.num_classes!r}"
            )
        if self.download is not None and not isinstance(self.download, Download):
            raise ValueError(f"data set {self.name!r}: download must be a driftlab.data.registry.Download or None")
        for key in ("size_estimate", "vocabulary"):
            if getattr(self, key) is not None and not callable(getattr(self, key)):
                raise ValueError(f"data set {self.name!r}: {key} must be a function of the [data] section, or None")

    @property
    def default_location(self) -> str | None:
        """``location`` under the name ``experiments/run/real_data.py`` reads (until it reads ``location``)."""
        return self.location

    @property
    def own_keys(self) -> list[str]:
        """The keys of its ``[data]`` section beyond those every data set shares."""
        return [key for key in self.config_type.model_fields if key not in DataSection.model_fields]


REGISTRY: Registry[DataSetEntry] = Registry("data set", ENTRY_POINT_GROUP, DataSetEntry, lambda entry: entry.load)
DATA_SETS: dict[str, DataSetEntry] = REGISTRY.entries  # in registration order: the built-ins, then plugins


# The kind's registry functions are the Registry's own (driftlab.plugins.Registry documents them).
register = REGISTRY.register
lookup = REGISTRY.lookup


def entry_of(section: Any) -> DataSetEntry:
    """The entry of a validated ``[data]`` section (``config.data``)."""
    entry = REGISTRY.lookup(section.name)
    if entry is None:  # validated in a process whose plugins this one has not imported
        raise ConfigError(REGISTRY.unknown_message(section.name, "data.name"))
    return entry


def downloads() -> dict[str, tuple[RemoteFile, ...]]:
    """What ``driftlab data download`` can fetch: each registered data set's download, by its name."""
    REGISTRY.load_entry_points()
    return {
        entry.download.name: entry.download.files for entry in REGISTRY.entries.values() if entry.download is not None
    }
