"""Betting e-values for a bounded mean, and the confidence intervals they give (DESIGN §17), pure.

For scores x_1..x_n in [-1, 1] and a candidate mean m, the wealth of a constant bet λ,

    K_λ(m) = prod_i (1 + λ (x_i - m)),

has expectation at most 1 when the scores are independent and their means average m (the arithmetic-geometric
mean inequality), and when they are a simple random sample without replacement from a population of mean m, with
or without independent noise on each (Hoeffding 1963, §6: a convex function of such a sample's sum is dominated by
that of a sample with replacement). Our e-value is the average of K_λ over a fixed set of bets, 40 on each side
from a small fraction to 99% of the largest one that keeps every factor positive: nothing is chosen after seeing
the scores (Waudby-Smith & Ramdas 2024, "Estimating means of bounded random variables by betting", JRSS-B 86(1);
Robbins' method of mixtures). By Markov's inequality, the means whose e-value stays below 1/α form a confidence set
at level 1 - α, whatever the sample size: a handful of scores that agree is not certainty, and the set is a single
point only when the scores are the population itself.

When the scores are the population's own values (deterministic replays) drawn without replacement from N, each
bet is placed, in a seeded random order, against the mean of what is left, (N m - sum_{j<t} x_j) / (N - t + 1):
a martingale under sampling without replacement (Waudby-Smith & Ramdas 2020, "Confidence sequences for sampling
without replacement", NeurIPS), so the interval closes as the sample nears the census.

Independent strata combine by multiplying their e-values; a figure Σ w_h μ_h is kept when some allocation of the
stratum means that gives it keeps the product below 1/α (a union-intersection test).

Means live on a grid of step 0.0025 over [-1, 1]; every bound is rounded outwards to the next grid point.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Candidate means of a score in [-1, 1].
GRID = np.linspace(-1.0, 1.0, 801)
_STEP = float(GRID[1] - GRID[0])
# The bets of the mixture, per side, as fractions of the largest bet that keeps every factor positive.
BET_FRACTIONS = np.arange(1, 41) / 40 * 0.99
LOW, HIGH = -1.0, 1.0


@dataclass(frozen=True)
class Evidence:
    """What the scores say about one mean: its log e-value at every point of GRID, or the mean itself when the
    scores are the whole population's exact values."""

    log_e: np.ndarray | None = None
    exact: float | None = None

    def __post_init__(self) -> None:
        if (self.log_e is None) == (self.exact is None):
            raise ValueError("evidence is a log e-value curve or an exact mean, one of the two")


@functools.lru_cache(maxsize=4096)
def _mixture_on_grid(tallies: tuple[tuple[float, int], ...]) -> np.ndarray:
    """`_mixture` on GRID for scores given as (distinct value, count) pairs; kept, since studies and their breakdowns
    ask for the same tallies again and again (read-only)."""
    values = np.array([v for v, _ in tallies])
    counts = np.array([c for _, c in tallies], dtype=np.float64)
    out = _mixture(values, counts, GRID)
    out.flags.writeable = False
    return out


def _mixture(values: np.ndarray, counts: np.ndarray, m: np.ndarray) -> np.ndarray:
    """log of the mixture e-value at each candidate mean m, for scores given as distinct values with counts."""
    v, c = values[None, None, :], counts[None, None, :]
    mm = m[:, None, None]
    up = BET_FRACTIONS[None, :, None] / np.maximum(mm - LOW, 1e-12)
    down = -BET_FRACTIONS[None, :, None] / np.maximum(HIGH - mm, 1e-12)
    wealth = np.concatenate([(c * np.log1p(up * (v - mm))).sum(axis=2), (c * np.log1p(down * (v - mm))).sum(axis=2)],
                            axis=1)
    top = wealth.max(axis=1, keepdims=True)
    return top[:, 0] + np.log(np.exp(wealth - top).mean(axis=1))


