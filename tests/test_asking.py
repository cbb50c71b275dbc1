"""Declining, asking again and the comparison of the ways of asking (DESIGN §18), pure: a declined arm's label and
score, the evidence of every call of an arm that asks again, the duty cycle, the triggers' paired tests against
their placebos and the fixed query points (Holm across the family), the budget check and the best way per call."""

from __future__ import annotations

import pytest
from helpers.case_records import FP, ORIGINAL, injected

from rescue.core.asking import TriggerConfig
from rescue.core.classify import classify
from rescue.core.digest import digest_text
from rescue.core.figures.exact_stats import holm, mcnemar_exact
from rescue.core.figures.stats import summarize
from rescue.core.figures.success_sample import SamplingFrame
from rescue.core.records import ArmResult, Assistance, CaseRecord, Receipt
from rescue.core.trace import TraceRow

pytestmark = pytest.mark.fast

C, H, Q = 8, 64, 32
STALL = TriggerConfig(name="stall", kind="stall", window=2, distance=0.01)
PLACEBO = TriggerConfig(name="placebo", kind="random", matches="stall", rate=0.5)
TRIGGERS = {"assisted@stall": STALL, "assisted@placebo": PLACEBO}
EARLY = 16


def _rows(tag: str, start: int, end: int, instruction_at: dict[int, str]) -> list[TraceRow]:
    out, text = [], ORIGINAL
    for s in range(start, end, C):
        text = instruction_at.get(s, text)
        out.append(TraceRow(step=s, state=digest_text(f"{tag}-{s}"), images={}, instruction=digest_text(text),
                            actions=digest_text(f"{tag}-a-{s}")))
    return out


def _receipt(call: str, req: str, case_id: str, subgoal: str | None) -> Receipt:
    return Receipt(kind="outcome", call_id=call, attempt=1, request_ids=[req], tokens={req: "t"}, case_ids=[case_id],
                   model_requested="m", endpoint_kind="chat", prompt_template="p", prompt_template_sha256="0" * 64,
                   prompt_sha256="0" * 64, started_at=0.0, status="ok", subgoals={req: subgoal},
                   request_status={req: "ok" if subgoal else "declined"})


def build(case_id: str, outcome: str, control_ok: bool, arms: dict[str, tuple]) -> CaseRecord:
    """A forked case: `arms` maps an arm to (its calls' steps, each call applied or declined, its success); no
    steps: a trigger that never fired."""
    states = {s: digest_text(f"{case_id}-state-{s}") for s in range(0, H, C)}
    control = ArmResult(case_id=case_id, arm="control", status="complete", success=control_ok, steps=H,
                        fingerprint=FP, trace=_rows(f"{case_id}-control", 0, H, {}), mode="fork",
                        assistance=Assistance(status="control"), q_state=states[Q],
                        fork_states={s: states[s] for s in range(0, H, C) if s != Q})
    records, receipts, again_receipts = {"control": control}, {}, {}
    steps_of, unasked, again_steps = {}, [], {}
    for arm, (steps, statuses, ok) in arms.items():
        if not steps:
            records[arm] = control.model_copy(update={"arm": arm, "assistance": Assistance(status="not_asked"),
                                                      "fork_states": {}, "q_state": None})
            unasked.append(arm)
            steps_of[arm] = H
            continue
        calls, switches = [], {}
        for i, (step, status) in enumerate(zip(steps, statuses)):
            call, req = f"{case_id}-{arm}-{i}", f"r-{case_id}-{arm}-{i}"
            subgoal = f"grasp it {i}" if status == "applied" else None
            text = injected(ORIGINAL, subgoal) if subgoal else None
            if text:
                switches[step] = text
            calls.append(Assistance(status=status, query_step=step, subgoal=subgoal, instruction=text,
                                    instruction_digest=digest_text(text) if text else None, call_id=call,
                                    request_id=req))
            (receipts if i == 0 else again_receipts)[arm if i == 0 else call] = _receipt(call, req, case_id, subgoal)
        first = steps[0]
        records[arm] = ArmResult(case_id=case_id, arm=arm, status="complete", success=ok, steps=H, fingerprint=FP,
                                 mode="fork", q_state=states[first], assistance=calls[0], again=calls[1:],
                                 trace=[r for r in control.trace if r.step < first]
                                 + _rows(f"{case_id}-{arm}", first, H, switches))
        if arm != "assisted":
            steps_of[arm] = first
        if steps[1:]:
            again_steps[arm] = list(steps[1:])
    return CaseRecord(case_id=case_id, group="g", task="libero_object/0", horizon=H, query_step=Q,
                      historical_fingerprint=FP, historical_outcome=outcome, arms=records, receipts=receipts,
                      query_steps=steps_of, unasked=unasked, again_steps=again_steps, again_receipts=again_receipts,
                      declining=True, triggers=TRIGGERS, max_calls=2)


