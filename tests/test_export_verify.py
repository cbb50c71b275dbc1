"""Export, verify and status on a real study folder: a real journal, real receipt lines, real traces.

No simulator runs: a small driver plays the engine's part (claim, record arms,
write and index receipts, classify and finish), so the folder holds exactly
what a run leaves behind. Tamper tests edit copies of it and expect verify to
name the case that was touched.
"""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from conftest import resolved_config

from rescue.core.classify import classify
from rescue.core.digest import digest_array, digest_obs, digest_text
from rescue.core.manifest import parse_manifest
from rescue.core.querypoint import query_point
from rescue.core.records import ArmResult, Assistance, Receipt, Usage
from rescue.core.verdicts import Verdict
from rescue.core.trace import TraceRow
from rescue.read.export import (
    csv_columns,
    EXPORT_SCHEMA,
    csv_rows,
    export_paths,
    export_study,
    write_export,
)
from rescue.read.status import render_status, study_status
from rescue.read.verify import outcome_line_sha256, verify_study
from rescue.run.recovery import recover
from rescue.study.folder import case_record, create_study, outcome_receipts, store_summary
from rescue.study.journal import SUMMARY_KEY, Journal, arm_digest
from rescue.study.layout import RECEIPTS as RECEIPTS_FILE
from rescue.study.receipts import ReceiptLog, read_receipts
from wrappers.injection import inject

pytestmark = pytest.mark.fast

H, C = 220, 16
Q = query_point(H, C)  # 112
FP = digest_text("initial state")
TASK_INSTRUCTION = "pick up the black bowl and place it on the plate"


# --- building a study like the engine does -------------------------------------


def manifest_lines() -> list[dict]:
    base = dict(suite="libero_spatial", env_seed=7, horizon=H)
    # Each case its own episode (a manifest refuses one episode under two ids).
    return [dict(line, init_state_index=i) for i, line in enumerate(_lines(base))]


def _lines(base: dict) -> list[dict]:
    return [
        # Given instructions and fingerprints for some cases, none for others:
        # verify must re-derive the original instruction either way.
        dict(base, case_id="rescued-1", task_id=0, group="spatial", instruction=TASK_INSTRUCTION, fingerprint=FP),
        dict(base, case_id="assisted-fails", task_id=0, group="spatial"),
        dict(base, case_id="control-wins", task_id=1, group="spatial", fingerprint=FP),
        dict(base, case_id="vlm-timeout", task_id=1, group="object"),
        dict(base, case_id="deviates", task_id=2, group="object", fingerprint=digest_text("another state")),
        dict(base, case_id="crashed", task_id=2, group="object"),
        dict(base, case_id="never-started", task_id=3, group="object"),
        dict(base, case_id="pilot-1", task_id=3, group="object", pilot=True),
    ]


def trace(case_id: str, arm: str, end: int, applied: str | None = None) -> list[TraceRow]:
    """One row per query at 0, C, 2C, ...; rows before Q are the same in both arms."""
    rows = []
    for step in range(0, end, C):
        tag = "shared" if step < Q else arm
        obs = {"state": np.full(8, step, np.float32), "tag": np.frombuffer(f"{case_id}{tag}".encode(), np.uint8)}
        instruction = applied if (applied is not None and step >= Q) else TASK_INSTRUCTION
        chunk = np.full((C, 7), step / 1000.0 + (0.5 if tag == "assisted" else 0.0), np.float32)
        rows.append(
            TraceRow(
                step=step,
                state=digest_obs(obs),
                images={"agentview": digest_array(np.full((4, 4, 3), step % 255, np.uint8))},
                instruction=digest_text(instruction),
                actions=digest_array(chunk),
            )
        )
    return rows


