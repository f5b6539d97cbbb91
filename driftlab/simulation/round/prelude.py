"""A round's first phase (``seam.RoundPrelude``: Mime's control variate, Karimireddy et al. 2021), before local
training.  Each client k with work this round computes its vector v_k at the broadcast view, one after another in
sample order on the client code path's computations (the same numbers on every backend); the server applies their
weighted mean::

    s ← apply(s, Σ_k w_k v_k / Σ_k w_k),        w_k = weight(context_k)

and the clients train from the new state's view.  A one-phase round (no prelude, or nobody with work) is the round
as planned: ``run_prelude`` is its null policy, so the round (``round.engine``) calls it whatever the algorithm.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from driftlab.metrics.communication import payload_bits
from driftlab.simulation.backends.local_training import single_threaded_clients
from driftlab.simulation.round.client import ClientDataComputation, client_data


def run_prelude(sim: Any, work: Any) -> Any:
    """The planned round ``work`` (a ``RoundWork`` of ``sim``, a ``Simulation``) after its first phase: its server
    state and view those of ``apply``, and the vectors' upload counted in ``prelude_bits``; ``work`` itself for a
    one-phase round."""
    prelude = sim.algorithm.prelude
    if prelude is None or not work.contexts:  # a one-phase round, or nobody to compute a vector
        return work
    total, weights, bits = None, 0.0, 0
    with single_threaded_clients(sim.device):
        for context in work.contexts:
            data = client_data(sim, context.client_id)
            computation = ClientDataComputation(data, work.settings.seed, work.round, context.client_id, work.settings)
            vector = prelude.compute(work.view_of(sim.algorithm, context.client_id), context, computation)
            weight = float(prelude.weight(context))
            total = vector * weight if total is None else total + vector * weight
            weights += weight
            bits += payload_bits(vector)
    server = prelude.apply(work.server, total / weights)
    return dataclasses.replace(work, server=server, view=sim.algorithm.broadcast(server), prelude_bits=bits)
