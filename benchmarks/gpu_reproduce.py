"""The second prepared GPU command: a shipped reproduction sweep at paper scale, all its runs at once on one GPU.

FedDyn Table 1 (``feddyn-cifar10-partial``: CIFAR-10, 100 clients of 500 images,
10% participation, IID and Dirichlet 0.3, FedDyn, SCAFFOLD, FedAvg and FedProx)
at ``--scale paper`` (1,000 rounds), with one learning-rate decay (``--decay``,
default 0.998, the issue's setting and the ``cifar10-feddyn`` preset's) in
place of the sweep's decay axis: eight runs, each its own process
(``--jobs``, default all of them), sharing the GPU's memory budget
(``DRIFTLAB_GPU_SHARE``, set by the local executor).  The sweep runs until it
ends or until ``--budget`` seconds have passed; then it is stopped (SIGTERM,
then SIGKILL) and what every run reached is read from its ``metrics.jsonl``.

Output, in ``--out`` (at most 8 files, as the device tool returns them):
``summary.json`` (per run: rounds done, the rate in rounds per second of wall
clock and the median ``round_seconds``, the last and best test accuracy, the
round each target was reached; also printed as the last line), ``sweep.toml``
(the sweep as run) and ``runs.tar.gz`` (every run's ``metrics.jsonl`` and
``config.json``, and the report's tables when the sweep finished).

Usage (on the GPU machine, from the checkout, data copied into an ignored folder)::

    DRIFTLAB_DATA=.gpudata python benchmarks/gpu_reproduce.py --out $OUT/table1 --budget 500
    python benchmarks/gpu_reproduce.py --quick --out /tmp/table1      # on a CPU: two tiny rounds per run, tests the script
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from driftlab.experiments.config.toml_writer import to_toml  # noqa: E402 - the checkout's driftlab, on the path above

DECAY_AXIS = "lr decay"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for summary.json, sweep.toml and runs.tar.gz (created)"
    )
    parser.add_argument(
        "--sweep", default="feddyn-cifar10-partial", help="a shipped sweep (default feddyn-cifar10-partial)"
    )
    parser.add_argument(
        "--scale", default="paper", help="the sweep's scale (default paper; 'none' for its default scale)"
    )
    parser.add_argument(
        "--decay", type=float, default=0.998, help="the one lr decay per round run in place of the decay axis"
    )
    parser.add_argument("--budget", type=float, default=500.0, help="seconds before the sweep is stopped (default 500)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once (default: every run of the sweep)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    parser.add_argument("--device", default=None, help="device of every run (default cuda when there is one, else cpu)")
    parser.add_argument(
        "--runs",
        type=Path,
        default=None,
        help="the sweep's folder (default runs/gpu-reproduce/<sweep>-decay-<decay> in the checkout: a second call on the "
        "same machine resumes it)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 rounds per run at the sweep's default scale: tests this script"
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run, after the sweep's own")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the sweep as run


def one_decay(sweep: dict[str, Any], decay: float) -> dict[str, Any]:
    """The sweep with its lr-decay axis replaced by one decay (``client.lr`` exponential from the preset's 0.1)."""
    axes = [axis for axis in sweep.get("axes", []) if axis.get("name") != DECAY_AXIS]
    if len(axes) == len(sweep.get("axes", [])):
        return sweep
    lr = "client.lr=0.1" if decay == 1 else f'client.lr={{kind="exponential", initial=0.1, decay={decay}}}'
    description = (
        f"{sweep.get('description', '').strip()}\n\nRun by benchmarks/gpu_reproduce.py with one lr decay, {decay}."
    )
    return {**sweep, "description": description, "overrides": [*sweep.get("overrides", []), lr], "axes": axes}


# ---------------------------------------------------------------- what the runs reached


def run_metrics(runs_dir: Path) -> dict[str, Path]:
    """Each run's ``metrics.jsonl``, by its path under ``runs/`` (setting/method/seed, or method/seed)."""
    return {
        str(p.parent.relative_to(runs_dir / "runs")): p for p in sorted(runs_dir.glob("runs/**/seed-*/metrics.jsonl"))
    }


def read_records(metrics: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def rounds_done(metrics: Path) -> int:
    records = read_records(metrics)
    return records[-1]["round"] if records else 0


def run_summary(metrics: Path, targets: list[float], wall_seconds: float, rounds_before: int = 0) -> dict[str, Any]:
    """What one run reached; its rate counts the rounds of this call only (a resumed sweep had ``rounds_before``)."""
    records = read_records(metrics)
    evaluated = [r for r in records if "test_accuracy" in r]
    seconds = sorted(r["round_seconds"] for r in records if "round_seconds" in r)
    reached = {}
    for target in targets:
        hit = next((r["round"] for r in evaluated if r["test_accuracy"] >= target), None)
        reached[f"{target:g}"] = hit
    return {
        "rounds": records[-1]["round"] if records else 0,
        "rounds_this_call": (records[-1]["round"] if records else 0) - rounds_before,
        "rounds_per_second": round(((records[-1]["round"] if records else 0) - rounds_before) / wall_seconds, 3)
        if wall_seconds > 0
        else None,
        "median_round_seconds": seconds[len(seconds) // 2] if seconds else None,
        "last_test_accuracy": evaluated[-1]["test_accuracy"] if evaluated else None,
        "best_test_accuracy": max((r["test_accuracy"] for r in evaluated), default=None),
        "round_of_target": reached,
        "accuracy_every_100": {r["round"]: round(r["test_accuracy"], 4) for r in evaluated if r["round"] % 100 == 0},
    }


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the sweep's process group (its runs write a checkpoint and stop), SIGKILL if they linger."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from driftlab.experiments.sweep.shipped import sweep_names, sweep_text

    if args.sweep not in sweep_names():
        print(
            f"gpu_reproduce.py: error: --sweep {args.sweep!r} is not a shipped sweep; choose one of {', '.join(sweep_names())}",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sweep = one_decay(tomllib.loads(sweep_text(args.sweep)), args.decay)
    (args.out / "sweep.toml").write_text(to_toml(sweep))
    runs_dir = args.runs or REPOSITORY / "runs" / "gpu-reproduce" / f"{args.sweep}-decay-{args.decay:g}"
    before = {name: rounds_done(path) for name, path in run_metrics(runs_dir).items()}
    extra = ["rounds=2", "evaluation.every=1"] if args.quick else []
    scale = [] if args.quick or args.scale == "none" else ["--scale", args.scale]
    command = [
        sys.executable,
        "-m",
        "driftlab.cli",
        "sweep",
        str(args.out / "sweep.toml"),
        "--out",
        str(runs_dir),
        *scale,
        "--threads",
        str(args.threads),
        *(["--jobs", str(args.jobs)] if args.jobs else ["--jobs", "64"]),
        f"device={device}",
        *extra,
        *args.overrides,
    ]
    started = time.monotonic()
    with open(args.out / "log.txt", "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(
            command,
            cwd=REPOSITORY,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            process.wait(timeout=args.budget)
            status = "finished" if process.returncode == 0 else f"failed (exit {process.returncode})"
        except subprocess.TimeoutExpired:
            stop(process)
            status = f"stopped after the budget of {args.budget:.0f} s"
    wall = time.monotonic() - started
    targets = [float(t) for t in sweep.get("targets", [])]
    runs = {name: run_summary(path, targets, wall, before.get(name, 0)) for name, path in run_metrics(runs_dir).items()}
    with tarfile.open(args.out / "runs.tar.gz", "w:gz") as archive:
        for path in sorted(runs_dir.glob("runs/**/seed-*/*")):
            if path.name in ("metrics.jsonl", "config.json", "run.json"):
                archive.add(path, arcname=str(path.relative_to(runs_dir)))
        for path in sorted(runs_dir.glob("report/*")):
            if path.suffix in (".md", ".csv", ".json"):
                archive.add(path, arcname=str(path.relative_to(runs_dir)))
    summary = {
        "sweep": args.sweep,
        "scale": None if args.quick else args.scale,
        "decay": args.decay,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "status": status,
        "wall_seconds": round(wall, 1),
        "runs_dir": str(runs_dir),
        "command": " ".join(command),
        "runs": runs,
        "commit": os.environ.get("DRIFTLAB_COMMIT"),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"sweep folder: {runs_dir}")
    print(f"{summary['gpu'] or device}: {status} after {wall:.0f} s")
    for name, run in runs.items():
        print(
            f"  {name:<40} {run['rounds']:>5} rounds  {run['median_round_seconds'] or 0:.3f} s/round  acc {run['last_test_accuracy']}"
        )
    print(json.dumps(summary, separators=(",", ":")))
    return 0 if status == "finished" or status.startswith("stopped") else 1


if __name__ == "__main__":
    sys.exit(main())
