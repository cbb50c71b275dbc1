"""Proofs that a pair of arms is comparable and the assistance is real (DESIGN §2).

Each check returns (ok, reason) so a verdict can say why a case failed it.
"""

from __future__ import annotations

from collections.abc import Sequence

from rescue.core.arms import base_arm
from rescue.core.digest import digest_text
from rescue.core.records import ArmResult, Assistance, CaseRecord, Receipt
from rescue.core.trace import TraceRow


def trace_is_regular(trace: Sequence[TraceRow], interval: int) -> bool:
    """True when the trace's steps are exactly 0, C, 2C, ... with none missing."""
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval}")
    # Every arm queries the policy at step 0, so an empty trace is not regular.
    if not trace:
        return False
    return all(row.step == i * interval for i, row in enumerate(trace))


def _changed_fields(a: TraceRow, b: TraceRow) -> list[str]:
    return [name for name in TraceRow.model_fields if getattr(a, name) != getattr(b, name)]


def prefix_match(
    control_trace: Sequence[TraceRow], assisted_trace: Sequence[TraceRow], q: int
) -> tuple[bool, str]:
    """Whether the arms' trace rows before step q are equal, in order, and at least one."""
    control = [row for row in control_trace if row.step < q]
    assisted = [row for row in assisted_trace if row.step < q]
    if len(control) != len(assisted):
        return False, (
            f"prefix length differs before step {q}: "
            f"control {len(control)} rows, assisted {len(assisted)}"
        )
    if not control:
        # An empty prefix proves nothing about the two arms being the same run.
        return False, f"no trace rows before step {q}"
    for c_row, a_row in zip(control, assisted):
        if c_row != a_row:
            fields = ", ".join(_changed_fields(c_row, a_row))
            return False, (
                f"prefix differs at control step {c_row.step} / assisted step {a_row.step}"
                f" ({fields})"
            )
    return True, f"{len(control)} rows before step {q} match"


def q_state_match(control: ArmResult, assisted: ArmResult, prefix_why: str, q: int | None = None) -> tuple[bool, str]:
    """Whether both arms stood in one simulator state at q (the digest of its full state).

    In fork mode the prefix is shared by construction and this is its proof; in
    independent mode it backs the trace prefix. Only an adapter that records no
    state digest at all (both missing, independent mode) leaves the trace alone as the proof.
    `q`: a declared extra query point's step (DESIGN §14), where the leader's state and render are its
    `fork_states` and `fork_renders`; None: the case's q.
    """
    if q is not None and q in control.fork_states:
        control = control.model_copy(update={"q_state": control.fork_states[q], "q_render": control.fork_renders.get(q)})
    if control.mode != assisted.mode:
        return False, f"arms ran in different modes ({control.mode}, {assisted.mode})"
    if assisted.assistance.status in ("not_reached", "not_asked"):
        return True, prefix_why
    if assisted.restored_render is not None and assisted.restored_render != assisted.q_render:
        return False, "after the VLM wait the restored simulator rendered other views than at q"
    if control.mode == "fork":
        if control.q_state is None or control.q_state != assisted.q_state:
            return False, "fork: the arms' simulator states at q differ or are missing"
        # The leader's render of the state at q is the follower's first render after its restore
        # (recorded since renders were proved; a study made before then has neither).
        if control.q_render is not None and control.q_render != assisted.q_render:
            return False, "fork: the follower's first render at q differs from the leader's"
        return True, f"fork: shared prefix, one simulator state at q ({prefix_why})"
    if control.q_state is None and assisted.q_state is None:
        return True, prefix_why
    if control.q_state != assisted.q_state:
        return False, "the arms' simulator states at q differ (or one is missing) although their traces match"
    return True, f"{prefix_why}; one simulator state at q"


def _receipt_problem(a: Assistance, r: Receipt | None, names: str) -> str | None:
    """Why an applied subgoal is not the answer a valid outcome receipt gave the request (None: it is)."""
    if r is None:
        return "no receipt"
    if r.kind != "outcome":
        return f"receipt kind is {r.kind!r}, not 'outcome'"
    if r.status != "ok":
        return f"receipt status is {r.status!r}"
    if names not in r.case_ids:
        return f"receipt does not name case {names!r}"
    if a.call_id != r.call_id:
        return f"assistance call id {a.call_id!r} != receipt call id {r.call_id!r}"
    if a.request_id is None or a.request_id not in r.request_ids:
        return f"request id {a.request_id!r} not in the receipt"
    # A batched call can be ok overall while rejecting this one request.
    if a.request_id in getattr(r, "request_errors", {}):
        return f"receipt rejected request {a.request_id!r}: {r.request_errors[a.request_id]}"
    if r.subgoals.get(a.request_id) != a.subgoal:
        return "applied subgoal differs from the receipt's subgoal for this request"
    return None


