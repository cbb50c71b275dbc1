"""The paired comparison of two policies on identical episodes, as a record of the family (pure).

Pairs are matched by episode id. A pair enters the paired figures only when both episodes completed and their
initial-state fingerprints are equal; every other pair is counted and named, never dropped silently.
Orientation: B is the first arm of every `PairedComparison` here and A the second, so a *win* (B succeeded, A
failed) is the table's `first_only`, a *loss* its `second_only`, and every difference is B minus A.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rescue.core.figures.evaluation import EvalSummary, summarize_labels
from rescue.core.verdicts import EpisodeLabel
from rescue.core.figures.stats import PairedComparison, compare
from rescue.core.figures.exact_stats import block_bootstrap_ci

COMPARISON_SCHEMA = "rescue-comparison/2"
# The sides as the comparison's folder and its paired comparisons name them.
SIDES = ("a", "b")

# How a pair was treated, checked in this order (first match wins).
PairStatus = Literal["unmatched", "unexecuted", "fingerprint_mismatch", "unknown", "paired"]
EXCLUDED: tuple[PairStatus, ...] = ("fingerprint_mismatch", "unknown", "unexecuted", "unmatched")
Outcome = Literal["win", "loss", "both_success", "both_fail"]


class Episode(BaseModel):
    """One side's episode as the comparison sees it."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The episode's case id (the same on both sides)."""
    task: str
    """`suite/task_id`."""
    group: str
    """The manifest's group of the episode."""
    label: EpisodeLabel | None = None
    """success, failure or unknown; None: never run (unexecuted)."""
    fingerprint: str | None = None
    """The initial-state fingerprint of the run; None when it did not reset."""
    result_sha256: str | None = None
    """sha256 of the stored arm record (the journal's digest); None when none is stored."""


class Pair(BaseModel):
    """One episode id on both sides: how it was treated and, when paired, its outcome."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The episode's case id."""
    task: str
    """`suite/task_id`."""
    group: str
    """The manifest's group of the episode."""
    status: PairStatus
    """How the pair was treated: `paired`, or why it was excluded (first match of PairStatus's order)."""
    outcome: Outcome | None = None
    """win (B only succeeded), loss (A only), both_success or both_fail; None unless paired."""
    reason: str
    """One line saying why the pair got its status."""
    a_label: str | None = None
    """Side A's label; None: never run."""
    b_label: str | None = None
    """Side B's label; None: never run."""
    a_fingerprint: str | None = None
    """Side A's initial-state fingerprint; None when it did not reset."""
    b_fingerprint: str | None = None
    """Side B's initial-state fingerprint; None when it did not reset."""
    a_result_sha256: str | None = None
    """sha256 of side A's stored arm record; None when none is stored."""
    b_result_sha256: str | None = None
    """sha256 of side B's stored arm record; None when none is stored."""


class PairSlice(BaseModel):
    """The pairs of one slice of the episodes (all of them, a task, a group): B against A over its paired
    episodes, and every excluded pair by reason."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    n: int
    """Every pair of the slice, excluded ones included."""
    versus: PairedComparison
    """B (`first`) against A (`second`) over the slice's paired episodes (both ran, same fingerprint, neither
    unknown): `k` of them, the 2x2 (`first_only`: wins, `second_only`: losses), the exact McNemar p, B's minus
    A's success rate and Newcombe's paired interval of it."""
    fingerprint_mismatch: int = 0
    """Excluded: the two sides' initial-state fingerprints differ."""
    unknown: int = 0
    """Excluded: either side's episode is unknown (infrastructure)."""
    unexecuted: int = 0
    """Excluded: either side never ran the episode."""
    unmatched: int = 0
    """Excluded: the episode id exists on one side only."""


def pair_slice(pairs: Sequence[Pair], confidence: float = 0.95) -> PairSlice:
    """The slice of these pairs: B against A over the paired ones, the others counted by status."""
    paired = [(p.b_label == "success", p.a_label == "success") for p in pairs if p.status == "paired"]
    excluded = {status: sum(p.status == status for p in pairs) for status in EXCLUDED}
    return PairSlice(n=len(pairs), versus=compare("b", "a", paired, confidence), **excluded)


class Comparison(BaseModel):
    """The paired figures of B against A, with every excluded pair counted and named."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    schema_version: Literal["rescue-comparison/2", "rescue-comparison/1"] = COMPARISON_SCHEMA
    """The format of this document (`comparison.json`); a document of `/1` (or of before it was versioned) is read
    into today's shape and keeps its version here."""
    a_name: str = "A"
    """Side A's name: its config file's stem and/or its policy."""
    b_name: str = "B"
    """Side B's name."""
    counts: PairSlice
    """The pairs over all episodes: B against A over the paired ones, and the excluded by reason."""
    a_rate: float | None
    """A's success rate over the paired episodes (0-1); None when none is paired."""
    b_rate: float | None
    """B's success rate over the paired episodes (0-1); None when none is paired."""
    confidence: float
    """The confidence level of both intervals (Newcombe's in `counts.versus`, the bootstrap's; e.g. 0.95)."""
    bootstrap_ci: tuple[float, float] | None
    """Percentile interval of B's minus A's rate resampling whole tasks; None when none is paired."""
    bootstrap_seed: int
    """The block bootstrap's seed."""
    bootstrap_reps: int
    """The block bootstrap's resamples."""
    a: EvalSummary
    """Side A over all its episodes, unknown and unexecuted included (fixed denominator)."""
    b: EvalSummary
    """Side B over all its episodes, unknown and unexecuted included (fixed denominator)."""
    per_task: dict[str, PairSlice] = Field(default_factory=dict)
    """The pairs per task (`suite/task_id`)."""
    per_group: dict[str, PairSlice] = Field(default_factory=dict)
    """The pairs per manifest group."""
    excluded: dict[str, list[str]] = Field(default_factory=dict)
    """Excluded episode ids by status."""
    pairs: list[Pair] = Field(default_factory=list)
    """Every pair, in manifest order."""


