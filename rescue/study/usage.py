"""Token usage and latency over VLM calls, honest about what is unknown.

One call counts once however many cases shared it and however many attempts it
took: each call is its outcome receipt, chosen by the receipts module's one rule
(the first outcome line of a call; `rescue.study.receipts.first_outcomes`). A token
total is given only when every call reported that counter; otherwise the known
sum is shown beside how many calls lacked it.
"""

from __future__ import annotations

import datetime
import os
import statistics
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.vlm_config import TokenPrice, VLMConfig, endpoint_host
from rescue.core.records import Receipt
from rescue.study.folder import StudyError, load_study_config, open_journal, receipt_files
from rescue.study.layout import StudyLayout
from rescue.study.receipts import ReceiptLine, first_outcomes, read_receipts

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


class CallCost(BaseModel):
    """One VLM call as a lab counts it: where it went, what it used, what it cost under its declared price."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    call_id: str
    """Our id of the call (its receipts')."""
    study: str
    """The study's folder (two studies may share an id, never a folder)."""
    advisor: str | None = None
    """The advisor the call was made for; None: a study of one `[vlm]`."""
    model: str
    """The model the call asked for."""
    endpoint: str
    """Where it was asked: `local` (the bundled endpoint), else the base URL's host and port."""
    started_at: float
    """When the call started, Unix time in seconds."""
    day: str
    """The UTC date the call started, `YYYY-MM-DD`."""
    status: str
    """How the call ended (`ok`, `error`, `timeout`, ...)."""
    cases: int
    """The cases the call asked for (more than one only when batched)."""
    tokens: dict[str, int | None]
    """Token type (`input`, `cached_input`, `output`, `reasoning`) -> the call's count; None: not reported."""
    latency_s: float | None
    """Seconds from the call's start to its outcome, retries included."""
    cost: float | None
    """The call's cost under its declared price; None: no price declared, or a count the price needs is missing."""


def advisor_config(config: StudyConfig, advisor: str | None) -> VLMConfig | None:
    """The VLM configuration a receipt's calls were made under: its advisor's, or the study's `[vlm]`; None: the
    receipt names an advisor the study does not declare."""
    if not config.advisors:
        return config.vlm
    return next((a for a in config.advisors if a.name == advisor), None)


def call_cost(config: StudyConfig, receipt: Receipt, study: str) -> CallCost:
    """One outcome receipt as a priced call of `study` (a folder)."""
    vlm = advisor_config(config, receipt.advisor)
    price = vlm.price if vlm is not None else None
    tokens = {name: getattr(receipt.usage, field) for name, field in TOKEN_TYPES.items()}
    return CallCost(
        call_id=receipt.call_id, study=study, advisor=receipt.advisor, model=receipt.model_requested,
        endpoint=endpoint_host(vlm.base_url) if vlm is not None else "unknown", started_at=receipt.started_at,
        day=datetime.datetime.fromtimestamp(receipt.started_at, datetime.UTC).date().isoformat(),
        status=receipt.status, cases=len(receipt.case_ids), tokens=tokens, latency_s=receipt.latency_s,
        cost=None if price is None else price.cost(tokens["input"], tokens["cached_input"], tokens["output"]),
    )


def study_calls(study_dir: str | os.PathLike[str]) -> tuple[str, StudyConfig, list[Receipt]]:
    """A study's id, configuration and calls: each its first outcome receipt over every receipts file of the
    study, as its export counts them. StudyError when the folder cannot be read as a study."""
    config = load_study_config(study_dir)
    layout = StudyLayout.of(study_dir)
    with open_journal(study_dir) as journal:
        study_id = str(journal.meta().get("study_id") or Path(study_dir).name)
        receipts: list[Receipt] = []
        for path in receipt_files(layout, journal).values():
            if path.exists() and not path.is_file():
                raise StudyError(f"{path}: not a regular file (receipts are read from files only)")
            if path.exists():
                receipts.extend(read_receipts(path))
    return study_id, config, list(first_outcomes(receipts).values())


def call_costs(study_dir: str | os.PathLike[str]) -> tuple[str, list[CallCost]]:
    """A study's id and its calls, priced (see `study_calls`)."""
    study_id, config, calls = study_calls(study_dir)
    return study_id, [call_cost(config, r, str(study_dir)) for r in calls]
