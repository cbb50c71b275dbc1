"""The case list's index rows and one panel per case (loaded on demand by the page, see app.py)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rescue.core.arms import advisor_arm
from rescue.core.records import ArmResult, Receipt
from rescue.read.export import CaseEntry
from rescue.read.html.page import esc
from rescue.read.html.paths import path_svg, shared_bounds

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
    views: list[tuple[str, Href]] = field(default_factory=list)  # (camera, image) the VLM saw at q
    views_note: str = ""
    prompt: str | None = None
    response: str | None = None
    keyframes: dict[str, list[tuple[str, Href]]] = field(default_factory=dict)  # arm -> (name, image)
    videos: dict[str, Href] = field(default_factory=dict)
    traces: dict[str, Href] = field(default_factory=dict)
    prefix: tuple[bool, str] | None = None
    evidence: tuple[bool, str] | None = None
    sham_source: str | None = None  # the study's declared source: fixed, permuted, or None (no sham arm)
    sham_text: str | None = None  # the declared fixed text for this case's task
    sham_donor: str | None = None  # the declared donor (permuted)
    sham_receipt: Receipt | None = None  # the donor's call, as its outcome receipt holds it
    advisors: list[AdvisorView] = field(default_factory=list)  # a study of several advisors: each one's call


@dataclass
class AdvisorView:
    """One advisor's answer at q, as the panel shows them side by side (DESIGN §11)."""

    name: str
    arm: str
    primary: bool
    label: str | None = None  # its verdict against control
    rule: int | None = None
    reason: str | None = None
    subgoal: str | None = None
    status: str | None = None  # its assistance status
    receipt: Receipt | None = None
    views: list[tuple[str, Href]] = field(default_factory=list)
    views_note: str = ""
    prompt: str | None = None
    response: str | None = None
    evidence: tuple[bool, str] | None = None


def keyframe_order(name: str) -> tuple[int, str]:
    """Keyframes in episode order: by the step in the name (`q112`, `s0048`), then `end`."""
    m = re.fullmatch(r"[A-Za-z_]*(\d+)", name)
    return (int(m.group(1)), name) if m else (1 << 30, name)


def reason_kind(reason: str | None) -> str:
    """A verdict's reason with its numbers left out, so that one kind of reason is one filter value."""
    if not reason:
        return ""
    text = re.sub(r"\d+", "N", reason)
    return text if len(text) <= 80 else text[:79] + "\u2026"


def _ok(x: bool | None) -> str:
    return "" if x is None else ("✔" if x else "✘")


# The index's row layout; the page reads cells by these names.
FIELDS = ("id", "pilot", "cohort", "label", "rule", "reason", "reason_kind", "sham_label", "sham_rule", "sham_reason",
          "group", "task", "q", "control", "assisted", "sham", "steps", "subgoal", "sham_subgoal", "donor")


def advisor_fields(names: Sequence[str]) -> list[str]:
    """The index fields a study of several advisors adds after FIELDS: per advisor its class, success and subgoal."""
    return [f"{what}@{name}" for name in names for what in ("label", "ok", "subgoal")]


def index_row(e: CaseEntry, advisors: Sequence[str] = ()) -> list[Any]:
    """One case as the list's index holds it (in FIELDS order, then `advisor_fields(advisors)`)."""
    extra = []
    for name in advisors:
        verdict = e.verdict(advisor_arm(name))
        record = e.arms.get(advisor_arm(name))
        extra += [verdict.label if verdict is not None else None, record.success if record else None,
                  record.subgoal if record else None]
    return _index_row(e) + extra


