"""ε from ``accounting`` against Opacus's own accountants and against an independent RDP computation.

The independent computation is written here from the papers, with nothing of
Opacus: Mironov, Talwar and Zhang, "Rényi Differential Privacy of the Sampled
Gaussian Mechanism" (2019), Section 3.3, for integer orders α,

    A_α = Σ_{k=0..α} C(α, k) (1 − q)^{α−k} q^k exp((k² − k) / (2σ²)),   RDP(α) = T log(A_α) / (α − 1)

(RDP(α) = T α / (2σ²) at q = 1, the plain Gaussian mechanism), and Balle et al.
(AISTATS 2020, Theorem 21), the conversion Opacus uses,

    ε = min_α  RDP(α) − (log δ + log α) / (α − 1) + log((α − 1) / α).

Flower ships an RDP accountant too (``flwr.supercore.privacy_accounting.RdpAccountant``),
but it wraps Google's dp-accounting, which is not installed here (it pins an old
attrs), so it cannot serve as the second reference.
"""

from __future__ import annotations

import math
import re
import sys
import warnings

import pytest

from driftlab.errors import ConfigError
from driftlab.extras import install_hint
from driftlab.privacy import accounting
from driftlab.privacy.settings import PrivacySettings

opacus_accountants = pytest.importorskip("opacus.accountants")
opacus_rdp = pytest.importorskip("opacus.accountants.analysis.rdp")

# Opacus's own calls below warn as they would anywhere (the optimal order at the end of the list; log(1 − q) at q = 1)
pytestmark = [
    pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
]

# (noise multiplier z, sampling rate q, rounds T, δ)
CASES = [
    (1.0, 0.01, 1, 1e-5),
    (1.0, 0.01, 1000, 1e-5),
    (1.1, 0.1, 100, 1e-5),
    (0.8, 0.001, 500, 1e-6),
    (2.0, 0.05, 37, 1e-4),
    (3.0, 0.01, 100, 1e-6),  # ε below 0.2: the optimal order passes Opacus's default 63
    (5.0, 1.0, 50, 1e-5),
    (0.7, 1.0, 3, 1e-3),
]
INTEGER_ORDERS = (*range(2, 65), 80, 96, 128, 256)


# ------------------------------------------------------------------------------------------------ independent RDP


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(math.fsum(math.exp(value - top) for value in values))


def _log_a(q: float, sigma: float, alpha: int) -> float:
    """log A_α of the sampled Gaussian mechanism (Mironov, Talwar and Zhang 2019, Section 3.3), integer α."""
    return _logsumexp(
        [
            math.lgamma(alpha + 1)
            - math.lgamma(k + 1)
            - math.lgamma(alpha - k + 1)
            + (alpha - k) * math.log1p(-q)
            + k * math.log(q)
            + (k * k - k) / (2 * sigma**2)
            for k in range(alpha + 1)
        ]
    )


def _independent_epsilon(z: float, q: float, rounds: int, delta: float, orders=INTEGER_ORDERS) -> float:
    best = math.inf
    for alpha in orders:
        per_round = alpha / (2 * z**2) if q == 1 else _log_a(q, z, alpha) / (alpha - 1)
        eps = rounds * per_round - (math.log(delta) + math.log(alpha)) / (alpha - 1) + math.log((alpha - 1) / alpha)
        best = min(best, eps)
    return best


def test_independent_log_a_matches_the_closed_form_at_order_2():
    # A_2 = (1 − q)² + 2q(1 − q) + q² e^{1/σ²} = 1 + q² (e^{1/σ²} − 1)
    for q, sigma in [(0.01, 1.0), (0.3, 0.7), (0.9, 4.0)]:
        assert _log_a(q, sigma, 2) == pytest.approx(math.log1p(q * q * math.expm1(1 / sigma**2)), rel=1e-13)


def test_independent_log_a_tends_to_the_plain_gaussian_as_q_tends_to_1():
    # at q = 1 only k = α is left: log A_α = (α² − α)/(2σ²), RDP = α/(2σ²)
    assert _log_a(1 - 1e-15, 2.0, 10) / 9 == pytest.approx(10 / (2 * 2.0**2), rel=1e-9)


