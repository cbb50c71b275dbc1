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

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rescue.core.figures.baseline import Baseline, baseline_of
from rescue.core.classify import deviation_detail
from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.vlm_config import endpoint_host
from rescue.core.digest import digest_json
from rescue.core.figures.evaluation import EvalSummary
from rescue.core.manifest import Case
from rescue.core.records import ArmResult, Receipt
from rescue.core.verdicts import ArmVerdict, ContinuationCount
from rescue.core.arms import advisor_arm, base_arm, continuation, query_point_of
from rescue.core.figures.stats import Summary
from rescue.read.legacy import upgrade_export
from rescue.read.legacy_harm import is_old_harm, upgrade_harm
from rescue.read.stopping_view import StopReport, stop_report
from rescue.study.files import write_atomic
from rescue.study.folder import (
    STOPPING_DECISION_KEY,
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
from rescue.study.usage import UsageSummary, study_usage, usage_summary

# 2: cases name the fingerprint parts of a deviation; the study names its observation profile.
# 3: the sham arm (DESIGN §8): per case its arm and verdict, in the summary its comparisons.
# 4: advisors (DESIGN §11): the study names them, per case every advisor's arm and verdict, in the summary
#    each advisor's figures and every pair of advisors, usage per advisor; cost under a declared price.
# 5: one record family for an arm against another arm: per case every arm by name (`arms`) and every other
#    arm's verdict against control (`verdicts`); in the summary the primary's figures with its comparison
#    against control (`versus_control`), every other arm's figures (`arms`) and the comparisons between arms;
#    the study names the baseline its failures came from (`study.baseline`).
# 6: historical successes (DESIGN §17): a case's `outcome`, its DESIGN §17 labels, the summary's `harm` (labels,
#    exposure, harm, rescue and the net change per arm, group and task); per group and task every arm's
#    comparison with control (`arms` holds the primary's too). A /5 document reads unchanged.
# 7: the net change's two intervals, each naming its population (`these_episodes`, `benchmark`: betting e-values),
#    and why it is not estimated (`refused`); the frame's design, its sample of failures and `--limit`; harm and
#    rescue intervals that never collapse on agreeing cases (`PairedDifference`); `kept` counts the successes the
#    query point reached, `unreached` the others. A /6 document reads into today's shape, its figures as stored
#    (rescue/read/legacy_harm.py).
# 8: whether and when to ask (DESIGN §18): triggers' arms (`assisted@<trigger>`, assistance `not_asked` when the
#    trigger never fired), declined answers (assistance and label `declined`), an arm's later calls (`again`, and
#    the CSV's `<arm>_calls`), and the summary's `asking` section (every way of asking per call, duty cycles,
#    declines, the triggers' paired tests, the best way). A /7 document reads unchanged.
EXPORT_SCHEMA = "rescue-export/8"
# The versions `read_export` reads; a document of an earlier one is read into today's shape (rescue/read/legacy.py).
READABLE_SCHEMAS = ("rescue-export/3", "rescue-export/4", "rescue-export/5", "rescue-export/6", "rescue-export/7",
                    "rescue-export/8")
# The versions read through rescue/read/legacy.py (later ones read as they are).
_LEGACY_SCHEMAS = ("rescue-export/3", "rescue-export/4")


class ExportError(StudyError):
    """A study that cannot be exported as it stands."""


class StudyInfo(BaseModel):
    """Who the study is: its id, what it was run with, and its replanning interval C."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    study_id: str | None = None
    """The study's id (its folder's name at creation); None: the journal holds none."""
    kind: str = "rescue"
    """`rescue`, or `evaluation`: evaluation studies run the control arm only and label episodes."""
    created_at: float | None = None
    """When the study was created, Unix time in seconds; None: the journal holds none."""
    config_sha256: str | None = None
    """sha256 of the resolved configuration, as stored at creation; None: the journal holds none."""
    manifest_sha256: str | None = None
    """sha256 of the manifest file's bytes, as stored at creation; None: the journal holds none."""
    replan_interval: int | None = None
    """C, in env steps, as the study's configuration fixed it."""
    observation: str | None = None
    """The observation profile the policy received (DESIGN §7); None: the configuration names none."""
    journal_schema_version: int | None = None
    """The journal's schema version (its meta `schema_version`)."""
    draining: bool = False
    """Whether a drain was requested: no new case is claimed."""
    summary_stored: bool = False
    """Whether the journal holds a stored summary (`rescue verify` re-checks it)."""
    advisors: list[AdvisorInfo] | None = Field(default=None, exclude_if=lambda v: v is None)
    """The study's advisors in declared order, the primary first (DESIGN §11); absent: a study of one `[vlm]`."""
    baseline: Baseline | None = Field(default=None, exclude_if=lambda v: v is None)
    """Where a rescue study's failures came from, as its cases' provenance tags name it (rescue/core/figures/baseline.py):
    the evaluation study or results file, its policy, success rate, episode protocol and split; `sources` empty and
    every case `by_hand` for a manifest written by hand. Absent: an evaluation study (or an export written before
    it was recorded)."""
    mode: Literal["fork", "independent"] | None = None
    """How a case's arms ran: `fork` (the prefix once, every arm from one snapshot at q) or `independent` (each arm
    whole); None: an evaluation, or an export of `rescue-export/4` or earlier."""
    continuations: int = 1
    """K: how many times each arm continued from the snapshot at q (DESIGN §13)."""
    policy_rng_control: bool | None = None
    """Whether the policy server gave RNG control (the RNG extension) when the study was created; None: not
    recorded (a study made before it was)."""
    policy_stateless: bool | None = None
    """Whether the policy was declared or announced to keep no state between calls (DESIGN §13); None: undeclared."""


