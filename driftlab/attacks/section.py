"""``[attack]``: the config section of a seeded Byzantine attack: who attacks, from which round, and what they send.

``attack.fraction`` of the N clients (drawn once from the run seed, ``driftlab.attacks.byzantine``) or the fixed
``attack.clients`` attack from round ``attack.start_round``; ``attack.kind`` names what they report instead of their
honest message (``driftlab.attacks.model_updates``), and the other keys are its parameters, each checked against
the attack's settings record (``driftlab.robust.section.rule_settings``: an error names the key and the fix).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from driftlab.attacks.byzantine import Byzantine
from driftlab.attacks.model_updates import ATTACKS, Attack
from driftlab.config_section import Section
from driftlab.robust.section import rule_settings

WHO = ("fraction", "clients", "start_round")  # the keys that say who attacks and when; the others are the kind's


class AttackConfig(Section):
    """``[attack]``: Byzantine clients forge the vector their message releases (``seam.ReleaseForm``).

    Sign flipping and scaling (the client's own update), Gaussian noise, "a little is enough" (Baruch et al. 2019),
    inner-product manipulation (Xie et al. 2020), min-max and min-sum (Shejwalkar and Houmansadr 2021); the last four
    are omniscient: they see the round's honest released vectors, as their papers assume.
    """

    kind: Literal["sign_flip", "scaled", "gaussian_noise", "alie", "ipm", "min_max", "min_sum"] = Field(
        description="what a Byzantine client reports instead of its honest released vector"
    )
    fraction: float | None = Field(
        None, ge=0, lt=1, description="the share of the N clients that are Byzantine, ⌊fraction·N⌋ drawn from the seed"
    )
    clients: tuple[int, ...] | None = Field(None, description="the Byzantine clients' ids, instead of attack.fraction")
    start_round: int = Field(1, ge=1, description="the first round they attack in (rounds count from 1)")
    scale: float | None = Field(None, description="sign_flip: x̃ = −scale·x (default 1)")
    factor: float | None = Field(None, description="scaled: x̃ = factor·x")
    std: float | None = Field(None, description="gaussian_noise: the noise's standard deviation")
    around_honest: bool | None = Field(None, description="gaussian_noise: x + noise instead of noise alone")
    z: float | None = Field(None, description="alie: x̃ = μ − zσ; none = Baruch et al.'s z_max from n and f")
    epsilon: float | None = Field(None, description="ipm: x̃ = −ε μ")
    direction: Literal["std", "unit", "sign"] | None = Field(
        None, description="min_max, min_sum: the perturbation p (default unit, −μ/‖μ‖)"
    )
    gamma_init: float | None = Field(None, description="min_max, min_sum: the search's first γ (default 10)")
    tolerance: float | None = Field(None, description="min_max, min_sum: the search's stopping width (1e-5)")
    bound: Literal["min", "max"] | None = Field(
        None, description="min_sum: the honest sum the forged one stays under, the smallest (min) or the largest"
    )

    @property
    def parameters(self) -> dict[str, Any]:
        """The attack's parameters this section sets."""
        keys = sorted(self.model_fields_set - {"kind", *WHO})
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}

    @property
    def settings(self) -> Attack:
        """The attack's settings record (``driftlab.attacks.model_updates.ATTACKS``)."""
        return rule_settings("attack", "kind", ATTACKS, self.kind, self.parameters)

    @property
    def byzantine(self) -> Byzantine:
        """Who attacks, and from which round."""
        return Byzantine(self.fraction, self.clients, self.start_round)

    @model_validator(mode="after")
    def _attack_is_whole(self) -> AttackConfig:
        self.byzantine  # noqa: B018 - raises for neither or both of attack.fraction and attack.clients
        self.settings  # noqa: B018 - raises, naming the key, for a parameter the attack does not take or refuses
        return self