def receipt(kind: str, call_id: str, cases: list[str], status: str, subgoals: dict | None = None) -> Receipt:
    request_ids = [f"req-{c}" for c in cases]
    return Receipt(
        kind=kind,
        call_id=call_id,
        attempt=1,
        request_ids=request_ids,
        tokens={r: f"tok-{r}" for r in request_ids},
        case_ids=cases,
        model_requested="qwen2.5-vl-7b",
        model_reported="qwen2.5-vl-7b" if status == "ok" else None,
        endpoint_kind="chat",
        prompt_template="subgoal",
        prompt_template_sha256=digest_text("template"),
        prompt_sha256=digest_text(f"prompt {call_id}"),
        started_at=1000.0,
        finished_at=1001.5,
        latency_s=1.5,
        status=status,
        error_kind=None if status == "ok" else status,
        usage=Usage(input_tokens=900, output_tokens=40) if status == "ok" else Usage(),
        response_sha256=digest_text(f"response {call_id}") if status == "ok" else None,
        subgoals=subgoals or {},
        request_status={r: status for r in request_ids},
    )


def arm_result(case_id: str, arm: str, *, success: bool, steps: int, fingerprint: str = FP,
               assistance: Assistance | None = None, applied: str | None = None) -> ArmResult:
    return ArmResult(
        case_id=case_id,
        arm=arm,
        status="complete",
        success=success,
        steps=steps,
        fingerprint=fingerprint,
        trace=trace(case_id, arm, steps, applied),
        assistance=assistance or Assistance(status="control"),
        started_at=1000.0,
        finished_at=1100.0,
    )


def applied(case_id: str, call_id: str, subgoal: str) -> tuple[Assistance, str]:
    instruction = inject(TASK_INSTRUCTION, subgoal)
    return Assistance(
        status="applied", query_step=Q, subgoal=subgoal, instruction=instruction,
        instruction_digest=digest_text(instruction), call_id=call_id, request_id=f"req-{case_id}",
    ), instruction


class Driver:
    """Plays the engine: claim, record arms, index receipts with their line sha256, classify, finish."""

    def __init__(self, study: Path, journal: Journal):
        self.study, self.journal = study, journal

    def finish(self, case_id: str, *arms: ArmResult) -> None:
        journal = self.journal
        assert journal.claim(case_id, "w0")
        by_arm = {a.arm: a for a in arms}
        call_id = by_arm["assisted"].assistance.call_id if "assisted" in by_arm else None
        path = self.study / RECEIPTS_FILE
        index = (call_id, RECEIPTS_FILE, outcome_line_sha256(path, call_id)) if call_id else None
        rec = case_record(journal.case(case_id), by_arm, outcome_receipts(path), resolved_config(C), interrupted=False)
        # As the engine does: arms, receipt index and verdict in one transaction.
        journal.finish_case(case_id, arms, classify(rec), index)