class AdvisorInfo(BaseModel):
    """One advisor of the study: its name, arm and what it asks (no URL's secrets, no key)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    name: str
    """The advisor's name."""
    arm: str
    """Its arm, `assisted:<name>`."""
    primary: bool
    """Whether its verdicts are the cases' labels (the first declared)."""
    endpoint: str
    """Where it is asked: `local` (the bundled endpoint), else the base URL's host and port."""
    model: str
    """The model its calls ask for."""
    api: str
    """`chat` or `responses`."""
    prompt_template: str
    """Its prompt template's name."""
    batch_size: int
    """Cases per call at most."""
    generation: dict[str, Any]
    """Its generation settings as configured (None: not sent)."""
    price: dict[str, float | None] | None = None
    """Its declared price per million tokens of each kind; None: none declared (its cost is unknown)."""


class CallEntry(BaseModel):
    """A later call of an arm that asks again (DESIGN §18), as exported."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    assistance: str
    """How the call ended: `applied`, `declined`, or why its request failed."""
    query_step: int | None = None
    """The env step it asked at."""
    subgoal: str | None = None
    """The applied subgoal; None unless applied."""
    call_id: str | None = None
    """The VLM call's id."""
    request_id: str | None = None
    """Our request id within that call."""


class ArmEntry(BaseModel):
    """One arm of one case as exported."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    status: str
    """How the arm ended: `complete` or `error` (the infrastructure failed under it)."""
    error: str | None = None
    """One line: the exception and its message; None unless the status is `error`."""
    success: bool | None = None
    """Whether the task succeeded within the horizon; None when the arm did not complete."""
    steps: int
    """Env steps the arm ran."""
    fingerprint: str | None = None
    """The arm's initial-state fingerprint; None when it never reset."""
    assistance: str
    """The arm's assistance status: `control`, `applied`, `not_reached`, or why its request failed."""
    query_step: int | None = None
    """Env step at which the arm asked (q); None when it never asked."""
    subgoal: str | None = None
    """The applied subgoal; None unless applied."""
    source: str | None = None
    """Where the subgoal came from: vlm, or a sham arm's fixed text or donor; None when the arm never asked."""
    donor_case_id: str | None = None
    """A permuted sham arm's donor case; None otherwise."""
    call_id: str | None = None
    """The VLM call's id (a permuted sham arm: its donor's); None when the arm made no call."""
    request_id: str | None = None
    """Our request id within that call; None when the arm made no call."""
    trace_rows: int
    """Policy queries the arm recorded (rows of its trace)."""
    trace_sha256: str
    """The trajectory alone (every query's state, images, instruction and actions digests): equal
    across runs, machines and backends whenever the arm did the same thing."""
    digest: str
    """sha256 of the whole arm record's canonical JSON, timings included (what the journal stores beside it)."""
    again: list[CallEntry] = Field(default_factory=list, exclude_if=lambda v: not v)
    """Its later calls in order (`[asking] max_calls` above 1, DESIGN §18); absent: it asked once at most."""
    calls: int | None = Field(default=None, exclude_if=lambda v: v is None)
    """The calls it made (0: never asked, as a trigger that never fired); absent in a study that asks once."""


