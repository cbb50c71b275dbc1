"""`rescue verify`: re-derive every hash, classification and summary from the raw records (DESIGN §4).

Nothing stored is taken on trust. Arm records are re-hashed against the
digest taken when they were written; receipt lines against the sha256 the
index holds; verdicts are recomputed by `classify`; traces, injections and
the stored summary are rebuilt from the arms. Every disagreement becomes a
problem naming the case and what disagreed; the report is ok only with none.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from rescue.core.configuration.config import StudyConfig
from rescue.core.digest import digest_bytes, digest_text
from rescue.core.manifest import Case, ManifestError, load_manifest
from rescue.core.proofs import trace_is_regular
from rescue.core.records import ArmResult, Assistance, CaseRecord, Receipt
from rescue.core.verdicts import Verdict
from rescue.core.trace import chain_break
from rescue.core.arms import answered_at_q, base_arm, continuation, continuation_seed, is_assisted
from rescue.core.sham import sham_donors
from rescue.core.figures.stats import Summary, judged_arms
from rescue.core.figures.success_sample import frame_disagreement, frame_of, task_frames
from rescue.read.legacy import is_legacy_summary, legacy_summary
from rescue.read.legacy_harm import is_old_harm, old_harm_summary
from rescue.read.stopping_view import derived_decision, order_problem
from rescue.core.figures.sequential import Decision
from rescue.study import layout
from rescue.study.folder import (
    MANIFEST_COPY_KEY,
    STOPPING_DECISION_KEY,
    SUMMARIZED_STATES,
    SHAM_DONORS_KEY,
    StudyError,
    StudyRecords,
    SummaryError,
    load_study_config,
    open_journal,
    receipt_files,
    study_summary,
)
from rescue.study.journal import SUMMARY_KEY, Journal, stored_arm_digest
from rescue.study.layout import CONFIG, MANIFEST, LayoutError, StudyLayout
from rescue.study.usage import study_usage
from rescue.study.receipts import (
    ReceiptLine,
    check_artifacts,
    check_attempt_refs,
    check_ref,
    extra_outcomes,
    outcomes_by_call,
    read_receipt_file,
    unfinished_calls,
)
from rescue.read.verify_asking import call_problems, trigger_problems
from wrappers.injection import inject, parse_injection


class Problem(BaseModel):
    """One disagreement between what is stored and what it re-derives to."""

    check: str  # which check found it: arm_digest, receipt, verdict, trace, injection, summary, ...
    case_id: str | None = None
    message: str

    def __str__(self) -> str:
        return f"{self.case_id}: {self.message}" if self.case_id else self.message


class VerifyReport(BaseModel):
    """The outcome of verifying one study: problems (fatal) and warnings (not re-checkable)."""

    study_id: str | None = None
    checked: dict[str, int] = Field(default_factory=dict)  # how many of each thing were checked
    problems: list[Problem] = Field(default_factory=list)
    warnings: list[Problem] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing disagreed."""
        return not self.problems

    def render(self) -> str:
        """Plain text for a terminal: verdict line, then every problem and warning."""
        head = "OK" if self.ok else f"FAILED: {len(self.problems)} problem(s)"
        checked = ", ".join(f"{n} {what}" for what, n in self.checked.items())
        lines = [f"verify {self.study_id or '(unnamed study)'}: {head}"]
        if checked:
            lines.append(f"checked: {checked}")
        lines.append(f"evidence (checked): {', '.join(EVIDENCE)}; logs (not evidence, not checked): {', '.join(LOGS)}")
        lines += [f"  problem [{p.check}] {p}" for p in self.problems]
        lines += [f"  warning [{w.check}] {w}" for w in self.warnings]
        return "\n".join(lines)


# What a study folder holds as evidence (every byte re-derived or hash-checked here) and as logs.
EVIDENCE = (layout.JOURNAL, layout.CONFIG, layout.MANIFEST, layout.RECEIPTS, f"{layout.VLM_ARTIFACTS}/",
            f"{layout.FRAMES}/")
LOGS = (layout.EVENTS, layout.SIMULATOR_LOG, layout.POLICY_LOG)


def outcome_line_sha256(path: str | os.PathLike[str], call_id: str) -> str | None:
    """The sha256 of a call's outcome line in a receipts file (what the index stores), or None."""
    line = outcomes_by_call(read_receipt_file(path)).get(call_id)
    return line.sha256 if line is not None else None


