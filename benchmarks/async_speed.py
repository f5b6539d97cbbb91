"""Wall time of asynchronous FedBuff against synchronous rounds on the MLP standard workload (issue 28).

Workload: the MLP standard workload of issue 3 (``mlp_benchmarks.py``): 100 clients x 600 MNIST
samples (real MNIST from ../shared/data/mnist when present, else random data of its shape),
MLP 784-200-200-10, SGD lr 0.1, batch 50, 5 local epochs, FedAvg with uniform aggregation,
vectorized backend, ``[system]`` with the default lognormal devices (the same devices in every
row: they are drawn from (seed, client id)).  Three rows, built from the same data in one
process and timed side by side:

* ``untimed``      — synchronous rounds of 10 clients without ``[system]`` (what a round cost before issue 28);
* ``synchronous``  — the same rounds with ``[system]``: each round also plans its clients' download,
  compute and upload times and advances the simulated clock;
* ``asynchronous`` — FedBuff (``[asynchronous]``): C = 100 clients in flight, a server update every
  B = 10 arrivals (``simulation.asynchronous.engine.run_update``; training lazy and batched by the
  model version a client started from).

A row's unit of work is a block of 10 rounds (synchronous rows) or 10 server updates (FedBuff),
the same number of folded client messages, 100, in each.  The first block of every row is a
warm-up and is not timed: it holds FedBuff's start, where all C clients dispatched at time 0 train
together.  Then the rows take turns, block by block, the first row alternating, so that a slow
minute of a shared machine falls on all rows.  Each block counts the clients its backend trained
(a wrapper around ``sim.backend``): a synchronous round trains the 10 clients it folds; FedBuff
trains each dispatched client once, in batches of the clients dispatched from one model version.

Reported per row: the median seconds per block, the median seconds per client trained
(block seconds / clients trained in that block), for FedBuff the simulated events per second
(arrivals processed, each with its slot's refill dispatch, per wall second) and the simulated
seconds a block covers; and the ratio of FedBuff's per-client cost to the synchronous row's, against
the issue's goal of at most 1.5.

The last line printed is one JSON object with every number: ``rows`` (per row: ``block_seconds``,
``clients_trained``, ``backend_calls``, ``arrivals``, ``dispatches``, ``simulated_seconds``, medians),
``ratio_per_client`` (asynchronous / synchronous), ``ratio_per_client_untimed`` (asynchronous / untimed),
``timing_overhead`` (synchronous / untimed, per client), ``within_goal``, ``machine``, ``device``,
``workload``, ``data``.

Usage:
    python benchmarks/async_speed.py            # 7 timed blocks per row (about a minute on 2 cores)
    python benchmarks/async_speed.py --blocks 11
    python benchmarks/async_speed.py --quick    # a tiny smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # mlp_benchmarks, beside this file
import mlp_benchmarks  # after the path: the workload, its data and the machine description come from it

GOAL = 1.5  # the goal: FedBuff's wall time per client trained at most 1.5x a synchronous round's
ROWS = ("untimed", "synchronous", "asynchronous")
UPDATES_PER_BLOCK = 10


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, random data, 2 timed blocks: a smoke run")
    parser.add_argument(
        "--blocks", type=int, default=None, help="timed blocks per row after one warm-up (default 7; quick 2)"
    )
    parser.add_argument("--num-clients", type=int, default=None, help="default 100 (quick 8)")
    parser.add_argument("--samples", type=int, default=None, help="samples per client (default 600; quick 60)")
    parser.add_argument("--epochs", type=int, default=None, help="local epochs (default 5; quick 1)")
    parser.add_argument("--concurrency", type=int, default=None, help="FedBuff's C (default 100; quick 8)")
    parser.add_argument(
        "--buffer", type=int, default=None, help="FedBuff's B = the synchronous cohort (default 10; quick 2)"
    )
    parser.add_argument(
        "--random-data", action="store_true", help="random data of MNIST's shape even where MNIST is present"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    mlp_benchmarks.settle_mlp_options(
        parser,
        args,
        quick={"blocks": 2, "num_clients": 8, "samples": 60, "epochs": 1, "concurrency": 8, "buffer": 2},
        full={"blocks": 7, "num_clients": 100, "samples": 600, "epochs": 5, "concurrency": 100, "buffer": 10},
    )
    if args.concurrency > args.num_clients:
        parser.error(
            f"--concurrency {args.concurrency} is more than the {args.num_clients} clients: at most every client trains at once"
        )
    if args.buffer > args.concurrency:
        parser.error(
            f"--buffer {args.buffer} is more than --concurrency {args.concurrency}: the buffer could never fill"
        )
    return args


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **mlp_benchmarks.mlp_workload(args),
        "algorithm": "fedavg (uniform aggregation)",
        "clients_per_round": args.buffer,
        "concurrency": args.concurrency,
        "buffer": args.buffer,
        "updates_per_block": UPDATES_PER_BLOCK,
        "timed_blocks": args.blocks,
        "warmup_blocks": 1,
        "system": system_section(),
        "threads": torch.get_num_threads(),
    }


def system_section() -> dict[str, Any]:
    """``[system]`` of the timed rows: the default lognormal devices (FedScale's model; medians and σ the defaults)."""
    return {"profiles": "lognormal"}


class CountingBackend:
    """``sim.backend`` that counts the clients it is asked to train and its calls, then trains them as the inner one does."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, getattr(inner, "name", type(inner).__name__)
        self.clients = 0
        self.calls = 0

    def train(self, model: Any, start_params: torch.Tensor, tasks: Any, settings: Any, data: Any) -> Iterator[Any]:
        self.clients += len(tasks)
        self.calls += 1
        yield from self.inner.train(model, start_params, tasks, settings, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def build_rows(args: argparse.Namespace, data_section: dict[str, Any]) -> dict[str, tuple]:
    """(simulation, state) of each row: the same config; ``[system]`` added to the timed ones, ``[asynchronous]`` to FedBuff."""
    from driftlab.experiments.config import load_config
    from driftlab.experiments.run.assembly import build_simulation

    table = mlp_benchmarks.mlp_config(args, data_section, rounds=100_000)
    # FedBuff keeps the default sampling (it samples nobody); the synchronous rows draw B clients per round
    cohort = {"participation": args.buffer / args.num_clients}
    tables = {
        "untimed": {**table, "sampling": cohort},
        "synchronous": {**table, "sampling": cohort, "system": system_section()},
        "asynchronous": {
            **table,
            "system": system_section(),
            "asynchronous": {"concurrency": args.concurrency, "buffer": args.buffer},
        },
    }
    rows = {}
    for row in ROWS:
        sim, state = build_simulation(load_config(tables[row]))
        sim.backend = CountingBackend(sim.backend)
        rows[row] = (sim, state)
    return rows


def run_block(row: str, sim: Any, state: Any) -> tuple[Any, dict[str, Any]]:
    """``UPDATES_PER_BLOCK`` rounds or server updates (no evaluation), committed as a run commits them; what they cost."""
    from driftlab.simulation.asynchronous.engine import run_update
    from driftlab.simulation.round.engine import commit_round, run_round

    backend = sim.backend
    clients, calls = backend.clients, backend.calls
    records = []
    started = time.perf_counter()
    for _ in range(UPDATES_PER_BLOCK):
        if row == "asynchronous":
            state, record = run_update(sim, state)
            commit_round(state)
        else:
            state, record = run_round(sim, state)
        records.append(record)
    seconds = time.perf_counter() - started
    timed = "time_start" in records[0]
    block = {
        "seconds": seconds,
        "clients_trained": backend.clients - clients,
        "backend_calls": backend.calls - calls,
        "arrivals": sum(r["num_reporting"] for r in records),
        "dispatches": sum(r.get("num_dispatched", 0) for r in records),
        "simulated_seconds": records[-1]["time_end"] - records[0]["time_start"] if timed else None,
        "mean_staleness": statistics.fmean(r["mean_staleness"] for r in records)
        if "mean_staleness" in records[0]
        else None,
    }
    return state, block


def measure(args: argparse.Namespace, data_section: dict[str, Any]) -> dict[str, Any]:
    """Every row, block by block after one warm-up block each, the first row alternating."""
    rows = build_rows(args, data_section)
    states = {row: rows[row][1] for row in ROWS}
    blocks: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    warmup: dict[str, dict[str, Any]] = {}
    for repetition in range(1 + args.blocks):
        order = ROWS if repetition % 2 == 0 else ROWS[::-1]  # alternate who goes first: drift falls on every row
        for row in order:
            states[row], block = run_block(row, rows[row][0], states[row])
            if repetition == 0:
                warmup[row] = block
            else:
                blocks[row].append(block)
    results = {}
    for row in ROWS:
        timed = blocks[row]
        per_client = [b["seconds"] / b["clients_trained"] for b in timed]
        entry = {
            "block_seconds": [b["seconds"] for b in timed],
            "clients_trained": [b["clients_trained"] for b in timed],
            "backend_calls": [b["backend_calls"] for b in timed],
            "arrivals": [b["arrivals"] for b in timed],
            "dispatches": [b["dispatches"] for b in timed],
            "simulated_seconds": [b["simulated_seconds"] for b in timed],
            "median_block_seconds": statistics.median(b["seconds"] for b in timed),
            "median_seconds_per_client": statistics.median(per_client),
            "median_clients_per_second": statistics.median(b["clients_trained"] / b["seconds"] for b in timed),
            "warmup": warmup[row],
        }
        if row == "asynchronous":
            entry["median_events_per_second"] = statistics.median(b["arrivals"] / b["seconds"] for b in timed)
            entry["mean_staleness"] = statistics.fmean(b["mean_staleness"] for b in timed)
        if row != "untimed":
            entry["median_simulated_seconds_per_block"] = statistics.median(b["simulated_seconds"] for b in timed)
        results[row] = entry
    asynchronous = results["asynchronous"]["median_seconds_per_client"]
    synchronous = results["synchronous"]["median_seconds_per_client"]
    untimed = results["untimed"]["median_seconds_per_client"]
    return {
        "rows": results,
        "ratio_per_client": asynchronous / synchronous,
        "ratio_per_client_untimed": asynchronous / untimed,
        "timing_overhead": synchronous / untimed - 1,
        "within_goal": asynchronous / synchronous <= GOAL,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table and, as the last line, the JSON report, which is also returned."""
    args = parse_arguments(argv)
    with mlp_benchmarks.mlp_data_section(args) as (data_section, data_kind):
        measured = measure(args, data_section)
    report = {
        **mlp_benchmarks.report_head("cpu", data_kind),
        "workload": workload(args),
        "goal_ratio": GOAL,
        **measured,
    }
    print_table(report)
    print(json.dumps(report))
    return report


def print_table(report: dict[str, Any]) -> None:
    work = report["workload"]
    mlp_benchmarks.print_mlp_heading(
        report,
        f"synchronous: {work['clients_per_round']} clients/round; FedBuff: C = {work['concurrency']}, "
        f"B = {work['buffer']}; blocks of {work['updates_per_block']} rounds/updates",
    )
    widths = [12, 8, 7, 5, 9, 9, 8, 11]
    mlp_benchmarks.print_header(
        ["row", "s/block", "clients", "calls", "s/client", "clients/s", "events/s", "sim s/block"], widths
    )
    for row in ROWS:
        entry = report["rows"][row]
        simulated = entry.get("median_simulated_seconds_per_block")
        events = entry.get("median_events_per_second")
        cells = [
            row,
            f"{entry['median_block_seconds']:.3f}",
            f"{statistics.median(entry['clients_trained']):g}",
            f"{statistics.median(entry['backend_calls']):g}",
            f"{entry['median_seconds_per_client']:.4f}",
            f"{entry['median_clients_per_second']:.1f}",
            "-" if events is None else f"{events:.1f}",
            "-" if simulated is None else f"{simulated:.1f}",
        ]
        mlp_benchmarks.print_row(cells, widths)
    print(
        f"FedBuff / synchronous, seconds per client trained: {report['ratio_per_client']:.3f} "
        f"(goal ≤ {report['goal_ratio']}: {'met' if report['within_goal'] else 'not met'}); "
        f"FedBuff / untimed: {report['ratio_per_client_untimed']:.3f}; "
        f"[system]'s cost on a synchronous round: {report['timing_overhead']:+.1%}"
    )


if __name__ == "__main__":
    main()
