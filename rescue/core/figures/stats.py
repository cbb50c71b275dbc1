"""Paired statistics and the fixed-denominator summary (DESIGN §3)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from rescue.core.arms import base_arm, is_assisted, query_point_of
from rescue.core.figures.continuations import PairedEstimate, estimate
from rescue.core.figures.asking import AskingSummary, asking_summary
from rescue.core.figures.harm_figures import HarmSummary, harm_summary
from rescue.core.records import CaseRecord
from rescue.core.verdicts import DECLINED, ArmVerdict, Label, Verdict
from rescue.core.figures.success_sample import SamplingFrame
from rescue.core.figures.exact_stats import holm
from rescue.core.figures.paired import PairedComparison, PairedTable, compare, ratio as _ratio

__all__ = ["PairedComparison", "PairedTable", "compare"]  # where the record family has always been imported from

LABELS: tuple[Label, ...] = ("rescued", "not_rescued", "unknown", "initial_state_deviation")


# --- one arm against another: the record family (the paired table and comparison: rescue/core/figures/paired.py)


class ArmFigures(BaseModel):
    """One arm's DESIGN §3 figures over its own verdicts against control, and its paired comparison with control."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    arm: str
    """The arm's name (`assisted`, `assisted:<advisor>`, `sham`, `assisted@<query point>`)."""
    counts: dict[str, int]
    """The arm's DESIGN §3 labels against control, every label present (zero included)."""
    r: int
    """Cases the arm rescued."""
    m: int
    """Control/arm pairs in M (both valid and complete, no deviation, exact prefix)."""
    e: int
    """Of those, with the arm's subgoal applied and valid evidence."""
    r_over_n: float | None
    """R / N, a fraction; None when N is 0."""
    r_over_m: float | None
    """R / M, a fraction; None when M is 0."""
    r_over_e: float | None
    """R / E, a fraction; None when E is 0."""
    versus_control: PairedComparison | None
    """The arm against control over its M; None only in an export of `rescue-export/4` or earlier, which kept no
    such comparison for the sham arm."""


class JudgedArms(BaseModel):
    """What a summary and its breakdowns share: the other judged arms' figures and the comparisons between arms,
    with their finders (each subclass declares both fields, where its records have always had them)."""

    if TYPE_CHECKING:  # not fields here: a subclass's fields keep their order
        arms: list[ArmFigures]
        comparisons: list[PairedComparison]

    def figures_of(self, arm: str) -> ArmFigures | None:
        """The figures of one judged arm (None: no such arm here)."""
        return next((f for f in self.arms if f.arm == arm), None)

    def comparison(self, first: str, second: str) -> PairedComparison | None:
        """The comparison of two arms (either order asked), or None when none is made here."""
        return next((c for c in self.comparisons if (c.first, c.second) in ((first, second), (second, first))), None)


class Breakdown(JudgedArms):
    """Counts of one group or task."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    n: int
    """Cases of the group or task in the summary."""
    counts: dict[str, int]
    """Cases per DESIGN §3 label, every label present (zero included)."""
    rescued: int
    """Cases labelled `rescued`."""
    rate: float | None
    """rescued / n, a fraction; None when n is 0."""
    versus_control: PairedComparison | None = Field(default=None, exclude_if=lambda v: v is None)
    """Over this group's or task's cases alone: the primary arm against control over its M (as the summary's
    own `versus_control`); absent: a summary stored before breakdowns carried it."""
    arms: list[ArmFigures] = Field(default_factory=list, exclude_if=lambda v: not v)
    """Over this group's or task's cases alone: the figures of every arm the study judges besides its primary
    (the sham, further advisors, extra query points); absent: a study of two arms."""
    comparisons: list[PairedComparison] = Field(default_factory=list, exclude_if=lambda v: not v)
    """Over this group's or task's cases alone: the study's comparisons between arms (`Summary.comparisons`)."""


