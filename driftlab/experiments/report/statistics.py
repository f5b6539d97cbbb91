"""Statistics over seeds for reports: mean, standard deviation, a 95% confidence interval, and paired comparisons.

With s seeds of a method, values x_1 … x_s (a final accuracy, rounds to a target):

    mean  x̄ = Σ x_i / s,     std  σ = sqrt(Σ (x_i − x̄)² / (s − 1))          (the sample std: unbiased variance)
    95% CI  x̄ ± t_{0.975, s−1} σ / √s                                        (Student's t; none for one seed)

A paired comparison of a method with a baseline uses the seeds both ran (the same seed gives both the same data,
model initialisation and client samples, so the difference removes what the seeds share):

    d_i = x_i − b_i,   d̄ ± t_{0.975, n−1} σ_d / √n                            (CI of the mean difference)
    t = d̄ / (σ_d / √n),  p = P(|T_{n−1}| ≥ |t|)                              (paired t-test, two-sided)
    p_flip = #{signs ε ∈ {±1}ⁿ : |Σ ε_i d_i| ≥ |Σ d_i|} / 2ⁿ                  (exact sign-flip test, no normality)

The sign-flip test is exact for any n (2ⁿ sign patterns, all enumerated up to n = 16, else 65,536 drawn from a
generator seeded by the differences' count); its smallest p is 2/2ⁿ, so with 3 seeds no difference can be
significant at 5% (p ≥ 0.25): reports say so rather than let a reader over-read three seeds.

Student's t distribution is computed here (the regularized incomplete beta function by its continued fraction,
Numerical Recipes §6.4) so that reports need no SciPy; tested against tabulated quantiles.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

LEVEL = 0.95
MAX_ENUMERATED_SIGNS = 16  # 2^16 sign patterns enumerated; more clients draw as many


@dataclass(frozen=True)
class Summary:
    """Mean, sample std and 95% CI of values over seeds (``low``/``high`` None for a single value)."""

    mean: float
    std: float
    count: int
    low: float | None
    high: float | None


@dataclass(frozen=True)
class PairedComparison:
    """A method minus a baseline over the seeds both ran: the mean difference, its 95% CI and two p-values."""

    mean_difference: float
    count: int
    low: float | None
    high: float | None
    p_value: float | None  # paired t-test, two-sided (None: fewer than 2 pairs, or all differences equal)
    p_sign_flip: float | None  # exact sign-flip test (None: no pairs)


def summarize(values: Sequence[float]) -> Summary:
    """``Summary`` of ``values`` (at least one)."""
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        raise ValueError("summarize needs at least one value")
    mean = float(data.mean())
    if data.size == 1:
        return Summary(mean, 0.0, 1, None, None)
    std = float(data.std(ddof=1))
    half = t_quantile(0.5 + LEVEL / 2, data.size - 1) * std / math.sqrt(data.size)
    return Summary(mean, std, int(data.size), mean - half, mean + half)


def paired(values: dict[int, float], baseline: dict[int, float]) -> PairedComparison | None:
    """The paired comparison over the seeds in both ``values`` and ``baseline`` (seed -> value); None: no seed in both."""
    seeds = sorted(set(values) & set(baseline))
    if not seeds:
        return None
    differences = np.array([values[s] - baseline[s] for s in seeds], dtype=np.float64)
    n = differences.size
    mean = float(differences.mean())
    if n == 1:
        return PairedComparison(mean, 1, None, None, None, 1.0)
    std = float(differences.std(ddof=1))
    half = t_quantile(0.5 + LEVEL / 2, n - 1) * std / math.sqrt(n)
    p_value = None
    if std > 0:
        statistic = mean / (std / math.sqrt(n))
        p_value = t_two_sided_p(statistic, n - 1)
    return PairedComparison(mean, n, mean - half, mean + half, p_value, sign_flip_p(differences))


def sign_flip_p(differences: np.ndarray) -> float:
    """P(|Σ ε_i d_i| ≥ |Σ d_i|) over uniform random signs ε: exact enumeration up to ``MAX_ENUMERATED_SIGNS`` values."""
    d = np.asarray(differences, dtype=np.float64)
    observed = abs(float(d.sum()))
    tolerance = 1e-12 * max(1.0, float(np.abs(d).sum()))
    if d.size <= MAX_ENUMERATED_SIGNS:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))
    else:
        signs = np.random.default_rng(d.size).choice((1.0, -1.0), size=(1 << MAX_ENUMERATED_SIGNS, d.size))
    sums = np.abs(signs @ d)
    return float(np.mean(sums >= observed - tolerance))


# ---------------------------------------------------------------- Student's t, without SciPy


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom: 1 − I_x(df/2, 1/2)/2 with x = df/(df + t²) for t ≥ 0."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t >= 0 else tail


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| ≥ |t|) = I_x(df/2, 1/2), x = df/(df + t²)."""
    return regularized_beta(df / (df + t * t), df / 2.0, 0.5)


def t_quantile(probability: float, df: float) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (bisection on ``t_cdf``)."""
    if not 0 < probability < 1:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    if probability < 0.5:
        return -t_quantile(1 - probability, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < probability:
        high *= 2.0
    for _ in range(200):  # far below float resolution of the interval
        middle = 0.5 * (low + high)
        if t_cdf(middle, df) < probability:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function (continued fraction, modified Lentz)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(1.0 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return result
