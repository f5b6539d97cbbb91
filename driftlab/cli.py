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
import codecs
import json
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from driftlab.errors import ConfigError

# Errors whose message says what to fix (exit code 2), besides ConfigError: (module, name). The modules
# import torch, so they are imported by the commands that need them, never here (`driftlab report` and
# `--help` import no torch); an error of a module that was not imported cannot have been raised.
USER_ERRORS = (
    ("driftlab.data.federated", "DataFileError"),
    ("driftlab.experiments.run.datasets", "DataSetupError"),
    ("driftlab.simulation.state.checkpoint", "CheckpointError"),
)

EXIT_RUNS_HELD = 4  # `driftlab sweep`: some runs are held by other live processes, so the sweep is not finished

EPILOG_RUN = """examples:
  driftlab run synthetic-fedavg --out runs/fedavg
  driftlab run synthetic-fedavg client.lr=0.05 sampling.participation=0.2 --out runs/lr05
  driftlab run mnist-fedadam data.root=/data/mnist server.lr=0.01 --out runs/fedadam
  driftlab run runs/fedavg/config.json --out runs/fedavg --resume

overrides are section.key=value with TOML values, before or after the options.
`driftlab config` lists every key with its meaning and default (this help listed them before 2026-12)."""

EPILOG_SWEEP = """examples:
  driftlab sweep fedprox-figure1 --out runs/fedprox-figure1            a shipped sweep (see `driftlab presets`)
  driftlab sweep fedprox-figure1 --scale paper --out runs/fedprox-paper  the paper's full scale
  driftlab sweep synthetic-fedprox --grid 'algorithm.mu=[0, 0.01, 1]' --seeds 0,1,2 --out runs/mu
  driftlab sweep mnist-fedavg --grid algorithm.name=fedavg,scaffold --grid data.partition=iid,dirichlet --out runs/grid
  driftlab sweep my-sweep.toml rounds=20 --jobs 1 --out runs/mine      key=value applies to every run
  driftlab sweep synthetic-fedavg --grid algorithm.name=fedavg,fedprox 'name=fedprox:algorithm.mu=0.1' --out runs/prox
                                                                        LABEL:key=value applies to that label's runs only
  driftlab sweep fedprox-figure1 --executor slurm --slurm-partition gpu --slurm-time 120 --out runs/fedprox-figure1
  driftlab sweep fedprox-figure1 --executor ray --ray-address auto --out runs/fedprox-figure1
  driftlab sweep --status runs/fedprox-figure1                          done, running, queued, failed ... per run

Running the same command again skips finished runs and resumes interrupted ones from their
checkpoints; runs another live process holds are left to it, and the sweep then exits with
code 4. A sweep file has base, overrides, seeds, targets, [scales.NAME] and [[axes]] with
labelled values: the README shows one, and docs/reproduction.md the shipped ones and their results."""

EPILOG_REPORT = """examples:
  driftlab report runs/fedprox-figure1 --out reports/fedprox-figure1
  driftlab report runs/fedavg runs/feddyn --targets 0.95,0.97 --out reports/mnist

writes report.md, targets.csv, accuracy.csv, steps.csv and PNG plots to --out. A file of those names there that
driftlab did not write stops the report before it writes anything: choose another --out, or pass --force to
replace it; running the report again into its own folder replaces its own files."""


_FORCE_HELP = (
    "replace files of the names this command writes that driftlab did not write (without it, such a file stops the "
    "command before it writes anything); nothing else in the folder is touched"
)


# Commands whose positional `key=value` overrides may also follow their options.
TAKES_OVERRIDES = {
    ("demo",),
    ("run",),
    ("config",),
    ("sweep",),
    ("reproduce",),
    ("data", "describe"),
    ("flower", "check"),
}


_LOG_HELP = (
    "experiment trackers, comma-separated: tensorboard, wandb, mlflow (or none); replaces the config's `log`. "
    "Each writes into the run directory: tensorboard/, wandb/, mlruns/"
)


def _trackers_option(args: argparse.Namespace) -> tuple[str, ...] | None:
    from driftlab.experiments.run.trackers import parse_tracker_list

    return None if args.log is None else parse_tracker_list(args.log)


