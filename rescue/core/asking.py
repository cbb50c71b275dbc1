"""Whether and when to ask, as a study declares it (DESIGN §18): triggers that decide an arm's q while the episode
runs, and asking again.

A `[[trigger]]` table adds an arm of the primary advisor's, `assisted@<name>` (the query points' grammar: a trigger
is a query point whose q is decided online), forked from the one prefix at the step where its trigger first fires
on what the control arm has shown up to there. `[asking]` says how many calls an arm that asks a VLM may make and
when it asks again. The decisions themselves are pure functions of recorded data: rescue/core/triggers.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rescue.core.arms import QUERY_POINT_NAME

def _unset(value: Any) -> bool:
    return value is None


TriggerKind = Literal["stall", "gripper", "uncertainty", "random"]

# Each kind's parameters and their defaults; a parameter of another kind is refused by name.
PARAMETERS: dict[str, dict[str, Any]] = {
    "stall": {"window": 4, "distance": 0.01, "objects": True},
    "gripper": {"cycles": 2},
    "uncertainty": {"samples": 4, "threshold": 0.1},
    "random": {"matches": None, "rate": None, "seed": 0},
}


class TriggerConfig(BaseModel):
    """A declared trigger (DESIGN §18): its arm `assisted@<name>` asks the primary advisor at the first query step
    (after the first) where the trigger fires on the shared prefix; it never asks when it never fires."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=rf"^{QUERY_POINT_NAME}$")
    """The trigger's name (its arm is `assisted@<name>`), distinct from every `[[query_point]]`'s."""
    kind: TriggerKind
    """`stall`: the end effector (and the task's object, where the suite's goal names one) stayed within
    `distance` metres of where it was `window` queries before, at each of those queries; `gripper`: the gripper
    closed more than `cycles` times; `uncertainty`: `samples` chunks drawn for the same observation disagree by more
    than `threshold`; `random`: a placebo, at a seeded random query step, asking the share `rate` of episodes."""
    window: int | None = Field(default=None, exclude_if=_unset, ge=1)
    """stall: W, the queries looked back over (default 4)."""
    distance: float | None = Field(default=None, exclude_if=_unset, gt=0)
    """stall: metres (default 0.01)."""
    objects: bool | None = Field(default=None, exclude_if=_unset)
    """stall: whether the task's object must have stayed still too, where the suite's goal names one (default
    true)."""
    cycles: int | None = Field(default=None, exclude_if=_unset, ge=0)
    """gripper: n; it fires once the gripper has closed n + 1 times (default 2)."""
    samples: int | None = Field(default=None, exclude_if=_unset, ge=2)
    """uncertainty: K, the chunks drawn at each query from a probe connection of its own (default 4)."""
    threshold: float | None = Field(default=None, exclude_if=_unset, ge=0)
    """uncertainty: the largest mean distance between two drawn chunks' executed actions that is not yet
    disagreement (default 0.1, in the action space's units)."""
    matches: str | None = Field(default=None, exclude_if=_unset)
    """random: the trigger whose budget this placebo matches (its name)."""
    rate: float | None = Field(default=None, exclude_if=_unset, ge=0, le=1)
    """random: the share of episodes it asks, declared before the study runs (from a pilot of the matched trigger:
    rescue.core.triggers.placebo_rate)."""
    seed: int | None = Field(default=None, exclude_if=_unset)
    """random: the seed of its draws (default 0); each case's draw also depends on its id and the trigger's name."""

    @model_validator(mode="before")
    @classmethod
    def _its_parameters(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("kind") not in PARAMETERS:
            return data
        own = PARAMETERS[data["kind"]]
        others = sorted(k for k in data if k not in own and k not in ("name", "kind")
                        and any(k in p for p in PARAMETERS.values()))
        if others:
            raise ValueError(f"trigger {data.get('name')!r} ({data['kind']}): {', '.join(others)} is not a parameter of "
                             f"a {data['kind']} trigger (its parameters: {', '.join(own)})")
        filled = {k: v for k, v in own.items() if v is not None}
        return {**filled, **{k: v for k, v in data.items() if v is not None}}

    @model_validator(mode="after")
    def _random_is_declared(self) -> "TriggerConfig":
        if self.kind == "random" and (self.matches is None or self.rate is None):
            raise ValueError(f"trigger {self.name!r}: a random placebo names the trigger it matches (matches) and the "
                             "share of episodes it asks (rate), both declared before the study runs")
        return self


class AskingConfig(BaseModel):
    """How often an arm that asks a VLM may ask (DESIGN §18): every call its own receipt, its subgoal replacing the
    last one's; the sham asks once."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_calls: int = Field(default=1, ge=1, le=100)
    """Calls per arm at most (1: ask once, as before)."""
    again: Literal["every", "fires"] = "every"
    """When an arm asks again: `every` (`every_queries` policy queries after its last call), or `fires` (a trigger's
    arm: when its trigger fires again on the arm's own queries since its last call; an arm without a trigger asks
    every `every_queries`)."""
    every_queries: int = Field(default=8, ge=1)
    """The policy queries between two calls (`again = "every"`, and arms without a trigger)."""


def trigger_named(triggers: list[TriggerConfig] | None, name: str | None) -> TriggerConfig | None:
    """The declared trigger of a name (an arm's query point), or None: a fixed query point, or none."""
    return next((t for t in triggers or [] if t.name == name), None)
