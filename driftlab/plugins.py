"""Plugins: one registry type for every extension point, and the importing of what a config names.

driftlab is open at five points, each a ``Registry`` of frozen entries held by the
package of its kind:

=====================  ==================================  ==============================
kind                   registry                            entry-point group
=====================  ==================================  ==============================
algorithm              ``driftlab.algorithms.registry``    ``driftlab.algorithms``
model                  ``driftlab.models.registry``        ``driftlab.models``
data set               ``driftlab.data.registry``          ``driftlab.datasets``
server optimizer       ``driftlab.optim.registry``         ``driftlab.server_optimizers``
executor               ``driftlab.executors.registry``     ``driftlab.executors``
=====================  ==================================  ==============================

A server optimizer may also be a chain of transformations stated in ``[server]``; the transformations are a
sixth registry (``driftlab.optim.registry.TRANSFORMATIONS``, group ``driftlab.server_transformations``).

The built-ins register through the same ``register`` a plugin calls, from their
package's ``__init__``; ``finish_built_ins`` then marks which names are driftlab's own.
A plugin is a module (or a ``.py`` file) that registers entries when imported; one
file may register entries of several kinds.  A config names it under ``plugins``
(``load_plugins`` imports it in every process that reads the config: ``driftlab run``,
each sweep run's interpreter, a resume, ``driftlab report``) and ``config.json``
records it; an installed package declares it in the kind's entry-point group instead.

Also here, because every kind needs them: ``import_function`` for the
``"module:function"`` references of a config (``data.loader``, ``model.loss``), the
import of a file under a name of its own (``import_file``), and ``did_you_mean``.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import re
import sys
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Generic, Sequence, TypeVar

from driftlab.errors import ConfigError

NAME = re.compile(r"[a-z][a-z0-9_]*")
Entry = TypeVar("Entry")
REGISTRIES: list[Registry] = []  # every registry made, each kind's (what the tests restore after each test)


def check_entry_name(kind: str, name: Any) -> None:
    """Refuse a name a config could not state: one word of lower-case letters, digits and _.

    Every entry type asks this first in its ``__post_init__``, so a bad entry fails where it is made."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        article = "an" if kind[:1] in ("a", "e", "i", "o", "u") else "a"
        raise ValueError(
            f"{article} {kind}'s name is lower-case letters, digits and _, starting with a letter; got {name!r}"
        )


def check_config_type(kind: str, name: str, config_type: Any, base: type, base_name: str, tag: str = "name") -> None:
    """Refuse a config type that cannot stand in its kind's tagged union (``[algorithm]``, ``[model]``, ...).

    It must subclass ``base`` (``base_name``: how the message names it, and why) and its ``tag`` field must
    default to the entry's name: the tag's value is how the union picks the config type of a section."""
    if not (isinstance(config_type, type) and issubclass(config_type, base)):
        raise ValueError(f"{kind} {name!r}: config_type must subclass {base_name}")
    field = config_type.model_fields.get(tag)
    if field is None or field.default != name:
        raise ValueError(f'{kind} {name!r}: config_type must have a field `{tag}: Literal["{name}"] = "{name}"`')


