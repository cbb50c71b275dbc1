"""Formats of earlier versions: an export of `rescue-export/3` or `/4` read into today's shape, and today's
summary written in the shape a journal of those versions stored (so `rescue verify` re-derives an old study's
stored summary figure for figure).

Before the arm-against-arm record family (`rescue-export/5`), the sham arm's figures and its comparison with
the primary were one `sham` object, each advisor's figures and its comparison with the sham one entry of
`advisors`, the pairs of advisors `advisor_pairs`, and the 2x2 tables named their arms (`assisted_only`,
`control_only`, `sham_only`, `first_only`).
"""

from __future__ import annotations

from typing import Any

from rescue.core.arms import advisor_arm
from rescue.core.figures.stats import Breakdown, PairedComparison, PairedTable, Summary, compare

# --- an old export read into today's shape -------------------------------------------------------------


def _table(old: dict[str, int], first: str, second: str) -> dict[str, int]:
    return {"first_only": old.get(first, 0), "second_only": old.get(second, 0),
            "both_success": old.get("both_success", 0), "both_fail": old.get("both_fail", 0)}


def _comparison(first: str, second: str, old: dict[str, Any], table: tuple[str, str], k: int | None = None) -> dict:
    return {"first": first, "second": second, "k": old["k"] if k is None else k,
            "pairs": _table(old["pairs"], *table), "mcnemar_p": old["mcnemar_p"],
            **({"holm_p": old["holm_p"]} if "holm_p" in old else {}), "diff": old["diff"], "diff_ci": old["diff_ci"]}


def _ratio(x: int, n: int) -> float | None:
    return x / n if n else None


def _sham_parts(sham: dict[str, Any] | None, primary: str, n: int) -> tuple[list[dict], list[dict]]:
    if sham is None:
        return [], []
    figures = {"arm": "sham", "counts": sham["counts"], "r": sham["r"], "m": sham["m"], "e": sham["e"],
               "r_over_n": _ratio(sham["r"], n), "r_over_m": _ratio(sham["r"], sham["m"]),
               "r_over_e": _ratio(sham["r"], sham["e"]), "versus_control": None}
    return [figures], [_comparison(primary, "sham", sham, ("assisted_only", "sham_only"))]


def _upgrade_summary(old: dict[str, Any] | None, primary: str) -> dict[str, Any] | None:
    if old is None:
        return None
    new = {k: v for k, v in old.items() if k not in ("pairs", "mcnemar_p", "diff", "diff_ci", "sham", "advisors",
                                                      "advisor_pairs", "per_group", "per_task", "pilot")}
    new["arm"] = primary
    new["versus_control"] = _comparison(primary, "control", old, ("assisted_only", "control_only"), k=old["m"])
    arms, comparisons = [], []
    advisors = old.get("advisors") or []
    for a in advisors[1:]:
        arms.append({"arm": a["arm"], **{k: a[k] for k in ("counts", "r", "m", "e", "r_over_n", "r_over_m", "r_over_e")},
                     "versus_control": _comparison(a["arm"], "control", a, ("assisted_only", "control_only"), k=a["m"])})
    sham_arms, sham_comparisons = _sham_parts(old.get("sham"), primary, old["n"])
    arms += sham_arms
    comparisons += sham_comparisons
    for a in advisors[1:]:
        if a.get("sham") is not None:
            comparisons.append(_comparison(a["arm"], "sham", a["sham"], ("assisted_only", "sham_only")))
    for p in old.get("advisor_pairs") or []:
        comparisons.append(_comparison(advisor_arm(p["first"]), advisor_arm(p["second"]), p, ("first_only", "second_only")))
    new["arms"], new["comparisons"] = arms, comparisons
    for key in ("per_group", "per_task"):
        new[key] = {}
        for name, b in (old.get(key) or {}).items():
            b_arms, b_comparisons = _sham_parts(b.get("sham"), primary, b["n"])
            new[key][name] = {**{k: v for k, v in b.items() if k != "sham"}, "arms": b_arms, "comparisons": b_comparisons}
    new["pilot"] = _upgrade_summary(old.get("pilot"), primary)
    return new


