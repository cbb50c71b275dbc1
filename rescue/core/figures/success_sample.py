"""The evaluation's episodes as cases (DESIGN §17): the seeded samples of its successes (and, when asked, of its
failures), their design, and the sampling frame they travel with.

A sample is drawn before anything runs and its frame travels with every case as tags (`rescue manifest from-eval
--successes`, `--failures`): how many episodes, failures and successes the evaluation had (after any `--inits`
split), the same for the case's task, each sample's seed and size and the design that drew it, and a `--limit`
(the first failures, not a sample). The manifest's sha256 is part of the study's identity, so the frame, the design
and the seeds are too. The net change reads the frame back from the cases (`frame_of`) and is refused when the
cases are not what the frame declares (`frame_refusal`).

The design (`DESIGN`): stratified by task, every episode drawn with the same probability n / total. Each task gets
its proportional quota n * total_t / total rounded down or up, up with probability its fractional part: systematic
sampling over the quotas, tasks in a seeded random order, from a seeded random start (Madow 1949); then a seeded
simple random sample within each task. So no task is favoured by its place in the list, ties are broken by the
seed, and the unweighted mean of the sample is unbiased for the frame's mean. Manifests written before this design
(no `frame_design` tag) drew successes by largest-remainder quotas with ties to the first task: unequal inclusion
probabilities, so their net change is refused.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from fractions import Fraction

from pydantic import BaseModel, ConfigDict

from rescue.core.manifest import Case

DESIGN = "equal-probability"
"""The design of this version's samples (the `frame_design` tag)."""

# Tags on every case of a manifest that holds successes: the frame the strata were sampled from.
FRAME_TAGS = {"episodes": "frame_episodes", "failures": "frame_failures", "successes": "frame_successes",
              "sampled": "success_sample", "seed": "success_seed", "failures_sampled": "failure_sample",
              "failure_seed": "failure_seed", "design": "frame_design"}
# The case's own task's part of the frame (the per-task and per-group net change).
TASK_FRAME_TAGS = {"failures": "frame_task_failures", "successes": "frame_task_successes"}
# The provenance tag of `rescue manifest from-eval --limit`: the failures are the first of the list.
LIMIT_TAG = "taken_limit"


class SamplingFrame(BaseModel):
    """What the study's cases were drawn from: the evaluation's failures F and successes S, the seeded samples of
    each and the design that drew them (DESIGN §17)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    failures: int
    """F: the evaluation's failures in the frame."""
    successes: int
    """S: the evaluation's successes in the frame."""
    sampled: int | None = None
    """How many successes the seeded sample took (None: every one, or none were taken)."""
    seed: int | None = None
    """The successes' sample's seed; None: not sampled."""
    failures_sampled: int | None = None
    """How many failures a seeded sample took (`--failures N`); None: every one (or the first `limit`)."""
    failure_seed: int | None = None
    """The failures' sample's seed; None: not sampled."""
    design: str | None = None
    """The design that drew the samples (`DESIGN`); None: a manifest written before it was recorded, whose sample
    of successes (if any) had unequal inclusion probabilities."""
    limit: int | None = None
    """The failures are the first `limit` of the evaluation's list (`--limit`), not a probability sample."""

    @property
    def episodes(self) -> int:
        """N = F + S: the episodes the net change is a change of (unknown episodes left out)."""
        return self.failures + self.successes


def allocate(counts: Sequence[int], n: int, seed: int | str) -> list[int]:
    """n draws over strata of these sizes, every unit with inclusion probability n / total: each stratum's quota
    n * count / total rounded down or up, up with probability its fractional part (systematic over the quotas in
    a seeded random order, from a seeded random start); never more than a stratum holds."""
    total = sum(counts)
    if not 0 <= n <= total:
        raise ValueError(f"cannot draw {n} of {total}")
    if total == 0:
        return [0] * len(counts)
    rng = random.Random(f"{seed}:allocation")
    order = list(range(len(counts)))
    rng.shuffle(order)
    start = Fraction(rng.randrange(2**52), 2**52)
    out = [0] * len(counts)
    edge = Fraction(0)
    for i in order:
        nxt = edge + Fraction(n * counts[i], total)
        # The points start + k (k = 0, 1, ...) that fall in [edge, nxt).
        out[i] = math.ceil(nxt - start) - math.ceil(edge - start)
        edge = nxt
    return out


def sample_cases(cases: Sequence[Case], n: int | None, seed: int) -> list[Case]:
    """A seeded sample of n cases stratified by task with equal inclusion probabilities (module docstring), in
    the given order; every one when n is None or at least their number."""
    if n is None or n >= len(cases):
        return list(cases)
    by_task: dict[str, list[int]] = {}
    for i, case in enumerate(cases):
        by_task.setdefault(case.task, []).append(i)
    tasks = sorted(by_task)
    chosen: set[int] = set()
    for task, k in zip(tasks, allocate([len(by_task[t]) for t in tasks], n, seed)):
        # One stream per task, so that a task's draws depend on its own size and quota only.
        chosen.update(random.Random(f"{seed}:{task}").sample(by_task[task], k))
    return [c for i, c in enumerate(cases) if i in chosen]