@pytest.mark.parametrize(("z", "q", "rounds", "delta"), CASES)
def test_rdp_epsilon_equals_the_independent_computation_at_the_same_orders(z, q, rounds, delta):
    independent = _independent_epsilon(z, q, rounds, delta)
    ours = accounting.epsilon(z, q, rounds, delta, orders=INTEGER_ORDERS)
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=rounds, orders=list(INTEGER_ORDERS))
    opacus, _ = opacus_rdp.get_privacy_spent(orders=list(INTEGER_ORDERS), rdp=rdp, delta=delta)
    assert ours == pytest.approx(independent, rel=1e-9, abs=1e-9)
    assert float(opacus) == pytest.approx(independent, rel=1e-9, abs=1e-9)
    # the default orders add fractional ones between 1 and 11: the minimum can only fall
    assert accounting.epsilon(z, q, rounds, delta) <= ours


# ------------------------------------------------------------------------------------------------ Opacus's own API


def test_orders_begin_with_opacus_defaults():
    assert (
        list(accounting.ORDERS[: len(accounting.OPACUS_DEFAULT_ORDERS)])
        == opacus_accountants.RDPAccountant.DEFAULT_ALPHAS
    )
    assert max(accounting.ORDERS) > max(opacus_accountants.RDPAccountant.DEFAULT_ALPHAS)


@pytest.mark.parametrize(("z", "q", "rounds", "delta"), CASES)
def test_rdp_epsilon_equals_opacus_rdp_accountant(z, q, rounds, delta):
    accountant = opacus_accountants.RDPAccountant()
    accountant.history = [(z, q, rounds)]
    assert accounting.epsilon(z, q, rounds, delta) == accountant.get_epsilon(delta, alphas=list(accounting.ORDERS))


def test_rdp_epsilon_equals_opacus_rdp_accountant_stepped_round_by_round():
    accountant = opacus_accountants.RDPAccountant()
    for rounds in range(1, 31):
        accountant.step(noise_multiplier=1.3, sample_rate=0.02)
        expected = accountant.get_epsilon(1e-5, alphas=list(accounting.ORDERS))
        assert accounting.epsilon(1.3, 0.02, rounds, 1e-5) == expected


@pytest.mark.parametrize(("z", "q", "rounds", "delta"), [case for case in CASES if case[1] < 1])
def test_prv_epsilon_equals_opacus_prv_accountant(z, q, rounds, delta):
    accountant = opacus_accountants.PRVAccountant()
    accountant.history = [(z, q, rounds)]
    assert accounting.epsilon(z, q, rounds, delta, "prv") == accountant.get_epsilon(delta)


@pytest.mark.parametrize(("z", "rounds", "delta"), [(5.0, 50, 1e-5), (0.7, 3, 1e-3), (2.0, 20, 1e-6)])
def test_prv_at_full_participation_is_one_gaussian_of_multiplier_z_over_root_t(z, rounds, delta):
    ours = accounting.epsilon(z, 1.0, rounds, delta, "prv")
    one = opacus_accountants.PRVAccountant()
    one.history = [(z / math.sqrt(rounds), 1.0, 1)]
    composed = opacus_accountants.PRVAccountant()
    composed.history = [(z, 1.0, rounds)]
    assert ours == one.get_epsilon(delta)
    # both are upper bounds within about eps_error of the true ε
    assert ours == pytest.approx(composed.get_epsilon(delta), abs=2 * accounting.PRV_EPS_ERROR)


@pytest.mark.parametrize(("z", "q", "rounds", "delta"), CASES)
def test_prv_is_no_looser_than_rdp(z, q, rounds, delta):
    assert accounting.epsilon(z, q, rounds, delta, "prv") <= accounting.epsilon(z, q, rounds, delta, "rdp")


