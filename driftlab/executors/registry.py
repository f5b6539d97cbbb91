"""The executor registry: one entry per place a sweep's runs can execute, holding every fact about it.

An entry names the executor's own options (a frozen dataclass with a default for every
field), the function that runs the tasks, the check that refuses impossible options
before anything is planned or written, and how its options appear on the command line::

    ExecutorEntry(
        name="local",                          # --executor local
        options_type=LocalOptions,              # its options: jobs
        execute=local.execute,                  # (tasks, options, events) -> list[TaskResult]
        check=local.check,                      # (options) -> None, or a ConfigError saying what to change
        cli_options=(CliOption("--jobs", "jobs", int, "parallel processes ..."),),
        description="processes on this machine",
        layout=local.layout,                    # (options, pending runs) -> threads per run and how the log says it
    )

The built-ins (local, slurm, ray) are registered by ``driftlab.executors``. An executor of
your own registers itself the same way from a plugin module, with one call at import
(``register(ExecutorEntry(...))``); a sweep file (or its base config) names the module under
``plugins``, or an installed package declares it in the entry-point group ``driftlab.executors``.
Every executor must start each run through ``processes.start_worker`` (or ``run_task``), the
same worker entry point, so that every executor gives the same results byte for byte.

``ExecutorOptions`` is what a sweep is given: the executor's name and its options. It can be
made before a plugin executor is registered (the sweep imports its plugins first), so it is
resolved against the registry only when the sweep starts (``resolve``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from driftlab.errors import ConfigError
from driftlab.executors.tasks import NO_EVENTS, Events, RunTask, TaskResult
from driftlab.plugins import Registry, check_entry_name

ENTRY_POINT_GROUP = "driftlab.executors"
SWITCH = bool  # CliOption.type of a flag that takes no value (store_true)


@dataclass(frozen=True)
class CliOption:
    """One command-line flag of an executor: ``--slurm-time 120`` sets the field ``time`` of its options.

    ``type`` converts the flag's word (``int``, ``float``, ``str``), or is ``bool`` for a switch that takes
    none. ``repeat``: the flag may be given several times, and the field gets a tuple of their words, in order
    (``--slurm-setup "module load cuda" --slurm-setup "source .venv/bin/activate"``). Several executors may
    declare the same flag (each for a field of its own); the command line has it once.
    """

    flag: str
    field: str
    type: Callable[[str], Any] = str
    help: str = ""
    metavar: str | None = None
    repeat: bool = False

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag's value under: ``--slurm-time`` -> ``slurm_time``."""
        return self.flag.lstrip("-").replace("-", "_")

    def argparse_keywords(self) -> dict[str, Any]:
        """``add_argument`` keywords; SUPPRESS as default, so only the flags the user gave reach the options."""
        keywords: dict[str, Any] = {"dest": self.dest, "default": argparse.SUPPRESS, "help": self.help}
        if self.type is SWITCH:
            return {**keywords, "action": "store_true"}
        shown = {"metavar": self.metavar} if self.metavar else {}
        return {**keywords, "type": self.type, **shown, **({"action": "append"} if self.repeat else {})}


@dataclass(frozen=True)
class Layout:
    """How a sweep lays its pending runs out on an executor: torch threads per run when ``--threads`` is not given,
    and how its first log line says where they run (``"in 2 process(es)"``, ``"as slurm jobs"``)."""

    threads: int
    where: str


def _accept(options: Any) -> None:  # noqa: ARG001 - the check of an executor whose every option value is possible
    return None


@dataclass(frozen=True)
class ExecutorEntry:
    """Everything driftlab needs to know about one executor.

    ``options_type``: a frozen dataclass whose fields (each with a default) are the executor's options.
    ``execute(tasks, options, events)`` runs every task (each through ``processes.start_worker`` or ``run_task``),
    calls ``events.started``/``finished`` as runs start and end, and returns one ``TaskResult`` per task.
    ``check(options)`` raises a ConfigError for options it cannot run with (a value out of range, a missing
    package or cluster), before the sweep plans or writes anything. ``layout(options, pending)``: see ``Layout``;
    without one, a run gets 1 thread and the log says ``as NAME jobs``.
    """

    name: str
    options_type: type
    execute: Callable[[list[RunTask], Any, Events], list[TaskResult]]
    check: Callable[[Any], None] = _accept
    cli_options: tuple[CliOption, ...] = ()
    description: str = ""
    layout: Callable[[Any, int], Layout] | None = None

    def __post_init__(self) -> None:
        check_entry_name("executor", self.name)
        if not (isinstance(self.options_type, type) and dataclasses.is_dataclass(self.options_type)):
            raise ValueError(
                f"executor {self.name!r}: options_type must be a frozen dataclass (a field with a default per option)"
            )
        try:
            self.options_type()
        except TypeError as error:
            raise ValueError(f"executor {self.name!r}: every field of options_type needs a default ({error})") from None
        if not callable(self.execute) or not callable(self.check):
            raise ValueError(
                f"executor {self.name!r}: execute (tasks, options, events) and check (options) must be functions"
            )
        fields = self.option_names()
        for option in self.cli_options:
            if not isinstance(option, CliOption):
                raise ValueError(
                    f"executor {self.name!r}: cli_options holds CliOption(flag, field, type, help), got {option!r}"
                )
            if not option.flag.startswith("--") or option.field not in fields:
                raise ValueError(
                    f"executor {self.name!r}: cli option {option.flag!r} must start with -- and set a field of "
                    f"{self.options_type.__name__} ({', '.join(fields)}), not {option.field!r}"
                )

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.options_type))

    def layout_for(self, options: Any, pending: int) -> Layout:
        return self.layout(options, pending) if self.layout else Layout(1, f"as {self.name} jobs")


