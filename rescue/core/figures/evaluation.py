"""Baseline evaluation: episodes of one policy, and the failure manifest they yield.

An evaluation study is a study whose only arm is `control`. Each episode is
labelled `success`, `failure` or `unknown` (infrastructure); interrupted and
never-started episodes are counted, never dropped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from rescue.core.catalog import VARIANT_MARK, libero_catalog, split_variant
from rescue.core.episode_protocol import RESCUE, EpisodeProtocol
from rescue.core.manifest import Case
from rescue.core.records import ArmResult
from rescue.core.verdicts import Verdict


def classify_episode(case_id: str, arm: ArmResult | None, interrupted: bool) -> Verdict:
    """An episode's label: success or failure when it completed, else unknown."""
    if interrupted:
        return Verdict(case_id=case_id, label="unknown", rule=2, reason="interrupted")
    if arm is None or arm.status != "complete" or arm.success is None:
        why = "missing" if arm is None else f"{arm.status}: {arm.error}"
        return Verdict(case_id=case_id, label="unknown", rule=2, reason=f"episode {why}")
    if arm.success:
        return Verdict(case_id=case_id, label="success", rule=0, reason=f"succeeded at step {arm.steps}")
    return Verdict(case_id=case_id, label="failure", rule=0, reason=f"failed after {arm.steps} steps")


class Rate(BaseModel):
    """Successes of a slice of episodes; the rate is over all its episodes, unknowns included."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    n: int = 0
    """Every episode of the slice in the manifest, run or not."""
    success: int = 0
    """Episodes labelled success."""
    failure: int = 0
    """Episodes labelled failure."""
    unknown: int = 0
    """Episodes labelled unknown (infrastructure, or interrupted)."""
    unexecuted: int = 0
    """Episodes without a verdict yet (never started, or still running)."""
    rate: float | None = None
    """success / n (0-1); None when the slice is empty."""


class EvalSummary(BaseModel):
    """Success per task, per group and overall, with unknown and unexecuted episodes shown."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    overall: Rate
    """Every episode of the manifest."""
    per_task: dict[str, Rate]
    """By task (`suite/task_id`)."""
    per_group: dict[str, Rate]
    """By the manifest's group."""


def summarize_eval(cases: list[Case], verdicts: dict[str, Verdict]) -> EvalSummary:
    """Count every manifest episode; one with no verdict yet is `unexecuted`."""
    return summarize_labels(
        (case.task, case.group, verdicts[case.case_id].label if case.case_id in verdicts else None) for case in cases
    )


def summarize_labels(episodes: Iterable[tuple[str, str, str | None]]) -> EvalSummary:
    """Count (task, group, label) episodes; a label of None is `unexecuted`."""
    overall = Rate()
    per_task: dict[str, Rate] = defaultdict(Rate)
    per_group: dict[str, Rate] = defaultdict(Rate)
    for task, group, label in episodes:
        field = label or "unexecuted"
        if field not in ("success", "failure", "unknown", "unexecuted"):
            raise ValueError(f"not an episode label: {label!r}")
        for rate in (overall, per_task[task], per_group[group]):
            rate.n += 1
            setattr(rate, field, getattr(rate, field) + 1)
    for rate in [overall, *per_task.values(), *per_group.values()]:
        rate.rate = rate.success / rate.n if rate.n else None
    return EvalSummary(overall=overall, per_task=dict(per_task), per_group=dict(per_group))


def failure_cases(
    cases: list[Case], verdicts: dict[str, Verdict], arms: dict[str, dict[str, ArmResult]], provenance: dict,
    outcome: str = "failure",
) -> list[Case]:
    """The failed episodes (`outcome="success"`: the successful ones, marked so) as rescue cases, with their
    initial-state fingerprint and provenance tags."""
    out = []
    for case in cases:
        verdict = verdicts.get(case.case_id)
        if verdict is None or verdict.label != outcome:
            continue
        arm = arms[case.case_id]["control"]
        tags = {**case.tags, **{k: v for k, v in provenance.items() if v is not None}}
        update = {"fingerprint": arm.fingerprint, "tags": tags, "pilot": False}
        if outcome == "success":
            update["outcome"] = "success"
        out.append(case.model_copy(update=update))
    return out


def mark_pilot(cases: list[Case], first_tasks: int) -> list[Case]:
    """Declare the pilot before any rescue runs: the first failure of each of the first k tasks."""
    seen_tasks: list[str] = []
    out = []
    for case in cases:
        pilot = False
        if case.task not in seen_tasks:
            seen_tasks.append(case.task)
            pilot = len(seen_tasks) <= first_tasks
        out.append(case.model_copy(update={"pilot": pilot}))
    return out


def suite_group(suite: str) -> str:
    """The group an evaluation gives a suite's episodes: its short name, or its perturbation kind (with its
    variant: `language@base-inits`, so a study of both never pools them)."""
    known = libero_catalog().suite(suite)
    _, variant = split_variant(suite)
    if known is not None and known.perturbation != "none":
        return known.perturbation + (f"{VARIANT_MARK}{variant}" if variant else "")
    return suite.removeprefix("libero_")


def case_id_of(suite: str, task_id: int, index: int) -> str:
    """An episode's case id: `object-3-ep7`, `object_lan.base-inits-3-ep7` (case ids take no `@`)."""
    return f"{suite.removeprefix('libero_').replace(VARIANT_MARK, '.')}-{task_id}-ep{index}"


def episode_cases(
    suite: str, tasks: list[int], episodes: int, horizon: int, first_init: int = 0, protocol: EpisodeProtocol = RESCUE
) -> list[Case]:
    """The evaluation manifest: `episodes` official initial states of each task, episode k seeded as the
    episode protocol seeds its episode k (rescue: k; openpi: the task's 7; LeRobot: 1000 + k). The group
    is the suite (`object`), or for a LIBERO-PRO perturbation its kind (`swap`, `language`, ...), so a
    study over several suites reports per perturbation kind."""
    group = suite_group(suite)
    return [
        Case(
            case_id=case_id_of(suite, task, idx),
            suite=suite,
            task_id=task,
            init_state_index=idx,
            env_seed=protocol.episode_seed(idx),
            horizon=horizon,
            group=group,
        )
        for task in tasks
        for idx in range(first_init, first_init + episodes)
    ]