def build_study(study: Path) -> Path:
    data = "".join(json.dumps(line) + "\n" for line in manifest_lines()).encode()
    manifest = parse_manifest(data, "manifest.jsonl", catalog=None)
    create_study(study, manifest, resolved_config(C))
    journal = Journal.open(study)
    log = ReceiptLog(study / RECEIPTS_FILE)
    drive = Driver(study, journal)

    # One batched call answers two cases, as the client does with a contact sheet.
    sub1, sub2 = "Grasp the bowl by its rim.", "Lift the bowl above the plate."
    log.write(receipt("attempt", "call-a", ["rescued-1", "assisted-fails"], "ok"))
    log.write(receipt("outcome", "call-a", ["rescued-1", "assisted-fails"], "ok",
                      {"req-rescued-1": sub1, "req-assisted-fails": sub2}))
    a1, i1 = applied("rescued-1", "call-a", sub1)
    drive.finish(
        "rescued-1",
        arm_result("rescued-1", "control", success=False, steps=H),
        arm_result("rescued-1", "assisted", success=True, steps=176, assistance=a1, applied=i1),
    )
    a2, i2 = applied("assisted-fails", "call-a", sub2)
    drive.finish(
        "assisted-fails",
        arm_result("assisted-fails", "control", success=False, steps=H),
        arm_result("assisted-fails", "assisted", success=False, steps=H, assistance=a2, applied=i2),
    )
    sub3 = "Open the gripper over the plate."
    log.write(receipt("outcome", "call-b", ["control-wins"], "ok", {"req-control-wins": sub3}))
    a3, i3 = applied("control-wins", "call-b", sub3)
    drive.finish(
        "control-wins",
        arm_result("control-wins", "control", success=True, steps=144),
        arm_result("control-wins", "assisted", success=False, steps=H, assistance=a3, applied=i3),
    )
    log.write(receipt("outcome", "call-c", ["vlm-timeout"], "timeout"))
    drive.finish(
        "vlm-timeout",
        arm_result("vlm-timeout", "control", success=False, steps=H),
        arm_result("vlm-timeout", "assisted", success=False, steps=H, assistance=Assistance(
            status="timeout", query_step=Q, call_id="call-c", request_id="req-vlm-timeout", error_kind="timeout")),
    )
    sub4 = "Push the bowl toward the plate."
    log.write(receipt("outcome", "call-d", ["deviates"], "ok", {"req-deviates": sub4}))
    a4, i4 = applied("deviates", "call-d", sub4)
    drive.finish(
        "deviates",
        arm_result("deviates", "control", success=False, steps=H),
        arm_result("deviates", "assisted", success=True, steps=200, assistance=a4, applied=i4),
    )
    sub5 = "Center the gripper over the bowl."
    log.write(receipt("outcome", "call-e", ["pilot-1"], "ok", {"req-pilot-1": sub5}))
    a5, i5 = applied("pilot-1", "call-e", sub5)
    drive.finish(
        "pilot-1",
        arm_result("pilot-1", "control", success=False, steps=H),
        arm_result("pilot-1", "assisted", success=True, steps=192, assistance=a5, applied=i5),
    )
    # A worker dies while its arms run (nothing of a case lands before its verdict): resume's
    # recovery makes it interrupted.
    assert journal.claim("crashed", "w1")
    log.close()
    # What each call saw and answered (DESIGN §9), kept as the client keeps it: named by sha256.
    for r in read_receipts(study / RECEIPTS_FILE):
        if r.kind == "outcome":
            for text in (f"prompt {r.call_id}", f"response {r.call_id}"):
                if digest_text(text) not in (r.prompt_sha256, r.response_sha256):
                    continue  # a call without a response keeps none (a timeout)
                (study / "vlm").mkdir(exist_ok=True)
                (study / "vlm" / f"{digest_text(text)}.txt").write_text(text, encoding="utf-8")
    journal.close()
    recover(study)
    store_summary(study)
    return study


@pytest.fixture(scope="module")
def clean_study(tmp_path_factory) -> Path:
    return build_study(tmp_path_factory.mktemp("studies") / "study-clean")


@pytest.fixture
def study_copy(clean_study, tmp_path) -> Path:
    return Path(shutil.copytree(clean_study, tmp_path / "study-copy"))


def problems_for(report, case_id: str) -> list[str]:
    return [p.message for p in report.problems if p.case_id == case_id]


# --- the clean study -------------------------------------------------------------


def test_clean_study_verifies(clean_study):
    report = verify_study(clean_study)
    assert report.ok, report.render()
    assert report.warnings == []
    assert report.checked["cases"] == 8
    assert report.checked["verdicts"] == 7  # finished and interrupted, not the pending one
    assert report.checked["injections"] == 5
    assert report.checked["summary"] == 1
    assert "OK" in report.render()


def test_study_holds_the_expected_labels(clean_study):
    with Journal.open(clean_study, readonly=True) as j:
        labels = {cid: (v.label, v.rule) for cid, v in j.verdicts().items()}
    assert labels == {
        "rescued-1": ("rescued", 9),
        "assisted-fails": ("not_rescued", 8),
        "control-wins": ("not_rescued", 7),
        "vlm-timeout": ("unknown", 3),
        "deviates": ("initial_state_deviation", 1),
        "crashed": ("unknown", 2),
        "pilot-1": ("rescued", 9),
    }


def test_journal_stores_arm_digests_and_receipt_line_sha256(clean_study):
    with Journal.open(clean_study, readonly=True) as j:
        rows = j.arm_rows()
        assert len(rows) == 12
        for row in rows:
            assert row.digest == arm_digest(ArmResult.model_validate_json(row.data))
        index = {(r.call_id, r.case_id): r.line_sha256 for r in j.receipt_index()}
        assert len(index) == 6
    lines = (clean_study / RECEIPTS_FILE).read_bytes().split(b"\n")
    outcome_a = next(l for l in lines if b'"outcome"' in l and b'"call-a"' in l)
    assert index[("call-a", "rescued-1")] == index[("call-a", "assisted-fails")] == digest_text(outcome_a.decode())


