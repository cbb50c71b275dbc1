"""Behaviour of the pure core: query point, digests, proofs, classification, statistics."""

from __future__ import annotations

import hashlib
import math
from collections import Counter

import numpy as np
import pytest
from helpers.case_records import (
    C,
    DEVIATIONS,
    EXPECTED_LABEL,
    H,
    ORIGINAL,
    OTHER_UNKNOWNS,
    Q,
    assisted_interrupted,
    build_seed_cohort,
    case_interrupted,
    control_error,
    dev_and_interrupted,
    dev_and_missing,
    dev_assisted,
    dev_control,
    dev_no_history,
    evidence_no_receipt,
    evidence_other_case,
    evidence_row_not_applied,
    evidence_wrong_call,
    evidence_wrong_subgoal,
    make_case,
    make_trace,
    missing_control,
    prefix_row_differs,
    prefix_rows_missing,
    replace_row,
    timeout_and_diverged,
)

from rescue.core.classify import classify
from rescue.core.digest import digest_array, digest_bytes, digest_json, digest_obs, digest_text
from rescue.core.proofs import check_evidence, prefix_match, trace_is_regular
from rescue.core.querypoint import query_point
from rescue.core.records import ArmResult, Assistance, CaseRecord, Receipt
from rescue.core.verdicts import Verdict
from rescue.core.figures.stats import summarize
from rescue.core.figures.exact_stats import block_bootstrap_ci, mcnemar_exact, paired_diff_ci

pytestmark = pytest.mark.fast


# --- query point -----------------------------------------------------------------


def test_query_point_seed_and_libero():
    assert query_point(1800, 16) == 912
    assert query_point(220, 16) == 112
    assert query_point(32, 16) == 16  # H/2 already on the grid
    assert query_point(221, 1) == 111


@pytest.mark.parametrize("h, c", [(0, 16), (220, 0), (-1, 16), (220.0, 16), (True, 16)])
def test_query_point_rejects_bad_input(h, c):
    with pytest.raises((ValueError, TypeError)):
        query_point(h, c)


# --- digests ---------------------------------------------------------------------


def test_digest_array_sensitive_to_shape_and_dtype():
    a = np.arange(12, dtype=np.int32)
    assert a.tobytes() == a.reshape(3, 4).tobytes()
    assert digest_array(a) != digest_array(a.reshape(3, 4))
    assert digest_array(a.reshape(3, 4)) != digest_array(a.reshape(4, 3))
    same_bytes = a.view(np.float32)
    assert digest_array(a) != digest_array(same_bytes)
    assert digest_array(a) != digest_array(a.astype(">i4"))  # byte order is part of dtype.str


def test_digest_array_stable_for_equal_arrays():
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    assert digest_array(a) == digest_array(a.copy())
    assert digest_array(a.T) == digest_array(np.ascontiguousarray(a.T))  # layout does not matter
    assert digest_array(a) != digest_array(a + 1e-12)
    with pytest.raises(TypeError):
        digest_array(np.array([{}, 1], dtype=object))


