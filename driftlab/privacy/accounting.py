"""ε(δ) of a run's client-level DP, from Opacus's RDP and PRV accountants (the ``privacy`` extra).

Each round of a private run is one sampled Gaussian mechanism on the clients'
clipped released vectors: every client takes part independently with
probability q (Poisson sampling; q = 1 with full participation), the sum has
sensitivity C (adding or removing one client's whole data) and gets noise
N(0, (zC)²).  T rounds compose T such mechanisms, so ε after T rounds depends
on (q, z, T, δ) only:

* ``"rdp"``: Rényi DP of the sampled Gaussian mechanism (Mironov, Talwar and
  Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism", 2019),
  composed by adding over rounds and converted to (ε, δ) with Balle et al.'s
  bound ("Hypothesis Testing Interpretations and Rényi Differential Privacy",
  AISTATS 2020, Theorem 21), minimized over the orders ``ORDERS``: Opacus's
  ``compute_rdp`` and ``get_privacy_spent``.  The RDP of one round is the
  expensive part (tens of milliseconds at fractional orders); it is cached per
  (q, z), and round T costs a multiplication and a minimum (microseconds).
* ``"prv"``: numerical composition of privacy loss random variables (Gopi, Lee
  and Wutschitz, "Numerical Composition of Differential Privacy", NeurIPS 2021):
  Opacus's ``PRVAccountant`` with its default errors (``PRV_EPS_ERROR`` = 0.01 on
  ε, δ/1000 on δ), whose ε is an upper bound, typically tighter than RDP's.  It
  costs milliseconds to a second per (q, z, T) (an FFT over a grid that grows
  with T and ε) and is cached per (q, z, T, δ).

Opacus is imported when an ε is first asked for, so that a run without
``[privacy]`` does not need it.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from driftlab.errors import ConfigError
from driftlab.extras import install_hint
from driftlab.privacy.settings import ACCOUNTANTS

if TYPE_CHECKING:
    from driftlab.privacy.settings import PrivacySettings

# Opacus's RDPAccountant.DEFAULT_ALPHAS (the same expression, so the same floats), then larger integer orders: the
# optimal order grows as ε shrinks (about z·sqrt(2 log(1/δ)/T) at q = 1), and below ε ≈ 0.2 it passes 63, where
# Opacus's default list ends and its ε is looser than it need be.
OPACUS_DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
ORDERS: tuple[float, ...] = (*OPACUS_DEFAULT_ORDERS, 80, 96, 128, 192, 256, 512)

PRV_EPS_ERROR = 0.01  # Opacus's PRVAccountant default: the ε it returns is an upper bound at most about this loose

MAX_NOISE_MULTIPLIER = 1e3  # noise_multiplier_for searches z in (0, 1e3]; beyond it a model is noise
MIN_NOISE_MULTIPLIER = 1e-4  # ... and stops halving below this (ε there is far beyond any useful target)
SEARCH_RELATIVE_TOLERANCE = 0.005  # noise_multiplier_for's z gives ε in [(1 - 0.005) target, target]

# Where Opacus's PRV stops working: its grid of privacy losses t spans [−L, L] with L a little above RDP's ε, and it
# takes exp(±t), which overflows past 709 (ε then comes out capped near 709, silently wrong); a grid of more than
# 2²⁴ points (128 MiB per float64 array, several arrays; the grid grows with ε and with √T) arises at ε above 70 with
# 10⁵ rounds, above 700 with 10³.  Both are refused with a ValueError naming RDP, whose ε costs microseconds.
PRV_MAX_LOSS = 700.0
PRV_MAX_GRID = 1 << 24


def _opacus_rdp():
    """Opacus's RDP analysis module, imported on first use (the ``privacy`` extra)."""
    try:
        from opacus.accountants.analysis import rdp
    except ImportError:
        raise ConfigError(f"privacy accounting (privacy.delta) needs Opacus: {install_hint('privacy')}") from None
    return rdp


def _opacus_prv():
    """Opacus's PRV analysis module, imported on first use (the ``privacy`` extra)."""
    try:
        from opacus.accountants.analysis import prv
    except ImportError:
        raise ConfigError(f"privacy accounting (privacy.delta) needs Opacus: {install_hint('privacy')}") from None
    return prv