# ------------------------------------------------------------------------------------------------ shape of ε


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_no_noise_is_no_privacy_and_no_rounds_cost_nothing(accountant):
    assert accounting.epsilon(0.0, 0.1, 10, 1e-5, accountant) == math.inf
    assert accounting.epsilon(0.0, 0.1, 0, 1e-5, accountant) == 0.0
    assert accounting.epsilon(1.0, 0.1, 0, 1e-5, accountant) == 0.0


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_grows_with_rounds_and_rate_and_falls_with_noise(accountant):
    def eps(z, q, rounds):
        return accounting.epsilon(z, q, rounds, 1e-5, accountant)

    assert eps(1.0, 0.05, 10) < eps(1.0, 0.05, 20) < eps(1.0, 0.05, 40)
    assert eps(1.0, 0.02, 20) < eps(1.0, 0.05, 20) < eps(1.0, 0.2, 20)
    assert eps(2.0, 0.05, 20) < eps(1.0, 0.05, 20) < eps(0.7, 0.05, 20)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_local_epsilon_is_a_gaussian_of_half_the_multiplier_every_round(accountant):
    for z, rounds in [(2.0, 1), (4.0, 25), (10.0, 200)]:
        assert accounting.local_epsilon(z, rounds, 1e-5, accountant) == accounting.epsilon(
            z / 2, 1.0, rounds, 1e-5, accountant
        )
    # q = 1 and sensitivity 2C: RDP(α) = T α / (2 (z/2)²)
    assert accounting.local_epsilon(4.0, 25, 1e-5, "rdp") == pytest.approx(
        _independent_epsilon(2.0, 1.0, 25, 1e-5, orders=accounting.ORDERS), rel=1e-12
    )


def _settings(**overrides) -> PrivacySettings:
    fields = dict(
        clip=1.0, noise_multiplier=1.2, seed=0, sampling_rate=0.05, expected_cohort=5.0, population=100, delta=1e-4
    )
    return PrivacySettings(**(fields | overrides))


def test_run_epsilon_follows_the_settings():
    assert accounting.run_epsilon(_settings(delta=None), 10) is None
    assert accounting.run_epsilon(_settings(), 10) == accounting.epsilon(1.2, 0.05, 10, 1e-4)
    assert accounting.run_epsilon(_settings(accountant="prv"), 10) == accounting.epsilon(1.2, 0.05, 10, 1e-4, "prv")
    # noise_cohort_size M: accounted at q = M / population
    assert accounting.run_epsilon(_settings(noise_cohort_size=20), 10) == accounting.epsilon(1.2, 0.2, 10, 1e-4)
    assert accounting.run_epsilon(_settings(noise="local"), 10) == accounting.local_epsilon(1.2, 10, 1e-4)
    assert accounting.run_epsilon(_settings(noise_multiplier=0.0), 10) == math.inf


# ------------------------------------------------------------------------------------------------ noise for a target


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
@pytest.mark.parametrize(
    ("target", "delta", "q", "rounds"), [(1.0, 1e-5, 0.01, 1000), (8.0, 1e-5, 0.1, 200), (0.5, 1e-6, 0.02, 100)]
)
def test_noise_multiplier_for_reaches_the_target_within_one_percent(accountant, target, delta, q, rounds):
    z = accounting.noise_multiplier_for(target, delta, q, rounds, accountant)
    eps = accounting.epsilon(z, q, rounds, delta, accountant)
    assert 0.99 * target <= eps <= target


def test_noise_multiplier_for_a_generous_target_goes_below_one():
    z = accounting.noise_multiplier_for(50.0, 1e-5, 0.01, 10)
    assert z < 1
    assert 0.99 * 50.0 <= accounting.epsilon(z, 0.01, 10, 1e-5) <= 50.0


@pytest.mark.parametrize(
    ("target", "delta", "q", "rounds"),
    [(0.001, 1e-5, 0.01, 100), (0.5, 1e-5, 1.0, 10**7)],
)
def test_noise_multiplier_for_an_unreachable_target_says_what_to_change(target, delta, q, rounds):
    with pytest.raises(ValueError, match="no noise multiplier up to 1e3 reaches") as raised:
        accounting.noise_multiplier_for(target, delta, q, rounds)
    message = str(raised.value)
    assert f"ε = {target:g}" in message and f"in {rounds} rounds" in message and f"sampling rate {q:g}" in message
    assert "allow a larger ε, fewer rounds or a smaller sampling rate" in message