def _index_row(e: CaseEntry) -> list[Any]:
    arm = {"control": e.control, "assisted": e.assisted, "sham": e.arms.get("sham")}
    sham = e.verdicts.get("sham")
    row = {
        "id": e.case_id, "pilot": e.pilot, "cohort": "pilot" if e.pilot else "main", "label": e.label or e.state,
        "rule": e.rule, "reason": e.reason, "reason_kind": reason_kind(e.reason),
        "sham_label": sham.label if sham else None, "sham_rule": sham.rule if sham else None,
        "sham_reason": sham.reason if sham else None, "group": e.group, "task": e.task, "q": e.query_step,
        "control": arm["control"].success if arm["control"] else None,
        "assisted": arm["assisted"].success if arm["assisted"] else None,
        "sham": arm["sham"].success if arm["sham"] else None,
        "steps": arm["assisted"].steps if arm["assisted"] else None,
        "subgoal": arm["assisted"].subgoal if arm["assisted"] else None,
        "sham_subgoal": arm["sham"].subgoal if arm["sham"] else None,
        "donor": arm["sham"].donor_case_id if arm["sham"] else None,
    }
    return [row[k] for k in FIELDS]


def case_index(entries: Sequence[CaseEntry], arms: Sequence[str], files: str, advisors: Sequence[str] = ()) -> dict[str, Any]:
    """The list's index: every case, the columns shown, the filters and the searched fields (with several
    advisors, each one's class, success and subgoal)."""
    if advisors:
        index = case_index(entries, ["control", "assisted", *(["sham"] if "sham" in arms else [])], files)
        # The primary's success and subgoal are its advisor's columns below.
        index["columns"] = [c for c in index["columns"] if c[0] not in ("assisted", "subgoal", "steps")]
        index["fields"] += advisor_fields(advisors)
        for name in advisors:
            index["columns"] += [[f"label@{name}", f"class · {name}", "label"], [f"ok@{name}", name, "ok"],
                                 [f"subgoal@{name}", f"subgoal · {name}", "text"]]
            index["filters"].append([f"label@{name}", f"class · {name}"])
            index["search"].append(f"subgoal@{name}")
        index["rows"] = [index_row(e, advisors) for e in entries]
        return index
    sham = "sham" in arms
    columns = [["id", "case", "case"], ["label", "class", "label"], ["rule", "rule", "num"], ["reason", "reason", "text"]]
    if sham:
        columns.append(["sham_label", "sham class", "label"])
    columns += [["group", "group", "text"], ["task", "task", "text"], ["control", "control", "ok"]]
    if "assisted" in arms:
        columns.append(["assisted", "assisted", "ok"])
    if sham:
        columns.append(["sham", "sham", "ok"])
    if "assisted" in arms:
        columns += [["steps", "assisted steps", "num"], ["subgoal", "subgoal", "text"]]
    filters = [["label", "class"]] + ([["sham_label", "sham class"]] if sham else [])
    filters += [["task", "task"], ["group", "group"], ["cohort", "cohort"], ["reason_kind", "reason"]]
    return {
        "fields": list(FIELDS), "columns": columns, "filters": filters,
        "search": ["id", "task", "subgoal", "sham_subgoal", "reason", "sham_reason"],
        "panels": True, "prefix": files, "page_size": 50, "rows": [index_row(e) for e in entries],
    }


def _img(href: Href, caption: str, width: int = 160) -> str:
    if href is None:
        return f"<figure><figcaption>{esc(caption)}: file missing</figcaption></figure>"
    return (f'<figure><img src="{esc(href)}" loading="lazy" decoding="async" width="{width}" height="{width}" '
            f'alt="{esc(caption)}"><figcaption>{esc(caption)}</figcaption></figure>')


def _check(name: str, result: tuple[bool, str] | None) -> str:
    if result is None:
        return ""
    ok, why = result
    return f'<li><span class="{"ok" if ok else "bad"}">{esc(name)}: {"ok" if ok else "failed"}</span> ({esc(why)})</li>'


def _go(case_id: str) -> str:
    return f'<a href="#case={esc(case_id)}" data-go="{esc(case_id)}">{esc(case_id)}</a>'


def _call(r: Receipt) -> str:
    latency = "" if r.latency_s is None else f" · {r.latency_s:.2f} s"
    return (f"call <code>{esc(r.call_id)}</code> · {esc(r.status)} · model {esc(r.model_reported or r.model_requested)}"
            f"{latency} · attempts {r.attempt}")


