"""Export a study: per-case results, the fixed-denominator summary and VLM usage (DESIGN §1, §3).

The export reads the journal read-only and the receipts files; it never runs
or re-classifies anything (`rescue verify` does that). Cases that never
started or are still in flight stay visible: the export counts them beside
the summary instead of letting them leave the denominator unnoticed.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from rescue.core.classify import deviation_detail
from rescue.core.digest import digest_json
from rescue.core.manifest import Case
from rescue.core.querypoint import query_point
from rescue.core.records import ArmResult, Receipt
from rescue.core.stats import Summary
from rescue.study.files import write_atomic
from rescue.study.folder import (
    SUMMARIZED_STATES,
    StudyError,
    StudyRecords,
    open_journal,
    read_study,
    receipt_files,
    study_summary,
)
from rescue.study.journal import SUMMARY_KEY, CaseState, arm_digest
from rescue.study.layout import StudyLayout
from rescue.study.receipts import read_receipts
from rescue.study.usage import UsageSummary, usage_summary

# 2: cases name the fingerprint parts of a deviation; the study names its observation profile.
# 3: the sham arm (DESIGN §8): per case its arm and verdict, in the summary its comparisons.
EXPORT_SCHEMA = "rescue-export/3"


class ExportError(StudyError):
    """A study that cannot be exported as it stands."""


class StudyInfo(BaseModel):
    """Who the study is: its id, what it was run with, and its replanning interval C."""

    study_id: str | None = None
    kind: str = "rescue"  # "evaluation" studies run the control arm only and label episodes
    created_at: float | None = None
    config_sha256: str | None = None
    manifest_sha256: str | None = None
    replan_interval: int | None = None
    observation: str | None = None  # the observation profile the policy received (DESIGN §7)
    journal_schema_version: int | None = None
    draining: bool = False
    summary_stored: bool = False


class ArmEntry(BaseModel):
    """One arm of one case as exported."""

    status: str
    error: str | None = None
    success: bool | None = None
    steps: int
    fingerprint: str | None = None
    assistance: str
    query_step: int | None = None
    subgoal: str | None = None
    source: str | None = None  # where the subgoal came from: vlm, or a sham arm's fixed text or donor
    donor_case_id: str | None = None
    call_id: str | None = None
    request_id: str | None = None
    trace_rows: int
    # The trajectory alone (every query's state, images, instruction and actions digests): equal
    # across runs, machines and backends whenever the arm did the same thing.
    trace_sha256: str
    digest: str  # the whole arm record, timings and hosts included


class CaseEntry(BaseModel):
    """One manifest case: its queue state, its stored verdict (if any) and its arms."""

    case_id: str
    group: str
    task: str
    pilot: bool
    state: CaseState
    label: str | None = None
    rule: int | None = None
    reason: str | None = None
    in_m: bool | None = None
    in_e: bool | None = None
    deviation: str | None = None  # for an initial-state deviation: which fingerprint parts differed
    query_step: int | None = None
    call_id: str | None = None
    control: ArmEntry | None = None
    assisted: ArmEntry | None = None
    sham: ArmEntry | None = None
    # The sham arm against control (DESIGN §8); None when the study has no sham arm.
    sham_label: str | None = None
    sham_rule: int | None = None
    sham_reason: str | None = None


class EpisodeRow(BaseModel):
    """One episode of an evaluation study: where it started, how it ended, and its result's sha256."""

    case_id: str
    task: str
    group: str
    init_state_index: int
    env_seed: int
    policy_seed: int
    horizon: int
    state: CaseState
    label: str | None = None  # success, failure, unknown; None while not run
    reason: str | None = None
    status: str | None = None
    success: bool | None = None
    steps: int | None = None
    fingerprint: str | None = None
    trace_rows: int | None = None
    result_sha256: str | None = None  # the digest the journal stored with the arm result


class Coverage(BaseModel):
    """How much of a cohort the summary covers; N of DESIGN §3 is `n_manifest`."""

    n_manifest: int = 0
    n_pending: int = 0  # never started
    n_in_flight: int = 0  # claimed, neither finished nor interrupted yet
    n_finished: int = 0
    n_interrupted: int = 0
    n_without_verdict: int = 0  # finished or interrupted but not yet classified
    n_summarized: int = 0  # the summary's n: finished and interrupted cases with a verdict
    complete: bool = False  # the summary's n equals n_manifest