@pytest.mark.parametrize(
    ("arguments", "phrase"),
    [
        ((0.0, 1e-5, 0.1, 10), "target ε must be a number > 0"),
        ((-1.0, 1e-5, 0.1, 10), "target ε must be a number > 0"),
        ((1.0, 0.0, 0.1, 10), "δ must be in (0, 1)"),
        ((1.0, 1.0, 0.1, 10), "δ must be in (0, 1)"),
        ((1.0, 1e-5, 0.1, 0), "rounds must be an integer ≥ 1"),
        ((1.0, 1e-5, 0.1, 2.5), "rounds must be an integer ≥ 1"),
        ((1.0, 1e-5, 0.0, 10), "sampling rate must be in (0, 1]"),
        ((1.0, 1e-5, 1.5, 10), "sampling rate must be in (0, 1]"),
    ],
)
def test_noise_multiplier_for_refuses_bad_input(arguments, phrase):
    with pytest.raises(ValueError, match=phrase.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        accounting.noise_multiplier_for(*arguments)


@pytest.mark.parametrize(
    ("arguments", "phrase"),
    [
        ((-0.5, 0.1, 10, 1e-5), "noise multiplier must be a finite number ≥ 0"),
        ((math.inf, 0.1, 10, 1e-5), "noise multiplier must be a finite number ≥ 0"),
        ((1.0, 0.1, -1, 1e-5), "rounds must be an integer ≥ 0"),
        ((1.0, 0.1, 10, 1.5), "δ must be in"),
        ((1.0, 0.1, 10, 1e-5, "pld"), "accountant must be one of rdp, prv"),
    ],
)
def test_epsilon_refuses_bad_input(arguments, phrase):
    with pytest.raises(ValueError, match=phrase):
        accounting.epsilon(*arguments)
    with pytest.raises(ValueError, match="apply to accountant 'rdp'"):
        accounting.epsilon(1.0, 0.1, 10, 1e-5, "prv", orders=(2, 3))


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_itself_warns_nothing(accountant):
    # fresh arguments (nothing cached): the optimal order is Opacus's last default in PRV's domain bound, and q = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accounting.epsilon(3.01, 0.0101, 100, 1e-6, accountant)
        accounting.epsilon(5.01, 1.0, 50, 1e-5, accountant)
        accounting.epsilon(0.71, 1.0, 3, 1e-3, accountant)


def test_prv_refuses_a_grid_too_large_and_names_rdp():
    with pytest.raises(
        ValueError, match='the PRV accountant cannot compute ε .* points.* use privacy.accountant = "rdp"'
    ):
        accounting.epsilon(2.0, 0.1, 100_000, 1e-5, "prv")  # RDP: ε = 217


@pytest.mark.parametrize("q", [1.0, 0.3])
def test_prv_refuses_losses_past_where_exp_overflows(q):
    # Opacus itself returns about 697 here, capped by exp overflowing at 709 (RDP: 722)
    with pytest.raises(ValueError, match='cannot compute ε .* past e\\^700.* use privacy.accountant = "rdp"'):
        accounting.epsilon(0.03, q, 1, 1e-5, "prv")
    assert accounting.epsilon(0.035, q, 1, 1e-5, "prv") < accounting.epsilon(0.035, q, 1, 1e-5, "rdp") < 700


def test_noise_multiplier_for_with_prv_steps_over_what_prv_refuses():
    with pytest.raises(ValueError, match="cannot compute ε"):
        accounting.epsilon(0.0625, 1.0, 10, 1e-5, "prv")  # halving from z = 1 reaches it
    z = accounting.noise_multiplier_for(500.0, 1e-5, 1.0, 10, "prv")
    assert 0.99 * 500 <= accounting.epsilon(z, 1.0, 10, 1e-5, "prv") <= 500


def test_missing_opacus_names_the_extra(monkeypatch):
    for name in [name for name in sys.modules if name == "opacus" or name.startswith("opacus.")]:
        monkeypatch.setitem(sys.modules, name, None)
    # arguments no other test uses, so no cached value answers
    for accountant in ("rdp", "prv"):
        with pytest.raises(ConfigError, match=f"needs Opacus: {re.escape(install_hint('privacy'))}$"):
            accounting.epsilon(1.234567, 0.0123, 7, 1e-5, accountant)