def _check(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float, accountant: str) -> None:
    if not (isinstance(noise_multiplier, int | float) and noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise multiplier must be a finite number ≥ 0, got {noise_multiplier!r}")
    if not (isinstance(sampling_rate, int | float) and 0 < sampling_rate <= 1):
        raise ValueError(f"sampling rate must be in (0, 1] (clients per round / population), got {sampling_rate!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an integer ≥ 0, got {rounds!r}")
    if not (isinstance(delta, int | float) and 0 < delta < 1):
        raise ValueError(f"δ must be in (0, 1) (usually below 1/population), got {delta!r}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")


def epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    accountant: str = "rdp",
    *,
    orders: Sequence[float] | None = None,
) -> float:
    """ε after ``rounds`` rounds of the sampled Gaussian mechanism (multiplier z, Poisson rate q) at ``delta``.

    ``math.inf`` when z = 0 (no noise) and 0.0 after no rounds.  ``orders``
    (``"rdp"`` only) replaces ``ORDERS``, the RDP orders minimized over.
    """
    _check(noise_multiplier, sampling_rate, rounds, delta, accountant)
    if orders is not None and accountant != "rdp":
        raise ValueError(f"orders are RDP orders: they apply to accountant 'rdp', not {accountant!r}")
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    q, z = float(sampling_rate), float(noise_multiplier)
    if accountant == "prv":
        return _prv_epsilon(q, z, rounds, float(delta))
    chosen = ORDERS if orders is None else tuple(float(order) for order in orders)
    if not chosen or min(chosen) <= 1:
        raise ValueError(f"RDP orders must be a non-empty list of numbers > 1, got {orders!r}")
    return _rdp_epsilon(q, z, rounds, float(delta), chosen)


def local_epsilon(noise_multiplier: float, rounds: int, delta: float, accountant: str = "rdp") -> float:
    """ε of each client's own messages under local noise, after ``rounds`` rounds.

    A message is clipped to C and gets N(0, (zC)²) itself.  The guarantee is
    about what one client sends, so neighbouring inputs are two of its datasets,
    whose clipped vectors differ by up to 2C: sensitivity 2C, multiplier z/2.
    Sampling does not amplify it (the client knows it was sampled), and a client
    may be sampled every round: q = 1 over all ``rounds`` rounds, the worst case.
    """
    return epsilon(noise_multiplier / 2, 1.0, rounds, delta, accountant)


def run_epsilon(settings: PrivacySettings, rounds: int) -> float | None:
    """ε after ``rounds`` rounds of a run with these privacy settings; None when the run sets no δ.

    Central noise: the sampled Gaussian mechanism at the accounting rate (the
    run's q, or M / population with ``noise_cohort_size``) and multiplier z (with
    adaptive clipping, z covers the update and the clipped count together:
    Andrew et al. 2021, Theorem 1).  Local noise: ``local_epsilon``.
    """
    if settings.delta is None:
        return None
    if settings.noise == "local":
        return local_epsilon(settings.noise_multiplier, rounds, settings.delta, settings.accountant)
    return epsilon(settings.noise_multiplier, settings.accounting_rate, rounds, settings.delta, settings.accountant)


def noise_multiplier_for(
    target_epsilon: float, delta: float, sampling_rate: float, rounds: int, accountant: str = "rdp"
) -> float:
    """The noise multiplier z whose ε after ``rounds`` rounds is at most ``target_epsilon``, and within 0.5% of it.

    Our own bisection over ``epsilon``, not Opacus's ``get_noise_multiplier``:
    that one stops within an absolute 0.01 of ε (1% of ε = 1, 100% of ε = 0.01)
    and searches z up to 10⁶.  Here z is bracketed by doubling or halving from
    1 (ε falls as z grows), then bisected until ε(z) ≥ (1 − 0.005)·target; z is
    searched up to ``MAX_NOISE_MULTIPLIER`` = 10³: a target that needs more
    raises ValueError.  Each step costs one ``epsilon`` (a fresh RDP vector:
    tens of milliseconds; PRV: up to about a second), some 10 to 20 in all.
    PRV cannot compute ε in the hundreds (``PRV_MAX_LOSS``): the search takes a
    z it refuses for one over the target.
    """
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, int | float) or not target_epsilon > 0:
        raise ValueError(f"target ε must be a number > 0, got {target_epsilon!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer ≥ 1 to calibrate noise for, got {rounds!r}")
    _check(1.0, sampling_rate, rounds, delta, accountant)
    target = float(target_epsilon)

    def eps(z: float) -> float:
        try:
            return epsilon(z, sampling_rate, rounds, delta, accountant)
        except ConfigError:
            raise
        except ValueError:
            # PRV refuses z whose ε is too large for its grid: over the target.  Erring this way is safe: the z
            # returned is always one whose ε was computed and found within the target.
            if accountant != "prv":
                raise
            return math.inf

    if eps(MAX_NOISE_MULTIPLIER) > target:
        bound = f"1e{math.log10(MAX_NOISE_MULTIPLIER):.0f}"
        raise ValueError(
            f"no noise multiplier up to {bound} reaches ε = {target:g} with δ = {delta:g} in {rounds} rounds at "
            f"sampling rate {sampling_rate:g}; allow a larger ε, fewer rounds or a smaller sampling rate"
        )
    # Bracket: eps(high) ≤ target < eps(low).
    high = 1.0
    if eps(high) > target:
        while eps(high) > target:
            high = min(2 * high, MAX_NOISE_MULTIPLIER)
        low = high / 2
    else:
        low = high / 2
        while eps(low) <= target:
            if low / 2 < MIN_NOISE_MULTIPLIER:
                return low  # ε is at most the target even at this little noise
            high, low = low, low / 2
    while eps(high) < (1 - SEARCH_RELATIVE_TOLERANCE) * target and high - low > 1e-12 * high:
        middle = (low + high) / 2
        if eps(middle) <= target:
            high = middle
        else:
            low = middle
    return high


