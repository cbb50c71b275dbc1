"""K continuations per arm (DESIGN §13): the paired estimate, its reduction to McNemar, and the mode's resolution.

The p-value is checked against scipy's own exact permutation test and binomial test, the interval against scipy's
percentile bootstrap: independent computations of the same quantities.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.case_records import make_case, make_trace, with_arms

from rescue.core.arms import base_arm, continuation, continuation_arm, continuation_seed
from rescue.core.classify import classify
from rescue.core.configuration.config import StudyConfig
from rescue.core.figures.continuations import bootstrap_ci, estimate, sign_flip_p
from rescue.core.digest import digest_text
from rescue.core.configuration.identity import IdentityError, resolve_fork, resolve_stateless
from rescue.core.figures.stats import summarize
from rescue.core.figures.exact_stats import mcnemar_exact

pytestmark = pytest.mark.fast


# --- the statistics ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("b, c, ties", [(0, 0, 5), (3, 0, 2), (53, 47, 500), (1, 9, 0), (12, 12, 3), (20, 2, 30)])
def test_with_one_continuation_the_sign_flip_test_is_the_exact_mcnemar_test(b, c, ties):
    pairs = [(1, 0)] * b + [(0, 1)] * c + [(0, 0)] * ties
    assert estimate(pairs, 1).p == pytest.approx(mcnemar_exact(b, c), rel=1e-12, abs=1e-15)
    if pairs:
        assert estimate(pairs, 1).diff == pytest.approx((b - c) / len(pairs))


def test_the_sign_flip_p_is_scipys_exact_permutation_test():
    from scipy.stats import permutation_test

    rng = np.random.default_rng(7)
    for _ in range(25):
        n, k = int(rng.integers(2, 12)), int(rng.integers(2, 6))
        a, b = rng.integers(0, k + 1, n), rng.integers(0, k + 1, n)
        ref = permutation_test((a / k, b / k), lambda x, y: np.sum(x - y), permutation_type="samples",
                               n_resamples=np.inf, alternative="two-sided").pvalue
        assert sign_flip_p(list(a - b)) == pytest.approx(ref, rel=1e-9)
        assert estimate(list(zip(a, b)), k).p == pytest.approx(ref, rel=1e-9)


def test_the_interval_is_a_percentile_bootstrap_over_cases():
    from scipy.stats import bootstrap

    rng = np.random.default_rng(3)
    values = rng.integers(-4, 5, 300) / 4
    ours = bootstrap_ci(list(values))
    theirs = bootstrap(
        (values,), np.mean, method="percentile", n_resamples=20_000, random_state=np.random.default_rng(11)
    ).confidence_interval
    assert ours[0] == pytest.approx(theirs.low, abs=0.01) and ours[1] == pytest.approx(theirs.high, abs=0.01)
    assert bootstrap_ci(list(values)) == ours  # seeded: re-derived bit for bit
    assert bootstrap_ci([]) is None


def test_an_estimate_over_no_case_says_nothing_and_counts_outside_k_are_refused():
    empty = estimate([], 4)
    assert (empty.k, empty.diff, empty.diff_ci, empty.p) == (0, None, None, 1.0)
    with pytest.raises(ValueError, match="outside 0..4"):
        estimate([(5, 0)], 4)


# --- arm names and seeds ------------------------------------------------------------------------------------


def test_continuation_arms_are_named_after_their_arm():
    assert continuation_arm("assisted", 1) == "assisted" and continuation_arm("assisted:gpt", 3) == "assisted:gpt#3"
    assert (continuation("sham#12"), base_arm("sham#12"), continuation("control")) == (12, "sham", 1)
    with pytest.raises(ValueError):
        continuation("control#1")  # the first continuation has no suffix: one name per arm
    seeds = {continuation_seed(7, k) for k in range(2, 10)}
    assert len(seeds) == 8 and continuation_seed(7, 2) != continuation_seed(8, 2)
    assert StudyConfig(continuations=3).case_arms == (
        "control", "assisted", "control#2", "assisted#2", "control#3", "assisted#3")


# --- the mode ------------------------------------------------------------------------------------------------


def test_the_mode_forks_at_q_without_rng_control_or_with_continuations_and_a_stateful_sampler_is_refused():
    assert resolve_fork(None, rng_control=False, continuations=1) is True
    assert resolve_fork(None, rng_control=True, continuations=1) is False
    assert resolve_fork(None, rng_control=True, continuations=4) is True
    assert resolve_fork(False, rng_control=False, continuations=1) is False  # said so: kept (and stopped early)
    assert resolve_stateless(None, {}, rng_control=False) is True  # openpi's server: its Policy.infer keeps none
    assert resolve_stateless(None, {"stateless": False}, rng_control=True) is False
    assert resolve_stateless(None, {}, rng_control=True) is None
    with pytest.raises(IdentityError, match="keeps state between calls"):
        resolve_stateless(False, {}, rng_control=False)
    with pytest.raises(IdentityError, match="the server announces stateless = false"):
        resolve_stateless(None, {"stateless": False}, rng_control=False)


def test_continuations_need_the_fork_and_a_config_written_before_them_hashes_as_before():
    from rescue.core.configuration.config_files import ConfigError, validate_config

    with pytest.raises(ConfigError, match="need fork_at_q"):
        validate_config({"continuations": 4, "fork_at_q": False}, "study.toml")
    config = StudyConfig(fork_at_q=False)
    older = config.model_dump(mode="json")
    for key in ("continuations",):
        older.pop(key)
    for key in ("stateless", "rng_control"):
        older["policy"].pop(key)
    assert StudyConfig.model_validate(older).sha256() == config.sha256()
    assert StudyConfig(fork_at_q=True, continuations=2).sha256() != StudyConfig(fork_at_q=True).sha256()


# --- classification ------------------------------------------------------------------------------------------


def _continued(case_id: str, control: list[bool], assisted: list[bool]):
    """A forked case with K continuations of control and assisted (every one sound)."""
    rec = make_case(case_id, control_success=control[0], assisted_success=assisted[0])
    q_state = digest_text(f"{case_id}-state-at-q")
    for arm in rec.arms.values():
        arm.mode, arm.q_state = "fork", q_state
    arms = {}
    for k in range(2, len(control) + 1):
        c = rec.control.model_copy(update={"arm": f"control#{k}", "success": control[k - 1], "trace": make_trace("control")})
        a = rec.assisted.model_copy(update={"arm": f"assisted#{k}", "success": assisted[k - 1],
                                            "trace": list(rec.assisted.trace)})
        arms[c.arm], arms[a.arm] = c, a
    return with_arms(rec, arms, {name: rec.receipt for name in arms if name.startswith("assisted")})


def test_each_arm_counts_its_successes_of_k_and_the_label_comes_from_the_first():
    rec = _continued("c", control=[False, True, False, False], assisted=[True, True, False, True])
    v = classify(rec)
    assert (v.label, v.rule) == ("rescued", 9)  # continuation 1 of each: control failed, assisted succeeded
    assert (v.continuations["control"].successes, v.continuations["assisted"].successes) == (1, 3)
    assert v.continuations["assisted"].continuations == 4 and v.continuations["assisted"].in_e
    # A continuation that stood elsewhere at q leaves the case out of the estimate, not out of N.
    moved = rec.arms["assisted#3"].model_copy(update={"q_state": digest_text("elsewhere")})
    v = classify(with_arms(rec, {"assisted#3": moved}))
    assert v.label == "rescued" and not v.continuations["assisted"].in_m


def test_the_studys_estimate_is_the_mean_paired_difference_over_cases_whose_continuations_all_count():
    rows = [([False] * 4, [True, True, False, True]), ([False, True, False, False], [False] * 4),
            ([False] * 4, [True] * 4)]
    records = [_continued(f"c{i}", c, a) for i, (c, a) in enumerate(rows)]
    s = summarize(records, [classify(r) for r in records])
    e = s.versus_control.estimate
    assert (e.k, e.continuations) == (3, 4)
    diffs = [(3 - 0) / 4, (0 - 1) / 4, (4 - 0) / 4]
    assert e.diff == pytest.approx(np.mean(diffs)) and e.first_rate == pytest.approx(7 / 12)
    assert e.p == pytest.approx(sign_flip_p([3, -1, 4]))
    assert s.reproduction.controls == 12 and s.reproduction.failed == 11
    # One continuation per arm: no estimate at all (the McNemar test is the same test).
    plain = [make_case(f"p{i}") for i in range(3)]
    assert summarize(plain, [classify(r) for r in plain]).versus_control.estimate is None


def test_an_interrupted_case_counts_the_continuations_that_ran_not_k():
    rec = _continued("c", control=[False, True, False], assisted=[True, False, True])
    cut = with_arms(rec, {"assisted": None, "assisted#2": None, "assisted#3": None, "control#3": None}, interrupted=True)
    v = classify(cut)
    assert v.label == "unknown"
    assert (v.continuations["assisted"].successes, v.continuations["assisted"].continuations) == (0, 0)
    assert v.continuations["control"].continuations == 2 and not v.continuations["control"].in_m
    # The study still summarizes, the interrupted case in N and out of the estimate.
    whole = _continued("d", control=[False] * 3, assisted=[True] * 3)
    s = summarize([cut, whole], [classify(cut), classify(whole)])
    assert s.n == 2 and s.versus_control.estimate.k == 1
