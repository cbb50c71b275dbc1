"""The read model of a study: its configuration, records and the one classification dispatch.

Everything here reads files (config, journal, receipts) and calls the pure
core; nothing starts a simulator, a policy or a VLM client. The engine uses
the same functions to classify a case when it finishes, so a verdict the
engine stored and one `rescue verify` recomputes come from one code path.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from rescue.core.arms import base_arm, is_assisted, query_point_of
from rescue.core.classify import classify
from rescue.core.configuration.config import StudyConfig
from rescue.core.figures.evaluation import classify_episode
from rescue.core.manifest import Case, Manifest
from rescue.core.records import ArmResult, CaseRecord, Receipt
from rescue.core.verdicts import Verdict
from rescue.core.sham import sham_donors
from rescue.core.triggers import call_steps, first_firing
from rescue.core.figures.stats import Summary, summarize
from rescue.core.figures.success_sample import frame_of, task_frames
from rescue.study.files import fsync_dir, write_atomic, write_manifest
from rescue.study.journal import STOP_REASON_KEY, STOPPED_NOW_KEY, CaseState, Journal
from rescue.study.layout import LAB_RECEIPTS, RECEIPTS, STUDIES, StudyLayout
from rescue.study.receipts import outcomes_by_call, read_receipt_file

# Journal meta key: the sham arm's donor of each case (permuted source), fixed at creation.
SHAM_DONORS_KEY = "sham_donors"
# How the study's manifest.jsonl was written: "verbatim" (the bytes read, so their sha256 is `manifest_sha256`) or
# "rewritten" (the cases serialized again); absent in a study made before it was recorded.
MANIFEST_COPY_KEY = "manifest_copy"
# A study with a `[stopping]` rule (DESIGN §20): the order its cases run in, fixed at creation (pilot cases first,
# then the main cohort's seeded permutation stratified by task), and the decision the rule reached, when it stopped
# the study.
STOPPING_ORDER_KEY = "stopping_order"
STOPPING_DECISION_KEY = "stopping_decision"

# The states whose cases carry a verdict and so enter the summary.
SUMMARIZED_STATES: tuple[CaseState, ...] = ("finished", "interrupted")


class StudyError(RuntimeError):
    """A study folder cannot be created, opened or resumed as asked."""


class SummaryError(StudyError):
    """Stored verdicts that break the summary's invariants."""