def _without_replacement(ordered: np.ndarray, population: int, m: np.ndarray) -> np.ndarray:
    """log of the mixture e-value of a sample without replacement taken in this order, at each population mean m
    (infinite where no population of mean m could have given the sample)."""
    n = ordered.size
    total = population * m
    rest_low, rest_high = (population - n) * LOW, (population - n) * HIGH
    possible = (total - ordered.sum() >= rest_low - 1e-9) & (total - ordered.sum() <= rest_high + 1e-9)
    up = np.zeros((m.size, BET_FRACTIONS.size))
    down = np.zeros((m.size, BET_FRACTIONS.size))
    drawn = 0.0
    for t, x in enumerate(ordered):
        left = (total - drawn) / (population - t)  # the mean of what is not drawn yet
        possible &= (left >= LOW - 1e-12) & (left <= HIGH + 1e-12)
        left = np.clip(left, LOW + 1e-12, HIGH - 1e-12)[:, None]
        up += np.log1p(BET_FRACTIONS[None, :] / (left - LOW) * (x - left))
        down += np.log1p(-BET_FRACTIONS[None, :] / (HIGH - left) * (x - left))
        drawn += x
    wealth = np.concatenate([up, down], axis=1)
    top = wealth.max(axis=1, keepdims=True)
    out = top[:, 0] + np.log(np.exp(wealth - top).mean(axis=1))
    return np.where(possible, out, np.inf)


def _checked(scores: Sequence[float]) -> np.ndarray:
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim != 1 or not np.all(np.isfinite(x)) or np.any(x < LOW - 1e-12) or np.any(x > HIGH + 1e-12):
        raise ValueError(f"scores must be finite and in [{LOW:g}, {HIGH:g}]")
    return np.clip(x, LOW, HIGH)


def evidence(scores: Sequence[float], population: int | None = None, exact_values: bool = False,
             seed: int | str = 0) -> Evidence:
    """The evidence the scores give about their population's mean. `population`: the number of units the scores
    were drawn from without replacement (None: a sample of an unbounded population, or noisy scores).
    `exact_values`: each score is its unit's value itself (deterministic replays), so a census is exact and a
    sample is bet on in the order of a random permutation seeded by `seed`."""
    x = _checked(scores)
    if x.size == 0:
        raise ValueError("no scores: nothing to say about the mean")
    if population is not None and x.size > population:
        raise ValueError(f"{x.size} scores drawn from a population of {population}")
    if exact_values and population is not None:
        if x.size == population:
            return Evidence(exact=math.fsum(x.tolist()) / x.size)
        order = list(range(x.size))
        random.Random(str(seed)).shuffle(order)
        return Evidence(log_e=_without_replacement(x[order], population, GRID))
    values, counts = np.unique(np.round(x, 12), return_counts=True)
    return Evidence(log_e=_mixture_on_grid(tuple(zip(values.tolist(), counts.tolist()))))


def share_evidence(ones: int, n: int) -> Evidence:
    """The evidence n independent yes/no outcomes, `ones` of them yes, give about the chance of a yes, on GRID read
    as 2p - 1 (p = (GRID + 1) / 2)."""
    if not 0 <= ones <= n or n == 0:
        raise ValueError(f"{ones} of {n} outcomes")
    return Evidence(log_e=_mixture_on_grid(((LOW, n - ones), (HIGH, ones))))