def _advisor_problem(r: Receipt | None, advisor: str | None) -> str | None:
    """Why a receipt is not a call of this advisor (DESIGN §11: an arm's evidence is its own advisor's call)."""
    if r is not None and r.advisor != advisor:
        def whose(name: str | None) -> str:
            return f"of advisor {name!r}" if name is not None else "naming no advisor"

        return f"the receipt is a call {whose(r.advisor)}, not {whose(advisor)}"
    return None


def _applied_problem(arm: ArmResult, a: Assistance, q: int) -> str | None:
    """Why one applied call's instruction is not what the arm queried with at its step q (None: it is)."""
    if a.query_step != q:
        return f"assistance at step {a.query_step}, query point is {q}"
    if a.instruction is None or a.instruction_digest is None:
        return "applied instruction or its digest is missing"
    if digest_text(a.instruction) != a.instruction_digest:
        return "applied instruction does not hash to its recorded digest"
    if a.subgoal is None or a.subgoal.strip() not in a.instruction:
        return "applied instruction does not carry the subgoal"
    rows = [row for row in arm.trace if row.step == q]
    if len(rows) != 1:
        return f"{len(rows)} {arm.arm} trace rows at step {q}, expected 1"
    if rows[0].instruction != a.instruction_digest:
        return f"trace row at step {q} was not queried with the applied instruction"
    return None


def call_steps_problem(rec: CaseRecord, arm: ArmResult) -> str | None:
    """Why the steps an arm asked at are not those its study's rules give on the records (its q, then each later
    call's: DESIGN §18), or None."""
    name = base_arm(arm.arm)
    expected = [rec.q_of(name), *rec.again_steps.get(name, [])]
    asked = [c.query_step for c in arm.calls()]
    if asked != expected:
        return f"asked at steps {asked}, the study's rules give {expected} on the recorded queries"
    return None


def check_evidence(rec: CaseRecord, name: str | None = None, advisor: str | None = None) -> tuple[bool, str]:
    """Whether an assisted arm's (the primary by default) applied subgoals are each tied to a valid receipt of its
    own advisor's call (`advisor`: None for a study of one `[vlm]`), asked at the steps the study's rules give, and
    to its trace."""
    name = name or rec.primary
    arm = rec.arms.get(name)
    if arm is None:
        return False, "no assisted arm"
    calls = arm.calls()
    applied = [c for c in calls if c.status == "applied"]
    if not applied:
        return False, f"assistance status is {arm.assistance.status!r}, not 'applied'"
    # One call: its step is checked with its instruction below (the reasons read as they always have).
    problem = call_steps_problem(rec, arm) if len(calls) > 1 or rec.again_steps.get(base_arm(name)) else None
    if problem is not None:
        return False, problem
    for i, a in enumerate(calls):
        if a.status != "applied":
            continue
        if a.subgoal is None or not a.subgoal.strip():
            return False, "applied subgoal is empty"
        receipt = rec.receipts.get(name) if i == 0 else rec.again_receipts.get(a.call_id or "")
        problem = (_receipt_problem(a, receipt, rec.case_id) or _advisor_problem(receipt, advisor)
                   or _applied_problem(arm, a, a.query_step if i else rec.q_of(name)))
        if problem is not None:
            return False, problem if i == 0 else f"call {i + 1}: {problem}"
    if len(applied) == 1:
        return True, f"receipt {applied[0].call_id}/{applied[0].request_id} applied at step {applied[0].query_step}"
    return True, "receipts " + ", ".join(f"{a.call_id}/{a.request_id} applied at step {a.query_step}" for a in applied)


def check_sham_evidence(rec: CaseRecord, name: str = "sham") -> tuple[bool, str]:
    """Whether the sham arm applied what it was declared to: the fixed text, or its declared donor's answer as
    the donor's outcome receipt (the sham's receipt) holds it."""
    arm = rec.arms.get(name)
    if arm is None:
        return False, "no sham arm"
    a = arm.assistance
    if a.status != "applied":
        return False, f"sham subgoal status is {a.status!r}, not 'applied'"
    if a.source != rec.sham_source:
        return False, f"sham subgoal came from {a.source!r}, the study declared {rec.sham_source!r}"
    if rec.sham_source == "fixed":
        if rec.sham_text is None or a.subgoal != rec.sham_text or a.source_sha256 != digest_text(rec.sham_text):
            return False, "sham subgoal is not the study's fixed text"
        where = "the fixed text"
    else:
        if a.donor_case_id is None or a.donor_case_id != rec.sham_donor:
            return False, f"sham donor {a.donor_case_id!r} is not the declared donor {rec.sham_donor!r}"
        receipt = rec.receipts.get(name)
        problem = _receipt_problem(a, receipt, rec.sham_donor) or _advisor_problem(receipt, rec.sham_advisor)
        if problem is not None:
            return False, f"donor receipt: {problem}"
        where = f"donor {rec.sham_donor}'s receipt {a.call_id}/{a.request_id}"
    problem = _applied_problem(arm, a, rec.q_of(name))
    if problem is not None:
        return False, problem
    return True, f"{where} applied at step {rec.q_of(name)}"
