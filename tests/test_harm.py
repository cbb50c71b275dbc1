"""Historical successes (DESIGN §17): their labels under the failures' rules, exposure, harm and the net change."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers.case_records import build_seed_cohort, make_case, with_arms

from rescue.core.classify import classify
from rescue.core.figures.evalues import bounds, evidence
from rescue.core.figures.harm import case_score, net_change
from rescue.core.success_labels import is_exposed
from rescue.core.manifest import Case
from rescue.core.figures.stats import summarize
from rescue.core.figures.success_sample import (
    DESIGN,
    SamplingFrame,
    allocate,
    frame_disagreement,
    frame_of,
    frame_refusal,
    frame_tags,
    sample_successes,
)

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
    verdicts = [classify(r) for r in records]
    summary = summarize(records, verdicts, replays_exact=True)
    assert summary.n == 10 and summary.r == 3  # failures only, as before
    harm = summary.harm.of("assisted")
    assert harm.n == 10 and harm.exposed == 7 and harm.m == 7 and harm.unreached == 3
    # `kept` counts the successes the query point reached; the three that ended before it are said apart.
    assert harm.counts == {"broken": 2, "kept": 5, "not_reproduced": 0, "unknown": 0, "initial_state_deviation": 0}
    assert harm.harm.diff == pytest.approx(2 / 7)  # over the exposed, never diluted by the unexposed
    assert harm.rescue.diff == pytest.approx(3 / 10)
    # No frame: the cases are the whole evaluation; a census of exact replays: (10 * 0.3 - 10 * 0.2) / 20, exactly.
    net = harm.net
    assert net.change == pytest.approx((3 - 2) / 20)
    assert net.these_episodes.exact and (net.these_episodes.low, net.these_episodes.high) == pytest.approx((0.05, 0.05))
    # ... and still a benchmark interval: 20 episodes say little about the suite's other initial states.
    assert net.benchmark.low < 0.05 - 0.1 and net.benchmark.high > 0.05 + 0.1 and not net.benchmark.exact
    # A policy that samples without RNG control: the census is not exact, its draws are.
    noisy = summarize(records, verdicts).harm.of("assisted").net
    assert not noisy.these_episodes.exact and noisy.these_episodes.low < 0.05 < noisy.these_episodes.high
    # A frame whose sample the design of this version drew: extrapolated, with an interval wider than the census.
    framed = summarize(records, verdicts, replays_exact=True,
                       frame=SamplingFrame(failures=10, successes=100, sampled=10, seed=1, design=DESIGN)).harm.of("assisted")
    assert framed.net.change == pytest.approx((3 - 100 * 0.2) / 110)
    lo, hi = framed.net.these_episodes.low, framed.net.these_episodes.high
    assert lo < framed.net.change < hi and hi - lo > 0.2
    # The same sample drawn by the sampler before this version (largest remainder, ties to the first task): refused.
    old = summarize(records, verdicts, frame=SamplingFrame(failures=10, successes=100, sampled=10, seed=1)).harm.of("assisted")
    assert old.net.change is None and "sampler before this version" in old.net.refused
    assert old.harm.diff == pytest.approx(2 / 7)  # the harm over the replayed successes stands


def test_pilot_failures_leave_the_frame_and_are_never_extrapolated():
    failures = [make_case(f"f{i}", assisted_success=i < 3) for i in range(10)]
    pilot = make_case("p0", assisted_success=True)
    pilot.pilot = True
    successes = [success(f"k{i}") for i in range(4)]
    records = failures + [pilot] + successes
    s = summarize(records, [classify(r) for r in records], replays_exact=True,
                  frame=SamplingFrame(failures=11, successes=4, design=DESIGN))
    net = s.harm.of("assisted").net
    assert s.harm.pilot_failures == 1 and s.harm.frame.failures == 10
    assert net.episodes == 14 and net.change == pytest.approx(3 / 14) and net.these_episodes.exact
    assert s.pilot is not None and s.pilot.n == 1  # reported apart


# --- the estimator ---------------------------------------------------------------------------------------------


def test_case_score():
    assert case_score(1, 0, 1) == 1.0
    assert case_score(2, 1, 4) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        case_score(5, 0, 4)


def _independent_log_e(x: np.ndarray, m: float) -> float:
    """The mixture e-value of evalues.py's docstring, computed here path by path with plain Python floats."""
    paths = []
    for u in np.arange(1, 41) / 40 * 0.99:
        for lam in (u / (m + 1), -u / (1 - m)):
            paths.append(math.fsum(math.log1p(lam * (xi - m)) for xi in x))
    top = max(paths)
    return top + math.log(sum(math.exp(p - top) for p in paths) / len(paths))


def test_the_interval_of_one_mean_against_an_independent_computation():
    rng = np.random.default_rng(3)
    x = rng.choice([-1.0, 0.0, 0.0, 0.5, 1.0], 25)
    lo, hi = bounds(evidence(x))
    threshold = math.log(20)
    # Every mean inside is kept by the independent computation, and the first grid points outside are rejected.
    for m in np.linspace(lo + 0.0025, hi - 0.0025, 9):
        assert _independent_log_e(x, m) < threshold
    assert _independent_log_e(x, lo) >= threshold or _independent_log_e(x, lo + 0.0025) < threshold
    assert _independent_log_e(x, max(-0.999, lo - 0.0025)) >= threshold
    assert _independent_log_e(x, min(0.999, hi + 0.0025)) >= threshold
    assert lo < x.mean() < hi


