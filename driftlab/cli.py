"""The ``driftlab`` command line.

    driftlab demo                                   every algorithm on synthetic(1,1): table + plot
    driftlab run CONFIG [key=value ...] --out DIR   one experiment (CONFIG: a .toml/.json file or a preset)
    driftlab run CONFIG --out DIR --resume          continue an interrupted run exactly
    driftlab config [CONFIG] [key=value ...]        list every key, or print a resolved config
    driftlab presets                                list the shipped presets
    driftlab data list                              the data sets, partitions and models a config can name
    driftlab data describe CONFIG [key=value ...]   clients, samples per client, classes holding 80% of a client's data
    driftlab data download NAME --to DIR            fetch official files (checksummed, resumable); never needed for tests
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from driftlab.data.federated import DataFileError
from driftlab.experiments.datasets import DataSetupError
from driftlab.experiments.config import ConfigError, describe_keys, load_config, preset_names
from driftlab.simulation.checkpoint import CheckpointError

EPILOG_RUN = """examples:
  driftlab run synthetic-fedavg --out runs/fedavg
  driftlab run synthetic-fedavg client.lr=0.05 sampling.participation=0.2 --out runs/lr05
  driftlab run mnist-fedadam data.root=/data/mnist server.lr=0.01 --out runs/fedadam
  driftlab run runs/fedavg/config.json --out runs/fedavg --resume

overrides are section.key=value with TOML values; `driftlab config` lists every key."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="driftlab", description="Federated optimization simulator: FedAvg, FedOpt and drift-correcting algorithms.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="compare every algorithm on the built-in synthetic(1,1) default (about a minute)")
    demo.add_argument("overrides", nargs="*", metavar="key=value", help="overrides applied to every demo run, e.g. rounds=30")
    demo.add_argument("--out", default="driftlab-demo", help="output directory (default: driftlab-demo)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")

    run = commands.add_parser(
        "run",
        help="run one experiment",
        description="Run one experiment and write its config, per-round metrics and checkpoints to --out.",
        epilog=EPILOG_RUN + "\n\nconfiguration keys:\n" + describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("config", help="a config file (.toml or .json) or a preset name (see `driftlab presets`)")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="overrides such as client.lr=0.05")
    run.add_argument("--out", required=True, help="output directory: config.json, metrics.jsonl, checkpoints")
    run.add_argument("--resume", action="store_true", help="continue the interrupted run in --out from its checkpoint")
    run.add_argument("--quiet", action="store_true", help="no progress bar")

    config = commands.add_parser("config", help="list every configuration key, or print a resolved configuration")
    config.add_argument("config", nargs="?", help="a config file or preset to resolve")
    config.add_argument("overrides", nargs="*", metavar="key=value")

    commands.add_parser("presets", help="list the shipped presets")

    data = commands.add_parser("data", help="data sets: list, describe a partition, download official files")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    data_commands.add_parser("list", help="data sets, partitions and models a config can name")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (ConfigError, DataFileError, DataSetupError, CheckpointError) as error:
        print(f"driftlab: error: {error}", file=sys.stderr)
        return 2
    except FloatingPointError as error:
        # A diverged run: its metrics and the checkpoint of the last finite round stay in --out for inspection.
        print(f"driftlab: error: {error}; metrics and the last finite round's checkpoint are kept in --out", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("driftlab: interrupted; the last completed round is checkpointed, continue with --resume", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "presets":
        print("\n".join(preset_names()))
        return 0
    if args.command == "config":
        if args.config is not None and "=" in args.config and not Path(args.config).exists():
            # `driftlab config client.lr=0.5`: an override, not a config file; resolve it on the defaults
            args.config, args.overrides = None, [args.config, *args.overrides]
        if args.config is None and not args.overrides:
            print(describe_keys())
        else:
            print(json.dumps(load_config(args.config, args.overrides).to_dict(), indent=2))
        return 0

    if args.command == "data":
        return _data_command(args)

    from driftlab.experiments.runner import install_termination_handler, run

    install_termination_handler()
    if args.command == "run":
        config = load_config(args.config, args.overrides)
        result = run(config, args.out, resume=args.resume, progress=not args.quiet)
        print(json.dumps(result.summary, indent=2))
        print(f"metrics: {args.out}/metrics.jsonl")
        return 0
    if args.command == "demo":
        from driftlab.experiments.demo import run_demo, summary_table

        results = run_demo(args.out, tuple(args.overrides), progress=not args.quiet)
        print()
        print(summary_table(results))
        print(f"\nplot: {args.out}/accuracy.png   table: {args.out}/summary.md   per-round metrics: {args.out}/<algorithm>/metrics.jsonl")
        return 0
    raise AssertionError(args.command)


def _data_command(args: argparse.Namespace) -> int:
    from driftlab.data.download import NOT_DOWNLOADABLE, dataset_names
    from driftlab.experiments.config import PARTITIONS
    from driftlab.experiments.datasets import DATA_SETS, build_dataset, data_location
    from driftlab.models import MODEL_NAMES

    if args.data_command == "list":
        print("data sets (data.name):")
        for name, info in DATA_SETS.items():
            where = f"  [default files: ../shared/data/{info.default_location}]" if info.default_location else ""
            print(f"  {name:18s} {info.description}{where}")
        print("partitions (data.partition): " + ", ".join(PARTITIONS))
        print("models (model.name): " + ", ".join(MODEL_NAMES))
        print("downloadable (driftlab data download NAME --to DIR): " + ", ".join(dataset_names()))
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
            for path in download(args.name, args.to):
                print(path)
        except DownloadError as error:
            print(f"driftlab: error: {error}", file=sys.stderr)
            return 1
        return 0
    raise AssertionError(args.data_command)


if __name__ == "__main__":
    sys.exit(main())