def _upgrade_case(old: dict[str, Any], primary: str, arm_order: list[str]) -> dict[str, Any]:
    new = {k: v for k, v in old.items() if k not in ("control", "assisted", "sham", "sham_label", "sham_rule",
                                                      "sham_reason", "advisors")}
    new["primary"] = primary
    arms: dict[str, Any] = {"control": old.get("control"), primary: old.get("assisted")}
    verdicts: dict[str, Any] = {}
    advisors = old.get("advisors") or {}
    for name, entry in advisors.items():
        arm = entry.get("arm") or advisor_arm(name)
        if arm != primary:
            arms[arm] = entry.get("record")
            if entry.get("label") is not None:
                verdicts[arm] = {k: entry[k] for k in ("label", "rule", "reason", "in_m", "in_e")}
    if "sham" in arm_order:
        arms["sham"] = old.get("sham")
        if old.get("sham_label") is not None:
            verdicts["sham"] = {"label": old["sham_label"], "rule": old["sham_rule"], "reason": old["sham_reason"],
                                "in_m": False, "in_e": False}
    new["arms"] = {name: arms.get(name) for name in arm_order if name in arms}
    new["verdicts"] = verdicts
    return new


def upgrade_export(data: dict[str, Any]) -> dict[str, Any]:
    """An export document of `rescue-export/3` or `/4` in today's shape (its version kept). What the old
    document did not record stays unknown: the sham's comparison with control (`versus_control` None) and
    whether a sham pair was in M or E (False)."""
    data = dict(data)
    advisors = (data.get("study") or {}).get("advisors") or []
    primary = advisors[0]["arm"] if advisors else "assisted"
    data["summary"] = _upgrade_summary(data.get("summary"), primary)
    has_sham = any(c.get("sham") is not None or c.get("sham_label") is not None for c in data.get("cases") or [])
    order = ["control", primary, *(a["arm"] for a in advisors[1:]), *(["sham"] if has_sham else [])]
    data["cases"] = [_upgrade_case(c, primary, order) for c in data.get("cases") or []]
    return data


# --- today's summary in the shape an old journal stored it ---------------------------------------------


def is_legacy_summary(stored: Any) -> bool:
    """Whether a stored summary is of the shape before the record family (its 2x2 named `assisted_only`)."""
    return isinstance(stored, dict) and isinstance(stored.get("pairs"), dict) and "assisted_only" in stored["pairs"]


def _old_table(t: PairedTable, first: str, second: str) -> dict[str, int]:
    return {first: t.first_only, second: t.second_only, "both_success": t.both_success, "both_fail": t.both_fail}


def _old_comparison(c: PairedComparison, table: tuple[str, str]) -> dict[str, Any]:
    return {"k": c.k, "pairs": _old_table(c.pairs, *table), "mcnemar_p": c.mcnemar_p, "diff": c.diff,
            "diff_ci": list(c.diff_ci) if c.diff_ci is not None else None}


def _old_sham(arms: list, comparisons: list[PairedComparison], primary: str) -> dict[str, Any] | None:
    sham = next((f for f in arms if f.arm == "sham"), None)
    if sham is None:
        return None
    versus = next(c for c in comparisons if (c.first, c.second) == (primary, "sham"))
    return {"counts": sham.counts, "r": sham.r, "m": sham.m, "e": sham.e,
            **_old_comparison(versus, ("assisted_only", "sham_only"))}


def _old_breakdown(b: Breakdown, primary: str) -> dict[str, Any]:
    return {"n": b.n, "counts": b.counts, "rescued": b.rescued, "rate": b.rate,
            "sham": _old_sham(b.arms, b.comparisons, primary)}


