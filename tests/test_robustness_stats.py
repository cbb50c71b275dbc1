"""The robustness table's statistics against independent computations: scipy's Fisher test, Wilson
intervals found by root-finding on the score equation, and the published values of Newcombe (1998)."""

from __future__ import annotations

import itertools
import math

import pytest
from scipy.optimize import brentq
from scipy.stats import binomtest, norm
from scipy.stats import fisher_exact as scipy_fisher

from rescue.core.figures.robustness import compare_paired, compare_unpaired, compare_with_base, fisher_exact, newcombe_unpaired_ci

pytestmark = pytest.mark.fast

GRID = [(x1, n1, x2, n2) for n1, n2 in ((1, 1), (5, 7), (10, 10), (20, 20), (13, 31))
        for x1, x2 in itertools.product(range(n1 + 1), range(n2 + 1))]


def test_fisher_equals_scipys_on_every_table_of_the_grid():
    for x1, n1, x2, n2 in GRID[::4] + [(250, 500, 198, 500), (164, 227, 14, 227)]:
        ours = fisher_exact(x1, n1, x2, n2)
        theirs = scipy_fisher([[x1, n1 - x1], [x2, n2 - x2]], alternative="two-sided").pvalue
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-15), (x1, n1, x2, n2)


def _wilson_by_root_finding(x: int, n: int, confidence: float) -> tuple[float, float]:
    """The Wilson interval as the set of p whose score statistic |x/n - p| / sqrt(p(1-p)/n) is at most z."""
    z, phat = norm.ppf(0.5 + confidence / 2), x / n

    def score(p: float) -> float:
        return abs(phat - p) - z * math.sqrt(p * (1 - p) / n)

    inside = min(max(phat, 1e-9), 1 - 1e-9)  # a point of the interval where the score is below z
    lo = 0.0 if x == 0 else brentq(score, 0.0, inside, xtol=1e-14)
    hi = 1.0 if x == n else brentq(score, inside, 1.0, xtol=1e-14)
    return lo, hi


def test_newcombes_interval_from_wilson_bounds_found_by_root_finding():
    for x1, n1, x2, n2 in GRID[::5] + [(11, 20, 5, 20), (164, 227, 14, 227)]:
        l1, u1 = _wilson_by_root_finding(x1, n1, 0.95)
        l2, u2 = _wilson_by_root_finding(x2, n2, 0.95)
        d = x1 / n1 - x2 / n2
        expected = (d - math.hypot(x1 / n1 - l1, u2 - x2 / n2), d + math.hypot(u1 - x1 / n1, x2 / n2 - l2))
        assert newcombe_unpaired_ci(x1, n1, x2, n2) == pytest.approx(expected, abs=1e-9), (x1, n1, x2, n2)


# Newcombe, "Interval estimation for the difference between independent proportions", Statistics in
# Medicine 17 (1998), Table II, method 10 (hybrid score), to the 4 decimals published.
@pytest.mark.parametrize(("x1", "n1", "x2", "n2", "lo", "hi"), [
    (56, 70, 48, 80, 0.0524, 0.3339), (9, 10, 3, 10, 0.1705, 0.8090), (6, 7, 2, 7, 0.0582, 0.8062),
    (5, 56, 0, 29, -0.0381, 0.1926), (0, 10, 0, 20, -0.1611, 0.2775), (0, 10, 0, 10, -0.2775, 0.2775),
    (10, 10, 0, 20, 0.6791, 1.0), (10, 10, 0, 10, 0.6075, 1.0),
])
def test_newcombes_published_values(x1, n1, x2, n2, lo, hi):
    assert newcombe_unpaired_ci(x1, n1, x2, n2) == pytest.approx((lo, hi), abs=5e-5)


def test_an_unpaired_row_says_so_and_carries_both_samples():
    row = compare_unpaired((11, 20), (5, 20))
    assert row.design == "unpaired" and "Fisher" in row.test and "Newcombe" in row.test
    assert (row.base_successes, row.base_n, row.successes, row.n) == (11, 20, 5, 20)
    assert row.diff == pytest.approx(-0.3) and row.ci[0] < -0.3 < row.ci[1]
    assert row.p == pytest.approx(scipy_fisher([[5, 15], [11, 9]]).pvalue)
    assert row.perturbed_only is None and row.base_only is None


def test_a_paired_row_is_mcnemar_on_the_discordant_twins():
    # (base, perturbed): 3 where only the base succeeded, 1 where only the perturbed twin did.
    pairs = [(True, True)] * 6 + [(True, False)] * 3 + [(False, True)] * 1 + [(False, False)] * 10
    row = compare_paired(pairs)
    assert row.design == "paired" and "McNemar" in row.test
    assert (row.base_only, row.perturbed_only, row.base_successes, row.successes, row.n) == (3, 1, 9, 7, 20)
    assert row.diff == pytest.approx(-0.1)
    assert row.p == pytest.approx(binomtest(1, 4, 0.5).pvalue)
    assert row.ci[0] < -0.1 < row.ci[1]


def test_the_catalogs_fact_decides_the_design_and_pairs_only_identical_keys():
    base = {(t, k): (t + k) % 2 == 0 for t in range(10) for k in (30, 31)}
    perturbed = {key: True for key in base}
    paired = compare_with_base(base, perturbed, identical_episodes=True)
    unpaired = compare_with_base(base, perturbed, identical_episodes=False)
    assert paired.design == "paired" and paired.n == 20 and (paired.perturbed_only, paired.base_only) == (10, 0)
    assert unpaired.design == "unpaired" and (unpaired.base_successes, unpaired.successes) == (10, 20)
    assert paired.p != unpaired.p  # the two tests differ on the same counts
    # Paired over the episodes both sides have: a base episode with no twin is left out, not counted as failed.
    partial = compare_with_base(base, {key: v for key, v in perturbed.items() if key[0] < 5}, identical_episodes=True)
    assert partial.n == 10


@pytest.mark.parametrize("args", [(3, 2, 1, 5), (-1, 5, 1, 5), (1, 5, 1.0, 5), (True, 5, 1, 5)])
def test_impossible_counts_are_refused(args):
    with pytest.raises(ValueError, match="successes <= episodes"):
        fisher_exact(*args)


def test_empty_samples_give_no_interval():
    assert all(math.isnan(v) for v in newcombe_unpaired_ci(0, 0, 3, 5))
    assert compare_unpaired((0, 0), (3, 5)).diff is None and fisher_exact(0, 0, 0, 0) == 1.0