def test_a_declined_arm_is_labelled_apart_on_failures_and_successes():
    for outcome, control_ok in (("failure", False), ("success", True)):
        rec = build("d", outcome, control_ok, {"assisted": ([Q], ["declined"], not control_ok)})
        v = classify(rec)
        assert (v.label, v.rule, v.in_m, v.in_e) == ("declined", 4, True, False), v.reason
        assert "kept the instruction" in v.reason
    # Declined first, applied at its second call: judged as any applied arm.
    rec = build("d2", "failure", False, {"assisted": ([Q, Q + 2 * C], ["declined", "applied"], True)})
    assert classify(rec).label == "rescued"


def test_every_call_of_an_arm_that_asks_again_is_evidence_checked_at_its_own_step():
    rec = build("a", "failure", False, {"assisted": ([Q, Q + 2 * C], ["applied", "applied"], True)})
    assert classify(rec).label == "rescued"
    # Its second call where the study's rule does not put it, or its receipt another subgoal's, or its rows not
    # carrying it: the evidence fails (rule 6).
    moved = rec.model_copy(update={"again_steps": {"assisted": [Q + 3 * C]}})
    assert (classify(moved).rule, "the study's rules give" in classify(moved).reason) == (6, True)
    second = rec.arms["assisted"].again[0].call_id
    other = rec.again_receipts[second].model_copy(update={"subgoals": {f"r-a-assisted-1": "another subgoal"}})
    forged = rec.model_copy(update={"again_receipts": {second: other}})
    assert classify(forged).rule == 6 and "call 2" in classify(forged).reason
    arm = rec.arms["assisted"].model_copy(deep=True)
    arm.trace = [r.model_copy(update={"instruction": arm.trace[2].instruction}) if r.step == Q + 2 * C else r
                 for r in arm.trace]
    assert classify(rec.model_copy(update={"arms": {**rec.arms, "assisted": arm}})).rule == 6
    # A later call that failed makes the arm unknown (rule 3), as a failed first call does.
    failed = rec.arms["assisted"].model_copy(deep=True)
    failed.again[0] = Assistance(status="timeout", query_step=Q + 2 * C, error_kind="timeout")
    v = classify(rec.model_copy(update={"arms": {**rec.arms, "assisted": failed}}))
    assert (v.label, v.rule) == ("unknown", 3) and "call 2" in v.reason


def _cohort():
    """12 failures and 8 successes: the stall trigger asks the stuck failures and rescues them, its placebo asks at
    random, the fixed early point asks everything (and breaks successes), the pre-registered q reaches few."""
    cases = []
    for i in range(12):
        stuck = i < 8
        cases.append(build(f"f{i}", "failure", False, {
            "assisted": ([Q], ["applied"], i < 5),
            "assisted@early": ([EARLY], ["applied"], i < 6),
            "assisted@stall": ([24] if stuck else [], ["applied"], stuck and i < 7),
            "assisted@placebo": ([40] if i % 2 == 0 else [], ["applied"], i in (0, 2)),
        }))
    for i in range(8):
        cases.append(build(f"s{i}", "success", True, {
            "assisted": ([Q], ["declined" if i < 2 else "applied"], True),
            "assisted@early": ([EARLY], ["applied"], i >= 6),
            "assisted@stall": ([], ["applied"], True),
            "assisted@placebo": ([40] if i % 2 == 0 else [], ["applied"], True),
        }))
    return cases