def test_export_has_one_entry_per_case_and_explicit_coverage(clean_study):
    export = export_study(clean_study)
    assert export.schema_version == EXPORT_SCHEMA == "rescue-export/8"
    assert [e.case_id for e in export.cases] == [line["case_id"] for line in manifest_lines()]
    by_id = {e.case_id: e for e in export.cases}
    assert by_id["never-started"].state == "pending" and by_id["never-started"].label is None
    assert by_id["crashed"].state == "interrupted" and by_id["crashed"].assisted is None
    rescued = by_id["rescued-1"]
    assert (rescued.label, rescued.rule, rescued.in_m, rescued.in_e) == ("rescued", 9, True, True)
    assert rescued.query_step == Q and rescued.call_id == "call-a"
    assert rescued.assisted.subgoal == "Grasp the bowl by its rim."
    assert rescued.assisted.trace_rows == 176 // C
    assert rescued.control.assistance == "control"
    assert export.study.replan_interval == C and export.study.summary_stored
    main = export.coverage["main"]
    assert (main.n_manifest, main.n_pending, main.n_in_flight, main.n_summarized, main.complete) == (7, 1, 0, 6, False)
    assert export.coverage["pilot"].complete
    s = export.summary
    assert (s.n, s.r, s.e, s.m) == (6, 1, 3, 4)
    assert s.pilot_ids == ["pilot-1"] and s.pilot.r == 1
    assert export.usage.calls == 5 and export.usage.attempts == 5
    assert export.usage.tokens["input"].total is None  # the timed-out call reported none
    assert export.usage.tokens["input"].known_sum == 3600


def test_write_export_json_and_csv_match(clean_study, tmp_path):
    export = export_study(clean_study)
    out_json, out_csv = export_paths(clean_study)
    assert out_json.name == "export.json" and out_csv.name == "export.csv"
    out_json, out_csv = tmp_path / "export.json", tmp_path / "export.csv"
    write_export(export, out_json, out_csv)
    assert json.loads(out_json.read_text())["schema_version"] == "rescue-export/8"
    assert json.loads(out_json.read_text()) == export.model_dump(mode="json")
    with out_csv.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == csv_columns(export)
        rows = list(reader)
    assert rows == csv_rows(export)
    assert [r["case_id"] for r in rows] == [e.case_id for e in export.cases]
    rescued = next(r for r in rows if r["case_id"] == "rescued-1")
    assert rescued["label"] == "rescued" and rescued["assisted_success"] == "true"
    assert rescued["control_digest"] == export.cases[0].control.digest


def test_status_counts_states_labels_and_usage(clean_study):
    status = study_status(clean_study)
    assert status.states == {"pending": 1, "claimed": 0, "finished": 6, "interrupted": 1}
    assert status.labels["rescued"] == 1 and status.labels["unknown"] == 2
    assert status.pilot_labels["rescued"] == 1
    assert status.usage.calls == 5 and not status.draining
    text = render_status(status)
    assert "finished 6" in text and "rescued 1" in text and "vlm calls: 5" in text


# --- tampering with copies ----------------------------------------------------------


def edit_arm(study: Path, case_id: str, arm: str, change, *, rehash: bool) -> None:
    conn = sqlite3.connect(study / "journal.sqlite")
    (data,) = conn.execute("SELECT data FROM arms WHERE case_id = ? AND arm = ?", (case_id, arm)).fetchone()
    obj = json.loads(data)
    change(obj)
    new = json.dumps(obj)
    if rehash:
        conn.execute("UPDATE arms SET data = ?, digest = ? WHERE case_id = ? AND arm = ?",
                     (new, arm_digest(ArmResult.model_validate(obj)), case_id, arm))
    else:
        conn.execute("UPDATE arms SET data = ? WHERE case_id = ? AND arm = ?", (new, case_id, arm))
    conn.commit()
    conn.close()