class CaseEntry(BaseModel):
    """One manifest case: its queue state, its stored verdict (if any) and its arms."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The case's id."""
    group: str
    """The group the case is reported under."""
    task: str
    """The case's task, as `suite/task_id`."""
    pilot: bool
    """Whether the case is a declared pilot (never counted in the main summary)."""
    outcome: Literal["failure", "success"] = "failure"
    """How the episode ended in the evaluation: a `failure` (DESIGN §3 labels) or a `success` (DESIGN §17 labels:
    broken, kept, not_reproduced, unknown, initial_state_deviation)."""
    state: CaseState
    """The case's queue state: `pending`, `claimed`, `finished` or `interrupted`."""
    primary: str = "assisted"
    """The arm whose verdict against control is the case's label (`assisted`, or the first advisor's)."""
    label: str | None = None
    """The stored verdict's DESIGN §3 label (the primary arm against control); None without a verdict."""
    rule: int | None = None
    """The DESIGN §3 rule that decided it; None without a verdict."""
    reason: str | None = None
    """Why, in one line; None without a verdict."""
    in_m: bool | None = None
    """Whether the control/primary pair is in M; None without a verdict."""
    in_e: bool | None = None
    """Whether the pair is in E; None without a verdict."""
    deviation: str | None = None
    """For an initial-state deviation: which fingerprint parts differed; None otherwise."""
    query_step: int | None = None
    """q, the env step of the case's query point."""
    call_id: str | None = None
    """The primary arm's VLM call id; None without that arm or a call."""
    arms: dict[str, ArmEntry | None] = Field(default_factory=dict)
    """Every arm the study runs for the case, by name in the study's order (`control`, the primary, then the
    sham, further advisors, extra query points); None: not recorded."""
    verdicts: dict[str, ArmVerdict] = Field(default_factory=dict)
    """The stored verdict of every other arm the case judges against control (the sham, further advisors, extra
    query points), by arm; empty without a verdict or in a study of two arms."""
    continuations: dict[str, ContinuationCount] = Field(default_factory=dict, exclude_if=lambda v: not v)
    """With K continuations per arm (DESIGN §13): each arm's successes of K, as the stored verdict counts them;
    absent with one continuation per arm or without a verdict."""

    @property
    def control(self) -> ArmEntry | None:
        """The control arm's entry."""
        return self.arms.get("control")

    @property
    def assisted(self) -> ArmEntry | None:
        """The primary arm's entry."""
        return self.arms.get(self.primary)

    def verdict(self, arm: str) -> ArmVerdict | None:
        """One arm's verdict against control (the primary's from the case's label); None without one."""
        if arm == self.primary:
            if self.label is None or self.rule is None:
                return None
            return ArmVerdict(label=self.label, rule=self.rule, reason=self.reason or "", in_m=bool(self.in_m),
                              in_e=bool(self.in_e))
        return self.verdicts.get(arm)


