"""The local endpoint's decision: an image-only subgoal model, with a rule as fallback.

It reads only what a request carries (the instruction, the views, the step
budget). The subgoal model (`rescue.embedded.subgoal_model`, trained on rendered LIBERO
frames) looks at the three views and says which phase of a pick-and-place the
scene is in; the answer is that phase's sub-instruction, naming the object the
instruction names (or, if the instruction names none the model knows, the
object the model sees). Fallback, documented and only then: when the model
file is missing, or the instruction is not a pick-and-place of an object the
model was trained on (libero_object's), the subgoal comes from the
instruction's wording (grasp the object again, finish the motion).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from PIL import Image

from rescue.embedded.phases import PHASES, PickPlace, parse_pick_place, sub_instruction
from rescue.embedded.subgoal_model import OBJECTS, VIEWS, load_model

_PREP = r"(?:on top of|onto|into|inside|on|in|to|towards|toward)"
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    # Greedy object: "pick up the bowl between the plate and the ramekin and place it on the plate".
    ("place", re.compile(rf"^pick up the (?P<obj>.+) and (?:place|put) it (?P<prep>{_PREP}) the (?P<target>.+)$")),
    ("place", re.compile(rf"^(?:put|place|move) (?:both )?the (?P<obj>.+?) (?P<prep>{_PREP}) the (?P<target>.+)$")),
    ("pick", re.compile(r"^(?:pick up|lift|grasp|grab) the (?P<obj>.+)$")),
    ("open", re.compile(r"^open the (?P<obj>.+)$")),
    ("close", re.compile(r"^(?:close|shut) the (?P<obj>.+)$")),
    ("turn_on", re.compile(r"^(?:turn|switch) on the (?P<obj>.+)$")),
    ("turn_off", re.compile(r"^(?:turn|switch) off the (?P<obj>.+)$")),
    ("push", re.compile(rf"^push the (?P<obj>.+?)(?: (?P<prep>{_PREP}) the (?P<target>.+))?$")),
]


@dataclass(frozen=True)
class Goal:
    """What the instruction asks: a verb, its object and (for placing) a target."""

    verb: str
    obj: str
    target: str | None = None
    prep: str | None = None


def _first_clause(text: str) -> str:
    # A target runs until the next clause ("... on the plate and close it").
    return re.split(r"\s+and\s+(?=(?:then\s+)?(?:put|place|close|open|turn|push|pick)\b)|,\s*then\s+", text)[0]


def parse_goal(instruction: str) -> Goal | None:
    """Find the task's verb, object and target in the instruction (None if no rule fits)."""
    text = " ".join(instruction.lower().strip().rstrip(".!").split())
    for verb, pattern in _PATTERNS:
        m = pattern.match(text)
        if m is None:
            continue
        groups = m.groupdict()
        obj = groups["obj"]
        if verb != "place":
            obj = _first_clause(obj)
        target = groups.get("target")
        return Goal(
            verb=verb,
            obj=obj.strip(),
            target=_first_clause(target).strip() if target else None,
            prep=groups.get("prep"),
        )
    return None


def _usable(view: Image.Image) -> bool:
    # Decoding is forced here; a uniform image (all one colour) shows nothing.
    pixels = np.asarray(view.convert("RGB"))
    return pixels.size > 0 and int(pixels.max()) != int(pixels.min())


def propose_subgoal(instruction: str, views: list[Image.Image], remaining_steps: int) -> str:
    """One bounded subgoal: the subgoal model's reading of the views, else the instruction's wording."""
    if not views or not any(_usable(v) for v in views):
        return "look around: the view is empty"
    model = load_model()
    goal = parse_pick_place(instruction)
    # The model knows libero_object's scenes only; other tasks keep the rule.
    known = goal is not None and goal.obj in OBJECTS
    if model is not None and len(views) == len(VIEWS) and (known or not instruction.strip()):
        return model_subgoal(model, goal, views)
    return rule_subgoal(instruction, remaining_steps)


# The phases in which the task's object is in the gripper and on its way to its target.
PROGRESSING = ("lift", "carry", "place", "release")


def sees_progress(instruction: str, views: list[Image.Image]) -> bool:
    """Whether the endpoint sees no sign of failure, and so keeps the instruction when it may (DESIGN §18): the
    subgoal model, on the three views, reads a phase in which the object is in the gripper and on its way (lift,
    carry, place, release) with probability above one half, for a pick-and-place of an object it knows. Anything
    else is a reason to advise: the object not held at the moment of asking, a task or a view it cannot read (no
    model file, an instruction that is not a known pick-and-place, an empty view)."""
    goal = parse_pick_place(instruction)
    if goal is None or goal.obj not in OBJECTS or len(views) != len(VIEWS) or not all(_usable(v) for v in views):
        return False
    model = load_model()
    if model is None:
        return False
    phase_p, _ = model.predict(views)
    return float(sum(phase_p[PHASES.index(p)] for p in PROGRESSING)) > 0.5


def model_subgoal(model, goal: PickPlace | None, views: list[Image.Image]) -> str:
    """The sub-instruction of the phase the model sees, for the instruction's object (else the one it sees)."""
    phase_p, object_p = model.predict(views)
    phase = PHASES[int(np.argmax(phase_p))]
    if goal is None:
        goal = PickPlace(obj=OBJECTS[int(np.argmax(object_p))], target="basket", prep="in")
    return sub_instruction(phase, goal)


def rule_subgoal(instruction: str, remaining_steps: int) -> str:
    """The fallback: a subgoal from the instruction's wording alone."""
    goal = parse_goal(instruction)
    # With few steps left, ask for the shortest useful motion.
    hurry = " quickly" if remaining_steps < 50 else ""
    if goal is None:
        return f"grasp the task's object again{hurry}, then finish: {instruction.strip()}"
    if goal.verb == "place":
        prep = {"in": "in", "into": "in", "inside": "in", "on top of": "on top of"}.get(goal.prep or "", "on")
        return f"grasp the {goal.obj} again{hurry}, then place it {prep} the {goal.target}"
    if goal.verb == "pick":
        return f"grasp the {goal.obj} again{hurry}, then lift it up"
    if goal.verb == "open":
        return f"grasp the handle of the {goal.obj} again{hurry}, then pull it open"
    if goal.verb == "close":
        return f"move the gripper to the {goal.obj} again{hurry}, then push it closed"
    if goal.verb in {"turn_on", "turn_off"}:
        state = "on" if goal.verb == "turn_on" else "off"
        return f"grasp the knob of the {goal.obj} again{hurry}, then turn it {state}"
    where = f" {goal.prep} the {goal.target}" if goal.target else ""
    return f"move the gripper behind the {goal.obj} again{hurry}, then push it{where}"
