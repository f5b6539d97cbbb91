"""Which model an evaluated round evaluates (``evaluation.model``), as a policy of the evaluation plan
(``EvaluationPlan.evaluated_model``), so the round (``round.engine``) never compares the setting's name.

* ``"server"``: the server model θ^t.
* ``"reporting_mean"``: the mean of the reporting clients' final models, ``(1/|R_t|) Σ_{k ∈ R_t} θ_k^t``, summed in
  sample order by the round's fold (``OrderedFold`` with ``keep_models``); the server's when nobody reported.
* ``"all_clients_mean"``: the mean over the registered clients of every client's latest model (FedDyn's reporting:
  ``latest_models.mean_of_latest``), whose running sum is checkpointed (``LatestModelsExtra``).
"""

from __future__ import annotations

from typing import Any

import torch

from driftlab.simulation.round.latest_models import LatestModelsExtra, mean_of_latest
from driftlab.simulation.round.ordered_fold import FoldedRound


class ServerModel:
    """The server model: nothing kept beside it."""

    keeps_reporting_models = False  # whether the round's fold must sum the reporting clients' final models

    def params(self, sim: Any, registered: Any, folded: FoldedRound, store: Any, latest: Any) -> torch.Tensor:  # noqa: ARG002
        return folded.server.params

    def state_extras(self) -> tuple[Any, ...]:
        return ()


class ReportingMean(ServerModel):
    """The reporting clients' mean final model (the server's when nobody reported)."""

    keeps_reporting_models = True

    def params(self, sim: Any, registered: Any, folded: FoldedRound, store: Any, latest: Any) -> torch.Tensor:  # noqa: ARG002
        if not folded.reporting_clients:
            return folded.server.params
        if folded.reporting_mean is None:  # a driver that collects messages (``finish_round``) passed no models
            raise ValueError(
                'evaluation.model "reporting_mean" needs the reporting clients\' final models (reporting_models)'
            )
        return folded.reporting_mean


class AllClientsMean(ServerModel):
    """The mean of every registered client's latest model (θ⁰ for a client that never trained)."""

    def params(self, sim: Any, registered: Any, folded: FoldedRound, store: Any, latest: Any) -> torch.Tensor:  # noqa: ARG002
        """``store``: every client's latest model (staged ones included); ``latest``: their running sum after the
        round (None: summed from the store)."""
        return mean_of_latest(store, latest, registered, sim.data.num_clients, sim.initial_params)

    def state_extras(self) -> tuple[Any, ...]:
        return (LatestModelsExtra(),)


# The policy of each value of ``evaluation.model``.
EVALUATED_MODELS: dict[str, ServerModel] = {
    "server": ServerModel(),
    "reporting_mean": ReportingMean(),
    "all_clients_mean": AllClientsMean(),
}
