"""Stopping when the answer is decided (DESIGN §20), pure: an e-process over the paired scores of the cases in
the order fixed when the study was created, the decision it reaches, and the confidence sequence at the stop.

Each case contributes one paired score d in [-1, 1] (the first arm's successes of K minus the second's, over K:
with K = 1 a McNemar pair's -1, 0 or 1). Read as draws of the suite's cases (the cases in a seeded random order,
a sample of the benchmark's episodes like them), the scores are independent with a common mean mu, and for each
candidate m and constant bet lambda the wealth prod_t (1 + lambda (d_t - m)) is a nonnegative martingale when
mu = m. The fixed mixture of bets of `rescue.core.figures.evalues` is one too, so by Ville's inequality the means
whose mixture stays below 1/alpha form a confidence sequence: it covers mu at every case at once, with
probability at least 1 - alpha, so at any stopping time, data-dependent as it is (Waudby-Smith & Ramdas 2024,
"Estimating means of bounded random variables by betting", JRSS-B; Howard, Ramdas, McAuliffe & Sekhon 2021,
"Time-uniform, nonparametric, nonasymptotic confidence sequences", Ann. Statist.). The rule reads it after
each scored case, at the two points that matter (each side's bets carry half the mixture):

- efficacy: the bets on a mean above zero reach 2/alpha, so the sequence excludes zero from below (an effect of
  the first arm over the second is shown: error <= alpha);
- futility: the bets on a mean below `effect`, the smallest effect of interest, reach 2/alpha (an effect that
  large is ruled out: error <= alpha);
- the interval at the stop is the sequence's, valid at that stopping time.

The decision is the first case, in the fixed order, after at least `minimum` scored cases, where a declared
boundary is crossed; or, without one, the last case the rule lets run (the declared maximum, or every case).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict

from rescue.core.figures.evalues import BET_FRACTIONS, bounds, evidence
from rescue.core.figures.harm_figures import pair_counts
from rescue.core.manifest import Case
from rescue.core.records import CaseRecord
from rescue.core.success_labels import is_exposed
from rescue.core.verdicts import Verdict

Outcome = Literal["efficacy", "futility", "maximum", "undecided"]


def _side_log_wealth(x: np.ndarray, m: float, side: int) -> np.ndarray:
    """log of the average wealth of the mixture's bets on one side (+1: the mean above m; -1: below), after each
    prefix of `x`: half the two-sided mixture of `rescue.core.figures.evalues` is this side's share."""
    lam = BET_FRACTIONS / (m + 1.0) if side > 0 else -BET_FRACTIONS / (1.0 - m)
    logs = np.cumsum(np.log1p(np.outer(x - m, lam)), axis=0)
    top = logs.max(axis=1, keepdims=True)
    return top[:, 0] + np.log(np.exp(logs - top).mean(axis=1))


class Step(BaseModel):
    """The e-process after one scored case, as the journal records it and `rescue verify` derives it again."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The case, in the fixed order."""
    score: float
    """Its paired score."""
    efficacy: float
    """log of the bets on a mean above zero (the confidence sequence excludes zero from below once it reaches
    log(2 / alpha))."""
    futility: float
    """log of the bets on a mean below `effect` (the sequence excludes `effect` from above at log(2 / alpha))."""


class Decision(BaseModel):
    """Where the rule stopped, and why (DESIGN §20)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    outcome: Outcome
    """`efficacy` or `futility` (a boundary crossed), `maximum` (every case the rule lets run has run, no boundary
    crossed), `undecided` (not yet)."""
    at: int
    """How many scored cases the decision read (the n of "stopped at n of N")."""
    case_id: str | None
    """The case the decision was reached at; None when none was scored."""
    mean: float | None
    """The mean paired score over those cases."""
    interval: tuple[float, float] | None
    """The confidence sequence's interval of the mean at that case (valid at a data-dependent stop)."""
    steps: list[Step]
    """The e-process case by case, up to the decision."""


