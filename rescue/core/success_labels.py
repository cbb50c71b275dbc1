"""The labels of a historical success (DESIGN §17), pure: the same ordered rules of DESIGN §3 as a failure's
(`rescue.core.classify.judge`), where only the last ones read differently:

    rules 1-3, 5, 6 as for a failure       -> initial_state_deviation / unknown
    rule 4: the arm ended before its q      -> kept (not exposed: the advice could not touch it; no call was made)
    rule 7: the control arm failed          -> not_reproduced
    rule 8: the asking arm failed           -> broken
    rule 9: both succeeded                  -> kept
    rule 4, the advisor kept the instruction -> declined (as for a failure: DESIGN §18)

The figures over these labels (harm, the net change) are in `rescue.core.figures.harm`.
"""

from __future__ import annotations

from typing import Literal

SuccessLabel = Literal["broken", "kept", "not_reproduced", "unknown", "initial_state_deviation", "declined"]
SUCCESS_LABELS: tuple[SuccessLabel, ...] = ("broken", "kept", "not_reproduced", "unknown", "initial_state_deviation")
HistoricalOutcome = Literal["failure", "success"]

# The DESIGN §3 rule that, for a historical success, decides `kept` by construction: the arm ended before its q.
NOT_EXPOSED_RULE = 4


def success_label(rule: int) -> SuccessLabel:
    """A historical success's label from the DESIGN §3 rule that decided it (the rules are checked in the same
    order for failures and successes; rules 4, 7, 8 and 9 read differently)."""
    if rule == 1:
        return "initial_state_deviation"
    if rule in (2, 3, 5, 6):
        return "unknown"
    return {4: "kept", 7: "not_reproduced", 8: "broken", 9: "kept"}[rule]


def success_reason(rule: int, arm: str, against: str, q: int, steps: int) -> str:
    """The one-line reason of a success's label for rules 4, 7, 8 and 9."""
    if rule == 4:
        return f"the episode ended at step {steps}, before the query point {q}: kept by construction, not exposed"
    if rule == 7:
        return f"{against} arm failed: the historical success was not reproduced"
    if rule == 8:
        return f"{against} succeeded, {arm} failed: broken"
    return f"{against} and {arm} succeeded: kept"


def is_exposed(label: str, rule: int) -> bool:
    """Whether the arm's query point reached the success (every label but `kept` by rule 4; an unknown case is
    counted as reached: its exposure is not known, and it is never evidence of safety)."""
    return not (label == "kept" and rule == NOT_EXPOSED_RULE)
