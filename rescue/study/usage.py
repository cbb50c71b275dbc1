"""Token usage and latency over VLM calls, honest about what is unknown.

One call counts once however many cases shared it and however many attempts it
took: each call is its outcome receipt, chosen by the receipts module's one rule
(the first outcome line of a call; `rescue.study.receipts.first_outcomes`). A token
total is given only when every call reported that counter; otherwise the known
sum is shown beside how many calls lacked it.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from rescue.core.config import StudyConfig, TokenPrice
from rescue.core.records import Receipt
from rescue.study.receipts import ReceiptLine, first_outcomes

TOKEN_TYPES = {
    "input": "input_tokens",
    "cached_input": "cached_input_tokens",
    "output": "output_tokens",
    "reasoning": "reasoning_tokens",
}


class TokenTally(BaseModel):
    """One token type over all calls."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    known_sum: int = 0
    """Tokens summed over the calls that reported the counter."""
    calls_with: int = 0
    """Calls that reported the counter."""
    calls_without: int = 0
    """Calls that did not report it."""
    total: int | None = None
    """The total over all calls; None when any call lacked the counter."""


class LatencySummary(BaseModel):
    """Per-call latency in seconds over outcome receipts (None when there are no calls)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    sum_s: float = 0.0
    """Total latency of the calls, seconds."""
    mean_s: float | None = None
    """Mean latency of a call, seconds; None without calls."""
    median_s: float | None = None
    """Median latency of a call, seconds; None without calls."""
    min_s: float | None = None
    """Shortest call, seconds; None without calls."""
    max_s: float | None = None
    """Longest call, seconds; None without calls."""


class UsageSummary(BaseModel):
    """Deduplicated call count, statuses, tokens per type, latency; cost unknown."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    calls: int = 0
    """VLM calls, each counted once (its first outcome receipt)."""
    cases: int = 0
    """Distinct cases the calls asked for."""
    attempts: int = 0
    """HTTP attempts over all calls, retries included."""
    by_status: dict[str, int] = Field(default_factory=dict)
    """Calls per outcome status (`ok`, `error`, `timeout`...); only statuses that occurred."""
    tokens: dict[str, TokenTally] = Field(default_factory=dict)
    """Token type (`input`, `cached_input`, `output`, `reasoning`) -> its tally over the calls."""
    latency: LatencySummary = Field(default_factory=LatencySummary)
    """Latency of the calls, seconds."""
    cost: float | None = None
    """The calls' cost under the configuration's declared price per million tokens of each kind (in the unit it
    was declared in); None when no price is declared or a call lacked a count the price needs (never guessed)."""


def _outcomes(receipts: Iterable[Receipt | ReceiptLine]) -> list[Receipt]:
    plain = (r.receipt if isinstance(r, ReceiptLine) else r for r in receipts)
    return list(first_outcomes(r for r in plain if r is not None).values())


def _tally(values: list[int | None]) -> TokenTally:
    known = [v for v in values if v is not None]
    missing = len(values) - len(known)
    return TokenTally(
        known_sum=sum(known),
        calls_with=len(known),
        calls_without=missing,
        total=sum(known) if missing == 0 else None,
    )


def usage_summary(receipts: Iterable[Receipt | ReceiptLine], price: TokenPrice | None = None) -> UsageSummary:
    """Summarise calls from their receipts or receipt lines (attempt receipts are ignored); with a declared
    price, their cost (None when a count the price needs is unreported)."""
    calls = _outcomes(receipts)
    latencies = [r.latency_s for r in calls if r.latency_s is not None]
    usage = _summary(calls, latencies)
    if price is not None:
        t = usage.tokens
        usage.cost = price.cost(t["input"].total, t["cached_input"].total, t["output"].total)
    return usage


def usage_by_advisor(receipts: Iterable[Receipt | ReceiptLine], config: StudyConfig) -> dict[str, UsageSummary] | None:
    """Each advisor's calls summarised, by advisor name in declared order, with its declared price (DESIGN §11);
    None: a study of one `[vlm]`. A call is an advisor's when its receipt names that advisor."""
    if not config.advisors:
        return None
    calls = _outcomes(receipts)
    return {a.name: usage_summary([r for r in calls if r.advisor == a.name], a.price) for a in config.advisors}


def study_price(config: StudyConfig) -> TokenPrice | None:
    """The price a study of one `[vlm]` declares for its calls; None for several advisors (each has its own)."""
    return None if config.advisors else config.vlm.price


def _summary(calls: list[Receipt], latencies: list[float]) -> UsageSummary:
    return UsageSummary(
        calls=len(calls),
        cases=len({c for r in calls for c in r.case_ids}),
        attempts=sum(r.attempt for r in calls),
        by_status=dict(Counter(r.status for r in calls)),
        tokens={
            name: _tally([getattr(r.usage, field) for r in calls])
            for name, field in TOKEN_TYPES.items()
        },
        latency=LatencySummary(
            sum_s=sum(latencies),
            mean_s=statistics.fmean(latencies) if latencies else None,
            median_s=statistics.median(latencies) if latencies else None,
            min_s=min(latencies) if latencies else None,
            max_s=max(latencies) if latencies else None,
        ),
    )


def study_usage(receipts: Iterable[Receipt | ReceiptLine], config: StudyConfig) -> tuple[UsageSummary, dict[str, UsageSummary] | None]:
    """A study's usage over all its calls and, with several advisors, per advisor; the total's cost is the sum of
    the advisors' (None when any is unknown)."""
    calls = _outcomes(receipts)
    by_advisor = usage_by_advisor(calls, config)
    total = usage_summary(calls, study_price(config))
    if by_advisor is not None:
        costs = [u.cost for u in by_advisor.values()]
        total.cost = sum(costs) if costs and all(c is not None for c in costs) else None
    return total, by_advisor
