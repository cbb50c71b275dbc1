"""What a live view hears from a running study: `RunObserver`, whose methods the engine calls.

A live view (`rescue.run.progress.LiveProgress`) subclasses it and overrides what it shows; it need not
import the engine.
"""

from __future__ import annotations

from typing import Callable

from rescue.core.verdicts import Verdict


class RunObserver:
    """What a live view hears from a running study; every method is optional to override."""

    def study_started(self, pending: int, arms_per_case: int, steps: int | None = None) -> None:
        """The run begins with `pending` never-claimed cases of `arms_per_case` arms each, at most `steps`
        env steps in all (their horizons times the arms)."""

    def arm_started(self, arm: str) -> None:
        """An arm took its simulator and policy connection."""

    def arm_finished(self, arm: str) -> None:
        """An arm ended (any status)."""

    def vlm_waiting(self, delta: int) -> None:
        """An assisted arm began (+1) or ended (-1) waiting for the VLM."""

    def steps_done(self, steps: int) -> None:
        """An arm stepped its simulator `steps` env steps (a chunk)."""

    def case_finished(self, verdict: Verdict) -> None:
        """A case got its verdict."""

    def stopping(self, message: str) -> None:
        """A signal changed how the run ends (one line to tell the person who sent it)."""


class _CallbackObserver(RunObserver):
    """An observer that hears only the verdicts, through one callback."""

    def __init__(self, on_case: Callable[[Verdict], None]):
        self._on_case = on_case

    def case_finished(self, verdict: Verdict) -> None:
        self._on_case(verdict)


def as_observer(on_case: RunObserver | Callable[[Verdict], None] | None) -> RunObserver:
    """A RunObserver from an observer, a per-case callback, or nothing."""
    if isinstance(on_case, RunObserver):
        return on_case
    return _CallbackObserver(on_case) if on_case is not None else RunObserver()
