"""Baseline evaluation on real LIBERO through the CLI: records, export, failure manifest, rescue run, kill and resume."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import SCRIPTED_ARGS, kill_mid_study, rescue_cli

from rescue.core.manifest import load_manifest
from rescue.core.records import ArmResult
from rescue.read.export import EPISODE_COLUMNS
from rescue.study.journal import Journal, arm_digest

pytestmark = [pytest.mark.sim, pytest.mark.e2e]


def _export(study: Path) -> dict:
    # --partial: this file also exports studies a kill left unfinished (without it: exit 5, nothing written)
    rescue_cli("export", str(study), "--partial")
    return json.loads((study / "export.json").read_text())


def _journal(study: Path) -> tuple[dict, dict[str, str], dict[tuple[str, str], tuple[str, str]]]:
    """Meta, case states, and every stored arm record as (raw JSON, stored digest)."""
    with Journal.open(study, readonly=True) as journal:
        states = {row.case_id: row.state for row in journal.rows()}
        arms = {(row.case_id, row.arm): (row.data, row.digest) for row in journal.arm_rows()}
        return journal.meta(), states, arms


def test_eval_records_episodes_then_its_failure_manifest_runs_unedited(tmp_path):
    study = tmp_path / "eval"
    # H=48 is far too short to finish a pick-and-place: every episode fails, on purpose.
    out = rescue_cli("eval", "--suite", "libero_object", "--tasks", "3,4", "--episodes", "2", "--horizon", "48", "--study", str(study))
    for column in ("unknown", "unexecuted", "per group", "object/3", "object/4", "overall"):
        assert column in out.stdout

    meta, states, arms = _journal(study)
    assert meta["kind"] == "evaluation" and set(states.values()) == {"finished"}
    export = _export(study)
    rows = {row["case_id"]: row for row in export["episode_rows"]}
    assert list(rows) == ["object-3-ep0", "object-3-ep1", "object-4-ep0", "object-4-ep1"]
    for case_id, row in rows.items():
        data, stored = arms[(case_id, "control")]
        arm = ArmResult.model_validate_json(data)
        # The result sha256 is the digest stored with the record, and it re-derives from the record.
        assert row["result_sha256"] == stored == arm_digest(arm)
        assert row["fingerprint"] == arm.fingerprint and len(row["fingerprint"]) == 64
        assert row["trace_rows"] == len(arm.trace) > 0 and arm.trace[0].step == 0
        assert row["label"] == "failure" and row["success"] is False and row["steps"] == 48
        assert row["env_seed"] == row["init_state_index"]
    assert export["episodes"]["overall"] == {"n": 4, "success": 0, "failure": 4, "unknown": 0, "unexecuted": 0, "rate": 0.0}
    with open(study / "export.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == EPISODE_COLUMNS
        assert {r["case_id"]: r["result_sha256"] for r in reader} == {k: r["result_sha256"] for k, r in rows.items()}

    manifest_path = tmp_path / "failures.jsonl"
    out = rescue_cli("manifest", "from-eval", str(study), "--out", str(manifest_path), "--pilot-tasks", "1")
    assert "pilot: object-3-ep0" in " ".join(out.stdout.split())
    manifest = load_manifest(manifest_path)
    assert [c.case_id for c in manifest.cases] == list(rows)
    # The pilot rule: the first failure of each of the first K=1 tasks, declared in the manifest.
    assert [c.case_id for c in manifest.cases if c.pilot] == ["object-3-ep0"]
    for case in manifest.cases:
        assert case.fingerprint == rows[case.case_id]["fingerprint"]
        assert case.tags == {
            "eval_study": meta["study_id"],
            "eval_config_sha256": meta["config_sha256"],
            "eval_manifest_sha256": meta["manifest_sha256"],
            "eval_created": meta["created_at"],  # the evaluation's date, as the report names it
            "episode_protocol": "rescue",  # the embedded policy's protocol; a study must replay them under it
            # Where the failures came from (rescue.core.figures.baseline): the policy, its success, what it ran.
            "eval_policy": "rescue.embedded.vision_language:make_policy",
            "eval_episodes": 4, "eval_successes": 0, "eval_failures": 4,
            "eval_suites": "libero_object", "eval_tasks": "3-4", "eval_inits": "0-1",
        }
        assert (case.horizon, case.suite, case.group) == (48, "libero_object", "object")
    # A held-out split: only the failures of the initial states named.
    split = tmp_path / "split.jsonl"
    out = rescue_cli("manifest", "from-eval", str(study), "--out", str(split), "--inits", "1-1")
    assert [c.case_id for c in load_manifest(split).cases] == ["object-3-ep1", "object-4-ep1"]
    bad = rescue_cli("manifest", "from-eval", str(study), "--out", str(tmp_path / "x.jsonl"), "--inits", "a-b", check=False)
    assert bad.returncode == 2 and "--inits 'a-b'" in bad.stderr and not (tmp_path / "x.jsonl").exists()

    rescue = tmp_path / "rescue"
    rescue_cli("run", str(manifest_path), "--study", str(rescue))
    result = _export(rescue)
    assert result["study"]["kind"] == "rescue"
    assert result["study"]["manifest_sha256"] == manifest.sha256
    summary = result["summary"]
    assert summary["n"] == 3 and summary["pilot_ids"] == ["object-3-ep0"] and summary["pilot"]["n"] == 1
    # The replay starts from the evaluation's initial states: no case deviates from its fingerprint.
    assert summary["counts"]["initial_state_deviation"] == 0
    for case in result["cases"]:
        assert case["arms"]["control"]["fingerprint"] == rows[case["case_id"]]["fingerprint"]
        assert case["arms"]["assisted"]["fingerprint"] == rows[case["case_id"]]["fingerprint"]
    assert rescue_cli("verify", str(rescue)).returncode == 0


def test_sigkill_mid_eval_then_resume_reports_interrupted_episodes_as_unknown(tmp_path):
    study = tmp_path / "eval"
    # The subject is the journal across a kill, not what a policy sees: the scripted policy renders no camera.
    kill_mid_study(
        ["eval", "--suite", "libero_object", "--tasks", "3", "--episodes", "5", "--horizon", "64",
         "--study", str(study), "--cases-in-flight", "1", *SCRIPTED_ARGS],
        study,
    )
    _, before_states, before_arms = _journal(study)
    finished = {c for c, s in before_states.items() if s == "finished"}
    in_flight = {c for c, s in before_states.items() if s == "claimed"}
    never = {c for c, s in before_states.items() if s == "pending"}
    assert finished and in_flight and len(finished | in_flight | never) == 5

    # Before the resume, the episodes without a result show as unexecuted, none as a failure.
    partial = _export(study)["episodes"]["overall"]
    assert partial["unexecuted"] == len(in_flight | never) and partial["unknown"] == 0
    assert partial["success"] + partial["failure"] == len(finished)

    out = rescue_cli("resume", str(study))
    said = " ".join(out.stdout.split())
    assert "recorded as unknown (interrupted)" in said
    for case_id in in_flight:
        assert case_id in said
    _, after_states, after_arms = _journal(study)
    export = _export(study)
    rows = {row["case_id"]: row for row in export["episode_rows"]}
    for case_id in finished:
        # A finished episode keeps its first result, byte for byte.
        assert after_states[case_id] == "finished"
        assert after_arms[(case_id, "control")] == before_arms[(case_id, "control")]
    for case_id in in_flight:
        # Interrupted: unknown, not a failure, and not run again.
        assert after_states[case_id] == "interrupted"
        assert rows[case_id]["label"] == "unknown" and "interrupted" in rows[case_id]["reason"]
        assert (case_id, "control") not in after_arms or after_arms[(case_id, "control")] == before_arms.get((case_id, "control"))
        assert rows[case_id]["result_sha256"] == (before_arms.get((case_id, "control")) or (None, None))[1]
    for case_id in never:
        assert after_states[case_id] == "finished" and rows[case_id]["label"] in ("success", "failure")
        assert rows[case_id]["result_sha256"] == after_arms[(case_id, "control")][1]
    overall = export["episodes"]["overall"]
    assert overall["n"] == 5 and overall["unexecuted"] == 0
    assert overall["unknown"] == len(in_flight)
    assert overall["success"] + overall["failure"] == len(finished) + len(never)
    assert rescue_cli("verify", str(study)).returncode == 0
