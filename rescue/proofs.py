"""Proofs that a pair of arms is comparable and the assistance is real (DESIGN §2).

Each check returns (ok, reason) so a verdict can say why a case failed it.
"""

from __future__ import annotations

from collections.abc import Sequence

from rescue.digest import digest_text
from rescue.records import ArmResult, CaseRecord, TraceRow


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


def q_state_match(control: ArmResult, assisted: ArmResult, prefix_why: str) -> tuple[bool, str]:
    """Whether both arms stood in one simulator state at q (the digest of its full state).

    In fork mode the prefix is shared by construction and this is its proof; in
    independent mode it backs the trace prefix. Only an adapter that records no
    state digest at all (both missing, independent mode) leaves the trace alone as the proof.
    """
    if control.mode != assisted.mode:
        return False, f"arms ran in different modes ({control.mode}, {assisted.mode})"
    if assisted.assistance.status == "not_reached":
        return True, prefix_why
    if control.mode == "fork":
        if control.q_state is None or control.q_state != assisted.q_state:
            return False, "fork: the arms' simulator states at q differ or are missing"
        return True, f"fork: shared prefix, one simulator state at q ({prefix_why})"
    if control.q_state is None and assisted.q_state is None:
        return True, prefix_why
    if control.q_state != assisted.q_state:
        return False, "the arms' simulator states at q differ (or one is missing) although their traces match"
    return True, f"{prefix_why}; one simulator state at q"


def check_evidence(rec: CaseRecord) -> tuple[bool, str]:
    """Whether the assisted arm's applied subgoal is tied to a valid receipt and its trace."""
    arm = rec.assisted
    if arm is None:
        return False, "no assisted arm"
    a = arm.assistance
    if a.status != "applied":
        return False, f"assistance status is {a.status!r}, not 'applied'"
    r = rec.receipt
    if r is None:
        return False, "no receipt"
    if r.kind != "outcome":
        return False, f"receipt kind is {r.kind!r}, not 'outcome'"
    if r.status != "ok":
        return False, f"receipt status is {r.status!r}"
    if rec.case_id not in r.case_ids:
        return False, f"receipt does not name case {rec.case_id!r}"
    if a.call_id != r.call_id:
        return False, f"assistance call id {a.call_id!r} != receipt call id {r.call_id!r}"
    if a.request_id is None or a.request_id not in r.request_ids:
        return False, f"request id {a.request_id!r} not in the receipt"
    # A batched call can be ok overall while rejecting this one request.
    if a.request_id in getattr(r, "request_errors", {}):
        return False, f"receipt rejected request {a.request_id!r}: {r.request_errors[a.request_id]}"
    if a.subgoal is None or not a.subgoal.strip():
        return False, "applied subgoal is empty"
    if r.subgoals.get(a.request_id) != a.subgoal:
        return False, "applied subgoal differs from the receipt's subgoal for this request"
    if a.query_step != rec.query_step:
        return False, f"assistance at step {a.query_step}, query point is {rec.query_step}"
    if a.instruction is None or a.instruction_digest is None:
        return False, "applied instruction or its digest is missing"
    if digest_text(a.instruction) != a.instruction_digest:
        return False, "applied instruction does not hash to its recorded digest"
    if a.subgoal.strip() not in a.instruction:
        return False, "applied instruction does not carry the subgoal"
    rows = [row for row in arm.trace if row.step == rec.query_step]
    if len(rows) != 1:
        return False, f"{len(rows)} assisted trace rows at step {rec.query_step}, expected 1"
    if rows[0].instruction != a.instruction_digest:
        return False, f"trace row at step {rec.query_step} was not queried with the applied instruction"
    return True, f"receipt {r.call_id}/{a.request_id} applied at step {rec.query_step}"
