"""Seconds per round with and without ``[privacy]``: client-level DP's overhead on the MLP standard workload (issue 27).

Workload: the MLP standard workload of issue 3 (``mlp_benchmarks.py``): 100 clients x 600 MNIST
samples (real MNIST from ../shared/data/mnist when present, else random data of its shape),
MLP 784-200-200-10, SGD lr 0.1, batch 50, 5 local epochs, FedAvg, vectorized backend, with
10 and with 100 clients per round.  Two rows per cohort size, built from the same data in one
process and timed side by side:

* ``plain``   — the run without ``[privacy]``;
* ``private`` — the same run with ``[privacy]``: clip 1, noise multiplier 1, central noise,
  δ = 1e-5 (so ε is accounted after every round, with the RDP accountant, inside the round).

Sampling is the same in both rows: at 10 clients per round ``sampling.mode = "poisson"`` with
q = 0.1 (the sampling an accounted run needs; the cohort varies from round to round), at 100
clients per round full participation (q = 1).  Both rows have the same seed, so round t selects
the same clients in both.  After one warm-up round each, the rows take turns, round by round
(plain then private, then private then plain, ...), so that a slow minute of a shared machine
falls on both.  Reported per cohort size: each row's median seconds per round (engine
``run_round``: sampling, training, clipping, noise, aggregation, accounting; no evaluation), the
ratio of the medians (private / plain), the median of the per-round ratios (the rounds are
paired), and whether the overhead is within the issue's goal of 5%.

Accounting time per round is measured apart from the rounds, for both accountants: ε(q, z = 1,
T, δ) for T = 1 .. ``--accounting-rounds`` in order with empty caches (what a run asks after
each round): the first call (RDP: the per-round RDP vector for (q, z); PRV: a whole PRV
composition) and the median of the later calls.

The last line printed is one JSON object with every number: ``results`` (per cohort size:
``plain`` and ``private`` rows with ``median_seconds`` and ``round_seconds``, ``ratio_of_medians``,
``median_paired_ratio``, ``overhead``, ``within_goal``, the private run's last privacy metrics),
``accounting`` (per sampling rate and accountant), ``machine``, ``device``, ``workload``, ``data``.

Usage:
    python benchmarks/privacy_overhead.py            # 10 and 100 clients per round, 7 timed rounds each (a few minutes)
    python benchmarks/privacy_overhead.py --rounds 11 --clients-per-round 10
    python benchmarks/privacy_overhead.py --quick    # a tiny smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # mlp_benchmarks, beside this file
import mlp_benchmarks  # after the path: the workload, its data and the machine description come from it

CLIP = 1.0
NOISE_MULTIPLIER = 1.0
DELTA = 1e-5
GOAL = 0.05  # the goal: at most 5% over the same run without [privacy]
ROWS = ("plain", "private")


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, random data, 2 timed rounds: a smoke run")
    parser.add_argument("--clients-per-round", type=int, nargs="+", default=None, help="default: 10 100 (quick: 2 4)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per row after one warm-up (default 7; quick 2)"
    )
    parser.add_argument(
        "--accounting-rounds", type=int, default=None, help="ε queries T = 1 .. this (default 100; quick 5)"
    )
    parser.add_argument("--num-clients", type=int, default=None, help="default 100 (quick 4)")
    parser.add_argument("--samples", type=int, default=None, help="samples per client (default 600; quick 60)")
    parser.add_argument("--epochs", type=int, default=None, help="local epochs (default 5; quick 1)")
    parser.add_argument(
        "--random-data", action="store_true", help="random data of MNIST's shape even where MNIST is present"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    # clients per round and timed rounds of the rows, ε queries, clients, samples per client, local epochs
    keys = ("clients_per_round", "rounds", "accounting_rounds", "num_clients", "samples", "epochs")
    quick, full = ([2, 4], 2, 5, 4, 60, 1), ([10, 100], 7, 100, 100, 600, 5)
    mlp_benchmarks.settle_mlp_options(
        parser, args, dict(zip(keys, quick, strict=True)), dict(zip(keys, full, strict=True))
    )
    for clients in args.clients_per_round:
        if not 1 <= clients <= args.num_clients:
            parser.error(
                f"--clients-per-round {clients} must be between 1 and the number of clients ({args.num_clients})"
            )
    return args


def privacy_section() -> dict[str, Any]:
    """The private row's ``[privacy]``: the issue's clip 1 and z 1, central noise, accounted with δ (RDP)."""
    return {"clip": CLIP, "noise_multiplier": NOISE_MULTIPLIER, "noise": "central", "delta": DELTA}


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **mlp_benchmarks.mlp_workload(args),
        "algorithm": "fedavg",
        "clients_per_round": list(args.clients_per_round),
        "timed_rounds": args.rounds,
        "warmup_rounds": 1,
        "privacy": privacy_section(),
        "threads": torch.get_num_threads(),
    }


def sampling_section(clients_per_round: int, num_clients: int) -> dict[str, Any]:
    """Full participation with every client, else Poisson sampling of the same expected cohort (accounting needs it)."""
    if clients_per_round == num_clients:
        return {"participation": 1.0}
    return {"participation": clients_per_round / num_clients, "mode": "poisson"}


def build_rows(args: argparse.Namespace, clients_per_round: int, data_section: dict[str, Any]) -> dict[str, tuple]:
    """(simulation, state) of each row: the same config, the private one with ``[privacy]`` added."""
    from driftlab.experiments.config import load_config
    from driftlab.experiments.run.assembly import build_simulation

    table = {
        **mlp_benchmarks.mlp_config(args, data_section, rounds=1000),
        "sampling": sampling_section(clients_per_round, args.num_clients),
    }
    rows = {}
    for row in ROWS:
        config = load_config({**table, "privacy": privacy_section()} if row == "private" else table)
        rows[row] = build_simulation(config)
    return rows


def timed_round(simulation: Any, state: Any) -> tuple[float, Any, dict[str, Any]]:
    """Seconds of one ``run_round`` (sampling, training, aggregation; no evaluation), the new state and its record."""
    from driftlab.simulation.round.engine import run_round

    started = time.perf_counter()
    state, record = run_round(simulation, state)
    return time.perf_counter() - started, state, record


def measure(args: argparse.Namespace, clients_per_round: int, data_section: dict[str, Any]) -> dict[str, Any]:
    """Both rows at one cohort size, interleaved round by round after one warm-up round each."""
    rows = build_rows(args, clients_per_round, data_section)
    simulations = {row: rows[row][0] for row in ROWS}
    states = {row: rows[row][1] for row in ROWS}
    seconds: dict[str, list[float]] = {row: [] for row in ROWS}
    records: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    for repetition in range(1 + args.rounds):
        order = ROWS if repetition % 2 == 0 else ROWS[::-1]  # alternate who goes first: drift falls on both
        for row in order:
            took, states[row], record = timed_round(simulations[row], states[row])
            if repetition > 0:
                seconds[row].append(took)
            records[row].append(record)
    cohorts = [[r["num_reporting"] for r in records[row]] for row in ROWS]
    assert cohorts[0] == cohorts[1], "the rows must select the same clients in every round"
    medians = {row: statistics.median(seconds[row]) for row in ROWS}
    paired = [private / plain for plain, private in zip(seconds["plain"], seconds["private"], strict=True)]
    last = records["private"][-1]
    return {
        "clients_per_round": clients_per_round,
        "sampling": sampling_section(clients_per_round, args.num_clients),
        "cohorts": cohorts[0][1:],
        "plain": {"median_seconds": medians["plain"], "round_seconds": seconds["plain"]},
        "private": {"median_seconds": medians["private"], "round_seconds": seconds["private"]},
        "ratio_of_medians": medians["private"] / medians["plain"],
        "median_paired_ratio": statistics.median(paired),
        "overhead": medians["private"] / medians["plain"] - 1,
        "within_goal": medians["private"] / medians["plain"] <= 1 + GOAL,
        "private_metrics": {key: value for key, value in last.items() if key.startswith("privacy_")},
        "plain_has_privacy_metrics": any(key.startswith("privacy_") for r in records["plain"] for key in r),
        "rounds_recorded": len(records["private"]),
    }


def accounting_seconds(sampling_rate: float, rounds: int, accountant: str) -> dict[str, Any]:
    """Seconds of ε(q, z, T, δ) for T = 1 .. ``rounds`` in order with empty caches, as a run asks after each round."""
    from driftlab.privacy import accounting

    for cached in (accounting._rdp_per_round, accounting._rdp_epsilon, accounting._prv_epsilon):
        cached.cache_clear()  # a fresh run's process: nothing computed yet
    accounting.epsilon(NOISE_MULTIPLIER, 0.5, 1, DELTA, accountant)  # imports Opacus: once per process, not per round
    for cached in (accounting._rdp_per_round, accounting._rdp_epsilon, accounting._prv_epsilon):
        cached.cache_clear()
    seconds, value = [], None
    for t in range(1, rounds + 1):
        started = time.perf_counter()
        value = accounting.epsilon(NOISE_MULTIPLIER, sampling_rate, t, DELTA, accountant)
        seconds.append(time.perf_counter() - started)
    later = seconds[1:] or [0.0]
    return {
        "sampling_rate": sampling_rate,
        "accountant": accountant,
        "rounds": rounds,
        "first_seconds": seconds[0],
        "median_later_seconds": statistics.median(later),
        "max_later_seconds": max(later),
        "total_seconds": sum(seconds),
        "epsilon_last": value,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table and, as the last line, the JSON report, which is also returned."""
    args = parse_arguments(argv)
    results = []
    with mlp_benchmarks.mlp_data_section(args) as (data_section, data_kind):
        for clients_per_round in args.clients_per_round:
            results.append(measure(args, clients_per_round, data_section))
            print(f"  measured {clients_per_round} clients/round", file=sys.stderr)
    rates = sorted({min(1.0, c / args.num_clients) for c in args.clients_per_round})
    accounting = [
        accounting_seconds(q, args.accounting_rounds, accountant) for q in rates for accountant in ("rdp", "prv")
    ]
    report = {
        **mlp_benchmarks.report_head("cpu", data_kind),
        "workload": workload(args),
        "goal_overhead": GOAL,
        "results": results,
        "accounting": accounting,
    }
    print_table(report)
    print(json.dumps(report))
    return report


