"""``driftlab sweep``: a sweep's runs planned, run in parallel (resumable) and reported, or where they stand
(``--status``); exit code EXIT_RUNS_HELD while other live processes hold some of its runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from driftlab.cli_parser import _trackers_option
from driftlab.errors import ConfigError

EXIT_RUNS_HELD = 4  # `driftlab sweep`: some runs are held by other live processes, so the sweep is not finished


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