def sample_successes(successes: Sequence[Case], n: int | None, seed: int) -> list[Case]:
    """The seeded sample of n successes (`sample_cases`)."""
    return sample_cases(successes, n, seed)


def _values(cases: Iterable[Case], tag: str) -> set:
    return {c.tags.get(tag) for c in cases}


def _int_tag(cases: Iterable[Case], tag: str) -> int | None:
    values = _values(cases, tag)
    values.discard(None)
    if len(values) != 1:
        return None
    (value,) = values
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def frame_disagreement(cases: Sequence[Case]) -> str | None:
    """Which frame tag the cases disagree on (one row edited), in one line; None: every case records the same
    frame, or none does."""
    tagged = [c for c in cases if FRAME_TAGS["failures"] in c.tags or FRAME_TAGS["successes"] in c.tags]
    if not tagged:
        return None
    for tag in (*FRAME_TAGS.values(), LIMIT_TAG):
        values = {repr(c.tags.get(tag)) for c in cases}
        if len(values) > 1:
            odd = sorted(values)
            return f"the cases disagree on the sampling frame's {tag!r} ({', '.join(odd[:3])})"
    per_task: dict[str, set[str]] = {}
    for c in cases:
        per_task.setdefault(c.task, set()).add(repr([c.tags.get(t) for t in TASK_FRAME_TAGS.values()]))
    for task, values in sorted(per_task.items()):
        if len(values) > 1:
            return f"the cases of task {task} disagree on its part of the sampling frame"
    return None


def frame_of(cases: Sequence[Case]) -> SamplingFrame | None:
    """The sampling frame the cases' tags record (every case must agree); None when they record none."""
    failures, successes = _int_tag(cases, FRAME_TAGS["failures"]), _int_tag(cases, FRAME_TAGS["successes"])
    if failures is None or successes is None:
        return None
    designs = _values(cases, FRAME_TAGS["design"]) - {None}
    return SamplingFrame(failures=failures, successes=successes, sampled=_int_tag(cases, FRAME_TAGS["sampled"]),
                         seed=_int_tag(cases, FRAME_TAGS["seed"]),
                         failures_sampled=_int_tag(cases, FRAME_TAGS["failures_sampled"]),
                         failure_seed=_int_tag(cases, FRAME_TAGS["failure_seed"]),
                         design=next(iter(designs)) if len(designs) == 1 else None,
                         limit=_int_tag(cases, LIMIT_TAG))


def task_frames(cases: Iterable[Case]) -> dict[str, SamplingFrame]:
    """Each task's part of the frame, by `suite/task_id`, as its cases' tags record it."""
    out: dict[str, SamplingFrame] = {}
    for case in cases:
        f, s = case.tags.get(TASK_FRAME_TAGS["failures"]), case.tags.get(TASK_FRAME_TAGS["successes"])
        if isinstance(f, int) and isinstance(s, int):
            out.setdefault(case.task, SamplingFrame(failures=f, successes=s))
    return out


def frame_tags(frame: SamplingFrame, task: SamplingFrame) -> dict[str, int | str]:
    """The tags that record the frame (and the case's task's part of it) on a case."""
    tags: dict[str, int | str] = {
        FRAME_TAGS["episodes"]: frame.episodes, FRAME_TAGS["failures"]: frame.failures,
        FRAME_TAGS["successes"]: frame.successes,
        TASK_FRAME_TAGS["failures"]: task.failures, TASK_FRAME_TAGS["successes"]: task.successes}
    for key in ("seed", "sampled", "failures_sampled", "failure_seed", "design"):
        value = getattr(frame, key)
        if value is not None:
            tags[FRAME_TAGS[key]] = value
    return tags


def main_frame(frame: SamplingFrame, pilot_failures: int) -> SamplingFrame:
    """The frame of the main cohort: the evaluation without its declared pilot failures (reported apart, never
    extrapolated)."""
    return frame.model_copy(update={"failures": frame.failures - pilot_failures})


def frame_refusal(frame: SamplingFrame, failures: int, successes: int) -> str | None:
    """Why the net change over `frame` (the main cohort's: `main_frame`) cannot be estimated from `failures` failure
    cases and `successes` success cases of the main cohort, in one line naming the selection; None: each stratum is
    a census or a sample of the declared design and size."""
    if frame.limit is not None and failures < frame.failures:
        return (f"the failures are the first {failures} of the evaluation's {frame.failures} (--limit {frame.limit}), "
                "not a random sample: nothing may be extrapolated from them (draw them with --failures N --seed S)")
    samples = [s for s in (frame.sampled, frame.failures_sampled) if s is not None]
    if samples and frame.design != DESIGN:
        return ("the successes were drawn by a sampler before this version (largest-remainder quotas with ties to "
                "the first task): their inclusion probabilities are unequal (re-draw them with `rescue manifest "
                "from-eval --successes N --seed S`)")
    for what, held, total, sampled in (("failures", failures, frame.failures, frame.failures_sampled),
                                       ("successes", successes, frame.successes, frame.sampled)):
        want = total if sampled is None else sampled
        if held != want:
            declared = "all" if sampled is None else "a sample of"
            return (f"the frame declares {declared} {want} of the evaluation's {total} {what}; the manifest holds "
                    f"{held} (a hand-made selection is not a probability sample)")
    return None