class EpisodeRow(BaseModel):
    """One episode of an evaluation study: where it started, how it ended, and its result's sha256."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    case_id: str
    """The episode's case id."""
    task: str
    """The task, as `suite/task_id`."""
    group: str
    """The group the episode is reported under."""
    init_state_index: int
    """Which of the task's recorded initial states the episode started from."""
    env_seed: int
    """The environment's seed."""
    policy_seed: int
    """The seed of the policy's sampling RNG."""
    horizon: int
    """H: the most env steps the episode may run."""
    state: CaseState
    """The episode's queue state: `pending`, `claimed`, `finished` or `interrupted`."""
    label: str | None = None
    """`success`, `failure` or `unknown`; None without a verdict (not run yet)."""
    reason: str | None = None
    """Why, in one line; None without a verdict."""
    status: str | None = None
    """How the control arm ended (`complete`, `error`); None while not run."""
    success: bool | None = None
    """Whether the task succeeded; None while not run or when the arm did not complete."""
    steps: int | None = None
    """Env steps the episode ran; None while not run."""
    fingerprint: str | None = None
    """The initial-state fingerprint; None while not run or when the arm never reset."""
    trace_rows: int | None = None
    """Policy queries recorded; None while not run."""
    result_sha256: str | None = None
    """The digest the journal stored with the arm result; None while not run."""


class Coverage(BaseModel):
    """How much of a cohort the summary covers; N of DESIGN §3 is `n_manifest`."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    n_manifest: int = 0
    """The cohort's cases in the manifest."""
    n_pending: int = 0
    """Never started."""
    n_in_flight: int = 0
    """Claimed, neither finished nor interrupted yet."""
    n_finished: int = 0
    """Finished."""
    n_interrupted: int = 0
    """Claimed and never finished (their verdict is unknown)."""
    n_without_verdict: int = 0
    """Finished or interrupted but not yet classified."""
    n_summarized: int = 0
    """The summary's n: finished and interrupted cases with a verdict."""
    n_not_run: int = Field(default=0, exclude_if=lambda v: v == 0)
    """Of the never started, those the study's `[stopping]` rule left unrun once it decided (DESIGN §20); absent
    when none."""
    complete: bool = False
    """Whether the summary's n equals n_manifest, the cases the rule left unrun aside."""


class StudyExport(BaseModel):
    """A study's whole result in one document (what `rescue export` writes as JSON)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    schema_version: Literal["rescue-export/3", "rescue-export/4", "rescue-export/5", "rescue-export/6",
                            "rescue-export/7", "rescue-export/8"] = EXPORT_SCHEMA
    """The format of this document and its version (`rescue export` writes 8; a document of 3 to 7 is read into
    this shape, keeping its version)."""
    study: StudyInfo
    """Who the study is."""
    # The summary counts finished and interrupted cases only; `coverage` says
    # how many manifest cases that is, so a partial study cannot pass for a whole one.
    coverage: dict[str, Coverage] = Field(default_factory=dict)
    """Per cohort (`main`, `pilot`): how many of its cases the summary covers."""
    summary: Summary | None = None
    """The DESIGN §3 summary of the main cohort; None for an evaluation study."""
    episodes: EvalSummary | None = None
    """An evaluation study's success rates (overall, per task, per group) instead; None for a rescue study."""
    episode_rows: list[EpisodeRow] | None = None
    """An evaluation study's episodes, one row each; None for a rescue study."""
    usage: UsageSummary
    """VLM calls, tokens and latency over every receipts file of the study."""
    usage_by_advisor: dict[str, UsageSummary] | None = Field(default=None, exclude_if=lambda v: v is None)
    """The same per advisor, with its cost under its declared price (DESIGN §11); absent: a study of one `[vlm]`."""
    usage_by_query_point: dict[str, UsageSummary] | None = Field(default=None, exclude_if=lambda v: v is None)
    """With declared extra query points (DESIGN §14): the calls each query point's arm applied, by arm (the
    pre-registered q's is the primary arm's), with the primary advisor's declared price; a call that batched two
    query points' cases counts under both. Absent without query points."""
    stopping: StopReport | None = Field(default=None, exclude_if=lambda v: v is None)
    """A study with a `[stopping]` rule (DESIGN §20): the rule, where it stopped, the interval at the stop; absent
    for a study without one."""
    cases: list[CaseEntry]
    """Every manifest case, in manifest order."""


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
    if STOPPING_DECISION_KEY in records.meta and not pilot:
        out.n_not_run = out.n_pending
    out.complete = out.n_summarized + out.n_not_run == out.n_manifest
    return out