class StudyExport(BaseModel):
    """A study's whole result in one document (what `rescue export` writes as JSON)."""

    schema_version: Literal["rescue-export/3"] = EXPORT_SCHEMA
    study: StudyInfo
    # The summary counts finished and interrupted cases only; `coverage` says
    # how many manifest cases that is, so a partial study cannot pass for a whole one.
    coverage: dict[str, Coverage] = Field(default_factory=dict)  # "main", "pilot"
    summary: Summary | None = None  # DESIGN §3 summary; None for an evaluation study
    episodes: dict[str, Any] | None = None  # an evaluation study's success rates instead
    episode_rows: list[EpisodeRow] | None = None  # an evaluation study's episodes, one row each
    usage: UsageSummary
    cases: list[CaseEntry]


def coverage(records: StudyRecords, pilot: bool) -> Coverage:
    """Counts of one cohort's cases by state, and how many the summary covers."""
    out = Coverage()
    for case in records.cases:
        if case.pilot != pilot:
            continue
        state = records.states[case.case_id]
        out.n_manifest += 1
        out.n_pending += state == "pending"
        out.n_in_flight += state == "claimed"
        out.n_finished += state == "finished"
        out.n_interrupted += state == "interrupted"
        if state in SUMMARIZED_STATES:
            if case.case_id in records.verdicts:
                out.n_summarized += 1
            else:
                out.n_without_verdict += 1
    out.complete = out.n_summarized == out.n_manifest
    return out


def _arm_entry(arm: ArmResult | None) -> ArmEntry | None:
    if arm is None:
        return None
    a = arm.assistance
    return ArmEntry(
        status=arm.status,
        error=arm.error,
        success=arm.success,
        steps=arm.steps,
        fingerprint=arm.fingerprint,
        assistance=a.status,
        query_step=a.query_step,
        subgoal=a.subgoal,
        source=a.source,
        donor_case_id=a.donor_case_id,
        call_id=a.call_id,
        request_id=a.request_id,
        trace_rows=len(arm.trace),
        trace_sha256=digest_json([row.model_dump(mode="json") for row in arm.trace]),
        digest=arm_digest(arm),
    )


def _case_entry(records: StudyRecords, case: Case) -> CaseEntry:
    arms = records.arms.get(case.case_id, {})
    v = records.verdicts.get(case.case_id)
    assisted = arms.get("assisted")
    return CaseEntry(
        case_id=case.case_id,
        group=case.group,
        task=case.task,
        pilot=case.pilot,
        state=records.states[case.case_id],
        label=v.label if v else None,
        rule=v.rule if v else None,
        reason=v.reason if v else None,
        in_m=v.in_m if v else None,
        in_e=v.in_e if v else None,
        deviation=deviation_detail(records.record(case)) if v and v.label == "initial_state_deviation" else None,
        query_step=query_point(case.horizon, records.interval),
        call_id=assisted.assistance.call_id if assisted else None,
        control=_arm_entry(arms.get("control")),
        assisted=_arm_entry(assisted),
        sham=_arm_entry(arms.get("sham")),
        sham_label=v.sham.label if v and v.sham else None,
        sham_rule=v.sham.rule if v and v.sham else None,
        sham_reason=v.sham.reason if v and v.sham else None,
    )


def _episode_row(records: StudyRecords, case: Case, result_sha256: str | None) -> EpisodeRow:
    arm = records.arms.get(case.case_id, {}).get("control")
    v = records.verdicts.get(case.case_id)
    return EpisodeRow(
        case_id=case.case_id,
        task=case.task,
        group=case.group,
        init_state_index=case.init_state_index,
        env_seed=case.env_seed,
        policy_seed=case.policy_seed,
        horizon=case.horizon,
        state=records.states[case.case_id],
        label=v.label if v else None,
        reason=v.reason if v else None,
        status=arm.status if arm else None,
        success=arm.success if arm else None,
        steps=arm.steps if arm else None,
        fingerprint=arm.fingerprint if arm else None,
        trace_rows=len(arm.trace) if arm else None,
        result_sha256=result_sha256,
    )


