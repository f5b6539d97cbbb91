"""The ``driftlab`` command line.

    driftlab demo                                   every algorithm on synthetic(1,1): table + plot
    driftlab run CONFIG [key=value ...] --out DIR   one experiment (CONFIG: a .toml/.json file or a preset)
    driftlab run CONFIG --out DIR --resume          continue an interrupted run exactly
    driftlab config [CONFIG] [key=value ...]        list every key, or print a resolved config (--toml: a file to edit)
    driftlab sweep SWEEP --out DIR                  a grid of runs x seeds in parallel processes, resumable
    driftlab report DIR [DIR ...] --out REPORT      tables (Markdown, CSV) and plots from runs and sweeps
    driftlab reproduce [NAME ...] --out DIR         rerun the shipped sweeps; rewrite docs/reproduction.md's tables from them
    driftlab presets                                list the shipped presets and sweeps
    driftlab data list                              the data sets, partitions and models a config can name
    driftlab data describe CONFIG [key=value ...]   clients, samples per client, classes holding 80% of a client's data
    driftlab data download NAME --to DIR            fetch official files (checksummed, resumable); never needed for tests
    driftlab flower new DIR --config CONFIG         a Flower app project running CONFIG (the flower extra)
    driftlab flower check CONFIG [key=value ...]    Flower's simulation engine vs the simulator, bit for bit (exit 0: equal)

key=value overrides may stand anywhere after the command, before or after its options.
An unexpected failure prints one line and the path of a log holding the traceback;
``--debug`` (before or after the command) prints the traceback too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

from driftlab.cli_data import _data_command
from driftlab.cli_errors import (
    ERROR_LOG,
    MESSAGE_LIMIT,
    USER_ERRORS,
    _check_named_files,
    _describe_os_error,
    _report_unexpected,
    _show_run_warnings_plainly,
    _user_errors,
)
from driftlab.cli_parser import (
    EPILOG_REPORT,
    EPILOG_RUN,
    EPILOG_SWEEP,
    TAKES_OVERRIDES,
    _float_list,
    _trackers_option,
    parse_arguments,
)
from driftlab.cli_sweep import EXIT_RUNS_HELD, _sweep_command

__all__ = [
    "EPILOG_REPORT",
    "EPILOG_RUN",
    "EPILOG_SWEEP",
    "ERROR_LOG",
    "EXIT_RUNS_HELD",
    "MESSAGE_LIMIT",
    "TAKES_OVERRIDES",
    "USER_ERRORS",
    "main",
    "parse_arguments",
    "preset_description",
    "to_toml",
]


def main(argv: list[str] | None = None) -> int:
    # run and sweep turn SIGTERM into KeyboardInterrupt while they work; once main returns, a second SIGTERM (one
    # arriving while the process frees its memory and exits) must end it quietly, not print a traceback from shutdown
    main_thread = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGTERM")
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        return _main(argv)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else [str(word) for word in argv]
    args = None
    try:
        args = parse_arguments(argv)
        _check_named_files(args)
        return _dispatch(args)
    except _user_errors() as error:
        print(f"driftlab: error: {error}", file=sys.stderr)
        return 2
    except FloatingPointError as error:
        # A diverged run; the message names the round, the values, and the checkpoint kept (or that none exists).
        print(f"driftlab: error: {error}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as error:
        # A run's RunInterrupted says what it saved and the command that continues it; any other interrupt of
        # `driftlab run` came before the run claimed its directory (loading the config, importing a plugin).
        if type(error).__name__ == "RunInterrupted":
            print(f"driftlab: interrupted; {error}", file=sys.stderr)
        elif getattr(args, "command", None) == "run":
            print("driftlab: interrupted before the run started; nothing was saved", file=sys.stderr)
        else:
            print("driftlab: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `driftlab sweep ... --dry-run | head`: the reader left; say nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as error:
        # the file system refused (permissions, a file where a folder must be, a full disk): the user can fix that
        print(f"driftlab: error: {_describe_os_error(error)}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - the last resort: never a traceback the user did not ask for
        debug = bool(getattr(args, "debug", False)) if args is not None else "--debug" in argv
        return _report_unexpected(error, argv, args, debug)


def _dispatch(args: argparse.Namespace) -> int:
    # Each command imports what it needs: `report` and `sweep --status` read directories without torch.
    if args.command == "report":
        from driftlab.experiments.report import make_report

        targets = _float_list(args.targets, "--targets") if args.targets else None
        report = make_report(
            args.inputs,
            args.out,
            targets=targets,
            steps_reference=args.steps_reference,
            plots=not args.no_plots,
            baseline=args.baseline,
            force=args.force,
        )
        print(report.markdown)
        print(f"report: {Path(args.out) / 'report.md'}")
        return 0
    if args.command == "sweep":
        return _sweep_command(args)
    if args.command == "reproduce":
        from driftlab.experiments.reproduce.command import command as reproduce_command

        return reproduce_command(args)
    if args.command == "flower":
        from driftlab.flower.project import flower_command

        return flower_command(args)

    if args.command == "presets":
        # read from the shipped files alone: listing them imports no torch
        from driftlab.experiments.sweep.shipped import preset_names, sweep_description, sweep_names

        print("configs (driftlab run NAME --out DIR):")
        for name in preset_names():
            print(f"  {name}")
            print(_wrapped(preset_description(name)))
        print("sweeps (driftlab sweep NAME --out DIR):")
        for name in sweep_names():
            print(f"  {name}")
            print(_wrapped(sweep_description(name)))
        return 0

    from driftlab.experiments.config import describe_keys, load_config

    if args.command == "config":
        if args.config is not None and "=" in args.config and not Path(args.config).exists():
            # `driftlab config client.lr=0.5`: an override, not a config file; resolve it on the defaults
            args.config, args.overrides = None, [args.config, *args.overrides]
        if args.config is None and not args.overrides and not args.toml:
            print(describe_keys())
        elif args.config is None and not args.toml and all(o.strip().startswith("plugins=") for o in args.overrides):
            load_config(None, args.overrides)  # imports the plugins, so their algorithms' keys are listed too
            print(describe_keys())
        elif args.toml:
            source = " ".join(filter(None, [args.config, *args.overrides])) or "(the defaults)"
            header = (
                f"# driftlab config {source}\n"
                "# The resolved config, defaults included (unset keys are left out; `driftlab config` lists and explains every key).\n"
                "# Save it (> my.toml), edit it, then: driftlab run my.toml --out DIR\n"
            )
            print(header + to_toml(load_config(args.config, args.overrides).to_dict()), end="")
        else:
            print(json.dumps(load_config(args.config, args.overrides).to_dict(), indent=2))
        return 0

    if args.command == "data":
        return _data_command(args)

    from driftlab.experiments.run.runner import install_termination_handler, run

    install_termination_handler()
    _show_run_warnings_plainly()
    if args.command == "run":
        config = load_config(args.config, args.overrides)
        if args.log is not None:
            config = load_config(config.to_dict(), [f"log={json.dumps(list(_trackers_option(args)))}"])
        result = run(
            config,
            args.out,
            resume=args.resume,
            progress=not args.quiet,
            progress_label=Path(args.out).name or config.algorithm.name,
            clean_up_refused=True,  # a run refused for a wrong data path (say) leaves no config.json behind in --out
        )
        print(json.dumps(result.summary, indent=2))
        print(f"metrics: {args.out}/metrics.jsonl")
        return 0
    if args.command == "demo":
        from driftlab.experiments.run.demo import run_demo, summary_table

        results = run_demo(args.out, tuple(args.overrides), progress=not args.quiet, force=args.force)
        print()
        print(summary_table(results))
        print(
            f"\nplot: {args.out}/accuracy.png   table: {args.out}/summary.md   per-round metrics: {args.out}/<algorithm>/metrics.jsonl"
        )
        return 0
    raise AssertionError(args.command)


def preset_description(name: str) -> str:
    """The comment lines at the top of a shipped preset, as one paragraph."""
    from driftlab.experiments.sweep.shipped import preset_description as description

    return description(name)


def _wrapped(text: str, indent: str = "      ") -> str:
    """A description as a paragraph wrapped to the terminal (at most 100 columns), never cut."""
    width = max(40, min(100, shutil.get_terminal_size((100, 24)).columns))
    paragraph = " ".join(text.split())
    if not paragraph:
        return f"{indent}(no description)"
    # break_on_hyphens=False: "DP-SCAFFOLD" split after its hyphen would read "DP- SCAFFOLD" once joined again
    return textwrap.fill(
        paragraph, width=width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
    )


# ----------------------------------------------------------------- TOML output (tomllib only reads)


def to_toml(table: dict[str, Any]) -> str:
    """A resolved config as TOML that ``load_config`` reads back equal: the config package's one TOML writer
    (``driftlab.experiments.config.toml_writer``), imported when it is needed so that the commands that do not
    read configs do not import torch."""
    from driftlab.experiments.config.toml_writer import to_toml as write

    return write(table)


if __name__ == "__main__":
    sys.exit(main())
