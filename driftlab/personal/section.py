"""``[personal_layers]``: which of the model's parameters stay on each client (FedPer, LG-FedAvg, FedRep).

The checks that need the model's parameter names (a pattern that matches none) are the plan's
(``driftlab.personal.feature``), made once the model is built and before any round.
"""

from __future__ import annotations

from pydantic import Field

from driftlab.config_section import Section


class PersonalLayersConfig(Section):
    """``[personal_layers]``: partial-model personalization of any algorithm with a release form.

    ``keep`` names the personal parameters: glob patterns over the model's parameter names (``"fc3.*"``), or
    ``"head"`` (the parameters of the model's last module, in ``named_parameters`` order) or ``"body"`` (all
    others) or ``"batchnorm"`` (the affine parameters of every normalisation layer with running statistics, found by
    module class; FedBN's parameters).  Each client keeps its own values there; the server's stay as they were at round 0.
    """

    keep: tuple[str, ...] = Field(
        (),
        description="the personal parameters, kept on each client and never sent: glob patterns over the model's "
        'parameter names (e.g. ["fc3.*"]) or "head" (the last module\'s parameters; FedPer) or "body" (all but the '
        'head; LG-FedAvg) or "batchnorm" (every BatchNorm layer\'s affine parameters; FedBN); [] = none (the wrapped algorithm as it is)',
    )
    personal_first_steps: int = Field(
        0,
        ge=0,
        description="FedRep (Collins et al. 2021): each round a client first trains only its personal part for this "
        "many local steps (the shared part fixed), then only the shared part (the personal part fixed) for the rest "
        "of its steps; 0 = both together every step (FedPer, LG-FedAvg)",
    )


__all__ = ["PersonalLayersConfig"]