class Registry(Generic[Entry]):
    """The entries of one kind, by name, in registration order (the built-ins first, then plugins).

    ``defining`` returns the function or class that defines an entry (``from_config`` of an algorithm,
    ``build`` of a model): its module and source file say where the entry comes from, which makes one
    plugin file imported twice (by its module name and by its path) register the same entry, not a clash.
    """

    def __init__(self, kind: str, group: str, entry_type: type, defining: Callable[[Any], Any]) -> None:
        self.kind = kind
        self.group = group
        self.entry_type = entry_type
        self.defining = defining
        self.entries: dict[str, Entry] = {}
        self.built_in: tuple[str, ...] = ()
        self._entry_point_problems: list[str] | None = None  # None: entry points not read yet in this process
        REGISTRIES.append(self)

    def register(self, entry: Entry) -> Entry:
        """Add ``entry`` (what a plugin module calls at import); returns it.

        Registering the same entry again (a module imported twice) does nothing; another entry under a name
        already taken is a ValueError naming both.
        """
        if not isinstance(entry, self.entry_type):
            raise TypeError(f"register() takes a {self.entry_type.__name__}, got {type(entry).__name__}")
        name = entry.name  # type: ignore[attr-defined]
        check_entry_name(self.kind, name)
        existing = self.entries.get(name)
        if existing is not None and existing != entry and not self._same_definition(existing, entry):
            where = (
                f"a built-in {self.kind}" if name in self.built_in else f"already registered by {self.module(existing)}"
            )
            raise ValueError(
                f"{self.kind} name {name!r} is {where}; give the {self.kind} in {self.module(entry)} another name"
            )
        self.entries[name] = entry
        return entry

    def finish_built_ins(self) -> None:
        """Mark every entry registered so far as driftlab's own (called once by the kind's package)."""
        self.built_in = tuple(self.entries)

    def module(self, entry: Entry) -> str:
        """The module that defines ``entry``."""
        return getattr(self.defining(entry), "__module__", None) or "unknown module"

    def source(self, entry: Entry) -> str:
        """The source file that defines ``entry`` (resolved), else its module's name."""
        code = getattr(self.defining(entry), "__code__", None)
        if code is None:  # a class: the file of its module
            module = sys.modules.get(self.module(entry))
            path = getattr(module, "__file__", None)
            return str(Path(path).resolve()) if path else self.module(entry)
        return str(Path(code.co_filename).resolve())

    def _same_definition(self, first: Entry, second: Entry) -> bool:
        names = (
            getattr(self.defining(first), "__qualname__", None),
            getattr(self.defining(second), "__qualname__", None),
        )
        return self.source(first) == self.source(second) and names[0] == names[1]

    def is_plugin(self, entry: Entry) -> bool:
        """Whether ``entry`` comes from a plugin (a config's ``plugins``, an entry point, a script), not driftlab."""
        return entry.name not in self.built_in  # type: ignore[attr-defined]  # register() lets nothing take a built-in's name

    def describe(self, entry: Entry) -> str:
        """How messages name a plugin's entry: ``model plugin 'tiny_cnn' (/path/tiny_cnn.py)``."""
        return f"{self.kind} plugin {entry.name!r} ({self.source(entry)})"  # type: ignore[attr-defined]

    def lookup(self, name: str) -> Entry | None:
        """The entry registered under ``name``, reading the installed entry points once when it is not (yet) known."""
        if name not in self.entries:
            self.load_entry_points()
        return self.entries.get(name)

    def names(self) -> list[str]:
        """Every name a config can give now: built-ins, installed entry points and plugins imported so far."""
        self.load_entry_points()
        return list(self.entries)

    def plugin_source(self, entry: Entry) -> str | None:
        """What a config's ``plugins`` must name for another process to register ``entry`` (``module_source``);
        None for a built-in, or an entry defined in a script (``__main__``) or a module that cannot be imported."""
        if not self.is_plugin(entry):
            return None
        return module_source(self.module(entry))

    def load_entry_points(self) -> list[str]:
        """Import the installed entry points of this kind's group (once per process); the problems met.

        An entry point names a module that registers its entries when imported, or an entry, which is
        registered.  One that fails does not stop runs that do not need it; its problem is returned (and
        named by ``unknown_message`` when a config asks for a name that is not found).
        """
        if self._entry_point_problems is not None:
            return self._entry_point_problems
        self._entry_point_problems = []
        for point in metadata.entry_points(group=self.group):
            try:
                loaded = point.load()
                if isinstance(loaded, self.entry_type):
                    self.register(loaded)
            except Exception as error:  # noqa: BLE001 - any failure of someone else's package is reported, not raised here
                package = point.dist.name if point.dist else "unknown package"
                self._entry_point_problems.append(
                    f"entry point {point.name} = {point.value!r} ({package}): {one_line(error)}"
                )
        return self._entry_point_problems

    def unknown_message(self, name: Any, key: str) -> str:
        """What to say about a ``key`` (e.g. ``model.name``) that names no registered entry, and how to make it one."""
        known = self.names()
        guess = did_you_mean(name, known) if isinstance(name, str) else None
        shown = repr(name) if len(repr(name)) <= 80 else f"{repr(name)[:77]}... ({len(repr(name))} characters)"
        message = (
            f"{key}: unknown {self.kind} {shown}{f' (did you mean {guess!r}?)' if guess else ''}; "
            f"valid: {', '.join(known)}. {'An' if self.kind[0] in 'aeiou' else 'A'} {self.kind} of your own is registered by a plugin named at the top of the "
            'config: plugins = ["my_plugin.py"] (docs/design.md, "Writing a plugin")'
        )
        problems = self.load_entry_points()
        if problems:
            message += "; installed plugins that failed to load: " + "; ".join(problems)
        return message