def test_the_ways_of_asking_are_compared_per_call_with_the_triggers_tested_against_placebo_and_fixed_points():
    records = _cohort()
    verdicts = [classify(r) for r in records]
    frame = SamplingFrame(failures=12, successes=8)
    s = summarize(records, verdicts, frame=frame)
    a = s.asking
    assert [w.arm for w in a.ways] == ["assisted", "assisted@early", "assisted@stall", "assisted@placebo"]
    assert [w.kind for w in a.ways] == ["fixed", "fixed", "trigger", "placebo"]
    stall, early, placebo, primary = a.way("assisted@stall"), a.way("assisted@early"), a.way("assisted@placebo"), a.way("assisted")
    # Duty cycle, failures and successes apart.
    assert (stall.failures.asked, stall.failures.calls, stall.successes.asked) == (8, 8, 0)
    assert stall.failures.share_asked == pytest.approx(8 / 12) and stall.successes.calls_per_episode == 0
    assert (placebo.failures.asked, placebo.successes.asked) == (6, 4)
    assert early.calls_per_episode == pytest.approx(1.0)
    assert stall.calls_per_episode == pytest.approx((12 * 8 / 12 + 8 * 0) / 20)
    # Declines: the primary's advisor kept the instruction on two successes; among applied answers it harmed none.
    assert (primary.successes.declined, primary.successes.decline_rate) == (2, pytest.approx(2 / 8))
    assert primary.failures.declined == 0 and primary.applied_harm.k == 6 and primary.applied_harm.diff == 0
    assert s.harm.of("assisted").counts["declined"] == 2 and s.counts["declined"] == 0
    # Rescue and harm, and the net change: the trigger rescued 7 of 12 failures and broke nothing; the early point
    # rescued 6 and broke 6 of 8 successes.
    assert stall.rescue.diff == pytest.approx(7 / 12) and stall.harm.diff is None and stall.net.change == pytest.approx(7 / 20)
    assert early.net.change == pytest.approx((6 - 6) / 20)
    assert stall.change_per_call == pytest.approx((7 / 20) / (8 / 20))
    # The family: the trigger against its placebo and against each fixed point, over the episodes where both are in M.
    pairs = {(c.first, c.second): c for c in a.comparisons}
    assert list(pairs) == [("assisted@stall", "assisted@placebo"), ("assisted@stall", "assisted"),
                           ("assisted@stall", "assisted@early")]
    vp = pairs[("assisted@stall", "assisted@placebo")]
    assert (vp.pairs.first_only, vp.pairs.second_only, vp.k) == (5, 0, 20)
    raw = [c.mcnemar_p for c in a.comparisons]
    assert raw[0] == pytest.approx(mcnemar_exact(5, 0))
    assert [c.holm_p for c in a.comparisons] == pytest.approx(holm(raw))
    # The placebo asked 10 of 20 episodes, the trigger 8: within the tolerance of a matched budget.
    assert a.budgets[0].placebo_calls == pytest.approx(10 / 20) and a.budgets[0].matched
    assert a.best == "assisted@stall" and a.reading.startswith("Per call, the trigger stall changes the benchmark most")
    assert "against the placebo placebo at a matched budget: 5 only it, 0 only the placebo" in a.reading
    assert a.best_beats_chance is (vp.holm_p < 0.05)


def test_a_failures_only_study_ranks_by_rescue_per_call_and_a_study_without_triggers_has_no_asking_section():
    records = [r for r in _cohort() if r.historical_outcome == "failure"]
    s = summarize(records, [classify(r) for r in records])
    a = s.asking
    assert a.way("assisted@stall").net is None and a.way("assisted@stall").successes is None
    assert a.way("assisted@stall").change_per_call == pytest.approx((7 / 12) / (8 / 12))
    assert "rescue among the failures" in a.reading
    plain = [r.model_copy(update={"declining": False, "triggers": {}, "max_calls": 1,
                                  "arms": {k: v for k, v in r.arms.items() if k in ("control", "assisted")}})
             for r in records]
    assert summarize(plain, [classify(r) for r in plain]).asking is None


def test_a_fixed_point_that_wins_per_call_without_a_sham_is_not_said_to_beat_chance():
    """The best way is a fixed point and no sham asks beside it: nothing tests it against chance, and the reading
    says why (not that a placebo is missing: placebos match triggers)."""
    records = [r.model_copy(update={"triggers": {}, "arms": {k: v for k, v in r.arms.items()
                                                             if k in ("control", "assisted", "assisted@early")}})
               for r in _cohort()]
    s = summarize(records, [classify(r) for r in records], frame=SamplingFrame(failures=12, successes=8))
    a = s.asking
    assert a is not None and [w.kind for w in a.ways] == ["fixed", "fixed"]
    assert a.best in ("assisted", "assisted@early") and a.best_beats_chance is None
    assert a.reading.endswith("the study has no sham arm to compare it with, so whether it beats chance is not tested.")
