"""driftlab's own data sets: each one's ``[data]`` keys, its loader and its registry entry.

Registered by ``driftlab.data`` through the same ``register`` a plugin calls.  A loader
takes ``(section, seed, path)``: its validated ``[data]`` section, the data seed and
where its files are (None for generated data), and returns a ``FederatedDataset`` (clients
of its own) or pooled tensors that ``data.partition`` deals out
(``driftlab.experiments.run.datasets.build_dataset``).  The loaders import their modules
when called, so naming the data sets costs no import of h5py, PIL or the generators.
"""

# ruff: noqa: ARG001, ARG005 - every loader takes (section, seed, path), the registry's signature, whatever it uses

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from driftlab.data.download import REGISTRY as DOWNLOADS
from driftlab.data.federated import DataFileError, federated_dataset_from_arrays
from driftlab.data.registry import DataSection, DataSetEntry, Download, default_is_unset, named_section, register
from driftlab.errors import ConfigError

# Peak bytes per client while generating a data set, measured (tracemalloc, numpy) and rounded down,
# so the memory check's estimate stays a lower bound.
SYNTHETIC_BYTES_PER_CLIENT = 400_000
FEDDYN_SYNTHETIC_BYTES_PER_CLIENT = 200_000
QUADRATIC1D_BYTES_PER_CLIENT = 20_000
# With data.samples_per_client = c, FedProx synthetic devices peak at about 7,400 + 870 c bytes each (measured, c = 10, 100).
CAPPED_SYNTHETIC_BYTES = (6_000, 800)
QUADRATIC_BYTES_PER_CLIENT_AND_DIMENSION = 8_000
LEAF_CHARACTERS = 80  # LEAF's character vocabulary (Shakespeare)

_MAX_CLIENTS = "keep at most this many clients"


def check_function_reference(reference: str) -> None:
    """A ValueError unless ``reference`` reads ``"module:function"`` or ``"path/to/file.py:function"``."""
    source, separator, name = reference.rpartition(":")
    if not separator or not source or not name.isidentifier():
        shown = repr(reference) if len(repr(reference)) <= 80 else repr(reference)[:65] + "..."
        raise ValueError(f'expected "module:function" or "path/to/file.py:function", got {shown}')


# ---------------------------------------------------------------- generated data


class SyntheticData(DataSection):
    name: Literal["synthetic"] = "synthetic"
    synthetic_alpha: float = Field(
        1.0, ge=0, description="α of synthetic(α,β): variance of the shared mean of each device's W_k, b_k"
    )
    synthetic_beta: float = Field(1.0, ge=0, description="β of synthetic(α,β): how much local data differs")
    samples_per_client: int | None = Field(
        None, ge=1, description="at most this many samples per device (train and test together)"
    )


class SyntheticIidData(DataSection):
    name: Literal["synthetic_iid"] = "synthetic_iid"
    samples_per_client: int | None = Field(
        None, ge=1, description="at most this many samples per device (train and test together)"
    )


class FedDynSyntheticData(DataSection):
    name: Literal["feddyn_synthetic"] = "feddyn_synthetic"
    feddyn_kind: int = Field(1, ge=0, le=3, description="heterogeneity type 1, 2 or 3 (0: homogeneous)")
    feddyn_heterogeneity: float = Field(1.0, ge=0, description="the γ of the chosen type")


class _ObjectiveClients(DataSection):
    """Clients that are objectives (quadratics) rather than labelled examples."""

    @model_validator(mode="after")
    def _no_label_partition(self) -> "_ObjectiveClients":
        if self.partition not in (None, "natural", "iid"):
            # the label-based partitions skew classes, and quadratic objectives have none (all labels 0)
            raise ValueError(
                f"data.partition = {self.partition!r} deals out examples by class, and {self.name}'s clients are "
                'objectives with no classes; use data.partition = "natural" (the default: one objective per client) '
                'or "iid" (the objectives grouped into clients at random)'
            )
        return self


class Quadratic1dData(_ObjectiveClients):
    name: Literal["quadratic1d"] = "quadratic1d"


class QuadraticData(_ObjectiveClients):
    name: Literal["quadratic"] = "quadratic"
    quadratic_dimension: int = Field(10, ge=1, description="dimension of the multi-dimensional quadratic clients")
    quadratic_heterogeneity: float = Field(
        1.0, ge=0, description="spread of curvatures and linear terms across quadratic clients"
    )


