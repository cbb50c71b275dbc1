"""Historical successes (DESIGN §17): their labels under the failures' rules, exposure, harm and the net change."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers.case_records import build_seed_cohort, make_case, with_arms

from rescue.core.classify import classify
from rescue.core.figures.harm import CaseScore, case_score, net_change, stratum
from rescue.core.success_labels import is_exposed
from rescue.core.manifest import Case
from rescue.core.figures.stats import summarize
from rescue.core.figures.success_sample import SamplingFrame, allocate, frame_of, frame_tags, sample_successes

pytestmark = pytest.mark.fast


def success(case_id: str, control: bool = True, assisted: bool = True, **kw):
    rec = make_case(case_id, control_success=control, assisted_success=assisted, **kw)
    rec.historical_outcome = "success"
    return rec


def ended_early(rec, steps: int = 100):
    """Both arms of a success ended (succeeded) before q: the assisted arm never asked."""
    for arm in rec.arms.values():
        arm.steps, arm.success, arm.trace = steps, True, [r for r in arm.trace if r.step < steps]
    assisted = rec.arms["assisted"]
    assisted.assistance = assisted.assistance.model_copy(update={
        "status": "not_reached", "query_step": None, "subgoal": None, "instruction": None,
        "instruction_digest": None, "call_id": None, "request_id": None})
    return rec


# --- labels --------------------------------------------------------------------------------------------------


def test_success_labels_follow_the_failure_rules_in_order():
    cases = {
        "broken": success("b", control=True, assisted=False),
        "kept": success("k", control=True, assisted=True),
        "not_reproduced": success("n", control=False, assisted=True),
        "also_not_reproduced": success("n2", control=False, assisted=False),
        "unknown": with_arms(success("u"), interrupted=True),
        "not_exposed": ended_early(success("e")),
    }
    dev = success("d", control=False, assisted=False)
    dev.arms["control"].fingerprint = "0" * 64
    cases["initial_state_deviation"] = dev
    got = {name: classify(rec) for name, rec in cases.items()}
    assert {n: v.label for n, v in got.items()} == {
        "broken": "broken", "kept": "kept", "not_reproduced": "not_reproduced", "also_not_reproduced": "not_reproduced",
        "unknown": "unknown", "not_exposed": "kept", "initial_state_deviation": "initial_state_deviation"}
    assert got["not_exposed"].rule == 4 and not is_exposed("kept", 4)
    assert "before the query point" in got["not_exposed"].reason
    assert is_exposed("kept", 9) and is_exposed("unknown", 2)
    # The same arms as a historical failure keep today's labels.
    assert classify(make_case("f", control_success=True, assisted_success=False)).label == "not_rescued"


def test_failures_only_summary_is_todays():
    records, _ = build_seed_cohort()
    verdicts = [classify(r) for r in records]
    before = summarize(records, verdicts).model_dump(mode="json")
    assert "harm" not in before
    assert (before["r"], before["m"], before["e"], before["n"]) == (56, 874, 869, 1004)


def test_a_mixed_study_keeps_failures_apart_and_counts_exposure():
    failures = [make_case(f"f{i}", assisted_success=i < 3) for i in range(10)]
    successes = ([success(f"b{i}", assisted=False) for i in range(2)] + [success(f"k{i}") for i in range(5)]
                 + [ended_early(success(f"e{i}")) for i in range(3)])
    records = failures + successes
    summary = summarize(records, [classify(r) for r in records])
    assert summary.n == 10 and summary.r == 3  # failures only, as before
    harm = summary.harm.of("assisted")
    assert harm.n == 10 and harm.exposed == 7 and harm.m == 7
    assert harm.counts == {"broken": 2, "kept": 8, "not_reproduced": 0, "unknown": 0, "initial_state_deviation": 0}
    assert harm.harm.diff == pytest.approx(2 / 7)  # over the exposed, never diluted by the unexposed
    assert harm.rescue.diff == pytest.approx(3 / 10)
    # No frame: the cases are the whole evaluation, a census: (10 * 0.3 - 10 * 0.2) / 20, exactly.
    assert harm.net.change == pytest.approx((3 - 2) / 20)
    assert harm.net.change_ci == pytest.approx((0.05, 0.05))
    framed = summarize(records, [classify(r) for r in records],
                       frame=SamplingFrame(failures=10, successes=100, sampled=10, seed=1)).harm.of("assisted")
    assert framed.net.change == pytest.approx((3 - 100 * 0.2) / 110)
    lo, hi = framed.net.change_ci
    assert lo < framed.net.change < hi


# --- the estimator ---------------------------------------------------------------------------------------------


def test_case_score_and_its_within_variance():
    assert case_score(1, 0, 1) == CaseScore(1.0, 0.0)
    s = case_score(2, 1, 4)
    assert s.score == pytest.approx(0.25)
    assert s.variance == pytest.approx((0.5 * 0.5 + 0.25 * 0.75) / 3)
    with pytest.raises(ValueError):
        case_score(5, 0, 4)


def test_net_change_against_an_independent_computation():
    rng = np.random.default_rng(3)
    k, F, S = 4, 400, 900
    fa, fc = rng.integers(0, k + 1, 60), rng.integers(0, k + 1, 60)
    sa, sc = rng.integers(0, k + 1, 45), rng.integers(0, k + 1, 45)
    got = net_change([case_score(a, c, k) for a, c in zip(fa, fc)], F,
                     [case_score(c, a, k) for a, c in zip(sa, sc)], S)
    # Horvitz-Thompson totals and the textbook two-stage variance, computed with numpy arrays.
    x, y = (fa - fc) / k, (sc - sa) / k
    vx = ((fa / k) * (1 - fa / k) + (fc / k) * (1 - fc / k)) / (k - 1)
    vy = ((sa / k) * (1 - sa / k) + (sc / k) * (1 - sc / k)) / (k - 1)
    total = F * x.sum() / x.size - S * y.sum() / y.size
    var_total = (F**2 * ((1 - x.size / F) * x.var(ddof=1) / x.size + vx.sum() / (F * x.size))
                 + S**2 * ((1 - y.size / S) * y.var(ddof=1) / y.size + vy.sum() / (S * y.size)))
    from scipy.stats import norm

    half = norm.ppf(0.975) * math.sqrt(var_total) / (F + S)
    assert got.change == pytest.approx(total / (F + S))
    assert got.change_ci == pytest.approx((total / (F + S) - half, total / (F + S) + half))
    assert got.base_rate == pytest.approx(S / (F + S))


def test_a_census_of_fixed_outcomes_has_no_sampling_error_and_fpc_narrows():
    scores = [CaseScore(1.0, 0.0)] * 3 + [CaseScore(0.0, 0.0)] * 7
    census = stratum(scores, 10)
    assert census.variance == 0.0
    part, whole = stratum(scores, 20), stratum(scores, 10**9)
    assert 0 < part.variance < whole.variance
    assert whole.variance == pytest.approx(np.var([1.0] * 3 + [0.0] * 7, ddof=1) / 10, rel=1e-6)
    # A stratum the evaluation has but the study never replayed: no figure, not zero.
    assert net_change([], 50, scores, 10).change is None


@pytest.mark.parametrize(("k", "n_f", "n_s"), [(1, 120, 90), (3, 60, 150)])
def test_interval_covers_a_known_net_change(k, n_f, n_s):
    """A simulated evaluation with known per-episode probabilities: the interval covers the true net change at
    about its nominal rate, and the estimate is unbiased."""
    rng = np.random.default_rng(20261205 + k)
    F, S = 400, 600
    if k == 1:  # a seeded policy: each episode's outcome under each arm is fixed
        fa, fc = (rng.random(F) < 0.2).astype(float), np.zeros(F)
        sc = np.ones(S)
        sa = np.where(rng.random(S) < 0.15, 0.0, 1.0)
    else:
        fa, fc = rng.beta(1, 4, F), rng.beta(1, 9, F)
        sc, sa = rng.beta(9, 1, S), rng.beta(6, 2, S)
    reached = rng.random(S) < 0.7  # the others end before q: harm 0 by construction
    truth = (np.sum(fa - fc) - np.sum(np.where(reached, sc - sa, 0.0))) / (F + S)
    hits, estimates = 0, []
    for _ in range(800):
        fi = rng.choice(F, n_f, replace=False)
        si = rng.choice(S, n_s, replace=False)
        f_scores = [case_score(int(a), int(c), k) for a, c in zip(rng.binomial(k, fa[fi]), rng.binomial(k, fc[fi]))]
        s_scores = [case_score(int(c), int(a), k) if reached[i] else CaseScore(0.0, 0.0)
                    for i, c, a in zip(si, rng.binomial(k, sc[si]), rng.binomial(k, sa[si]))]
        got = net_change(f_scores, F, s_scores, S)
        estimates.append(got.change)
        hits += got.change_ci[0] <= truth <= got.change_ci[1]
    assert 0.92 <= hits / 800 <= 0.975
    assert np.mean(estimates) == pytest.approx(truth, abs=0.003)


# --- the sample and its frame ------------------------------------------------------------------------------------


def test_allocation_and_seeded_stratified_sample():
    assert allocate([10, 30, 60], 10) == [1, 3, 6]
    assert sum(allocate([3, 3, 3], 4)) == 4
    cases = [Case(case_id=f"s{t}-{i}", suite="libero_object", task_id=t, init_state_index=i, env_seed=7, horizon=280)
             for t in range(3) for i in range(10 * (t + 1))]
    first, again = sample_successes(cases, 12, 5), sample_successes(cases, 12, 5)
    assert first == again and len(first) == 12
    assert [sum(c.task_id == t for c in first) for t in range(3)] == [2, 4, 6]
    assert sample_successes(cases, 12, 6) != first
    assert sample_successes(cases, None, 5) == cases
    tagged = [c.model_copy(update={"tags": frame_tags(SamplingFrame(failures=9, successes=60, sampled=12, seed=5),
                                                      SamplingFrame(failures=3, successes=10))}) for c in first]
    assert frame_of(tagged) == SamplingFrame(failures=9, successes=60, sampled=12, seed=5)
    assert frame_of(cases) is None


def test_each_breakdown_carries_the_primary_against_control():
    records = ([make_case(f"a{i}", group="A", assisted_success=i < 2) for i in range(5)]
               + [make_case(f"b{i}", group="B", control_success=i < 1) for i in range(4)])
    s = summarize(records, [classify(r) for r in records])
    a, b = s.per_group["A"].versus_control, s.per_group["B"].versus_control
    assert (a.k, a.pairs.first_only, a.pairs.second_only) == (5, 2, 0)
    assert (b.k, b.pairs.first_only, b.pairs.second_only) == (4, 0, 1)
    assert s.per_task["t"].versus_control.pairs.first_only == 2
