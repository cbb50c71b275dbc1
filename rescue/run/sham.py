"""Where a running study's sham arms get their subgoals (DESIGN §8): a declared fixed text, or the answer a
donor case's VLM call gave, as it arrives in this process or as the donor's recorded arm holds it.

No retry and no substitute: a donor whose call failed, was interrupted or never ran makes the sham arm's
answer fail, and the case's sham verdict unknown (rule 3).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from rescue.core.sham import ShamConfig
from rescue.core.digest import digest_text
from rescue.core.manifest import Case
from rescue.core.records import Answer
from rescue.run.arm import Advisor
from rescue.study.journal import Journal


class ShamSource:
    """The sham arms' advisor: it answers a case at q from the study's declared source."""

    def __init__(self, config: ShamConfig, donors: dict[str, str], journal: Journal, donor_arm: str,
                 stopping: Callable[[], bool]):
        self.config, self.donors, self.journal, self.donor_arm = config, donors, journal, donor_arm
        self._stopping = stopping
        # The donor advisor's answers given in this process, by case, and an event per case its waiters wait on.
        self._answers: dict[str, Answer] = {}
        self._events: dict[str, asyncio.Event] = {}

    def heard(self, case_id: str, answer: Answer) -> None:
        """The donor advisor answered `case_id`: wake any sham arm waiting for that case's answer (its first: a later
        call of the donor's arm, DESIGN §18, lends nothing)."""
        self._answers.setdefault(case_id, answer)
        self._events.setdefault(case_id, asyncio.Event()).set()

    def advisor(self, case: Case) -> Advisor:
        """Who answers the sham arm of one case."""
        text = self.config.text_for(case.task)

        async def ask(case_id: str, instruction: str, remaining: int, views: dict) -> Answer:
            if self.config.source == "fixed":
                return Answer(status="ok", subgoal=text, source="fixed", source_sha256=digest_text(text))
            donor = self.donors.get(case_id)
            if donor is None:
                return Answer(status="broker_error", source="permuted", error_kind="no_donor",
                              error="no donor declared for the case")
            return await self.donor_answer(donor)

        return ask

    async def donor_answer(self, donor: str) -> Answer:
        """The donor's VLM answer, as a permuted sham applies it: as it arrives in this process, else from the
        donor's recorded arm once its case has ended."""
        event = self._events.setdefault(donor, asyncio.Event())
        while True:
            heard = self._answers.get(donor)
            if heard is not None:
                if heard.status == "declined":
                    # The donor's advisor kept the instruction: the sham has nothing to apply, and declines too.
                    return Answer(status="declined", source="permuted", donor_case_id=donor, call_id=heard.call_id,
                                  request_id=heard.request_id, receipt_ref=heard.receipt_ref)
                if heard.status != "ok":
                    return _failed(donor, "donor_failed", f"donor {donor}'s VLM call ended {heard.status} ({heard.error_kind})")
                return Answer(status="ok", subgoal=heard.subgoal, source="permuted", donor_case_id=donor,
                              call_id=heard.call_id, request_id=heard.request_id, receipt_ref=heard.receipt_ref)
            state = self.journal.state(donor)
            if state in ("finished", "interrupted"):
                arm = self.journal.arms(donor).get(self.donor_arm)
                a = arm.assistance if arm is not None else None
                if a is not None and a.status == "declined":
                    return Answer(status="declined", source="permuted", donor_case_id=donor, call_id=a.call_id,
                                  request_id=a.request_id, receipt_ref=a.receipt_ref)
                if a is None or a.status != "applied":
                    why = "was interrupted" if a is None else f"had assistance {a.status}"
                    return _failed(donor, "donor_failed", f"donor {donor} {why}")
                return Answer(status="ok", subgoal=a.subgoal, source="permuted", donor_case_id=donor,
                              call_id=a.call_id, request_id=a.request_id, receipt_ref=a.receipt_ref)
            if state == "pending" and self._stopping():
                return _failed(donor, "donor_never_ran", f"donor {donor} never ran: the study stopped claiming")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), 1.0)


def _failed(donor: str, kind: str, error: str) -> Answer:
    return Answer(status="broker_error", source="permuted", donor_case_id=donor, error_kind=kind, error=error)
