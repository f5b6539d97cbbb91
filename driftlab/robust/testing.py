"""Test support for robust aggregation and the attacks (``robust/*_test.py``, ``attacks/*_test.py``): one round of
two-coordinate clients whose trained models are given by hand.  (Like the library here, it names no algorithm: the
tests pass theirs.)"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from driftlab.simulation.seam import ClientContext, ClientUpdate, RoundContext


def one_round(
    algorithm: Any,
    finals: Sequence[Sequence[float]],
    server: Any = None,
    round_index: int = 1,
    ids: Sequence[int] | None = None,
) -> tuple[Any, dict[str, float]]:
    """The server state and metrics after one round in which client k (``ids[k]``) trained from the broadcast to
    ``finals[k]``, of 5 registered clients; ``server`` None starts from θ = 0."""
    server = algorithm.server_init(torch.zeros(2, dtype=torch.float64)) if server is None else server
    view = algorithm.broadcast(server)
    state = algorithm.client_state_init(view.params) if algorithm.client_state_init is not None else None
    messages = []
    for k, final in enumerate(finals):
        client = k if ids is None else ids[k]
        context = ClientContext(client, round_index, num_samples=10, mean_num_samples=10.0, num_registered=5,
                                planned_steps=1, client_lr=0.1)  # fmt: skip
        update = ClientUpdate(view.params, torch.tensor(final, dtype=torch.float64), 1)
        messages.append(algorithm.client_finish(view, state, context, update)[1])
    return algorithm.server_update(server, messages, RoundContext(round_index, 5, len(finals), 1.0))