def new_study_dir(root: str | os.PathLike[str] = STUDIES) -> Path:
    """A fresh, unique study folder name under root."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(root) / f"study-{stamp}-{uuid.uuid4().hex[:6]}"


def create_study(study_dir: Path, manifest: Manifest, config: StudyConfig, extra_meta: dict | None = None) -> None:
    """Lay out a study folder (manifest copy, resolved config and its sha256, journal), all or nothing.

    The folder is built under a private name beside its final one and renamed
    into place only when complete, so a crash or a full disk leaves either a
    whole study or nothing at `study_dir`.
    """
    study_dir = Path(study_dir)
    if config.policy.replan_interval is None or config.policy.announced is None:
        raise StudyError("a study's configuration must have its identity resolved before it is created")
    if StudyLayout.of(study_dir).is_study():
        raise StudyError(f"{study_dir} already holds a study; use `rescue resume {study_dir}` to continue it")
    if study_dir.exists() and (not study_dir.is_dir() or any(study_dir.iterdir())):
        raise StudyError(f"{study_dir} already exists and is not an empty folder (nor a study): give --study a new "
                         "folder")
    if config.vlm.lab_budget is not None:
        # The lab's ledger is the same whatever folder a later resume runs from.
        ledger = Path(config.vlm.lab_ledger or LAB_RECEIPTS).resolve()
        config = config.model_copy(update={"vlm": config.vlm.model_copy(update={"lab_ledger": str(ledger)})})
    study_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = study_dir.parent / f".{study_dir.name}.creating-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        tmp.mkdir()
        layout = StudyLayout.of(tmp)
        layout.receipts.parent.mkdir()
        # The manifest as it was read, byte for byte: `rescue verify` hashes it against `manifest_sha256`.
        if manifest.data is not None:
            write_atomic(layout.manifest, manifest.data)
        else:
            write_manifest(manifest.cases, layout.manifest)
        config_json = json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True)
        write_atomic(layout.config, config_json + "\n")
        meta = {
            **tool_provenance(),
            "study_id": study_dir.name,
            "kind": "evaluation" if config.is_evaluation else "rescue",
            "created_at": time.time(),
            "config_sha256": config.sha256(),
            "manifest_sha256": manifest.sha256,
            "manifest_source": str(manifest.source) if manifest.source else None,
            MANIFEST_COPY_KEY: "verbatim" if manifest.data is not None else "rewritten",
            **(extra_meta or {}),
        }
        if config.sham.source == "permuted" and not config.is_evaluation:
            # Declared before anything runs; `rescue verify` derives it again from manifest and seed.
            meta[SHAM_DONORS_KEY] = sham_donors(manifest.cases, config.sham.seed)
        Journal.create(tmp, manifest.cases, meta).close()
        if study_dir.exists():
            study_dir.rmdir()  # empty (checked above); rename cannot replace a folder that has files
        os.rename(tmp, study_dir)
        fsync_dir(study_dir.parent)
    except OSError as exc:
        raise StudyError(f"cannot create the study at {study_dir}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tool_provenance() -> dict[str, Any]:
    """The tool that creates a study: its version, and when it runs from a git checkout its commit and
    whether that checkout had uncommitted changes (None outside a checkout)."""
    import subprocess

    import rescue

    root = Path(rescue.__file__).resolve().parent.parent
    commit = dirty = None
    if (root / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=10, check=True).stdout.strip() or None
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10, check=True).stdout
            dirty = bool(status.strip())
        except (OSError, subprocess.SubprocessError):
            commit = dirty = None
    return {"rescue_version": rescue.__version__, "git_commit": commit, "git_dirty": dirty}


def load_study_config(study_dir: str | os.PathLike[str]) -> StudyConfig:
    """The resolved configuration a study was created with."""
    path = StudyLayout.of(study_dir).config
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StudyError(f"{study_dir} is not a study folder (no {path.name})") from None
    try:
        return StudyConfig.model_validate_json(text)
    except ValidationError as exc:
        raise StudyError(f"{path}: not a study configuration ({exc.errors()[0]['msg']})") from None


def case_record(
    case: Case,
    arms: dict[str, ArmResult],
    receipts: dict[str, Receipt],
    config: StudyConfig,
    interrupted: bool,
    donors: dict[str, str] | None = None,
) -> CaseRecord:
    """Gather what DESIGN §3 classification needs for one case: every arm its study runs (None: not recorded),
    the outcome receipt each arm's subgoals came from, the sham arm's declaration, and where each arm asks: its
    query point's step, or where its trigger fires on the control arm's queries, and its later calls' steps, each
    derived again from the records (DESIGN §18)."""
    sham = config.sham
    sham_on = sham.on and "sham" in config.arms
    judged = {name: arms.get(name) for name in config.case_arms}
    steps = {arm: config.query_step(arm, case.horizon) for arm in config.arms
             if query_point_of(arm) and config.trigger_of(arm) is None}
    fired, again = asking_steps(case, judged, config, steps)
    return CaseRecord(
        case_id=case.case_id,
        group=case.group,
        task=case.task,
        horizon=case.horizon,
        query_step=config.query_step("control", case.horizon),
        query_steps={**steps, **{arm: case.horizon if at is None else at for arm, at in fired.items()}},
        unasked=[arm for arm, at in fired.items() if at is None],
        again_steps=again,
        again_receipts={c.call_id: receipts[c.call_id] for arm in judged.values() if arm is not None
                        for c in arm.again if c.call_id in receipts},
        declining=config.may_decline,
        triggers={arm: config.trigger_of(arm) for arm in config.arms if config.trigger_of(arm) is not None},
        max_calls=config.max_calls,
        historical_fingerprint=case.fingerprint,
        pilot=case.pilot,
        historical_outcome=case.historical_outcome,
        interrupted=interrupted,
        primary=config.primary_arm,
        arms=judged,
        receipts={name: receipts.get(arm.assistance.call_id) for name, arm in judged.items()
                  if arm is not None and arm.assistance.call_id},
        sham_source=sham.source if sham_on else None,
        sham_text=sham.text_for(case.task) if sham_on and sham.source == "fixed" else None,
        sham_donor=(donors or {}).get(case.case_id) if sham_on and sham.source == "permuted" else None,
        sham_advisor=config.sham_donor_advisor if sham_on and sham.source == "permuted" else None,
    )


def asking_steps(case: Case, arms: dict[str, ArmResult | None], config: StudyConfig,
                 fixed: dict[str, int]) -> tuple[dict[str, int | None], dict[str, list[int]]]:
    """Where each trigger's arm first asks, derived again from the control arm's recorded queries (None: its trigger
    never fires; an arm whose control arm is not recorded is left out), and each asking arm's later calls' steps,
    from its own (DESIGN §18)."""
    control = arms.get("control")
    triggers = list(config.triggers or [])
    fired: dict[str, int | None] = {}
    if control is not None:
        for arm in config.arms:
            trigger = config.trigger_of(arm)
            if trigger is not None:
                fired[arm] = first_firing(trigger, control.queries, case.case_id, case.horizon, config.interval,
                                          triggers=triggers)
    again: dict[str, list[int]] = {}
    if config.max_calls > 1:
        for name, arm in arms.items():
            if arm is None or not is_assisted(name) or base_arm(name) != name:
                continue
            first = fired.get(name) if config.trigger_of(name) is not None else fixed.get(
                name, config.query_step("control", case.horizon))
            found = call_steps(first, config.asking, config.trigger_of(name), arm.queries, case.case_id, case.horizon,
                               config.interval, triggers=triggers)
            if found[1:]:
                again[name] = found[1:]
    return fired, again


def classify_case(
    config: StudyConfig,
    case: Case,
    arms: dict[str, ArmResult],
    receipts: dict[str, Receipt],
    interrupted: bool,
    donors: dict[str, str] | None = None,
) -> Verdict:
    """A case's verdict under its study's rules: an episode label in an evaluation, DESIGN §3 otherwise."""
    if config.is_evaluation:
        return classify_episode(case.case_id, arms.get("control"), interrupted)
    return classify(case_record(case, arms, receipts, config, interrupted, donors))


def receipt_files(layout: StudyLayout, journal: Journal) -> dict[str, Path]:
    """Every receipts file of a study by its name in the index: the default one and any the index names."""
    names = [RECEIPTS] + sorted({row.path for row in journal.receipt_index()} - {RECEIPTS})
    return {name: layout.receipts_file(name) for name in names}


def outcome_receipts(path: Path) -> dict[str, Receipt]:
    """Outcome receipts of one file by call id, by the receipts reader's rule (a call's first outcome line)."""
    return {call_id: line.receipt for call_id, line in outcomes_by_call(read_receipt_file(path)).items()}


def study_receipts(layout: StudyLayout, journal: Journal) -> dict[str, Receipt]:
    """The outcome receipt of every call of a study, by call id (the receipts reader's rule)."""
    out: dict[str, Receipt] = {}
    for path in receipt_files(layout, journal).values():
        for call_id, receipt in outcome_receipts(path).items():
            out.setdefault(call_id, receipt)
    return out


class StudyRecords(BaseModel):
    """What a study's files hold, gathered once for export, verification and reports."""

    config: StudyConfig
    cases: list[Case]
    states: dict[str, CaseState]
    arms: dict[str, dict[str, ArmResult]]
    # The digest the journal stored beside each arm record, by case id and arm.
    arm_digests: dict[str, dict[str, str]] = {}
    verdicts: dict[str, Verdict]
    receipts: dict[str, Receipt]  # outcome receipts by call id
    meta: dict[str, Any]

    @property
    def interval(self) -> int:
        """C, as the study's configuration fixed it."""
        return self.config.interval

    @property
    def donors(self) -> dict[str, str]:
        """The sham arm's declared donor of each case (permuted source), as stored at creation."""
        return dict(self.meta.get(SHAM_DONORS_KEY) or {})

    def record(self, case: Case) -> CaseRecord:
        """The DESIGN §3 classification input of one case."""
        interrupted = self.states[case.case_id] == "interrupted"
        return case_record(case, self.arms.get(case.case_id, {}), self.receipts, self.config, interrupted, self.donors)

    def classify(self, case: Case) -> Verdict:
        """The verdict a case's records classify to now."""
        interrupted = self.states[case.case_id] == "interrupted"
        return classify_case(
            self.config, case, self.arms.get(case.case_id, {}), self.receipts, interrupted, self.donors
        )


def open_journal(study_dir: str | os.PathLike[str], readonly: bool = True, case_type: type[Case] = Case) -> Journal:
    """Open a study's journal, with a StudyError naming the folder when it is not a study."""
    from rescue.study.journal import JournalError

    layout = StudyLayout.of(study_dir)
    if not layout.is_study():
        raise StudyError(f"{study_dir} is not a study folder (no {layout.journal.name})")
    try:
        return Journal.open(study_dir, readonly=readonly, case_type=case_type)
    except JournalError as exc:
        raise StudyError(str(exc)) from None
    except Exception as exc:  # sqlite3.DatabaseError and friends: an unreadable journal
        raise StudyError(f"{layout.journal}: unreadable journal ({exc})") from None


def _arm_digests(journal: Journal) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for row in journal.arm_rows():
        out.setdefault(row.case_id, {})[row.arm] = row.digest
    return out


def read_study(study_dir: str | os.PathLike[str], journal: Journal) -> StudyRecords:
    """Gather configuration, cases, states, arms, verdicts and outcome receipts from an open journal."""
    layout = StudyLayout.of(study_dir)
    return StudyRecords(
        config=load_study_config(study_dir),
        cases=journal.cases(),
        states={row.case_id: row.state for row in journal.rows()},
        arms=journal.all_arms(),
        arm_digests=_arm_digests(journal),
        verdicts=journal.verdicts(),
        receipts=study_receipts(layout, journal),
        meta=journal.meta(),
    )


def study_summary(records: StudyRecords, verdicts: dict[str, Verdict] | None = None) -> Summary:
    """The summary over finished and interrupted cases with a verdict (stored ones by default).

    Raises SummaryError when the verdicts break the summary's invariants (`rescue verify` says where).
    """
    verdicts = records.verdicts if verdicts is None else verdicts
    chosen = [c for c in records.cases if records.states[c.case_id] in SUMMARIZED_STATES and c.case_id in verdicts]
    try:
        return summarize([records.record(c) for c in chosen], [verdicts[c.case_id] for c in chosen],
                         frame=frame_of(records.cases), task_frames=task_frames(records.cases),
                         replays_exact=records.config.policy.rng_control is True)
    except ValueError as exc:
        raise SummaryError(f"the study's verdicts cannot be summarized: {exc}") from None


def store_summary(study_dir: str | os.PathLike[str]) -> Summary:
    """Compute a rescue study's summary from its stored verdicts and keep it in the journal's meta."""
    with Journal.open(study_dir) as journal:
        records = read_study(study_dir, journal)
        if records.config.is_evaluation:
            raise StudyError("an evaluation study has no rescue summary to store")
        summary = study_summary(records)
        journal.set_summary(summary)
    return summary


class StudyOutcome(BaseModel):
    """How a run left its study, and the line that explains it (the command turns `ended` into its exit code)."""

    ended: Literal["finished", "decided", "stopped", "all_unknown"]
    """finished: every case has a verdict; decided: the study's `[stopping]` rule stopped it, every case it ran
    has a verdict and the rest were never run, by the rule; stopped: cases were never run (drain, fail-fast, an
    unreachable policy); all_unknown: every case has a verdict, and every one is unknown."""
    message: str


def study_outcome(study_dir: str | os.PathLike[str]) -> StudyOutcome:
    """How a run ended, from what the journal holds: finished, stopped early, or all unknown."""
    with open_journal(study_dir) as journal:
        counts = journal.counts()
        labels = journal.label_counts()
        meta = journal.meta()
    n = sum(counts.values())
    left = counts["pending"] + counts["claimed"]
    decision = meta.get(STOPPING_DECISION_KEY)
    if decision is not None and not counts["claimed"] and not meta.get(STOPPED_NOW_KEY) and not meta.get(STOP_REASON_KEY):
        return StudyOutcome(ended="decided", message=(
            f"the [stopping] rule decided at case {decision['at']} of the ordered main cohort ({decision['outcome']}); "
            f"{counts['pending']} of {n} cases were never run, by the rule"))
    if left or meta.get(STOPPED_NOW_KEY):
        why = meta.get(STOP_REASON_KEY) or ("a drain was requested" if meta.get("drain") else "it was interrupted")
        if not left:
            return StudyOutcome(ended="stopped", message=f"the study stopped: {why}")
        return StudyOutcome(
            ended="stopped",
            message=f"the study stopped with {left} of {n} cases without a verdict: {why}",
        )
    unknown = sum(v for (_, label), v in labels.items() if label == "unknown")
    if n and unknown == n:
        return StudyOutcome(ended="all_unknown", message=f"every one of the {n} cases is unknown (see their reasons: rescue export)")
    return StudyOutcome(ended="finished", message=f"all {n} cases have a verdict")
