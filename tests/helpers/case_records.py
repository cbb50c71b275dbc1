"""Case records built from arms, traces and receipts as the engine records them: a valid pair, the ways to break one
(each aimed at one classification rule), and the seed's cohort of 1,004 cases."""

from __future__ import annotations

from collections import Counter

import numpy as np

from rescue.core.digest import digest_text
from rescue.core.querypoint import query_point
from rescue.core.records import ArmResult, Assistance, CaseRecord, Receipt
from rescue.core.trace import TraceRow


H, C = 220, 16
Q = query_point(H, C)
FP = digest_text("initial state of the case")
ORIGINAL = "pick up the black bowl and place it on the plate"
SUBGOAL = "Move the gripper above the bowl rim and close it."


def injected(original: str, subgoal: str) -> str:
    return original + "\nImmediate next actions: " + subgoal.strip() + "\nThen complete the original task."


def make_trace(arm: str, *, applied: str | None = None, end: int = H) -> list[TraceRow]:
    """One row per query; rows before Q are arm-independent, rows from Q on are not."""
    rows = []
    for step in range(0, end, C):
        before = step < Q
        tag = "shared" if before else arm
        instruction = ORIGINAL if before or applied is None else applied
        rows.append(
            TraceRow(
                step=step,
                state=digest_text(f"{tag}-state-{step}"),
                images={"agentview": digest_text(f"{tag}-image-{step}")},
                instruction=digest_text(instruction),
                actions=digest_text(f"{tag}-actions-{step}"),
            )
        )
    return rows


def make_case(
    case_id: str,
    *,
    group: str = "g",
    task: str = "t",
    control_success: bool = False,
    assisted_success: bool = False,
    pilot: bool = False,
) -> CaseRecord:
    """A complete, valid pair: same initial state, same prefix, a receipt tying the subgoal."""
    instruction = injected(ORIGINAL, SUBGOAL)
    call_id, request_id = f"call-{case_id}", f"req-{case_id}"
    control = ArmResult(
        case_id=case_id,
        arm="control",
        status="complete",
        success=control_success,
        steps=H,
        fingerprint=FP,
        trace=make_trace("control"),
        assistance=Assistance(status="control"),
    )
    assisted = ArmResult(
        case_id=case_id,
        arm="assisted",
        status="complete",
        success=assisted_success,
        steps=H,
        fingerprint=FP,
        trace=make_trace("assisted", applied=instruction),
        assistance=Assistance(
            status="applied",
            query_step=Q,
            subgoal=SUBGOAL,
            instruction=instruction,
            instruction_digest=digest_text(instruction),
            call_id=call_id,
            request_id=request_id,
        ),
    )
    receipt = Receipt(
        kind="outcome",
        call_id=call_id,
        attempt=1,
        request_ids=[request_id],
        tokens={request_id: "tok"},
        case_ids=[case_id],
        model_requested="vlm",
        model_reported="vlm",
        endpoint_kind="chat",
        prompt_template="subgoal",
        prompt_template_sha256=digest_text("template"),
        prompt_sha256=digest_text("prompt"),
        started_at=0.0,
        finished_at=1.0,
        latency_s=1.0,
        status="ok",
        response_sha256=digest_text("response"),
        subgoals={request_id: SUBGOAL},
    )
    return CaseRecord(
        case_id=case_id,
        group=group,
        task=task,
        horizon=H,
        query_step=Q,
        historical_fingerprint=FP,
        pilot=pilot,
        arms={"control": control, "assisted": assisted},
        receipts={"assisted": receipt},
    )


def with_arms(rec: CaseRecord, arms: dict | None = None, receipts: dict | None = None, **fields) -> CaseRecord:
    """A copy of a case record with arms and receipts (by arm name) replaced or added, and other fields changed."""
    return rec.model_copy(update={"arms": {**rec.arms, **(arms or {})}, "receipts": {**rec.receipts, **(receipts or {})},
                                  **fields})


def sham_of(summary, primary: str = "assisted"):
    """A summary's (or a group's) sham figures and the primary-vs-sham comparison."""
    figures = next(a for a in summary.arms if a.arm == "sham")
    versus = next(c for c in summary.comparisons if (c.first, c.second) == (primary, "sham"))
    return figures, versus


def replace_row(arm: ArmResult, step: int, **changes) -> None:
    arm.trace = [r.model_copy(update=changes) if r.step == step else r for r in arm.trace]


