"""Seconds to partition 50,000 samples over 1,000 clients with Dirichlet alpha = 0.03.

Issue 6 ("finishes in seconds; other libraries hang there").  Labels are
CIFAR-10-like: 50,000 samples, 10 balanced classes of 5,000.  Rows:

* ``client_prior`` — driftlab's ``dirichlet_client_prior_partition`` (FedDyn's
  procedure, vectorised), balanced quotas of 50;
* ``classwise`` — driftlab's ``dirichlet_classwise_partition`` with
  ``min_client_size=0`` (at this alpha and client count about a quarter of the
  clients get no sample at all, so any minimum size is unreachable; the row
  ``classwise_min10`` times how long it takes to say so with a clear error
  after its 10 attempts);
* ``reference`` — a plain re-implementation of the FedDyn authors' loop
  (``utils_dataset.py``, rule ``Dirichlet``), written the way their code does
  it: one sample at a time, a uniformly drawn client (redrawn while full), a
  class by ``argmax(uniform <= cumsum(prior))`` redrawn while that class is
  exhausted.  It stops at ``--time-limit`` seconds (default 60) and is then
  reported as "> 60 s": at small alpha the redraw loop can wait practically
  forever for a class whose prior mass is 1e-20.

Each row is repeated (``--repeats``, default 5; the reference once, as it
usually hits the limit) with seeds 0, 1, ...; the median seconds is reported
with its ratio to the reference.  The last line printed is one JSON object
with every number.

Usage:
    python benchmarks/partition_speed.py            # the full benchmark (about a minute)
    python benchmarks/partition_speed.py --quick    # a tiny smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from driftlab.data.partition import (
    balanced_quotas,
    dirichlet_classwise_partition,
    dirichlet_client_prior_partition,
)


class TimeLimitReached(Exception):
    """The reference loop ran out of time; ``assigned`` samples had been placed."""

    def __init__(self, assigned: int) -> None:
        super().__init__(f"time limit reached after assigning {assigned} samples")
        self.assigned = assigned


def feddyn_reference_partition(labels: np.ndarray, quotas: np.ndarray, alpha: float, seed: int, time_limit: float):
    """The FedDyn authors' Dirichlet loop, sample by sample (their global ``np.random`` state becomes a RandomState).

    Raises TimeLimitReached once ``time_limit`` seconds have passed (checked every 1,000 draws of either loop).
    """
    random = np.random.RandomState(seed)
    deadline = time.perf_counter() + time_limit
    num_clients, num_classes = len(quotas), int(labels.max()) + 1
    remaining = [int(q) for q in quotas]
    cls_priors = random.dirichlet(alpha=[alpha] * num_classes, size=num_clients)
    prior_cumsum = np.cumsum(cls_priors, axis=1)
    idx_list = [np.where(labels == c)[0] for c in range(num_classes)]
    cls_amount = [len(idx_list[c]) for c in range(num_classes)]
    clients = [np.zeros(remaining[k], dtype=np.int64) for k in range(num_clients)]
    draws = 0
    while np.sum(remaining) != 0:
        current = random.randint(num_clients)
        draws += 1
        if draws % 1000 == 0 and time.perf_counter() > deadline:
            raise TimeLimitReached(int(quotas.sum() - np.sum(remaining)))
        if remaining[current] <= 0:  # the client is full: resample a client
            continue
        remaining[current] -= 1
        current_prior = prior_cumsum[current]
        while True:
            cls_label = np.argmax(random.uniform() <= current_prior)
            draws += 1
            if draws % 1000 == 0 and time.perf_counter() > deadline:
                raise TimeLimitReached(
                    int(quotas.sum() - np.sum(remaining)) - 1
                )  # the current sample is not placed yet
            if cls_amount[cls_label] <= 0:  # the class is exhausted: redraw
                continue
            cls_amount[cls_label] -= 1
            clients[current][remaining[current]] = idx_list[cls_label][cls_amount[cls_label]]
            break
    return clients


def _time(call, repeats: int) -> list[float]:
    seconds = []
    for seed in range(repeats):
        start = time.perf_counter()
        call(seed)
        seconds.append(time.perf_counter() - start)
    return seconds


def run(num_samples: int, num_clients: int, num_classes: int, alpha: float, repeats: int, time_limit: float) -> dict:
    labels = np.repeat(np.arange(num_classes), num_samples // num_classes)
    labels = np.concatenate([labels, np.arange(num_samples - len(labels)) % num_classes])
    labels = np.random.default_rng(12345).permutation(labels)
    quotas = balanced_quotas(num_samples, num_clients)
    results = []

    def add(key: str, row: str, seconds: list[float] | None, note: str = "", finished: bool = True) -> None:
        median = statistics.median(seconds) if seconds else None
        entry = {"key": key, "row": row, "finished": finished, "median_seconds": median, "seconds": seconds or []}
        results.append({**entry, "note": note})

    prior = _time(
        lambda seed: dirichlet_client_prior_partition(labels, quotas, alpha, np.random.default_rng(seed)), repeats
    )
    add("client_prior", "driftlab dirichlet_client_prior_partition", prior, "balanced quotas")

    empty = []

    def classwise(seed: int) -> None:
        parts = dirichlet_classwise_partition(
            labels, num_clients, alpha, np.random.default_rng(seed), min_client_size=0
        )
        empty.append(sum(len(p) == 0 for p in parts))

    add("classwise", "driftlab dirichlet_classwise_partition", _time(classwise, repeats), "min_client_size=0")
    results[-1]["empty_clients_median"] = statistics.median(empty)

    errors = []

    def classwise_min10(seed: int) -> None:
        try:
            dirichlet_classwise_partition(labels, num_clients, alpha, np.random.default_rng(seed), min_client_size=10)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))

    add(
        "classwise_min10",
        "driftlab dirichlet_classwise_partition (min_client_size=10)",
        _time(classwise_min10, repeats),
        "10 attempts, then ValueError" if all(errors) else "succeeded",
    )
    results[-1]["raised"] = all(e is not None for e in errors)

    start = time.perf_counter()
    try:
        feddyn_reference_partition(labels, quotas, alpha, seed=0, time_limit=time_limit)
        add("reference", "FedDyn authors' sequential loop", [time.perf_counter() - start])
    except TimeLimitReached as stop:
        note = f"stopped at the {time_limit:g} s limit with {stop.assigned} of {int(quotas.sum())} samples assigned"
        add("reference", "FedDyn authors' sequential loop", None, note, finished=False)
        results[-1]["assigned_at_limit"] = stop.assigned
    reference = results[-1]
    for entry in results:
        if reference["finished"]:
            entry["ratio_to_reference"] = entry["median_seconds"] / reference["median_seconds"]
            entry["speedup_vs_reference"] = reference["median_seconds"] / entry["median_seconds"]
            entry["speedup_is_lower_bound"] = False
        else:  # the reference took more than the limit: speedups are lower bounds
            entry["ratio_to_reference"] = None if entry is reference else entry["median_seconds"] / time_limit
            entry["speedup_vs_reference"] = None if entry is reference else time_limit / entry["median_seconds"]
            entry["speedup_is_lower_bound"] = entry is not reference
    machine = {"platform": platform.platform(), "python": platform.python_version(), "numpy": np.__version__}
    sizes = {"num_samples": num_samples, "num_clients": num_clients, "num_classes": num_classes, "alpha": alpha}
    workload = {**sizes, "repeats": repeats, "time_limit_seconds": time_limit}
    return {"machine": machine, "workload": workload, "results": results}


def _print_table(report: dict) -> None:
    w = report["workload"]
    print(
        f"{w['num_samples']} samples, {w['num_clients']} clients, {w['num_classes']} classes, Dirichlet alpha={w['alpha']}"
    )
    print(f"{'row':<62} {'median s':>10} {'x faster':>10}  note")
    for entry in report["results"]:
        seconds = f"{entry['median_seconds']:.4f}" if entry["finished"] else f"> {w['time_limit_seconds']:g}"
        speedup = entry["speedup_vs_reference"]
        faster = "-" if speedup is None else (">" if entry["speedup_is_lower_bound"] else "") + f"{speedup:.0f}"
        note = entry["note"] + (
            f"; {entry['empty_clients_median']:g} empty clients" if "empty_clients_median" in entry else ""
        )
        print(f"{entry['row']:<62} {seconds:>10} {faster:>10}  {note}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a tiny smoke run: 500 samples, 20 clients, 1 repeat, 2 s limit"
    )
    parser.add_argument("--samples", type=int, default=50000)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.03)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds after which the reference loop is stopped"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.clients, args.repeats, args.time_limit = 500, 20, 1, 2.0
    report = run(args.samples, args.clients, args.classes, args.alpha, args.repeats, args.time_limit)
    _print_table(report)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
