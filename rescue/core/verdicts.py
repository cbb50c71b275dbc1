"""What a case's classification records: its label, the rule that decided it, each judged arm's verdict and, with
K continuations, every arm's successes of K (DESIGN §3, §13, §17)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rescue.core.arms import ADVISOR_ARM_PREFIX
from rescue.core.success_labels import SuccessLabel

Label = Literal["rescued", "not_rescued", "unknown", "initial_state_deviation", "declined"]
# The label of an arm whose advisor kept the instruction at every call (DESIGN §18): never rescued, kept or broken.
DECLINED = "declined"


# An evaluation study (control arm only) labels episodes instead.
EpisodeLabel = Literal["success", "failure", "unknown"]


class ArmVerdict(BaseModel):
    """One arm judged against another by the DESIGN §3 rules: the sham (DESIGN §8), an advisor's arm
    (DESIGN §11), a query point's arm (DESIGN §14), each against the control arm."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    against: str = "control"
    """The arm it is judged against."""
    label: Label | SuccessLabel
    """The DESIGN §3 label of the arm against `against` (a historical success's: DESIGN §17)."""
    rule: int
    """The DESIGN §3 rule (1 to 9) that decided it."""
    reason: str
    """Why, in one line."""
    in_m: bool = False
    """Whether the pair is in M (both valid and complete, no deviation, exact prefix)."""
    in_e: bool = False
    """Whether it is in E: in M, with the arm's subgoal applied and valid evidence."""


class ContinuationCount(BaseModel):
    """One arm's K continuations from the snapshot at q, as its case's verdict counts them (DESIGN §13)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    successes: int
    """How many of its continuations succeeded."""
    continuations: int
    """K: how many continuations it ran (its first is the arm judged for the case's label)."""
    in_m: bool
    """Whether every continuation k is in M with the control arm's continuation k (for the control arm itself:
    every continuation completed and stood in the leader's state at q); only then does the case count in the
    arm's paired estimate against control."""
    in_e: bool
    """Whether every continuation k is in E with the control arm's continuation k (the control arm: as `in_m`);
    only then does the case count in the arm's paired estimate against another arm that asks."""


class Verdict(BaseModel):
    """A case's classification and the rule (DESIGN §3 number) that decided it."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The case classified."""
    label: Label | SuccessLabel | EpisodeLabel
    """The DESIGN §3 label of the primary arm against control (a historical success's: broken, kept,
    not_reproduced, unknown, initial_state_deviation, DESIGN §17); in an evaluation study, the episode's label
    (success, failure, unknown)."""
    rule: int
    """The DESIGN §3 rule (1 to 9) that decided it; in an evaluation study 0 (the episode ran) or 2 (unknown)."""
    reason: str
    """Why, in one line."""
    in_m: bool = False
    """Whether the control/primary pair is in M (both valid and complete, no deviation, exact prefix)."""
    in_e: bool = False
    """Whether it is in E: in M, with the subgoal applied and valid evidence."""
    arms: dict[str, ArmVerdict] = Field(default_factory=dict, exclude_if=lambda v: not v)
    """The verdict of every other arm the case judges (the sham, each further advisor, each extra query point),
    by arm name in the study's order; the primary's is the label above. Empty (absent): a study of two arms,
    or an evaluation."""
    continuations: dict[str, ContinuationCount] = Field(default_factory=dict, exclude_if=lambda v: not v)
    """With K continuations per arm (K > 1, DESIGN §13): every arm's successes of K, the control arm's first, by
    arm name. Empty (absent): one continuation per arm."""

    @model_validator(mode="before")
    @classmethod
    def _before_arms(cls, data: Any) -> Any:
        # A verdict stored before the record family (rescue-export/4 and earlier) keeps the sham's verdict under
        # `sham` and every advisor's (the primary's first, equal to the label) under `advisors`.
        if not isinstance(data, dict) or ("sham" not in data and "advisors" not in data):
            return data
        data = dict(data)
        sham, advisors = data.pop("sham", None), data.pop("advisors", None) or {}
        arms = {f"{ADVISOR_ARM_PREFIX}{name}": v for name, v in list(advisors.items())[1:]}
        if sham is not None:
            arms["sham"] = sham
        data.setdefault("arms", arms)
        return data

    def of(self, arm: str, primary: str = "assisted") -> ArmVerdict | None:
        """The verdict of one arm against control (the primary's from the label); None: the case judges no such arm."""
        if arm == primary:
            return ArmVerdict(label=self.label, rule=self.rule, reason=self.reason, in_m=self.in_m, in_e=self.in_e)
        return self.arms.get(arm)
