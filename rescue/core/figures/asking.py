"""Which way of asking changes the benchmark most per call (DESIGN §18), pure.

Each arm that asks is a way of asking: a fixed query point (the pre-registered q, a declared `[[query_point]]`,
another advisor at q), a trigger, a random placebo at its trigger's budget, the sham. Per way: how often it asked
(its duty cycle: calls per episode and the share of episodes asked, on failures and on successes apart), how often
its advisor declined, its rescue and harm (over every pair, and over the answers that were applied), the net change
of the evaluation's success rate with it on (DESIGN §17's estimator and intervals) and that change per call. Then
the paired tests that say whether a trigger is worth its calls: each trigger against each placebo matching its
budget and against each fixed query point of the primary advisor, over the episodes where both arms' pairs are in
M (failures and successes alike: an arm that was not asked ran as the control did), exact McNemar, Holm-adjusted
across that family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rescue.core.arms import base_arm, is_assisted, query_point_of, shown
from rescue.core.figures.exact_stats import holm
from rescue.core.figures.harm import NetChange
from rescue.core.figures.harm_figures import HarmSummary, PairedDifference, paired_difference
from rescue.core.figures.paired import PairedComparison, compare
from rescue.core.records import CaseRecord
from rescue.core.verdicts import DECLINED, Verdict

Judged = tuple[CaseRecord, Verdict]
WayKind = Literal["fixed", "trigger", "placebo", "sham"]
# How far a placebo's calls per episode may lie from its trigger's and still count as the same budget.
BUDGET_TOLERANCE = 0.1


class Duty(BaseModel):
    """How often one way of asking asked, over one stratum's episodes (DESIGN §18's duty cycle)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    episodes: int
    """The stratum's episodes with the arm recorded."""
    asked: int
    """Of those, the episodes it made at least one call in."""
    calls: int
    """The calls it made (with `[asking] max_calls` above 1, an episode may hold several)."""
    declined: int
    """The episodes where its advisor kept the instruction at every call (labelled `declined`)."""
    calls_per_episode: float | None
    """calls / episodes; None without episodes."""
    share_asked: float | None
    """asked / episodes; None without episodes."""
    decline_rate: float | None
    """declined / asked; None when it never asked."""


class WayOfAsking(BaseModel):
    """One arm that asks, as a way of asking: how often, at what price in harm, for what rescue."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    arm: str
    """The arm (`assisted`, `assisted@<query point or trigger>`, `assisted:<advisor>`, `sham`)."""
    kind: WayKind
    """`fixed` (a fixed query point), `trigger`, `placebo` (a random trigger) or `sham`."""
    matches: str | None = None
    """A placebo: the arm of the trigger whose budget it matches; None otherwise."""
    failures: Duty
    """How often it asked on the historical failures."""
    successes: Duty | None
    """How often it asked on the historical successes; None: a study of failures only."""
    rescue: PairedDifference
    """On the failures' pairs in M: the arm minus control (an episode not asked or declined counts 0)."""
    harm: PairedDifference | None
    """On the successes it reached, pairs in M: control minus the arm; None: a study of failures only."""
    applied_rescue: PairedDifference
    """On the failures whose answers were applied with valid evidence (in E): the arm minus control."""
    applied_harm: PairedDifference | None
    """On the successes whose answers were applied (in E): control minus the arm; None: failures only."""
    net: NetChange | None
    """The evaluation's success rate with it on against off (DESIGN §17); None: no successes or no frame."""
    calls_per_episode: float | None
    """Its calls per episode of the evaluation: the strata's rates weighted by the frame's F and S (failures only:
    per failure); None without episodes."""
    change_per_call: float | None
    """The net change (failures only: the rescue) divided by the calls per episode: what one call buys, in
    fractions of the evaluation's success rate; None when it never asked or nothing is estimated."""


class BudgetMatch(BaseModel):
    """A placebo's calls against its trigger's: the same budget within BUDGET_TOLERANCE calls per episode."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    placebo: str
    """The placebo's arm."""
    trigger: str
    """The arm of the trigger it matches."""
    placebo_calls: float | None
    """The placebo's calls per episode (as `WayOfAsking.calls_per_episode`)."""
    trigger_calls: float | None
    """The trigger's."""
    matched: bool
    """Whether the two differ by at most BUDGET_TOLERANCE calls per episode."""