def _arm_entry(arm: ArmResult | None, digest: str | None, asks_again: bool = False) -> ArmEntry | None:
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
        digest=digest or arm_digest(arm),
        again=[CallEntry(assistance=c.status, query_step=c.query_step, subgoal=c.subgoal, call_id=c.call_id,
                         request_id=c.request_id) for c in arm.again],
        calls=len(arm.calls()) if asks_again else None,
    )


def _case_entry(records: StudyRecords, case: Case) -> CaseEntry:
    arms = records.arms.get(case.case_id, {})
    digests = records.arm_digests.get(case.case_id, {})
    v = records.verdicts.get(case.case_id)
    primary = records.config.primary_arm
    assisted = arms.get(primary)
    asks_again = records.config.max_calls > 1 or bool(records.config.triggers)
    return CaseEntry(
        case_id=case.case_id,
        group=case.group,
        task=case.task,
        pilot=case.pilot,
        outcome=case.historical_outcome,
        state=records.states[case.case_id],
        primary=primary,
        label=v.label if v else None,
        rule=v.rule if v else None,
        reason=v.reason if v else None,
        in_m=v.in_m if v else None,
        in_e=v.in_e if v else None,
        deviation=deviation_detail(records.record(case)) if v and v.label == "initial_state_deviation" else None,
        query_step=records.config.query_step("control", case.horizon),
        call_id=assisted.assistance.call_id if assisted else None,
        arms={name: _arm_entry(arms.get(name), digests.get(name), asks_again) for name in records.config.case_arms},
        verdicts=dict(v.arms) if v else {},
        continuations=dict(v.continuations) if v else {},
    )


def _advisor_info(config: StudyConfig) -> list[AdvisorInfo] | None:
    if not config.advisors:
        return None
    return [
        AdvisorInfo(
            name=a.name, arm=advisor_arm(a.name), primary=i == 0, endpoint=endpoint_host(a.base_url), model=a.model,
            api=a.api, prompt_template=a.prompt_template, batch_size=a.batch_size, generation=a.generation(),
            price=a.price.model_dump() if a.price is not None else None,
        )
        for i, a in enumerate(config.advisors)
    ]


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
        from rescue.core.figures.evaluation import summarize_eval

        episodes = summarize_eval(records.cases, records.verdicts)
        rows = [_episode_row(records, case, stored_digests.get((case.case_id, "control"))) for case in records.cases]
    else:
        summary = study_summary(records)
    usage, by_advisor = study_usage(all_receipts, records.config)
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
            advisors=_advisor_info(records.config),
            baseline=None if evaluation else baseline_of(records.cases),
            mode=None if evaluation else ("fork" if records.config.forked else "independent"),
            continuations=records.config.continuations,
            policy_rng_control=records.config.policy.rng_control,
            policy_stateless=records.config.policy.stateless,
        ),
        coverage={"main": coverage(records, pilot=False), "pilot": coverage(records, pilot=True)},
        summary=summary,
        episodes=episodes,
        episode_rows=rows,
        usage=usage,
        usage_by_advisor=by_advisor,
        usage_by_query_point=_usage_by_query_point(records, all_receipts),
        stopping=None if evaluation else stop_report(records),
        cases=[_case_entry(records, case) for case in records.cases],
    )


def query_point_calls(records: StudyRecords, receipts: list[Receipt]) -> dict[str, set[str]]:
    """The calls of each query point's arm (the pre-registered q's is the primary arm's), by call id: those its arm
    records applied, and those its receipts say it asked (a case that never finished has no arm record)."""
    config = records.config
    out = {}
    for arm in [config.primary_arm, *(a for a in config.arms if query_point_of(a))]:
        calls = {c.call_id for by_arm in records.arms.values() for name in by_arm if base_arm(name) == arm
                 for c in [by_arm[name].assistance, *by_arm[name].again] if c.call_id}
        out[arm] = calls | {r.call_id for r in receipts if arm in r.arms.values()}
    return out


def _usage_by_query_point(records: StudyRecords, receipts: list[Receipt]) -> dict[str, UsageSummary] | None:
    config = records.config
    if not config.query_points and not config.triggers:
        return None
    primary = config.advisor_configs()[0][2]
    return {arm: usage_summary([r for r in receipts if r.call_id in calls], primary.price)
            for arm, calls in query_point_calls(records, receipts).items()}


