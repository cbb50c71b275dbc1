"""Paired statistics and the fixed-denominator summary (DESIGN §3)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rescue.core.records import CaseRecord, Label, Verdict

LABELS: tuple[Label, ...] = ("rescued", "not_rescued", "unknown", "initial_state_deviation")


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    from scipy.stats import norm  # imported when used: scipy.stats alone costs 0.7 s, and `rescue status` needs none of it

    return float(norm.ppf(0.5 + confidence / 2.0))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of b discordant wins out of b + c."""
    b, c = _count("b", b), _count("c", c)
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(b, b + c, 0.5).pvalue)


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of p-values (family-wise error), in the input's order."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def wilson_interval(x: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion x / n."""
    z = _z(confidence)
    p = x / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_diff_ci(
    b: int, c: int, n: int, confidence: float = 0.95, *, both_success: int = 0
) -> tuple[float, float]:
    """Newcombe's square-and-add interval (1998, method 10) for p_first - p_second on paired data.

    b = pairs where only the first arm succeeded, c = only the second, n = all pairs,
    both_success = pairs where both did (0 in a rescue study of historical failures).
    """
    b, c, n, a = _count("b", b), _count("c", c), _count("n", n), _count("both_success", both_success)
    if n == 0:
        return math.nan, math.nan
    d = n - a - b - c
    if d < 0:
        raise ValueError(f"b + c + both_success exceeds n ({a + b + c} > {n})")
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, confidence)
    l2, u2 = wilson_interval(a + c, n, confidence)
    # Correlation between the two marginals, with Newcombe's n/2 shrink of a positive
    # cross-product so that the interval does not get too narrow.
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    if margins == 0:
        phi = 0.0
    elif cross > n / 2:
        phi = (cross - n / 2) / math.sqrt(margins)
    elif cross >= 0:
        phi = 0.0
    else:
        phi = cross / math.sqrt(margins)
    delta = p1 - p2
    lower = delta - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    upper = delta + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return max(-1.0, lower), min(1.0, upper)