def _synthetic(section: SyntheticData, seed: int, path: Path | None) -> Any:
    from driftlab.data.synthetic import synthetic_federated

    return synthetic_federated(
        section.synthetic_alpha,
        section.synthetic_beta,
        num_clients=section.num_clients,
        seed=seed,
        max_samples_per_client=section.samples_per_client,
    )


def _synthetic_iid(section: SyntheticIidData, seed: int, path: Path | None) -> Any:
    from driftlab.data.synthetic import synthetic_federated

    return synthetic_federated(
        0.0,
        0.0,
        iid=True,
        num_clients=section.num_clients,
        seed=seed,
        max_samples_per_client=section.samples_per_client,
    )


def _synthetic_bytes(section: SyntheticData | SyntheticIidData) -> int:
    if section.samples_per_client is None:
        return SYNTHETIC_BYTES_PER_CLIENT
    fixed, per_sample = CAPPED_SYNTHETIC_BYTES
    return min(SYNTHETIC_BYTES_PER_CLIENT, fixed + per_sample * section.samples_per_client)


def _feddyn_synthetic(section: FedDynSyntheticData, seed: int, path: Path | None) -> Any:
    from driftlab.data.synthetic_types import feddyn_synthetic

    return feddyn_synthetic(
        section.feddyn_kind,
        num_clients=section.num_clients,
        heterogeneity=section.feddyn_heterogeneity,
        seed=seed,
        test_fraction=0.2,
    )


def _quadratic1d(section: Quadratic1dData, seed: int, path: Path | None) -> Any:
    from driftlab.data.quadratic import scalar_quadratic_clients

    return scalar_quadratic_clients(section.num_clients)


def _quadratic(section: QuadraticData, seed: int, path: Path | None) -> Any:
    from driftlab.data.quadratic import random_quadratic_clients

    return random_quadratic_clients(
        section.num_clients, section.quadratic_dimension, seed, section.quadratic_heterogeneity
    )


# ---------------------------------------------------------------- pooled images, dealt out by data.partition


class _CifarSection(DataSection):
    """A CIFAR data set, read whole or only the first images of every class (a quick run on a slice of the data)."""

    limit_per_class: int | None = Field(None, ge=1, description="read at most this many images per class and split")


MnistData = named_section("MnistData", "mnist", __name__)
FashionMnistData = named_section("FashionMnistData", "fashion_mnist", __name__)
EmnistLetters10Data = named_section("EmnistLetters10Data", "emnist_letters10", __name__)
EmnistLettersData = named_section("EmnistLettersData", "emnist_letters", __name__)
EmnistByclassData = named_section("EmnistByclassData", "emnist_byclass", __name__)
Cifar10Data = named_section("Cifar10Data", "cifar10", __name__, _CifarSection)
Cifar100Data = named_section("Cifar100Data", "cifar100", __name__, _CifarSection)
Cifar10FolderData = named_section("Cifar10FolderData", "cifar10_folder", __name__, _CifarSection)
Cifar100PfllibData = named_section("Cifar100PfllibData", "cifar100_pfllib", __name__)


def _mnist(section: MnistData, seed: int, path: Path) -> Any:
    from driftlab.data.idx import load_mnist_pixels

    return load_mnist_pixels(path)


def _fashion_mnist(section: FashionMnistData, seed: int, path: Path) -> Any:
    from driftlab.data.images import load_fashion_mnist_pixels

    return load_fashion_mnist_pixels(path)


def _emnist(split: str) -> Any:
    def load(section: DataSection, seed: int, path: Path) -> Any:
        from driftlab.data.images import load_emnist_pixels

        return load_emnist_pixels(path, split)

    return load


def _cifar(num_classes: int) -> Any:
    def load(section: _CifarSection, seed: int, path: Path) -> Any:
        from driftlab.data.images import load_cifar_pixels

        return load_cifar_pixels(path, num_classes, limit_per_class=section.limit_per_class)

    return load


def _cifar10_folder(section: Cifar10FolderData, seed: int, path: Path) -> Any:
    from driftlab.data.image_folders import load_cifar10_image_folder_pixels

    train_x, train_y, test_x, test_y, _classes, normalisation = load_cifar10_image_folder_pixels(
        path, limit_per_class=section.limit_per_class
    )
    return train_x, train_y, test_x, test_y, normalisation


