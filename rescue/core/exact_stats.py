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


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    from scipy.stats import (
        norm,  # imported when used: scipy.stats alone costs 0.7 s, and `rescue status` needs none of it
    )

    return float(norm.ppf(0.5 + confidence / 2.0))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of b discordant wins out of b + c."""
    b, c = _count("b", b), _count("c", c)
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(b, b + c, 0.5).pvalue)


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
