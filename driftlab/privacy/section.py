"""``[privacy]``: the config section of client-level differential privacy, with the checks among its own keys.

The checks that combine it with other sections (the sampling, membership changes, compression) are the config's
(``driftlab.experiments.config``); those that need the data are assembly's.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_serializer, model_validator

from driftlab.config_section import Section
from driftlab.optim.schedules import MAX_RATE

ADAPTIVE_KEYS = ("target_quantile", "clip_learning_rate", "count_noise")  # [privacy] keys of adaptive clipping only


class PrivacyConfig(Section):
    """``[privacy]``: client-level differential privacy (``driftlab.privacy``); a config without it is not private.

    Each reporting client's message is clipped to L2 norm ``clip`` as the algorithm's ``ReleaseForm`` releases it,
    and Gaussian noise of std ``noise_multiplier · clip`` is added to the round's sum (DP-FedAvg, McMahan et al.,
    "Learning Differentially Private Recurrent Language Models", ICLR 2018), or to each message (``noise = "local"``).
    The checks that need the data's number of clients (δ below 1/N, the noise a target ε needs) are made by
    ``driftlab.experiments.run.assembly`` before any round.
    """

    clip: float = Field(
        math.inf,
        gt=0,
        allow_inf_nan=True,
        description="L2 norm C each reporting client's message (the whole of what it reveals) is clipped to before "
        "the fold; inf = no clipping (McMahan et al. 2018); the initial C_0 with privacy.adaptive",
    )
    noise_multiplier: float = Field(
        0.0,
        ge=0,
        description="z: Gaussian noise of std z·clip on the round's sum of clipped messages (central) or on each "
        "message (local); 0 = no noise; give privacy.target_epsilon instead to have it computed",
    )
    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="the ε the run may spend in its rounds at privacy.delta: the noise multiplier is computed for it "
        "(instead of privacy.noise_multiplier) with the accountant, for the sampling rate and rounds of the run",
    )
    delta: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="δ of the (ε, δ) guarantee, below 1/number of clients; set: ε after every round in the metrics "
        "(privacy_epsilon) and run.json; none = not accounted",
    )
    accountant: Literal["rdp", "prv"] = Field(
        "rdp",
        description="rdp: Rényi DP of the sampled Gaussian mechanism (Mironov et al. 2019); prv: privacy loss random "
        "variables (Gopi et al., NeurIPS 2021), tighter and slower; both Opacus's (extra driftlab[privacy])",
    )
    noise: Literal["central", "local"] = Field(
        "central",
        description="central: noise once on the sum at a trusted server, means divide by the expected cohort q·N; "
        "local: noise on each client's message before it is sent (ε of each client's own messages, no amplification)",
    )
    noise_cohort_size: float | None = Field(
        None,
        gt=0,
        description="M: central noise calibrated as if a cohort of M clients reported (std z·clip·m/M, pfl-research's "
        "noise_cohort_size), and ε accounted for a cohort of M out of privacy.population; none = the run's own cohort",
    )
    population: int | None = Field(
        None,
        ge=1,
        description="the population privacy.noise_cohort_size's cohort is drawn from (the accountant's "
        "q = M/population); none = the data's number of clients",
    )
    adaptive: bool = Field(
        False,
        description='adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive Clipping", '
        "NeurIPS 2021): the clip follows the target quantile of the clients' norms, C ← C·exp(−η(b̃ − γ))",
    )
    target_quantile: float = Field(
        0.5, ge=0, le=1, description="γ: the fraction of clients adaptive clipping aims to leave unclipped"
    )
    clip_learning_rate: float = Field(0.2, gt=0, le=MAX_RATE, description="η_C of adaptive clipping's geometric update")
    count_noise: float | None = Field(
        None,
        gt=0,
        description="σ_b: std of the noise on adaptive clipping's count of unclipped clients; none = m/20 for the "
        "expected cohort m, as Andrew et al. suggest (it must exceed noise_multiplier/2)",
    )

    @field_serializer("clip")
    def _clip_as_text_when_unbounded(self, clip: float) -> float | str:
        # "inf" rather than a float: config.json stays strict JSON (no Infinity literal), and it reads back as inf
        return "inf" if math.isinf(clip) else clip

    @model_validator(mode="after")
    def _settings_agree(self) -> "PrivacyConfig":
        # Each message says "got": the whole section is not repeated after it (validation_problems).
        noise = f"noise_multiplier {self.noise_multiplier:g}" if self.target_epsilon is None else "a target_epsilon"
        if self.noised and math.isinf(self.clip):
            raise ValueError(
                f"noise without clipping (got {noise} and clip inf): the noise is z·clip, and an unclipped message "
                "can be anything; set privacy.clip to a finite norm (e.g. 1.0)"
            )
        if self.target_epsilon is not None and self.noise_multiplier > 0:
            raise ValueError(
                f"give privacy.target_epsilon or privacy.noise_multiplier, not both (got {self.target_epsilon:g} and "
                f"{self.noise_multiplier:g}): the noise multiplier is computed from the target; remove "
                "privacy.noise_multiplier"
            )
        if self.target_epsilon is not None and self.delta is None:
            raise ValueError(
                f"privacy.target_epsilon needs privacy.delta (got target_epsilon {self.target_epsilon:g} without it): "
                "ε holds at a δ; set privacy.delta below 1/number of clients, e.g. 1e-5"
            )
        if self.population is not None and self.noise_cohort_size is None:
            raise ValueError(
                f"privacy.population is the population privacy.noise_cohort_size's cohort is drawn from (got "
                f"population {self.population} without it): set privacy.noise_cohort_size too, or remove "
                "privacy.population"
            )
        if self.noise_cohort_size is not None and self.noise == "local":
            raise ValueError(
                f"privacy.noise_cohort_size calibrates the central noise on the sum (got {self.noise_cohort_size:g} "
                'with noise "local"): remove it, or set privacy.noise = "central"'
            )
        if self.adaptive and self.noise == "local":
            raise ValueError(
                "adaptive clipping noises the count of unclipped clients at the server, which local noise does not "
                'trust (got adaptive true with noise "local"): set privacy.noise = "central", or '
                "privacy.adaptive = false"
            )
        if self.adaptive and math.isinf(self.clip):
            raise ValueError(
                "adaptive clipping starts from privacy.clip (got clip inf): set it to a finite initial clip (e.g. 0.1)"
            )
        defaults = type(self).model_fields
        stray = [key for key in ADAPTIVE_KEYS if getattr(self, key) != defaults[key].default]
        if stray and not self.adaptive:
            raise ValueError(
                f"privacy.{stray[0]} is a setting of adaptive clipping (got {getattr(self, stray[0]):g} with adaptive "
                "false): set privacy.adaptive = true, or remove it"
            )
        return self

    @property
    def noised(self) -> bool:
        """Whether the run adds noise (a noise multiplier, given or computed from a target ε)."""
        return self.noise_multiplier > 0 or self.target_epsilon is not None

    @property
    def accounted_centrally(self) -> bool:
        """Central noise: its ε is the sampled Gaussian mechanism's, which assumes each client sampled independently."""
        return self.noised and self.noise == "central"


__all__ = ["ADAPTIVE_KEYS", "PrivacyConfig"]
