"""The harm section of `rescue-export/6` (DESIGN §17 as it landed first): read into today's shape, and derived
again figure for figure so that `rescue verify` still checks a study whose journal stored it.

That version's net change had one interval, normal, from a two-stage variance (zero-width whenever the replayed
cases agreed), treated the successes' sample as a simple random sample whatever its design, and scaled a
`--limit` of failures to all of them; its harm and rescue intervals were bootstraps over cases, and `kept`
counted the successes the query point never reached. Read into today's shape, those figures keep their values:
the interval becomes the `these_episodes` interval, with no benchmark interval, and the method says which it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rescue.core.arms import query_point_of
from rescue.core.figures.continuations import estimate
from rescue.core.figures.exact_stats import normal_quantile
from rescue.core.figures.harm_figures import Judged, failure_scores, success_scores
from rescue.core.figures.success_sample import SamplingFrame
from rescue.core.success_labels import SUCCESS_LABELS, is_exposed

OLD_METHOD = "stratified two-stage: FPC on each stratum's sample, K-continuation variance within cases, normal"


def is_old_harm(harm: Any) -> bool:
    """Whether a stored or exported harm section is of `rescue-export/6` (arms without `unreached`)."""
    arms = harm.get("arms") if isinstance(harm, dict) else None
    return bool(arms) and all(isinstance(a, dict) and "unreached" not in a for a in arms)


# --- an old harm section read into today's shape --------------------------------------------------------------


def _paired(old: dict[str, Any]) -> dict[str, Any]:
    return {k: old.get(k) for k in ("k", "continuations", "first_rate", "second_rate", "diff", "diff_ci", "p")}


def _stratum(old: dict[str, Any]) -> dict[str, Any]:
    return {"population": old["population"], "sampled": old["sampled"], "mean": old.get("mean"),
            "census": old["sampled"] == old["population"]}


def _net(old: dict[str, Any] | None) -> dict[str, Any] | None:
    if old is None:
        return None
    ci = old.get("change_ci")
    refused = None
    if old.get("change") is None:
        refused = "a stratum of the evaluation had no replayed case"
    return {"episodes": old["episodes"], "failures": _stratum(old["failures"]), "successes": _stratum(old["successes"]),
            "base_rate": old["base_rate"], "change": old.get("change"),
            "these_episodes": None if ci is None else {"low": ci[0], "high": ci[1], "exact": False},
            "benchmark": None, "confidence": old.get("confidence", 0.95), "method": old.get("method", OLD_METHOD),
            "refused": refused}


def _figures(old: dict[str, Any]) -> dict[str, Any]:
    unreached = old["n"] - old["exposed"]
    counts = dict(old["counts"])
    counts["kept"] = counts.get("kept", 0) - unreached
    return {"arm": old["arm"], "query_point": old.get("query_point"), "n": old["n"], "counts": counts,
            "unreached": unreached, "exposed": old["exposed"], "m": old["m"], "harm": _paired(old["harm"]),
            "rescue": _paired(old["rescue"]), "net": _net(old.get("net"))}


def upgrade_harm(old: dict[str, Any]) -> dict[str, Any]:
    """A `rescue-export/6` harm section in today's shape, its figures as stored."""
    return {"successes": old["successes"], "frame": old.get("frame"), "pilot_failures": 0, "replays_exact": False,
            "arms": [_figures(f) for f in old["arms"]],
            "per_group": {k: [_figures(f) for f in v] for k, v in (old.get("per_group") or {}).items()},
            "per_task": {k: [_figures(f) for f in v] for k, v in (old.get("per_task") or {}).items()}}


# --- the old harm section derived again ---------------------------------------------------------------------


def _old_stratum(scores: list[tuple[float, float]], population: int) -> dict[str, Any]:
    n = len(scores)
    if n == 0:
        return {"population": population, "sampled": 0, "fraction": None, "mean": None, "variance": None}
    f = n / population
    mean = math.fsum(s for s, _ in scores) / n
    within = math.fsum(v for _, v in scores)
    if n == 1:
        variance = within if f == 1.0 else None
    else:
        s2 = math.fsum((s - mean) ** 2 for s, _ in scores) / (n - 1)
        variance = (1 - f) * s2 / n + f * within / (n * n)
    return {"population": population, "sampled": n, "fraction": f, "mean": mean, "variance": variance}


