"""Statistics over seeds: Student's t against tabulated values, the CI and paired comparisons on hand-checked cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from driftlab.experiments.report.statistics import (
    paired,
    regularized_beta,
    sign_flip_p,
    summarize,
    t_cdf,
    t_quantile,
    t_two_sided_p,
)


@pytest.mark.parametrize(
    "df, quantile",
    [(1, 12.706204736), (2, 4.302652730), (4, 2.776445105), (9, 2.262157163), (29, 2.045229642), (1000, 1.962339081)],
)
def test_the_975_quantile_of_students_t_matches_the_tables(df, quantile):
    assert t_quantile(0.975, df) == pytest.approx(quantile, rel=1e-8)
    assert t_quantile(0.025, df) == pytest.approx(-quantile, rel=1e-8)


def test_the_t_distribution_and_the_incomplete_beta_function_on_known_values():
    assert t_cdf(0.0, 5) == pytest.approx(0.5, abs=1e-15)
    assert t_two_sided_p(2.0, 10) == pytest.approx(0.073388034, rel=1e-7)  # R: 2 * pt(-2, 10)
    assert t_cdf(1.0, 1) == pytest.approx(0.75, rel=1e-12)  # Cauchy: 1/2 + atan(1)/π
    assert regularized_beta(0.3, 1.0, 1.0) == pytest.approx(0.3, rel=1e-13)  # I_x(1, 1) = x
    assert regularized_beta(0.4, 2.0, 3.0) == pytest.approx(0.5248, rel=1e-12)  # 1 − Σ_{j<2} C(4, j) 0.4^j 0.6^(4−j)


def test_a_summary_gives_the_sample_std_and_a_t_interval():
    summary = summarize([1.0, 2.0, 3.0])
    assert (summary.mean, summary.std, summary.count) == (2.0, 1.0, 3)
    half = 4.302652730 / math.sqrt(3)
    assert summary.low == pytest.approx(2.0 - half, rel=1e-9) and summary.high == pytest.approx(2.0 + half, rel=1e-9)
    single = summarize([0.7])
    assert (single.mean, single.std, single.low, single.high) == (0.7, 0.0, None, None)
    with pytest.raises(ValueError, match="at least one value"):
        summarize([])


def test_a_paired_comparison_uses_only_the_seeds_both_ran_and_their_differences():
    method = {0: 0.80, 1: 0.85, 2: 0.83, 3: 0.90}
    baseline = {0: 0.78, 1: 0.81, 2: 0.80, 5: 0.10}  # seed 3 and 5 have no partner
    comparison = paired(method, baseline)
    differences = np.array([0.02, 0.04, 0.03])
    assert comparison.count == 3 and comparison.mean_difference == pytest.approx(0.03, abs=1e-15)
    statistic = differences.mean() / (differences.std(ddof=1) / math.sqrt(3))
    assert comparison.p_value == pytest.approx(t_two_sided_p(statistic, 2), rel=1e-12)
    assert comparison.p_value < 0.05  # consistent differences: the paired t-test sees them
    assert comparison.p_sign_flip == 0.25  # but three seeds can never give an exact sign-flip p below 2/8
    assert comparison.low > 0 and comparison.high > comparison.low
    assert paired({0: 1.0}, {1: 1.0}) is None


def test_the_sign_flip_test_is_exact():
    assert sign_flip_p(np.array([1.0, 2.0, 3.0])) == 0.25  # only all-plus and all-minus reach |Σ| = 6
    assert sign_flip_p(np.array([1.0, -1.0])) == 1.0  # Σ = 0: every pattern is at least as extreme
    # |±3 ± 1 ± 1 ± 1| reaches 6 only with all signs alike (flipping any one drops it to 4 or 0): 2 of 16 patterns
    assert sign_flip_p(np.array([3.0, 1.0, 1.0, 1.0])) == 2 / 16
    # Σ = 4: 3 plus three ±1 reaches ≥ 4 in 4 of 8 patterns (6 once, 4 three times), and −3 likewise: 8 of 16
    assert sign_flip_p(np.array([3.0, 1.0, 1.0, -1.0])) == 8 / 16