def test_tampered_trace_row_is_caught_by_the_stored_digest(study_copy):
    def change(obj):
        row = next(r for r in obj["trace"] if r["step"] == Q + C)  # after q: the label cannot change
        row["actions"] = digest_text("other actions")

    edit_arm(study_copy, "assisted-fails", "assisted", change, rehash=False)
    report = verify_study(study_copy)
    assert not report.ok
    assert {p.check for p in report.problems} == {"arm_digest"}
    assert any("changed since it was recorded" in m for m in problems_for(report, "assisted-fails"))


def test_tampered_receipt_subgoal_is_caught(study_copy):
    path = study_copy / RECEIPTS_FILE
    text = path.read_text()
    assert text.count("Grasp the bowl by its rim.") == 1
    path.write_text(text.replace("Grasp the bowl by its rim.", "Grasp the bowl by its foot."))
    report = verify_study(study_copy)
    assert not report.ok
    messages = problems_for(report, "rescued-1")
    assert any("changed since it was indexed" in m for m in messages)
    # The recomputed verdict no longer finds evidence for the applied subgoal.
    assert any("differs from the recomputed unknown (rule 6" in m for m in messages)


def test_tampered_verdict_label_is_caught(study_copy):
    conn = sqlite3.connect(study_copy / "journal.sqlite")
    (data,) = conn.execute("SELECT data FROM verdicts WHERE case_id = 'assisted-fails'").fetchone()
    obj = json.loads(data)
    obj["label"] = "rescued"
    conn.execute("UPDATE verdicts SET data = ? WHERE case_id = 'assisted-fails'", (json.dumps(obj),))
    conn.commit()
    conn.close()
    report = verify_study(study_copy)
    assert not report.ok
    assert any("stored verdict rescued (rule 8) differs from the recomputed not_rescued" in m
               for m in problems_for(report, "assisted-fails"))


def test_rehashed_success_flag_is_caught_by_reclassification(study_copy):
    edit_arm(study_copy, "rescued-1", "control", lambda obj: obj.update(success=True), rehash=True)
    report = verify_study(study_copy)
    assert not report.ok
    assert "arm_digest" not in {p.check for p in report.problems}
    assert any("differs from the recomputed not_rescued (rule 7" in m for m in problems_for(report, "rescued-1"))


def test_tampered_summary_is_caught(study_copy):
    conn = sqlite3.connect(study_copy / "journal.sqlite")
    (value,) = conn.execute("SELECT value FROM meta WHERE key = ?", (SUMMARY_KEY,)).fetchone()
    summary = json.loads(value)
    summary["r"] += 1
    conn.execute("UPDATE meta SET value = ? WHERE key = ?", (json.dumps(summary), SUMMARY_KEY))
    conn.commit()
    conn.close()
    report = verify_study(study_copy)
    assert not report.ok
    assert [p.check for p in report.problems] == ["summary"]
    assert "r: stored 2, recomputed 1" in report.problems[0].message


def test_irregular_trace_is_caught_even_when_rehashed(study_copy):
    def drop_row(obj):
        obj["trace"] = [r for r in obj["trace"] if r["step"] != Q + 2 * C]

    edit_arm(study_copy, "assisted-fails", "assisted", drop_row, rehash=True)
    report = verify_study(study_copy)
    assert [p.check for p in report.problems] == ["trace"]
    assert report.problems[0].case_id == "assisted-fails"
    assert f"row 9 is at step {Q + 3 * C}, expected {Q + 2 * C}" in report.problems[0].message


def test_injection_onto_another_original_is_caught(study_copy):
    # Evidence only asks that the subgoal appear in a self-consistent applied
    # instruction; re-deriving the injection catches a different original.
    forged = inject("pick up the red mug", "Grasp the bowl by its rim.")

    def change(obj):
        a = obj["assistance"]
        a["instruction"], a["instruction_digest"] = forged, digest_text(forged)
        for row in obj["trace"]:
            if row["step"] >= Q:
                row["instruction"] = digest_text(forged)

    edit_arm(study_copy, "rescued-1", "assisted", change, rehash=True)
    report = verify_study(study_copy)
    assert not report.ok
    assert {p.check for p in report.problems} == {"injection"}
    assert any("not inject(original, subgoal)" in m for m in problems_for(report, "rescued-1"))


