"""Model-update attacks: what a Byzantine client reports instead of its honest change.

Each attack is a pure function of the client's honest update x ([d]), the
round's honest updates X ([h, d], for the omniscient attacks, as their papers
assume), its settings and, for noise, a seeded generator (``byzantine.
noise_generator``).  With μ, σ the coordinate-wise mean and standard deviation
of X (σ with Bessel's correction, h − 1, as torch.std and the authors' code)::

    sign flipping:    x̃ = −s · x                                   (s = 1: the plain flip)
    scaled update:    x̃ = s · x
    Gaussian noise:   x̃ = ξ,  or x + ξ when around_honest,   ξ ~ N(0, std² I)
    ALIE:             x̃ = μ − z σ,   z_max = Φ⁻¹((n − s) / n),   s = ⌊n/2 + 1⌋ − f
                      (Baruch, Baruch and Goldberg, "A Little Is Enough", NeurIPS 2019; n clients, f attackers)
    IPM:              x̃ = −ε μ
                      (Xie, Koyejo and Gupta, "Fall of Empires: Breaking Byzantine-tolerant SGD by Inner Product
                      Manipulation", UAI 2019 / PMLR 2020)
    min-max:          x̃ = μ + γ p,  γ the largest with  max_i ‖x̃ − x_i‖ ≤ max_{i,j} ‖x_i − x_j‖
    min-sum:          x̃ = μ + γ p,  γ the largest with  Σ_i ‖x̃ − x_i‖² ≤ min_i Σ_j ‖x_i − x_j‖²   (bound "min")
                                                   or  Σ_i ‖x̃ − x_i‖² ≤ max_i Σ_j ‖x_i − x_j‖²   (bound "max")
                      (Shejwalkar and Houmansadr, "Manipulating the Byzantine: Optimizing Model Poisoning Attacks
                      and Defenses for Federated Learning", NDSS 2021), p = −σ ("std"), −μ/‖μ‖ ("unit") or
                      −sign(μ) ("sign")

γ is found as the paper's Algorithm 1 does, by a halving search from γ_init
(``min_max_gamma``): try γ, keep it if it meets the constraint and step up by
the step, else step down, halve the step, stop when the last kept γ and the
tried one are within ``tolerance``.  It finds the largest feasible γ up to
2 γ_init (the search never looks higher) and returns 0 when nothing larger is
feasible (μ itself always is: it lies in the honest hull).  All attackers of a
round send the same x̃ in the omniscient attacks, as in the papers.

ALIE's z_max is the formula with n and f as above; the epfml code of
Karimireddy et al. (``ALittleIsEnoughAttack``) counts among the n − f honest
workers instead, Φ⁻¹((n − f − s)/(n − f)) (0.336 at n = 50, f = 12, against
0.583 here): pass ``z`` to use it.

Min-sum's bound: the authors' code (vrt1shjwlkr/NDSS21-Model-Poisoning,
``our_attack_score``) compares with the *smallest* honest sum, so that the
forged update scores no worse than the best honest one; "max" is the looser
reading of the constraint.  Default "min", the code's; the defaults γ_init = 10,
tolerance 1e-5 and direction "unit" are the code's too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

DIRECTIONS = ("std", "unit", "sign")


class AttackSettings:
    """What every attack's settings declare, as class keywords: ``name`` (``attack.kind`` in configs) and whether it
    is ``omniscient`` (reads the round's honest updates X)."""

    name: ClassVar[str]
    omniscient: ClassVar[bool]

    def __init_subclass__(cls, *, name: str, omniscient: bool, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name, cls.omniscient = name, omniscient


def _require(holds: bool, name: str, rule: str, value: object) -> None:
    """ValueError "{name}: {rule}, got {value}" unless a setting ``holds`` (NaN never does)."""
    if not holds:
        raise ValueError(f"{name}: {rule}, got {value}")


@dataclass(frozen=True)
class SignFlip(AttackSettings, name="sign_flip", omniscient=False):
    scale: float = 1.0


@dataclass(frozen=True)
class Scaled(AttackSettings, name="scaled", omniscient=False):
    factor: float


@dataclass(frozen=True)
class GaussianNoise(AttackSettings, name="gaussian_noise", omniscient=False):
    std: float
    around_honest: bool = False

    def __post_init__(self) -> None:
        _require(self.std >= 0, self.name, "std must be ≥ 0", self.std)


@dataclass(frozen=True)
class LittleIsEnough(AttackSettings, name="alie", omniscient=True):
    """ALIE; ``z`` None takes the paper's z_max from the round's n and f."""

    z: float | None = None


@dataclass(frozen=True)
class InnerProduct(AttackSettings, name="ipm", omniscient=True):
    """IPM with ε > 0 (the paper's small ε = 0.1 slips past Krum; large ε = 100 beats the median)."""

    epsilon: float

    def __post_init__(self) -> None:
        _require(self.epsilon > 0, self.name, "epsilon must be positive", self.epsilon)


@dataclass(frozen=True)
class _GammaSearch:
    """The keys of min-max's and min-sum's search for γ along the direction p (module docstring)."""

    name: ClassVar[str]

    direction: str = "unit"
    gamma_init: float = 10.0
    tolerance: float = 1e-5

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"{self.name}: direction must be one of {', '.join(DIRECTIONS)}, got {self.direction!r}")
        _require(
            self.gamma_init > 0 and self.tolerance > 0,
            self.name,
            "gamma_init and tolerance must be positive",
            f"{self.gamma_init}, {self.tolerance}",
        )


@dataclass(frozen=True)
class MinMax(_GammaSearch, AttackSettings, name="min_max", omniscient=True):
    pass


@dataclass(frozen=True)
class MinSum(_GammaSearch, AttackSettings, name="min_sum", omniscient=True):
    bound: str = "min"  # the honest sum the forged one must not exceed: the smallest ("min", the code's) or largest

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bound not in ("min", "max"):
            raise ValueError(f"min_sum: bound must be 'min' (the authors' code) or 'max', got {self.bound!r}")


ATTACKS: dict[str, type] = {
    a.name: a for a in (SignFlip, Scaled, GaussianNoise, LittleIsEnough, InnerProduct, MinMax, MinSum)
}

Attack = SignFlip | Scaled | GaussianNoise | LittleIsEnough | InnerProduct | MinMax | MinSum


# ------------------------------------------------------------------------------------------------ statistics


def _honest(honest_updates: torch.Tensor | None, name: str, at_least: int = 1) -> torch.Tensor:
    if honest_updates is None or honest_updates.dim() != 2 or honest_updates.shape[0] < at_least:
        raise ValueError(
            f"{name} is omniscient: pass the round's honest updates as an [h, d] tensor with h ≥ {at_least} "
            "(a round with fewer honest clients has nothing to imitate)"
        )
    return honest_updates


def alie_z_max(num_clients: int, num_byzantine: int) -> float:
    """Baruch et al.'s z_max = Φ⁻¹((n − s) / n) with s = ⌊n/2 + 1⌋ − f, the supporters an attacker needs."""
    n, f = num_clients, num_byzantine
    if not 0 <= f < n:
        raise ValueError(f"alie needs 0 ≤ f < n, got n = {n}, f = {f}")
    s = (n // 2 + 1) - f
    return float(torch.special.ndtri(torch.tensor((n - s) / n, dtype=torch.float64)))


def deviation(honest_updates: torch.Tensor, direction: str) -> torch.Tensor:
    """Shejwalkar and Houmansadr's perturbation p: −σ, −μ/‖μ‖ or −sign(μ)."""
    mean = honest_updates.mean(dim=0)
    if direction == "std":
        return -honest_updates.std(dim=0) if honest_updates.shape[0] > 1 else torch.zeros_like(mean)
    if direction == "unit":
        norm = torch.linalg.vector_norm(mean)
        return -mean / norm if norm > 0 else torch.zeros_like(mean)
    return -torch.sign(mean)


def _pairwise(honest_updates: torch.Tensor) -> torch.Tensor:
    """[h, h] ‖x_i − x_j‖², row by row (exact differences)."""
    return torch.stack([((honest_updates - row) ** 2).sum(dim=1) for row in honest_updates])


def min_max_feasible(honest_updates: torch.Tensor) -> Callable[[torch.Tensor], bool]:
    bound = _pairwise(honest_updates).max()
    return lambda forged: bool(((honest_updates - forged) ** 2).sum(dim=1).max() <= bound)


def min_sum_feasible(honest_updates: torch.Tensor, bound: str = "min") -> Callable[[torch.Tensor], bool]:
    sums = _pairwise(honest_updates).sum(dim=1)
    limit = sums.min() if bound == "min" else sums.max()
    return lambda forged: bool(((honest_updates - forged) ** 2).sum() <= limit)


def search_gamma(
    feasible: Callable[[torch.Tensor], bool],
    mean: torch.Tensor,
    direction: torch.Tensor,
    gamma_init: float,
    tolerance: float,
) -> float:
    """The largest γ in [0, 2 γ_init] (to ``tolerance``) with ``feasible(μ + γ p)``, by the paper's halving search."""
    gamma, step, kept = gamma_init, gamma_init / 2, 0.0
    while abs(kept - gamma) > tolerance:
        if feasible(mean + gamma * direction):
            kept = gamma
            gamma += step
        else:
            gamma -= step
        step /= 2
    return kept


def min_max_gamma(settings: MinMax | MinSum, honest_updates: torch.Tensor) -> float:
    """γ of min-max (or of min-sum, given ``MinSum``) against the round's honest updates."""
    honest = _honest(honest_updates, settings.name)
    feasible = min_max_feasible(honest) if isinstance(settings, MinMax) else min_sum_feasible(honest, settings.bound)
    return search_gamma(
        feasible, honest.mean(dim=0), deviation(honest, settings.direction), settings.gamma_init, settings.tolerance
    )


# ------------------------------------------------------------------------------------------------ the entry point


def forge(
    settings: Attack,
    honest_update: torch.Tensor | None = None,
    *,
    honest_updates: torch.Tensor | None = None,
    num_clients: int | None = None,
    num_byzantine: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """What a Byzantine client reports in place of ``honest_update`` ([d]) under attack ``settings``.

    ``honest_updates`` ([h, d]) are the round's honest updates, for the omniscient attacks
    (ALIE, IPM, min-max, min-sum); ``num_clients`` n and ``num_byzantine`` f are ALIE's (for z_max);
    ``generator`` is the client's noise generator (``byzantine.noise_generator``) for Gaussian noise.

    Example:
        >>> import torch
        >>> forge(SignFlip(), torch.tensor([1.0, -2.0]))
        tensor([-1.,  2.])
    """
    if not settings.omniscient and honest_update is None:
        raise ValueError(f"{settings.name} forges from the client's own honest update: pass honest_update")
    if isinstance(settings, SignFlip):
        return -settings.scale * honest_update
    if isinstance(settings, Scaled):
        return settings.factor * honest_update
    if isinstance(settings, GaussianNoise):
        if generator is None:
            raise ValueError(
                "gaussian_noise needs the client's seeded generator (driftlab.attacks.byzantine.noise_generator)"
            )
        noise = torch.randn(honest_update.shape, generator=generator, dtype=honest_update.dtype) * settings.std
        noise = noise.to(honest_update.device)  # drawn on the CPU, so every backend draws the same numbers
        return honest_update + noise if settings.around_honest else noise
    if isinstance(settings, LittleIsEnough):
        honest = _honest(honest_updates, settings.name, at_least=2)
        z = settings.z
        if z is None:
            if num_clients is None or num_byzantine is None:
                raise ValueError("alie without z needs num_clients (n) and num_byzantine (f) for z_max")
            z = alie_z_max(num_clients, num_byzantine)
        return honest.mean(dim=0) - z * honest.std(dim=0)
    if isinstance(settings, InnerProduct):
        return -settings.epsilon * _honest(honest_updates, settings.name).mean(dim=0)
    if isinstance(settings, MinMax | MinSum):
        honest = _honest(honest_updates, settings.name)
        return honest.mean(dim=0) + min_max_gamma(settings, honest) * deviation(honest, settings.direction)
    raise ValueError(f"not an attack's settings: {settings!r}; choose one of {', '.join(sorted(ATTACKS))}")