def test_agreeing_scores_are_not_certainty_and_the_census_is():
    zeros = [0.0] * 4
    lo, hi = bounds(evidence(zeros))
    assert lo < -0.5 and hi > 0.5  # four agreeing scores of an unbounded population
    # Of a population of 12 by exact replays, 4 say less than 8, 8 less than 12, and 12 all.
    widths = [bounds(evidence([0.0] * n, population=12, exact_values=True))[1] for n in (4, 8, 11)]
    assert widths[0] > widths[1] > widths[2] > 0
    assert widths[2] == pytest.approx(1 / 12, abs=0.003)  # the one unseen episode could be anything
    assert bounds(evidence(zeros + [1.0] * 8, population=12, exact_values=True)) == pytest.approx((8 / 12, 8 / 12))
    # Noisy scores (a policy that samples) are never a census.
    assert bounds(evidence([0.0] * 12, population=12))[1] > 0.2


def test_net_change_point_estimate_and_both_intervals():
    rng = np.random.default_rng(3)
    k, F, S = 4, 400, 900
    fa, fc = rng.integers(0, k + 1, 60), rng.integers(0, k + 1, 60)
    sa, sc = rng.integers(0, k + 1, 45), rng.integers(0, k + 1, 45)
    got = net_change([case_score(a, c, k) for a, c in zip(fa, fc)], F, [case_score(c, a, k) for a, c in zip(sa, sc)], S)
    total = F * np.mean((fa - fc) / k) - S * np.mean((sc - sa) / k)
    assert got.change == pytest.approx(total / (F + S))
    assert got.base_rate == pytest.approx(S / (F + S))
    these, bench = got.these_episodes, got.benchmark
    assert these.low < got.change < these.high and bench.low < got.change < bench.high
    assert not these.exact and not bench.exact
    # A stratum the evaluation has but the study never replayed: no figure, not zero, and the reason.
    empty = net_change([], 50, [0.0] * 10, 10)
    assert empty.change is None and empty.these_episodes is None and "failure" in empty.refused


# --- the sample and its frame ------------------------------------------------------------------------------------


def test_allocation_gives_every_unit_the_same_chance_and_ties_to_the_seed():
    assert allocate([10, 30, 60], 10, 0) == [1, 3, 6]  # whole quotas are met exactly
    assert all(sum(allocate([3, 3, 3], 4, seed)) == 4 for seed in range(50))
    # Four tasks of three, two draws: every task drawn in about half the seeds (largest remainder: tasks 0, 1 only).
    drawn = np.array([allocate([3, 3, 3, 3], 2, seed) for seed in range(2000)])
    assert set(drawn.ravel()) <= {0, 1}
    assert np.all(np.abs(drawn.mean(axis=0) - 0.5) < 0.05)
    # Quotas 1.5, 1.5, 1.5, 1.5 of six: each task the floor or the ceiling, in expectation the quota.
    six = np.array([allocate([3, 3, 3, 3], 6, seed) for seed in range(2000)])
    assert set(six.ravel()) <= {1, 2} and np.all(np.abs(six.mean(axis=0) - 1.5) < 0.05)


def test_seeded_stratified_sample_and_its_frame():
    cases = [Case(case_id=f"s{t}-{i}", suite="libero_object", task_id=t, init_state_index=i, env_seed=7, horizon=280)
             for t in range(3) for i in range(10 * (t + 1))]
    first, again = sample_successes(cases, 12, 5), sample_successes(cases, 12, 5)
    assert first == again and len(first) == 12
    assert [sum(c.task_id == t for c in first) for t in range(3)] == [2, 4, 6]
    assert sample_successes(cases, 12, 6) != first
    assert sample_successes(cases, None, 5) == cases
    frame = SamplingFrame(failures=9, successes=60, sampled=12, seed=5, design=DESIGN)
    tagged = [c.model_copy(update={"tags": frame_tags(frame, SamplingFrame(failures=3, successes=10))}) for c in first]
    assert frame_of(tagged) == frame and frame_disagreement(tagged) is None
    assert frame_of(cases) is None
    edited = [tagged[0].model_copy(update={"tags": {**tagged[0].tags, "frame_successes": 61}})] + tagged[1:]
    assert "frame_successes" in frame_disagreement(edited)


def test_a_selection_that_is_not_the_declared_sample_is_refused_naming_it():
    design = dict(design=DESIGN)
    assert frame_refusal(SamplingFrame(failures=18, successes=6, **design), 18, 6) is None
    limited = frame_refusal(SamplingFrame(failures=18, successes=6, limit=2, **design), 2, 6)
    assert "first 2 of the evaluation's 18" in limited and "--limit 2" in limited
    assert "hand-made" in frame_refusal(SamplingFrame(failures=18, successes=6, **design), 10, 6)
    assert "hand-made" in frame_refusal(SamplingFrame(failures=18, successes=60, sampled=6, seed=1, **design), 18, 5)
    assert frame_refusal(SamplingFrame(failures=18, successes=60, sampled=6, seed=1, failures_sampled=9,
                                       failure_seed=1, **design), 9, 6) is None


def test_each_breakdown_carries_the_primary_against_control():
    records = ([make_case(f"a{i}", group="A", assisted_success=i < 2) for i in range(5)]
               + [make_case(f"b{i}", group="B", control_success=i < 1) for i in range(4)])
    s = summarize(records, [classify(r) for r in records])
    a, b = s.per_group["A"].versus_control, s.per_group["B"].versus_control
    assert (a.k, a.pairs.first_only, a.pairs.second_only) == (5, 2, 0)
    assert (b.k, b.pairs.first_only, b.pairs.second_only) == (4, 0, 1)
    assert s.per_task["t"].versus_control.pairs.first_only == 2
