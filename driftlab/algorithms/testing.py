"""What the algorithms' tests share: the smallest whole run that exercises a round (``TINY``), and the round plan of
the hand-computed cases (``every_client_plan``).

Three rounds of the built-in synthetic data on six clients, half of them sampled each round, one local epoch,
evaluated every round: enough for every algorithm to send, fold and evaluate, cheap enough for every test to run it.
"""

from __future__ import annotations

from driftlab.simulation.round.setup import RoundPlan

TINY = {
    "rounds": 3,
    "data": {"num_clients": 6},
    "client": {"epochs": 1},
    "sampling": {"participation": 0.5},
    "evaluation": {"every": 1},
}


def every_client_plan(steps: int, seed: int = 0, client_lr: float = 0.1, server_lr: float = 1.0) -> RoundPlan:
    """Every client in every round, ``steps`` fixed local steps on minibatches of 10: larger than the hand cases'
    clients, so a step is a full-batch gradient step and the expected numbers can be computed by hand."""
    return RoundPlan(
        seed=seed,
        participation=1.0,
        sampling="uniform",
        batch_size=10,
        client_lr=client_lr,
        server_lr=server_lr,
        local_epochs=None,
        steps=steps,
    )
