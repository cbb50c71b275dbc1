"""A perturbed suite's success against its base suite's, with the test the episodes allow (DESIGN §15).

Paired only where the episodes are identical: the same model and, index for index, the same initial
state (the catalog measures it; `<suite>@base-inits` is so by construction). Then each base episode
has its perturbed twin, and the comparison is exact McNemar on the discordant pairs with Newcombe's
paired interval. Anywhere else (every LIBERO-PRO suite as shipped: none shares an initial state with
its base) the two are independent samples of episodes: the difference of two proportions with
Newcombe's hybrid score interval (1998, method 10: two Wilson intervals) and Fisher's exact test.
A rescue study's sham comparison is within one suite and one case, so it stays paired (`stats`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from rescue.core.figures.exact_stats import mcnemar_exact, paired_diff_ci, wilson_interval

# Hypergeometric probabilities within this relative distance of the observed one count as "as extreme"
# (the floating-point allowance R's fisher.test and scipy use).
_FISHER_TOLERANCE = 1 + 1e-7


def _counts(x: int, n: int, name: str) -> None:
    if isinstance(x, bool) or isinstance(n, bool) or not (isinstance(x, int) and isinstance(n, int)) or not 0 <= x <= n:
        raise ValueError(f"{name}: need 0 <= successes <= episodes (integers), got {x!r} of {n!r}")


def fisher_exact(x1: int, n1: int, x2: int, n2: int) -> float:
    """Two-sided Fisher's exact p-value for x1/n1 against x2/n2 (independent samples): the probability, given
    both margins, of a table at most as likely as the observed one."""
    _counts(x1, n1, "first")
    _counts(x2, n2, "second")
    total, successes = n1 + n2, x1 + x2
    if total == 0:
        return 1.0
    whole = math.comb(total, successes)

    def prob(k: int) -> float:
        return math.comb(n1, k) * math.comb(n2, successes - k) / whole

    observed = prob(x1)
    lo, hi = max(0, successes - n2), min(n1, successes)
    p = sum(q for q in (prob(k) for k in range(lo, hi + 1)) if q <= observed * _FISHER_TOLERANCE)
    return min(1.0, p)


def newcombe_unpaired_ci(x1: int, n1: int, x2: int, n2: int, confidence: float = 0.95) -> tuple[float, float]:
    """Newcombe's hybrid score interval (1998, method 10) for x1/n1 - x2/n2, independent samples: built from
    each proportion's Wilson interval. (nan, nan) when either sample is empty."""
    _counts(x1, n1, "first")
    _counts(x2, n2, "second")
    if n1 == 0 or n2 == 0:
        return math.nan, math.nan
    p1, p2 = x1 / n1, x2 / n2
    l1, u1 = wilson_interval(x1, n1, confidence)
    l2, u2 = wilson_interval(x2, n2, confidence)
    d = p1 - p2
    return (max(-1.0, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)),
            min(1.0, d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)))


class SuiteComparison(BaseModel):
    """One row of a robustness table: a perturbed suite's success against its base suite's, and the test used."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    design: Literal["paired", "unpaired"]
    """`paired`: identical episodes, each base episode against its perturbed twin; `unpaired`: two independent
    samples of episodes (same tasks and initial-state indices at most, other initial states or another model)."""
    test: str
    """The test and the interval, in words (for a table's label)."""
    base_successes: int
    """Successes in the base suite's episodes compared."""
    base_n: int
    """Base episodes compared."""
    successes: int
    """Successes in the perturbed suite's episodes compared."""
    n: int
    """Perturbed episodes compared."""
    diff: float | None
    """Perturbed success rate minus the base's; None when either side is empty."""
    ci: tuple[float, float] | None
    """The interval for `diff` (Newcombe's paired or hybrid score interval); None when either side is empty."""
    p: float
    """Two-sided p-value: exact McNemar (paired) or Fisher's exact (unpaired)."""
    perturbed_only: int | None = None
    """Paired: episodes where only the perturbed twin succeeded; None when unpaired."""
    base_only: int | None = None
    """Paired: episodes where only the base twin succeeded; None when unpaired."""
    confidence: float = 0.95
    """The interval's confidence level."""


def compare_unpaired(base: tuple[int, int], perturbed: tuple[int, int], confidence: float = 0.95) -> SuiteComparison:
    """(successes, episodes) of each side, independent samples: difference, hybrid score interval, Fisher's p."""
    (x2, n2), (x1, n1) = base, perturbed
    empty = n1 == 0 or n2 == 0
    return SuiteComparison(
        design="unpaired", test="unpaired: difference of two proportions, Newcombe hybrid score CI, Fisher's exact p",
        base_successes=x2, base_n=n2, successes=x1, n=n1,
        diff=None if empty else x1 / n1 - x2 / n2, ci=None if empty else newcombe_unpaired_ci(x1, n1, x2, n2, confidence),
        p=fisher_exact(x1, n1, x2, n2), confidence=confidence,
    )


def compare_paired(pairs: list[tuple[bool, bool]], confidence: float = 0.95) -> SuiteComparison:
    """(base success, perturbed success) per identical episode: exact McNemar and Newcombe's paired interval."""
    both = sum(b and p for b, p in pairs)
    base_only = sum(b and not p for b, p in pairs)
    perturbed_only = sum(p and not b for b, p in pairs)
    n = len(pairs)
    return SuiteComparison(
        design="paired", test="paired on identical episodes: exact McNemar p, Newcombe paired CI",
        base_successes=both + base_only, base_n=n, successes=both + perturbed_only, n=n,
        diff=(perturbed_only - base_only) / n if n else None,
        ci=paired_diff_ci(perturbed_only, base_only, n, confidence, both_success=both) if n else None,
        p=mcnemar_exact(perturbed_only, base_only), perturbed_only=perturbed_only, base_only=base_only,
        confidence=confidence,
    )


def compare_with_base(
    base: Mapping[tuple[int, int], bool], perturbed: Mapping[tuple[int, int], bool], identical_episodes: bool,
    confidence: float = 0.95,
) -> SuiteComparison:
    """Episode outcomes keyed by (base task id, initial-state index), each side's own episodes: paired over the
    keys both have when the episodes are identical (the catalog says), else every episode of each, unpaired."""
    if identical_episodes:
        return compare_paired([(base[k], perturbed[k]) for k in sorted(base.keys() & perturbed.keys())], confidence)
    return compare_unpaired((sum(base.values()), len(base)), (sum(perturbed.values()), len(perturbed)), confidence)
