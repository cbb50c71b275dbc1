"""The harm figures of a study's successes and the net change, per arm (DESIGN §17), from its judged cases.

Failures keep their DESIGN §3 summary unchanged (`rescue.core.figures.stats`); the successes are summarized here,
apart, with their own fixed denominator, and the two strata meet only in the net change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from rescue.core.arms import query_point_of
from rescue.core.figures.continuations import sign_flip_p
from rescue.core.figures.evalues import bounds, evidence
from rescue.core.figures.harm import NetChange, case_score, net_change
from rescue.core.figures.success_sample import SamplingFrame, frame_refusal
from rescue.core.records import CaseRecord
from rescue.core.success_labels import SUCCESS_LABELS, is_exposed
from rescue.core.verdicts import DECLINED, Verdict

Judged = tuple[CaseRecord, Verdict]


class PairedDifference(BaseModel):
    """One arm against another over paired cases (K continuations each), with an interval that is never narrower
    than the cases allow (DESIGN §17)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    k: int
    """The pairs estimated over."""
    continuations: int
    """K: continuations per arm and case."""
    first_rate: float | None
    """The first arm's mean success probability over the pairs; None without pairs."""
    second_rate: float | None
    """The second arm's, likewise."""
    diff: float | None
    """first_rate - second_rate; None without pairs."""
    diff_ci: tuple[float, float] | None
    """Its interval for the benchmark (the pairs as a sample of the suite's episodes like them), from a betting
    e-value (`rescue.core.figures.evalues`); None without pairs."""
    p: float
    """Two-sided exact sign-flip p-value over the pairs (with K = 1, the exact McNemar p)."""


def paired_difference(pairs: Sequence[tuple[int, int]], k: int, confidence: float = 0.95) -> PairedDifference:
    """The paired difference of (first's successes, second's successes) of K per pair."""
    if not pairs:
        return PairedDifference(k=0, continuations=k, first_rate=None, second_rate=None, diff=None, diff_ci=None, p=1.0)
    n = len(pairs)
    diffs = [case_score(a, b, k) for a, b in pairs]
    return PairedDifference(k=n, continuations=k, first_rate=math.fsum(a for a, _ in pairs) / (n * k),
                            second_rate=math.fsum(b for _, b in pairs) / (n * k), diff=math.fsum(diffs) / n,
                            diff_ci=bounds(evidence(diffs), confidence), p=sign_flip_p([a - b for a, b in pairs]))


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
    """Successes per DESIGN §17 label, every label present (zero included); `kept` counts reached ones only."""
    unreached: int
    """Successes that ended before the arm's query point: kept by construction, with no call (not in `counts`'
    `kept`, never evidence of safety)."""
    exposed: int
    """Successes the arm's query point reached (n - unreached)."""
    m: int
    """Of the exposed, the pairs in M (every continuation's, with K > 1): the harm's cases."""
    harm: PairedDifference
    """Over those: control minus the arm, the mean paired difference in success probability (with K = 1,
    (broken - control-only-failed) / m)."""
    rescue: PairedDifference
    """On the failures, over the arm's pairs in M: the arm minus control (the rescue stratum's mean)."""
    net: NetChange | None
    """The evaluation's success rate with the arm on against off; None without a frame to scale by."""


class HarmSummary(BaseModel):
    """The study's historical successes (DESIGN §17): per arm, overall, per group and per task."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    successes: int
    """Successes summarized (the main cohort's; failures are the summary's N)."""
    frame: SamplingFrame | None
    """The main cohort's frame (the evaluation without declared pilot failures); None: the study's own cases are
    taken as the whole evaluation."""
    pilot_failures: int = 0
    """Declared pilot failures left out of the frame (reported apart, never extrapolated)."""
    replays_exact: bool = False
    """Whether each replay is its episode's value itself (K = 1, the policy's draws replayed under RNG control), so
    that a census is exact for these episodes."""
    arms: list[HarmFigures]
    """Every judged arm, the primary first."""
    per_group: dict[str, list[HarmFigures]] = Field(default_factory=dict)
    """The same over each group's cases (the net change scaled by the group's tasks' frames)."""
    per_task: dict[str, list[HarmFigures]] = Field(default_factory=dict)
    """The same over each task's cases (the net change scaled by the task's frame)."""

    def of(self, arm: str) -> HarmFigures | None:
        """One arm's figures, or None."""
        return next((f for f in self.arms if f.arm == arm), None)


def pair_counts(rec: CaseRecord, v: Verdict, arm: str) -> tuple[int, int, int] | None:
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


def _paired_scores(cases: Sequence[Judged], arm: str, harm: bool) -> tuple[list[float], list[tuple[int, int]], int]:
    """Per-case scores over the arm's pairs in M: harm (control - arm; 0 for an unexposed success) or rescue
    (arm - control), the pairs' successes in the same order, and K."""
    scores, pairs, k_max = [], [], max((rec.continuations for rec, _ in cases), default=1)
    for rec, v in cases:
        verdict = v.of(arm, rec.primary)
        if verdict is None:
            raise ValueError(f"case {rec.case_id} has no verdict for its {arm} arm")
        if verdict.label == DECLINED and verdict.in_m:
            # The advisor kept the instruction (DESIGN §18): with the advice on, the episode runs as it would off.
            scores.append(0.0)
            continue
        if harm and not is_exposed(verdict.label, verdict.rule):
            scores.append(0.0)
            continue
        found = pair_counts(rec, v, arm)
        if found is not None:
            a, c, k = found
            first, second = (c, a) if harm else (a, c)
            scores.append(case_score(first, second, k))
            pairs.append((first, second))
    return scores, pairs, k_max