# Ways to break a record, each aimed at one rule. Each mutates the record in place.


def dev_assisted(rec):
    rec.assisted.fingerprint = digest_text("other state")


def dev_control(rec):
    rec.control.fingerprint = digest_text("other state")


def dev_no_history(rec):
    rec.historical_fingerprint = None
    rec.assisted.fingerprint = digest_text("other state")


def dev_and_interrupted(rec):
    dev_assisted(rec)
    rec.interrupted = True
    rec.assisted.status = "interrupted"


def dev_and_missing(rec):
    dev_control(rec)
    rec.assisted = None


def missing_control(rec):
    rec.control = None


def assisted_interrupted(rec):
    rec.assisted.status = "interrupted"
    rec.assisted.success = None


def case_interrupted(rec):
    rec.interrupted = True


def control_error(rec):
    rec.control.status = "error"
    rec.control.error = "policy connection lost"


def timeout_and_diverged(rec):
    # The VLM timed out; the arm's trace also diverged, so the pair is outside M.
    rec.assisted.assistance = Assistance(status="timeout", error_kind="ReadTimeout")
    replace_row(rec.assisted, 0, actions=digest_text("different"))


def prefix_row_differs(rec):
    replace_row(rec.assisted, Q - C, state=digest_text("different"))


def prefix_rows_missing(rec):
    rec.assisted.trace = [r for r in rec.assisted.trace if r.step != C]


def evidence_no_receipt(rec):
    rec.receipt = None


def evidence_wrong_call(rec):
    rec.assisted.assistance.call_id = "call-someone-else"


def evidence_wrong_subgoal(rec):
    rec.receipt.subgoals[rec.assisted.assistance.request_id] = "Open the drawer."


def evidence_row_not_applied(rec):
    replace_row(rec.assisted, Q, instruction=digest_text(ORIGINAL))


def evidence_other_case(rec):
    rec.receipt.case_ids = ["another-case"]


DEVIATIONS = [dev_assisted, dev_control, dev_no_history, dev_and_interrupted, dev_and_missing]
OTHER_UNKNOWNS = [
    missing_control,
    assisted_interrupted,
    case_interrupted,
    control_error,
    timeout_and_diverged,
    prefix_row_differs,
    prefix_rows_missing,
]
EVIDENCE_BREAKS = [
    evidence_no_receipt,
    evidence_wrong_call,
    evidence_wrong_subgoal,
    evidence_row_not_applied,
    evidence_other_case,
]

# The seed's cohort (DESIGN §3): per group, cases by how they were built.
SEED_PLAN = {
    "Atomic-Seen": {"rescued": 12, "both_fail": 125, "evidence": 0, "other_unknown": 0, "deviation": 16},
    "Composite-Seen": {"rescued": 25, "both_fail": 218, "evidence": 2, "other_unknown": 6, "deviation": 70},
    "Composite-Unseen": {"rescued": 19, "both_fail": 470, "evidence": 3, "other_unknown": 17, "deviation": 21},
}
EXPECTED_LABEL = {
    "rescued": "rescued",
    "both_fail": "not_rescued",
    "evidence": "unknown",
    "other_unknown": "unknown",
    "deviation": "initial_state_deviation",
}


def build_seed_cohort() -> tuple[list[CaseRecord], dict[str, str]]:
    """The seed's 1,004 cases built from arms, traces and receipts, plus their planned kind."""
    records, kinds = [], {}
    counter = Counter()
    for group, plan in SEED_PLAN.items():
        for kind, count in plan.items():
            for i in range(count):
                case_id = f"{group}-{kind}-{i}"
                task = f"{group}/task{counter[group] % 7}"
                counter[group] += 1
                rec = make_case(case_id, group=group, task=task, assisted_success=kind == "rescued")
                if kind == "deviation":
                    DEVIATIONS[i % len(DEVIATIONS)](rec)
                elif kind == "other_unknown":
                    OTHER_UNKNOWNS[i % len(OTHER_UNKNOWNS)](rec)
                elif kind == "evidence":
                    EVIDENCE_BREAKS[i % len(EVIDENCE_BREAKS)](rec)
                records.append(rec)
                kinds[case_id] = kind
    # Manifest order should not matter.
    order = np.random.default_rng(7).permutation(len(records))
    return [records[i] for i in order], kinds
