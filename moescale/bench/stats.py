"""Statistics for interleaved benchmark repetitions: a ratio of step times with its noise.

`paired_ratio(times_a, times_b)` takes the per-repetition times of two implementations timed
round-robin (repetition i of each ran back to back, so load from other processes hits the pair
alike) and returns the geometric mean of the paired ratios a_i / b_i with a confidence
interval: the mean of the log-ratios +- t(n-1) * standard error, mapped back by exp. The
median of the paired ratios is reported beside it. A null control (an implementation timed
against an identical copy of itself) should give an interval that contains 1.0; if it does
not, the measurement is biased (e.g. by the position in the round) and no ratio from the same
run should be trusted.

`t_quantile(p, df)` is Student's t quantile without scipy: exact for df 1 and 2, the
Cornish-Fisher expansion (Abramowitz & Stegun 26.7.5) from df 3 on (relative error < 0.2%
at df 3, < 1e-4 from df 10).

Deliberately not here: timing (measure.py), deciding what is compared (the benchmarks).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Sequence


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t distribution with `df` degrees of freedom."""
    if not 0 < p < 1:
        raise ValueError(f"p={p!r} must be in (0, 1)")
    if df < 1:
        raise ValueError(f"df={df!r} must be >= 1 (two or more samples)")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


@dataclass(frozen=True)
class RatioInterval:
    """A ratio of two implementations' step times and its confidence interval."""

    ratio: float            # geometric mean of the paired ratios
    low: float
    high: float
    median_ratio: float     # median of the paired ratios
    n: int
    confidence: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"{self.ratio:.3f}x [{self.low:.3f}, {self.high:.3f}] "
                f"({self.confidence:.0%} CI, n={self.n})")


def paired_ratio(times_a: Sequence[float], times_b: Sequence[float],
                 confidence: float = 0.95) -> RatioInterval:
    """a / b from paired repetitions: geometric mean and t-interval of the log-ratios."""
    if len(times_a) != len(times_b):
        raise ValueError(f"paired samples need equal counts, got {len(times_a)} and "
                         f"{len(times_b)}")
    if len(times_a) < 2:
        raise ValueError(f"a confidence interval needs >= 2 pairs, got {len(times_a)}")
    if min(*times_a, *times_b) <= 0:
        raise ValueError("times must be positive")
    logs = [math.log(a / b) for a, b in zip(times_a, times_b)]
    n = len(logs)
    mean = statistics.fmean(logs)
    half = t_quantile(0.5 + confidence / 2, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return RatioInterval(ratio=math.exp(mean), low=math.exp(mean - half),
                         high=math.exp(mean + half),
                         median_ratio=statistics.median(a / b for a, b in zip(times_a, times_b)),
                         n=n, confidence=confidence)