def success_scores(cases: Sequence[Judged], arm: str) -> tuple[list[float], list[tuple[int, int]], int]:
    """The successes' harm scores (control - arm; 0 for an unexposed one), the (control, arm) successes of the
    exposed pairs in M, and K."""
    return _paired_scores(cases, arm, harm=True)


def failure_scores(cases: Sequence[Judged], arm: str) -> tuple[list[float], list[tuple[int, int]], int]:
    """The failures' rescue scores (arm - control) over the arm's pairs in M, the (arm, control) successes, and K."""
    return _paired_scores(cases, arm, harm=False)


def harm_figures(failures: Sequence[Judged], successes: Sequence[Judged], arm: str, frame: SamplingFrame | None,
                 confidence: float = 0.95, replays_exact: bool = False) -> HarmFigures:
    """One arm's harm on the successes, its rescue on the failures and the net change over `frame` (the main
    cohort's; None: the cases are the whole evaluation)."""
    counts = dict.fromkeys((*SUCCESS_LABELS, DECLINED) if any(rec.declining for rec, _ in successes)
                           else SUCCESS_LABELS, 0)
    unreached = 0
    for rec, v in successes:
        verdict = v.of(arm, rec.primary)
        if verdict is None:
            raise ValueError(f"case {rec.case_id} has no verdict for its {arm} arm")
        if is_exposed(verdict.label, verdict.rule):
            counts[verdict.label] += 1
        else:
            unreached += 1
    s_scores, s_pairs, k_s = success_scores(successes, arm)
    f_scores, f_pairs, k_f = failure_scores(failures, arm)
    net = None
    if frame is not None and frame.episodes:
        refused = frame_refusal(frame, len(failures), len(successes))
        if refused is None and (len(failures) > frame.failures or len(successes) > frame.successes):
            refused = "the manifest holds more cases than the frame has episodes"
        seed = f"{frame.seed}:{frame.failure_seed}:{arm}"
        net = net_change(f_scores, frame.failures, s_scores, frame.successes, confidence,
                         exact_values=replays_exact and max(k_s, k_f) == 1, seed=seed, refused=refused)
    return HarmFigures(arm=arm, query_point=query_point_of(arm), n=len(successes), counts=counts, unreached=unreached,
                       exposed=len(successes) - unreached, m=len(s_pairs), harm=paired_difference(s_pairs, k_s, confidence),
                       rescue=paired_difference(f_pairs, k_f, confidence), net=net)


def harm_summary(failures: Sequence[Judged], successes: Sequence[Judged], judged: Sequence[str],
                 frame: SamplingFrame | None, task_frames: dict[str, SamplingFrame], confidence: float = 0.95,
                 replays_exact: bool = False, pilot_failures: dict[str, int] | None = None) -> HarmSummary:
    """The successes' figures for every judged arm, overall and per group and task. `frame` and `task_frames` are
    the evaluation's; `pilot_failures` counts the declared pilot failures per task, left out of both."""
    pilot = pilot_failures or {}
    left_out = sum(pilot.values())
    main = None
    if frame is not None:
        main = frame.model_copy(update={"failures": frame.failures - left_out})
    elif not left_out:
        main = SamplingFrame(failures=len(failures), successes=len(successes))

    def task_part(task: str) -> SamplingFrame | None:
        found = task_frames.get(task)
        if found is None:
            return None
        return found.model_copy(update={"failures": found.failures - pilot.get(task, 0)})

    def split(key: str) -> dict[str, list[HarmFigures]]:
        out: dict[str, list[HarmFigures]] = {}
        names = sorted({getattr(rec, key) for rec, _ in (*failures, *successes)})
        for name in names:
            fails = [(r, v) for r, v in failures if getattr(r, key) == name]
            succs = [(r, v) for r, v in successes if getattr(r, key) == name]
            tasks = sorted({r.task for r, _ in (*fails, *succs)})
            parts = [task_part(t) for t in tasks]
            part = None
            if main is not None and tasks and all(p is not None for p in parts):
                # The whole frame's sampling, the group's or task's own counts.
                part = main.model_copy(update={"failures": sum(p.failures for p in parts),
                                               "successes": sum(p.successes for p in parts), "sampled": None,
                                               "failures_sampled": None, "limit": None})
                part = _sampled_part(part, main, len(fails), len(succs))
            out[name] = [harm_figures(fails, succs, arm, part, confidence, replays_exact) for arm in judged]
        return out

    return HarmSummary(successes=len(successes), frame=main, pilot_failures=left_out, replays_exact=replays_exact,
                       arms=[harm_figures(failures, successes, arm, main, confidence, replays_exact) for arm in judged],
                       per_group=split("group"), per_task=split("task"))


def _sampled_part(part: SamplingFrame, whole: SamplingFrame, failures: int, successes: int) -> SamplingFrame:
    """A group's or task's frame under the whole frame's design: its strata are samples of their own size where the
    whole one is sampled (within a task, a simple random sample of the size its allocation drew), else censuses,
    and the whole frame's `--limit` refuses it as it refuses the whole."""
    update: dict = {}
    if whole.sampled is not None:
        update["sampled"] = successes
    if whole.failures_sampled is not None:
        update["failures_sampled"] = failures
    if whole.limit is not None:
        update["limit"] = whole.limit
    return part.model_copy(update=update)