def _diff(stored: Any, fresh: Any, where: str = "") -> list[str]:
    """Paths at which two JSON values differ (both-NaN counts as equal)."""
    if isinstance(stored, dict) and isinstance(fresh, dict):
        out = []
        for key in sorted(set(stored) | set(fresh), key=str):
            sub = f"{where}.{key}" if where else str(key)
            if key not in stored or key not in fresh:
                out.append(f"{sub} (only in {'recomputed' if key in fresh else 'stored'})")
            else:
                out += _diff(stored[key], fresh[key], sub)
        return out
    if isinstance(stored, list) and isinstance(fresh, list) and len(stored) == len(fresh):
        return [d for i, (a, b) in enumerate(zip(stored, fresh)) for d in _diff(a, b, f"{where}[{i}]")]
    if isinstance(stored, float) and isinstance(fresh, float) and math.isnan(stored) and math.isnan(fresh):
        return []
    if stored != fresh:
        return [f"{where or 'value'}: stored {stored!r}, recomputed {fresh!r}"]
    return []


def _as_stored_then(recomputed: dict, stored: dict) -> dict:
    """The recomputed summary without what a summary stored before breakdowns carried the primary's comparison
    with control (`versus_control` in `per_group`, `per_task`) could not hold; every figure it held is compared."""
    breakdowns = [b for key in ("per_group", "per_task") for b in (stored.get(key) or {}).values() if isinstance(b, dict)]
    if not breakdowns or any("versus_control" in b for b in breakdowns):
        return recomputed
    out = dict(recomputed)
    for key in ("per_group", "per_task"):
        out[key] = {name: {k: v for k, v in b.items() if k != "versus_control"} for name, b in (out.get(key) or {}).items()}
    return out


def _old_harm_section(records: StudyRecords, verdicts: dict[str, Verdict], confidence: float) -> dict[str, Any]:
    """The harm section of the main cohort as `rescue-export/6` computed it."""
    chosen = [c for c in records.cases if records.states[c.case_id] in SUMMARIZED_STATES and c.case_id in verdicts]
    main = [(records.record(c), verdicts[c.case_id]) for c in chosen if not c.pilot]
    failures = [(rec, v) for rec, v in main if rec.historical_outcome != "success"]
    successes = [(rec, v) for rec, v in main if rec.historical_outcome == "success"]
    return old_harm_summary(failures, successes, judged_arms(main), frame_of(records.cases),
                            task_frames(records.cases), confidence)