def _sham_source(arm: ArmResult, v: CaseView) -> str:
    """Where the sham arm's subgoal came from: the fixed text, or the donor case and the donor's call."""
    a = arm.assistance
    subgoal = a.subgoal if a.subgoal is not None else v.sham_text
    text = f'<p class="sham-subgoal"><b>sham subgoal</b>: <code>{esc(subgoal) if subgoal else "none"}</code>'
    if v.sham_source == "fixed" or a.source == "fixed":
        text += " (the study's declared fixed text" + ("" if a.subgoal is not None else "; never applied") + ")</p>"
        return text
    donor = a.donor_case_id or v.sham_donor
    text += "</p>"
    if donor is None:
        return text + '<p class="note">no donor declared</p>'
    line = f'<p class="sham-donor">from donor case {_go(donor)}'
    if v.sham_donor is not None and donor != v.sham_donor:
        line += f' <span class="bad">(the declared donor is {_go(v.sham_donor)})</span>'
    r = v.sham_receipt
    if r is not None:
        line += f"; the donor's {_call(r)}"
        if a.request_id:
            line += f", request <code>{esc(a.request_id)}</code>"
    elif a.call_id:
        line += f"; the donor's call <code>{esc(a.call_id)}</code> (its outcome receipt was not found)"
    else:
        line += "; the donor's call gave no answer" + (f" ({esc(a.error_kind)})" if a.error_kind else "")
    return text + line + "</p>"


def _vlm_call(who: str, views, views_note: str, prompt: str | None, response: str | None, receipt, size: int) -> str:
    """One VLM call: the views it saw at q (by camera), its rendered prompt, its raw answer and its receipt."""
    out = ""
    if views:
        out += f'<p class="note">what {who} saw at q{esc(views_note)}</p><div class="frames vlm-views">'
        out += "".join(_img(href, caption, size) for caption, href in views) + "</div>"
    if prompt is not None:
        out += f"<details><summary>rendered prompt</summary><pre>{esc(prompt)}</pre></details>"
    if response is not None:
        out += f"<details><summary>raw answer</summary><pre>{esc(response)}</pre></details>"
    if receipt is not None:
        out += f'<p class="note">{_call(receipt)}</p>'
    return out


def _advisors(v: CaseView) -> str:
    """Every advisor side by side: its verdict against control, the subgoal it answered, what it saw, its prompt
    and raw answer, and its evidence."""
    cols = ""
    for a in v.advisors:
        label = a.label or "no verdict"
        col = (f'<div class="arm advisor" data-advisor="{esc(a.name)}"><h4>{esc(a.name)}{" (primary)" if a.primary else ""}</h4>'
               f'<p><span class="{esc(label)}">{esc(label)}</span>' + (f", rule {esc(a.rule)}: {esc(a.reason)}" if a.rule else "") + "</p>")
        col += (f'<p><b>subgoal</b>: <code>{esc(a.subgoal)}</code></p>' if a.subgoal
                else f'<p class="note">no subgoal applied ({esc(a.status or "no arm")})</p>')
        col += _vlm_call("it", a.views, a.views_note, a.prompt, a.response, a.receipt, 120)
        if a.evidence is not None:
            col += "<ul>" + _check("evidence", a.evidence) + "</ul>"
        cols += col + "</div>"
    # Inline: long call ids wrap inside their column (the page's style sheet is every report's).
    return (f'<h4>the advisors at q, side by side</h4><div class="arms advisors" style="overflow-wrap:anywhere">'
            f"{cols}</div>")


