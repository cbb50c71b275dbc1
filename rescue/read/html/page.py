"""HTML pieces of the report: the summary (DESIGN §3), the usage panel, the page frame.

Every figure cell carries `data-figure` (its name) and `data-value` (the
export's value as JSON), so a browser test can read the page back and
compare it with the export.
"""

from __future__ import annotations

import html
import json
from typing import Any

from rescue.core.arms import arm_advisor, is_assisted
from rescue.core.stats import LABELS, ArmFigures, Breakdown, PairedComparison, Summary, ranked
from rescue.read.html import app
from rescue.read.html.significance import significance_reading

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#222;background:#fafafa}
main{max-width:1180px;margin:0 auto;padding:1.2em 2em 3em}
h1{margin:.2em 0 0;font-size:1.7em}h2{margin-top:1.6em;border-bottom:2px solid #ddd;padding-bottom:.2em}
.sub{color:#555;margin:.2em 0 1em}
table{border-collapse:collapse;margin:.4em 0 1.2em;background:#fff}
td,th{border:1px solid #d5d5d5;padding:.25em .6em;text-align:left;vertical-align:top;font-size:.92em}
th{background:#f0f0f0}td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
.cols{display:flex;gap:2em;flex-wrap:wrap;align-items:flex-start}.cols>div{flex:1;min-width:380px}
.cards{display:flex;gap:.8em;flex-wrap:wrap;margin:.6em 0}
.card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:.6em 1em;min-width:120px}
.card .v{font-size:1.6em;font-weight:600}.card .k{color:#666;font-size:.85em}
.reading{background:#eef4fb;border-left:4px solid #1565c0;padding:.6em 1em;margin:.6em 0 1em}
.note{color:#666;font-size:.9em}
.plots{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}.plots img{max-width:560px;background:#fff;border:1px solid #ddd}
.rescued{color:#2e7d32}.not_rescued{color:#616161}.unknown{color:#b26a00}.initial_state_deviation{color:#c62828}
tr.rescued td:first-child{border-left:4px solid #2e7d32}tr.unknown td:first-child{border-left:4px solid #f9a825}
tr.initial_state_deviation td:first-child{border-left:4px solid #c62828}
.case{background:#fff;border:1px solid #ddd;border-radius:8px;padding:.6em 1.2em;margin:1.2em 0}
.case h3{margin:.3em 0}.arms{display:flex;gap:1.2em;flex-wrap:wrap}.arm{flex:1;min-width:260px}
.frames{display:flex;gap:.5em;flex-wrap:wrap}.frames figure{margin:0}.frames img{width:160px;image-rendering:pixelated}
figcaption{font-size:.8em;color:#555}pre{white-space:pre-wrap;background:#f6f6f6;padding:.6em;max-height:24em;overflow:auto}
.ok{color:#2e7d32}.bad{color:#c62828}.filters label{margin-right:1em}
code{background:#f1f1f1;padding:0 .25em;border-radius:3px}
"""

def esc(x: Any) -> str:
    """HTML-escaped text of any value ('' for None)."""
    return "" if x is None else html.escape(str(x))


def pct(x: float | None) -> str:
    """A share as a percentage with two decimals, or n/a."""
    return "n/a" if x is None else f"{100 * x:.2f}%"


def figure(name: str, value: Any, text: str | None = None, cls: str = "num") -> str:
    """A table cell holding one figure, machine-readable by its name."""
    shown = esc(value) if text is None else esc(text)
    return f'<td class="{cls}" data-figure="{esc(name)}" data-value="{esc(json.dumps(value))}">{shown}</td>'


def _ci_text(ci: tuple[float, float] | None) -> str:
    return "n/a" if ci is None else f"[{pct(ci[0])}, {pct(ci[1])}]"


def paired_block(prefix: str, title: str, c: PairedComparison, confidence: float, first: str = "assisted",
                 other: str = "control") -> str:
    """One arm against another: the raw 2x2, the exact McNemar p, the paired CI, and their reading together."""
    level = f"{round(confidence * 100)}%"
    t = c.pairs
    rows = [
        (f"{first} succeeded, {other} failed ({first}-only)", "first_only", t.first_only),
        (f"{other} succeeded, {first} failed ({other}-only)", "second_only", t.second_only),
        ("both succeeded", "both_success", t.both_success),
        ("both failed", "both_fail", t.both_fail),
    ]
    body = "".join(f"<tr><th>{esc(k)}</th>{figure(f'{prefix}.{n}', v)}</tr>" for k, n, v in rows)
    body += f"<tr><th>exact McNemar p (discordant pairs)</th>{figure(f'{prefix}.mcnemar_p', c.mcnemar_p, f'{c.mcnemar_p:.4f}')}</tr>"
    body += f"<tr><th>paired difference, {first} - {other}</th>{figure(f'{prefix}.diff', c.diff, pct(c.diff))}</tr>"
    body += (
        f"<tr><th>{level} CI (Newcombe)</th>"
        + figure(f"{prefix}.diff_ci", list(c.diff_ci) if c.diff_ci else None, _ci_text(c.diff_ci))
        + "</tr>"
    )
    reading = significance_reading(t.first_only, t.second_only, c.mcnemar_p, c.diff_ci, 1 - confidence, other,
                                   first=first)
    return f"<h3>{esc(title)}</h3><table>{body}</table><p class=\"reading\" data-reading=\"{esc(prefix)}\">{esc(reading)}</p>"


def _sham(figures: list[ArmFigures]) -> ArmFigures | None:
    return next((f for f in figures if f.arm == "sham"), None)


def summary_block(prefix: str, s: Summary) -> str:
    """DESIGN §3: fixed N, the four classes, M, E, R/N, R/M, R/E, the 2x2, McNemar and the CI with their reading."""
    cards = [("cases (N, fixed)", "n", s.n, None), ("rescued (R)", "rescued", s.counts.get("rescued", 0), None),
             ("R/N", "r_over_n", s.r_over_n, pct(s.r_over_n)), ("R/M", "r_over_m", s.r_over_m, pct(s.r_over_m)),
             ("R/E", "r_over_e", s.r_over_e, pct(s.r_over_e))]
    card_html = "".join(
        f'<div class="card"><div class="v" data-figure="{prefix}.{n}.card" data-value="{esc(json.dumps(v))}">'
        f"{esc(v if t is None else t)}</div><div class=\"k\">{esc(k)}</div></div>"
        for k, n, v, t in cards
    )
    rows = [f"<tr><th>cases (N, fixed: every manifest case of the cohort)</th>{figure(f'{prefix}.n', s.n)}</tr>"]
    rows += [
        f'<tr><th class="{label}">{esc(label)}</th>{figure(f"{prefix}.{label}", s.counts.get(label, 0))}</tr>'
        for label in LABELS
    ]
    rows += [
        f"<tr><th>M: both arms valid and complete, no deviation, exact prefix</th>{figure(f'{prefix}.m', s.m)}</tr>",
        f"<tr><th>E: M with the subgoal applied and valid evidence</th>{figure(f'{prefix}.e', s.e)}</tr>",
        f"<tr><th>R/N</th>{figure(f'{prefix}.r_over_n', s.r_over_n, pct(s.r_over_n))}</tr>",
        f"<tr><th>R/M</th>{figure(f'{prefix}.r_over_m', s.r_over_m, pct(s.r_over_m))}</tr>",
        f"<tr><th>R/E</th>{figure(f'{prefix}.r_over_e', s.r_over_e, pct(s.r_over_e))}</tr>",
    ]
    if s.reproduction is not None:
        rep = s.reproduction
        rows.append(f"<tr><th>control failed again (of {rep.controls} control runs that completed)</th>"
                    f"{figure(f'{prefix}.reproduction.failed', rep.failed)}</tr>")
    out = f'<div class="cards">{card_html}</div><div class="cols"><div><h3>classes over N</h3><table>{"".join(rows)}</table></div><div>'
    out += paired_block(prefix, "assisted vs control over M", s.versus_control, s.confidence)
    sham = _sham(s.arms)  # the placebo comparison (DESIGN §8), when the study has a sham arm
    versus = s.comparison(s.arm, "sham")
    if sham is not None and versus is not None:
        counts = "".join(
            f"<tr><th>sham vs control: {esc(k)}</th>{figure(f'{prefix}.sham.counts.{k}', v)}</tr>" for k, v in sham.counts.items()
        )
        out += (
            f"<h3>sham arm against control</h3><table>{counts}"
            f"<tr><th>sham M / E</th><td>{sham.m} / {sham.e}</td></tr>"
            f"<tr><th>K: both subgoals applied, three arms valid</th>{figure(f'{prefix}.sham.k', versus.k)}</tr></table>"
        )
        out += paired_block(f"{prefix}.sham", "assisted vs sham: the effect of the VLM's content", versus, s.confidence,
                            other="sham")
    return out + "</div></div>"


def _p(p: float) -> str:
    return f"{p:.2g}" if p < 0.001 else f"{p:.4f}"


def _name(arm: str) -> str:
    return arm_advisor(arm) or arm


def advisors_block(prefix: str, s: Summary, infos: Any = None) -> str:
    """DESIGN §11, §14: the arms that ask ranked by R/E (each against control and the sham), the pairwise matrix
    of Holm-adjusted p and paired difference, and every pair's 2x2, exact McNemar p, Holm p and Newcombe CI."""
    figures = [f for f in s.figures() if is_assisted(f.arm)]
    about = {a.arm: a for a in infos or []}
    sham = _sham(s.arms) is not None
    head = ("<tr><th class=num>rank</th><th>advisor</th><th>model · prompt (endpoint)</th><th class=num>R</th>"
            "<th class=num>M</th><th class=num>E</th><th class=num>R/N</th><th class=num>R/M</th><th class=num>R/E</th>"
            "<th class=num>vs control: b</th><th class=num>c</th><th class=num>p</th><th class=num>difference, 95% CI</th>")
    if sham:
        head += ("<th class=num>vs sham: K</th><th class=num>b</th><th class=num>c</th><th class=num>p</th>"
                 "<th class=num>difference, 95% CI</th>")
    body = ""
    for rank, a in enumerate(ranked(figures), start=1):
        name = _name(a.arm)
        key = f"{prefix}.advisor.{name}"
        info = about.get(a.arm)
        what = f"{info.model} · {info.prompt_template} ({info.endpoint})" if info is not None else ""
        vc = a.versus_control
        body += (f'<tr data-advisor="{esc(name)}" data-rank="{rank}">{figure(f"{key}.rank", rank)}'
                 f"<td>{esc(name)}{' (primary)' if a.arm == s.arm else ''}</td><td>{esc(what)}</td>"
                 f"{figure(key + '.r', a.r)}{figure(key + '.m', a.m)}{figure(key + '.e', a.e)}"
                 f"{figure(key + '.r_over_n', a.r_over_n, pct(a.r_over_n))}{figure(key + '.r_over_m', a.r_over_m, pct(a.r_over_m))}"
                 f"{figure(key + '.r_over_e', a.r_over_e, pct(a.r_over_e))}"
                 f"{figure(key + '.first_only', vc.pairs.first_only)}{figure(key + '.second_only', vc.pairs.second_only)}"
                 f"{figure(key + '.mcnemar_p', vc.mcnemar_p, _p(vc.mcnemar_p))}"
                 f"{figure(key + '.diff_ci', list(vc.diff_ci) if vc.diff_ci else None, f'{pct(vc.diff)} {_ci_text(vc.diff_ci)}')}")
        if sham:
            v = s.comparison(a.arm, "sham")
            if v is None:
                body += "<td colspan=5>n/a</td>"
            else:
                body += (f"{figure(key + '.sham.k', v.k)}{figure(key + '.sham.first_only', v.pairs.first_only)}"
                         f"{figure(key + '.sham.second_only', v.pairs.second_only)}{figure(key + '.sham.mcnemar_p', v.mcnemar_p, _p(v.mcnemar_p))}"
                         + figure(key + ".sham.diff_ci", list(v.diff_ci) if v.diff_ci else None, f"{pct(v.diff)} {_ci_text(v.diff_ci)}"))
        body += "</tr>"
    out = (f'<h3>advisors, ranked by R/E</h3><p class="note">b: cases only the advisor\'s arm succeeded; c: only the '
           "other arm (control, or the sham over K, the cases where both are in E); p: exact McNemar; the difference is "
           "the advisor's success rate minus the other's, with Newcombe's interval.</p>"
           f'<div class="scroll"><table data-table="{esc(prefix)}.advisors">{head}</tr>{body}</table></div>')
    pairs = [c for c in s.comparisons if c.holm_p is not None]
    if not pairs:
        return out
    names = [_name(f.arm) for f in figures]
    by = {(_name(q.first), _name(q.second)): q for q in pairs}
    cells = "<tr><th>row vs column: Holm-adjusted p · row - column</th>" + "".join(f"<th>{esc(n)}</th>" for n in names) + "</tr>"
    for row in names:
        cells += f"<tr><th>{esc(row)}</th>"
        for col in names:
            q = by.get((row, col)) or by.get((col, row))
            if q is None:
                cells += "<td>·</td>"
                continue
            diff = q.diff if (_name(q.first), _name(q.second)) == (row, col) or q.diff is None else 0.0 - q.diff
            cells += figure(f"{prefix}.matrix.{row}.{col}", q.holm_p, f"p {_p(q.holm_p)} · {pct(diff)}", cls="")
        cells += "</tr>"
    out += (f'<h3>pairwise matrix (cases in E for both advisors; exact McNemar, Holm-adjusted across {len(pairs)} pairs)</h3>'
            f'<table data-table="{esc(prefix)}.matrix">{cells}</table>')
    head = ("<tr><th>first vs second</th><th class=num>K</th><th class=num>first-only</th><th class=num>second-only</th>"
            "<th class=num>both succeeded</th><th class=num>both failed</th><th class=num>exact McNemar p</th>"
            "<th class=num>Holm-adjusted p</th><th class=num>first - second</th><th class=num>95% CI (Newcombe)</th></tr>")
    body = ""
    for q in pairs:
        first, second = _name(q.first), _name(q.second)
        key = f"{prefix}.pair.{first}.{second}"
        t = q.pairs
        body += (f'<tr data-pair="{esc(first)}|{esc(second)}"><td>{esc(first)} vs {esc(second)}</td>'
                 f"{figure(key + '.k', q.k)}{figure(key + '.first_only', t.first_only)}{figure(key + '.second_only', t.second_only)}"
                 f"{figure(key + '.both_success', t.both_success)}{figure(key + '.both_fail', t.both_fail)}"
                 f"{figure(key + '.mcnemar_p', q.mcnemar_p, _p(q.mcnemar_p))}{figure(key + '.holm_p', q.holm_p, _p(q.holm_p))}"
                 f"{figure(key + '.diff', q.diff, pct(q.diff))}"
                 f"{figure(key + '.diff_ci', list(q.diff_ci) if q.diff_ci else None, _ci_text(q.diff_ci))}</tr>")
    return out + f'<h3>advisors paired</h3><table data-table="{esc(prefix)}.pairs">{head}{body}</table>'


def advisor_usage_block(by_advisor: dict[str, Any]) -> str:
    """Per advisor: calls, statuses, tokens by kind, latency and its cost under its declared price."""
    head = ("<tr><th>advisor</th><th class=num>calls</th><th class=num>not ok</th><th class=num>attempts</th>"
            "<th class=num>input tokens</th><th class=num>cached input</th><th class=num>output</th><th class=num>reasoning</th>"
            "<th class=num>median latency</th><th class=num>max latency</th><th>cost</th></tr>")
    body = ""
    for name, u in by_advisor.items():
        key = f"usage.advisor.{name}"
        body += f"<tr><td>{esc(name)}</td>{figure(key + '.calls', u.calls)}"
        body += figure(key + ".not_ok", u.calls - u.by_status.get("ok", 0)) + figure(key + ".attempts", u.attempts)
        for kind in ("input", "cached_input", "output", "reasoning"):
            t = u.tokens[kind]
            body += figure(f"{key}.tokens.{kind}", t.total, "unknown" if t.total is None else str(t.total))
        for what, v in (("median", u.latency.median_s), ("max", u.latency.max_s)):
            body += figure(f"{key}.latency.{what}", v, "n/a" if v is None else f"{v:.2f} s")
        body += figure(key + ".cost", u.cost, "not configured (no price declared)" if u.cost is None else f"{u.cost:.4f}", cls="")
        body += "</tr>"
    return f"<h3>per advisor</h3><table>{head}{body}</table>"


def breakdown_table(prefix: str, what: str, rows: dict[str, Breakdown], primary: str = "assisted") -> str:
    """Per group or per task: cases, each class, R/N; with a sham arm, the sham's rescues and assisted
    against sham over the group's own K (a perturbation kind's placebo comparison, say)."""
    shams = any(_sham(b.arms) is not None for b in rows.values())
    head = f"<tr><th>{esc(what)}</th><th class=num>cases</th>" + "".join(f"<th class=num>{esc(k)}</th>" for k in LABELS)
    head += "<th class=num>R/N</th>"
    if shams:
        head += ("<th class=num>sham rescued</th><th class=num>K</th><th class=num>assisted only</th>"
                 "<th class=num>sham only</th><th class=num>McNemar p (assisted vs sham)</th>")
    body = ""
    for name, b in rows.items():
        key = f"{prefix}.{what}.{name}"
        body += f"<tr><td>{esc(name)}</td>{figure(key + '.n', b.n)}"
        body += "".join(figure(f"{key}.{k}", b.counts.get(k, 0)) for k in LABELS)
        body += figure(key + ".rate", b.rate, pct(b.rate))
        sham = _sham(b.arms)
        versus = next((c for c in b.comparisons if (c.first, c.second) == (primary, "sham")), None)
        if sham is not None and versus is not None:
            body += figure(key + ".sham_r", sham.r) + figure(key + ".sham_k", versus.k)
            body += figure(key + ".sham_first_only", versus.pairs.first_only)
            body += figure(key + ".sham_second_only", versus.pairs.second_only)
            body += figure(key + ".sham_mcnemar_p", versus.mcnemar_p, f"{versus.mcnemar_p:.4f}")
        elif shams:
            body += "<td></td>" * 5
        body += "</tr>"
    return f"<table>{head}{body}</table>"


def usage_block(u: Any) -> str:
    """Calls, statuses, tokens by type with the count of calls lacking each counter, latency, cost."""
    rows = [
        f"<tr><th>calls (one per call, however many cases shared it)</th>{figure('usage.calls', u.calls)}</tr>",
        f"<tr><th>cases in calls</th>{figure('usage.cases', u.cases)}</tr>",
        f"<tr><th>attempts (infrastructure retries included)</th>{figure('usage.attempts', u.attempts)}</tr>",
    ]
    rows += [f"<tr><th>status {esc(k)}</th>{figure(f'usage.status.{k}', v)}</tr>" for k, v in sorted(u.by_status.items())]
    tokens = "<tr><th>tokens</th><th class=num>total</th><th class=num>known sum</th><th class=num>calls reporting</th><th class=num>calls missing it</th></tr>"
    for name, t in u.tokens.items():
        total_text = "unknown" if t.total is None else str(t.total)
        tokens += (
            f"<tr><td>{esc(name)}</td>{figure(f'usage.tokens.{name}.total', t.total, total_text)}"
            f"{figure(f'usage.tokens.{name}.known_sum', t.known_sum)}{figure(f'usage.tokens.{name}.calls_with', t.calls_with)}"
            f"{figure(f'usage.tokens.{name}.calls_without', t.calls_without)}</tr>"
        )
    lat = u.latency
    lat_rows = "".join(
        f"<tr><th>latency {k}</th>{figure(f'usage.latency.{k}', v, 'n/a' if v is None else f'{v:.2f} s')}</tr>"
        for k, v in (("mean", lat.mean_s), ("median", lat.median_s), ("min", lat.min_s), ("max", lat.max_s), ("sum", lat.sum_s))
    )
    cost = "not configured (no price list)" if u.cost is None else f"{u.cost:.4f}"
    cost_row = f"<tr><th>cost</th>{figure('usage.cost', u.cost, cost, cls='')}</tr>"
    return f"<table>{''.join(rows)}{lat_rows}{cost_row}</table><table>{tokens}</table>"


def page(title: str, body: str) -> str:
    """The whole document: no network; styles and the case list's script inline (its data comes from files)."""
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{esc(title)}</title>"
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{STYLE}{app.STYLE}</style>'
        f"<script>{app.SCRIPT}</script></head><body><main>{body}</main></body></html>\n"
    )