# ---------------------------------------------------------------- importing what a config names

_loaded_paths: dict[str, str] = {}  # resolved .py path -> the module name it was imported as


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
                    '(plugins = ["path/to/module.py"], relative to the config file)'
                )
            raise ConfigError(
                f"plugins: cannot import plugin {plugin!r}: {one_line(error)}{_raised_at(error)}; {how}"
            ) from None


def _raised_at(error: BaseException) -> str:
    """`` (raised at FILE, line N)``: the innermost frame of the traceback outside importlib, when it is not driftlab's."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "importlib" not in frame.filename]
    if not frames or Path(frames[-1].filename).resolve().is_relative_to(Path(__file__).resolve().parent):
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


def module_source(module: str) -> str | None:
    """What a config's ``plugins`` names for another process to import ``module``: the path of the .py file it was
    loaded from (``import_file``), or its name when it can be imported by name; None for a script (``__main__``)."""
    for path, module_name in _loaded_paths.items():
        if module_name == module:
            return path
    if module == "__main__":
        return None
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    return module if found is not None else None


def import_function(reference: str, key: str) -> Any:
    """The function a ``"module:function"`` or ``"path/to/file.py:function"`` reference names; a ConfigError naming ``key``
    when it cannot be imported or is not a function.  A module name is looked up on sys.path, then in the working directory."""
    source, _, name = reference.rpartition(":")
    try:
        if is_path(source):
            module = import_file(Path(source))
        else:
            try:
                module = importlib.import_module(source)
            except ModuleNotFoundError as error:
                if error.name != source.split(".")[0] or str(Path.cwd()) in sys.path:
                    raise
                sys.path.insert(0, str(Path.cwd()))  # as `python -m` would have it: a module beside the user
                module = importlib.import_module(source)
    except Exception as error:  # noqa: BLE001 - the user's module failed, whatever the reason: one clear message
        where = (
            "a relative path is taken from the config file's folder, else from the working directory"
            if is_path(source)
            else 'the module must be importable from the working directory or an installed package; or name its file: "path/to/file.py:function"'
        )
        raise ConfigError(f"{key} = {reference!r}: cannot import {source!r}: {one_line(error)}; {where}") from None
    function = getattr(module, name, None)
    if function is None and source == "__main__":
        raise ConfigError(
            f"{key} = {reference!r} was defined in a script, which this process cannot import: pass it again from that script "
            f"(driftlab.run(..., {'loss=' if key == 'model.loss' else 'data='}...)), or move it into a module and name that, "
            f'e.g. {key} = "my_module.py:{name}"'
        )
    if not callable(function):
        found = "has no" if function is None else f"has a {type(function).__name__}, not a"
        raise ConfigError(
            f"{key} = {reference!r}: {source!r} {found} function {name!r}; name a function defined in that module"
        )
    return function


# ---------------------------------------------------------------- messages

# Names people carry over from other libraries, for a key with the same meaning here ("did you mean").
KEY_ALIASES = {
    "learning_rate": "lr",
    "step_size": "lr",
    "local_lr": "lr",
    "batch": "batch_size",
    "bs": "batch_size",
    "local_epochs": "epochs",
    "num_epochs": "epochs",
    "local_steps": "steps",
    "num_steps": "steps",
    "num_rounds": "rounds",
    "communication_rounds": "rounds",
    "clients": "num_clients",
    "n_clients": "num_clients",
    "fraction": "participation",
    "participation_rate": "participation",
    "dataset": "name",
    "alpha": "dirichlet_alpha",
}


def did_you_mean(name: str, choices: list[str]) -> str | None:
    """The choice ``name`` was most likely meant to be (a known alias, else the closest spelling), or None."""
    alias = KEY_ALIASES.get(name)
    if alias in choices:
        return alias
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(name.lower(), [choice.lower() for choice in choices], n=1, cutoff=0.6)
        close = [choice for choice in choices if choice.lower() in close]
    return close[0] if close else None


def one_line(error: BaseException) -> str:
    """``ErrorType: first line of the message``, at most 300 characters."""
    text = (str(error).strip().splitlines() or [""])[0]
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."
