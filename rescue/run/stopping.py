"""A study's `[stopping]` rule at run time (DESIGN §20): the order its cases are claimed in, fixed at creation,
and the check after each finished case that stops claiming once the rule decides. The e-process and the decision
are pure (`rescue.core.figures.sequential`); the decision is kept in the journal, so a resume reaches the same one
and `rescue verify` derives it again."""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from rescue.core.configuration.config import StudyConfig
from rescue.core.figures.sequential import Decision, main_order, study_decision, study_order
from rescue.core.manifest import Case
from rescue.core.records import CaseRecord
from rescue.core.verdicts import Verdict
from rescue.study.folder import STOPPING_DECISION_KEY, STOPPING_ORDER_KEY, case_record
from rescue.study.journal import Journal

log = structlog.get_logger()


def order_meta(cases: Sequence[Case], config: StudyConfig) -> dict[str, list[str]]:
    """What a study with a rule stores at creation: the order its cases run in (pilot cases first)."""
    if config.stopping is None:
        return {}
    return {STOPPING_ORDER_KEY: study_order(cases, config.stopping.seed)}


class StopRule:
    """The study's rule, bound to its journal: claims in the fixed order, checks after each case."""

    def __init__(self, journal: Journal, config: StudyConfig):
        if config.stopping is None:
            raise ValueError("a study without a [stopping] rule has no stop rule")
        self.journal = journal
        self.config = config
        self.rule = config.stopping
        self.cases = {c.case_id: c for c in journal.cases()}
        order = journal.meta().get(STOPPING_ORDER_KEY)
        if not isinstance(order, list) or sorted(order) != sorted(self.cases):
            raise ValueError("the study's stopping order does not list its cases")
        self.order = list(order)
        self.main = main_order(self.order, list(self.cases.values()))
        # The main cases the rule lets run: the first `maximum` of the order.
        self.runs = self.main[: self.rule.maximum] if self.rule.maximum is not None else self.main
        self._judged: dict[str, tuple[CaseRecord, Verdict]] = {}

    def decided(self) -> dict | None:
        """The decision the journal keeps, if the rule stopped the study."""
        return self.journal.meta().get(STOPPING_DECISION_KEY)

    def claim(self, worker: str) -> Case | None:
        """The first pending case in the fixed order, claimed; None when none is left, the rule decided, or the
        declared maximum of main cases has been claimed."""
        if self.decided() is not None:
            return None
        pending = set(self.journal.pending_ids())
        started = sum(1 for case_id in self.main if case_id not in pending)
        for case_id in self.order:
            if case_id not in pending:
                continue
            if not self.cases[case_id].pilot and self.rule.maximum is not None and started >= self.rule.maximum:
                return None
            if self.journal.claim(case_id, worker):
                return self.journal.case(case_id)
            pending.discard(case_id)  # another worker took it: the next one
        return None

    def check(self) -> Decision | None:
        """Read the finished prefix of the order; when the rule decides (a boundary, or the maximum), keep the
        decision in the journal and return it."""
        if self.decided() is not None:
            return None
        verdicts = self.journal.verdicts()
        for case_id in self.runs:
            if case_id in self._judged:
                continue  # a case's verdict, once given, never changes: its record is read once
            verdict = verdicts.get(case_id)
            if verdict is None:
                break
            interrupted = self.journal.state(case_id) == "interrupted"
            rec = case_record(self.cases[case_id], self.journal.arms(case_id), {}, self.config, interrupted)
            self._judged[case_id] = (rec, verdict)
        decision = study_decision(self.rule, *self.rule.arms(self.config.primary_arm), self.main, self._judged)
        if decision.outcome == "undecided" or (decision.outcome == "maximum" and len(self.runs) == len(self.main)):
            return None  # not yet, or every case ran: nothing was stopped
        self.journal.set_meta(STOPPING_DECISION_KEY, decision.model_dump(mode="json"))
        log.info("study.decided", outcome=decision.outcome, at=decision.at, case_id=decision.case_id)
        return decision