def block_bootstrap_ci(
    pairs: Sequence[tuple[str, bool, bool]],
    seed: int,
    reps: int = 2000,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval of mean(b) - mean(a) over (block, a, b) pairs, resampling whole blocks."""
    if reps < 1:
        raise ValueError(f"reps must be positive, got {reps}")
    _z(confidence)
    if not pairs:
        return math.nan, math.nan
    # Pairs of one task are correlated; resampling tasks keeps that correlation.
    keys = sorted({key for key, _, _ in pairs})
    index = {key: i for i, key in enumerate(keys)}
    size = np.zeros(len(keys))
    wins_a = np.zeros(len(keys))
    wins_b = np.zeros(len(keys))
    for key, a_ok, b_ok in pairs:
        i = index[key]
        size[i] += 1
        wins_a[i] += bool(a_ok)
        wins_b[i] += bool(b_ok)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(keys), size=(reps, len(keys)))
    diff = (wins_b[draws].sum(axis=1) - wins_a[draws].sum(axis=1)) / size[draws].sum(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(diff, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


class Breakdown(BaseModel):
    """Counts of one group or task."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    n: int
    """Cases of the group or task in the summary."""
    counts: dict[str, int]
    """Cases per DESIGN §3 label, every label present (zero included)."""
    rescued: int
    """Cases labelled `rescued`."""
    rate: float | None
    """rescued / n, a fraction; None when n is 0."""
    sham: ShamSummary | None = None
    """The placebo comparison over this group's or task's cases alone (the sham's labels, its rescues, assisted
    against sham over the group's K); None when the study has no sham arm (and in summaries made before)."""


class PairTable(BaseModel):
    """The raw 2x2 of arm outcomes over the pairs in M."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    assisted_only: int = 0
    """Pairs where only the assisted arm succeeded (McNemar's b)."""
    control_only: int = 0
    """Pairs where only the control arm succeeded (McNemar's c)."""
    both_success: int = 0
    """Pairs where both arms succeeded."""
    both_fail: int = 0
    """Pairs where both arms failed."""


class ShamPairTable(BaseModel):
    """The raw 2x2 of assisted against sham over K: cases whose three arms are valid with both subgoals applied."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    assisted_only: int = 0
    """Cases where only the assisted arm succeeded (McNemar's b)."""
    sham_only: int = 0
    """Cases where only the sham arm succeeded (McNemar's c)."""
    both_success: int = 0
    """Cases where both arms succeeded."""
    both_fail: int = 0
    """Cases where both arms failed."""


class ShamSummary(BaseModel):
    """The placebo comparison (DESIGN §8): the sham arm against control, and assisted against sham."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    counts: dict[str, int]
    """The sham arm's own DESIGN §3 labels against control, over N, every label present."""
    r: int
    """Cases the sham "rescued"."""
    m: int
    """Sham pairs in M (valid, matched prefix, no deviation)."""
    e: int
    """Of those, with the sham subgoal applied and its source proven."""
    k: int
    """Cases where assisted and sham are both in E: the paired comparison's n."""
    pairs: ShamPairTable
    """The raw 2x2 of assisted against sham over K."""
    mcnemar_p: float
    """Two-sided exact McNemar p-value of assisted against sham over K; 1.0 without discordant cases."""
    diff: float | None
    """Assisted minus sham success rate over K: the effect of the VLM's content; None when K is 0."""
    diff_ci: tuple[float, float] | None
    """Newcombe square-and-add interval of `diff`, at the summary's confidence; None when K is 0."""


class AdvisorShamComparison(BaseModel):
    """One advisor against the sham arm over the cases where both are in E (DESIGN §8, §11)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    k: int
    """Cases where the advisor's arm and the sham arm are both in E: the paired comparison's n."""
    pairs: ShamPairTable
    """The raw 2x2 over those cases (`assisted_only`: only the advisor's arm succeeded)."""
    mcnemar_p: float
    """Two-sided exact McNemar p-value of the advisor against sham; 1.0 without discordant cases."""
    diff: float | None
    """The advisor's minus the sham's success rate over those cases; None when there are none."""
    diff_ci: tuple[float, float] | None
    """Newcombe square-and-add interval of `diff`, at the summary's confidence; None when there are no cases."""


class AdvisorSummary(BaseModel):
    """One advisor's figures against control (DESIGN §3 over its own verdicts, DESIGN §11), and against the sham."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    name: str
    """The advisor's name."""
    arm: str
    """Its arm, `assisted:<name>`."""
    primary: bool
    """Whether it is the study's primary advisor (its verdicts are the cases' labels, and the summary's R, M, E)."""
    counts: dict[str, int]
    """The advisor's DESIGN §3 labels against control, over N, every label present."""
    r: int
    """Cases the advisor's arm rescued."""
    m: int
    """Control/advisor pairs in M."""
    e: int
    """Of those, with the advisor's subgoal applied and valid evidence."""
    r_over_n: float | None
    """R / N, a fraction; None when N is 0."""
    r_over_m: float | None
    """R / M, a fraction; None when M is 0."""
    r_over_e: float | None
    """R / E, a fraction; None when E is 0 (the advisor table ranks by it)."""
    pairs: PairTable
    """The raw 2x2 of the advisor's arm (`assisted_only`) against control over its M."""
    mcnemar_p: float
    """Two-sided exact McNemar p-value on the discordant pairs of its M; 1.0 when there are none."""
    diff: float | None
    """The advisor's minus control's success rate over its M; None when M is 0."""
    diff_ci: tuple[float, float] | None
    """Newcombe square-and-add interval of `diff`; None when M is 0."""
    sham: AdvisorShamComparison | None = None
    """The advisor against the sham arm; None when the study has no sham arm."""


class AdvisorPairTable(BaseModel):
    """The raw 2x2 of two advisors' arms over the cases where both are in E."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    first_only: int = 0
    """Cases where only the first advisor's arm succeeded (McNemar's b)."""
    second_only: int = 0
    """Cases where only the second advisor's arm succeeded (McNemar's c)."""
    both_success: int = 0
    """Cases where both succeeded."""
    both_fail: int = 0
    """Cases where both failed."""


class AdvisorPair(BaseModel):
    """Two advisors, paired case by case over the cases where both are in E (DESIGN §11)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    first: str
    """The advisor declared earlier."""
    second: str
    """The advisor declared later."""
    k: int
    """Cases where both advisors' arms are in E: the paired comparison's n."""
    pairs: AdvisorPairTable
    """The raw 2x2 over those cases."""
    mcnemar_p: float
    """Two-sided exact McNemar p-value on the discordant cases; 1.0 without any."""
    holm_p: float
    """`mcnemar_p` Holm-adjusted across every pair of the study's advisors (family-wise error)."""
    diff: float | None
    """The first's minus the second's success rate over those cases; None when there are none."""
    diff_ci: tuple[float, float] | None
    """Newcombe square-and-add interval of `diff`, at the summary's confidence; None when there are no cases."""


class Summary(BaseModel):
    """The fixed-denominator summary of a study's main cohort (DESIGN §3)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    n: int
    """N: the cases summarized (finished or interrupted, with a verdict); the whole cohort once the study is complete."""
    counts: dict[str, int]
    """Cases per DESIGN §3 label, every label present (zero included)."""
    r: int
    """R: cases rescued."""
    m: int
    """M: pairs with both arms valid and complete, no deviation, exact prefix."""
    e: int
    """E: pairs in M with the subgoal applied and valid evidence."""
    r_over_n: float | None
    """R / N, a fraction; None when N is 0."""
    r_over_m: float | None
    """R / M, a fraction; None when M is 0."""
    r_over_e: float | None
    """R / E, a fraction; None when E is 0."""
    pairs: PairTable
    """The raw 2x2 of arm outcomes over M."""
    mcnemar_p: float
    """Two-sided exact McNemar p-value on the discordant pairs of M; 1.0 when there are none."""
    diff: float | None
    """Assisted minus control success rate over M; None when M is 0."""
    diff_ci: tuple[float, float] | None
    """Newcombe square-and-add interval of `diff` over M, at `confidence`; None when M is 0."""
    confidence: float = 0.95
    """Confidence level of the intervals."""
    per_group: dict[str, Breakdown] = Field(default_factory=dict)
    """The counts of each group, by group name."""
    per_task: dict[str, Breakdown] = Field(default_factory=dict)
    """The counts of each task, by `suite/task_id`."""
    pilot_ids: list[str] = Field(default_factory=list)
    """Ids of the pilot cases summarized apart, in manifest order; empty in a pilot cohort's own summary."""
    pilot: Summary | None = None
    """The pilot cohort's own summary; None without pilot cases (and in a pilot cohort's own summary)."""
    sham: ShamSummary | None = None
    """The placebo comparison; None when the study has no sham arm."""
    # Absent, not null, from a summary without them: a summary stored before there were advisors is re-derived
    # byte for byte by `rescue verify`.
    advisors: list[AdvisorSummary] | None = Field(default=None, exclude_if=lambda v: v is None)
    """Each advisor's figures, in declared order (the primary first; DESIGN §11); None: a study of one `[vlm]`."""
    advisor_pairs: list[AdvisorPair] | None = Field(default=None, exclude_if=lambda v: v is None)
    """Every pair of advisors (declared order within a pair), with Holm-adjusted p; None: a study of one `[vlm]`."""


def _ratio(x: int, n: int) -> float | None:
    return x / n if n else None


def _label_counts(labels: Iterable[str]) -> dict[str, int]:
    counts = dict.fromkeys(LABELS, 0)
    for label in labels:
        counts[label] += 1
    return counts


def _breakdowns(cases: Sequence[tuple[CaseRecord, Verdict]], key: str, confidence: float) -> dict[str, Breakdown]:
    buckets: dict[str, list[tuple[CaseRecord, Verdict]]] = {}
    for rec, v in cases:
        buckets.setdefault(getattr(rec, key), []).append((rec, v))
    out = {}
    for name in sorted(buckets):
        counts = _label_counts(v.label for _, v in buckets[name])
        n = len(buckets[name])
        rescued = counts["rescued"]
        out[name] = Breakdown(n=n, counts=counts, rescued=rescued, rate=_ratio(rescued, n),
                              sham=sham_summary(buckets[name], confidence))
    return out


def _pair_table(cases: Sequence[tuple[CaseRecord, Verdict]]) -> PairTable:
    table = PairTable()
    outcomes = []
    for rec, v in cases:
        if not v.in_m:
            continue
        if rec.control is None or rec.assisted is None:
            raise ValueError(f"case {rec.case_id} is in M without both arms")
        outcomes.append((bool(rec.assisted.success), bool(rec.control.success)))
    table.assisted_only, table.control_only, table.both_success, table.both_fail = _tally(outcomes)
    return table


def _tally(pairs: Iterable[tuple[bool, bool]]) -> tuple[int, int, int, int]:
    """A paired 2x2 from (first succeeded, second succeeded): first only, second only, both, neither."""
    counts = Counter((bool(a), bool(b)) for a, b in pairs)
    return counts[(True, False)], counts[(False, True)], counts[(True, True)], counts[(False, False)]


def sham_summary(cases: Sequence[tuple[CaseRecord, Verdict]], confidence: float = 0.95) -> ShamSummary | None:
    """The sham arm's own labels and the assisted-vs-sham paired comparison, or None without a sham arm."""
    judged = [(rec, v) for rec, v in cases if v.sham is not None]
    if not judged:
        return None
    if len(judged) != len(cases):
        raise ValueError("some cases of a sham study have no sham verdict")
    counts = _label_counts(v.sham.label for _, v in judged)
    for rec, v in judged:
        if v.sham.in_e and not v.sham.in_m:
            raise ValueError(f"case {rec.case_id}'s sham arm is in E but not in M")
    table = ShamPairTable()
    table.assisted_only, table.sham_only, table.both_success, table.both_fail = _tally(
        (rec.assisted.success, rec.sham.success) for rec, v in judged if v.in_e and v.sham.in_e
    )
    k = table.assisted_only + table.sham_only + table.both_success + table.both_fail
    b, c = table.assisted_only, table.sham_only
    return ShamSummary(
        counts=counts,
        r=counts["rescued"],
        m=sum(v.sham.in_m for _, v in judged),
        e=sum(v.sham.in_e for _, v in judged),
        k=k,
        pairs=table,
        mcnemar_p=mcnemar_exact(b, c),
        diff=_ratio(b - c, k),
        diff_ci=paired_diff_ci(b, c, k, confidence, both_success=table.both_success) if k else None,
    )


def _advisor_success(rec: CaseRecord, name: str) -> bool:
    arm = (rec.advisors or {}).get(name)
    if arm is None:
        raise ValueError(f"case {rec.case_id} has advisor {name!r}'s verdict in E without its arm")
    return bool(arm.success)


def _advisor_names(cases: Sequence[tuple[CaseRecord, Verdict]]) -> list[str] | None:
    named = [list(v.advisors) for _, v in cases if v.advisors is not None]
    if not named:
        return None
    if len(named) != len(cases) or any(n != named[0] for n in named):
        raise ValueError("the cases of a study of several advisors do not all carry every advisor's verdict")
    return named[0]


def advisor_summaries(
    cases: Sequence[tuple[CaseRecord, Verdict]], confidence: float = 0.95
) -> tuple[list[AdvisorSummary], list[AdvisorPair]] | None:
    """Each advisor against control (and the sham), and every pair of advisors over the cases both have in E,
    Holm-adjusted across the pairs (DESIGN §11); None without advisors."""
    names = _advisor_names(cases)
    if names is None:
        return None
    out = []
    for i, name in enumerate(names):
        verdicts = [(rec, v.advisors[name]) for rec, v in cases]
        counts = _label_counts(v.label for _, v in verdicts)
        n, r = len(verdicts), counts["rescued"]
        m = sum(v.in_m for _, v in verdicts)
        e = sum(v.in_e for _, v in verdicts)
        if any(v.in_e and not v.in_m for _, v in verdicts) or not r <= e <= m <= n:
            raise ValueError(f"advisor {name!r}: invariant R <= E <= M <= N violated: R={r} E={e} M={m} N={n}")
        table = PairTable()
        table.assisted_only, table.control_only, table.both_success, table.both_fail = _tally(
            (_advisor_success(rec, name), bool(rec.control.success)) for rec, v in verdicts if v.in_m
        )
        b, c = table.assisted_only, table.control_only
        sham = None
        if all(v.sham is not None for _, v in cases) and cases:
            st = ShamPairTable()
            st.assisted_only, st.sham_only, st.both_success, st.both_fail = _tally(
                (_advisor_success(rec, name), bool(rec.sham.success))
                for rec, v in cases if v.advisors[name].in_e and v.sham.in_e
            )
            k = st.assisted_only + st.sham_only + st.both_success + st.both_fail
            sham = AdvisorShamComparison(
                k=k, pairs=st, mcnemar_p=mcnemar_exact(st.assisted_only, st.sham_only),
                diff=_ratio(st.assisted_only - st.sham_only, k),
                diff_ci=paired_diff_ci(st.assisted_only, st.sham_only, k, confidence, both_success=st.both_success) if k else None,
            )
        out.append(AdvisorSummary(
            name=name, arm=f"assisted:{name}", primary=i == 0, counts=counts, r=r, m=m, e=e,
            r_over_n=_ratio(r, n), r_over_m=_ratio(r, m), r_over_e=_ratio(r, e), pairs=table,
            mcnemar_p=mcnemar_exact(b, c), diff=_ratio(b - c, m),
            diff_ci=paired_diff_ci(b, c, m, confidence, both_success=table.both_success) if m else None, sham=sham,
        ))
    pairs = []
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            t = AdvisorPairTable()
            t.first_only, t.second_only, t.both_success, t.both_fail = _tally(
                (_advisor_success(rec, first), _advisor_success(rec, second))
                for rec, v in cases if v.advisors[first].in_e and v.advisors[second].in_e
            )
            k = t.first_only + t.second_only + t.both_success + t.both_fail
            b, c = t.first_only, t.second_only
            pairs.append(AdvisorPair(
                first=first, second=second, k=k, pairs=t, mcnemar_p=mcnemar_exact(b, c), holm_p=1.0,
                diff=_ratio(b - c, k), diff_ci=paired_diff_ci(b, c, k, confidence, both_success=t.both_success) if k else None,
            ))
    for pair, adjusted in zip(pairs, holm([p.mcnemar_p for p in pairs])):
        pair.holm_p = adjusted
    return out, pairs


def ranked_advisors(advisors: Sequence[AdvisorSummary]) -> list[AdvisorSummary]:
    """The advisors ranked by R/E (highest first; none last), then by R, then in declared order."""
    order = {a.name: i for i, a in enumerate(advisors)}
    return sorted(advisors, key=lambda a: (a.r_over_e is None, -(a.r_over_e or 0.0), -a.r, order[a.name]))


def _summarize_cohort(cases: Sequence[tuple[CaseRecord, Verdict]], confidence: float) -> Summary:
    for rec, v in cases:
        if v.in_e and not v.in_m:
            raise ValueError(f"case {rec.case_id} is in E but not in M")
    counts = _label_counts(v.label for _, v in cases)
    n = len(cases)
    r = counts["rescued"]
    m = sum(v.in_m for _, v in cases)
    e = sum(v.in_e for _, v in cases)
    if not r <= e <= m <= n:
        raise ValueError(f"invariant R <= E <= M <= N violated: R={r} E={e} M={m} N={n}")
    table = _pair_table(cases)
    b, c = table.assisted_only, table.control_only
    return Summary(
        n=n,
        counts=counts,
        r=r,
        m=m,
        e=e,
        r_over_n=_ratio(r, n),
        r_over_m=_ratio(r, m),
        r_over_e=_ratio(r, e),
        pairs=table,
        mcnemar_p=mcnemar_exact(b, c),
        diff=_ratio(b - c, m),
        diff_ci=paired_diff_ci(b, c, m, confidence, both_success=table.both_success) if m else None,
        confidence=confidence,
        per_group=_breakdowns(cases, "group", confidence),
        per_task=_breakdowns(cases, "task", confidence),
        sham=sham_summary(cases, confidence),
        **_advisor_fields(cases, confidence),
    )


def _advisor_fields(cases: Sequence[tuple[CaseRecord, Verdict]], confidence: float) -> dict:
    found = advisor_summaries(cases, confidence)
    if found is None:
        return {}
    return {"advisors": found[0], "advisor_pairs": found[1]}


def summarize(
    records: Sequence[CaseRecord], verdicts: Sequence[Verdict], confidence: float = 0.95
) -> Summary:
    """Summarize a study: the main cohort with N fixed, and pilot cases apart."""
    by_id: dict[str, Verdict] = {}
    for v in verdicts:
        if v.case_id in by_id:
            raise ValueError(f"two verdicts for case {v.case_id}")
        by_id[v.case_id] = v
    seen: set[str] = set()
    main: list[tuple[CaseRecord, Verdict]] = []
    pilot: list[tuple[CaseRecord, Verdict]] = []
    for rec in records:
        if rec.case_id in seen:
            raise ValueError(f"case {rec.case_id} appears twice")
        seen.add(rec.case_id)
        # A case without a verdict would silently leave the denominator.
        if rec.case_id not in by_id:
            raise ValueError(f"no verdict for case {rec.case_id}")
        (pilot if rec.pilot else main).append((rec, by_id[rec.case_id]))
    extra = set(by_id) - seen
    if extra:
        raise ValueError(f"verdicts for unknown cases: {sorted(extra)[:5]}")
    summary = _summarize_cohort(main, confidence)
    summary.pilot_ids = [rec.case_id for rec, _ in pilot]
    summary.pilot = _summarize_cohort(pilot, confidence) if pilot else None
    return summary
