"""Exact tests and intervals for paired outcomes, as pure functions of counts.

McNemar's exact test, Holm's adjustment, Wilson's interval, Newcombe's paired-difference interval and a
task-block bootstrap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def normal_quantile(q: float) -> float:
    """The standard normal's q-quantile: scipy.stats.norm.ppf(q), bit for bit (its `_ppf` is `scipy.special.ndtri`),
    without importing scipy.stats (0.5 s of CPU in every command that prints a figure)."""
    from scipy.special import ndtri

    return float(ndtri(q))


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return normal_quantile(0.5 + confidence / 2.0)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of b discordant wins out of b + c."""
    b, c = _count("b", b), _count("c", c)
    if b + c == 0:
        return 1.0
    return _binomtest_half(b, b + c)


def _binomtest_half(k: int, n: int) -> float:
    """`scipy.stats.binomtest(k, n, 0.5).pvalue` (two-sided), bit for bit, from the binomial functions scipy.stats's
    `binom` calls (`scipy.special`'s `_binom_pmf`, `_binom_cdf`, `_binom_sf`) and the steps of its `binomtest`:
    the mass at k, the first term past the mode at or below it (times 1 + 1e-7), the two tails added.
    tests/test_exact_stats_scipy.py holds it to scipy.stats on every k <= n <= 60 and on larger n.
    A scipy without those functions gets scipy.stats's own test."""
    try:
        from scipy.special._ufuncs import _binom_cdf, _binom_pmf, _binom_sf
    except ImportError:  # another scipy
        from scipy.stats import binomtest

        return float(binomtest(k, n, 0.5).pvalue)
    p = 0.5

    def pmf(x: int) -> float:  # binom.pmf: 0 off the support, else the mass clipped to [0, 1]
        return min(max(float(_binom_pmf(float(x), float(n), p)), 0.0), 1.0) if 0 <= x <= n else 0.0

    def cdf(x: int) -> float:  # binom.cdf: 0 below the support, 1 at and past its top
        return 0.0 if x < 0 else 1.0 if x >= n else min(max(float(_binom_cdf(float(x), float(n), p)), 0.0), 1.0)

    def sf(x: int) -> float:  # binom.sf: 1 below the support, 0 at and past its top
        return 1.0 if x < 0 else 0.0 if x >= n else min(max(float(_binom_sf(float(x), float(n), p)), 0.0), 1.0)

    def search(a, d: float, lo: int, hi: int) -> int:  # the index i in [lo, hi] with a(i) <= d < a(i + 1)
        while lo < hi:
            mid = lo + (hi - lo) // 2
            value = a(mid)
            if value < d:
                lo = mid + 1
            elif value > d:
                hi = mid - 1
            else:
                return mid
        return lo if a(lo) <= d else lo - 1

    d, rerr = pmf(k), 1 + 1e-7
    if k == p * n:
        return 1.0
    if k < p * n:
        ix = search(lambda x: -pmf(x), -d * rerr, math.ceil(p * n), n)
        y = n - ix + int(d * rerr == pmf(ix))
        pval = cdf(k) + sf(n - y)
    else:
        ix = search(pmf, d * rerr, 0, math.floor(p * n))
        pval = cdf(ix) + sf(k - 1)
    return min(1.0, pval)


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of p-values (family-wise error), in the input's order."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def wilson_interval(x: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion x / n."""
    z = _z(confidence)
    p = x / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_diff_ci(
    b: int, c: int, n: int, confidence: float = 0.95, *, both_success: int = 0
) -> tuple[float, float]:
    """Newcombe's square-and-add interval (1998, method 10) for p_first - p_second on paired data.

    b = pairs where only the first arm succeeded, c = only the second, n = all pairs,
    both_success = pairs where both did (0 in a rescue study of historical failures).
    """
    b, c, n, a = _count("b", b), _count("c", c), _count("n", n), _count("both_success", both_success)
    if n == 0:
        return math.nan, math.nan
    d = n - a - b - c
    if d < 0:
        raise ValueError(f"b + c + both_success exceeds n ({a + b + c} > {n})")
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, confidence)
    l2, u2 = wilson_interval(a + c, n, confidence)
    # Correlation between the two marginals, with Newcombe's n/2 shrink of a positive
    # cross-product so that the interval does not get too narrow.
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    if margins == 0:
        phi = 0.0
    elif cross > n / 2:
        phi = (cross - n / 2) / math.sqrt(margins)
    elif cross >= 0:
        phi = 0.0
    else:
        phi = cross / math.sqrt(margins)
    delta = p1 - p2
    lower = delta - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    upper = delta + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return max(-1.0, lower), min(1.0, upper)


def block_bootstrap_ci(
    pairs: Sequence[tuple[str, bool, bool]],
    seed: int,
    reps: int = 2000,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval of mean(b) - mean(a) over (block, a, b) pairs, resampling whole blocks."""
    if reps < 1:
        raise ValueError(f"reps must be positive, got {reps}")
    _z(confidence)
    if not pairs:
        return math.nan, math.nan
    # Pairs of one task are correlated; resampling tasks keeps that correlation.
    keys = sorted({key for key, _, _ in pairs})
    index = {key: i for i, key in enumerate(keys)}
    size = np.zeros(len(keys))
    wins_a = np.zeros(len(keys))
    wins_b = np.zeros(len(keys))
    for key, a_ok, b_ok in pairs:
        i = index[key]
        size[i] += 1
        wins_a[i] += bool(a_ok)
        wins_b[i] += bool(b_ok)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(keys), size=(reps, len(keys)))
    diff = (wins_b[draws].sum(axis=1) - wins_a[draws].sum(axis=1)) / size[draws].sum(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(diff, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)
