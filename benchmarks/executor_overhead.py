"""Start-up and per-run overhead of each sweep executor, next to local processes.

Runs the same tiny 4-run sweep (synthetic, 6 clients, 3 rounds, one thread per run)
through each executor, ``--repeats`` times, each time into a fresh directory:

* ``local``               2 local processes (``--jobs 2``);
* ``slurm --slurm-local`` submitit's local executor (the same jobs as on a cluster, as processes here);
* ``ray (new local Ray)`` no cluster running: the sweep starts a local Ray and stops it;
* ``ray (running Ray)``   a local Ray of 2 CPUs already running (as on a cluster).

A 1-run sweep of the same config gives the start-up (from calling ``run_sweep`` to
the run started or submitted: planning, connecting to or starting Ray, building the
submission) and the per-run overhead (from the sweep starting or submitting the run to
the sweep seeing it finished, minus the seconds its round loop took, ``run.json``
``wall_seconds``: interpreter start, imports, data, scheduling, result polling), with
no run queued behind another. The 4-run sweep's wall time shows the throughput: local
and Ray run 2 at a time (2 processes, 2 CPUs); submitit's local executor starts all 4
jobs at once. Medians over repeats.

Usage:
    python benchmarks/executor_overhead.py               # 3 repeats
    python benchmarks/executor_overhead.py --repeats 5

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

OVERRIDES = ["data.num_clients=6", "client.epochs=1", "sampling.participation=0.5", "evaluation.every=1", "rounds=3"]


def measure(options, out: Path, mus: str = "[0, 1]", seeds: tuple[int, ...] = (0, 1)) -> dict:
    from driftlab.experiments.run.runner import read_run_info
    from driftlab.experiments.sweep import run_sweep, sweep_from_config
    from driftlab.experiments.sweep.execution import _name

    spec = sweep_from_config("synthetic-fedprox", [f"algorithm.mu={mus}"], list(seeds), name="overhead")
    started: dict[str, float] = {}
    finished: dict[str, float] = {}

    def log(line: str) -> None:
        now = time.perf_counter()
        begun = re.match(r"\s+(?:start|submit)\s+(.+?)(?:\s\s\(|$)", line)
        ended = re.match(r"\s+complete\s+(.+?)\s\s\[", line)
        if begun:
            started[begun.group(1)] = now
        elif ended:
            finished[ended.group(1)] = now

    began = time.perf_counter()
    outcomes = run_sweep(spec, out, extra_overrides=OVERRIDES, executor=options, threads=1, log=log)
    total = time.perf_counter() - began
    if any(o.status != "complete" for o in outcomes):
        raise SystemExit(f"{options.name}: not every run completed: {[(o.status, o.message) for o in outcomes]}")
    overheads = [
        finished[_name(o.run)] - started[_name(o.run)] - read_run_info(out / o.run.dir)["wall_seconds"]
        for o in outcomes
    ]
    return {"startup_s": min(started.values()) - began, "total_s": total, "per_run_overhead_s": overheads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from driftlab.executors import ExecutorOptions

    variants = [
        ("local", ExecutorOptions("local", jobs=2), None),
        ("slurm --slurm-local", ExecutorOptions("slurm", slurm_local=True), None),
    ]
    try:
        import ray
    except ImportError:
        ray = None
    if ray is not None:
        variants += [
            ("ray (new local Ray)", ExecutorOptions("ray"), None),
            ("ray (running Ray)", ExecutorOptions("ray"), "running"),
        ]
    results = {}
    with tempfile.TemporaryDirectory(prefix="driftlab-executors-") as folder:
        for name, options, ray_mode in variants:
            if ray_mode == "running":
                ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                samples, singles = [], []
                for i in range(args.repeats):
                    singles.append(
                        measure(options, Path(folder) / f"{name.split()[0]}-{ray_mode}-one-{i}", "[0]", (0,))
                    )
                    samples.append(measure(options, Path(folder) / f"{name.split()[0]}-{ray_mode}-{i}"))
            finally:
                if ray_mode == "running":
                    ray.shutdown()
            results[name] = {
                "startup_s": statistics.median(s["startup_s"] for s in singles),
                "per_run_overhead_s": statistics.median(s["per_run_overhead_s"][0] for s in singles),
                "total_s": statistics.median(s["total_s"] for s in samples),
                "one_run_sweeps": singles,
                "four_run_sweeps": samples,
            }
            print(f"{name}: done", file=sys.stderr)
    local = results["local"]
    print(f"{'executor':<22s} {'start-up s':>10s} {'4-run sweep s':>14s} {'per-run overhead s':>19s} {'vs local':>9s}")
    for name, r in results.items():
        ratio = r["per_run_overhead_s"] / local["per_run_overhead_s"]
        print(
            f"{name:<22s} {r['startup_s']:>10.2f} {r['total_s']:>14.2f} {r['per_run_overhead_s']:>19.2f} {ratio:>8.1f}x"
        )
    print(json.dumps({"repeats": args.repeats, "executors": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
