"""Harm on historical successes and the benchmark's net change (DESIGN §17), pure.

A historical success is replayed with the same arms, query point and proofs as a failure and labelled by
`rescue.core.success_labels`. The net change of the evaluation's success rate with the advice on, in points, is
estimated from per-case paired differences of success probabilities in two strata (failures, successes), each a
simple random sample of its part of the evaluation; docs/design.md ("Harm and the net change") derives the
estimator and its interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from rescue.core.figures.exact_stats import normal_quantile

# --- the estimator --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseScore:
    """One replayed case's paired difference of success probabilities and its within-case variance estimate."""

    score: float
    """Failures: assisted minus control success probability (the case's rescue); successes: control minus assisted
    (its harm); 0 exactly for a success the query point never reached."""
    variance: float
    """Unbiased estimate of the score's variance from its K continuations (0 with K = 1, or when not exposed)."""


def case_score(first: int, second: int, k: int) -> CaseScore:
    """The paired difference (first - second) / K of two arms' successes of K continuations from one state, with
    the unbiased estimate of its variance, [p1(1-p1) + p2(1-p2)] / (K - 1) (0 with K = 1: a single draw)."""
    if k < 1 or not (0 <= first <= k and 0 <= second <= k):
        raise ValueError(f"successes ({first}, {second}) of {k} continuations")
    p1, p2 = first / k, second / k
    variance = (p1 * (1 - p1) + p2 * (1 - p2)) / (k - 1) if k > 1 else 0.0
    return CaseScore(p1 - p2, variance)


class Stratum(BaseModel):
    """One stratum of the evaluation (its failures or its successes): the replayed sample's mean paired difference
    and the variance of that mean as an estimate of the whole stratum's."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    population: int
    """Episodes of the stratum in the evaluation (F or S)."""
    sampled: int
    """Cases of the stratum the estimate is over (a case whose pair is not in M is left out and counted apart)."""
    fraction: float | None
    """sampled / population, the sampling fraction of the finite-population correction; None when nothing sampled."""
    mean: float | None
    """The mean per-case score: rescue (failures) or harm (successes), a paired difference of probabilities."""
    variance: float | None
    """Estimated variance of `mean`: (1 - f) s^2 / n + f * sum(v_i) / n^2 (two-stage sampling); None: not
    estimable (no case, or one case of a sampled stratum)."""


def stratum(scores: Sequence[CaseScore], population: int) -> Stratum:
    """A stratum's mean score and its two-stage variance with the finite-population correction."""
    n = len(scores)
    if population < n:
        raise ValueError(f"{n} cases sampled from a stratum of {population}")
    if n == 0:
        return Stratum(population=population, sampled=0, fraction=None, mean=None, variance=None)
    f = n / population
    mean = math.fsum(s.score for s in scores) / n
    within = math.fsum(s.variance for s in scores)
    if n == 1:
        # No between-case spread is estimable from one case; only a census of one has a variance.
        variance = within if f == 1.0 else None
    else:
        s2 = math.fsum((s.score - mean) ** 2 for s in scores) / (n - 1)
        variance = (1 - f) * s2 / n + f * within / (n * n)
    return Stratum(population=population, sampled=n, fraction=f, mean=mean, variance=variance)


class NetChange(BaseModel):
    """The evaluation's success rate with the advice on against off (DESIGN §17), from its two strata."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    episodes: int
    """N: the evaluation's episodes (F + S of the sampling frame)."""
    failures: Stratum
    """The failures' stratum (its mean is the rescue, a paired difference over cases in M)."""
    successes: Stratum
    """The successes' stratum (its mean is the harm; a success never reached counts with harm 0)."""
    base_rate: float
    """S / N: the evaluation's success rate with the advice off."""
    change: float | None
    """(F * rescue - S * harm) / N, a fraction of N (x100 for points); None when a non-empty stratum has no case."""
    change_ci: tuple[float, float] | None
    """Normal interval of `change` at the given confidence from the strata's variances; None when not estimable."""
    confidence: float = 0.95
    """Confidence level of the interval."""
    method: str = "stratified two-stage: FPC on each stratum's sample, K-continuation variance within cases, normal"
    """How the interval was computed, in a line."""

    @property
    def rate_on(self) -> float | None:
        """The evaluation's success rate with the advice on: base_rate + change."""
        return None if self.change is None else self.base_rate + self.change


def net_change(failure_scores: Sequence[CaseScore], failures: int, success_scores: Sequence[CaseScore],
               successes: int, confidence: float = 0.95) -> NetChange:
    """The net change (F * rescue - S * harm) / N with its interval, from the replayed cases' scores (failures:
    assisted - control; successes: control - assisted) and the evaluation's F failures and S successes."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = failures + successes
    if n <= 0:
        raise ValueError("an evaluation of no episodes has no success rate")
    fail, succ = stratum(failure_scores, failures), stratum(success_scores, successes)
    out = NetChange(episodes=n, failures=fail, successes=succ, base_rate=successes / n, change=None, change_ci=None,
                    confidence=confidence)
    parts = [(failures / n, fail, 1.0), (successes / n, succ, -1.0)]
    if any(w > 0 and s.mean is None for w, s, _ in parts):
        return out
    out.change = math.fsum(sign * w * s.mean for w, s, sign in parts if w > 0)
    if any(w > 0 and s.variance is None for w, s, _ in parts):
        return out
    half = normal_quantile(0.5 + confidence / 2) * math.sqrt(math.fsum(w * w * s.variance for w, s, _ in parts if w > 0))
    # The change cannot exceed what the evaluation leaves: every failure rescued, or every success broken.
    out.change_ci = (max(-successes / n, out.change - half), min(failures / n, out.change + half))
    return out