class Reproduction(BaseModel):
    """How often the control arm failed again from the case's initial state (DESIGN §13): with a policy that
    samples, the control arm is a new draw from the historical initial state, not the historical episode."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    controls: int
    """Control runs that completed (every continuation of the control arm counts)."""
    failed: int
    """Of those, the ones that failed again."""
    rate: float | None
    """failed / controls, a fraction; None when no control run completed."""


class Summary(ArmFigures, JudgedArms):
    """The fixed-denominator summary of a study's main cohort (DESIGN §3): the primary arm's figures against
    control (the study's answer), every other arm's, and the comparisons between arms."""

    n: int
    """N: the cases summarized (finished or interrupted, with a verdict); the whole cohort once the study is complete."""
    confidence: float = 0.95
    """Confidence level of the intervals."""
    per_group: dict[str, Breakdown] = Field(default_factory=dict)
    """The counts of each group, by group name."""
    per_task: dict[str, Breakdown] = Field(default_factory=dict)
    """The counts of each task, by `suite/task_id`."""
    pilot_ids: list[str] = Field(default_factory=list)
    """Ids of the pilot cases summarized apart, in manifest order; empty in a pilot cohort's own summary."""
    pilot: Summary | None = None
    """The pilot cohort's own summary; None without pilot cases (and in a pilot cohort's own summary)."""
    reproduction: Reproduction | None = None
    """How often the control arm failed again; None only in an export of `rescue-export/4` or earlier."""
    arms: list[ArmFigures] = Field(default_factory=list, exclude_if=lambda v: not v)
    """Every other arm the study judges against control (the sham, further advisors, extra query points), in the
    study's order; absent: a study of two arms."""
    comparisons: list[PairedComparison] = Field(default_factory=list, exclude_if=lambda v: not v)
    """The arms that ask compared with each other over the cases where both are in E: each assisted arm against
    the sham, every pair of advisors and every pair of query points (Holm-adjusted within each family)."""
    harm: HarmSummary | None = Field(default=None, exclude_if=lambda v: v is None)
    """The historical successes (DESIGN §17), summarized apart from the failures above (N counts failures only):
    per arm their labels, exposure and harm, and the evaluation's net change; absent: a study of failures only."""
    asking: AskingSummary | None = Field(default=None, exclude_if=lambda v: v is None)
    """Whether and when to ask (DESIGN §18): every way of asking compared per call, with its duty cycle, declines,
    and the triggers' paired tests against their placebos and the fixed query points; absent: a study without
    triggers, asking again or an advisor that may decline."""

    def figures(self) -> list[ArmFigures]:
        """Every judged arm's figures, the primary's (this summary's own) first."""
        primary = ArmFigures.model_validate({f: getattr(self, f) for f in ArmFigures.model_fields})
        return [primary, *self.arms]

    def figures_of(self, arm: str) -> ArmFigures | None:
        """The figures of one judged arm, the primary's included (None: the study has no such arm)."""
        return next((f for f in self.figures() if f.arm == arm), None)

    def comparison(self, first: str, second: str) -> PairedComparison | None:
        """The comparison of two arms (either order asked; against control, the arm's own), or None when the
        study makes none."""
        if second == "control":
            figures = self.figures_of(first)
            return figures.versus_control if figures is not None else None
        return super().comparison(first, second)


def ranked(figures: Sequence[ArmFigures]) -> list[ArmFigures]:
    """Arms ranked by R/E (highest first; none last), then by R, then in the given order."""
    order = {f.arm: i for i, f in enumerate(figures)}
    return sorted(figures, key=lambda f: (f.r_over_e is None, -(f.r_over_e or 0.0), -f.r, order[f.arm]))


def labels_of(cases: Sequence[Judged]) -> tuple[str, ...]:
    """The labels a cohort's counts hold: DESIGN §3's, and `declined` when an advisor of the study may decline
    (DESIGN §18; a study without one counts exactly what it always has)."""
    return (*LABELS, DECLINED) if any(rec.declining for rec, _ in cases) else LABELS


def _label_counts(labels: Iterable[str], known: Sequence[str] = LABELS) -> dict[str, int]:
    counts = dict.fromkeys(known, 0)
    for label in labels:
        counts[label] += 1
    return counts


Judged = tuple[CaseRecord, Verdict]


def _verdict(rec: CaseRecord, v: Verdict, arm: str) -> ArmVerdict:
    found = v.of(arm, rec.primary)
    if found is None:
        raise ValueError(f"case {rec.case_id} has no verdict for its {arm} arm")
    return found


def _success(rec: CaseRecord, arm: str) -> bool:
    record = rec.arms.get(arm)
    if record is None:
        raise ValueError(f"case {rec.case_id} has its {arm} arm's verdict in M or E without its arm")
    return bool(record.success)


def _estimate(cases: Sequence[Judged], first: str, second: str, needs: str, confidence: float) -> PairedEstimate | None:
    """The paired estimate over the cases whose continuations of both arms are all in M (`needs` = "in_m") or all
    in E; None with one continuation per arm."""
    k_max = max((rec.continuations for rec, _ in cases), default=1)
    if k_max < 2:
        return None
    pairs = []
    for rec, v in cases:
        a, b = v.continuations.get(first), v.continuations.get(second)
        if a is None or b is None or a.continuations > k_max or b.continuations > k_max:
            raise ValueError(f"case {rec.case_id} has no count of {k_max} continuations of its {first} and {second} arms")
        # A case where fewer than K ran (interrupted) is not sound: its count is not an estimate of K draws.
        if getattr(a, needs) and getattr(b, needs) and a.continuations == b.continuations == k_max:
            pairs.append((a.successes, b.successes))
    return estimate(pairs, k_max, confidence)


def arm_figures(cases: Sequence[Judged], arm: str, confidence: float = 0.95) -> ArmFigures:
    """One arm's labels, R, M, E over its own verdicts, and its comparison with control over its M."""
    verdicts = [(rec, _verdict(rec, v, arm)) for rec, v in cases]
    counts = _label_counts((v.label for _, v in verdicts), labels_of(cases))
    n, r = len(verdicts), counts["rescued"]
    m = sum(v.in_m for _, v in verdicts)
    e = sum(v.in_e for _, v in verdicts)
    for rec, v in verdicts:
        if v.in_e and not v.in_m:
            raise ValueError(f"case {rec.case_id}'s {arm} arm is in E but not in M")
    if not r <= e <= m <= n:
        raise ValueError(f"{arm}: invariant R <= E <= M <= N violated: R={r} E={e} M={m} N={n}")
    against = [(_success(rec, arm), _success(rec, "control")) for rec, v in verdicts if v.in_m]
    versus = compare(arm, "control", against, confidence)
    versus.estimate = _estimate(cases, arm, "control", "in_m", confidence)
    return ArmFigures(arm=arm, counts=counts, r=r, m=m, e=e, r_over_n=_ratio(r, n), r_over_m=_ratio(r, m),
                      r_over_e=_ratio(r, e), versus_control=versus)


def compare_arms(cases: Sequence[Judged], first: str, second: str, confidence: float = 0.95) -> PairedComparison:
    """Two arms that ask, over the cases where both are in E."""
    both = [(rec, _verdict(rec, v, first), _verdict(rec, v, second)) for rec, v in cases]
    outcomes = [(_success(rec, first), _success(rec, second)) for rec, a, b in both if a.in_e and b.in_e]
    found = compare(first, second, outcomes, confidence)
    found.estimate = _estimate(cases, first, second, "in_e", confidence)
    return found


def comparison_families(judged: Sequence[str], triggers: Iterable[str] = ()) -> list[tuple[list[tuple[str, str]], bool]]:
    """Which arms a study compares with each other, by family, and whether Holm adjusts within it: each arm
    asking at the pre-registered query point against the sham (alone, unadjusted), every pair of advisors at the
    pre-registered query point, every pair of the primary advisor's fixed query points (each family adjusted).
    The arms of `triggers` are compared apart (rescue.core.figures.asking, DESIGN §18)."""
    asking = [a for a in judged if is_assisted(a) and a not in set(triggers)]
    at_q = [a for a in asking if query_point_of(a) is None]
    points = [judged[0], *(a for a in asking if query_point_of(a) is not None)]
    families: list[tuple[list[tuple[str, str]], bool]] = []
    if "sham" in judged:
        families += [([(a, "sham")], False) for a in at_q]
    for family in (at_q, points):
        pairs = [(a, b) for i, a in enumerate(family) for b in family[i + 1:]]
        if pairs:
            families.append((pairs, True))
    return families


def _comparisons(cases: Sequence[Judged], judged: Sequence[str], confidence: float) -> list[PairedComparison]:
    out = []
    triggers = {arm for rec, _ in cases for arm in rec.triggers}
    for family, adjusted in comparison_families(judged, triggers):
        found = [compare_arms(cases, a, b, confidence) for a, b in family]
        if adjusted:
            for c, p in zip(found, holm([c.mcnemar_p for c in found])):
                c.holm_p = p
        out += found
    return out


def judged_arms(cases: Sequence[Judged]) -> list[str]:
    """The arms every case of a cohort judges, primary first (they must agree)."""
    found = {tuple(rec.judged()) for rec, _ in cases}
    if len(found) > 1:
        raise ValueError("the cases of a study do not all judge the same arms")
    return list(found.pop()) if found else ["assisted"]


def _breakdowns(cases: Sequence[Judged], key: str, judged: Sequence[str], confidence: float) -> dict[str, Breakdown]:
    buckets: dict[str, list[Judged]] = {}
    for rec, v in cases:
        buckets.setdefault(getattr(rec, key), []).append((rec, v))
    out = {}
    for name in sorted(buckets):
        bucket = buckets[name]
        counts = _label_counts((v.label for _, v in bucket), labels_of(cases))
        out[name] = Breakdown(
            n=len(bucket), counts=counts, rescued=counts["rescued"], rate=_ratio(counts["rescued"], len(bucket)),
            versus_control=arm_figures(bucket, judged[0], confidence).versus_control,
            arms=[arm_figures(bucket, arm, confidence) for arm in judged[1:]],
            comparisons=_comparisons(bucket, judged, confidence),
        )
    return out


def reproduction(cases: Sequence[Judged]) -> Reproduction:
    """The control runs that completed and how many of them failed again."""
    runs = [arm for rec, _ in cases for name, arm in rec.arms.items()
            if arm is not None and base_arm(name) == "control" and arm.status == "complete" and arm.success is not None]
    failed = sum(not arm.success for arm in runs)
    return Reproduction(controls=len(runs), failed=failed, rate=_ratio(failed, len(runs)))


def _summarize_cohort(cases: Sequence[Judged], confidence: float) -> Summary:
    judged = judged_arms(cases)
    primary = arm_figures(cases, judged[0], confidence)
    return Summary(
        **primary.model_dump(),
        n=len(cases),
        confidence=confidence,
        reproduction=reproduction(cases),
        per_group=_breakdowns(cases, "group", judged, confidence),
        per_task=_breakdowns(cases, "task", judged, confidence),
        arms=[arm_figures(cases, arm, confidence) for arm in judged[1:]],
        comparisons=_comparisons(cases, judged, confidence),
    )


def summarize(
    records: Sequence[CaseRecord], verdicts: Sequence[Verdict], confidence: float = 0.95,
    frame: SamplingFrame | None = None, task_frames: dict[str, SamplingFrame] | None = None,
    replays_exact: bool = False,
) -> Summary:
    """Summarize a study: the main cohort's failures with N fixed, its historical successes apart (with the net
    change over `frame`, the evaluation's, without the declared pilot failures, DESIGN §17), and pilot cases apart.
    `replays_exact`: the policy's draws are replayed under RNG control (a census of K = 1 replays is exact)."""
    by_id: dict[str, Verdict] = {}
    for v in verdicts:
        if v.case_id in by_id:
            raise ValueError(f"two verdicts for case {v.case_id}")
        by_id[v.case_id] = v
    seen: set[str] = set()
    main: list[Judged] = []
    pilot: list[Judged] = []
    for rec in records:
        if rec.case_id in seen:
            raise ValueError(f"case {rec.case_id} appears twice")
        seen.add(rec.case_id)
        # A case without a verdict would silently leave the denominator.
        if rec.case_id not in by_id:
            raise ValueError(f"no verdict for case {rec.case_id}")
        (pilot if rec.pilot else main).append((rec, by_id[rec.case_id]))
    extra = set(by_id) - seen
    if extra:
        raise ValueError(f"verdicts for unknown cases: {sorted(extra)[:5]}")
    failures = [(rec, v) for rec, v in main if rec.historical_outcome != "success"]
    successes = [(rec, v) for rec, v in main if rec.historical_outcome == "success"]
    summary = _summarize_cohort(failures, confidence)
    if successes:
        judged = judged_arms(main)
        pilot_failures: dict[str, int] = {}
        for rec, _ in pilot:
            if rec.historical_outcome != "success":
                pilot_failures[rec.task] = pilot_failures.get(rec.task, 0) + 1
        summary.harm = harm_summary(failures, successes, judged, frame, task_frames or {}, confidence,
                                    replays_exact=replays_exact, pilot_failures=pilot_failures)
    if any(rec.triggers or rec.declining or rec.max_calls > 1 for rec, _ in main):
        summary.asking = asking_summary(failures, successes, judged_arms(main), summary.harm, confidence)
    summary.pilot_ids = [rec.case_id for rec, _ in pilot]
    pilot_failures = [(rec, v) for rec, v in pilot if rec.historical_outcome != "success"]
    summary.pilot = _summarize_cohort(pilot_failures, confidence) if pilot else None
    return summary