def decide(scores: Sequence[tuple[str, float]], alpha: float, minimum: int,
           stop_for: Literal["efficacy", "futility", "both"], effect: float, complete: bool) -> Decision:
    """The decision over `scores` ((case id, paired score) in the fixed order, of the cases finished so far with
    no unfinished case before them); `complete`: no more case will be scored (every case the rule lets run has
    its verdict), so that without a boundary crossed the decision is `maximum`. Efficacy: the confidence
    sequence excludes zero from below; futility: it excludes `effect` from above (each side's bets carry half
    the mixture, so each crossing is at log(2 / alpha))."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if not 0.0 < effect < 1.0:
        raise ValueError(f"the smallest effect of interest must be in (0, 1), got {effect}")
    if not scores:
        return Decision(outcome="undecided", at=0, case_id=None, mean=None, interval=None, steps=[])
    x = np.clip(np.asarray([s for _, s in scores], dtype=np.float64), -1.0, 1.0)
    eff, fut = _side_log_wealth(x, 0.0, +1), _side_log_wealth(x, effect, -1)
    crossing = math.log(2.0 / alpha)
    outcome: Outcome = "maximum" if complete else "undecided"
    stop = x.size - 1
    for t in range(minimum - 1, x.size):
        if stop_for in ("efficacy", "both") and eff[t] >= crossing:
            outcome, stop = "efficacy", t
            break
        if stop_for in ("futility", "both") and fut[t] >= crossing:
            outcome, stop = "futility", t
            break
    seen = x[: stop + 1]
    steps = [Step(case_id=c, score=float(v), efficacy=float(e), futility=float(f))
             for (c, _), v, e, f in zip(scores[: stop + 1], seen, eff, fut)]
    return Decision(outcome=outcome, at=stop + 1, case_id=steps[-1].case_id, mean=float(seen.mean()),
                    interval=bounds(evidence(seen.tolist()), 1.0 - alpha), steps=steps)


def fixed_order(case_ids: Sequence[str], tasks: Sequence[str], seed: int) -> list[str]:
    """The order the cases run in, fixed at creation: a seeded random permutation stratified by task (each task's
    cases shuffled, then interleaved so that every prefix holds each task in proportion), so that stopping never
    selects on outcomes nor on a task's place in the manifest."""
    rng = random.Random(f"{seed}:order")
    by_task: dict[str, list[str]] = {}
    for case_id, task in zip(case_ids, tasks):
        by_task.setdefault(task, []).append(case_id)
    keyed = []
    for task in sorted(by_task):
        ids = by_task[task][:]
        rng.shuffle(ids)
        n = len(ids)
        offset = rng.random()
        # Case i of a task of n at (i + offset) / n of the way: every task spread evenly over the order.
        keyed += [((i + offset) / n, rng.random(), cid) for i, cid in enumerate(ids)]
    return [cid for _, _, cid in sorted(keyed)]


def _asking_counts(rec: CaseRecord, v: Verdict, arm: str) -> tuple[int, int] | None:
    """(successes, K) of an arm that asks, when every continuation of it is in E; None otherwise."""
    k = rec.continuations
    if k > 1:
        c = v.continuations.get(arm)
        return (c.successes, k) if c is not None and c.in_e and c.continuations == k else None
    verdict = v.of(arm, rec.primary)
    if verdict is None or not verdict.in_e:
        return None
    return int(bool(rec.arms[arm].success)), 1


def case_score(test: str, first: str, second: str, rec: CaseRecord, v: Verdict) -> float | None:
    """A case's paired score for the rule's test (first's successes minus second's, over K), or None when the
    case has none: of the other stratum, or its pair not sound (not in M, or not in E for two arms that ask)."""
    success = rec.historical_outcome == "success"
    if test in ("rescue", "sham", "arms") and success or test == "harm" and not success:
        return None
    if test in ("rescue", "net", "harm"):
        asking = second if test == "harm" else first
        if success:
            verdict = v.of(asking, rec.primary)
            if verdict is not None and not is_exposed(verdict.label, verdict.rule):
                return 0.0  # never reached: its exact change is none
        found = pair_counts(rec, v, asking)
        if found is None:
            return None
        a, c, k = found
        return (c - a) / k if test == "harm" else (a - c) / k
    one, two = _asking_counts(rec, v, first), _asking_counts(rec, v, second)
    if one is None or two is None:
        return None
    return (one[0] - two[0]) / one[1]


def prefix_scores(rule_test: str, first: str, second: str, order: Sequence[str],
                  records: dict[str, tuple[CaseRecord, Verdict]]) -> tuple[list[tuple[str, float]], bool]:
    """The scored cases of the order's prefix that has a verdict (it ends at the first case without one), and
    whether that prefix is the whole order; `records`: every case with a verdict, by id (pilot cases left out)."""
    out = []
    for case_id in order:
        found = records.get(case_id)
        if found is None:
            return out, False
        score = case_score(rule_test, first, second, *found)
        if score is not None:
            out.append((case_id, score))
    return out, True


class Rule(Protocol):
    """What the decision reads of a study's rule (`rescue.core.configuration.stopping.StoppingConfig`)."""

    test: str
    alpha: float
    minimum: int
    maximum: int | None
    stop_for: Literal["efficacy", "futility", "both"]
    effect: float


def study_decision(rule: Rule, first: str, second: str, main: Sequence[str],
                   records: dict[str, tuple[CaseRecord, Verdict]]) -> Decision:
    """The decision of a study's rule (`first` against `second`) over its main cohort's order (`main`) and the
    records of its cases with a verdict: the cases the rule lets run are the first `maximum` of the order."""
    runs = list(main[: rule.maximum]) if rule.maximum is not None else list(main)
    scores, complete = prefix_scores(rule.test, first, second, runs, records)
    return decide(scores, rule.alpha, rule.minimum, rule.stop_for, rule.effect, complete)


def study_order(cases: Sequence[Case], seed: int) -> list[str]:
    """The order a study with a rule runs its cases in, fixed at creation: its pilot cases first, then the main
    cohort's seeded permutation stratified by task (`fixed_order`)."""
    main = [c for c in cases if not c.pilot]
    return [c.case_id for c in cases if c.pilot] + fixed_order([c.case_id for c in main], [c.task for c in main], seed)


def main_order(order: Sequence[str], cases: Sequence[Case]) -> list[str]:
    """The order of the main cohort's cases (the rule reads those only)."""
    pilot = {c.case_id for c in cases if c.pilot}
    return [case_id for case_id in order if case_id not in pilot]
