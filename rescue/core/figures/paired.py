"""One arm against another, paired case by case (DESIGN §3, §8, §11, §14, §18): the raw 2x2 and the comparison."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from rescue.core.figures.continuations import PairedEstimate
from rescue.core.figures.exact_stats import mcnemar_exact, paired_diff_ci


class PairedTable(BaseModel):
    """The raw 2x2 of two arms' outcomes over the cases where both are compared."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    first_only: int = 0
    """Cases where only the first arm succeeded (McNemar's b)."""
    second_only: int = 0
    """Cases where only the second arm succeeded (McNemar's c)."""
    both_success: int = 0
    """Cases where both arms succeeded."""
    both_fail: int = 0
    """Cases where both arms failed."""

    @classmethod
    def tally(cls, outcomes: Iterable[tuple[bool, bool]]) -> PairedTable:
        """The table of (first succeeded, second succeeded) per case."""
        counts = Counter((bool(a), bool(b)) for a, b in outcomes)
        return cls(first_only=counts[(True, False)], second_only=counts[(False, True)],
                   both_success=counts[(True, True)], both_fail=counts[(False, False)])

    @property
    def k(self) -> int:
        """The cases tallied."""
        return self.first_only + self.second_only + self.both_success + self.both_fail


class PairedComparison(BaseModel):
    """One arm against another, paired case by case: assisted vs control, assisted vs sham, advisor vs advisor,
    query point vs query point (DESIGN §3, §8, §11, §14)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    first: str
    """The first arm's name (its successes are McNemar's b)."""
    second: str
    """The second arm's name."""
    k: int
    """The cases compared: against control, the first arm's M; between two arms that ask, the cases where both
    are in E."""
    pairs: PairedTable
    """The raw 2x2 over those cases."""
    mcnemar_p: float
    """Two-sided exact McNemar p-value on the discordant cases; 1.0 without any."""
    holm_p: float | None = Field(default=None, exclude_if=lambda v: v is None)
    """`mcnemar_p` Holm-adjusted across the comparisons of its family (every pair of advisors; every pair of query
    points); absent: not one of a family."""
    diff: float | None
    """The first's minus the second's success rate over those cases; None when there are none."""
    diff_ci: tuple[float, float] | None
    """Newcombe square-and-add interval of `diff`, at the summary's confidence; None when there are no cases."""
    estimate: PairedEstimate | None = Field(default=None, exclude_if=lambda v: v is None)
    """With K continuations per arm (K > 1, DESIGN §13): the mean paired difference in success probability over the
    cases whose continuations are all in M (against control) or all in E (between arms that ask), its bootstrap
    interval and exact sign-flip p; absent with one continuation (the test above is then the same test)."""


def compare(first: str, second: str, outcomes: Sequence[tuple[bool, bool]], confidence: float = 0.95) -> PairedComparison:
    """The paired comparison of two arms from (first succeeded, second succeeded) per case."""
    table = PairedTable.tally(outcomes)
    k, b, c = table.k, table.first_only, table.second_only
    return PairedComparison(
        first=first, second=second, k=k, pairs=table, mcnemar_p=mcnemar_exact(b, c), diff=ratio(b - c, k),
        diff_ci=paired_diff_ci(b, c, k, confidence, both_success=table.both_success) if k else None,
    )




def ratio(x: int, n: int) -> float | None:
    """x / n, or None when n is 0."""
    return x / n if n else None
