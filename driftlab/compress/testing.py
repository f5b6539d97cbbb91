"""Test support for compression (``compress/*_test.py``): the small end-to-end runs they share."""

from __future__ import annotations


def tiny_run(rounds: int, *overrides: str) -> list[str]:
    """The overrides of a small float64 run: six clients, half of them a round, three local steps, seed 11, evaluated
    at the end only; then ``overrides``."""
    return [
        f"rounds={rounds}",
        "data.num_clients=6",
        "sampling.participation=0.5",
        "client.steps=3",
        "seed=11",
        "precision=float64",
        "evaluation.every=100",
        *overrides,
    ]
