"""`rescue status`: a read-only look at a study while it runs or after it stopped.

Opens the journal read-only, so it is safe beside running workers; it
counts, it never classifies or writes.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from pydantic import BaseModel, Field

from rescue.core.manifest import Case
from rescue.core.records import Receipt
from rescue.core.figures.stats import LABELS
from rescue.core.verdicts import DECLINED
from rescue.study.folder import load_study_config, open_journal, receipt_files
from rescue.study.journal import STATES
from rescue.study.layout import StudyLayout
from rescue.study.receipts import scan_receipts
from rescue.study.usage import UsageSummary, study_usage


class StudyStatus(BaseModel):
    """Where a study stands: cases by state, labels so far, VLM usage, drain flag."""

    study_id: str | None = None
    kind: str = "rescue"
    cases: int = 0
    pilot_cases: int = 0
    replan_interval: int | None = None
    draining: bool = False
    states: dict[str, int] = Field(default_factory=dict)
    labels: dict[str, int] = Field(default_factory=dict)  # main cohort, verdicts so far
    pilot_labels: dict[str, int] = Field(default_factory=dict)
    # Each judged arm against control besides a study of two arms' one (the primary included), main cohort.
    arm_labels: dict[str, dict[str, int]] = Field(default_factory=dict)
    usage: UsageSummary = Field(default_factory=UsageSummary)
    usage_by_advisor: dict[str, UsageSummary] | None = None
    receipts_note: str | None = None  # a receipts file that could not be read fully


def study_status(study_dir: str | os.PathLike[str], case_type: type[Case] = Case) -> StudyStatus:
    """Read a study's state without taking any lock a worker would wait on."""
    config = load_study_config(study_dir)
    with open_journal(study_dir, case_type=case_type) as journal:
        meta = journal.meta()
        draining = journal.draining()
        counts = journal.counts()
        by_cohort = journal.label_counts()  # counted by SQLite: no case is parsed
        n_pilot = journal.pilot_count()
        arm_labels = journal.arm_label_counts()
        paths = list(receipt_files(StudyLayout.of(study_dir), journal).values())
    main_labels = Counter({label: n for (pilot, label), n in by_cohort.items() if not pilot})
    pilot_labels = Counter({label: n for (pilot, label), n in by_cohort.items() if pilot})
    receipts: list[Receipt] = []
    notes = []
    for path in paths:
        try:
            scan = scan_receipts(path)
        except ValueError as exc:
            # A status view reports a damaged file rather than failing; verify fails on it.
            notes.append(f"{Path(path).name}: unreadable line ({str(exc).splitlines()[0]})")
            continue
        receipts.extend(scan.receipts)
        if scan.truncated_tail is not None:
            notes.append(f"{Path(path).name}: last line cut short")
    usage, by_advisor = study_usage(receipts, config)
    # Zero-filled in a fixed order, plus any label the study's rules add.
    known = ("success", "failure", "unknown") if config.is_evaluation else LABELS
    order = list(known) + sorted((set(main_labels) | set(pilot_labels)) - set(known))
    return StudyStatus(
        study_id=meta.get("study_id"),
        kind="evaluation" if config.is_evaluation else "rescue",
        cases=sum(counts.values()),
        pilot_cases=n_pilot,
        replan_interval=config.policy.replan_interval,
        draining=draining,
        states={s: counts.get(s, 0) for s in STATES},
        labels={label: main_labels.get(label, 0) for label in order},
        pilot_labels={label: pilot_labels.get(label, 0) for label in order} if n_pilot else {},
        arm_labels=_arm_labels(config, main_labels, arm_labels),
        usage=usage,
        usage_by_advisor=by_advisor,
        receipts_note="; ".join(notes) or None,
    )


def _arm_labels(config, main: Counter, stored: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Each judged arm's labels in the study's order; the primary's are the main labels. Empty for a study of
    two arms (its labels are the main labels) and an evaluation."""
    judged = [a for a in config.arms if a != "control"]
    if config.is_evaluation or len(judged) < 2:
        return {}
    primary = config.primary_arm
    labels = (*LABELS, DECLINED) if config.may_decline else LABELS
    return {arm: {label: (main if arm == primary else stored.get(arm, {})).get(label, 0) for label in labels}
            for arm in judged}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def render_status(status: StudyStatus) -> str:
    """Plain text for a terminal, a few lines per section."""
    done = status.states.get("finished", 0) + status.states.get("interrupted", 0)
    lines = [
        f"{status.kind} study {status.study_id or '(unnamed)'}"
        + (f"  C={status.replan_interval}" if status.replan_interval else "")
        + ("  DRAINING" if status.draining else ""),
        f"cases: {status.cases} ({status.pilot_cases} pilot), {done} done",
        "  " + "  ".join(f"{state} {n}" for state, n in status.states.items()),
        "labels (main): " + "  ".join(f"{label} {n}" for label, n in status.labels.items()),
    ]
    if status.pilot_labels:
        lines.append("labels (pilot): " + "  ".join(f"{k} {n}" for k, n in status.pilot_labels.items()))
    for arm, labels in status.arm_labels.items():
        lines.append(f"{arm} vs control: " + "  ".join(f"{k} {n}" for k, n in labels.items()))
    u = status.usage
    tokens = "  ".join(
        f"{name} {t.total if t.total is not None else f'{t.known_sum}+? ({t.calls_without} unreported)'}"
        for name, t in u.tokens.items()
    )
    lines += [
        f"vlm calls: {u.calls} for {u.cases} cases, {u.attempts} attempts"
        + (" (" + ", ".join(f"{k} {n}" for k, n in sorted(u.by_status.items())) + ")" if u.by_status else ""),
        f"  tokens: {tokens}" if u.calls else "  tokens: -",
        f"  latency: mean {_seconds(u.latency.mean_s)}  median {_seconds(u.latency.median_s)}"
        f"  max {_seconds(u.latency.max_s)}",
    ]
    for name, a in (status.usage_by_advisor or {}).items():
        cost = "" if a.cost is None else f", cost {a.cost:.4f}"
        lines.append(f"  advisor {name}: {a.calls} calls"
                     + (" (" + ", ".join(f"{k} {n}" for k, n in sorted(a.by_status.items())) + ")" if a.by_status else "")
                     + f", median latency {_seconds(a.latency.median_s)}{cost}")
    if status.receipts_note:
        lines.append(f"receipts: {status.receipts_note}")
    return "\n".join(lines)
