"""Historical successes as cases (DESIGN §17): the seeded sample stratified by task, and its sampling frame.

The sample is drawn before anything runs and its frame travels with every case as tags (`rescue manifest
from-eval --successes`): how many episodes, failures and successes the evaluation had (after any `--inits`
split), the same for the case's task, and the sample's seed and size. The manifest's sha256 is part of the
study's identity, so the frame and seed are too. The net change reads the frame back from the cases.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict

from rescue.core.manifest import Case

# Tags on every case of a manifest that holds successes: the frame the strata were sampled from.
FRAME_TAGS = {"episodes": "frame_episodes", "failures": "frame_failures", "successes": "frame_successes",
              "sampled": "success_sample", "seed": "success_seed"}
# The case's own task's part of the frame (the per-task and per-group net change).
TASK_FRAME_TAGS = {"failures": "frame_task_failures", "successes": "frame_task_successes"}


class SamplingFrame(BaseModel):
    """What the study's cases were drawn from: the evaluation's failures F and successes S, and the seeded sample
    of successes (DESIGN §17)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    failures: int
    """F: the evaluation's failures in the frame (every one is a candidate case)."""
    successes: int
    """S: the evaluation's successes in the frame."""
    sampled: int | None = None
    """How many successes the seeded sample took (None: every one, or none were taken)."""
    seed: int | None = None
    """The sample's seed; None: not sampled."""

    @property
    def episodes(self) -> int:
        """N = F + S: the episodes the net change is a change of (unknown episodes left out)."""
        return self.failures + self.successes


def allocate(counts: Sequence[int], n: int) -> list[int]:
    """Proportional allocation of n draws over strata of these sizes (largest remainder, ties to the first
    stratum), never more than a stratum holds."""
    total = sum(counts)
    if not 0 <= n <= total:
        raise ValueError(f"cannot draw {n} of {total}")
    if total == 0:
        return [0] * len(counts)
    quotas = [n * c / total for c in counts]
    out = [int(q) for q in quotas]
    order = sorted(range(len(counts)), key=lambda i: (-(quotas[i] - out[i]), i))
    for i in order[: n - sum(out)]:
        out[i] += 1
    return out


def sample_successes(successes: Sequence[Case], n: int | None, seed: int) -> list[Case]:
    """A seeded random sample of n successes stratified by task (proportional allocation), in the given order;
    every one when n is None or at least their number."""
    if n is None or n >= len(successes):
        return list(successes)
    by_task: dict[str, list[int]] = {}
    for i, case in enumerate(successes):
        by_task.setdefault(case.task, []).append(i)
    tasks = sorted(by_task)
    chosen: set[int] = set()
    for task, k in zip(tasks, allocate([len(by_task[t]) for t in tasks], n)):
        # One stream per task, so that adding a task does not reshuffle the others' draws.
        chosen.update(random.Random(f"{seed}:{task}").sample(by_task[task], k))
    return [c for i, c in enumerate(successes) if i in chosen]


def _int_tag(cases: Iterable[Case], tag: str) -> int | None:
    values = {c.tags.get(tag) for c in cases}
    values.discard(None)
    if len(values) != 1:
        return None
    (value,) = values
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def frame_of(cases: Sequence[Case]) -> SamplingFrame | None:
    """The sampling frame the cases' tags record (every case must agree); None when they record none."""
    failures, successes = _int_tag(cases, FRAME_TAGS["failures"]), _int_tag(cases, FRAME_TAGS["successes"])
    if failures is None or successes is None:
        return None
    return SamplingFrame(failures=failures, successes=successes, sampled=_int_tag(cases, FRAME_TAGS["sampled"]),
                         seed=_int_tag(cases, FRAME_TAGS["seed"]))


def task_frames(cases: Iterable[Case]) -> dict[str, SamplingFrame]:
    """Each task's part of the frame, by `suite/task_id`, as its cases' tags record it."""
    out: dict[str, SamplingFrame] = {}
    for case in cases:
        f, s = case.tags.get(TASK_FRAME_TAGS["failures"]), case.tags.get(TASK_FRAME_TAGS["successes"])
        if isinstance(f, int) and isinstance(s, int):
            out.setdefault(case.task, SamplingFrame(failures=f, successes=s))
    return out


def frame_tags(frame: SamplingFrame, task: SamplingFrame) -> dict[str, int]:
    """The tags that record the frame (and the case's task's part of it) on a case."""
    tags = {FRAME_TAGS["episodes"]: frame.episodes, FRAME_TAGS["failures"]: frame.failures,
            FRAME_TAGS["successes"]: frame.successes,
            TASK_FRAME_TAGS["failures"]: task.failures, TASK_FRAME_TAGS["successes"]: task.successes}
    if frame.seed is not None:
        tags[FRAME_TAGS["seed"]] = frame.seed
    if frame.sampled is not None:
        tags[FRAME_TAGS["sampled"]] = frame.sampled
    return tags