def _threshold(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return math.log(1.0 / (1.0 - confidence))


def _hull(kept: np.ndarray) -> tuple[float, float]:
    """The grid's [low, high] around the kept points, rounded outwards one step."""
    idx = np.flatnonzero(kept)
    lo, hi = int(idx[0]), int(idx[-1])
    return float(GRID[max(lo - 1, 0)]), float(GRID[min(hi + 1, GRID.size - 1)])


def bounds(ev: Evidence, confidence: float = 0.95) -> tuple[float, float]:
    """The confidence interval of one mean."""
    if ev.exact is not None:
        return ev.exact, ev.exact
    kept = ev.log_e < _threshold(confidence)
    if not kept.any():  # cannot happen for a mixture (its sample mean is always kept); guard the WoR corner
        raise ValueError("no mean is consistent with the scores")
    return _hull(kept)


def _allowed(ev: Evidence, budgets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each budget b (a log e-value left to spend): the least and greatest mean whose log e-value is below b
    (NaN where none is); an exact mean is allowed under any positive budget."""
    budgets = np.asarray(budgets, dtype=np.float64)
    if ev.exact is not None:
        value = np.where(budgets > 0, ev.exact, np.nan)
        return value, value.copy()
    order = np.argsort(ev.log_e, kind="stable")
    sorted_e, means = ev.log_e[order], GRID[order]
    lows, highs = np.minimum.accumulate(means), np.maximum.accumulate(means)
    k = np.searchsorted(sorted_e, budgets, side="left")  # how many means lie below each budget
    at = np.maximum(k - 1, 0)
    return np.where(k > 0, lows[at], np.nan), np.where(k > 0, highs[at], np.nan)


def _points(ev: Evidence) -> tuple[np.ndarray, np.ndarray]:
    if ev.exact is not None:
        return np.array([ev.exact]), np.array([0.0])
    return GRID, ev.log_e


def _margin(*parts: tuple[float, Evidence]) -> float:
    """How far the grid can hide a bound of Σ w_h μ_h: one step of every part known only on the grid."""
    return sum(abs(w) * _STEP for w, ev in parts if ev.exact is None)


def weighted_bounds(first: tuple[float, Evidence], second: tuple[float, Evidence],
                    confidence: float = 0.95) -> tuple[float, float]:
    """The confidence interval of w1 μ1 + w2 μ2 from two independent strata's evidence (weights known)."""
    (w1, e1), (w2, e2) = first, second
    if e1.exact is not None and e2.exact is not None:
        value = w1 * e1.exact + w2 * e2.exact
        return value, value
    means, log_e = _points(e1)
    low2, high2 = _allowed(e2, _threshold(confidence) - log_e)
    ok = ~np.isnan(low2)
    if not ok.any():
        raise ValueError("no allocation of the strata's means is consistent with the scores")
    a = w1 * means[ok] + w2 * low2[ok]
    b = w1 * means[ok] + w2 * high2[ok]
    margin = _margin(first, second)
    return float(min(a.min(), b.min()) - margin), float(max(a.max(), b.max()) + margin)


def mixed_bounds(share: Evidence, first: Evidence, second: Evidence, confidence: float = 0.95) -> tuple[float, float]:
    """The confidence interval of p μ1 + (1 - p) μ2 when the weight p is itself estimated: `share` is the evidence
    about 2p - 1 (share_evidence), `first` and `second` about the two means (three independent e-values)."""
    budget = _threshold(confidence)
    # Only the shares and first means that are not rejected alone can be part of a kept allocation.
    shares = share.log_e < budget
    p, e_p = (GRID[shares] + 1.0) / 2.0, share.log_e[shares]
    m1, e1 = _points(first)
    alone = e1 < budget
    m1, e1 = m1[alone], e1[alone]
    spent = e_p[:, None] + e1[None, :]
    low2, high2 = _allowed(second, (budget - spent).ravel())
    low2, high2 = low2.reshape(spent.shape), high2.reshape(spent.shape)
    ok = ~np.isnan(low2)
    if not ok.any():
        raise ValueError("no allocation of the share and the means is consistent with the scores")
    pp, mm = np.broadcast_to(p[:, None], spent.shape)[ok], np.broadcast_to(m1[None, :], spent.shape)[ok]
    a = pp * mm + (1 - pp) * low2[ok]
    b = pp * mm + (1 - pp) * high2[ok]
    # One grid step of the share (half a step of p) moves the figure by at most |μ1 - μ2| / 2 <= 1 step; one step
    # of either mean moves it by at most one step.
    margin = _STEP + (0.0 if first.exact is not None else _STEP) + (0.0 if second.exact is not None else _STEP)
    return float(min(a.min(), b.min()) - margin), float(max(a.max(), b.max()) + margin)
