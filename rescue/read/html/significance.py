"""Plain readings: of the exact McNemar p-value and the paired-difference interval together, and of a study's
result as a whole (`answer_reading`, the first thing its report says).

The two answer slightly different questions: McNemar tests only the discordant
pairs (b assisted-only, c control-only) exactly; the Newcombe interval is an
approximation over all M pairs. With few discordant pairs they can disagree,
and a reader deserves one sentence that says so instead of two bare numbers.
"""

from __future__ import annotations

import math
from typing import Any

from rescue.core.arms import arm_advisor, is_assisted


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} pp"


def significance_reading(
    b: int, c: int, p: float, ci: tuple[float, float] | None, alpha: float = 0.05, other: str = "control",
    subject: str = "the assisted arm", first: str = "assisted",
) -> str:
    """One sentence reading McNemar's p (discordant pairs b, c) and the paired CI of `first` - `other` together.

    `subject` names what helps or hurts (a comparison of studies names a study's assisted arm)."""
    if ci is None or any(math.isnan(x) for x in ci):
        return "No pair is in M, so neither the test nor the interval says anything yet."
    lo, hi = ci
    level = f"{100 * (1 - alpha):.0f}%"
    if b + c == 0:
        return (
            "The arms never disagreed on a pair (no discordant pairs): there is no evidence of an effect either way; "
            f"the {level} interval [{_pct(lo)}, {_pct(hi)}] bounds how large one could be."
        )
    significant = p < alpha
    excludes_zero = lo > 0 or hi < 0
    direction = "helps" if (lo > 0 if excludes_zero else b > c) else "hurts"
    if significant and excludes_zero:
        return (
            f"Both agree: {subject} {direction} (p = {p:.3g} < {alpha:g}, and the {level} interval "
            f"[{_pct(lo)}, {_pct(hi)}] excludes 0)."
        )
    if not significant and not excludes_zero:
        return (
            f"Both agree there is no clear effect (p = {p:.3g} ≥ {alpha:g}, and the {level} interval "
            f"[{_pct(lo)}, {_pct(hi)}] includes 0); the interval bounds how large an effect could be."
        )
    if not significant and excludes_zero:
        # The smallest p the exact test can give with b + c discordant pairs: all on one side.
        floor = min(1.0, 2 * 0.5 ** (b + c))
        power = f"cannot reach p < {alpha:g} with so few" if floor >= alpha else "has little power with so few"
        return (
            f"p = {p:.3g} and an interval excluding 0 disagree because only {b + c} pair(s) are discordant "
            f"({b} {first}-only, {c} {other}-only): the exact test {power}, "
            f"while the interval is an approximation over all the pairs; read it as a hint {subject} "
            f"{direction}, not yet established — more cases are needed."
        )
    return (
        f"p = {p:.3g} < {alpha:g} but the {level} interval [{_pct(lo)}, {_pct(hi)}] includes 0: the result is "
        "borderline (the approximate interval is wider than the exact test); treat the effect as not established."
    )


def _p_text(p: float) -> str:
    return f"{p:.2g}" if p < 0.001 else f"{p:.4f}"


def _share(x: int, n: int) -> str:
    return f"{100 * x / n:.1f}%" if n else "n/a"


def answer_reading(s: Any, sham_source: str | None = None, primary: str | None = None) -> str:
    """The result in a few plain sentences, for the top of the page: what the VLM's subgoal rescued (of the matched
    failures and of all, with the interval of R/N), against control and, with a sham arm, against the sham; with
    several arms that ask, which ranked first. `s`: a rescue study's Summary; `primary`: its primary advisor's name."""
    from rescue.core.figures.stats import ranked
    from rescue.core.figures.exact_stats import wilson_interval

    alpha = 1 - s.confidence
    level = f"{100 * s.confidence:.0f}%"
    chance = lambda p: "is unlikely to be chance" if p < alpha else "could well be chance"  # noqa: E731
    who = f"The subgoal of {primary} (the primary advisor)" if primary else "The VLM's subgoal"
    if not s.n:
        return "No case of the main cohort has a verdict yet: there is nothing to read."
    lo, hi = wilson_interval(s.r, s.n, s.confidence)
    out = [f"{who} rescued {s.r} of {s.m} matched failures ({s.r} of all {s.n} cases, {_share(s.r, s.n)}; "
           f"{level} interval {100 * lo:.1f}% to {100 * hi:.1f}%)."]
    vc = s.versus_control
    if vc is not None and s.m:
        t = vc.pairs
        if t.first_only + t.second_only == 0:
            out.append(f"Against its control the arms never disagreed on any of the {s.m} matched pairs: no evidence "
                       "of an effect either way.")
        else:
            out.append(f"Against its control, over the {s.m} matched pairs, the assisted arm alone succeeded "
                       f"{t.first_only} time(s) and the control alone {t.second_only}: the difference "
                       f"{chance(vc.mcnemar_p)} (exact McNemar p = {_p_text(vc.mcnemar_p)}).")
    sham = next((f for f in s.arms if f.arm == "sham"), None)
    versus = s.comparison(s.arm, "sham")
    if sham is not None:
        what = {"permuted": "A permuted sham (another case's subgoal, same pause and injection)",
                "fixed": "A fixed sham (a content-free text, same pause and injection)"}.get(sham_source or "", "The sham arm")
        out.append(f"{what} rescued {sham.r} of {sham.m}.")
        if versus is not None and versus.k:
            t = versus.pairs
            if t.first_only + t.second_only == 0:
                out.append(f"Against the sham the two subgoals never disagreed on any of the {versus.k} cases where both "
                           "were applied: no evidence that the subgoal's content matters.")
            else:
                out.append(f"Against the sham, over the {versus.k} cases where both subgoals were applied, the VLM's "
                           f"subgoal alone succeeded {t.first_only} time(s) and the sham's alone {t.second_only}: the "
                           f"effect of the subgoal's content {chance(versus.mcnemar_p)} "
                           f"(exact McNemar p = {_p_text(versus.mcnemar_p)}).")
    asking = [f for f in s.figures() if is_assisted(f.arm)]
    if len(asking) > 1:
        order = ", ".join(f"{arm_advisor(f.arm) or f.arm} {'n/a' if f.r_over_e is None else f'{100 * f.r_over_e:.1f}%'}"
                          for f in ranked(asking))
        out.append(f"Ranked by R/E (rescued of the cases with a subgoal applied and valid evidence): {order}.")
    return " ".join(out)