# ----------------------------------------------------------------------------------------------------------------
# RDP


@functools.lru_cache(maxsize=256)
def _rdp_per_round(q: float, z: float, orders: tuple[float, ...]) -> np.ndarray:
    """RDP of one round at each order (read-only), the expensive part of RDP accounting."""
    rdp = _opacus_rdp().compute_rdp(q=q, noise_multiplier=z, steps=1, orders=list(orders))
    rdp.setflags(write=False)
    return rdp


def _privacy_spent(orders: Sequence[float], rdp: np.ndarray, delta: float) -> float:
    """Opacus's RDP → (ε, δ) conversion, minimized over ``orders``.

    Opacus warns when the optimum is the first or last order; that happens only
    at ε in the hundreds (order 1.1) or below about 0.02 (order 512), where a
    wider list of orders would change ε little, so the warning is not passed on.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        eps, _ = _opacus_rdp().get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=4096)
def _rdp_epsilon(q: float, z: float, rounds: int, delta: float, orders: tuple[float, ...]) -> float:
    # rounds · RDP(one round): RDP composes by addition.  Opacus's compute_rdp(steps=T) is this very product.
    return _privacy_spent(orders, _rdp_per_round(q, z, orders) * rounds, delta)


# ----------------------------------------------------------------------------------------------------------------
# PRV


@functools.lru_cache(maxsize=1024)
def _prv_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    """Opacus's ``PRVAccountant`` with history [(z, q, rounds)] and its default errors, at ``delta``.

    The steps of ``PRVAccountant.get_epsilon`` (Opacus 1.6), with the two RDP
    vectors its safe-domain bound computes (``compute_safe_domain_size``: RDP ε of
    all rounds at δ_err/4 and of one round at δ_err/(8T), over Opacus's default
    orders) taken from the per-(q, z) cache: half its time at fractional orders.
    The result is the same float (accounting_test checks it).

    At q = 1 the T rounds compose to one Gaussian mechanism of multiplier z/√T
    (a sum of T independent Gaussian privacy losses is one), so the PRV of one
    round at z/√T is used: its grid does not grow with T (the composed one costs
    seconds at T = 1000), and it skips T − 1 discretized self-compositions.
    """
    try:
        with np.errstate(divide="ignore"):  # Opacus's PRV takes log(1 − q), −inf at q = 1, on purpose
            if q == 1.0:
                return _prv_epsilon_composed(q, z / math.sqrt(rounds), 1, delta)
            return _prv_epsilon_composed(q, z, rounds, delta)
    except ConfigError:
        raise
    except (RuntimeError, ValueError) as error:  # Opacus's: "Cannot compute epsilon", "Discrete mean differs", ...
        raise ValueError(
            f"the PRV accountant cannot compute ε for z = {z:g}, q = {q:g}, {rounds} rounds, δ = {delta:g} "
            f'({error}); use privacy.accountant = "rdp"'
        ) from None


def _prv_epsilon_composed(q: float, z: float, rounds: int, delta: float) -> float:
    prv = _opacus_prv()
    eps_error, delta_error = PRV_EPS_ERROR, delta / 1000
    per_round = _rdp_per_round(q, z, ORDERS)[: len(OPACUS_DEFAULT_ORDERS)]
    bound = max(
        _privacy_spent(OPACUS_DEFAULT_ORDERS, per_round * rounds, delta_error / 4),
        _privacy_spent(OPACUS_DEFAULT_ORDERS, per_round * 1, delta_error / (8 * rounds)),
    )
    half_width = max(bound, eps_error) + 3
    # numpy's log and sqrt, as Opacus computes the mesh: the same grid
    mesh = eps_error / np.sqrt(rounds * np.log(12 / delta_error) / 2)
    if half_width > PRV_MAX_LOSS:
        raise ValueError(
            f"its privacy losses would reach {half_width:.4g}, past e^{PRV_MAX_LOSS:g}: ε is too large for it"
        )
    if 2 * half_width / mesh > PRV_MAX_GRID:
        raise ValueError(f"its grid would have {2 * half_width / mesh:.3g} points: ε is too large for it")
    domain = prv.Domain.create_aligned(-half_width, half_width, mesh)
    truncated = prv.TruncatedPrivacyRandomVariable(prv.PoissonSubsampledGaussianPRV(q, z), domain.t_min, domain.t_max)
    composed = prv.compose_heterogeneous(dprvs=[prv.discretize(truncated, domain)], num_self_compositions=[rounds])
    _, _, eps_upper = composed.compute_epsilon(delta, delta_error, eps_error)
    return float(eps_upper)
