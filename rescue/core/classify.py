"""Classification of one case (DESIGN §3): rules checked in order, first match wins.

Every arm that asks at a query point (the primary, the sham, each further advisor, each extra query point)
is judged against the control arm by the same rules; the primary's verdict is the case's label.
"""

from __future__ import annotations

from rescue.core.arms import arm_advisor, base_arm, continuation, continuation_arm, is_assisted
from rescue.core.success_labels import success_label, success_reason
from rescue.core.proofs import check_evidence, check_sham_evidence, prefix_match, q_state_match
from rescue.core.records import ArmResult, CaseRecord
from rescue.core.verdicts import DECLINED, ArmVerdict, ContinuationCount, Verdict

# Assistance statuses that mean the VLM request failed (rule 3).
ASSISTANCE_FAILURES = frozenset({"broker_error", "invalid_response", "timeout"})


def deviation_reason(rec: CaseRecord, arm: str | None = None, against: str = "control") -> str | None:
    """Why the case's initial state deviates (rule 1) for `against` (the control arm) and `arm` (the primary by
    default), or None when it does not."""
    judged = rec.arms.get(arm or rec.primary)
    # An arm that never reset has no fingerprint; it is rule 2's business, not a deviation.
    arms = [(a.arm, a.fingerprint) for a in (rec.arms.get(against), judged) if a is not None]
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


def arm_problem(rec: CaseRecord, arm: ArmResult | None, name: str) -> str | None:
    """Why one arm's record cannot be judged (missing, not complete, stitched from elsewhere), or None."""
    if arm is None:
        return f"{name} arm missing"
    if arm.status != "complete":
        return f"{name} arm {arm.status}" + (f": {arm.error}" if arm.error else "")
    # The checks below catch records stitched from the wrong case or arm.
    if arm.case_id != rec.case_id or arm.arm != name:
        return f"{name} slot holds {arm.arm} arm of case {arm.case_id!r}"
    if arm.success is None:
        return f"{name} arm complete but its success is unknown"
    if (base_arm(name, query_point=False) == "control") != (arm.assistance.status == "control"):
        return f"{name} arm has assistance status {arm.assistance.status!r}"
    return None


def invalid_reason(rec: CaseRecord, arm: str | None = None, against: str = "control") -> str | None:
    """Why `against` (the control arm) and `arm` (the primary by default) are missing, interrupted or invalid
    (rule 2), or None when both are sound."""
    if rec.interrupted:
        return "case interrupted"
    for name in (against, arm or rec.primary):
        problem = arm_problem(rec, rec.arms.get(name), name)
        if problem is not None:
            return problem
    return None


def evidence(rec: CaseRecord, arm: str) -> tuple[bool, str]:
    """Whether an arm's applied subgoal is what it should be: its advisor's receipt for an assisted arm, the
    declared source for the sham."""
    if is_assisted(arm):
        return check_evidence(rec, arm, arm_advisor(arm))
    return check_sham_evidence(rec, arm)


