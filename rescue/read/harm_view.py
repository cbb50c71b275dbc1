"""The historical successes and the net change as a person reads them (DESIGN §17): one sentence per arm, and
the harm table per arm (each query point's arm among them) for the terminal."""

from __future__ import annotations

from rich.table import Table

from rescue.core.arms import shown
from rescue.core.figures.harm_figures import HarmFigures, HarmSummary


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _points(x: float) -> str:
    return f"{100 * x:+.1f} pp"


def _net_text(figure: HarmFigures) -> str:
    net = figure.net
    if net is None or net.change is None:
        return "n/a"
    ci = net.change_ci
    return _points(net.change) + ("" if ci is None else f" [{_points(ci[0])}, {_points(ci[1])}]")


def evaluation_name(harm: HarmSummary) -> str:
    """The suites the study's cases come from, as the sentence names the evaluation."""
    return ", ".join(sorted({task.split("/")[0] for task in harm.per_task})) or "the evaluation"


def net_sentence(figure: HarmFigures, what: str) -> str:
    """"turning <arm> on at <its query point> would change <what> from X% to Y% [a, b] (net ±d pp)", or why it cannot say."""
    net = figure.net
    point = figure.query_point
    arm = shown(figure.arm if point is None else figure.arm.removesuffix(f"@{point}"))
    at = "at the pre-registered q" if point is None else f"at query point {point}"
    if net is None or net.change is None:
        return f"{arm} {at}: the net change on {what} cannot be estimated (a stratum of the evaluation has no replayed case)"
    ci = net.change_ci
    span = "" if ci is None else f" [{_pct(net.base_rate + ci[0])}, {_pct(net.base_rate + ci[1])}]"
    return (f"turning {arm} on {at} would change {what} from {_pct(net.base_rate)} to {_pct(net.rate_on)}{span} "
            f"(net {_points(net.change)}; {net.confidence:.0%} interval, {net.method})")


def harm_table(harm: HarmSummary, title: str = "historical successes: harm, rescue and the net change") -> Table:
    """Per arm: the successes' labels and exposure, harm over the exposed, rescue over the failures, net change."""
    t = Table(title=title)
    for col in ("arm", "successes", "exposed", "broken", "kept", "not repr.", "unknown/dev.", "harm [CI]", "p",
                "rescue [CI]", "net change [CI]"):
        t.add_column(col)
    for f in harm.arms:
        c = f.counts
        h, r = f.harm, f.rescue
        t.add_row(shown(f.arm), str(f.n), str(f.exposed), str(c["broken"]), str(c["kept"]), str(c["not_reproduced"]),
                  str(c["unknown"] + c["initial_state_deviation"]),
                  f"{_pct(h.diff)} [{_pct(h.diff_ci[0])}, {_pct(h.diff_ci[1])}]" if h.diff_ci else _pct(h.diff),
                  f"{h.p:.3g}",
                  f"{_pct(r.diff)} [{_pct(r.diff_ci[0])}, {_pct(r.diff_ci[1])}]" if r.diff_ci else _pct(r.diff),
                  _net_text(f))
    return t


def breakdown_table(by: dict[str, list[HarmFigures]], what: str) -> Table:
    """Per group or task: each arm's broken of exposed and net change."""
    t = Table(title=f"historical successes per {what}")
    for col in (what, "arm", "successes", "broken/exposed", "harm", "net change [CI]"):
        t.add_column(col)
    for name, figures in sorted(by.items()):
        for f in figures:
            t.add_row(name.removeprefix("libero_"), shown(f.arm), str(f.n), f"{f.counts['broken']}/{f.exposed}",
                      _pct(f.harm.diff), _net_text(f))
    return t
