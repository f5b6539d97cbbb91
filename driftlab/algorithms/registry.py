"""The algorithm registry: one entry per algorithm, holding every fact the rest of driftlab needs about it.

An entry names the algorithm's config type (its ``[algorithm]`` section), the
function that builds it, how reports and sweeps label it, and three facts the
runner, the config validation and the shared tests read instead of keeping
their own lists::

    AlgorithmEntry(
        name="fedavg",                     # algorithm.name in configs
        config_type=fedavg.Config,          # a pydantic model whose `name` field defaults to "fedavg"
        from_config=fedavg.from_config,     # (config, server_optimizer) -> seam.Algorithm
        label="FedAvg",                     # rows of reports, method labels of sweeps
        keeps_partial_work=False,           # a straggler's partial work is dropped (by default)
    )

The built-in algorithms are registered by ``driftlab.algorithms``.  An algorithm
of your own registers itself the same way from a plugin module, with one call
at import::

    from driftlab.algorithms import AlgorithmEntry, register
    register(AlgorithmEntry("nesterov_avg", Config, from_config, label="Nesterov FedAvg"))

and a config names the module under ``plugins`` (a module name, or the path of
a ``.py`` file relative to the config file or the working directory), or an
installed package declares it in the entry-point group ``driftlab.algorithms``.
Plugins are imported before a config is validated, in every process that
reads one (``driftlab run``, ``driftlab.run``, each sweep run's interpreter, a
resume, ``driftlab report``), and ``config.json`` records them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
import traceback
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

from driftlab.errors import ConfigError

ENTRY_POINT_GROUP = "driftlab.algorithms"
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class AlgorithmEntry:
    """Everything driftlab needs to know about one algorithm besides its code.

    ``config_type`` is a pydantic model with a ``name`` field whose default is
    ``name`` (the other fields are the algorithm's hyperparameters);
    ``from_config(config, server_optimizer)`` returns the
    ``driftlab.simulation.seam.Algorithm``.  ``owns_server_step``: the
    algorithm's server update is its own, so ``server.optimizer`` must stay
    ``sgd``.  ``uses_server_lr``: False when that own step has no rate, so
    ``server.lr`` must stay 1 (config validation checks both).  ``keeps_partial_work``: with its default hyperparameters, a
    straggler's partial work is aggregated (True) or dropped (False).
    ``default_compression_ratio`` is used when ``compression.ratio`` is unset.
    """

    name: str
    config_type: type
    from_config: Callable[[Any, Any], Any]
    label: str
    default_compression_ratio: float = 1.0
    owns_server_step: bool = False
    uses_server_lr: bool = True
    keeps_partial_work: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"an algorithm's name is lower-case letters, digits and _, starting with a letter; got {self.name!r}")
        fields = getattr(self.config_type, "model_fields", None)
        if fields is None or "name" not in fields or fields["name"].default != self.name:
            raise ValueError(
                f"algorithm {self.name!r}: config_type must be a pydantic model with a field "
                f'`name: Literal["{self.name}"] = "{self.name}"`'
            )
        if not callable(self.from_config):
            raise ValueError(f"algorithm {self.name!r}: from_config must be a function (config, server_optimizer) -> Algorithm")
        if not isinstance(self.label, str) or not self.label.strip():
            raise ValueError(f"algorithm {self.name!r}: label must be a non-empty string (how reports name it)")
        if not 0 < self.default_compression_ratio <= 1:
            raise ValueError(f"algorithm {self.name!r}: default_compression_ratio must be in (0, 1], got {self.default_compression_ratio!r}")

    @property
    def module(self) -> str:
        """The module that defines the algorithm."""
        return self.from_config.__module__


ALGORITHMS: dict[str, AlgorithmEntry] = {}  # in registration order: the built-ins (papers' order), then plugins
BUILT_IN: tuple[str, ...] = ()  # set by driftlab.algorithms once the built-ins are registered


def register(entry: AlgorithmEntry) -> AlgorithmEntry:
    """Add ``entry`` to the registry (what a plugin module calls at import); returns it.

    Registering the same entry again (a module imported twice) does nothing; another
    algorithm under a name already taken is an error.
    """
    if not isinstance(entry, AlgorithmEntry):
        raise TypeError(f"register() takes an AlgorithmEntry, got {type(entry).__name__}")
    existing = ALGORITHMS.get(entry.name)
    if existing is not None and existing != entry and not _same_definition(existing, entry):
        where = "a built-in algorithm" if entry.name in BUILT_IN else f"already registered by {existing.module}"
        raise ValueError(f"algorithm name {entry.name!r} is {where}; give the algorithm in {entry.module} another name")
    ALGORITHMS[entry.name] = entry
    return entry


def _same_definition(first: AlgorithmEntry, second: AlgorithmEntry) -> bool:
    # One plugin file imported twice (as a module and by its path, or by a doctest run) defines equal entries
    # with distinct function objects and module names: the same source file and function make them the same.
    return (_source_of(first), first.from_config.__qualname__, first.label) == (_source_of(second), second.from_config.__qualname__, second.label)


def _source_of(entry: AlgorithmEntry) -> str:
    code = getattr(entry.from_config, "__code__", None)
    return str(Path(code.co_filename).resolve()) if code is not None else entry.module


def is_plugin(entry: AlgorithmEntry) -> bool:
    """Whether ``entry`` comes from a plugin (a config's ``plugins``, an entry point, a script), not driftlab itself."""
    return entry.name not in BUILT_IN  # register() lets nothing else take a built-in's name


def describe_plugin(entry: AlgorithmEntry) -> str:
    """How messages name a plugin's algorithm: ``algorithm plugin 'moon' (/path/moon.py)`` (its source file, else its module)."""
    return f"algorithm plugin {entry.name!r} ({_source_of(entry)})"


def lookup(name: str) -> AlgorithmEntry | None:
    """The entry registered under ``name``, looking in installed entry points once when it is not (yet) known."""
    if name not in ALGORITHMS:
        load_entry_points()
    return ALGORITHMS.get(name)


def names() -> list[str]:
    """Every algorithm a config can name now: the built-ins, installed entry points and plugins imported so far."""
    load_entry_points()
    return list(ALGORITHMS)


def label(name: str) -> str:
    """How reports and sweeps name the algorithm (its own name when it is not registered)."""
    entry = ALGORITHMS.get(name)
    return entry.label if entry is not None else name


# ---------------------------------------------------------------- plugins

_entry_point_problems: list[str] | None = None  # None: entry points not read yet in this process
_loaded_paths: dict[str, str] = {}  # resolved .py path -> the module name it was imported as


def load_entry_points() -> list[str]:
    """Import the installed entry points of group ``driftlab.algorithms`` (once per process).

    An entry point names a module that registers its algorithms when imported, or an
    ``AlgorithmEntry``, which is registered.  One that fails to load does not stop
    runs of other algorithms; the problems are returned (and named when a config asks
    for an algorithm that is not found).
    """
    global _entry_point_problems
    if _entry_point_problems is not None:
        return _entry_point_problems
    _entry_point_problems = []
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = point.load()
            if isinstance(loaded, AlgorithmEntry):
                register(loaded)
        except Exception as error:  # noqa: BLE001 - any failure of someone else's package is reported, not raised here
            _entry_point_problems.append(f"entry point {point.name} = {point.value!r} ({point.dist.name if point.dist else 'unknown package'}): {one_line(error)}")
    return _entry_point_problems


def is_path(plugin: str) -> bool:
    """Whether a ``plugins`` entry is the path of a .py file rather than a module name."""
    return plugin.endswith(".py") or "/" in plugin or "\\" in plugin


def resolve_plugin(plugin: str, folder: Path | None = None) -> str:
    """A ``plugins`` entry as a config records it: module names as they are; a path absolute, taken relative
    to ``folder`` (the config or sweep file's), or to the working directory when the file is there and not in ``folder``."""
    if not is_path(plugin) or Path(plugin).is_absolute():
        return plugin
    if folder is not None and ((folder / plugin).is_file() or not Path(plugin).is_file()):
        return str((folder / plugin).resolve())  # where it is, or where it was looked for first (for the message)
    return str(Path(plugin).resolve())


def load_plugins(plugins: Sequence[str]) -> None:
    """Import each plugin (a module name or the path of a .py file); a ConfigError naming the one that fails."""
    for plugin in plugins:
        try:
            if is_path(plugin):
                import_file(Path(plugin))
            else:
                importlib.import_module(plugin)
        except (Exception, KeyboardInterrupt, SystemExit) as error:  # noqa: BLE001 - a plugin's own failure becomes one clear message
            # KeyboardInterrupt and SystemExit too: raised by a plugin's import, they would read as a run interrupted
            # (or ended) after its checkpoint, though nothing ran.
            if is_path(plugin):
                how = (
                    "check the path (a relative path is taken from the folder of the config or sweep file that names it, "
                    f"else from the working directory) and that `python {plugin}` runs"
                )
            else:
                how = (
                    "install the package that provides it, or name its .py file instead "
                    "(plugins = [\"path/to/module.py\"], relative to the config file)"
                )
            raise ConfigError(f"plugins: cannot import plugin {plugin!r}: {one_line(error)}{_raised_at(error)}; {how}") from None


def _raised_at(error: BaseException) -> str:
    """`` (raised at FILE, line N)``: the innermost frame of the traceback outside importlib, when it is not driftlab's."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "importlib" not in frame.filename]
    if not frames or Path(frames[-1].filename).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
        return ""
    return f" (raised at {Path(frames[-1].filename).resolve()}, line {frames[-1].lineno})"


def import_file(path: Path) -> Any:
    """The module of a ``.py`` file, imported once per file under a name of its own (plugins, data loaders, losses)."""
    resolved = str(path.resolve())
    if resolved in _loaded_paths:
        return sys.modules[_loaded_paths[resolved]]
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {resolved}")
    # A name of its own per file, so two plugins called plugin.py do not replace each other.
    module_name = f"driftlab_plugin_{re.sub(r'[^0-9a-zA-Z_]', '_', path.stem)}_{hashlib.sha256(resolved.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"{resolved} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it: dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    _loaded_paths[resolved] = module_name
    return module


def plugin_source(entry: AlgorithmEntry) -> str | None:
    """What a config's ``plugins`` must name for another process to register ``entry``: the path of the
    .py file it was loaded from, or its module's name; None when it was defined in a script (``__main__``)
    or another module that cannot be imported by name."""
    for path, module_name in _loaded_paths.items():
        if module_name == entry.module:
            return path
    if entry.module == "__main__" or entry.name in BUILT_IN:
        return None
    try:
        found = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        found = None
    return entry.module if found is not None else None


def one_line(error: BaseException) -> str:
    """``ErrorType: first line of the message``, at most 300 characters."""
    text = (str(error).strip().splitlines() or [""])[0]
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."
