"""A lab's VLM spending across its studies: calls, tokens, declared cost and latency by model, endpoint, study
and day (`rescue usage`).

Read side only: it reads every study folder under the folders it is given (a study is a folder holding a
journal; the service's queue keeps its jobs' studies inside job folders) and writes nothing. A call is its
outcome receipt, chosen by the receipts module's one rule, and the study's figures are the ones its export
gives (`rescue.study.usage`): the per-study rows here add up to the `usage` of each study's export. Cost is
the declared `[vlm] price` (or each advisor's) applied to one call's counts; a call that lacked a count the
price needs has no cost, and a group's cost is then unknown (its known part is shown beside it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rescue.study.folder import StudyError
from rescue.study.layout import StudyLayout
from rescue.study.ledger import LedgerTotals, read_ledger
from rescue.study.usage import TOKEN_TYPES, CallCost, TokenTally, call_cost, study_calls

USAGE_SCHEMA = "rescue-usage/1"
# The quantiles of a call's latency each group reports.
PERCENTILES = (50, 90, 99)


class LatencyQuantiles(BaseModel):
    """Latency of a group's calls, seconds (None without calls that have one)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    p50_s: float | None = None
    """Median latency of a call."""
    p90_s: float | None = None
    """90th percentile (linear interpolation between closest ranks)."""
    p99_s: float | None = None
    """99th percentile (linear interpolation between closest ranks)."""
    max_s: float | None = None
    """The longest call."""
    sum_s: float = 0.0
    """Total latency of the calls."""


class UsageGroup(BaseModel):
    """The calls of one model, endpoint, study or day (or all of them)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    key: str
    """What the calls share: the model, endpoint, study folder or day (`all` for the total)."""
    calls: int = 0
    """VLM calls, each counted once."""
    by_status: dict[str, int] = Field(default_factory=dict)
    """Calls per outcome status; only statuses that occurred."""
    tokens: dict[str, TokenTally] = Field(default_factory=dict)
    """Token type -> its tally over the calls (a total only when every call reported it)."""
    cost: float | None = None
    """The calls' declared cost; None when any call's is unknown (see `cost_known` and `calls_without_cost`)."""
    cost_known: float = 0.0
    """The cost of the calls whose cost is known."""
    calls_without_cost: int = 0
    """Calls with no cost: no price declared, or a count the price needs unreported."""
    latency: LatencyQuantiles = Field(default_factory=LatencyQuantiles)
    """Latency quantiles of the calls."""


class StudySeen(BaseModel):
    """One study folder the view read."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    study: str
    """The study's id."""
    path: str
    """Its folder, as found under the folders given."""
    calls: int
    """Its VLM calls (an evaluation makes none)."""
    counted_elsewhere: int = 0
    """Of them, calls a study read before it holds too (a copy of its folder: the call ids are the same), counted
    there only."""


class LabUsage(BaseModel):
    """What `rescue usage --json` prints: a lab's VLM calls over every study found, grouped four ways."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    schema_version: Literal["rescue-usage/1"] = USAGE_SCHEMA
    """The format of this document."""
    folders: list[str]
    """The folders searched for studies, as given (a default folder that does not exist is left out)."""
    studies: list[StudySeen]
    """Every study read, in the order found."""
    skipped: list[str] = Field(default_factory=list)
    """Folders that look like studies, and ledgers, that could not be read, each with why (one line)."""
    total: UsageGroup
    """Every call of every study."""
    by_model: list[UsageGroup]
    """Per model asked for, by name."""
    by_endpoint: list[UsageGroup]
    """Per endpoint (`local`, or host and port), by name."""
    by_study: list[UsageGroup]
    """Per study folder, in the order found."""
    by_day: list[UsageGroup]
    """Per UTC day a call started, oldest first."""
    ledgers: list[LedgerTotals] = Field(default_factory=list)
    """The lab budget's ledgers the studies name (`[vlm] lab_ledger`), as they stand now."""