def _arm(name: str, arm: ArmResult, v: CaseView, video_note: str, bounds) -> str:
    a = arm.assistance
    lines = [
        f"status {esc(arm.status)}, success {_ok(arm.success)}, {arm.steps} steps"
        + (f", episode protocol {esc(arm.episode_protocol)}" if getattr(arm, "episode_protocol", None) else "")
        + (f", error: {esc(arm.error)}" if arm.error else ""),
        f"assistance {esc(a.status)}" + (f" at step {a.query_step}" if a.query_step is not None else "")
        + (f" ({esc(a.error_kind)})" if a.error_kind else ""),
    ]
    body = f'<div class="arm" data-arm="{esc(name)}"><h4>{esc(name)}</h4><p>{"<br>".join(lines)}</p>'
    advisor = next((x for x in v.advisors if x.arm == name), None)
    if advisor is not None and advisor.label is not None:
        body += (f'<p><b>vs control</b>: <span class="{esc(advisor.label)}">{esc(advisor.label)}</span>, '
                 f"rule {esc(advisor.rule)}: {esc(advisor.reason)}</p>")
    if name == "sham":
        body += _sham_source(arm, v)
        sham = v.entry.verdicts.get("sham")
        if sham is not None:
            body += (f'<p><b>sham vs control</b>: <span class="{esc(sham.label)}">{esc(sham.label)}</span>, '
                     f"rule {esc(sham.rule)}: {esc(sham.reason)}</p>")
    body += path_svg(arm, v.entry.query_step, bounds)
    frames = v.keyframes.get(name, [])
    if frames:
        body += '<div class="frames">' + "".join(_img(href, f"{name} {k}", 128) for k, href in frames) + "</div>"
    else:
        body += '<p class="note">no keyframes stored (the study ran with keyframes off)</p>'
    if name in v.videos:
        href = v.videos[name]
        body += f'<video controls preload="none" width="256" src="{esc(href)}"></video><p class="note">{esc(video_note)}</p>'
    if name in v.traces:
        body += f'<p><a href="{esc(v.traces[name])}">trace rows ({len(arm.trace)})</a></p>'
    return body + "</div>"


def case_panel(v: CaseView, arm_order: Callable[[str], tuple[int, str]], video_note: str) -> str:
    """One case: verdict with rule and reason, what the VLM saw (by camera) and answered, the arms side by side
    with their end-effector paths, the sham arm's source, checks, links."""
    e = v.entry
    label = e.label or e.state
    head = (
        f'<h3>{esc(e.case_id)} <span class="{esc(label)}">{esc(label)}</span>{" · pilot" if e.pilot else ""}</h3>'
        f"<p>{esc(e.task)} · group {esc(e.group)} · horizon {v.horizon} · query point q = {esc(e.query_step)}</p>"
    )
    verdict = (f'<p class="verdict" data-label="{esc(label)}" data-rule="{esc(e.rule)}"><b>verdict</b>: rule {esc(e.rule)}: '
               f"{esc(e.reason)}" + (f" ({esc(e.deviation)})" if e.deviation else "") + "</p>")
    subgoal = v.entry.assisted.subgoal if v.entry.assisted is not None else None
    vlm = ""
    if subgoal:
        vlm += f'<p class="subgoal"><b>subgoal</b>: <code>{esc(subgoal)}</code></p>'
    vlm += _vlm_call("the VLM", v.views, v.views_note, v.prompt, v.response, v.receipt, 200)
    if v.advisors:
        vlm = _advisors(v)
    order = sorted(v.arms, key=arm_order)
    bounds = shared_bounds([v.arms[n] for n in order], v.horizon)
    arms = '<div class="arms">' + "".join(_arm(n, v.arms[n], v, video_note, bounds) for n in order) + "</div>"
    if not v.arms:
        arms = f'<p class="note">no arm recorded ({esc(e.state)})</p>'
    checks = "<ul>" + _check("prefix match", v.prefix) + _check("evidence", v.evidence)
    if v.receipt_line is not None:
        state = "matches the arm's reference" if v.receipt_check is None else v.receipt_check
        link = f' <a href="{esc(v.receipt_href)}">raw receipt line</a>' if v.receipt_href else ""
        checks += f"<li>receipt line: {esc(state)}{link}</li>"
    checks += f"<li>in M: {_ok(e.in_m)} · in E: {_ok(e.in_e)}</li></ul>"
    return head + verdict + vlm + arms + checks
