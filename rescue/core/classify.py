"""Classification of one case (DESIGN §3): rules checked in order, first match wins."""

from __future__ import annotations

from collections.abc import Callable

from rescue.core.proofs import check_evidence, check_sham_evidence, prefix_match, q_state_match
from rescue.core.records import AdvisorVerdict, ArmResult, CaseRecord, ShamVerdict, Verdict, advisor_arm, is_assisted

# Assistance statuses that mean the VLM request failed (rule 3).
ASSISTANCE_FAILURES = frozenset({"broker_error", "invalid_response", "timeout"})


def deviation_reason(rec: CaseRecord) -> str | None:
    """Why the case's initial state deviates (rule 1), or None when it does not."""
    # An arm that never reset has no fingerprint; it is rule 2's business, not a deviation.
    arms = [(arm.arm, arm.fingerprint) for arm in (rec.control, rec.assisted) if arm is not None]
    seen = [(name, fp) for name, fp in arms if fp is not None]
    if rec.historical_fingerprint is not None:
        for name, fp in seen:
            if fp != rec.historical_fingerprint:
                return f"{name} initial-state fingerprint differs from the historical one"
        return None
    if len(seen) == 2 and seen[0][1] != seen[1][1]:
        return "no historical fingerprint; the two arms' initial-state fingerprints differ"
    return None


def deviation_detail(rec: CaseRecord) -> str | None:
    """Which fingerprint parts differ for a deviating case (None when it does not deviate).

    Parts are named when the arms disagree with each other; against a
    historical fingerprint only the whole digest is known, so the detail says
    which arm differs and lists the parts it recorded.
    """
    if deviation_reason(rec) is None:
        return None
    control, assisted = rec.control, rec.assisted
    if control is not None and assisted is not None and control.fingerprint != assisted.fingerprint:
        a, b = control.fingerprint_parts, assisted.fingerprint_parts
        parts = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        return "parts differing between the arms: " + (", ".join(parts) if parts else "none recorded")
    arm = control or assisted
    recorded = ", ".join(sorted(arm.fingerprint_parts)) if arm is not None else ""
    return f"differs from the historical fingerprint (the manifest records its digest only; parts recorded: {recorded or 'none'})"


def _arm_problem(rec: CaseRecord, arm: ArmResult | None, name: str) -> str | None:
    if arm is None:
        return f"{name} arm missing"
    if arm.status != "complete":
        return f"{name} arm {arm.status}" + (f": {arm.error}" if arm.error else "")
    # The checks below catch records stitched from the wrong case or arm.
    if arm.case_id != rec.case_id or arm.arm != name:
        return f"{name} slot holds {arm.arm} arm of case {arm.case_id!r}"
    if arm.success is None:
        return f"{name} arm complete but its success is unknown"
    if (name == "control") != (arm.assistance.status == "control"):
        return f"{name} arm has assistance status {arm.assistance.status!r}"
    return None


def invalid_reason(rec: CaseRecord, second: str = "assisted") -> str | None:
    """Why the pair is missing, interrupted or invalid (rule 2), or None when it is sound."""
    if rec.interrupted:
        return "case interrupted"
    for name, arm in (("control", rec.control), (second, rec.assisted)):
        problem = _arm_problem(rec, arm, name)
        if problem is not None:
            return problem
    return None


def _judge(
    rec: CaseRecord, second: str, evidence: Callable[[CaseRecord], tuple[bool, str]]
) -> tuple[str, int, str, bool, bool]:
    """DESIGN §3 for the control arm against the arm in the `assisted` slot: label, rule, reason, in M, in E."""
    deviation = deviation_reason(rec)
    invalid = invalid_reason(rec, second)
    in_m = False
    prefix_ok, prefix_why = False, "not checked"
    if invalid is None:
        assert rec.control is not None and rec.assisted is not None
        prefix_ok, prefix_why = prefix_match(rec.control.trace, rec.assisted.trace, rec.query_step)
        if prefix_ok:
            prefix_ok, prefix_why = q_state_match(rec.control, rec.assisted, prefix_why)
        in_m = deviation is None and prefix_ok
    evidence_ok, evidence_why = evidence(rec) if in_m else (False, "not checked")
    # The evidence checks demand status 'applied', so E is "M with the subgoal applied and valid evidence".
    in_e = in_m and evidence_ok

    if deviation is not None:
        return "initial_state_deviation", 1, deviation, in_m, in_e
    if invalid is not None:
        return "unknown", 2, invalid, in_m, in_e
    assert rec.control is not None and rec.assisted is not None
    status = rec.assisted.assistance.status
    if status in ASSISTANCE_FAILURES:
        kind = rec.assisted.assistance.error_kind
        what = "assistance" if is_assisted(second) else f"{second} subgoal"
        return "unknown", 3, f"{what} {status}" + (f" ({kind})" if kind else ""), in_m, in_e
    if status == "not_reached":
        ended = f"{second} arm ended at step {rec.assisted.steps}, before the query point {rec.query_step}"
        return "not_rescued", 4, ended, in_m, in_e
    if not prefix_ok:
        return "unknown", 5, prefix_why, in_m, in_e
    if not evidence_ok:
        return "unknown", 6, f"evidence invalid: {evidence_why}", in_m, in_e
    if rec.control.success:
        return "not_rescued", 7, "control arm succeeded", in_m, in_e
    if not rec.assisted.success:
        return "not_rescued", 8, f"{second} arm failed", in_m, in_e
    return "rescued", 9, f"control failed, {second} succeeded, prefix and evidence hold", in_m, in_e


def classify(rec: CaseRecord) -> Verdict:
    """Classify one case by DESIGN §3 (assisted against control), its sham arm when the study has one, and
    in a study of several advisors each advisor's arm against control (DESIGN §11; the primary's is the label)."""
    label, rule, reason, in_m, in_e = _judge(rec, advisor_arm(rec.advisor), check_evidence)
    sham = None
    if rec.sham_source is not None:
        as_pair = rec.model_copy(update={"assisted": rec.sham, "receipt": rec.sham_receipt})
        s_label, s_rule, s_reason, s_m, s_e = _judge(as_pair, "sham", check_sham_evidence)
        sham = ShamVerdict(label=s_label, rule=s_rule, reason=s_reason, in_m=s_m, in_e=s_e)
    advisors = None
    if rec.advisors is not None:
        advisors = {}
        for name, arm in rec.advisors.items():
            receipt = (rec.advisor_receipts or {}).get(name)
            pair = rec.model_copy(update={"assisted": arm, "receipt": receipt, "advisor": name})
            a_label, a_rule, a_reason, a_m, a_e = _judge(pair, advisor_arm(name), check_evidence)
            advisors[name] = AdvisorVerdict(label=a_label, rule=a_rule, reason=a_reason, in_m=a_m, in_e=a_e)
    return Verdict(case_id=rec.case_id, label=label, rule=rule, reason=reason, in_m=in_m, in_e=in_e, sham=sham,
                   advisors=advisors)
