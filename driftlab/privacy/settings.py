"""What a run's ``[privacy]`` section resolves to, once the run's sampling and population are known.

``PrivacySettings`` is plain data: the config (``driftlab.experiments.config``)
checks the section and ``driftlab.experiments.run.assembly`` resolves it against
the sampling and the number of clients; ``mechanism.with_privacy`` and
``accounting`` read it.  Nothing here draws a random number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NOISE_PLACES = ("central", "local")
ACCOUNTANTS = ("rdp", "prv")


@dataclass(frozen=True)
class AdaptiveClipping:
    """Andrew et al., "Differentially Private Learning with Adaptive Clipping" (NeurIPS 2021), geometric update:

        b_k = 1[‖x_k‖ ≤ C_t],   b̃ = clamp((Σ_P (b_k − ½) + N(0, σ_b²)) / m + ½, 0, 1),   C_{t+1} = C_t · exp(−η_C (b̃ − γ))

    with the update noise multiplier ``z_Δ = (z^−2 − (2σ_b)^−2)^−1/2`` so that the
    round as a whole is a Gaussian mechanism of multiplier ``z`` (their Theorem 1): the centred count moves by at
    most ½ per client, so its multiplier is 2σ_b, and z^−2 = z_Δ^−2 + (2σ_b)^−2.
    """

    target_quantile: float  # γ in [0, 1]
    learning_rate: float  # η_C > 0
    count_noise: float  # σ_b > 0, the std of the noise on the clipped count (the paper suggests m/20)


@dataclass(frozen=True)
class PrivacySettings:
    """Client-level DP for one run.

    ``clip`` is C (the initial C_0 when ``adaptive``); ``math.inf`` clips nothing.
    ``noise_multiplier`` is z: central noise adds N(0, (z·C)²) to the sum of the
    clipped released vectors once per round; local noise adds it to each
    client's vector.  ``expected_cohort`` m = q·N is the public denominator of
    means over reporting clients under central noise.  ``noise_cohort_size`` M
    (pfl-research's): the noise on the sum is z·C·m/M, as a cohort of M would
    get per client, and ε is accounted for a run with cohort M out of
    ``population``.  ``sampling_rate`` q is what the accountant uses (1 with
    full participation).  ``delta`` None: no ε is reported.
    """

    clip: float
    noise_multiplier: float
    seed: int
    sampling_rate: float
    expected_cohort: float
    population: int
    noise: str = "central"
    delta: float | None = None
    accountant: str = "rdp"
    noise_cohort_size: float | None = None
    adaptive: AdaptiveClipping | None = None

    def __post_init__(self) -> None:
        if self.noise not in NOISE_PLACES:
            raise ValueError(f"privacy noise must be one of {', '.join(NOISE_PLACES)}, got {self.noise!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"privacy accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        if not self.clip > 0:
            raise ValueError(f"privacy clip must be positive (math.inf: no clipping), got {self.clip}")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"privacy noise_multiplier must be a finite number ≥ 0, got {self.noise_multiplier}")
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"sampling rate must be in (0, 1], got {self.sampling_rate}")

    @property
    def noised(self) -> bool:
        return self.noise_multiplier > 0

    @property
    def accounting_rate(self) -> float:
        """q the accountant uses: M / population with ``noise_cohort_size``, else the run's own."""
        if self.noise_cohort_size is not None:
            return min(1.0, self.noise_cohort_size / self.population)
        return self.sampling_rate

    @property
    def update_noise_multiplier(self) -> float:
        """The multiplier of the noise on the released vectors: z, or z_Δ when the clip is adaptive."""
        if self.adaptive is None or self.noise_multiplier == 0:
            return self.noise_multiplier
        rest = self.noise_multiplier**-2 - (2 * self.adaptive.count_noise) ** -2
        if rest <= 0:
            raise ValueError(
                f"adaptive clipping's count noise σ_b = {self.adaptive.count_noise} leaves no privacy for the update at "
                f"noise_multiplier {self.noise_multiplier}: need σ_b > z/2 = {self.noise_multiplier / 2}; raise "
                "privacy.count_noise or the noise multiplier"
            )
        return rest**-0.5

    def sum_noise_std(self, clip: float) -> float:
        """The std of the central noise on Σ_P of the clipped vectors at clip norm ``clip``."""
        std = self.update_noise_multiplier * clip
        if self.noise_cohort_size is not None:
            std *= self.expected_cohort / self.noise_cohort_size
        return std
