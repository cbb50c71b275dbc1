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

import pytest
from conftest import resolved_config
from helpers.study_builder import C, H, Q, applied, arm_result, build_study, manifest_lines, receipt, trace

from rescue.core.classify import classify
from rescue.core.digest import digest_text
from rescue.core.manifest import parse_manifest
from rescue.core.records import ArmResult, Usage
from rescue.core.verdicts import Verdict
from rescue.read.export import (
    csv_columns,
    EXPORT_SCHEMA,
    csv_rows,
    export_paths,
    export_study,
    write_export,
)
from rescue.read.status import render_status, study_status
from rescue.read.verify import verify_study
from rescue.study.folder import create_study, outcome_receipts
from rescue.study.journal import SUMMARY_KEY, Journal, arm_digest
from rescue.study.layout import RECEIPTS as RECEIPTS_FILE
from wrappers.injection import inject

pytestmark = pytest.mark.fast


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