# ---------------------------------------------------------------- data sets with clients of their own


class FemnistData(DataSection):
    name: Literal["femnist"] = "femnist"
    max_clients: int | None = Field(None, ge=1, description=_MAX_CLIENTS)


class ShakespeareData(DataSection):
    name: Literal["shakespeare"] = "shakespeare"
    max_clients: int | None = Field(None, ge=1, description=f"{_MAX_CLIENTS} (largest first)")
    samples_per_client: int | None = Field(None, ge=1, description="windows per role, e.g. 2000 for FedDyn's split")
    min_samples_per_client: int = Field(0, ge=0, description="drop roles with fewer windows")


class ShakespeareLeafData(DataSection):
    name: Literal["shakespeare_leaf"] = "shakespeare_leaf"
    max_clients: int | None = Field(None, ge=1, description=_MAX_CLIENTS)


class _ChosenUsers(DataSection):
    """Users as clients, of which ``data.max_clients`` keeps the files' first or a seeded random choice."""

    max_clients: int | None = Field(None, ge=1, description=_MAX_CLIENTS)
    client_choice: Literal["first", "random"] | None = Field(
        None,
        description='which users data.max_clients keeps: "first" (the default: the first in the files) or "random" '
        "(drawn from the data seed, kept in file order)",
    )

    _first_is_unset = default_is_unset("client_choice", "first")

    @model_validator(mode="after")
    def _random_needs_a_count(self) -> "_ChosenUsers":
        if self.client_choice == "random" and self.max_clients is None:
            raise ValueError(
                'data.client_choice = "random" draws data.max_clients users, and data.max_clients is unset (every user '
                "is kept); set data.max_clients, or leave data.client_choice unset"
            )
        return self

    def client_rng(self, seed: int) -> Any:
        """The generator of the random choice (``Stream.CLIENT_SUBSET``), or None to keep the first users."""
        from driftlab.randomness import Stream, generator

        return generator(seed, Stream.CLIENT_SUBSET) if self.client_choice == "random" else None


class StackOverflowData(_ChosenUsers):
    name: Literal["stackoverflow"] = "stackoverflow"
    samples_per_client: int | None = Field(None, ge=1, description="at most this many examples per user")
    vocabulary_size: int = Field(10_000, ge=3, description="bag-of-words size")
    tag_count: int = Field(500, ge=1, description="the most frequent tags predicted")


class Sent140Data(_ChosenUsers):
    name: Literal["sent140"] = "sent140"
    vocabulary_size: int = Field(10_000, ge=3, description="tokens in the vocabulary, PAD and UNK included")


def _cifar100_pfllib(section: Cifar100PfllibData, seed: int, path: Path) -> Any:
    from driftlab.data.cifar100_pfllib import load_cifar100_pfllib

    return load_cifar100_pfllib(path)


def _femnist(section: FemnistData, seed: int, path: Path) -> Any:
    from driftlab.data.leaf import load_leaf_femnist

    return load_leaf_femnist(path, max_clients=section.max_clients)


def _leaf_shakespeare(section: ShakespeareLeafData, seed: int, path: Path) -> Any:
    from driftlab.data.leaf import load_leaf_shakespeare

    return load_leaf_shakespeare(path, max_clients=section.max_clients)


def _sent140(section: Sent140Data, seed: int, path: Path) -> Any:
    from driftlab.data.leaf import load_leaf_sent140

    return load_leaf_sent140(
        path,
        vocabulary_size=section.vocabulary_size,
        max_clients=section.max_clients,
        client_rng=section.client_rng(seed),
    )


def _shakespeare(section: ShakespeareData, seed: int, path: Path) -> Any:
    from driftlab.data.shakespeare import load_shakespeare_text

    if path.is_dir():  # the directory `driftlab data download shakespeare --to DIR` writes to
        candidates = [path / name for name in ("input.txt", "input.txt.gz") if (path / name).is_file()]
        if not candidates:
            raise DataFileError(
                f"shakespeare: {path} holds neither input.txt nor input.txt.gz; set data.root to the text file"
            )
        path = candidates[0]
    return load_shakespeare_text(
        path,
        min_samples_per_client=section.min_samples_per_client,
        max_clients=section.max_clients,
        samples_per_client=section.samples_per_client,
        test_fraction=section.client_test_fraction or 0.2,
        seed=seed,
    )