class AskingSummary(BaseModel):
    """Every way of asking a study compared (DESIGN §18): the answer to "whether and when to ask"."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    ways: list[WayOfAsking]
    """Every arm that asks, in the study's order."""
    comparisons: list[PairedComparison] = Field(default_factory=list)
    """Each trigger against each placebo matching it and against each fixed query point of the primary advisor,
    over the episodes where both arms' pairs are in M; `holm_p` adjusted across them all."""
    budgets: list[BudgetMatch] = Field(default_factory=list)
    """Each placebo's calls against its trigger's."""
    best: str | None = None
    """The way (a fixed point or a trigger) whose change per call is largest; None: none asked."""
    best_beats_chance: bool | None = None
    """Whether the best way beats chance: a trigger against its placebo at a matched budget (Holm-adjusted p below
    1 - confidence, the trigger ahead), a fixed point against the sham; None: nothing to compare it with."""
    reading: str = ""
    """The answer in one sentence, as the report's first screen says it."""

    def way(self, arm: str) -> WayOfAsking | None:
        """One arm's way of asking, or None."""
        return next((w for w in self.ways if w.arm == arm), None)


def _duty(cases: Sequence[Judged], arm: str) -> Duty:
    episodes = asked = calls = declined = 0
    for rec, v in cases:
        record = rec.arms.get(arm)
        if record is None:
            continue
        episodes += 1
        made = record.calls()
        asked += bool(made)
        calls += len(made)
        verdict = v.of(arm, rec.primary)
        declined += verdict is not None and verdict.label == DECLINED
    return Duty(episodes=episodes, asked=asked, calls=calls, declined=declined,
                calls_per_episode=calls / episodes if episodes else None,
                share_asked=asked / episodes if episodes else None,
                decline_rate=declined / asked if asked else None)


def _kind(rec: CaseRecord, arm: str) -> WayKind:
    if base_arm(arm, query_point=False) == "sham":
        return "sham"
    trigger = rec.triggers.get(arm)
    if trigger is None:
        return "fixed"
    return "placebo" if trigger.kind == "random" else "trigger"


def _applied(cases: Sequence[Judged], arm: str, harm: bool, confidence: float) -> PairedDifference:
    pairs = []
    for rec, v in cases:
        verdict = v.of(arm, rec.primary)
        record, control = rec.arms.get(arm), rec.control
        if verdict is None or not verdict.in_e or record is None or control is None:
            continue
        a, c = int(bool(record.success)), int(bool(control.success))
        pairs.append((c, a) if harm else (a, c))
    return paired_difference(pairs, 1, confidence)


def _paired_in_m(cases: Sequence[Judged], first: str, second: str, confidence: float) -> PairedComparison:
    """Two ways of asking, over the episodes where both arms' pairs with control are in M."""
    outcomes = []
    for rec, v in cases:
        a, b = v.of(first, rec.primary), v.of(second, rec.primary)
        if a is None or b is None or not (a.in_m and b.in_m):
            continue
        outcomes.append((bool(rec.arms[first].success), bool(rec.arms[second].success)))
    return compare(first, second, outcomes, confidence)


def _per_episode(way: WayOfAsking, net: NetChange | None) -> float | None:
    f, s = way.failures.calls_per_episode, way.successes.calls_per_episode if way.successes else None
    if net is not None and f is not None and s is not None:
        return (net.failures.population * f + net.successes.population * s) / net.episodes
    return f


def asking_summary(failures: Sequence[Judged], successes: Sequence[Judged], judged: Sequence[str],
                   harm: HarmSummary | None, confidence: float = 0.95) -> AskingSummary:
    """Every judged arm that asks as a way of asking, the paired tests of the triggers and the best way per call."""
    rec0 = (failures or successes)[0][0]
    asking = [a for a in judged if is_assisted(a) or a == "sham"]
    ways = []
    for arm in asking:
        figures = harm.of(arm) if harm is not None else None
        trigger = rec0.triggers.get(arm)
        matches = next((a for a, t in rec0.triggers.items() if trigger is not None and trigger.kind == "random"
                        and t.name == trigger.matches), None)
        way = WayOfAsking(
            arm=arm, kind=_kind(rec0, arm), matches=matches, failures=_duty(failures, arm),
            successes=_duty(successes, arm) if successes else None,
            rescue=figures.rescue if figures is not None else _rescue(failures, arm, confidence),
            harm=figures.harm if figures is not None else None,
            applied_rescue=_applied(failures, arm, False, confidence),
            applied_harm=_applied(successes, arm, True, confidence) if successes else None,
            net=figures.net if figures is not None else None, calls_per_episode=None, change_per_call=None)
        way.calls_per_episode = _per_episode(way, way.net)
        change = way.net.change if way.net is not None and way.net.change is not None else (
            way.rescue.diff if way.net is None else None)
        if change is not None and way.calls_per_episode:
            way.change_per_call = change / way.calls_per_episode
        ways.append(way)
    summary = AskingSummary(ways=ways)
    cases = [*failures, *successes]
    fixed = [a for a in asking if _kind(rec0, a) == "fixed" and base_arm(a, query_point=False) == judged[0]]
    family = []
    for w in ways:
        if w.kind != "trigger":
            continue
        family += [(w.arm, p.arm) for p in ways if p.kind == "placebo" and p.matches == w.arm]
        family += [(w.arm, f) for f in fixed]
    found = [_paired_in_m(cases, a, b, confidence) for a, b in family]
    for c, p in zip(found, holm([c.mcnemar_p for c in found])):
        c.holm_p = p
    summary.comparisons = found
    summary.budgets = [
        BudgetMatch(placebo=p.arm, trigger=p.matches, placebo_calls=p.calls_per_episode,
                    trigger_calls=summary.way(p.matches).calls_per_episode,
                    matched=p.calls_per_episode is not None and summary.way(p.matches).calls_per_episode is not None
                    and abs(p.calls_per_episode - summary.way(p.matches).calls_per_episode) <= BUDGET_TOLERANCE)
        for p in ways if p.kind == "placebo" and p.matches is not None]
    _best(summary, cases, confidence)
    return summary


