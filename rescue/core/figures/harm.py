"""Harm on historical successes and the benchmark's net change (DESIGN §17), pure.

A historical success is replayed with the same arms, query point and proofs as a failure and labelled by
`rescue.core.success_labels`. The net change of the evaluation's success rate with the advice on is estimated
from per-case paired differences of success probabilities in two strata (failures, successes), each the whole of
its part of the evaluation or an equal-probability sample of it (`rescue.core.figures.success_sample`), with two
intervals, each saying which population it speaks for (`rescue.core.figures.evalues` computes both):

- for these episodes: the evaluation's N episodes as a finite population; the uncertainty is which episodes were
  replayed and, with a policy that samples, the policy's own draws. A census of deterministic replays is exact;
- for the benchmark: the episodes as a sample of the suite's initial states (the evaluation's tasks in its
  proportions), so the share of failures is uncertain too.

docs/design.md ("Harm and the net change") gives the estimator, the intervals and their coverage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from rescue.core.figures.evalues import Evidence, bounds, evidence, mixed_bounds, share_evidence, weighted_bounds

METHOD = ("betting e-values (a fixed mixture of bets; without replacement for deterministic replays), strata "
          "combined by product over every allocation; a census of deterministic replays is exact")
"""How the intervals are computed, in a line (docs/design.md §17 cites the method)."""


def case_score(first: int, second: int, k: int) -> float:
    """The paired difference (first - second) / K of two arms' successes of K continuations from one state."""
    if k < 1 or not (0 <= first <= k and 0 <= second <= k):
        raise ValueError(f"successes ({first}, {second}) of {k} continuations")
    return (first - second) / k


class Stratum(BaseModel):
    """One stratum of the evaluation (its failures or its successes): the replayed cases' mean paired difference."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    population: int
    """Episodes of the stratum in the evaluation (F or S; the main cohort's, without declared pilot cases)."""
    sampled: int
    """Cases of the stratum the estimate is over (a case whose pair is not in M is left out, as if not drawn)."""
    mean: float | None
    """The mean per-case score: rescue (failures) or harm (successes), a paired difference of probabilities;
    None when nothing was sampled."""
    census: bool
    """Every episode of the stratum has a case in the estimate: nothing of this stratum is extrapolated."""


class Interval(BaseModel):
    """A confidence interval of the net change, as a fraction of N, for one population."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    low: float
    """Lower bound."""
    high: float
    """Upper bound."""
    exact: bool = False
    """No uncertainty is left: a census of deterministic replays (for these episodes only)."""


class NetChange(BaseModel):
    """The evaluation's success rate with the advice on against off (DESIGN §17), from its two strata."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    episodes: int
    """N: the evaluation's episodes (F + S of the main cohort's sampling frame)."""
    failures: Stratum
    """The failures' stratum (its mean is the rescue, a paired difference over cases in M)."""
    successes: Stratum
    """The successes' stratum (its mean is the harm; a success never reached counts with harm 0)."""
    base_rate: float
    """S / N: the evaluation's success rate with the advice off."""
    change: float | None
    """(F * rescue - S * harm) / N, a fraction of N (x100 for points); None when it is not estimated (`refused`)."""
    these_episodes: Interval | None
    """The interval for these N episodes (the sampling of cases, and the policy's own draws when it samples)."""
    benchmark: Interval | None
    """The interval for the benchmark: the episodes as a sample of the suite's initial states."""
    confidence: float = 0.95
    """Confidence level of both intervals."""
    method: str = METHOD
    """How the intervals were computed, in a line."""
    refused: str | None = None
    """Why there is no figure, in one line (a stratum with no case, a selection that is not a probability sample);
    None: estimated."""

    @property
    def rate_on(self) -> float | None:
        """The evaluation's success rate with the advice on: base_rate + change."""
        return None if self.change is None else self.base_rate + self.change


def _stratum(scores: Sequence[float], population: int) -> Stratum:
    n = len(scores)
    if population < n:
        raise ValueError(f"{n} cases sampled from a stratum of {population}")
    mean = math.fsum(scores) / n if n else None
    return Stratum(population=population, sampled=n, mean=mean, census=n == population)


def _these(scores: Sequence[float], population: int, exact_values: bool, seed: str) -> Evidence:
    if population == 0:
        return Evidence(exact=0.0)
    return evidence(scores, population=population, exact_values=exact_values, seed=seed)


def net_change(failure_scores: Sequence[float], failures: int, success_scores: Sequence[float], successes: int,
               confidence: float = 0.95, exact_values: bool = False, seed: int | str = 0,
               refused: str | None = None, benchmark: bool = True) -> NetChange:
    """The net change (F * rescue - S * harm) / N with its two intervals, from the replayed cases' scores (failures:
    assisted - control; successes: control - assisted) and the evaluation's F failures and S successes.
    `exact_values`: each score is its episode's value itself (K = 1, the policy's draws replayed under RNG
    control); `seed` orders the bets of a sample drawn without replacement; `refused`: a reason, decided by the
    caller from the frame, not to estimate; `benchmark=False` leaves the benchmark's interval out (a simulation of
    one population needs only the other)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = failures + successes
    if n <= 0:
        raise ValueError("an evaluation of no episodes has no success rate")
    fail, succ = _stratum(failure_scores, failures), _stratum(success_scores, successes)
    out = NetChange(episodes=n, failures=fail, successes=succ, base_rate=successes / n, change=None,
                    these_episodes=None, benchmark=None, confidence=confidence, refused=refused)
    if refused is None and any(pop > 0 and s.mean is None for pop, s in ((failures, fail), (successes, succ))):
        what = "failure" if failures > 0 and fail.mean is None else "success"
        out.refused = f"no {what} of the evaluation has a replayed pair in M: that stratum has no estimate"
    if out.refused is not None:
        return out
    w_f, w_s = failures / n, successes / n
    out.change = w_f * (fail.mean or 0.0) - w_s * (succ.mean or 0.0)

    changes = [*failure_scores, *(-s for s in success_scores)]
    census = fail.census and succ.census
    if census and not exact_values:
        # Every episode replayed, each score a noisy draw of its own: one mixture over the N changes (independent,
        # their means averaging the net change) is tighter than the product of the strata's.
        low, high = bounds(evidence(changes), confidence)
        exact = False
    else:
        these_f = _these(failure_scores, failures, exact_values, f"{seed}:failures")
        these_s = _these(success_scores, successes, exact_values, f"{seed}:successes")
        low, high = weighted_bounds((w_f, these_f), (-w_s, these_s), confidence)
        exact = these_f.exact is not None and these_s.exact is not None
    out.these_episodes = Interval(low=max(-1.0, low), high=min(1.0, high), exact=exact)

    if not benchmark:
        return out
    # The benchmark: every score is a draw of its stratum's distribution over the suite's initial states.
    if census or failures == 0 or successes == 0:
        low, high = bounds(evidence(changes), confidence)
    else:
        low, high = mixed_bounds(share_evidence(failures, n), evidence(failure_scores),
                                 evidence([-s for s in success_scores]), confidence)
    out.benchmark = Interval(low=max(-1.0, low), high=min(1.0, high))
    return out