class _Verifier:
    def __init__(self, study_dir: Path, journal: Journal):
        self.dir = study_dir
        self.layout = StudyLayout.of(study_dir)
        self.journal = journal
        self.report = VerifyReport()
        self.checked: Counter[str] = Counter()

    def problem(self, check: str, case_id: str | None, message: str) -> None:
        self.report.problems.append(Problem(check=check, case_id=case_id, message=message))

    def warn(self, check: str, case_id: str | None, message: str) -> None:
        self.report.warnings.append(Problem(check=check, case_id=case_id, message=message))

    # --- study files ---------------------------------------------------------

    def check_files(self, cases: list[Case], meta: dict[str, Any]) -> StudyConfig | None:
        """Check the manifest copy and the configuration; return the configuration when it loads."""
        config = None
        manifest_path = self.layout.manifest
        if not manifest_path.exists():
            self.problem("manifest", None, f"the study folder has no {MANIFEST}")
        else:
            try:
                manifest = load_manifest(manifest_path, self.journal.case_type, catalog=None)
            except ManifestError as exc:
                self.problem("manifest", None, f"{MANIFEST} does not load: {exc.problems[0]}")
            else:
                listed = [c.case_id for c in manifest.cases]
                held = [c.case_id for c in cases]
                if listed != held:
                    self.problem("manifest", None, f"{MANIFEST} lists {len(listed)} cases, "
                                 f"the journal {len(held)}, or in another order")
                for a, b in zip(manifest.cases, cases):
                    if a.case_id == b.case_id and a != b:
                        self.problem("manifest", a.case_id, f"case differs between {MANIFEST} and the journal")
                self.check_manifest_digest(manifest.sha256, meta)
                odd = frame_disagreement(manifest.cases)
                if odd is not None:
                    self.problem("manifest", None, f"{MANIFEST}: {odd}")
        try:
            config = load_study_config(self.dir)
        except (StudyError, ValueError, OSError) as exc:
            self.problem("config", None, f"{CONFIG} does not load: {str(exc).splitlines()[0]}")
            return None
        sha = config.sha256()
        if sha != meta.get("config_sha256"):
            self.problem("config", None, f"{CONFIG} hashes to {sha}, the journal recorded {meta.get('config_sha256')}")
        if config.policy.replan_interval is None:
            self.problem("config", None, f"{CONFIG} holds no replan_interval (C); cases cannot be re-classified")
            return None
        return config

    def check_manifest_digest(self, sha: str, meta: dict[str, Any]) -> None:
        """The manifest copy hashes to the sha256 recorded when the study was created (its identity)."""
        recorded = meta.get("manifest_sha256")
        self.checked["manifest sha256"] = 1
        if sha == recorded:
            return
        if meta.get(MANIFEST_COPY_KEY) == "verbatim":
            self.problem("manifest", None, f"{MANIFEST} hashes to {sha}, the journal recorded {recorded} when the study "
                         "was created: the manifest changed since")
        else:  # an older study kept its cases serialized again: its digest is not the one recorded
            self.warn("manifest", None, f"{MANIFEST} was written again from its cases when the study was created "
                      "(before the manifest was kept byte for byte): its sha256 cannot be compared with the one "
                      "recorded; its cases are compared with the journal's")

    # --- keyframes: the stored PNGs are the ones the arm recorded ------------

    def check_keyframes(self, case_id: str, arm: ArmResult) -> None:
        for name, sha in arm.keyframes.items():
            try:
                path = self.layout.keyframe(case_id, arm.arm, name)
            except LayoutError as exc:
                self.problem("keyframes", case_id, f"{arm.arm} keyframe {name!r}: {exc}")
                continue
            if not path.exists():
                self.problem("keyframes", case_id, f"{arm.arm} keyframe {name} is missing ({path.name})")
            elif digest_bytes(path.read_bytes()) != sha:
                self.problem("keyframes", case_id, f"{arm.arm} keyframe {name} differs from the one recorded")
            self.checked["keyframes"] += 1

    # --- (a) arm digests, (g) one record per arm ---------------------------

    def load_arms(self, states: dict[str, str]) -> dict[str, dict[str, ArmResult]]:
        arms: dict[str, dict[str, ArmResult]] = {}
        seen: Counter[tuple[str, str]] = Counter()
        for row in self.journal.arm_rows():
            seen[(row.case_id, row.arm)] += 1
            self.checked["arm records"] += 1
            try:
                result = ArmResult.model_validate_json(row.data)
            except ValidationError as exc:
                self.problem("arm_digest", row.case_id, f"{row.arm} arm record does not parse: "
                             f"{exc.errors()[0]['msg']}")
                continue
            fresh = stored_arm_digest(row.data)
            if fresh != row.digest:
                self.problem("arm_digest", row.case_id, f"{row.arm} arm record changed since it was "
                             f"recorded: stored digest {row.digest[:12]}…, its data hashes to {fresh[:12]}…")
            if result.case_id != row.case_id or result.arm != row.arm:
                self.problem("arm_digest", row.case_id, f"{row.arm} arm row holds the {result.arm} arm "
                             f"of case {result.case_id!r}")
            if states.get(row.case_id) == "pending":
                self.problem("state", row.case_id, f"{row.arm} arm recorded for a case never claimed")
            arms.setdefault(row.case_id, {})[row.arm] = result
        for (case_id, arm), n in seen.items():
            if n > 1:
                self.problem("state", case_id, f"{n} records of the {arm} arm")
        return arms

    # --- (b) receipts ----------------------------------------------------------

    def load_receipts(self) -> tuple[dict[str, Receipt], dict[tuple[str, str], list[ReceiptLine]]]:
        receipts: dict[str, Receipt] = {}
        outcomes: dict[tuple[str, str], list[ReceiptLine]] = {}  # (path, call id) -> outcome lines, first first
        self.lines: dict[str, list[ReceiptLine]] = {}
        for name, path in receipt_files(self.layout, self.journal).items():
            lines = read_receipt_file(path)
            self.lines[name] = lines
            for line in lines:
                self.checked["receipt lines"] += 1
                if line.receipt is None:
                    # Evidence parses to the last byte: the receipt log never leaves a cut line (a write
                    # that fails is undone), so a line that does not parse was cut or edited afterwards.
                    self.problem("receipt", None, f"{name} line {line.lineno} does not parse: {line.error}"
                                 + ("" if line.complete else " (its last line, with no newline)"))
            for call_id, line in outcomes_by_call(lines).items():
                outcomes[(name, call_id)] = [line]
                receipts.setdefault(call_id, line.receipt)
                for problem in check_attempt_refs(line.receipt, lines):
                    for case_id in line.receipt.case_ids:
                        self.problem("receipt", case_id, problem)
                self.check_call_artifacts(line.receipt)
            for call_id, extra in extra_outcomes(lines).items():
                outcomes[(name, call_id)] += extra
                for case_id in extra[0].receipt.case_ids:
                    self.problem("receipt", case_id, f"call {call_id} has {1 + len(extra)} outcome lines in {name} "
                                 f"(lines {', '.join(str(l.lineno) for l in outcomes[(name, call_id)])}); the first is its outcome")
            for call_id, started in unfinished_calls(lines).items():
                self.warn("receipt", None, f"call {call_id} has {len(started)} attempt line(s) in {name} and no outcome "
                          "(in flight when the study stopped)")
        return receipts, outcomes

    def check_artifact_folder(self) -> None:
        """The VLM artifacts folder holds exactly the files the receipt lines name (images sent, prompts,
        responses): a file no line names was put there, not kept by the client."""
        folder = self.layout.vlm_artifacts
        if not folder.is_dir():
            return
        named: set[str] = set()
        for lines in self.lines.values():
            for line in lines:
                r = line.receipt
                if r is None:
                    continue
                named.update(f"{sha}.png" for sha in r.sent_image_sha256)
                named.add(f"{r.prompt_sha256}.txt")
                if r.response_sha256 is not None:
                    named.add(f"{r.response_sha256}.txt")
        for path in sorted(folder.iterdir()):
            if path.name not in named:
                self.problem("artifacts", None, f"{folder.name}/{path.name} is not named by any receipt line")

    def check_call_artifacts(self, receipt: Receipt) -> None:
        """The images, prompt and response a call kept (DESIGN §9) hash to what its receipt says."""
        folder = self.layout.vlm_artifacts
        if not folder.is_dir():
            self.warn("artifacts", None, f"call {receipt.call_id}: the study keeps no VLM artifacts folder")
            return
        self.checked["vlm calls' artifacts"] += 1
        for problem in check_artifacts(receipt, folder):
            for case_id in receipt.case_ids:
                self.problem("artifacts", case_id, f"call {receipt.call_id}: {problem}")

    def check_assisted_refs(self, arms: dict[str, dict[str, ArmResult]]) -> None:
        """Each assisted (or permuted sham) arm's receipt reference points at unchanged bytes of its call's outcome line."""
        for case_id, by_arm in arms.items():
            for name in [n for n in by_arm if answered_at_q(n)]:
                for a in by_arm[name].calls() or [by_arm[name].assistance]:
                    ref = a.receipt_ref
                    if ref is None:
                        continue
                    self.checked["receipt references"] += 1
                    problem = check_ref(ref, self.lines.get(ref.path, []))
                    if problem is not None:
                        self.problem("receipt", case_id, f"{name} arm's receipt reference: {problem}")
                        continue
                    line = next(l for l in self.lines[ref.path] if l.lineno == ref.lineno)
                    if line.receipt is None or line.receipt.kind != "outcome" or line.receipt.call_id != a.call_id:
                        self.problem("receipt", case_id, f"{name} arm's receipt reference ({ref.path} line {ref.lineno}) "
                                     f"is not the outcome line of call {a.call_id}")

    def check_sham_declaration(self, config: StudyConfig, cases: list[Case], meta: dict[str, Any]) -> None:
        """The permuted sham arm's donors are the ones its manifest and seed declare (DESIGN §8)."""
        stored = meta.get(SHAM_DONORS_KEY)
        if config.sham.source != "permuted":
            if stored is not None:
                self.problem("sham", None, "the journal declares sham donors, but the study's sham source is "
                             f"{config.sham.source!r}")
            return
        self.checked["sham declarations"] = 1
        expected = sham_donors(cases, config.sham.seed)
        if stored != expected:
            changed = sorted(k for k in set(expected) | set(stored or {}) if (stored or {}).get(k) != expected.get(k))
            self.problem("sham", None, f"the declared sham donors differ from those the manifest and seed "
                         f"{config.sham.seed} give, for {len(changed)} case(s): {', '.join(changed[:5])}")

    def check_receipt_index(
        self, outcomes: dict[tuple[str, str], list[ReceiptLine]], arms: dict[str, dict[str, ArmResult]]
    ) -> None:
        indexed: set[tuple[str, str]] = set()
        for row in self.journal.receipt_index():
            self.checked["receipt index entries"] += 1
            indexed.add((row.call_id, row.case_id))
            lines = outcomes.get((row.path, row.call_id), [])
            if not lines:
                self.problem("receipt", row.case_id, f"call {row.call_id} is indexed in {row.path}, "
                             "which holds no outcome line for it")
                continue
            line = lines[0]
            if row.case_id not in line.receipt.case_ids:
                self.problem("receipt", row.case_id, f"the outcome receipt of call {row.call_id} does not name the case")
            if row.line_sha256 is None:
                self.warn("receipt", row.case_id, f"call {row.call_id} was indexed without its line sha256; "
                          "its receipt line cannot be re-checked")
            elif line.sha256 != row.line_sha256:
                self.problem("receipt", row.case_id, f"the outcome line of call {row.call_id} in {row.path} "
                             f"(line {line.lineno}) changed since it was indexed: sha256 {line.sha256[:12]}…, "
                             f"index holds {row.line_sha256[:12]}…")
        by_call = {call_id for (_, call_id) in outcomes}
        for case_id, by_arm in arms.items():
            for name in [n for n in by_arm if is_assisted(n)]:
                for i, call in enumerate([by_arm[name].assistance, *by_arm[name].again]):
                    self.check_indexed(case_id, name if i == 0 else f"{name} (call {i + 1})", call, by_call, indexed)

    def check_indexed(self, case_id: str, name: str, a: Assistance, by_call: set[str], indexed: set[tuple[str, str]]) -> None:
        """An assisted arm's (each advisor's) applied subgoal has its call's outcome receipt, and the index names it."""
        if a.call_id is None and a.status != "applied":
            return
        what = "assistance" if name == "assisted" else f"{name} assistance"
        call_id = a.call_id
        if a.status != "applied":
            if call_id not in by_call:
                self.warn("receipt", case_id, f"{what} {a.status} names call {call_id}, "
                          "which has no outcome receipt")
            return
        if call_id is None:
            self.problem("receipt", case_id, f"applied {what} names no call")
        elif call_id not in by_call:
            self.problem("receipt", case_id, f"applied {what} has no outcome receipt (call {call_id})")
        elif (call_id, case_id) not in indexed:
            self.problem("receipt", case_id, f"applied {what}'s call {call_id} is not in the receipts index")

    def check_receipt_advisors(self, config: StudyConfig) -> None:
        """Every receipt names one of the study's declared advisors (DESIGN §11), or none in a study of one `[vlm]`."""
        declared = {a.name for a in config.advisors or []}
        for name, lines in self.lines.items():
            for line in lines:
                r = line.receipt
                if r is None:
                    continue
                if (r.advisor is None) != (not declared) or (r.advisor is not None and r.advisor not in declared):
                    said = f"advisor {r.advisor!r}" if r.advisor is not None else "no advisor"
                    want = f"one of {', '.join(sorted(declared))}" if declared else "none (a study of one [vlm])"
                    for case_id in r.case_ids:
                        self.problem("receipt", case_id, f"{name} line {line.lineno} (call {r.call_id}) names {said}; "
                                     f"the study declares {want}")

    # --- (c) verdicts and states ---------------------------------------------

    def stored_verdicts(self) -> dict[str, Verdict]:
        out = {}
        for case_id, data in self.journal.raw_verdicts().items():
            try:
                out[case_id] = Verdict.model_validate_json(data)
            except ValidationError as exc:
                self.problem("verdict", case_id, f"stored verdict does not parse: {exc.errors()[0]['msg']}")
        return out

    def check_verdicts(self, records: StudyRecords, stored: dict[str, Verdict]) -> dict[str, Verdict]:
        fresh: dict[str, Verdict] = {}
        for case in records.cases:
            case_id, state = case.case_id, records.states[case.case_id]
            v = stored.get(case_id)
            if state in ("pending", "claimed"):
                if v is not None:
                    self.problem("state", case_id, f"case is {state} but has a stored verdict")
                if state == "claimed":
                    self.warn("state", case_id, "claimed but not finished (in flight, or a crash `resume` "
                              "will mark interrupted)")
                continue
            self.checked["verdicts"] += 1
            new = self.classify(records, case)
            fresh[case_id] = new
            if v is None:
                self.problem("verdict", case_id, f"{state} case has no stored verdict; "
                             f"it classifies as {new.label} (rule {new.rule}: {new.reason})")
                continue
            fields = [f for f in Verdict.model_fields if f != "arms" and getattr(v, f) != getattr(new, f)]
            if fields:
                self.problem("verdict", case_id, f"stored verdict {v.label} (rule {v.rule}) differs from "
                             f"the recomputed {new.label} (rule {new.rule}: {new.reason}) in {', '.join(fields)}")
            for arm in [a for a in {**v.arms, **new.arms} if v.arms.get(a) != new.arms.get(a)]:
                old, now = v.arms.get(arm), new.arms.get(arm)
                said = f"{old.label} (rule {old.rule})" if old else "none"
                derived = f"{now.label} (rule {now.rule}: {now.reason})" if now else "none"
                self.problem("verdict", case_id, f"stored verdict of the {arm} arm {said} differs from the recomputed {derived}")
        return fresh

    @staticmethod
    def classify(records: StudyRecords, case: Case) -> Verdict:
        """The verdict a case's records classify to, by the rules its study was run under."""
        return records.classify(case)

    # --- (d) traces, (e) injection -------------------------------------------

    def check_trace(self, case_id: str, arm: ArmResult, interval: int) -> None:
        if arm.status != "complete":
            return
        self.checked["traces"] += 1
        broken = chain_break(arm.trace)
        if broken is not None:
            self.problem("trace", case_id, f"{arm.arm} trace row {broken} (step {arm.trace[broken].step}) does not "
                         "follow from the rows before it: its chain digest is not theirs and its own (an edited row)")
        if trace_is_regular(arm.trace, interval):
            return
        if not arm.trace:
            self.problem("trace", case_id, f"{arm.arm} arm is complete but its trace is empty")
            return
        i = next(i for i, row in enumerate(arm.trace) if row.step != i * interval)
        self.problem("trace", case_id, f"{arm.arm} trace is not regular for C={interval}: row {i} "
                     f"is at step {arm.trace[i].step}, expected {i * interval}")

    def check_instructions(self, case: Case, arms: dict[str, ArmResult], rec: CaseRecord) -> None:
        case_id = case.case_id
        control = arms.get("control")
        # The original instruction's digest: the manifest's text when given, else
        # the one the control arm queried with.
        original_text = case.instruction
        original = digest_text(original_text) if original_text is not None else None
        if control is not None and control.trace:
            seen = {row.instruction for row in control.trace}
            if len(seen) != 1:
                self.problem("injection", case_id, "control arm queried with more than one instruction")
            elif original is None:
                original = next(iter(seen))
            elif original not in seen:
                self.problem("injection", case_id, "control arm did not query with the case's instruction")
        for name in [n for n in arms if n != "control" and base_arm(n) == "control"]:  # its continuations
            if original is not None and any(row.instruction != original for row in arms[name].trace):
                self.problem("injection", case_id, f"{name} arm queried with another instruction than the control arm")
        for name in [n for n in arms if answered_at_q(n)]:
            arm_rec = arms.get(name)
            if arm_rec is not None and arm_rec.trace:
                q = rec.q_of(name)  # its declared query point's, where its trigger fires, else the case's q
                if arm_rec.again:
                    self.check_calls(case_id, name, arm_rec, original_text, original)
                else:
                    self.check_injection(case_id, name, arm_rec, q, original_text, original)

    def check_calls(self, case_id: str, name: str, arm: ArmResult, original_text: str | None,
                    original: str | None) -> None:
        """An arm that asked more than once (DESIGN §18): rescue/read/verify_asking.py."""
        applied = [c for c in arm.calls() if c.status == "applied"]
        self.checked["injections"] += len(applied)
        for message in call_problems(name, arm, original_text, original):
            self.problem("injection", case_id, message)

    def check_triggers(self, case_id: str, arms: dict[str, ArmResult], rec: CaseRecord, config: StudyConfig) -> None:
        """Each trigger's firing and each later call derived again from the records (DESIGN §18)."""
        firings, later, problems = trigger_problems(arms, rec, config)
        self.checked["trigger firings"] += firings
        self.checked["later calls"] += later
        for message in problems:
            self.problem("trigger", case_id, message)

    def check_continuations(self, case: Case, arms: dict[str, ArmResult]) -> None:
        """A continuation reseeded at q under RNG control got its continuation's declared seed (DESIGN §13)."""
        for name, arm in arms.items():
            k, seed = continuation(name), arm.continuation_seed
            if seed is not None and (k < 2 or seed != continuation_seed(case.policy_seed, k)):
                self.problem("continuation", case.case_id, f"{name} arm's policy RNG was reset to {seed} at q, "
                             "not to its continuation's declared seed")

    def check_injection(
        self, case_id: str, name: str, arm_rec: ArmResult, q: int, original_text: str | None, original: str | None
    ) -> None:
        """An arm that injects a subgoal at q: before q the original instruction, from q exactly inject(original, subgoal)."""
        a = arm_rec.assistance
        if a.status != "applied":
            if original is not None and any(row.instruction != original for row in arm_rec.trace):
                self.problem("injection", case_id, f"{name} subgoal {a.status}, yet the {name} arm "
                             "queried with another instruction than the original")
            return
        self.checked["injections"] += 1
        if a.instruction is None or a.subgoal is None or not a.subgoal.strip():
            self.problem("injection", case_id, f"applied {name} subgoal lacks its instruction or subgoal")
            return
        if original_text is None:
            # The original text is not stored; the applied instruction carries it,
            # and its digest must be the one the arms queried with before q.
            original_text, parsed = parse_injection(a.instruction)
            if parsed is None:
                self.problem("injection", case_id, "applied instruction is not an injection of a subgoal")
                return
            if original is None:
                original = digest_text(original_text)
            elif digest_text(original_text) != original:
                self.problem("injection", case_id, "the original inside the applied instruction is not "
                             "the instruction the control arm queried with")
        before = [row for row in arm_rec.trace if row.step < q]
        if any(row.instruction != original for row in before):
            self.problem("injection", case_id, f"{name} rows before step {q} carry another instruction "
                         "than the control arm's")
        expected = inject(original_text, a.subgoal)
        injected = digest_text(expected)
        if expected != a.instruction:
            self.problem("injection", case_id, "applied instruction is not inject(original, subgoal)")
        if a.instruction_digest != injected:
            self.problem("injection", case_id, "applied instruction digest is not the digest of "
                         "inject(original, subgoal)")
        at_q = [row for row in arm_rec.trace if row.step == q]
        # An arm whose policy server failed right after the answer was applied has no row at q;
        # that is its infrastructure error (the case is unknown), not a broken injection.
        ended_early = arm_rec.status != "complete" and not any(row.step >= q for row in arm_rec.trace)
        if not ended_early and (len(at_q) != 1 or at_q[0].instruction != injected):
            self.problem("injection", case_id, f"{name} trace row at step {q} was not queried with "
                         "inject(original, subgoal)")
        if any(row.instruction != injected for row in arm_rec.trace if row.step > q):
            self.problem("injection", case_id, f"{name} rows after step {q} leave the injected instruction")

    # --- (f) summary, (g) invariant --------------------------------------------

    def check_summary(self, records: StudyRecords, fresh: dict[str, Verdict]) -> None:
        try:
            summary = study_summary(records, fresh)
        except SummaryError as exc:
            self.problem("summary", None, str(exc))
            return
        stored = records.meta.get(SUMMARY_KEY)
        if stored is None:
            return
        self.checked["summary"] = 1
        if is_legacy_summary(stored):
            # Stored before the record family: today's figures, written in that version's shape.
            advisors = [a.name for a in records.config.advisors] if records.config.advisors else None
            recomputed = legacy_summary(summary, advisors)
        else:
            old_harm = is_old_harm(stored.get("harm"))
            try:
                Summary.model_validate({**stored, "harm": None} if old_harm else stored)
            except ValidationError:
                self.problem("summary", None, "stored summary is not a summary")
                return
            recomputed = _as_stored_then(summary.model_dump(mode="json"), stored)
            if old_harm:
                # Stored by `rescue-export/6`: its harm figures derived again as that version computed them.
                recomputed["harm"] = _old_harm_section(records, fresh, summary.confidence)
        diffs = _diff(stored, recomputed)
        if diffs:
            shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
            self.problem("summary", None, f"stored summary differs from the one recomputed over "
                         f"{summary.n} main-cohort cases: {shown}")

    def check_stopping(self, records: StudyRecords, fresh: dict[str, Verdict]) -> None:
        """A `[stopping]` rule: the order is the one its seed fixes, and the decision the journal keeps is the one
        the e-process gives again case by case (or, kept none, that no boundary was crossed before the end)."""
        if records.config.stopping is None:
            return
        self.checked["stopping rule"] = 1
        problem = order_problem(records)
        if problem is not None:
            self.problem("stopping", None, problem)
            return
        again = derived_decision(records, fresh)
        kept = records.meta.get(STOPPING_DECISION_KEY)
        if kept is None:
            if again is not None and again.outcome in ("efficacy", "futility"):
                self.problem("stopping", again.case_id, f"the rule decides {again.outcome} at case {again.at} "
                             f"({again.case_id}), and the study went on without stopping")
            return
        stored = Decision.model_validate(kept).model_dump(mode="json")
        diffs = _diff(stored, again.model_dump(mode="json"))
        if diffs:
            shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
            self.problem("stopping", None, f"the decision the journal keeps differs from the one derived again: {shown}")

    def check_invariant(self, records: StudyRecords, verdicts: dict[str, Verdict], which: str) -> None:
        main = [c for c in records.cases if not c.pilot]
        mine = [verdicts[c.case_id] for c in main if c.case_id in verdicts]
        primary = records.config.primary_arm
        arms = [primary] + [a for a in records.config.arms if a not in ("control", primary)]
        for arm in arms:
            judged = [(v.case_id, v.of(arm, primary)) for v in mine]
            judged = [(case_id, av) for case_id, av in judged if av is not None]
            what = f"{which} verdict" if arm == primary else f"{which} verdict of the {arm} arm"
            for case_id, av in judged:
                if av.in_e and not av.in_m:
                    self.problem("invariant", case_id, f"{what} is in E but not in M")
                if av.label == "rescued" and not av.in_e:
                    self.problem("invariant", case_id, f"{what} is rescued but not in E")
            r = sum(av.label == "rescued" for _, av in judged)
            e = sum(av.in_e for _, av in judged)
            m = sum(av.in_m for _, av in judged)
            if not r <= e <= m <= len(main):
                self.problem("invariant", None, f"{what}s break R <= E <= M <= N: R={r} E={e} M={m} N={len(main)}")

    def check_usage(self, records: StudyRecords) -> None:
        """Per-advisor usage adds up to the study's, and every call of the primary advisor is some query point's arm's
        (each call once, its tokens too): the per-arm and per-query-point tables sum to the receipts."""
        from rescue.read.export import query_point_calls

        receipts = list(records.receipts.values())
        usage, by_advisor = study_usage(receipts, records.config)
        self.checked["usage"] += 1
        if by_advisor is not None:
            calls = sum(u.calls for u in by_advisor.values())
            tokens = {k: sum(u.tokens[k].known_sum for u in by_advisor.values()) for k in usage.tokens}
            if calls != usage.calls or tokens != {k: t.known_sum for k, t in usage.tokens.items()}:
                self.problem("usage", None, f"the advisors' usage counts {calls} calls ({tokens}), the receipts "
                             f"{usage.calls}")
        if not records.config.query_points and not records.config.triggers:
            return
        primary = records.config.advisor_configs()[0][0]
        theirs = {r.call_id for r in receipts if r.advisor == primary}
        attributed = set().union(*query_point_calls(records, receipts).values())
        for call_id in sorted(theirs - attributed):
            self.problem("usage", None, f"call {call_id} of the primary advisor is no query point's arm's: the "
                         "per-query-point usage leaves it out")
        for call_id in sorted(attributed - theirs):
            self.problem("usage", None, f"call {call_id} counted for a query point's arm has no outcome receipt "
                         "of the primary advisor")

    def check_counts(self, cases: list[Case], states: dict[str, str]) -> None:
        counts = self.journal.counts()
        rows = self.journal.rows()
        twice = [cid for cid, n in Counter(r.case_id for r in rows).items() if n > 1]
        for case_id in twice:
            self.problem("state", case_id, "case holds more than one state")
        if sum(counts.values()) != len(cases) or len(rows) != len(cases):
            self.problem("state", None, f"state counts {counts} do not add up to {len(cases)} cases")


