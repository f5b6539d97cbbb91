"""The ``driftlab`` command line's grammar: its commands and options as argparse parsers (each command's ``--help``),
``key=value`` overrides taken wherever they stand after the command, and the values of the options that hold lists."""

from __future__ import annotations

import argparse

from driftlab.errors import ConfigError

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


def _documented(commands, name: str, summary: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A command whose ``--help`` prints its description and its examples (``epilog``) as they are written."""
    return commands.add_parser(
        name, help=summary, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


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

    run = _documented(
        commands,
        "run",
        "run one experiment",
        "Run one experiment and write its config, per-round metrics and checkpoints to --out.",
        EPILOG_RUN,
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

    sweep = _documented(
        commands,
        "sweep",
        "run a grid of configs x seeds in parallel processes (resumable), then report",
        "Run every config of a sweep (a grid of labelled variants times seeds) in parallel processes, "
        "write each run to DIR/runs/<setting>/<method>/seed-<s>/ and a report to DIR/report/.",
        EPILOG_SWEEP,
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

    report = _documented(
        commands,
        "report",
        "tables and plots from run and sweep directories",
        "Communication to reach target accuracies (FedDyn Tables 1-2), accuracy mean ± std over seeds, "
        "local SGD steps, run info, and plots, from run directories, sweep directories or folders holding runs.",
        EPILOG_REPORT,
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

    from driftlab.experiments.reproduce import command as reproduce  # standard library only: no torch for --help

    reproduce.add_arguments(_documented(commands, "reproduce", reproduce.HELP, reproduce.DESCRIPTION, reproduce.EPILOG))

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


def _float_list(text: str, option: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated numbers such as 0.95,0.972, got {text!r}") from None