def read_export(path: str | os.PathLike[str]) -> StudyExport:
    """An export document as `rescue export` wrote it, of this version or an earlier readable one
    (READABLE_SCHEMAS); ExportError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: not a readable export ({exc})") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version not in READABLE_SCHEMAS:
        raise ExportError(f"{path}: export schema {version!r}; this version reads {', '.join(READABLE_SCHEMAS)}")
    try:
        if version in _LEGACY_SCHEMAS:
            data = upgrade_export(data)
        elif version == "rescue-export/6" and is_old_harm((data.get("summary") or {}).get("harm")):
            data = {**data, "summary": {**data["summary"], "harm": upgrade_harm(data["summary"]["harm"])}}
        return StudyExport.model_validate(data)
    except ValidationError as exc:
        raise ExportError(f"{path}: not a {version} document ({exc.errors()[0]['msg']})") from None


# --- files -------------------------------------------------------------------

ARM_COLUMNS = (
    "status", "success", "steps", "fingerprint", "assistance", "query_step",
    "subgoal", "source", "donor_case_id", "call_id", "request_id", "trace_rows", "trace_sha256", "digest", "error",
)
CASE_COLUMNS = (
    "case_id", "group", "task", "pilot", "state", "label", "rule", "reason",
    "in_m", "in_e", "deviation", "query_step", "call_id",
)
VERDICT_COLUMNS = ("label", "rule", "reason", "in_m", "in_e")
CONTINUATION_COLUMNS = ("successes", "continuations")


def _cell(value: Any) -> str:
    # Lowercase booleans and empty cells for "none" read the same in any tool.
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _arm_names(export: StudyExport) -> list[str]:
    """The arms the CSV has columns for: each arm's first continuation (the later ones are counted per arm)."""
    names: list[str] = []
    for entry in export.cases:
        names += [n for n in entry.arms if n not in names and continuation(n) == 1]
    return names or ["control", "assisted"]


def _counted(export: StudyExport) -> bool:
    return any(entry.continuations for entry in export.cases)


def _calls_counted(export: StudyExport) -> bool:
    return any(a is not None and a.calls is not None for entry in export.cases for a in entry.arms.values())


def csv_columns(export: StudyExport) -> tuple[str, ...]:
    """The CSV's columns: the case's, then per arm (`control`, the primary, the others by name) its verdict
    against control (arms other than control and the primary) and its record (`<arm>_<column>`)."""
    primary = export.cases[0].primary if export.cases else "assisted"
    out = list(CASE_COLUMNS)
    for arm in _arm_names(export):
        if arm not in ("control", primary):
            out += [f"{arm}_{col}" for col in VERDICT_COLUMNS]
        out += [f"{arm}_{col}" for col in ARM_COLUMNS]
        if _calls_counted(export):
            out.append(f"{arm}_calls")
        if _counted(export):
            out += [f"{arm}_{col}" for col in CONTINUATION_COLUMNS]
    return tuple(out)


def csv_rows(export: StudyExport) -> list[dict[str, str]]:
    """One flat row per case, as the CSV holds it (columns `csv_columns`)."""
    rows = []
    for entry in export.cases:
        row = {col: _cell(getattr(entry, col)) for col in CASE_COLUMNS}
        for arm in _arm_names(export):
            if arm not in ("control", entry.primary):
                verdict = entry.verdicts.get(arm)
                for col in VERDICT_COLUMNS:
                    row[f"{arm}_{col}"] = _cell(getattr(verdict, col) if verdict else None)
            record = entry.arms.get(arm)
            for col in ARM_COLUMNS:
                row[f"{arm}_{col}"] = _cell(getattr(record, col) if record else None)
            if _calls_counted(export):
                row[f"{arm}_calls"] = _cell(record.calls if record else None)
            if _counted(export):
                count = entry.continuations.get(arm)
                for col in CONTINUATION_COLUMNS:
                    row[f"{arm}_{col}"] = _cell(getattr(count, col) if count else None)
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
        columns, rows = csv_columns(export), csv_rows(export)
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(Path(out_csv), buf.getvalue())
