"""The harm figures of a study's successes and the net change, per arm (DESIGN §17), from its judged cases.

Failures keep their DESIGN §3 summary unchanged (`rescue.core.figures.stats`); the successes are summarized here, apart,
with their own fixed denominator, and the two strata meet only in the net change.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from rescue.core.arms import query_point_of
from rescue.core.figures.continuations import PairedEstimate, estimate
from rescue.core.figures.harm import CaseScore, NetChange, case_score, net_change
from rescue.core.success_labels import SUCCESS_LABELS, is_exposed
from rescue.core.records import CaseRecord
from rescue.core.verdicts import Verdict
from rescue.core.figures.success_sample import SamplingFrame

Judged = tuple[CaseRecord, Verdict]


class HarmFigures(BaseModel):
    """One arm on the study's historical successes, and with its rescue the evaluation's net change."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    arm: str
    """The arm (`assisted`, `assisted:<advisor>`, `sham`, `...@<query point>`), judged against control."""
    query_point: str | None
    """The declared extra query point it asks at; None: the pre-registered q."""
    n: int
    """The successes summarized (fixed denominator of this stratum)."""
    counts: dict[str, int]
    """Successes per DESIGN §17 label, every label present (zero included)."""
    exposed: int
    """Successes the arm's query point reached (every case but those kept because they ended before it)."""
    m: int
    """Of the exposed, the pairs in M (every continuation's, with K > 1): the harm's cases."""
    harm: PairedEstimate
    """Over those: control minus the arm, the mean paired difference in success probability (with K = 1,
    (broken - control-only-failed) / m), its bootstrap interval and exact sign-flip p (K = 1: exact McNemar)."""
    rescue: PairedEstimate
    """On the failures, over the arm's pairs in M: the arm minus control (the rescue stratum's mean)."""
    net: NetChange | None
    """The evaluation's success rate with the arm on against off; None without a frame to scale by."""


