"""The historical successes and the net change as a person reads them (DESIGN §17): which evaluation the figures
speak for, one sentence per arm that names the population of each interval and says what was extrapolated, and
the harm table per arm (each query point's arm among them) for the terminal."""

from __future__ import annotations

import datetime as dt

from rich.table import Table

from rescue.core.arms import shown
from rescue.core.figures.baseline import Baseline
from rescue.core.figures.harm import Interval, NetChange
from rescue.core.figures.harm_figures import HarmFigures, HarmSummary, PairedDifference


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _points(x: float) -> str:
    return f"{100 * x:+.1f} pp"


def interval_text(ci: Interval | None) -> str:
    """`[-20.9, +41.8] pp`, `exact` for a census of exact replays, `n/a` without one."""
    if ci is None:
        return "n/a"
    if ci.exact:
        return "exact"
    return f"[{100 * ci.low:+.1f}, {100 * ci.high:+.1f}] pp"


def paired_text(p: PairedDifference) -> str:
    """`25.0% [-35.0%, 70.0%]`: a paired difference and its interval."""
    if p.diff is None:
        return "n/a"
    return _pct(p.diff) + ("" if p.diff_ci is None else f" [{_pct(p.diff_ci[0])}, {_pct(p.diff_ci[1])}]")


def evaluation_name(baseline: Baseline | None, harm: HarmSummary) -> str:
    """The evaluation the net change is a change of: its id, episodes and date as the cases' provenance names
    it, or the manifest's own cases when none is named."""
    sources = [] if baseline is None else baseline.sources
    episodes = harm.arms[0].net.episodes if harm.arms and harm.arms[0].net is not None else None
    suites = ", ".join(sorted({task.split("/")[0] for task in harm.per_task}))
    if len(sources) == 1:
        src = sources[0]
        name = (f"evaluation {src.eval_study}" if src.eval_study else
                f"{src.kind} results {src.results_file}" if src.results_file else "the evaluation")
        parts = [f"{src.episodes} episodes" if src.episodes is not None else None, suites or None,
                 _date(src.created)]
        return f"{name} ({', '.join(p for p in parts if p)})"
    if sources:
        return f"{len(sources)} evaluations ({suites})"
    return f"the manifest's own {episodes} episodes ({suites}; no evaluation named)" if episodes else "the manifest's cases"


def _date(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    return dt.datetime.fromtimestamp(stamp, tz=dt.timezone.utc).strftime("%Y-%m-%d")


def _extrapolated(net: NetChange) -> str:
    """What of the evaluation was not replayed, in words; empty for a census."""
    parts = [f"{s.sampled} of its {s.population} {what}" for s, what in ((net.failures, "failures"),
                                                                         (net.successes, "successes"))
             if not s.census and s.population]
    return ("extrapolated from " + " and ".join(parts)) if parts else "every episode replayed"


def net_sentence(figure: HarmFigures, evaluation: str) -> str:
    """"turning <arm> on at <its query point> would change <evaluation>'s success rate from X% to Y% (net ±d pp):
    for these N episodes [a, b] pp, <what was extrapolated>; for the benchmark [c, d] pp", or why it cannot say."""
    net = figure.net
    point = figure.query_point
    arm = shown(figure.arm if point is None else figure.arm.removesuffix(f"@{point}"))
    at = "at the pre-registered q" if point is None else f"at query point {point}"
    if net is None:
        return f"{arm} {at}: no net change of {evaluation} (no frame to scale by)"
    if net.change is None:
        return f"{arm} {at}: the net change of {evaluation} is not estimated: {net.refused}"
    these = ("exact for these episodes" if net.these_episodes is not None and net.these_episodes.exact
             else f"for these {net.episodes} episodes {interval_text(net.these_episodes)}")
    return (f"turning {arm} on {at} would change the success rate of {evaluation} from {_pct(net.base_rate)} to "
            f"{_pct(net.rate_on)} (net {_points(net.change)}): {these}, {_extrapolated(net)}; for the benchmark "
            f"(the suite's initial states) {interval_text(net.benchmark)} ({net.confidence:.0%} intervals)")


def harm_table(harm: HarmSummary, title: str = "historical successes: harm, rescue and the net change") -> Table:
    """Per arm: the successes' labels and reach, harm over the reached, rescue over the failures, net change."""
    t = Table(title=title)
    for col in ("arm", "successes", "reached", "broken", "kept", "not repr.", "unknown/dev.", "unreached (no call)",
                "harm [CI]", "p", "rescue [CI]", "net: these episodes", "net: benchmark"):
        t.add_column(col)
    for f in harm.arms:
        c = f.counts
        net = f.net
        change = "n/a" if net is None or net.change is None else _points(net.change)
        t.add_row(shown(f.arm), str(f.n), str(f.exposed), str(c["broken"]), str(c["kept"]), str(c["not_reproduced"]),
                  str(c["unknown"] + c["initial_state_deviation"]), str(f.unreached), paired_text(f.harm),
                  f"{f.harm.p:.3g}", paired_text(f.rescue),
                  change + ("" if net is None or net.change is None else f" {interval_text(net.these_episodes)}"),
                  "n/a" if net is None or net.change is None else interval_text(net.benchmark))
    return t


def breakdown_table(by: dict[str, list[HarmFigures]], what: str) -> Table:
    """Per group or task: each arm's broken of reached and net change for these episodes."""
    t = Table(title=f"historical successes per {what}")
    for col in (what, "arm", "successes", "broken/reached", "harm", "net change [these episodes]"):
        t.add_column(col)
    for name, figures in sorted(by.items()):
        for f in figures:
            net = f.net
            text = ("n/a" if net is None or net.change is None
                    else f"{_points(net.change)} {interval_text(net.these_episodes)}")
            t.add_row(name.removeprefix("libero_"), shown(f.arm), str(f.n), f"{f.counts['broken']}/{f.exposed}",
                      _pct(f.harm.diff), text)
    return t