def legacy_summary(s: Summary, advisors: list[str] | None) -> dict[str, Any]:
    """`s` as a journal of `rescue-export/4` or earlier stored it (`advisors`: the study's advisor names in
    declared order; None: a study of one `[vlm]`)."""
    primary, vc = s.arm, s.versus_control
    out: dict[str, Any] = {
        "n": s.n, "counts": s.counts, "r": s.r, "m": s.m, "e": s.e,
        "r_over_n": s.r_over_n, "r_over_m": s.r_over_m, "r_over_e": s.r_over_e,
        "pairs": _old_table(vc.pairs, "assisted_only", "control_only"), "mcnemar_p": vc.mcnemar_p, "diff": vc.diff,
        "diff_ci": list(vc.diff_ci) if vc.diff_ci is not None else None, "confidence": s.confidence,
        "per_group": {k: _old_breakdown(b, primary) for k, b in s.per_group.items()},
        "per_task": {k: _old_breakdown(b, primary) for k, b in s.per_task.items()},
        "pilot_ids": s.pilot_ids,
        "pilot": legacy_summary(s.pilot, advisors) if s.pilot is not None else None,
        "sham": _old_sham(s.arms, s.comparisons, primary),
    }
    if advisors:
        has_sham = out["sham"] is not None
        entries = []
        for i, (name, f) in enumerate(zip(advisors, s.figures())):
            versus = f.versus_control
            sham = s.comparison(f.arm, "sham") if has_sham else None
            entries.append({
                "name": name, "arm": f.arm, "primary": i == 0, "counts": f.counts, "r": f.r, "m": f.m, "e": f.e,
                "r_over_n": f.r_over_n, "r_over_m": f.r_over_m, "r_over_e": f.r_over_e,
                "pairs": _old_table(versus.pairs, "assisted_only", "control_only"), "mcnemar_p": versus.mcnemar_p,
                "diff": versus.diff, "diff_ci": list(versus.diff_ci) if versus.diff_ci is not None else None,
                "sham": _old_comparison(sham, ("assisted_only", "sham_only")) if sham is not None else None,
            })
        out["advisors"] = entries
        pairs = []
        for c in s.comparisons:
            if c.first.startswith("assisted:") and c.second.startswith("assisted:"):
                pairs.append({"first": c.first.split(":", 1)[1], "second": c.second.split(":", 1)[1],
                              **_old_comparison(c, ("first_only", "second_only")), "holm_p": c.holm_p})
        out["advisor_pairs"] = pairs
    return out


# --- an old comparison read into today's shape ----------------------------------------------------------


def _upgrade_slice(old: dict[str, Any], confidence: float, figures: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `rescue-comparison/1` PairCounts as a PairSlice; `figures`: the McNemar p, difference and interval the
    document stored for this slice (it stored them for all episodes only; a task's or group's are derived from
    its counts, as the document's own were)."""
    outcomes = ([(True, False)] * old.get("wins", 0) + [(False, True)] * old.get("losses", 0)
                + [(True, True)] * old.get("both_success", 0) + [(False, False)] * old.get("both_fail", 0))
    versus = compare("b", "a", outcomes, confidence).model_dump(mode="json")
    if figures is not None:
        versus.update(figures)
    excluded = {k: old.get(k, 0) for k in ("fingerprint_mismatch", "unknown", "unexecuted", "unmatched")}
    return {"n": old["n"], "versus": versus, **excluded}


def upgrade_comparison(data: dict[str, Any]) -> dict[str, Any]:
    """A comparison document of `rescue-comparison/1` (or of before it was versioned) in today's shape, its
    version kept: its own 2x2 (`wins`, `losses`, ...) and its `mcnemar_p`, `diff` and `newcombe_ci` become
    B's paired comparison with A (`counts.versus`)."""
    data = dict(data)
    confidence = data["confidence"]
    figures = {"mcnemar_p": data.pop("mcnemar_p"), "diff": data.pop("diff"), "diff_ci": data.pop("newcombe_ci")}
    data["schema_version"] = data.get("schema_version") or "rescue-comparison/1"
    data["counts"] = _upgrade_slice(data["counts"], confidence, figures)
    for key in ("per_task", "per_group"):
        data[key] = {name: _upgrade_slice(old, confidence) for name, old in (data.get(key) or {}).items()}
    return data
