"""HTML pieces of the report: the summary (DESIGN §3), the usage panel, the page frame.

Every figure cell carries `data-figure` (its name) and `data-value` (the
export's value as JSON), so a browser test can read the page back and
compare it with the export.
"""

from __future__ import annotations

import html
import json
from typing import Any

from rescue.core.stats import LABELS, Breakdown, Summary
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


def paired_block(
    prefix: str, title: str, pairs: Any, p: float, diff: float | None, ci: tuple[float, float] | None, confidence: float,
    other: str = "control",
) -> str:
    """The raw 2x2, the exact McNemar p, the paired CI, and their reading together (assisted vs `other`)."""
    level = f"{round(confidence * 100)}%"
    other_only = getattr(pairs, f"{other}_only")
    rows = [
        (f"assisted succeeded, {other} failed (assisted-only)", "assisted_only", pairs.assisted_only),
        (f"{other} succeeded, assisted failed ({other}-only)", f"{other}_only", other_only),
        ("both succeeded", "both_success", pairs.both_success),
        ("both failed", "both_fail", pairs.both_fail),
    ]
    body = "".join(f"<tr><th>{esc(k)}</th>{figure(f'{prefix}.{n}', v)}</tr>" for k, n, v in rows)
    body += f"<tr><th>exact McNemar p (discordant pairs)</th>{figure(f'{prefix}.mcnemar_p', p, f'{p:.4f}')}</tr>"
    body += f"<tr><th>paired difference, assisted - {other}</th>{figure(f'{prefix}.diff', diff, pct(diff))}</tr>"
    body += (
        f"<tr><th>{level} CI (Newcombe)</th>"
        + figure(f"{prefix}.diff_ci", list(ci) if ci else None, _ci_text(ci))
        + "</tr>"
    )
    reading = significance_reading(pairs.assisted_only, other_only, p, ci, 1 - confidence, other)
    return f"<h3>{esc(title)}</h3><table>{body}</table><p class=\"reading\" data-reading=\"{esc(prefix)}\">{esc(reading)}</p>"


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
    out = f'<div class="cards">{card_html}</div><div class="cols"><div><h3>classes over N</h3><table>{"".join(rows)}</table></div><div>'
    out += paired_block(prefix, "assisted vs control over M", s.pairs, s.mcnemar_p, s.diff, s.diff_ci, s.confidence)
    sham = getattr(s, "sham", None)  # the placebo comparison (DESIGN §8), when the summary carries one
    if sham is not None:
        counts = "".join(
            f"<tr><th>sham vs control: {esc(k)}</th>{figure(f'{prefix}.sham.counts.{k}', v)}</tr>" for k, v in sham.counts.items()
        )
        out += (
            f"<h3>sham arm against control</h3><table>{counts}"
            f"<tr><th>sham M / E</th><td>{sham.m} / {sham.e}</td></tr>"
            f"<tr><th>K: both subgoals applied, three arms valid</th>{figure(f'{prefix}.sham.k', sham.k)}</tr></table>"
        )
        out += paired_block(f"{prefix}.sham", "assisted vs sham: the effect of the VLM's content", sham.pairs,
                            sham.mcnemar_p, sham.diff, sham.diff_ci, s.confidence, other="sham")
    return out + "</div></div>"


def breakdown_table(prefix: str, what: str, rows: dict[str, Breakdown]) -> str:
    """Per group or per task: cases, each class, R/N."""
    head = f"<tr><th>{esc(what)}</th><th class=num>cases</th>" + "".join(f"<th class=num>{esc(k)}</th>" for k in LABELS)
    head += "<th class=num>R/N</th></tr>"
    body = ""
    for name, b in rows.items():
        key = f"{prefix}.{what}.{name}"
        body += f"<tr><td>{esc(name)}</td>{figure(key + '.n', b.n)}"
        body += "".join(figure(f"{key}.{k}", b.counts.get(k, 0)) for k in LABELS)
        body += figure(key + ".rate", b.rate, pct(b.rate)) + "</tr>"
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
