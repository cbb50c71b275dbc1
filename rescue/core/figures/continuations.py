"""K continuations per arm (DESIGN §13): the paired estimate of a difference in success probability.

Each case contributes, per arm, its successes out of K continuations from the one snapshot at q. The study's
effect of a first arm against a second is the mean over cases of (successes_first - successes_second) / K, with

- a two-sided p-value from the exact sign-flip permutation test over cases: under the null each case's difference
  is as likely negative as positive, so the statistic's distribution is that of the sum of +-|a_i| (a_i the
  integer difference of successes), computed exactly by convolution;
- a 95% percentile bootstrap interval over cases, from a fixed seed (re-derived bit for bit by `rescue verify`).

With K = 1 every difference is -1, 0 or 1 and the test is the exact McNemar test on the discordant cases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

BOOTSTRAP_SEED = 0
BOOTSTRAP_RESAMPLES = 10_000


def sign_flip_p(differences: Sequence[int]) -> float:
    """Two-sided exact p-value of the sign-flip permutation test of integer paired differences (sum statistic)."""
    a = np.abs(np.asarray(differences, dtype=np.int64))
    a = a[a > 0]
    if a.size == 0:
        return 1.0
    observed = abs(int(np.sum(differences)))
    total = int(a.sum())
    # dist[s + total] = P(sum of +-a_i = s), built one case at a time.
    dist = np.zeros(2 * total + 1)
    dist[total] = 1.0
    for x in a:
        shifted = np.zeros_like(dist)
        shifted[x:] += dist[:-x] * 0.5
        shifted[:-x] += dist[x:] * 0.5
        dist = shifted
    sums = np.arange(-total, total + 1)
    # A relative tolerance as scipy's binomtest uses, so that ties at |observed| count whatever the rounding.
    return float(min(1.0, dist[np.abs(sums) >= observed - 1e-9].sum()))


def bootstrap_ci(values: Sequence[float], confidence: float = 0.95, seed: int = BOOTSTRAP_SEED,
                 resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float] | None:
    """Percentile interval of the mean of `values` resampling cases with replacement; None without values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return None
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


class PairedEstimate(BaseModel):
    """The paired estimate of a first arm against a second over K continuations per arm (DESIGN §13)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    k: int
    """The cases estimated over: every continuation of both arms sound (against control: each of the first arm's
    continuations in M with its control continuation; between two arms that ask: each in E)."""
    continuations: int
    """K: continuations per arm and case."""
    first_rate: float | None
    """The first arm's mean success probability over those cases (successes / K, averaged); None without cases."""
    second_rate: float | None
    """The second arm's, likewise."""
    diff: float | None
    """first_rate - second_rate: the mean paired difference in success probability; None without cases."""
    diff_ci: tuple[float, float] | None
    """Percentile bootstrap interval of `diff` over cases, at the summary's confidence; None without cases."""
    p: float
    """Two-sided exact sign-flip permutation p-value over cases (with K = 1, the exact McNemar p)."""
    seed: int = BOOTSTRAP_SEED
    """The bootstrap's seed."""
    resamples: int = BOOTSTRAP_RESAMPLES
    """The bootstrap's resamples."""


def estimate(pairs: Sequence[tuple[int, int]], continuations: int, confidence: float = 0.95) -> PairedEstimate:
    """The paired estimate from (first's successes, second's successes) per case, each out of `continuations`."""
    if continuations < 1:
        raise ValueError(f"continuations must be at least 1, got {continuations}")
    for a, b in pairs:
        if not (0 <= a <= continuations and 0 <= b <= continuations):
            raise ValueError(f"successes ({a}, {b}) outside 0..{continuations}")
    n = len(pairs)
    if n == 0:
        return PairedEstimate(k=0, continuations=continuations, first_rate=None, second_rate=None, diff=None,
                              diff_ci=None, p=1.0)
    first = [a / continuations for a, _ in pairs]
    second = [b / continuations for _, b in pairs]
    diffs = [f - s for f, s in zip(first, second)]
    return PairedEstimate(
        k=n, continuations=continuations, first_rate=math.fsum(first) / n, second_rate=math.fsum(second) / n,
        diff=math.fsum(diffs) / n, diff_ci=bootstrap_ci(diffs, confidence), p=sign_flip_p([a - b for a, b in pairs]),
    )
