"""Whether and when to ask, as a person reads it (DESIGN §18): the best way of asking per call in one sentence, and
the table of every way of asking (its duty cycle, declines, rescue, harm, net change and change per call) with the
triggers' paired tests, for the terminal; the HTML report shows the same figures (study.html)."""

from __future__ import annotations

from rich.table import Table

from rescue.core.arms import shown
from rescue.core.figures.asking import AskingSummary, Duty, WayOfAsking, way_name
from rescue.read.harm_view import interval_text, paired_text


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def duty_text(d: Duty | None) -> str:
    """`5/12 asked, 0.42 calls/ep, 1 declined`: one stratum's duty cycle."""
    if d is None:
        return "n/a"
    per = "n/a" if d.calls_per_episode is None else f"{d.calls_per_episode:.2f}"
    return f"{d.asked}/{d.episodes} asked, {per} calls/ep" + (f", {d.declined} declined" if d.declined else "")


def net_text(way: WayOfAsking) -> str:
    """The net change and its interval for these episodes, or why there is none."""
    net = way.net
    if net is None:
        return "n/a (failures only)"
    if net.change is None:
        return f"not estimated ({net.refused})"
    return f"{100 * net.change:+.1f} pp {interval_text(net.these_episodes)}; benchmark {interval_text(net.benchmark)}"


def per_call_text(way: WayOfAsking) -> str:
    """The change per call, in points."""
    return "n/a" if way.change_per_call is None else f"{100 * way.change_per_call:+.1f} pp"


def ways_table(asking: AskingSummary, title: str = "ways of asking (DESIGN §18), per call") -> Table:
    """Per way of asking: kind, duty cycle on failures and successes, declines, rescue, harm, net change, per call."""
    t = Table(title=title)
    for col in ("arm", "way", "failures", "successes", "calls/episode", "rescue [CI]", "harm [CI]",
                "applied: rescue / harm", "net change", "per call"):
        t.add_column(col)
    for w in asking.ways:
        applied = f"{_pct(w.applied_rescue.diff)} / {_pct(w.applied_harm.diff) if w.applied_harm else 'n/a'}"
        t.add_row(shown(w.arm) + (" (best)" if w.arm == asking.best else ""), way_name(w), duty_text(w.failures),
                  duty_text(w.successes), "n/a" if w.calls_per_episode is None else f"{w.calls_per_episode:.2f}",
                  paired_text(w.rescue), paired_text(w.harm) if w.harm else "n/a", applied, net_text(w),
                  per_call_text(w))
    return t


def tests_table(asking: AskingSummary) -> Table:
    """Each trigger against its placebo and the fixed query points: the 2x2's discordant cells, exact McNemar, Holm."""
    t = Table(title="triggers against their placebos and the fixed query points (episodes with both pairs in M)")
    for col in ("first", "second", "only first", "only second", "K", "exact McNemar p", "Holm-adjusted p"):
        t.add_column(col)
    for c in asking.comparisons:
        t.add_row(shown(c.first), shown(c.second), str(c.pairs.first_only), str(c.pairs.second_only), str(c.k),
                  f"{c.mcnemar_p:.3g}", "n/a" if c.holm_p is None else f"{c.holm_p:.3g}")
    for b in asking.budgets:
        placebo = "n/a" if b.placebo_calls is None else f"{b.placebo_calls:.2f}"
        trigger = "n/a" if b.trigger_calls is None else f"{b.trigger_calls:.2f}"
        t.add_row(shown(b.placebo), shown(b.trigger), "", "", "",
                  f"budget: {placebo} vs {trigger} calls/ep", "matched" if b.matched else "NOT matched")
    return t
