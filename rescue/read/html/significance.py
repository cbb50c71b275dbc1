"""A plain reading of the exact McNemar p-value and the paired-difference interval together.

The two answer slightly different questions: McNemar tests only the discordant
pairs (b assisted-only, c control-only) exactly; the Newcombe interval is an
approximation over all M pairs. With few discordant pairs they can disagree,
and a reader deserves one sentence that says so instead of two bare numbers.
"""

from __future__ import annotations

import math


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