def find_studies(folders: Iterable[str | os.PathLike[str]]) -> Iterator[Path]:
    """Every study folder under the given folders (each once, in walk order); a study's own folder is not searched
    further, and folders whose names begin with a dot (a study being created) are skipped."""
    seen: set[Path] = set()
    for folder in folders:
        for root, dirs, _ in os.walk(folder):
            here = Path(root)
            if StudyLayout.of(here).is_study():
                dirs.clear()
                key = here.resolve()
                if key not in seen:
                    seen.add(key)
                    yield here
                continue
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))


def quantile(values: list[float], p: float) -> float:
    """The p-th percentile (0-100) of non-empty values, interpolated linearly between closest ranks."""
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def group(key: str, calls: list[CallCost]) -> UsageGroup:
    """The figures of a set of calls."""
    out = UsageGroup(key=key, calls=len(calls))
    for c in calls:
        out.by_status[c.status] = out.by_status.get(c.status, 0) + 1
    for name in TOKEN_TYPES:
        values = [c.tokens[name] for c in calls]
        known = [v for v in values if v is not None]
        missing = len(values) - len(known)
        out.tokens[name] = TokenTally(known_sum=sum(known), calls_with=len(known), calls_without=missing,
                                      total=sum(known) if missing == 0 else None)
    costs = [c.cost for c in calls if c.cost is not None]
    out.cost_known = sum(costs)
    out.calls_without_cost = len(calls) - len(costs)
    out.cost = out.cost_known if calls and not out.calls_without_cost else None
    latencies = [c.latency_s for c in calls if c.latency_s is not None]
    if latencies:
        out.latency = LatencyQuantiles(
            **{f"p{p}_s": quantile(latencies, p) for p in PERCENTILES}, max_s=max(latencies), sum_s=sum(latencies)
        )
    return out


def _grouped(calls: list[CallCost], field: str, keys: list[str] | None = None) -> list[UsageGroup]:
    by: dict[str, list[CallCost]] = {}
    for c in calls:
        by.setdefault(getattr(c, field), []).append(c)
    order = keys if keys is not None else sorted(by)
    return [group(k, by[k]) for k in order if k in by]


def _one_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def lab_usage(folders: Iterable[str | os.PathLike[str]], optional: Iterable[str | os.PathLike[str]] = ()) -> LabUsage:
    """Read every study under the folders; StudyError names a given folder that does not exist. `optional`
    folders are searched when they exist (the default `studies/`, the service's `queue/`)."""
    given = [str(f) for f in folders]
    for f in given:
        if not Path(f).is_dir():
            raise StudyError(f"{f}: no such folder")
    searched = given + [str(f) for f in optional if Path(f).is_dir() and str(f) not in given]
    studies, skipped, calls, ledgers = [], [], [], {}
    seen: set[tuple[str, str]] = set()
    for study_dir in find_studies(searched):
        try:
            study_id, config, receipts = study_calls(study_dir)
        except (StudyError, OSError, ValueError) as exc:
            skipped.append(f"{study_dir}: {_one_line(exc)}")
            continue
        mine = [call_cost(config, r, str(study_dir)) for r in receipts]
        # A call is counted once by its id, wherever its study's folder was copied (the ledger counts it so too).
        new = [c for c in mine if (study_id, c.call_id) not in seen]
        seen.update((study_id, c.call_id) for c in mine)
        studies.append(StudySeen(study=study_id, path=str(study_dir), calls=len(mine),
                                 counted_elsewhere=len(mine) - len(new)))
        calls += new
        if config.vlm.lab_ledger is not None and config.vlm.lab_ledger not in ledgers:
            try:
                ledgers[config.vlm.lab_ledger] = read_ledger(config.vlm.lab_ledger)
            except StudyError as exc:
                ledgers[config.vlm.lab_ledger] = None
                skipped.append(_one_line(exc))
    return LabUsage(
        folders=searched, studies=studies, skipped=skipped, total=group("all", calls),
        by_model=_grouped(calls, "model"), by_endpoint=_grouped(calls, "endpoint"),
        by_study=_grouped(calls, "study", [s.path for s in studies]), by_day=_grouped(calls, "day"),
        ledgers=[t for t in ledgers.values() if t is not None],
    )