def test_digest_text_json_bytes_obs():
    assert digest_text("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert digest_bytes(b"abc") == digest_text("abc")
    assert digest_json({"b": 1, "a": "é"}) == digest_json({"a": "é", "b": 1})
    expected = hashlib.sha256('{"a":"é","b":[1,2]}'.encode("utf-8")).hexdigest()
    assert digest_json({"b": [1, 2], "a": "é"}) == expected
    obs = {"wrist": np.zeros((2, 2), np.uint8), "state": np.ones(3)}
    assert digest_obs(obs) == digest_obs(dict(reversed(list(obs.items()))))
    assert digest_obs(obs) != digest_obs({"wrist": np.zeros((2, 2), np.uint8), "state": np.ones(3, np.float32)})
    assert digest_obs(obs) != digest_obs({"wrist2": obs["wrist"], "state": obs["state"]})


# --- proofs ----------------------------------------------------------------------


def test_trace_is_regular():
    assert trace_is_regular(make_trace("control"), C)
    assert not trace_is_regular(make_trace("control"), 8)
    assert not trace_is_regular([], C)
    gap = [r for r in make_trace("control") if r.step != 2 * C]
    assert not trace_is_regular(gap, C)
    late = [r for r in make_trace("control") if r.step != 0]
    assert not trace_is_regular(late, C)


def test_prefix_match_accepts_identical_prefix_and_ignores_rows_after_q():
    rec = make_case("p")
    ok, why = prefix_match(rec.control.trace, rec.assisted.trace, Q)
    assert ok, why
    assert rec.control.trace[-1] != rec.assisted.trace[-1]


def test_prefix_match_differing_row():
    rec = make_case("p")
    replace_row(rec.assisted, 2 * C, images={"agentview": digest_text("x")})
    ok, why = prefix_match(rec.control.trace, rec.assisted.trace, Q)
    assert not ok and "images" in why


def test_prefix_match_missing_rows():
    rec = make_case("p")
    short = [r for r in rec.assisted.trace if r.step < Q - C]
    ok, why = prefix_match(rec.control.trace, short, Q)
    assert not ok and "length" in why


def test_prefix_match_zero_rows():
    rec = make_case("p")
    assert prefix_match(rec.control.trace, rec.assisted.trace, 0)[0] is False
    assert prefix_match([], [], Q)[0] is False


def test_check_evidence_accepts_valid_case():
    ok, why = check_evidence(make_case("e"))
    assert ok, why


@pytest.mark.parametrize(
    "breaker, expected",
    [
        (evidence_no_receipt, "no receipt"),
        (evidence_wrong_call, "call id"),
        (evidence_wrong_subgoal, "subgoal"),
        (evidence_row_not_applied, "not queried with the applied instruction"),
        (evidence_other_case, "does not name case"),
        (lambda r: setattr(r.receipt, "status", "error"), "status"),
        (lambda r: setattr(r.receipt, "kind", "attempt"), "kind"),
        (lambda r: setattr(r.assisted.assistance, "request_id", "req-other"), "request id"),
        (lambda r: setattr(r.assisted.assistance, "query_step", Q + C), "query point"),
        (lambda r: setattr(r.assisted.assistance, "instruction", ORIGINAL), "digest"),
        (lambda r: setattr(r.assisted, "trace", [x for x in r.assisted.trace if x.step != Q]), "0 assisted trace rows"),
    ],
)
def test_check_evidence_failures(breaker, expected):
    rec = make_case("e")
    breaker(rec)
    ok, why = check_evidence(rec)
    assert not ok
    assert expected in why


@pytest.mark.skipif("request_errors" not in Receipt.model_fields, reason="receipt has no per-request errors")
def test_check_evidence_rejects_request_refused_within_an_ok_call():
    rec = make_case("e")
    rec.receipt.request_errors = {"req-e": "token mismatch"}
    ok, why = check_evidence(rec)
    assert not ok and "rejected request" in why


def test_check_evidence_rejects_empty_subgoal():
    rec = make_case("e")
    rec.assisted.assistance.subgoal = "  "
    rec.receipt.subgoals[rec.assisted.assistance.request_id] = "  "
    assert check_evidence(rec) == (False, "applied subgoal is empty")


# --- classification: each rule on a minimal record -------------------------------


def not_reached(rec):
    rec.assisted.trace = [r for r in rec.assisted.trace if r.step < Q]
    rec.assisted.steps = Q - 5
    rec.assisted.assistance = Assistance(status="not_reached")
    rec.receipt = None


@pytest.mark.parametrize(
    "mutate, label, rule",
    [
        (dev_assisted, "initial_state_deviation", 1),
        (dev_control, "initial_state_deviation", 1),
        (dev_no_history, "initial_state_deviation", 1),
        (missing_control, "unknown", 2),
        (lambda r: setattr(r, "assisted", None), "unknown", 2),
        (assisted_interrupted, "unknown", 2),
        (case_interrupted, "unknown", 2),
        (control_error, "unknown", 2),
        (lambda r: setattr(r.assisted.assistance, "status", "broker_error"), "unknown", 3),
        (lambda r: setattr(r.assisted.assistance, "status", "invalid_response"), "unknown", 3),
        (lambda r: setattr(r.assisted.assistance, "status", "timeout"), "unknown", 3),
        (not_reached, "not_rescued", 4),
        (prefix_row_differs, "unknown", 5),
        (prefix_rows_missing, "unknown", 5),
        (evidence_no_receipt, "unknown", 6),
        (evidence_row_not_applied, "unknown", 6),
        (lambda r: setattr(r.control, "success", True), "not_rescued", 7),
        (lambda r: setattr(r.assisted, "success", False), "not_rescued", 8),
        (lambda r: None, "rescued", 9),
    ],
)
def test_each_rule(mutate, label, rule):
    rec = make_case("c", assisted_success=True)
    mutate(rec)
    v = classify(rec)
    assert (v.label, v.rule) == (label, rule), v.reason
    assert v.case_id == "c" and v.reason


def test_membership_of_m_and_e():
    ok = classify(make_case("c", assisted_success=True))
    assert ok.in_m and ok.in_e
    rec = make_case("c")
    evidence_wrong_call(rec)
    v = classify(rec)
    assert v.in_m and not v.in_e
    rec = make_case("c")
    not_reached(rec)
    v = classify(rec)
    assert v.in_m and not v.in_e
    for mutate in DEVIATIONS + OTHER_UNKNOWNS:
        rec = make_case("c")
        mutate(rec)
        v = classify(rec)
        assert not v.in_m and not v.in_e, mutate.__name__


def test_precedence():
    # A deviation that was also interrupted stays a deviation.
    rec = make_case("c", assisted_success=True)
    dev_and_interrupted(rec)
    assert classify(rec).rule == 1
    # A deviation with an arm missing is still a deviation.
    rec = make_case("c")
    dev_and_missing(rec)
    assert classify(rec).rule == 1
    # A missing arm beats an assistance failure.
    rec = make_case("c")
    rec.assisted.status = "error"
    rec.assisted.assistance = Assistance(status="timeout")
    assert classify(rec).rule == 2
    # An assistance failure beats a broken prefix.
    rec = make_case("c")
    timeout_and_diverged(rec)
    assert classify(rec).rule == 3
    # Not reached beats a missing receipt and a control success.
    rec = make_case("c", control_success=True)
    not_reached(rec)
    assert (classify(rec).label, classify(rec).rule) == ("not_rescued", 4)
    # A broken prefix beats broken evidence.
    rec = make_case("c", assisted_success=True)
    prefix_row_differs(rec)
    evidence_no_receipt(rec)
    assert classify(rec).rule == 5
    # Broken evidence beats a control success.
    rec = make_case("c", control_success=True, assisted_success=True)
    evidence_wrong_subgoal(rec)
    assert (classify(rec).label, classify(rec).rule) == ("unknown", 6)


def test_fingerprint_of_an_arm_that_never_reset_is_skipped():
    rec = make_case("c")
    rec.control.fingerprint = None
    rec.control.status = "error"
    assert classify(rec).rule == 2
    rec = make_case("c", assisted_success=True)
    rec.historical_fingerprint = None
    assert classify(rec).label == "rescued"  # arms agree with each other
    rec = make_case("c")
    rec.historical_fingerprint = None
    rec.control.fingerprint = None
    rec.control.status = "error"
    assert classify(rec).rule == 2


def test_arm_in_the_wrong_slot_is_invalid():
    rec = make_case("c", assisted_success=True)
    rec.control.case_id = "other"
    assert classify(rec).rule == 2
    rec = make_case("c", assisted_success=True)
    rec.control.assistance = rec.assisted.assistance  # the control arm got a subgoal
    assert classify(rec).rule == 2


# --- statistics -----------------------------------------------------------------


def test_mcnemar_seed():
    assert round(mcnemar_exact(53, 47), 4) == 0.6173
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(56, 0) == pytest.approx(2 * 0.5**56)


def _wilson_by_roots(x: int, n: int, z: float) -> tuple[float, float]:
    # Roots of (p - x/n)^2 = z^2 p (1 - p) / n, solved as a polynomial in p.
    ph = x / n
    roots = np.roots([1 + z * z / n, -(2 * ph + z * z / n), ph * ph])
    return float(min(roots.real)), float(max(roots.real))


def _newcombe_by_hand(a: int, b: int, c: int, d: int, z: float = 1.959963984540054):
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = _wilson_by_roots(a + b, n, z)
    l2, u2 = _wilson_by_roots(a + c, n, z)
    cross = a * d - b * c
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    if margins == 0:
        phi = 0.0  # a marginal is all-or-nothing: no correlation to estimate
    elif cross > 0:
        phi = max(cross - n / 2, 0) / math.sqrt(margins)
    else:
        phi = cross / math.sqrt(margins)
    lo = p1 - p2 - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    hi = p1 - p2 + math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    return lo, hi


def test_newcombe_matches_independent_computation():
    lo, hi = paired_diff_ci(53, 47, 600)
    assert (lo, hi) == pytest.approx(_newcombe_by_hand(0, 53, 47, 500), abs=1e-9)
    assert (round(lo, 4), round(hi, 4)) == (-0.0229, 0.0430)
    lo, hi = paired_diff_ci(53, 47, 600, both_success=120)
    assert (lo, hi) == pytest.approx(_newcombe_by_hand(120, 53, 47, 380), abs=1e-9)


def test_newcombe_published_example():
    # Cavo et al. (2012) table as worked in Fagerland, Lydersen & Laake: -0.0621 (-0.1186 to -0.0046).
    lo, hi = paired_diff_ci(6, 16, 161, both_success=59)
    assert (round(lo, 4), round(hi, 4)) == (-0.1186, -0.0046)


@pytest.mark.parametrize(
    "b, c, n, a",
    [(53, 47, 600, 0), (56, 0, 874, 0), (0, 0, 10, 0), (10, 0, 10, 0), (0, 10, 10, 0), (3, 1, 20, 16)],
)
def test_newcombe_properties(b, c, n, a):
    lo, hi = paired_diff_ci(b, c, n, both_success=a)
    point = (b - c) / n
    assert -1.0 <= lo <= point <= hi <= 1.0


def test_newcombe_degenerate_and_invalid():
    assert all(math.isnan(x) for x in paired_diff_ci(0, 0, 0))
    with pytest.raises(ValueError):
        paired_diff_ci(5, 6, 10)
    with pytest.raises(ValueError):
        paired_diff_ci(-1, 0, 10)


def test_block_bootstrap():
    rng = np.random.default_rng(0)
    pairs = [(f"task{i % 12}", bool(rng.random() < 0.3), bool(rng.random() < 0.4)) for i in range(600)]
    lo, hi = block_bootstrap_ci(pairs, seed=1)
    point = np.mean([p[2] for p in pairs]) - np.mean([p[1] for p in pairs])
    assert lo <= point <= hi
    assert block_bootstrap_ci(pairs, seed=1) == (lo, hi)
    assert block_bootstrap_ci(pairs, seed=2) != (lo, hi)
    assert all(math.isnan(x) for x in block_bootstrap_ci([], seed=1))
    same = [("t", True, True)] * 5
    assert block_bootstrap_ci(same, seed=1) == (0.0, 0.0)


# --- the seed cohort -------------------------------------------------------------


def test_seed_cohort_summary():
    records, kinds = build_seed_cohort()
    pilots = [
        make_case(f"pilot-{i}", group="Atomic-Seen", task="Atomic-Seen/task0", assisted_success=True, pilot=True)
        for i in range(3)
    ]
    records = records + pilots
    verdicts = [classify(rec) for rec in records]
    for rec, v in zip(records, verdicts):
        if not rec.pilot:
            assert v.label == EXPECTED_LABEL[kinds[rec.case_id]], (rec.case_id, v.reason)

    s = summarize(records, verdicts)
    assert s.n == 1004
    assert s.counts == {"rescued": 56, "not_rescued": 813, "unknown": 28, "initial_state_deviation": 107}
    assert (s.r, s.m, s.e) == (56, 874, 869)
    assert round(100 * s.r_over_n, 2) == 5.58
    assert round(100 * s.r_over_m, 2) == 6.41
    assert round(100 * s.r_over_e, 2) == 6.44
    assert s.versus_control.pairs.model_dump() == {"first_only": 56, "second_only": 0, "both_success": 0, "both_fail": 818}

    groups = {g: (b.rescued, b.n) for g, b in s.per_group.items()}
    assert groups == {"Atomic-Seen": (12, 153), "Composite-Seen": (25, 321), "Composite-Unseen": (19, 530)}
    assert s.per_group["Atomic-Seen"].counts == {"rescued": 12, "not_rescued": 125, "unknown": 0, "initial_state_deviation": 16}
    assert s.per_group["Composite-Seen"].counts == {"rescued": 25, "not_rescued": 218, "unknown": 8, "initial_state_deviation": 70}
    assert s.per_group["Composite-Unseen"].counts == {"rescued": 19, "not_rescued": 470, "unknown": 20, "initial_state_deviation": 21}
    assert s.per_group["Composite-Seen"].rate == pytest.approx(25 / 321)

    # Per task: expected from how each case was built, not from the verdicts.
    expected_tasks: dict[str, Counter] = {}
    for rec in records:
        if not rec.pilot:
            expected_tasks.setdefault(rec.task, Counter())[EXPECTED_LABEL[kinds[rec.case_id]]] += 1
    assert set(s.per_task) == set(expected_tasks)
    for task, counter in expected_tasks.items():
        got = s.per_task[task]
        assert got.n == sum(counter.values())
        assert {k: v for k, v in got.counts.items() if v} == dict(counter)
    assert sum(t.n for t in s.per_task.values()) == 1004

    # Which rule decided: 5 unknowns by evidence, the rest by rules 2, 3 and 5.
    rules = Counter((v.label, v.rule) for rec, v in zip(records, verdicts) if not rec.pilot)
    assert rules[("unknown", 6)] == 5
    assert rules[("unknown", 2)] + rules[("unknown", 3)] + rules[("unknown", 5)] == 23
    assert rules[("unknown", 3)] > 0 and rules[("unknown", 5)] > 0
    assert rules[("not_rescued", 8)] == 813

    vc = s.versus_control
    assert vc.mcnemar_p == pytest.approx(2 * 0.5**56)
    assert vc.diff == pytest.approx(56 / 874)
    lo, hi = vc.diff_ci
    assert 0 < lo < vc.diff < hi < 1
    assert (lo, hi) == pytest.approx(_newcombe_by_hand(0, 56, 0, 818), abs=1e-9)

    assert s.pilot_ids == [f"pilot-{i}" for i in range(3)]
    assert s.pilot is not None and s.pilot.n == 3 and s.pilot.r == 3
    assert s.pilot.pilot is None

    # The summary round-trips through JSON (what exports write).
    assert type(s).model_validate_json(s.model_dump_json()) == s


def test_summary_keeps_every_case_in_the_denominator():
    records, _ = build_seed_cohort()
    verdicts = [classify(rec) for rec in records]
    with pytest.raises(ValueError):
        summarize(records, verdicts[:-1])
    with pytest.raises(ValueError):
        summarize(records + records[:1], verdicts)


def test_summary_rejects_broken_invariant():
    rec = make_case("x")
    forged = Verdict(case_id="x", label="rescued", rule=9, reason="forged", in_m=False, in_e=False)
    with pytest.raises(ValueError, match="R <= E <= M <= N"):
        summarize([rec], [forged])
    forged = Verdict(case_id="x", label="not_rescued", rule=8, reason="forged", in_m=False, in_e=True)
    with pytest.raises(ValueError):
        summarize([rec], [forged])


def test_empty_summary():
    s = summarize([], [])
    assert s.n == 0 and s.r_over_n is None and s.r_over_m is None and s.versus_control.diff_ci is None
    assert s.versus_control.mcnemar_p == 1.0 and s.pilot is None and s.pilot_ids == []


def test_deviation_detail_names_the_differing_fingerprint_parts():
    from rescue.core.classify import deviation_detail
    from rescue.core.records import ArmResult, Assistance, CaseRecord

    def arm(name, parts):
        return ArmResult(case_id="c", arm=name, status="complete", success=False, steps=10,
                         fingerprint=str(sorted(parts.items())), fingerprint_parts=parts,
                         assistance=Assistance(status="control" if name == "control" else "not_reached"))

    same = {"physics": "a", "model": "x", "instruction": "i"}
    other = {**same, "model": "y"}
    rec = CaseRecord(case_id="c", group="g", task="t", horizon=64, query_step=32,
                     arms={"control": arm("control", same), "assisted": arm("assisted", other)})
    assert deviation_detail(rec) == "parts differing between the arms: model"
    both_same = {"control": arm("control", same), "assisted": arm("assisted", same)}
    assert deviation_detail(rec.model_copy(update={"arms": both_same})) is None
    historical = rec.model_copy(update={"arms": both_same, "historical_fingerprint": "ff"})
    assert "historical" in deviation_detail(historical)


def test_vlm_flags_without_a_vlm_url_keep_the_local_endpoint():
    from rescue.core.configuration.config_files import load_config

    config = load_config(None, {"vlm.model": "other-model", "vlm.api": "responses", "vlm.batch_size": 4})
    assert config.vlm.base_url == "local" and config.vlm.model == "other-model" and config.vlm.batch_size == 4


def test_the_summary_says_how_often_the_control_arm_failed_again():
    failed, succeeded, broken = make_case("a"), make_case("b", control_success=True), make_case("c")
    broken.control.status, broken.control.success = "error", None
    records = [failed, succeeded, broken]
    rep = summarize(records, [classify(r) for r in records]).reproduction
    # Of the two controls that completed, one failed again; the errored one is no run at all.
    assert (rep.controls, rep.failed, rep.rate) == (2, 1, 0.5)


def test_the_policy_leaves_the_command_process_from_four_simulators_on_one_process_per_eight():
    from rescue.core.configuration.config import SIMULATORS_PER_POLICY_PROCESS, PolicyConfig, StudyConfig, auto_policy_processes

    assert SIMULATORS_PER_POLICY_PROCESS == 8
    assert [auto_policy_processes(n) for n in (0, 1, 2, 3, 4, 8, 9, 16, 17, 64)] == [0, 0, 0, 0, 1, 1, 2, 2, 3, 8]
    assert PolicyConfig().served_processes(16) == 2 and PolicyConfig(processes=0).served_processes(16) == 0
    assert PolicyConfig(processes=3).served_processes(1) == 3
    # An external server is served by itself: no process of ours, whatever is set.
    assert PolicyConfig(url="ws://gpu:8000", processes=3).served_processes(16) == 0
    # Unset, it is not in the study's hash: the studies made before it keep theirs.
    assert StudyConfig().sha256() == StudyConfig(policy={"processes": None}).sha256() != \
        StudyConfig(policy={"processes": 2}).sha256()
    with pytest.raises(ValueError):
        PolicyConfig(processes=-1)


def test_each_policy_connection_goes_to_the_next_policy_process():
    from rescue.run.peers import Peers

    peers = Peers(["ws://a/", "ws://b/", "ws://c/"], None, 8, pool=None, vlm=None)
    assert [peers.next_policy_url() for _ in range(7)] == ["ws://a/", "ws://b/", "ws://c/"] * 2 + ["ws://a/"]
    assert peers.policy_url == "ws://a/"
    one = Peers(["ws://only/"], None, 8, pool=None, vlm=None)
    assert {one.next_policy_url() for _ in range(3)} == {"ws://only/"} == {one.policy_url}
