"""The ``driftlab`` command line.

    driftlab demo                                   every algorithm on synthetic(1,1): table + plot
    driftlab run CONFIG [key=value ...] --out DIR   one experiment (CONFIG: a .toml/.json file or a preset)
    driftlab run CONFIG --out DIR --resume          continue an interrupted run exactly
    driftlab config [CONFIG] [key=value ...]        list every key, or print a resolved config
    driftlab sweep SWEEP --out DIR                  a grid of runs x seeds in parallel processes, resumable
    driftlab report DIR [DIR ...] --out REPORT      tables (Markdown, CSV) and plots from runs and sweeps
    driftlab presets                                list the shipped presets and sweeps
    driftlab data list                              the data sets, partitions and models a config can name
    driftlab data describe CONFIG [key=value ...]   clients, samples per client, classes holding 80% of a client's data
    driftlab data download NAME --to DIR            fetch official files (checksummed, resumable); never needed for tests
"""

from __future__ import annotations

import argparse
import json
import os
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

EPILOG_SWEEP = """examples:
  driftlab sweep fedprox-figure1 --out runs/fedprox-figure1            a shipped sweep (see `driftlab presets`)
  driftlab sweep fedprox-figure1 --scale paper --out runs/fedprox-paper  the paper's full scale
  driftlab sweep synthetic-fedprox --grid 'algorithm.mu=[0, 0.01, 1]' --seeds 0,1,2 --out runs/mu
  driftlab sweep mnist-fedavg --grid algorithm.name=fedavg,scaffold --grid data.partition=iid,dirichlet --out runs/grid
  driftlab sweep my-sweep.toml rounds=20 --jobs 1 --out runs/mine      key=value applies to every run

Running the same command again skips finished runs and resumes interrupted ones from their
checkpoints. A sweep file has base, overrides, seeds, targets, [scales.NAME] and [[axes]] with
labelled values: the README shows one, and docs/reproduction.md the shipped ones and their results."""

EPILOG_REPORT = """examples:
  driftlab report runs/fedprox-figure1 --out reports/fedprox-figure1
  driftlab report runs/fedavg runs/feddyn --targets 0.95,0.97 --out reports/mnist

writes report.md, targets.csv, accuracy.csv, steps.csv and PNG plots to --out."""


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

    sweep = commands.add_parser(
        "sweep",
        help="run a grid of configs x seeds in parallel processes (resumable), then report",
        description="Run every config of a sweep (a grid of labelled variants times seeds) in parallel processes, "
        "write each run to DIR/runs/<setting>/<method>/seed-<s>/ and a report to DIR/report/.",
        epilog=EPILOG_SWEEP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument("sweep", help="a shipped sweep (see `driftlab presets`), a sweep .toml file, or a config/preset to grid over with --grid")
    sweep.add_argument("overrides", nargs="*", metavar="key=value", help="overrides applied to every run, after the sweep's own")
    sweep.add_argument("--out", required=True, help="sweep directory (created; reused to resume)")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=VALUES", help="an axis: KEY=[v1, v2] (TOML list) or KEY=v1,v2; repeatable")
    sweep.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2 (default: the sweep's seeds, or 0)")
    sweep.add_argument("--scale", help="a named scale of the sweep file, e.g. paper (the paper's full scale)")
    sweep.add_argument("--jobs", type=int, help="parallel processes (default: the number of cores)")
    sweep.add_argument("--retry-diverged", action="store_true", help="run diverged runs again (they are skipped by default: reruns are identical)")
    sweep.add_argument("--dry-run", action="store_true", help="list the runs and their status without running anything")
    sweep.add_argument("--no-report", action="store_true", help="do not write DIR/report when the sweep ends")

    report = commands.add_parser(
        "report",
        help="tables and plots from run and sweep directories",
        description="Communication to reach target accuracies (FedDyn Tables 1-2), accuracy mean ± std over seeds, "
        "local SGD steps, run info, and plots, from run directories, sweep directories or folders holding runs.",
        epilog=EPILOG_REPORT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("inputs", nargs="+", metavar="DIR", help="run directories, sweep directories, or folders containing runs")
    report.add_argument("--out", required=True, help="report directory: report.md, CSV files, PNG plots")
    report.add_argument("--targets", help="comma-separated target accuracies, e.g. 0.95,0.972 (default: the sweep's or the runs' targets)")
    report.add_argument("--steps-reference", help="method label the local SGD steps are compared with (default: the constant-K method)")
    report.add_argument("--no-plots", action="store_true", help="tables only")

    commands.add_parser("presets", help="list the shipped presets and sweeps")

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
    except BrokenPipeError:
        # `driftlab sweep ... --dry-run | head`: the reader left; say nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "presets":
        from driftlab.experiments.sweep import load_sweep, sweep_names

        print("configs (driftlab run NAME --out DIR):")
        print("\n".join(f"  {name}" for name in preset_names()))
        print("sweeps (driftlab sweep NAME --out DIR):")
        for name in sweep_names():
            print(f"  {name:28s} {load_sweep(name).description.splitlines()[0] if load_sweep(name).description else ''}")
        return 0
    if args.command == "report":
        from driftlab.experiments.report import make_report

        targets = _float_list(args.targets, "--targets") if args.targets else None
        report = make_report(args.inputs, args.out, targets=targets, steps_reference=args.steps_reference, plots=not args.no_plots)
        print(report.markdown)
        print(f"report: {Path(args.out) / 'report.md'}")
        return 0
    if args.command == "sweep":
        return _sweep_command(args)
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


def _float_list(text: str, option: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated numbers such as 0.95,0.972, got {text!r}") from None


def _sweep_command(args: argparse.Namespace) -> int:
    from driftlab.experiments.sweep import is_sweep_source, load_sweep, plan, run_status, run_sweep, sweep_from_config, sweep_names, validate_seeds

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
            raise ConfigError(f"{args.sweep} is a sweep file: add axes to it instead of --grid (or pass a config/preset with --grid)")
        if seeds is not None:
            import dataclasses

            spec = dataclasses.replace(spec, seeds=tuple(seeds), scales={k: dataclasses.replace(v, seeds=None) for k, v in spec.scales.items()})
    else:
        spec = sweep_from_config(args.sweep, args.grid, seeds or [0], name=Path(args.out).name or "sweep")
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {args.jobs}")
    if args.dry_run:
        for r in plan(spec, args.scale, args.overrides):
            print(f"{run_status(Path(args.out) / r.dir, r.config.rounds):<12s} {r.dir}   {' '.join(r.overrides)}")
        return 0
    from driftlab.experiments.runner import install_termination_handler

    install_termination_handler()
    try:
        outcomes = run_sweep(spec, args.out, jobs=args.jobs, scale=args.scale, extra_overrides=args.overrides, retry_diverged=args.retry_diverged)
    except KeyboardInterrupt:
        print("driftlab: sweep interrupted; every run checkpointed its last completed round: run the same command again to resume", file=sys.stderr)
        return 130
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    print("sweep finished: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    failed = [o for o in outcomes if o.status == "failed"]
    for outcome in failed:
        print(f"  failed: {outcome.run.dir}: {outcome.message}", file=sys.stderr)
    if not any((Path(args.out) / o.run.dir / "metrics.jsonl").exists() for o in outcomes):
        print("no run wrote any metrics, so there is nothing to report", file=sys.stderr)
    elif not args.no_report:
        from driftlab.experiments.report import make_report

        report_dir = Path(args.out) / "report"
        report = make_report([args.out], report_dir)
        print(report.markdown)
        print(f"report: {report_dir / 'report.md'}")
    return 1 if failed else 0


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
