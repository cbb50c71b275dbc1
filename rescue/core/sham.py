"""The sham arm's declared sources (DESIGN §8), as pure functions.

`fixed`: one declared text, the same for every case (content-free by default),
or, with `by_task`, a declared text per task (say, a subgoal naming another
object of the task's scene). `permuted`: each case
gets the subgoal its donor's VLM call produced, under donor groups declared
when the study is created (stored in the journal, re-derived by `verify`):
a seeded derangement made of pairs (and one triple when the count is odd),
each pair across two different tasks whenever the cohort allows it. Short
cycles keep a sham arm's wait for its donor's answer as short as the donor's
own query: the engine starts a case's donor group together.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rescue.core.catalog import libero_catalog
from rescue.core.manifest import Case

# Content-free: it names no object, place or motion of any task.
DEFAULT_SHAM_TEXT = "Continue with the task."


class ShamConfig(BaseModel):
    """Whether a study has a sham arm, and where its subgoal comes from."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    source: Literal["off", "fixed", "permuted"] = "off"
    """`off`: no sham arm; `fixed`: a declared text; `permuted`: a donor case's VLM answer."""
    text: str = Field(default=DEFAULT_SHAM_TEXT, min_length=1, max_length=1500)
    """The `fixed` subgoal (content-free by default)."""
    by_task: dict[str, str] | None = None
    """`fixed` only: the subgoal for the cases of these tasks (`suite/task_id`); other tasks get `text`.
    None: every task gets `text`."""
    seed: int = 0
    """The `permuted` donor groups' seed."""
    advisor: str | None = None
    """`permuted` in a study of several advisors: the advisor whose answers the sham arms apply (its name);
    None: the study's primary advisor (a study of one `[vlm]`: its VLM's)."""

    @field_validator("by_task")
    @classmethod
    def _texts(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for task, text in (value or {}).items():
            if not text.strip() or len(text) > 1500:
                raise ValueError(f"sham text for {task} must have 1 to 1500 characters")
        return value

    def by_task_problem(self, tasks: Iterable[str]) -> str | None:
        """Why `by_task` names a task that is neither one of these (the manifest's, `suite/task_id`) nor one
        of the LIBERO catalog's (a shared file may name more tasks than a study holds), in one line; None
        when every key names one (a key naming none would be ignored)."""
        tasks = sorted(set(tasks))
        catalog = libero_catalog()

        def exists(key: str) -> bool:
            suite, _, task_id = key.rpartition("/")
            return key in tasks or (task_id.isdigit() and catalog.task(suite, int(task_id)) is not None)

        stray = [key for key in (self.by_task or {}) if not exists(key)]
        if not stray:
            return None
        shown = ", ".join(tasks[:6]) + (f", ... ({len(tasks)} tasks)" if len(tasks) > 6 else "")
        return (f"sham.by_task: {', '.join(repr(k) for k in stray)} names no task (`suite/task_id`) of the manifest "
                f"(its tasks: {shown}) or of the LIBERO catalog")

    def text_for(self, task: str) -> str:
        """The `fixed` subgoal for a case of this task (`suite/task_id`)."""
        return (self.by_task or {}).get(task, self.text)

    @property
    def on(self) -> bool:
        """Whether the study runs a sham arm."""
        return self.source != "off"


def sham_donors(cases: Sequence[Case], seed: int) -> dict[str, str]:
    """Each case's donor: pairs (one triple if the count is odd), across tasks where possible; seeded."""
    rng = random.Random(seed)
    by_task: dict[str, list[str]] = {}
    for case in cases:
        by_task.setdefault(case.task, []).append(case.case_id)
    for ids in by_task.values():
        rng.shuffle(ids)
    tasks = sorted(by_task)
    rng.shuffle(tasks)
    pairs: list[list[str]] = []
    # Pair a case of the task with the most cases left with one of the next: this keeps
    # same-task pairs to the minimum the cohort forces (one dominant task).
    while True:
        left = sorted((t for t in tasks if by_task[t]), key=lambda t: -len(by_task[t]))
        if len(left) < 2:
            break
        pairs.append([by_task[left[0]].pop(), by_task[left[1]].pop()])
    rest = [cid for t in tasks for cid in by_task[t]]
    while len(rest) >= 2:
        pairs.append([rest.pop(), rest.pop()])
    if rest and pairs:
        pairs[-1].append(rest.pop())  # a triple: every case still gets another case's answer
    donors: dict[str, str] = {}
    for group in pairs:
        for i, cid in enumerate(group):
            donors[cid] = group[(i + 1) % len(group)]
    return donors


def donor_group(donors: dict[str, str], case_id: str) -> list[str]:
    """The cycle of cases that give each other their subgoals, starting at case_id."""
    group = [case_id]
    nxt = donors.get(case_id)
    while nxt is not None and nxt != case_id and nxt not in group:
        group.append(nxt)
        nxt = donors.get(nxt)
    return group
