"""The objects of a task's scene, read from the installed benchmark's BDDL file, and a subgoal naming the wrong one.

A loopback advisor that answers with another object of the scene than the task's
(`rescue serve-vlm --answer wrong-object`) is a negative control with the VLM's own
style: the subgoal is as specific as a good one, only about the wrong object. The
task is found by its instruction in the catalog; its scene is the BDDL's
`(:objects ...)`. The other object is the first of the scene, in the suite's task
order, that is neither the task's object nor its target (the positive control's
`[sham.by_task]` texts in `models/positive_control/mismatched.toml` follow the same
rule).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from rescue.core.catalog import libero_catalog
from rescue.embedded.phases import parse_pick_place

_OBJECTS = re.compile(r"\(:objects(.*?)\)", re.DOTALL)


def _name(kind: str) -> str:
    return kind.replace("_", " ")


@functools.lru_cache(maxsize=None)
def _bddl_root() -> Path | None:
    try:
        from libero.libero import get_libero_path
    except ImportError:
        return None
    return Path(get_libero_path("bddl_files"))


@functools.lru_cache(maxsize=256)
def scene_of(instruction: str) -> tuple[str, tuple[str, ...]] | None:
    """(suite, the scene's object kinds in BDDL order) of the first catalog task whose instruction this is; None:
    no shipped task has it, or the benchmark's files are not installed."""
    root = _bddl_root()
    if root is None:
        return None
    text = " ".join(instruction.lower().split())
    catalog = libero_catalog()
    for name, suite in catalog.suites.items():
        for task in suite.tasks:
            if " ".join(task.instruction.lower().split()) != text:
                continue
            path = root / suite.base / f"{task.name}.bddl"
            if not path.is_file():
                continue
            found = _OBJECTS.search(path.read_text(encoding="utf-8"))
            if found is None:
                continue
            kinds = tuple(line.split(" - ", 1)[1].strip() for line in found.group(1).strip().splitlines() if " - " in line)
            return name, kinds
    return None


def task_order_objects(suite: str) -> list[str]:
    """The objects a suite's pick-and-place tasks name, in task order (libero_object: alphabet soup, cream cheese, ...)."""
    known = libero_catalog().suite(suite)
    out: list[str] = []
    for task in known.tasks if known is not None else []:
        goal = parse_pick_place(task.instruction)
        if goal is not None and goal.obj not in out:
            out.append(goal.obj)
    return out


def other_object(instruction: str) -> str | None:
    """Another object of the instruction's scene: the first, in the suite's task order, that is neither the task's
    object nor its target; None when the scene or the task's object is unknown."""
    goal = parse_pick_place(instruction)
    scene = scene_of(instruction)
    if goal is None or scene is None:
        return None
    suite, kinds = scene
    present = {_name(k) for k in kinds}
    for obj in task_order_objects(suite) + sorted(present):
        if obj in present and obj not in (goal.obj, goal.target):
            return obj
    return None


def wrong_object_subgoal(instruction: str) -> str:
    """A subgoal as specific as a good one, about the wrong object: `grasp the <another object of the scene>`."""
    other = other_object(instruction)
    if other is not None:
        return f"grasp the {other}"
    goal = parse_pick_place(instruction)
    # A scene we cannot read: still an object that is not the task's.
    return "grasp the bowl" if goal is None or goal.obj != "bowl" else "grasp the plate"