def judge(rec: CaseRecord, arm: str, against: str = "control") -> ArmVerdict:
    """DESIGN §3 for `against` (the control arm, or one of its continuations) against `arm`."""
    deviation = deviation_reason(rec, arm, against)
    invalid = invalid_reason(rec, arm, against)
    judged, control = rec.arms.get(arm), rec.arms.get(against)
    in_m = False
    prefix_ok, prefix_why = False, "not checked"
    q = rec.q_of(arm)
    if invalid is None:
        assert control is not None and judged is not None
        prefix_ok, prefix_why = prefix_match(control.trace, judged.trace, q)
        if prefix_ok:
            # At a declared extra query point the leader (the control arm) proves the state: only it stood there.
            at = None if q == rec.query_step else q
            prefix_ok, prefix_why = q_state_match(control if at is None else rec.control, judged, prefix_why, at)
        in_m = deviation is None and prefix_ok
    evidence_ok, evidence_why = evidence(rec, arm) if in_m else (False, "not checked")
    # The evidence checks demand status 'applied', so E is "M with the subgoal applied and valid evidence".
    in_e = in_m and evidence_ok

    succeeded = rec.historical_outcome == "success"

    def verdict(label: str, rule: int, reason: str, own_reason: bool = False) -> ArmVerdict:
        if succeeded and label != DECLINED:
            # A historical success: the same rules in the same order, read as DESIGN §17 labels.
            label = success_label(rule)
            if rule in (4, 7, 8, 9) and not own_reason:
                reason = success_reason(rule, arm, against, q, judged.steps if judged is not None else 0)
        return ArmVerdict(against=against, label=label, rule=rule, reason=reason, in_m=in_m, in_e=in_e)

    if deviation is not None:
        return verdict("initial_state_deviation", 1, deviation)
    if invalid is not None:
        return verdict("unknown", 2, invalid)
    assert control is not None and judged is not None
    status = judged.assistance.status
    failed = next((c for c in judged.calls() if c.status in ASSISTANCE_FAILURES), None)
    if failed is not None:
        kind = failed.error_kind
        what = "assistance" if is_assisted(arm) else f"{arm} subgoal"
        if failed is not judged.assistance:
            what = f"{what} (call {judged.calls().index(failed) + 1})"
        return verdict("unknown", 3, f"{what} {failed.status}" + (f" ({kind})" if kind else ""))
    if status == "not_reached":
        return verdict("not_rescued", 4, f"{arm} arm ended at step {judged.steps}, before the query point {q}")
    if status == "not_asked" or base_arm(arm) in rec.unasked:
        # A trigger's arm (DESIGN §18): asked exactly when its trigger fires on the control arm's queries.
        if status != "not_asked":
            return verdict("unknown", 6, f"evidence invalid: {arm}'s trigger never fires on the control arm's "
                           f"queries, yet it asked at step {judged.assistance.query_step}")
        if base_arm(arm) not in rec.unasked:
            return verdict("unknown", 6, f"evidence invalid: {arm}'s trigger fires at step {q} on the control arm's "
                           "queries, yet it was not asked")
        why = f"{arm}'s trigger never fired: not asked (no call)"
        return verdict("not_rescued", 4, why + (", kept by construction" if succeeded else ""), own_reason=True)
    if not any(c.status == "applied" for c in judged.calls()) and any(c.status == "declined" for c in judged.calls()):
        # Declined at every call: the arm ran on with the instruction unchanged (DESIGN §18).
        asked = [c.query_step for c in judged.calls()]
        if asked[0] != q:
            return verdict("unknown", 6, f"evidence invalid: declined at step {asked[0]}, query point is {q}")
        steps = ", ".join(str(s) for s in asked)
        return verdict(DECLINED, 4, f"the advisor kept the instruction (asked at step {steps}): declined")
    if not prefix_ok:
        return verdict("unknown", 5, prefix_why)
    if not evidence_ok:
        return verdict("unknown", 6, f"evidence invalid: {evidence_why}")
    # Rule 7: the control arm did not end as the evaluation did (a failure: it succeeded; a success: it failed).
    if bool(control.success) != succeeded:
        return verdict("not_rescued", 7, f"{against} arm succeeded")
    if not judged.success:
        return verdict("not_rescued", 8, f"{arm} arm failed")
    return verdict("rescued", 9, f"{against} failed, {arm} succeeded, prefix and evidence hold")


def control_sound(rec: CaseRecord, name: str) -> bool:
    """Whether a continuation of the control arm completed and stood where its leader stood at q (the control arm
    itself: whether it completed)."""
    arm = rec.arms.get(name)
    if rec.interrupted or arm_problem(rec, arm, name) is not None:
        return False
    if continuation(name) == 1:
        return True
    leader = rec.control
    if leader is None or arm_problem(rec, leader, "control") is not None:
        return False
    ok, why = prefix_match(leader.trace, arm.trace, rec.query_step)
    return ok and q_state_match(leader, arm, why)[0]


def continuation_counts(rec: CaseRecord) -> dict[str, ContinuationCount]:
    """Every arm's successes of its K continuations, and whether each continuation k is in M and in E with the
    control arm's k-th (DESIGN §13); empty with one continuation per arm."""
    k_max = rec.continuations
    if k_max < 2:
        return {}
    out = {}
    for base in ["control", *rec.judged()]:
        names = [continuation_arm(base, k) for k in range(1, k_max + 1)]
        recorded = [a for a in (rec.arms.get(n) for n in names) if a is not None]
        successes = sum(bool(a.success) for a in recorded if a.status == "complete")
        # How many ran: an interrupted case may have recorded fewer than K (none at all).
        ran = len(recorded)
        if base == "control":
            sound = all(control_sound(rec, n) for n in names)
            out[base] = ContinuationCount(successes=successes, continuations=ran, in_m=sound, in_e=sound)
            continue
        pairs = [judge(rec, n, continuation_arm("control", k)) for k, n in enumerate(names, start=1)]
        out[base] = ContinuationCount(successes=successes, continuations=ran, in_m=all(v.in_m for v in pairs),
                                      in_e=all(v.in_e for v in pairs))
    return out


def classify(rec: CaseRecord) -> Verdict:
    """Classify one case by DESIGN §3: the primary arm against control is the label; every other arm the case
    judges (the sham, further advisors, extra query points) gets its own verdict against control; with K
    continuations, every arm's successes of K."""
    primary = judge(rec, rec.primary)
    others = {arm: judge(rec, arm) for arm in rec.judged()[1:]}
    return Verdict(case_id=rec.case_id, label=primary.label, rule=primary.rule, reason=primary.reason,
                   in_m=primary.in_m, in_e=primary.in_e, arms=others, continuations=continuation_counts(rec))