def _rescue(failures: Sequence[Judged], arm: str, confidence: float) -> PairedDifference:
    from rescue.core.figures.harm_figures import failure_scores

    _, pairs, k = failure_scores(failures, arm)
    return paired_difference(pairs, k, confidence)


def _best(summary: AskingSummary, cases: Sequence[Judged], confidence: float) -> None:
    """The way (fixed point or trigger) that changes the benchmark most per call, and whether it beats chance."""
    candidates = [w for w in summary.ways if w.kind in ("fixed", "trigger") and w.change_per_call is not None]
    if not candidates:
        summary.reading = "No way of asking made a call: nothing to compare per call."
        return
    best = max(candidates, key=lambda w: w.change_per_call)
    summary.best = best.arm
    alpha = 1 - confidence
    measure = "net change" if best.net is not None else "rescue among the failures"
    what = (f"{100 * best.change_per_call:+.1f} pp of {measure} per call ({best.calls_per_episode:.2f} calls per "
            "episode)")
    if best.change_per_call > 0:
        head = f"Per call, {way_name(best)} changes the benchmark most: {what}"
    else:
        head = f"No way of asking raised the benchmark; per call, {way_name(best)} cost it least: {what}"
    if best.kind == "trigger":
        placebos = [c for c in summary.comparisons if c.first == best.arm
                    and summary.way(c.second) is not None and summary.way(c.second).kind == "placebo"]
        if placebos:
            c = placebos[0]
            budget = next((b for b in summary.budgets if b.placebo == c.second), None)
            matched = "at a matched budget" if budget is not None and budget.matched else "at a budget that did not match"
            summary.best_beats_chance = (c.holm_p if c.holm_p is not None else c.mcnemar_p) < alpha and \
                c.pairs.first_only > c.pairs.second_only
            verdict = "beats chance" if summary.best_beats_chance else "does not beat chance"
            summary.reading = (f"{head}; against {way_name(summary.way(c.second))} {matched}: {c.pairs.first_only} "
                               f"only it, {c.pairs.second_only} only the placebo, Holm-adjusted p = {c.holm_p:.3g}: "
                               f"it {verdict}.")
            return
        summary.reading = f"{head}; no random placebo matches its budget, so whether it beats chance is not tested."
        return
    if any(w.kind == "sham" for w in summary.ways):
        c = _paired_in_m(cases, best.arm, "sham", confidence)
        summary.best_beats_chance = c.mcnemar_p < alpha and c.pairs.first_only > c.pairs.second_only
        verdict = "beats chance" if summary.best_beats_chance else "does not beat chance"
        summary.reading = (f"{head}; against the sham at the pre-registered q: {c.pairs.first_only} only it, "
                           f"{c.pairs.second_only} only the sham, exact McNemar p = {c.mcnemar_p:.3g}: it {verdict}.")
        return
    summary.reading = f"{head}; the study has no sham arm to compare it with, so whether it beats chance is not tested."


def way_name(way: WayOfAsking) -> str:
    """A way of asking in words: `the trigger stall`, `the placebo random`, `asking at early`, `the sham`."""
    point = query_point_of(way.arm)
    if way.kind in ("trigger", "placebo"):
        return f"the {way.kind} {point}"
    if way.kind == "sham":
        return "the sham"
    return f"asking at {point}" if point is not None else f"asking {shown(way.arm)} at the pre-registered q"