def _stackoverflow(section: StackOverflowData, seed: int, path: Path) -> Any:
    from driftlab.data.stackoverflow import load_stackoverflow

    return load_stackoverflow(
        path,
        vocabulary_size=section.vocabulary_size,
        tag_count=section.tag_count,
        max_clients=section.max_clients,
        max_samples_per_client=section.samples_per_client,
        client_rng=section.client_rng(seed),
    )


# ---------------------------------------------------------------- your own data


class CustomData(DataSection):
    name: Literal["custom"] = "custom"
    loader: str | None = Field(
        None,
        min_length=1,
        description='"module:function" or "path/to/file.py:function" (relative to the config file) of a function '
        "returning driftlab.FederatedArrays; imported in every process (run, sweep, resume), so your data needs no "
        "driftlab.run(data=...)",
    )
    digest: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 of your data, recorded by the run; a run or resume given other data stops with an error",
    )

    @model_validator(mode="after")
    def _own_clients(self) -> "CustomData":
        # data.partition deals out examples given without client ids; data that brings ids is refused a partition
        # when it is loaded (experiments.run.datasets.own_clients): only the data says whether it has them.
        if self.loader is not None:
            check_function_reference(self.loader)
        return self


def _custom(section: CustomData, seed: int, path: Path | None) -> Any:
    """The user's data, from the function ``data.loader`` names (``driftlab.run(data=...)`` passes it directly instead)."""
    if not section.loader:
        raise ConfigError(
            'data.name = "custom" is your own data, and this run was given none: pass it to driftlab.run(config, data=...) '
            '(the same data again to resume), or set data.loader = "module:function" (or "path/to/file.py:function") '
            "naming a function that returns driftlab.FederatedArrays, so that sweeps, `driftlab run` and resumes load it"
        )
    from driftlab.plugins import import_function

    load = import_function(section.loader, "data.loader")
    origin = f"data.loader {section.loader!r}"
    try:
        arrays = load()
    except ConfigError:
        raise
    except Exception as error:  # the user's function failed: say so, with its own message
        raise ConfigError(f"{origin} failed: {type(error).__name__}: {error}") from error
    return federated_dataset_from_arrays(arrays, origin, "custom")


def _download(name: str) -> Download:
    return Download(name, DOWNLOADS[name])


