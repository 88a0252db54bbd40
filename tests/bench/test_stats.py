"""The interval statistics of interleaved benchmarks (bench/stats.py) on synthetic data: Student's
t quantiles against tabulated values, the paired log-ratio interval against a hand computation,
a null pair whose interval contains 1.0, a clear slowdown whose interval excludes it, and the
errors for unusable input. No timing."""

from __future__ import annotations

import math
import statistics

import pytest

from moescale.bench.stats import paired_ratio, t_quantile

# two-sided 95% (p = 0.975) quantiles from a t table
T_975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 6: 2.4469, 10: 2.2281, 14: 2.1448,
         19: 2.0930, 29: 2.0452, 60: 2.0003, 120: 1.9799}


@pytest.mark.parametrize("df,want", sorted(T_975.items()))
def test_t_quantile_matches_the_table(df, want):
    assert t_quantile(0.975, df) == pytest.approx(want, rel=2e-3)
    assert t_quantile(0.025, df) == pytest.approx(-want, rel=2e-3)   # symmetric


def test_t_quantile_one_sided_and_limits():
    assert t_quantile(0.95, 14) == pytest.approx(1.7613, rel=1e-3)
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-12)
    assert t_quantile(0.975, 10_000) == pytest.approx(1.96020, rel=1e-5)   # -> normal 1.95996
    with pytest.raises(ValueError, match="df"):
        t_quantile(0.975, 0)
    with pytest.raises(ValueError, match="p="):
        t_quantile(1.0, 5)


def test_paired_ratio_is_the_t_interval_of_the_log_ratios():
    base = [1.0, 1.2, 0.9, 1.5, 1.1, 1.3, 0.95, 1.05, 1.4, 1.0, 1.25, 0.85, 1.15, 1.1, 1.35]
    factors = [1.04, 1.07, 1.02, 1.09, 1.05, 1.03, 1.08, 1.06, 1.01, 1.05, 1.04, 1.06, 1.07,
               1.03, 1.05]
    slow = [b * f for b, f in zip(base, factors)]
    got = paired_ratio(slow, base)
    logs = [math.log(f) for f in factors]
    half = 2.1448 * statistics.stdev(logs) / math.sqrt(15)
    mean = statistics.fmean(logs)
    assert got.n == 15 and got.confidence == 0.95
    assert got.ratio == pytest.approx(math.exp(mean), rel=1e-12)
    assert got.low == pytest.approx(math.exp(mean - half), rel=1e-4)
    assert got.high == pytest.approx(math.exp(mean + half), rel=1e-4)
    assert got.median_ratio == pytest.approx(statistics.median(factors))
    assert not got.contains(1.0) and got.low > 1.0      # a real 5% slowdown is resolved
    assert set(got.as_dict()) >= {"ratio", "low", "high", "median_ratio", "n"}
    assert "95% CI" in str(got)


def test_paired_ratio_of_a_null_pair_contains_one_and_is_exact_for_identical_times():
    base = [2.0, 2.4, 1.8, 3.0, 2.2, 2.6, 1.9, 2.1, 2.8, 2.0, 2.5, 1.7, 2.3, 2.2, 2.7]
    jitter = [1.03, 0.97, 1.01, 0.99, 1.02, 0.98, 1.0, 1.04, 0.96, 1.01, 0.99, 1.02, 0.98,
              1.0, 1.0]   # no systematic difference
    null = paired_ratio([b * j for b, j in zip(base, jitter)], base)
    assert null.contains(1.0) and null.high - null.low < 0.05
    same = paired_ratio(base, base)
    assert (same.ratio, same.low, same.high) == (1.0, 1.0, 1.0)


def test_paired_ratio_refuses_unpaired_or_too_few_or_nonpositive_times():
    with pytest.raises(ValueError, match="equal counts"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=">= 2 pairs"):
        paired_ratio([1.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        paired_ratio([1.0, 0.0], [1.0, 1.0])
