"""What the run-level tests share: the short runs they stop, resume and compare, and how they read a run's records.

Several tests run the same small run and compare what two routes to its end write; the runs and the readers stand here
once, so a test says only what it adds (an algorithm, a stop rule, a store).  Nothing here is used by a run.
"""

from __future__ import annotations

import json
from pathlib import Path

# Six rounds of 3 local steps on 6 synthetic clients, half of them a round, checkpointed every 2 rounds: a run that
# can be stopped and resumed at a checkpoint with rounds left on both sides of it.
RESUMABLE_RUN = [
    "rounds=6",
    "data.num_clients=6",
    "sampling.participation=0.5",
    "client.steps=3",
    "checkpoint_every=2",
    "seed=1",
]

# FedBuff (asynchronous FedAvg, a buffer of 2 of 5 clients in flight) on 10 clients of lognormal speeds: six server
# updates, checkpointed every 2, with clients in flight at every checkpoint.
FEDBUFF_RUN = [
    "rounds=6",
    "data.num_clients=10",
    "client.steps=3",
    "checkpoint_every=2",
    "seed=4",
    "algorithm.name=fedavg",
    "algorithm.aggregation=uniform",
    "system.profiles=lognormal",
    "asynchronous.concurrency=5",
    "asynchronous.buffer=2",
]


def quadratic_run(num_clients: int, rounds: int, seed: int) -> dict:
    """A config of uniform FedAvg on the one-dimensional quadratic clients in float64, two local steps of lr 0.1 a
    round, half the clients a round: the run the feature tests (robust aggregation, attacks) wrap."""
    return {
        "data": {"name": "quadratic1d", "num_clients": num_clients},
        "model": {"name": "quadratic"},
        "algorithm": {"name": "fedavg", "aggregation": "uniform"},
        "client": {"lr": 0.1, "batch_size": 1000, "steps": 2},
        "sampling": {"participation": 0.5},
        "precision": "float64",
        "rounds": rounds,
        "seed": seed,
    }


def run_records(out: Path) -> list[dict]:
    """The records of the run directory ``out``, one a line of its metrics.jsonl."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_wall_time(records: list[dict]) -> list[dict]:
    """The records without round_seconds, the one key two runs of the same bits do not share."""
    return [{key: value for key, value in record.items() if key != "round_seconds"} for record in records]