def verify_study(study_dir: str | os.PathLike[str], case_type: type[Case] = Case) -> VerifyReport:
    """Re-check a study from its raw records; the report lists every disagreement found."""
    study_dir = Path(study_dir)
    try:
        journal = open_journal(study_dir, case_type=case_type)
    except StudyError as exc:
        return VerifyReport(problems=[Problem(check="journal", message=str(exc))])
    with journal:
        v = _Verifier(study_dir, journal)
        meta = journal.meta()
        v.report.study_id = meta.get("study_id")
        cases = journal.cases()
        states = {row.case_id: row.state for row in journal.rows()}
        v.checked["cases"] = len(cases)
        config = v.check_files(cases, meta)
        v.check_counts(cases, states)
        arms = v.load_arms(states)
        receipts, outcomes = v.load_receipts()
        v.check_artifact_folder()
        v.check_receipt_index(outcomes, arms)
        v.check_assisted_refs(arms)
        if config is not None and not config.is_evaluation:
            v.check_sham_declaration(config, cases, meta)
            v.check_receipt_advisors(config)
        if config is not None:
            for case_id, by_arm in arms.items():
                for name in sorted(set(by_arm) - set(config.case_arms)):
                    v.problem("state", case_id, f"{name} arm recorded, but the study runs {', '.join(config.case_arms)}")
        stored = v.stored_verdicts()
        if config is not None:
            records = StudyRecords(
                config=config, cases=cases, states=states, arms=arms, verdicts=stored, receipts=receipts, meta=meta,
            )
            interval = config.interval
            fresh = v.check_verdicts(records, stored)
            for case in cases:
                by_arm = arms.get(case.case_id, {})
                for arm in by_arm.values():
                    v.check_trace(case.case_id, arm, interval)
                    v.check_keyframes(case.case_id, arm)
                rec = records.record(case)
                v.check_instructions(case, by_arm, rec)
                if config.triggers or config.max_calls > 1:
                    v.check_triggers(case.case_id, by_arm, rec, config)
                v.check_continuations(case, by_arm)
            if not config.is_evaluation:
                v.check_usage(records)
                v.check_invariant(records, stored, "stored")
                v.check_invariant(records, fresh, "recomputed")
                v.check_summary(records, fresh)
                v.check_stopping(records, fresh)
        v.report.checked = dict(v.checked)
        return v.report