def export_study(study_dir: str | os.PathLike[str], case_type: type[Case] = Case) -> StudyExport:
    """Read a study (read-only) into one StudyExport document."""
    layout = StudyLayout.of(study_dir)
    with open_journal(study_dir, case_type=case_type) as journal:
        records = read_study(study_dir, journal)
        all_receipts: list[Receipt] = []
        for path in receipt_files(layout, journal).values():
            if path.exists():
                all_receipts.extend(read_receipts(path))
        draining = journal.draining()
        stored_digests = {(row.case_id, row.arm): row.digest for row in journal.arm_rows()}
    meta = records.meta
    summary, episodes, rows = None, None, None
    evaluation = records.config.is_evaluation
    if evaluation:
        # Imported here: only evaluation studies need the episode summary.
        from rescue.core.evaluation import summarize_eval

        episodes = summarize_eval(records.cases, records.verdicts).model_dump(mode="json")
        rows = [_episode_row(records, case, stored_digests.get((case.case_id, "control"))) for case in records.cases]
    else:
        summary = study_summary(records)
    return StudyExport(
        study=StudyInfo(
            study_id=meta.get("study_id"),
            kind="evaluation" if evaluation else "rescue",
            created_at=meta.get("created_at"),
            config_sha256=meta.get("config_sha256"),
            manifest_sha256=meta.get("manifest_sha256"),
            replan_interval=records.interval,
            observation=records.config.policy.observation,
            journal_schema_version=meta.get("schema_version"),
            draining=draining,
            summary_stored=SUMMARY_KEY in meta,
        ),
        coverage={"main": coverage(records, pilot=False), "pilot": coverage(records, pilot=True)},
        summary=summary,
        episodes=episodes,
        episode_rows=rows,
        usage=usage_summary(all_receipts),
        cases=[_case_entry(records, case) for case in records.cases],
    )


# --- files -------------------------------------------------------------------

ARM_COLUMNS = (
    "status", "success", "steps", "fingerprint", "assistance", "query_step",
    "subgoal", "source", "donor_case_id", "call_id", "request_id", "trace_rows", "trace_sha256", "digest", "error",
)
CASE_COLUMNS = (
    "case_id", "group", "task", "pilot", "state", "label", "rule", "reason",
    "in_m", "in_e", "deviation", "query_step", "call_id", "sham_label", "sham_rule", "sham_reason",
)
CSV_COLUMNS = CASE_COLUMNS + tuple(
    f"{arm}_{col}" for arm in ("control", "assisted", "sham") for col in ARM_COLUMNS
)


def _cell(value: Any) -> str:
    # Lowercase booleans and empty cells for "none" read the same in any tool.
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def csv_rows(export: StudyExport) -> list[dict[str, str]]:
    """One flat row per case, as the CSV holds it (columns CSV_COLUMNS)."""
    rows = []
    for entry in export.cases:
        row = {col: _cell(getattr(entry, col)) for col in CASE_COLUMNS}
        for name in ("control", "assisted", "sham"):
            arm = getattr(entry, name)
            for col in ARM_COLUMNS:
                row[f"{name}_{col}"] = _cell(getattr(arm, col) if arm else None)
        rows.append(row)
    return rows


EPISODE_COLUMNS = tuple(EpisodeRow.model_fields)


def episode_csv_rows(export: StudyExport) -> list[dict[str, str]]:
    """One flat row per episode of an evaluation study (columns EPISODE_COLUMNS)."""
    return [{col: _cell(getattr(row, col)) for col in EPISODE_COLUMNS} for row in export.episode_rows or []]


def export_paths(study_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The default JSON and CSV paths of a study's export."""
    layout = StudyLayout.of(study_dir)
    return layout.export_json, layout.export_csv


def write_export(
    export: StudyExport, out_json: str | os.PathLike[str], out_csv: str | os.PathLike[str]
) -> None:
    """Write the export as a JSON document and a CSV: per case, or per episode for an evaluation."""
    text = json.dumps(export.model_dump(mode="json"), indent=2, ensure_ascii=False)
    write_atomic(Path(out_json), text + "\n")
    buf = io.StringIO()
    if export.episode_rows is not None:
        columns, rows = EPISODE_COLUMNS, episode_csv_rows(export)
    else:
        columns, rows = CSV_COLUMNS, csv_rows(export)
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(Path(out_csv), buf.getvalue())
