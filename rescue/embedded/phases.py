"""The phases of a pick-and-place and the sub-instruction that names each one.

One vocabulary for the expert that labels demonstrations, the learned policy
that is trained on them, and the subgoal model that proposes them: a phase's
sub-instruction always names the task's object (and the target where it
matters), so a subgoal says what to do and to what.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PHASES = ("approach", "descend", "grasp", "lift", "carry", "place", "release")

_PREP = r"(?:on top of|onto|into|inside|on|in|to|towards|toward)"
_PICK_PLACE = re.compile(rf"^pick up the (?P<obj>.+) and (?:place|put) it (?P<prep>{_PREP}) the (?P<target>.+)$")


@dataclass(frozen=True)
class PickPlace:
    """The object to pick, where to put it, and the preposition the task uses."""

    obj: str
    target: str
    prep: str


def parse_pick_place(instruction: str) -> PickPlace | None:
    """The object, target and preposition of a LIBERO pick-and-place instruction (None if not one)."""
    text = " ".join(instruction.lower().strip().rstrip(".!").split())
    m = _PICK_PLACE.match(text)
    if m is None:
        return None
    prep = {"into": "in", "inside": "in", "onto": "on"}.get(m["prep"], m["prep"])
    return PickPlace(obj=m["obj"].strip(), target=m["target"].strip(), prep=prep)


def sub_instruction(phase: str, goal: PickPlace) -> str:
    """The sub-instruction for one phase of the task, naming its object."""
    o, t, p = goal.obj, goal.target, goal.prep
    return {
        "approach": f"move above the {o}",
        "descend": f"lower the gripper around the {o}",
        "grasp": f"grasp the {o}",
        "lift": f"lift the {o}",
        "carry": f"carry the {o} to the {t}",
        "place": f"lower the {o} {p} the {t}",
        "release": f"release the {o} {p} the {t}",
    }[phase]