def _pair(case_id: str, a: Episode | None, b: Episode | None) -> Pair:
    ref = a or b
    assert ref is not None
    fields = dict(
        case_id=case_id, task=ref.task, group=ref.group,
        a_label=a.label if a else None, b_label=b.label if b else None,
        a_fingerprint=a.fingerprint if a else None, b_fingerprint=b.fingerprint if b else None,
        a_result_sha256=a.result_sha256 if a else None, b_result_sha256=b.result_sha256 if b else None,
    )
    if a is None or b is None:
        return Pair(status="unmatched", reason=f"only on side {'a' if a else 'b'}", **fields)
    if a.task != b.task:
        return Pair(status="unmatched", reason=f"task {a.task} on side a, {b.task} on side b", **fields)
    if a.label is None or b.label is None:
        missing = [side for side, ep in (("a", a), ("b", b)) if ep.label is None]
        return Pair(status="unexecuted", reason=f"never run on side {' and '.join(missing)}", **fields)
    # As in DESIGN §3, a deviation is decided before anything else about the episodes.
    if a.fingerprint and b.fingerprint and a.fingerprint != b.fingerprint:
        return Pair(status="fingerprint_mismatch", reason="initial-state fingerprints differ", **fields)
    if "unknown" in (a.label, b.label):
        sides = [side for side, ep in (("a", a), ("b", b)) if ep.label == "unknown"]
        return Pair(status="unknown", reason=f"unknown on side {' and '.join(sides)}", **fields)
    if not a.fingerprint or not b.fingerprint:
        return Pair(status="fingerprint_mismatch", reason="a completed episode has no fingerprint", **fields)
    a_ok, b_ok = a.label == "success", b.label == "success"
    outcome: Outcome = "win" if b_ok and not a_ok else "loss" if a_ok and not b_ok else "both_success" if a_ok else "both_fail"
    return Pair(status="paired", outcome=outcome, reason="fingerprints match, both completed", **fields)


def pair_episodes(a: Sequence[Episode], b: Sequence[Episode]) -> list[Pair]:
    """Match episodes by id (A's order, then B-only ids) and decide how each pair is treated."""
    for side, episodes in (("a", a), ("b", b)):
        ids = [e.case_id for e in episodes]
        if len(ids) != len(set(ids)):
            raise ValueError(f"side {side} lists an episode twice")
    by_a = {e.case_id: e for e in a}
    by_b = {e.case_id: e for e in b}
    order = list(by_a) + [case_id for case_id in by_b if case_id not in by_a]
    return [_pair(case_id, by_a.get(case_id), by_b.get(case_id)) for case_id in order]


def _slices(pairs: Sequence[Pair], key: str, confidence: float) -> dict[str, PairSlice]:
    buckets: dict[str, list[Pair]] = {}
    for pair in pairs:
        buckets.setdefault(getattr(pair, key), []).append(pair)
    return {name: pair_slice(buckets[name], confidence) for name in sorted(buckets)}


def compare_episodes(
    a: Sequence[Episode],
    b: Sequence[Episode],
    seed: int = 0,
    reps: int = 2000,
    confidence: float = 0.95,
    names: tuple[str, str] = ("A", "B"),
) -> Comparison:
    """Pair two sides' episodes and compute wins, losses, ties, McNemar and both intervals."""
    pairs = pair_episodes(a, b)
    counts = pair_slice(pairs, confidence)
    excluded = {status: [p.case_id for p in pairs if p.status == status] for status in EXCLUDED}
    paired = [p for p in pairs if p.status == "paired"]
    table, n = counts.versus.pairs, counts.versus.k
    blocks = [(p.task, p.a_label == "success", p.b_label == "success") for p in paired]
    return Comparison(
        a_name=names[0],
        b_name=names[1],
        counts=counts,
        a_rate=(table.second_only + table.both_success) / n if n else None,
        b_rate=(table.first_only + table.both_success) / n if n else None,
        confidence=confidence,
        bootstrap_ci=block_bootstrap_ci(blocks, seed, reps, confidence) if n else None,
        bootstrap_seed=seed,
        bootstrap_reps=reps,
        a=summarize_labels((e.task, e.group, e.label) for e in a),
        b=summarize_labels((e.task, e.group, e.label) for e in b),
        per_task=_slices(pairs, "task", confidence),
        per_group=_slices(pairs, "group", confidence),
        excluded={k: v for k, v in excluded.items() if v},
        pairs=pairs,
    )