def _old_net(f_scores, failures: int, s_scores, successes: int, confidence: float) -> dict[str, Any]:
    n = failures + successes
    fail, succ = _old_stratum(f_scores, failures), _old_stratum(s_scores, successes)
    out = {"episodes": n, "failures": fail, "successes": succ, "base_rate": successes / n, "change": None,
           "change_ci": None, "confidence": confidence, "method": OLD_METHOD}
    parts = [(failures / n, fail, 1.0), (successes / n, succ, -1.0)]
    if any(w > 0 and s["mean"] is None for w, s, _ in parts):
        return out
    out["change"] = math.fsum(sign * w * s["mean"] for w, s, sign in parts if w > 0)
    if any(w > 0 and s["variance"] is None for w, s, _ in parts):
        return out
    half = normal_quantile(0.5 + confidence / 2) * math.sqrt(math.fsum(w * w * s["variance"] for w, s, _ in parts if w > 0))
    out["change_ci"] = [max(-successes / n, out["change"] - half), min(failures / n, out["change"] + half)]
    return out


def _old_scores(cases: Sequence[Judged], arm: str, harm: bool) -> tuple[list[tuple[float, float]], list[tuple[int, int]], int]:
    k_max = max((rec.continuations for rec, _ in cases), default=1)
    out: list[tuple[float, float]] = []
    pairs: list[tuple[int, int]] = []
    for rec, v in cases:
        if harm:
            verdict = v.of(arm, rec.primary)
            if verdict is not None and not is_exposed(verdict.label, verdict.rule):
                out.append((0.0, 0.0))
                continue
        got = (success_scores if harm else failure_scores)([(rec, v)], arm)
        if got[1]:
            (first, second), k = got[1][0], got[2]
            p1, p2 = first / k, second / k
            variance = (p1 * (1 - p1) + p2 * (1 - p2)) / (k - 1) if k > 1 else 0.0
            out.append((p1 - p2, variance))
            pairs.append((first, second))
    return out, pairs, k_max


def _old_figures(failures: Sequence[Judged], successes: Sequence[Judged], arm: str, frame: SamplingFrame | None,
                 confidence: float) -> dict[str, Any]:
    counts = dict.fromkeys(SUCCESS_LABELS, 0)
    exposed = 0
    for rec, v in successes:
        verdict = v.of(arm, rec.primary)
        counts[verdict.label] += 1
        exposed += is_exposed(verdict.label, verdict.rule)
    s_scores, s_pairs, k_s = _old_scores(successes, arm, harm=True)
    f_scores, f_pairs, k_f = _old_scores(failures, arm, harm=False)
    frame = frame or SamplingFrame(failures=len(failures), successes=len(successes))
    net = None
    if frame.episodes and len(failures) <= frame.failures and len(successes) <= frame.successes:
        net = _old_net(f_scores, frame.failures, s_scores, frame.successes, confidence)
    return {"arm": arm, "query_point": query_point_of(arm), "n": len(successes), "counts": counts, "exposed": exposed,
            "m": len(s_pairs), "harm": estimate(s_pairs, k_s, confidence).model_dump(mode="json"),
            "rescue": estimate(f_pairs, k_f, confidence).model_dump(mode="json"), "net": net}


def old_harm_summary(failures: Sequence[Judged], successes: Sequence[Judged], judged: Sequence[str],
                     frame: SamplingFrame | None, task_frames: dict[str, SamplingFrame], confidence: float) -> dict[str, Any]:
    """The harm section exactly as `rescue-export/6` computed and stored it (JSON shape)."""

    def split(key: str) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for name in sorted({getattr(rec, key) for rec, _ in (*failures, *successes)}):
            fails = [(r, v) for r, v in failures if getattr(r, key) == name]
            succs = [(r, v) for r, v in successes if getattr(r, key) == name]
            tasks = {r.task for r, _ in (*fails, *succs)}
            part = None
            if tasks and all(t in task_frames for t in tasks):
                part = SamplingFrame(failures=sum(task_frames[t].failures for t in tasks),
                                     successes=sum(task_frames[t].successes for t in tasks))
            elif frame is not None:
                part = SamplingFrame(failures=0, successes=0)
            out[name] = [_old_figures(fails, succs, arm, part, confidence) for arm in judged]
        return out

    old_frame = None if frame is None else {"failures": frame.failures, "successes": frame.successes,
                                            "sampled": frame.sampled, "seed": frame.seed}
    return {"successes": len(successes), "frame": old_frame,
            "arms": [_old_figures(failures, successes, arm, frame, confidence) for arm in judged],
            "per_group": split("group"), "per_task": split("task")}