def test_missing_line_sha256_is_a_warning_not_a_pass_of_the_receipt(study_copy):
    conn = sqlite3.connect(study_copy / "journal.sqlite")
    conn.execute("UPDATE receipts SET line_sha256 = NULL WHERE call_id = 'call-b'")
    conn.commit()
    conn.close()
    report = verify_study(study_copy)
    assert report.ok
    assert [w.case_id for w in report.warnings] == ["control-wins"]


# --- evaluation studies (control arm only, episode labels) ---------------------------


def test_evaluation_study_verifies_and_exports_episode_rates(tmp_path):
    evaluation = pytest.importorskip("rescue.core.figures.evaluation")
    lines = [
        dict(case_id=f"ep-{i}", suite="libero_spatial", task_id=i % 2, init_state_index=i, env_seed=i, horizon=H)
        for i in range(3)
    ]
    manifest = parse_manifest("".join(json.dumps(l) + "\n" for l in lines).encode(), "manifest.jsonl")
    study = tmp_path / "eval"
    create_study(study, manifest, resolved_config(C, arms=("control",)))
    with Journal.open(study) as journal:
        for case_id, success in (("ep-0", True), ("ep-1", False)):
            journal.claim(case_id, "w")
            result = arm_result(case_id, "control", success=success, steps=96 if success else H)
            journal.finish_case(case_id, [result], evaluation.classify_episode(case_id, result, False))
    report = verify_study(study)
    assert report.ok, report.render()
    export = export_study(study)
    assert export.study.kind == "evaluation" and export.summary is None
    assert export.episodes.overall.success == 1 and export.episodes.overall.unexecuted == 1
    assert study_status(study).labels == {"success": 1, "failure": 1, "unknown": 0}

    edit_arm(study, "ep-1", "control", lambda obj: obj.update(success=True), rehash=True)
    report = verify_study(study)
    assert any("differs from the recomputed success" in m for m in problems_for(report, "ep-1"))


def test_two_outcome_lines_for_one_call_read_the_same_everywhere(study_copy):
    """The engine's index, the read model, usage and verify all take a call's FIRST outcome line."""
    from rescue.study.folder import outcome_receipts as read_model_outcomes
    from rescue.study.receipts import OutcomeIndex, read_receipt_file
    from rescue.study.usage import usage_summary

    path = study_copy / RECEIPTS_FILE
    first = next(l for l in read_receipt_file(path) if l.receipt and l.receipt.kind == "outcome" and l.receipt.call_id == "call-b")
    second = first.receipt.model_copy(update={
        "usage": Usage(input_tokens=5, output_tokens=5), "subgoals": {"req-control-wins": "Something else."},
    })
    with open(path, "ab") as f:
        f.write(second.model_dump_json().encode() + b"\n")

    engine = OutcomeIndex(path).outcome("call-b")
    assert (engine.lineno, engine.sha256) == (first.lineno, first.sha256)
    assert read_model_outcomes(path)["call-b"] == first.receipt
    calls = usage_summary(read_receipt_file(path))
    assert calls.tokens["input"].known_sum == sum(
        r.usage.input_tokens or 0 for r in read_model_outcomes(path).values()
    )  # the second line's 5 tokens are not counted
    exported = export_study(study_copy)
    assert exported.usage == calls
    report = verify_study(study_copy)
    assert not report.ok
    assert [p.check for p in report.problems] == ["receipt"]
    assert "2 outcome lines" in report.problems[0].message and report.problems[0].case_id == "control-wins"
    # The verdict recomputed from the first line is the stored one: no verdict problem.
    assert all(p.check != "verdict" for p in report.problems)


def test_export_names_the_deviation_of_every_deviating_case(clean_study):
    export = export_study(clean_study)
    deviating = [c for c in export.cases if c.label == "initial_state_deviation"]
    assert [c.case_id for c in deviating] == ["deviates"]
    assert "historical fingerprint" in deviating[0].deviation
    assert all(c.deviation is None for c in export.cases if c.label != "initial_state_deviation")