REGISTRY: Registry[ExecutorEntry] = Registry("executor", ENTRY_POINT_GROUP, ExecutorEntry, lambda entry: entry.execute)


# The kind's registry functions are the Registry's own (driftlab.plugins.Registry documents them).
register = REGISTRY.register
lookup = REGISTRY.lookup
names = REGISTRY.names


def find(name: str) -> ExecutorEntry:
    """The entry of ``name``; a ConfigError listing the executors there are when none is registered under it."""
    entry = lookup(name)
    if entry is None:
        raise ConfigError(REGISTRY.unknown_message(name, "--executor"))
    return entry


@dataclass(frozen=True, init=False)
class ExecutorOptions:
    """Which executor runs a sweep's runs, and its options: ``ExecutorOptions("slurm", time=120, local=True)``.

    Keyword arguments set fields of the executor's options (the rest keep their defaults); ``options`` gives a whole
    options object instead (``ExecutorOptions("slurm", SlurmOptions(time=120))``). The flat spellings of earlier
    versions, the field prefixed by the executor's name (``slurm_time=120``, ``ray_address=...``), still work.
    """

    name: str
    options: Any
    changes: tuple[tuple[str, Any], ...]

    def __init__(self, name: str = "local", options: Any = None, **changes: Any) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "changes", tuple(sorted(changes.items())))  # sorted: equal whatever their order


def resolve(executor: ExecutorOptions) -> tuple[ExecutorEntry, Any]:
    """The entry of ``executor.name`` and its options object; a ConfigError for an unknown executor or option."""
    entry = find(executor.name)
    options = executor.options if executor.options is not None else entry.options_type()
    if not isinstance(options, entry.options_type):
        raise ConfigError(
            f"executor {entry.name!r} takes {entry.options_type.__name__} options, got {type(options).__name__}; "
            f"pass ExecutorOptions({entry.name!r}, {entry.options_type.__name__}(...))"
        )
    fields = entry.option_names()
    updates = {}
    for key, value in executor.changes:
        field = key if key in fields else key.removeprefix(f"{entry.name}_")
        if field not in fields:
            raise ConfigError(
                f"{key!r} is not an option of executor {entry.name!r}; its options: {', '.join(fields) or 'none'}"
            )
        updates[field] = value
    return entry, dataclasses.replace(options, **updates)


def check_options(executor: ExecutorOptions) -> None:
    """Refuse an unknown executor and impossible options before anything is planned or written."""
    entry, options = resolve(executor)
    entry.check(options)


def execute(tasks: list[RunTask], executor: ExecutorOptions, events: Events = NO_EVENTS) -> list[TaskResult]:
    """Run ``tasks`` on the executor ``executor.name``; returns one result per task (fewer when interrupted)."""
    entry, options = resolve(executor)
    return entry.execute(tasks, options, events)


# ---------------------------------------------------------------- the command line


def command_line_options() -> list[CliOption]:
    """Every registered executor's flags in registry order, each flag once (as the first executor declares it)."""
    seen: dict[str, CliOption] = {}
    for name in names():
        for option in REGISTRY.entries[name].cli_options:
            seen.setdefault(option.flag, option)
    return list(seen.values())


def options_from_command_line(name: str, given: Mapping[str, Any]) -> ExecutorOptions:
    """The ExecutorOptions of ``--executor NAME`` and the executor flags the user gave (``given``: flag -> value).

    A flag of another executor is an error that names the executor taking it. An executor a plugin registers that is
    not imported yet (the sweep imports its plugins later) can be named, but its flags not given.
    """
    entry = lookup(name)
    if entry is None:
        if given:
            raise ConfigError(REGISTRY.unknown_message(name, "--executor"))
        return ExecutorOptions(name)
    flags = {option.flag: option for option in entry.cli_options}
    changes = {}
    for flag, value in given.items():
        if flag not in flags:
            takers = [n for n in names() if any(o.flag == flag for o in REGISTRY.entries[n].cli_options)]
            raise ConfigError(
                f"{flag} is an option of --executor {' or '.join(takers) or 'none'}, not of --executor {name}; "
                f"drop {flag}, or run on that executor"
            )
        if flags[flag].repeat:  # argparse gives a list of the words; a caller may give one word
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        changes[flags[flag].field] = value
    return ExecutorOptions(name, **changes)


def options_from_arguments(name: str, arguments: argparse.Namespace) -> ExecutorOptions:
    """``options_from_command_line`` from parsed arguments whose executor flags came from ``command_line_options``."""
    given = {o.flag: getattr(arguments, o.dest) for o in command_line_options() if hasattr(arguments, o.dest)}
    return options_from_command_line(name, given)


__all__ = [
    "ENTRY_POINT_GROUP",
    "REGISTRY",
    "CliOption",
    "ExecutorEntry",
    "ExecutorOptions",
    "Layout",
    "check_options",
    "command_line_options",
    "execute",
    "find",
    "lookup",
    "names",
    "options_from_arguments",
    "options_from_command_line",
    "register",
    "resolve",
]