class HarmSummary(BaseModel):
    """The study's historical successes (DESIGN §17): per arm, overall, per group and per task."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    successes: int
    """Successes summarized (the main cohort's; failures are the summary's N)."""
    frame: SamplingFrame | None
    """The frame the cases were drawn from (None: the study's own cases are taken as the whole evaluation)."""
    arms: list[HarmFigures]
    """Every judged arm, the primary first."""
    per_group: dict[str, list[HarmFigures]] = Field(default_factory=dict)
    """The same over each group's cases (the net change scaled by the group's tasks' frames)."""
    per_task: dict[str, list[HarmFigures]] = Field(default_factory=dict)
    """The same over each task's cases (the net change scaled by the task's frame)."""

    def of(self, arm: str) -> HarmFigures | None:
        """One arm's figures, or None."""
        return next((f for f in self.arms if f.arm == arm), None)


def _counts(rec: CaseRecord, v: Verdict, arm: str) -> tuple[int, int, int] | None:
    """(arm's successes, control's successes, K) of a pair in M (every continuation's, with K > 1); None otherwise."""
    k = rec.continuations
    if k > 1:
        a, c = v.continuations.get(arm), v.continuations.get("control")
        if a is None or c is None or not (a.in_m and c.in_m) or not a.continuations == c.continuations == k:
            return None
        return a.successes, c.successes, k
    verdict = v.of(arm, rec.primary)
    if verdict is None or not verdict.in_m:
        return None
    judged, control = rec.arms.get(arm), rec.arms.get("control")
    if judged is None or control is None:
        raise ValueError(f"case {rec.case_id}'s {arm} pair is in M without its arms")
    return int(bool(judged.success)), int(bool(control.success)), 1


def _paired_scores(cases: Sequence[Judged], arm: str, harm: bool) -> tuple[list[CaseScore], list[tuple[int, int]], int]:
    """Per-case scores over the arm's pairs in M: harm (control - arm; 0 for an unexposed success) or rescue
    (arm - control), the pairs' successes in the same order, and K."""
    scores, pairs, k_max = [], [], max((rec.continuations for rec, _ in cases), default=1)
    for rec, v in cases:
        if harm:
            verdict = v.of(arm, rec.primary)
            if verdict is None:
                raise ValueError(f"case {rec.case_id} has no verdict for its {arm} arm")
            if not is_exposed(verdict.label, verdict.rule):
                scores.append(CaseScore(0.0, 0.0))
                continue
        found = _counts(rec, v, arm)
        if found is not None:
            a, c, k = found
            first, second = (c, a) if harm else (a, c)
            scores.append(case_score(first, second, k))
            pairs.append((first, second))
    return scores, pairs, k_max


def success_scores(cases: Sequence[Judged], arm: str) -> tuple[list[CaseScore], list[tuple[int, int]], int]:
    """The successes' harm scores (control - arm; 0 for an unexposed one), the (control, arm) successes of the
    exposed pairs in M, and K."""
    return _paired_scores(cases, arm, harm=True)


def failure_scores(cases: Sequence[Judged], arm: str) -> tuple[list[CaseScore], list[tuple[int, int]], int]:
    """The failures' rescue scores (arm - control) over the arm's pairs in M, the (arm, control) successes, and K."""
    return _paired_scores(cases, arm, harm=False)


def harm_figures(failures: Sequence[Judged], successes: Sequence[Judged], arm: str, frame: SamplingFrame | None,
                 confidence: float = 0.95) -> HarmFigures:
    """One arm's harm on the successes, its rescue on the failures and the net change over `frame` (None: the
    cases are the whole evaluation)."""
    counts = dict.fromkeys(SUCCESS_LABELS, 0)
    exposed = 0
    for rec, v in successes:
        verdict = v.of(arm, rec.primary)
        if verdict is None:
            raise ValueError(f"case {rec.case_id} has no verdict for its {arm} arm")
        counts[verdict.label] += 1
        exposed += is_exposed(verdict.label, verdict.rule)
    s_scores, s_pairs, k_s = success_scores(successes, arm)
    f_scores, f_pairs, k_f = failure_scores(failures, arm)
    frame = frame or SamplingFrame(failures=len(failures), successes=len(successes))
    net = None
    if frame.episodes and len(failures) <= frame.failures and len(successes) <= frame.successes:
        net = net_change(f_scores, frame.failures, s_scores, frame.successes, confidence)
    return HarmFigures(arm=arm, query_point=query_point_of(arm), n=len(successes), counts=counts, exposed=exposed,
                       m=len(s_pairs), harm=estimate(s_pairs, k_s, confidence), rescue=estimate(f_pairs, k_f, confidence),
                       net=net)


def harm_summary(failures: Sequence[Judged], successes: Sequence[Judged], judged: Sequence[str],
                 frame: SamplingFrame | None, task_frames: dict[str, SamplingFrame], confidence: float = 0.95) -> HarmSummary:
    """The successes' figures for every judged arm, overall and per group and task."""

    def split(key: str) -> dict[str, list[HarmFigures]]:
        out: dict[str, list[HarmFigures]] = {}
        names = sorted({getattr(rec, key) for rec, _ in (*failures, *successes)})
        for name in names:
            fails = [(r, v) for r, v in failures if getattr(r, key) == name]
            succs = [(r, v) for r, v in successes if getattr(r, key) == name]
            tasks = {r.task for r, _ in (*fails, *succs)}
            part = None
            if tasks and all(t in task_frames for t in tasks):
                part = SamplingFrame(failures=sum(task_frames[t].failures for t in tasks),
                                     successes=sum(task_frames[t].successes for t in tasks))
            elif frame is not None:
                part = SamplingFrame(failures=0, successes=0)  # a frame without its tasks' parts: no net change
            out[name] = [harm_figures(fails, succs, arm, part, confidence) for arm in judged]
        return out

    return HarmSummary(successes=len(successes), frame=frame,
                       arms=[harm_figures(failures, successes, arm, frame, confidence) for arm in judged],
                       per_group=split("group"), per_task=split("task"))