def test_a_forged_q_state_is_caught_even_with_its_digest_recomputed(study_copy):
    # The control arm recorded its simulator state at q; a forger gives the assisted arm
    # another one and re-hashes the record, so only the re-classification can tell.
    edit_arm(study_copy, "rescued-1", "control", lambda obj: obj.update(q_state=digest_text("state at q")), rehash=True)
    edit_arm(study_copy, "rescued-1", "assisted", lambda obj: obj.update(q_state=digest_text("state at q")), rehash=True)
    assert verify_study(study_copy).ok  # equal states at q: the verdict stands
    edit_arm(study_copy, "rescued-1", "assisted", lambda obj: obj.update(q_state=digest_text("another state")), rehash=True)
    report = verify_study(study_copy)
    messages = problems_for(report, "rescued-1")
    assert any("differs from the recomputed unknown (rule 5" in m and "states at q differ" in m for m in messages), messages


def test_a_follower_whose_first_render_differs_from_the_leaders_is_caught(study_copy):
    # A fork: the leader (control) rendered the state at q, the follower rendered it again after
    # restoring the leader's snapshot. Equal: the verdict stands; one camera differing: unknown (rule 5).
    render = {"agentview": digest_text("a"), "frontview": digest_text("f"), "robot0_eye_in_hand": digest_text("w")}
    for arm in ("control", "assisted"):
        edit_arm(study_copy, "rescued-1", arm,
                 lambda obj: obj.update(mode="fork", q_state=digest_text("state at q"), q_render=dict(render)), rehash=True)
    assert verify_study(study_copy).ok
    edit_arm(study_copy, "rescued-1", "assisted",
             lambda obj: obj.update(q_render={**render, "robot0_eye_in_hand": digest_text("markers")}), rehash=True)
    messages = problems_for(verify_study(study_copy), "rescued-1")
    assert any("recomputed unknown (rule 5" in m and "first render at q differs from the leader" in m for m in messages), messages


def test_an_arm_restored_after_its_vlm_wait_must_render_what_it_left_with(study_copy):
    render = {"agentview": digest_text("a"), "frontview": digest_text("f"), "robot0_eye_in_hand": digest_text("w")}
    edit_arm(study_copy, "rescued-1", "assisted", lambda obj: obj.update(q_render=dict(render),
                                                                        restored_render=dict(render)), rehash=True)
    assert verify_study(study_copy).ok
    edit_arm(study_copy, "rescued-1", "assisted",
             lambda obj: obj.update(restored_render={**render, "agentview": digest_text("other")}), rehash=True)
    messages = problems_for(verify_study(study_copy), "rescued-1")
    assert any("recomputed unknown (rule 5" in m and "restored simulator rendered other views" in m for m in messages), messages


def test_verify_accepts_an_assisted_arm_that_failed_right_after_its_subgoal_was_applied(study_copy):
    # A policy-server outage at q: the answer was applied, the query at q never returned.
    def outage(obj):
        obj["trace"] = [r for r in obj["trace"] if r["step"] < Q]
        obj.update(status="error", error="PolicyConnectionClosed: connection closed", success=None, steps=Q)

    edit_arm(study_copy, "assisted-fails", "assisted", outage, rehash=True)
    report = verify_study(study_copy)
    assert all("was not queried with" not in p.message for p in report.problems), report.render()
    # What does disagree is the stored verdict (the engine would have said unknown): nothing else.
    assert {p.check for p in report.problems} <= {"verdict", "summary", "invariant"}


def test_the_terminal_summary_of_a_drained_study_keeps_the_manifests_n(tmp_path):
    from rich.console import Console

    from rescue.read.terminal import render_summary

    data = "".join(json.dumps(line) + "\n" for line in manifest_lines()).encode()
    manifest = parse_manifest(data, "manifest.jsonl", catalog=None)
    study = tmp_path / "drained"
    create_study(study, manifest, resolved_config(C))
    with Journal.open(study) as journal:
        first = manifest.cases[0].case_id
        assert journal.claim(first, "w")
        journal.finish_case(first, [arm_result(first, "control", success=False, steps=H)],
                            Verdict(case_id=first, label="unknown", rule=2, reason="assisted arm missing"))
    console = Console(record=True, width=200)
    console.print(render_summary(export_study(study)))
    text = console.export_text()
    n = len([c for c in manifest.cases if not c.pilot])
    assert "cases (N, fixed)" in text and f"│ {n} " in text.replace("  ", " ")
    assert "never started" in text and "of which have a verdict" in text
