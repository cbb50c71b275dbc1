"""The case table (filterable by class, group, task) and one panel per case."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rescue.core.records import ArmResult, Receipt
from rescue.read.export import CaseEntry
from rescue.read.html.page import esc

# A file href (relative to the page) or None when the file could not be placed.
Href = str | None


@dataclass
class CaseView:
    """What the panel of one case shows, gathered by the report writer."""

    entry: CaseEntry
    horizon: int
    arms: dict[str, ArmResult]
    receipt: Receipt | None = None
    receipt_line: str | None = None  # the receipt's exact line text
    receipt_check: str | None = None  # None: the line hashes to the arm's reference
    receipt_href: Href = None
    views: list[tuple[str, Href]] = field(default_factory=list)  # (caption, image) the VLM saw at q
    views_note: str = ""
    prompt: str | None = None
    response: str | None = None
    keyframes: dict[str, list[tuple[str, Href]]] = field(default_factory=dict)  # arm -> (name, image)
    videos: dict[str, Href] = field(default_factory=dict)
    traces: dict[str, Href] = field(default_factory=dict)
    prefix: tuple[bool, str] | None = None
    evidence: tuple[bool, str] | None = None


def keyframe_order(name: str) -> tuple[int, str]:
    """Keyframes in episode order: by the step in the name (`q112`, `s0048`), then `end`."""
    m = re.fullmatch(r"[A-Za-z_]*(\d+)", name)
    return (int(m.group(1)), name) if m else (1 << 30, name)


def _options(key: str, values: list[str]) -> str:
    opts = "".join(f'<option value="{esc(v)}">{esc(v)}</option>' for v in values)
    return f'<label>{esc(key)} <select id="f-{key}"><option value="">all</option>{opts}</select></label>'


def _ok(x: bool | None) -> str:
    return "" if x is None else ("✔" if x else "✘")


def case_table(views: list[CaseView]) -> str:
    """Every case, one row each, with selects for class, group, task and cohort (main or pilot)."""
    labels = sorted({v.entry.label or v.entry.state for v in views})
    groups = sorted({v.entry.group for v in views})
    tasks = sorted({v.entry.task for v in views})
    filters = (
        '<p class="filters">' + _options("label", labels) + _options("group", groups) + _options("task", tasks)
        + _options("cohort", ["main", "pilot"]) + ' <span id="shown" data-shown="" data-total=""></span></p>'
    )
    head = "<tr><th>case</th><th>class</th><th>rule</th><th>group</th><th>task</th><th>control</th><th>assisted</th><th>assisted steps</th><th>subgoal</th></tr>"
    rows = []
    for v in views:
        e = v.entry
        label = e.label or e.state
        cohort = "pilot" if e.pilot else "main"
        rows.append(
            f'<tr class="{esc(label)}" data-label="{esc(label)}" data-group="{esc(e.group)}" data-task="{esc(e.task)}" '
            f'data-cohort="{cohort}"><td><a href="#case-{esc(e.case_id)}">{esc(e.case_id)}</a>{" (pilot)" if e.pilot else ""}</td>'
            f'<td class="{esc(label)}">{esc(label)}</td><td class=num>{esc(e.rule)}</td><td>{esc(e.group)}</td><td>{esc(e.task)}</td>'
            f"<td>{_ok(e.control.success if e.control else None)}</td><td>{_ok(e.assisted.success if e.assisted else None)}</td>"
            f"<td class=num>{esc(e.assisted.steps if e.assisted else '')}</td>"
            f"<td>{esc(e.assisted.subgoal if e.assisted else '')}</td></tr>"
        )
    return filters + f'<table id="case-table"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _img(href: Href, caption: str, width: int = 160) -> str:
    if href is None:
        return f"<figure><figcaption>{esc(caption)}: file missing</figcaption></figure>"
    return f'<figure><img src="{esc(href)}" width="{width}" alt="{esc(caption)}"><figcaption>{esc(caption)}</figcaption></figure>'


def _check(name: str, result: tuple[bool, str] | None) -> str:
    if result is None:
        return ""
    ok, why = result
    return f'<li><span class="{"ok" if ok else "bad"}">{esc(name)}: {"ok" if ok else "failed"}</span> ({esc(why)})</li>'


def _arm(name: str, arm: ArmResult, v: CaseView, video_note: str) -> str:
    a = arm.assistance
    lines = [
        f"status {esc(arm.status)}, success {_ok(arm.success)}, {arm.steps} steps"
        + (f", error: {esc(arm.error)}" if arm.error else ""),
        f"assistance {esc(a.status)}" + (f" at step {a.query_step}" if a.query_step is not None else ""),
    ]
    frames = v.keyframes.get(name, [])
    body = f'<div class="arm" data-arm="{esc(name)}"><h4>{esc(name)}</h4><p>{"<br>".join(lines)}</p>'
    if frames:
        body += '<div class="frames">' + "".join(_img(href, f"{name} {k}") for k, href in frames) + "</div>"
    else:
        body += '<p class="note">no keyframes stored (the study ran with keyframes off)</p>'
    if name in v.videos:
        href = v.videos[name]
        body += f'<video controls width="256" src="{esc(href)}"></video><p class="note">{esc(video_note)}</p>'
    if name in v.traces:
        body += f'<p><a href="{esc(v.traces[name])}">trace rows ({len(arm.trace)})</a></p>'
    return body + "</div>"


def case_panel(v: CaseView, arm_order: Callable[[str], tuple[int, str]], video_note: str) -> str:
    """One case: verdict with rule and reason, what the VLM saw and answered, the arms side by side, checks, links."""
    e = v.entry
    label = e.label or e.state
    head = (
        f'<section class="case" id="case-{esc(e.case_id)}" data-case="{esc(e.case_id)}">'
        f'<h3>{esc(e.case_id)} <span class="{esc(label)}">{esc(label)}</span>{" · pilot" if e.pilot else ""}</h3>'
        f"<p>{esc(e.task)} · group {esc(e.group)} · horizon {v.horizon} · query point q = {esc(e.query_step)}</p>"
    )
    verdict = f"<p><b>verdict</b>: rule {esc(e.rule)}: {esc(e.reason)}" + (f" ({esc(e.deviation)})" if e.deviation else "") + "</p>"
    subgoal = v.arms.get("assisted").assistance.subgoal if "assisted" in v.arms else None
    vlm = ""
    if subgoal:
        vlm += f"<p><b>subgoal</b>: <code>{esc(subgoal)}</code></p>"
    if v.views:
        vlm += f'<p class="note">what the VLM saw at q{esc(v.views_note)}</p><div class="frames vlm-views">'
        vlm += "".join(_img(href, caption, 200) for caption, href in v.views) + "</div>"
    if v.prompt is not None:
        vlm += f"<details><summary>rendered prompt</summary><pre>{esc(v.prompt)}</pre></details>"
    if v.response is not None:
        vlm += f"<details><summary>raw answer</summary><pre>{esc(v.response)}</pre></details>"
    if v.receipt is not None:
        r = v.receipt
        vlm += (
            f'<p class="note">call {esc(r.call_id)} · {esc(r.status)} · model {esc(r.model_reported or r.model_requested)}'
            f" · {'' if r.latency_s is None else f'{r.latency_s:.2f} s'} · attempts {r.attempt}</p>"
        )
    arms = '<div class="arms">' + "".join(_arm(n, v.arms[n], v, video_note) for n in sorted(v.arms, key=arm_order)) + "</div>"
    checks = "<ul>" + _check("prefix match", v.prefix) + _check("evidence", v.evidence)
    if v.receipt_line is not None:
        state = "matches the arm's reference" if v.receipt_check is None else v.receipt_check
        link = f' <a href="{esc(v.receipt_href)}">raw receipt line</a>' if v.receipt_href else ""
        checks += f"<li>receipt line: {esc(state)}{link}</li>"
    checks += f"<li>in M: {_ok(e.in_m)} · in E: {_ok(e.in_e)}</li></ul>"
    return head + verdict + vlm + arms + checks + "</section>"