def _user_errors() -> tuple[type[Exception], ...]:
    """ConfigError and those of USER_ERRORS whose module is imported (evaluated when an error is being handled)."""
    loaded = (getattr(sys.modules.get(module), name, None) for module, name in USER_ERRORS)
    return (ConfigError, *(error for error in loaded if error is not None))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="driftlab", description="Federated optimization simulator: FedAvg, FedOpt and drift-correcting algorithms."
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the full traceback of an unexpected error (it is always written to a log file)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="compare the seed papers' algorithms on the built-in synthetic(1,1) default (about a minute on 2 idle cores)",
    )
    demo.add_argument(
        "overrides", nargs="*", metavar="key=value", help="overrides applied to every demo run, e.g. rounds=30"
    )
    demo.add_argument("--out", default="driftlab-demo", help="output directory (default: driftlab-demo)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.add_argument("--force", action="store_true", help=_FORCE_HELP + " (summary.md, accuracy.png, <algorithm>/)")

    run = commands.add_parser(
        "run",
        help="run one experiment",
        description="Run one experiment and write its config, per-round metrics and checkpoints to --out.",
        epilog=EPILOG_RUN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("config", help="a config file (.toml or .json) or a preset name (see `driftlab presets`)")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="overrides such as client.lr=0.05")
    run.add_argument("--out", required=True, help="output directory: config.json, metrics.jsonl, checkpoints")
    run.add_argument("--resume", action="store_true", help="continue the interrupted run in --out from its checkpoint")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--log", metavar="TRACKERS", help=_LOG_HELP)

    config = commands.add_parser(
        "config",
        help="list every configuration key, or print a resolved configuration",
        epilog="example: driftlab config synthetic-fedavg rounds=50 --toml > my.toml   then   driftlab run my.toml --out runs/mine; "
        "`driftlab config 'plugins=[\"my_algorithm.py\"]'` lists the keys of a plugin's algorithm too",
    )
    config.add_argument("config", nargs="?", help="a config file or preset to resolve")
    config.add_argument("overrides", nargs="*", metavar="key=value")
    config.add_argument(
        "--toml",
        action="store_true",
        help="print TOML to save and edit (the resolved config, defaults included) instead of JSON",
    )

    sweep = commands.add_parser(
        "sweep",
        help="run a grid of configs x seeds in parallel processes (resumable), then report",
        description="Run every config of a sweep (a grid of labelled variants times seeds) in parallel processes, "
        "write each run to DIR/runs/<setting>/<method>/seed-<s>/ and a report to DIR/report/.",
        epilog=EPILOG_SWEEP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument(
        "sweep",
        nargs="?",
        help="a shipped sweep (see `driftlab presets`), a sweep .toml file, or a config/preset to grid over with --grid",
    )
    sweep.add_argument(
        "overrides", nargs="*", metavar="key=value", help="overrides applied to every run, after the sweep's own"
    )
    sweep.add_argument("--out", help="sweep directory (created; reused to resume); required unless --status")
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=VALUES",
        help="an axis: KEY=[v1, v2] (TOML list) or KEY=v1,v2; repeatable",
    )
    sweep.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2 (default: the sweep's seeds, or 0)")
    sweep.add_argument("--scale", help="a named scale of the sweep file, e.g. paper (the paper's full scale)")
    sweep.add_argument(
        "--retry-diverged",
        action="store_true",
        help="run diverged runs again (they are skipped by default: reruns are identical)",
    )
    sweep.add_argument("--dry-run", action="store_true", help="list the runs and their status without running anything")
    sweep.add_argument("--no-report", action="store_true", help="do not write DIR/report when the sweep ends")
    sweep.add_argument(
        "--force", action="store_true", help=_FORCE_HELP + " (sweep.json, jobs.json, runs/, report/'s files, ...)"
    )
    sweep.add_argument(
        "--halving",
        metavar="R:ETA",
        help="successive halving over the tuned axes' values: all to round R, the best 1/ETA on to R*ETA, ... (off: none, "
        "even where the sweep file asks for it; running without it extends the runs halving stopped)",
    )
    sweep.add_argument(
        "--status",
        metavar="DIR",
        help="show each run of the sweep in DIR (done, running, queued, interrupted, failed, diverged, stopped) and exit",
    )
    from driftlab.executors.registry import command_line_options
    from driftlab.executors.registry import names as executor_names

    sweep.add_argument(
        "--executor",
        default="local",
        metavar="NAME",
        help=f"where runs execute: {', '.join(executor_names())}, or one a plugin of the sweep registers (default: local processes)",
    )
    sweep.add_argument(
        "--threads",
        type=int,
        help="torch threads per run (default: the executor's; local: the cores split between the runs)",
    )
    for option in command_line_options():  # each executor's own flags, from its registry entry
        sweep.add_argument(option.flag, **option.argparse_keywords())
    sweep.add_argument("--log", metavar="TRACKERS", help=_LOG_HELP + " of every run")

    report = commands.add_parser(
        "report",
        help="tables and plots from run and sweep directories",
        description="Communication to reach target accuracies (FedDyn Tables 1-2), accuracy mean ± std over seeds, "
        "local SGD steps, run info, and plots, from run directories, sweep directories or folders holding runs.",
        epilog=EPILOG_REPORT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument(
        "inputs", nargs="+", metavar="DIR", help="run directories, sweep directories, or folders containing runs"
    )
    report.add_argument("--out", required=True, help="report directory: report.md, CSV files, PNG plots")
    report.add_argument(
        "--targets",
        help="comma-separated target accuracies, e.g. 0.95,0.972 (default: the sweep's or the runs' targets)",
    )
    report.add_argument(
        "--steps-reference", help="method label the local SGD steps are compared with (default: the constant-K method)"
    )
    report.add_argument("--no-plots", action="store_true", help="tables only")
    report.add_argument(
        "--baseline",
        help="method label the others are compared with, paired by seed (default: each setting's first method)",
    )
    report.add_argument("--force", action="store_true", help=_FORCE_HELP + " (report.md, the CSV files, the PNG plots)")

    from driftlab.experiments.reproduce.command import (
        add_parser as add_reproduce_parser,  # standard library only: no torch for --help
    )

    add_reproduce_parser(commands)

    commands.add_parser("presets", help="list the shipped presets and sweeps")

    data = commands.add_parser("data", help="data sets: list, describe a partition, download official files")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    data_commands.add_parser(
        "list", help="data sets (and whether their files are on disk), partitions and models a config can name"
    )
    describe = data_commands.add_parser("describe", help="summarise the clients a config's data and partition produce")
    describe.add_argument("config", help="a config file or preset")
    describe.add_argument("overrides", nargs="*", metavar="key=value")
    download = data_commands.add_parser(
        "download",
        help="download a data set's official files (checksummed, resumable)",
        epilog="example: driftlab data download mnist --to ~/data/mnist   then   driftlab run mnist-fedavg data.root=~/data/mnist --out runs/x",
    )
    download.add_argument("name", help="data set (see `driftlab data list`)")
    download.add_argument("--to", required=True, help="directory to write the files to")
    download.add_argument("--force", action="store_true", help=_FORCE_HELP + " (a data file's name, or NAME.part)")

    flower = commands.add_parser(
        "flower", help="deploy a config on Flower: write an app project, check it against the simulator"
    )
    flower_commands = flower.add_subparsers(dest="flower_command", required=True)
    flower_new = flower_commands.add_parser(
        "new",
        help="write a ready Flower app project (pyproject.toml, app module, README) for a config",
        epilog="example: driftlab config synthetic-fedavg algorithm.name=scaffold --toml > scaffold.toml   then   "
        "driftlab flower new scaffold-app --config scaffold.toml   then follow scaffold-app/README.md",
    )
    flower_new.add_argument(
        "directory",
        metavar="DIR",
        help="the project's directory: new, or one holding none of the project's files (see --force)",
    )
    flower_new.add_argument(
        "--force", action="store_true", help=_FORCE_HELP + " (pyproject.toml, the app module, README.md)"
    )
    flower_new.add_argument("--config", required=True, help="a config file or preset (see `driftlab presets`)")
    flower_check = flower_commands.add_parser(
        "check",
        help="run a config under Flower's simulation engine and the sequential backend; exit 0 if the final models are equal bit for bit",
        epilog="refused before anything runs, with the fix: evaluation.model other than server (the server never receives client "
        "models: add evaluation.model=server), and membership events with FedDyn-like algorithms. "
        "example: driftlab flower check synthetic-fedavg algorithm.name=scaffold --rounds 2",
    )
    flower_check.add_argument("config", help="a config file or preset")
    flower_check.add_argument(
        "overrides", nargs="*", metavar="key=value", help="overrides such as client.lr=0.05, as for `driftlab run`"
    )
    flower_check.add_argument("--rounds", type=int, default=3, help="rounds to run (default: 3)")
    flower_check.add_argument(
        "--nodes", type=int, help="virtual SuperNodes serving the clients round-robin (default: min(4, clients))"
    )
    flower_check.add_argument(
        "--keep", metavar="DIR", help="keep the Flower run's directory here (new or empty) for `driftlab report`"
    )
    for command in (*commands.choices.values(), *data_commands.choices.values(), *flower_commands.choices.values()):
        # --debug after the command too; SUPPRESS keeps a command from resetting a --debug given before it
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """Parse the command line, taking ``key=value`` overrides wherever they stand after the command.

    argparse fills a positional list only from the words before the first option, so
    ``run X --out D rounds=2`` leaves ``rounds=2`` over; such words are appended to the
    command's overrides in their order.  Anything else left over is argparse's usual error.
    """
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    command = (
        (args.command, getattr(args, "data_command", None) or getattr(args, "flower_command", None))
        if args.command in ("data", "flower")
        else (args.command,)
    )
    takes_overrides = command in TAKES_OVERRIDES
    unknown = [word for word in extras if not (takes_overrides and _looks_like_override(word))]
    if unknown:
        hint = " (overrides are section.key=value)" if takes_overrides else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if extras:
        args.overrides = [*args.overrides, *extras]
    if args.command == "sweep" and args.status is None and (args.sweep is None or args.out is None):
        parser.error("driftlab sweep needs a SWEEP and --out DIR (or --status DIR to show where a sweep's runs stand)")
    return args


def _looks_like_override(word: str) -> bool:
    return not word.startswith("-") and "=" in word and bool(word.partition("=")[0].strip())


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


def _show_run_warnings_plainly() -> None:
    """A run's own warnings (``UnstableRunWarning``, ``ResumeChangeWarning``) as one ``driftlab: warning: ...`` line,
    without Python's source line."""
    show = warnings.showwarning

    def shown(message, category, filename, lineno, file=None, line=None):  # warnings.showwarning's signature
        if category.__name__ in ("UnstableRunWarning", "ResumeChangeWarning"):
            print(f"driftlab: warning: {message}", file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = shown


ERROR_LOG = "error.log"
MESSAGE_LIMIT = 500  # characters of an unexpected error's message on the terminal; the log has all of it


def _report_unexpected(error: Exception, argv: list[str], args: argparse.Namespace | None, debug: bool) -> int:
    """One short line, the log holding the traceback, exit code 1; the traceback on stderr only with --debug."""
    details = "".join(traceback.format_exception(error))
    log = _write_error_log(details, argv, args)
    message = " ".join(str(error).split())
    if len(message) > MESSAGE_LIMIT:
        message = message[:MESSAGE_LIMIT] + " ..."
    if debug:
        print(details, file=sys.stderr, end="")
    print(
        f"driftlab: error: {type(error).__name__}: {message}"
        if message
        else f"driftlab: error: {type(error).__name__}",
        file=sys.stderr,
    )
    if log is not None:
        print(f"driftlab: full traceback in {log}" + ("" if debug else " (or run again with --debug)"), file=sys.stderr)
    elif not debug:
        print("driftlab: no log could be written; run again with --debug to see the traceback", file=sys.stderr)
    return 1


def _write_error_log(details: str, argv: list[str], args: argparse.Namespace | None) -> Path | None:
    """Append to ``<--out>/error.log`` when that folder exists (appending never loses an earlier log), else a new temp file."""
    import driftlab

    entry = (
        f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}  driftlab {driftlab.__version__}  python {sys.version.split()[0]}\n"
        f"command: driftlab {' '.join(argv)}\ncwd: {os.getcwd()}\n{details}\n"
    )
    out = getattr(args, "out", None) if args is not None else None
    candidates = []
    if out and Path(out).is_dir():
        candidates.append(Path(out) / ERROR_LOG)
    candidates.append(
        Path(tempfile.gettempdir()) / f"driftlab-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    )
    for path in candidates:
        try:
            with open(path, "a", encoding="utf-8", errors="replace") as handle:
                handle.write(entry)
            return path
        except OSError:
            continue
    return None


def _describe_os_error(error: OSError) -> str:
    reason = error.strerror or type(error).__name__
    if error.filename is None:
        return f"{reason} ({error})" if str(error) != reason else reason
    target = f" -> {error.filename2}" if error.filename2 is not None else ""
    return f"{error.filename}{target}: {reason}"


def _check_named_files(args: argparse.Namespace) -> None:
    """A config or sweep file named on the command line must be readable UTF-8 text: say which file, and why, if not."""
    for name in ("config", "sweep"):
        value = getattr(args, name, None)
        if value is not None and Path(value).is_file():
            _check_utf8_text(Path(value))


def _check_utf8_text(path: Path) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes read before the current chunk
    try:
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(1 << 20)  # a chunk at a time: a huge file is refused elsewhere, not read whole here
                pending = len(decoder.getstate()[0])
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    raise ConfigError(
                        f"{path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset {offset - pending + error.start}); "
                        "save it as UTF-8"
                    ) from None
                if not chunk:
                    return
                offset += len(chunk)
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}") from None


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


def _float_list(text: str, option: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated numbers such as 0.95,0.972, got {text!r}") from None


def _sweep_command(args: argparse.Namespace) -> int:
    if args.status is not None:
        from driftlab.experiments.sweep.sweep_status import format_status, sweep_status

        print(format_status(sweep_status(args.status)))
        return 0

    from driftlab.executors.registry import options_from_arguments
    from driftlab.experiments.config import preset_names
    from driftlab.experiments.sweep import (
        is_sweep_source,
        load_sweep,
        plan,
        run_status,
        run_sweep,
        sweep_from_config,
        sweep_names,
        validate_seeds,
    )

    seeds = None
    if args.seeds:
        try:
            seeds = [int(part) for part in args.seeds.split(",") if part.strip()]
        except ValueError:
            raise ConfigError(f"--seeds takes comma-separated integers such as 0,1,2, got {args.seeds!r}") from None
        validate_seeds(seeds, "--seeds")
    if not is_sweep_source(args.sweep) and not Path(args.sweep).is_file() and args.sweep not in preset_names():
        raise ConfigError(
            f"{args.sweep!r} is neither a sweep nor a config: shipped sweeps: {', '.join(sweep_names())}; "
            f"config presets (to use with --grid): {', '.join(preset_names())}; or give a .toml file"
        )
    if is_sweep_source(args.sweep):
        spec = load_sweep(args.sweep)
        if args.grid:
            raise ConfigError(
                f"{args.sweep} is a sweep file: add axes to it instead of --grid (or pass a config/preset with --grid)"
            )
        if seeds is not None:
            import dataclasses

            spec = dataclasses.replace(
                spec, seeds=tuple(seeds), scales={k: dataclasses.replace(v, seeds=None) for k, v in spec.scales.items()}
            )
    else:
        spec = sweep_from_config(args.sweep, args.grid, seeds or [0], name=Path(args.out).name or "sweep")
    from driftlab.plugins import load_plugins

    load_plugins(spec.plugins)  # an executor a plugin of the sweep file registers, with its flags
    executor = options_from_arguments(
        args.executor, args
    )  # checked by run_sweep, once the base config's plugins are in
    if args.dry_run:
        from driftlab.experiments.sweep import run_directory_holder

        for r in plan(spec, args.scale, args.overrides):
            held = run_directory_holder(Path(args.out) / r.dir) is not None  # another live process is running it
            print(
                f"{'running' if held else run_status(Path(args.out) / r.dir, r.config.rounds):<12s} {r.dir}   {' '.join(r.overrides)}"
            )
        return 0
    if not args.no_report:
        from driftlab.experiments.report import claimable

        claimable(
            Path(args.out) / "report", args.force
        )  # a user's report.md there stops the sweep before any run, not after
    from driftlab.experiments.run.runner import install_termination_handler

    install_termination_handler()
    try:
        outcomes = run_sweep(
            spec,
            args.out,
            scale=args.scale,
            extra_overrides=args.overrides,
            retry_diverged=args.retry_diverged,
            trackers=_trackers_option(args),
            executor=executor,
            threads=args.threads,
            halving=args.halving,
            force=args.force,
        )
    except KeyboardInterrupt:
        print(
            "driftlab: sweep interrupted; every run checkpointed its last completed round: run the same command again to resume",
            file=sys.stderr,
        )
        return 130
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    held = [o for o in outcomes if o.status == "running"]
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    if held:
        # Runs another process holds (a sweep killed outright leaves its SLURM jobs going) are not finished: a
        # `driftlab sweep ... && driftlab report ...` must not go on to report them.
        print(f"sweep not finished: {summary}", file=sys.stderr)
        for outcome in held:
            print(f"  running: {outcome.run.dir}: {outcome.message}", file=sys.stderr)
        print(
            f"driftlab: {len(held)} run(s) of this sweep are running in other processes; wait for them to end (or stop them), "
            f"then run the same command again to finish the sweep and write its report (exit code {EXIT_RUNS_HELD})",
            file=sys.stderr,
        )
        return EXIT_RUNS_HELD
    print("sweep finished: " + summary)
    failed = [o for o in outcomes if o.status == "failed"]
    for outcome in failed:
        print(f"  failed: {outcome.run.dir}: {outcome.message}", file=sys.stderr)
    if not any((Path(args.out) / o.run.dir / "metrics.jsonl").exists() for o in outcomes):
        print("no run wrote any metrics, so there is nothing to report", file=sys.stderr)
    elif not args.no_report:
        from driftlab.experiments.report import make_report

        report_dir = Path(args.out) / "report"
        report = make_report([args.out], report_dir, force=args.force)
        print(report.markdown)
        print(f"report: {report_dir / 'report.md'}")
    return 1 if failed else 0


def _data_command(args: argparse.Namespace) -> int:
    from driftlab.data import registry as data_sets
    from driftlab.data.download import NOT_DOWNLOADABLE
    from driftlab.experiments.config import PARTITIONS, load_config
    from driftlab.experiments.run.datasets import build_dataset, data_location, data_search_paths
    from driftlab.models import registry as model_registry

    if args.data_command == "list":
        print("data sets (data.name), and whether their files are where data.root's default looks:")
        for name in data_sets.REGISTRY.names():  # the built-ins, then installed plugins (entry point driftlab.datasets)
            info = data_sets.REGISTRY.entries[name]
            origin = f" ({data_sets.REGISTRY.describe(info)})" if data_sets.REGISTRY.is_plugin(info) else ""
            print(f"  {name:18s} {info.description}{origin}")
            if info.location:
                looked = data_search_paths(info.location)
                found = next((path for path in looked if path.exists()), None)
                state = f"present: {found}" if found else f"missing: looked in {', '.join(map(str, looked))}"
                print(f"  {'':18s} [{state}]")
        print("  (files elsewhere: data.root=PATH, or DRIFTLAB_DATA=DIR holding the folders named above)")
        print("partitions (data.partition): " + ", ".join(PARTITIONS))
        print("models (model.name): " + ", ".join(model_registry.names()))
        print("downloadable (driftlab data download NAME --to DIR): " + ", ".join(sorted(data_sets.downloads())))
        for name, reason in NOT_DOWNLOADABLE.items():
            print(f"  {name}: {reason}")
        return 0
    if args.data_command == "describe":
        config = load_config(args.config, args.overrides)
        dataset = build_dataset(config.data, config.seed)
        print(f"data set: {config.data.name}   files: {data_location(config.data) or 'generated'}")
        for key, value in dataset.describe().items():
            print(f"  {key}: {value}")
        return 0
    if args.data_command == "download":
        from driftlab.data.download import DownloadError, download

        try:
            for path in download(args.name, args.to, registry=data_sets.downloads(), force=args.force):
                print(path)
        except DownloadError as error:
            print(f"driftlab: error: {error}", file=sys.stderr)
            return 1
        return 0
    raise AssertionError(args.data_command)


if __name__ == "__main__":
    sys.exit(main())