def register_built_ins() -> None:
    """Register driftlab's data sets, in the order `driftlab data list` shows them (called once by ``driftlab.data``)."""
    generated = dict(natural_clients=True)
    register(
        DataSetEntry(
            "synthetic",
            SyntheticData,
            _synthetic,
            "FedProx synthetic(α,β): 60 features, 10 classes, one client per device",
            size_estimate=_synthetic_bytes,
            **generated,
        )
    )
    register(
        DataSetEntry(
            "synthetic_iid",
            SyntheticIidData,
            _synthetic_iid,
            "FedProx's IID synthetic data",
            size_estimate=_synthetic_bytes,
            **generated,
        )
    )
    register(
        DataSetEntry(
            "feddyn_synthetic",
            FedDynSyntheticData,
            _feddyn_synthetic,
            "FedDyn's synthetic heterogeneity types 0-3 (data.feddyn_kind): 30 features, 5 classes",
            size_estimate=lambda section: FEDDYN_SYNTHETIC_BYTES_PER_CLIENT,
            **generated,
        )
    )
    register(
        DataSetEntry(
            "quadratic1d",
            Quadratic1dData,
            _quadratic1d,
            "decaying-K paper's clients ½ z x² − x (model.name=quadratic)",
            size_estimate=lambda section: QUADRATIC1D_BYTES_PER_CLIENT,
            **generated,
        )
    )
    register(
        DataSetEntry(
            "quadratic",
            QuadraticData,
            _quadratic,
            "heterogeneous diagonal quadratics with a known minimiser (model.name=quadratic)",
            size_estimate=lambda section: QUADRATIC_BYTES_PER_CLIENT_AND_DIMENSION * section.quadratic_dimension,
            **generated,
        )
    )
    images = [
        ("mnist", MnistData, _mnist, "MNIST, official IDX files (gzipped or not)", "mnist", 10, "mnist"),
        (
            "fashion_mnist",
            FashionMnistData,
            _fashion_mnist,
            "Fashion-MNIST, official IDX files",
            "fashion-mnist",
            10,
            "fashion_mnist",
        ),
        (
            "emnist_letters10",
            EmnistLetters10Data,
            _emnist("letters10"),
            "EMNIST-L: the first 10 letters of EMNIST letters (FedDyn, AdaBest)",
            "emnist",
            10,
            "emnist",
        ),
        (
            "emnist_letters",
            EmnistLettersData,
            _emnist("letters"),
            "EMNIST letters, 26 classes, official gzip bundle",
            "emnist",
            26,
            "emnist",
        ),
        (
            "emnist_byclass",
            EmnistByclassData,
            _emnist("byclass"),
            "EMNIST byclass, 62 classes, official gzip bundle",
            "emnist",
            62,
            "emnist",
        ),
        (
            "cifar10",
            Cifar10Data,
            _cifar(10),
            "CIFAR-10, official binary version (folder or tarball)",
            "cifar10",
            10,
            "cifar10",
        ),
        (
            "cifar100",
            Cifar100Data,
            _cifar(100),
            "CIFAR-100 (fine labels), official binary version",
            "cifar100",
            100,
            "cifar100",
        ),
        (
            "cifar10_folder",
            Cifar10FolderData,
            _cifar10_folder,
            "CIFAR-10 as <split>/<class>/<image> files, a folder or a .tar.gz",
            "cifar10-jpeg/cifar10-jpeg.tar.gz",
            10,
            None,
        ),
    ]
    for name, config_type, load, description, location, classes, download in images:
        register(
            DataSetEntry(
                name,
                config_type,
                load,
                description,
                location=location,
                num_classes=classes,
                download=_download(download) if download else None,
            )
        )
    register(
        DataSetEntry(
            "cifar100_pfllib",
            Cifar100PfllibData,
            _cifar100_pfllib,
            "CIFAR-100 pooled by PFLlib: all 60,000 images over 100 Dirichlet clients, each split 75/25 (a tar.xz of "
            "cifar100_60k.npz)",
            location="cifar100-pfllib/cifar100-pfllib.tar.xz",
            natural_clients=True,
            num_classes=100,
        )
    )
    register(
        DataSetEntry(
            "femnist",
            FemnistData,
            _femnist,
            "LEAF FEMNIST JSON (folder or tar.gz), one client per writer",
            location="femnist-leaf-subset/femnist-leaf-subset.tar.gz",
            natural_clients=True,
        )
    )
    register(
        DataSetEntry(
            "shakespeare",
            ShakespeareData,
            _shakespeare,
            "Shakespeare raw text with speaker labels, one client per role, next character after 80",
            location="tinyshakespeare/input.txt.gz",
            natural_clients=True,
            tests_from_fraction=True,
            download=_download("shakespeare"),
            vocabulary=lambda section: LEAF_CHARACTERS,
        )
    )
    register(
        DataSetEntry(
            "shakespeare_leaf",
            ShakespeareLeafData,
            _leaf_shakespeare,
            "LEAF Shakespeare JSON, one client per role",
            location="shakespeare-leaf",
            natural_clients=True,
            vocabulary=lambda section: LEAF_CHARACTERS,
        )
    )
    register(
        DataSetEntry(
            "stackoverflow",
            StackOverflowData,
            _stackoverflow,
            "TFF StackOverflow tag prediction (h5 or sqlite): bag of words → multi-label tags, one client per user (model.name=mlr)",
            location="stackoverflow",
            natural_clients=True,
            download=_download("stackoverflow"),
        )
    )
    register(
        DataSetEntry(
            "sent140",
            Sent140Data,
            _sent140,
            "LEAF Sent140 JSON, one client per user, 25 tokens",
            location="sent140-leaf",
            natural_clients=True,
            vocabulary=lambda section: section.vocabulary_size,
        )
    )
    register(
        DataSetEntry(
            "custom",
            CustomData,
            _custom,
            'your own data: driftlab.run(config, data=driftlab.FederatedArrays(...)), or data.loader = "module:function" '
            "returning one; your client ids are the clients, or data.partition deals out examples given without ids",
            natural_clients=True,
        )
    )