def print_table(report: dict[str, Any]) -> None:
    mlp_benchmarks.print_mlp_heading(report, f"[privacy] clip {CLIP}, z {NOISE_MULTIPLIER}, central, δ {DELTA}")
    widths = [13, 9, 10, 7, 7, 9, 5]
    mlp_benchmarks.print_header(
        ["clients/round", "plain s", "private s", "ratio", "paired", "overhead", "≤ 5%"], widths
    )
    for entry in report["results"]:
        cells = [
            f"{entry['clients_per_round']}",
            f"{entry['plain']['median_seconds']:.3f}",
            f"{entry['private']['median_seconds']:.3f}",
            f"{entry['ratio_of_medians']:.3f}",
            f"{entry['median_paired_ratio']:.3f}",
            f"{entry['overhead']:+.1%}",
            "yes" if entry["within_goal"] else "no",
        ]
        mlp_benchmarks.print_row(cells, widths)
    print(f"accounting per round (ε after T = 1 .. {report['accounting'][0]['rounds']}):")
    for entry in report["accounting"]:
        print(
            f"  q {entry['sampling_rate']:<5} {entry['accountant']}: first {entry['first_seconds'] * 1e3:.2f} ms, "
            f"then median {entry['median_later_seconds'] * 1e3:.3f} ms "
            f"(max {entry['max_later_seconds'] * 1e3:.2f} ms); ε = {entry['epsilon_last']:.3f}"
        )


if __name__ == "__main__":
    main()
