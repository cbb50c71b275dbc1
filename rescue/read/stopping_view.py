"""A study's `[stopping]` rule as the read side shows it (DESIGN §20): the rule, the decision the journal keeps
(or that the finished cases give so far), "stopped at n of N by rule R" in words, and the decision derived again
for `rescue verify`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from rescue.core.configuration.stopping import StoppingConfig
from rescue.core.figures.sequential import Decision, main_order, study_decision, study_order
from rescue.core.verdicts import Verdict
from rescue.study.folder import SUMMARIZED_STATES, STOPPING_DECISION_KEY, STOPPING_ORDER_KEY, StudyRecords

METHOD = ("e-processes of betting on the paired scores in the order fixed at creation (a fixed mixture of bets; "
          "Ville's inequality), the interval a confidence sequence valid at the stop")


class StopReport(BaseModel):
    """The rule and where it stopped (DESIGN §20)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    rule: StoppingConfig
    """The declared rule."""
    described: str
    """The rule in a line."""
    first: str
    """Whose successes count for the effect."""
    second: str
    """Against whose."""
    decision: Decision
    """The decision the journal keeps when the rule stopped the study; else the one the cases with a verdict give
    so far (outcome `undecided`, or `maximum` once every case the rule lets run has run)."""
    stopped: bool
    """Whether the rule stopped the study (its decision is kept in the journal)."""
    main: int
    """N: the main cohort's cases."""
    ran: int
    """Of them, the cases that ran (with a verdict or in flight): the decision's and those started before it."""
    method: str = METHOD
    """How the decision and its interval were computed, in a line."""


def _records(records: StudyRecords, verdicts: dict[str, Verdict]) -> dict:
    return {c.case_id: (records.record(c), verdicts[c.case_id]) for c in records.cases
            if not c.pilot and records.states[c.case_id] in SUMMARIZED_STATES and c.case_id in verdicts}


def derived_decision(records: StudyRecords, verdicts: dict[str, Verdict] | None = None) -> Decision | None:
    """The rule's decision over the study's cases with a verdict (stored ones by default); None without a rule."""
    rule = records.config.stopping
    if rule is None:
        return None
    verdicts = records.verdicts if verdicts is None else verdicts
    main = main_order(study_order(records.cases, rule.seed), records.cases)
    return study_decision(rule, *rule.arms(records.config.primary_arm), main, _records(records, verdicts))


def stop_report(records: StudyRecords) -> StopReport | None:
    """The rule's report, or None for a study without one."""
    rule = records.config.stopping
    if rule is None:
        return None
    kept = records.meta.get(STOPPING_DECISION_KEY)
    decision = Decision.model_validate(kept) if kept is not None else derived_decision(records)
    main = [c for c in records.cases if not c.pilot]
    ran = sum(1 for c in main if records.states[c.case_id] != "pending")
    first, second = rule.arms(records.config.primary_arm)
    return StopReport(rule=rule, described=rule.describe(records.config.primary_arm), first=first, second=second,
                      decision=decision, stopped=kept is not None, main=len(main), ran=ran)


def stop_sentence(report: StopReport) -> str:
    """"stopped at n of N by rule R: ..." (or where the rule stands), in words."""
    d = report.decision
    ci = "" if d.interval is None else f" [{100 * d.interval[0]:+.1f}, {100 * d.interval[1]:+.1f}] pp"
    effect = "n/a" if d.mean is None else f"{100 * d.mean:+.1f} pp{ci}"
    what = f"{report.first} against {report.second}"
    if report.stopped:
        why = {"efficacy": f"the effect of {what} is above zero",
               "futility": f"an effect of {what} of {100 * report.rule.effect:.0f} points or more is ruled out",
               "maximum": "the declared maximum of cases ran without a decision"}.get(d.outcome, d.outcome)
        return (f"stopped at {d.at} of {report.main} by rule {report.described}: {why} ({effect}, a confidence "
                f"sequence valid at this stop); {report.ran - d.at} more case(s) started before the decision ran and "
                f"count; {report.main - report.ran} were never run. The other figures are fixed-n descriptions of the "
                f"{report.ran} cases that ran")
    if d.outcome == "maximum":
        return f"rule {report.described}: every case ran without a decision ({effect}, {d.at} scored cases)"
    return f"rule {report.described}: undecided after {d.at} scored case(s) so far ({effect})"


def order_problem(records: StudyRecords) -> str | None:
    """Why the order the journal keeps is not the one the rule's seed gives, in a line; None: it is."""
    rule = records.config.stopping
    if rule is None:
        return None
    kept = records.meta.get(STOPPING_ORDER_KEY)
    if kept != study_order(records.cases, rule.seed):
        return f"the journal's case order is not the one the rule's seed {rule.seed} fixes at creation"
    return None
