"""`[stopping]`: a rule, declared before the first case, that stops a study once its answer is decided (DESIGN
§20; the e-process is `rescue.core.figures.sequential`). Part of the configuration, so of the study's identity: a
rule changed after the first case is a new study."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Tested = Literal["rescue", "sham", "harm", "net", "arms"]


class StoppingConfig(BaseModel):
    """What is tested, at what error rate, between which bounds, and for what the study may stop."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    test: Tested = "rescue"
    """The comparison the rule decides: `rescue` (the primary arm against control over the failures), `sham` (the
    primary arm against the sham), `harm` (control against the primary arm over the historical successes), `net`
    (the primary arm against control over every case, failures and successes: the net change; needs every
    episode of the evaluation in the manifest), `arms` (`first` against `second`, e.g. two query points)."""
    first: str | None = None
    """`arms`: the first arm (its successes count for the effect); None: the primary arm."""
    second: str | None = None
    """`arms`: the second arm; None for the other tests."""
    alpha: float = Field(default=0.05, gt=0.0, lt=0.5)
    """The error rate of each boundary (efficacy and futility each): anytime-valid, however often it is looked at."""
    minimum: int = Field(default=10, ge=1, le=1_000_000)
    """No decision before this many scored cases."""
    maximum: int | None = Field(default=None, ge=1, le=1_000_000)
    """At most this many cases of the main cohort are run; None: every one (then the rule stops only early)."""
    stop_for: Literal["efficacy", "futility", "both"] = "both"
    """`efficacy`: stop once the effect is shown above zero; `futility`: once an effect of `effect` or more is
    ruled out; `both`."""
    effect: float = Field(default=0.10, gt=0.0, lt=1.0)
    """The smallest effect of interest (a difference of success probabilities: 0.10 is 10 points); futility
    rules out an effect this large."""
    seed: int = Field(default=0, ge=0, lt=2**63)
    """The seed of the order the cases run in (a random permutation stratified by task, fixed at creation)."""

    @model_validator(mode="after")
    def _arms(self) -> "StoppingConfig":
        if self.test == "arms" and self.second is None:
            raise ValueError("stopping.second: test = 'arms' compares two arms; name the second")
        if self.test != "arms" and (self.first is not None or self.second is not None):
            raise ValueError(f"stopping.first and stopping.second name the arms of test = 'arms', not {self.test!r}")
        if self.maximum is not None and self.maximum < self.minimum:
            raise ValueError(f"stopping.maximum {self.maximum} is below stopping.minimum {self.minimum}")
        return self

    def arms(self, primary: str) -> tuple[str, str]:
        """(first, second): whose successes count for the effect, against whose."""
        if self.test == "rescue":
            return primary, "control"
        if self.test == "sham":
            return primary, "sham"
        if self.test == "harm":
            return "control", primary
        if self.test == "net":
            return primary, "control"
        return self.first or primary, self.second or "control"

    def describe(self, primary: str) -> str:
        """The rule in a line: `rescue (assisted against control), alpha 0.05, both, 10 to 200 cases`."""
        first, second = self.arms(primary)
        bounds = (f"{self.minimum} to {self.maximum} cases" if self.maximum is not None
                  else f"at least {self.minimum} cases")
        goal = {"efficacy": "stop for efficacy", "futility": f"stop for futility (effect < {self.effect:g})",
                "both": f"stop for efficacy or futility (effect < {self.effect:g})"}[self.stop_for]
        return f"{self.test} ({first} against {second}), alpha {self.alpha:g}, {goal}, {bounds}"
