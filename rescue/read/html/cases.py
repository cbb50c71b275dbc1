"""The case list's index rows and one panel per case (loaded on demand by the page, see app.py)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rescue.core.arms import advisor_arm
from rescue.core.records import ArmResult, Receipt
from rescue.read.export import CaseEntry
from rescue.read.html.paths import shared_bounds
from rescue.read.html.render import macro

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


def case_panel(v: CaseView, arm_order: Callable[[str], tuple[int, str]], video_note: str) -> str:
    """One case: verdict with rule and reason, what the VLM saw (by camera) and answered, the arms side by side
    with their end-effector paths (on shared axes), the sham arm's source, checks, links."""
    order = sorted(v.arms, key=arm_order)
    bounds = shared_bounds([v.arms[n] for n in order], v.horizon)
    return macro("panel.html", "case_panel", v, order, bounds, video_note)
