"""The whole path on real LIBERO: a study run by the CLI, killed with SIGKILL, resumed, exported, verified."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, cli_env, rescue_cli, write_cases
from rescue.digest import digest_text
from rescue.querypoint import query_point
from wrappers.injection import inject


def _export(study: Path) -> dict:
    rescue_cli("export", str(study))
    return json.loads((study / "export.json").read_text())


def _states(study: Path) -> dict[str, str]:
    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        return dict(con.execute("SELECT case_id, state FROM cases"))
    finally:
        con.close()


def _arms(study: Path) -> dict[tuple[str, str], str]:
    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        return {(c, a): d for c, a, d in con.execute("SELECT case_id, arm, data FROM arms")}
    finally:
        con.close()


def test_study_runs_both_arms_with_matching_prefix_and_verifies(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 2)
    study = tmp_path / "study"
    rescue_cli("run", str(manifest), "--study", str(study))
    export = _export(study)
    assert [c["case_id"] for c in export["cases"]] == ["object-3-ep0", "object-3-ep1"]
    arms = _arms(study)
    for case in export["cases"]:
        assert case["label"] in {"rescued", "not_rescued", "unknown", "initial_state_deviation"}
        control = json.loads(arms[(case["case_id"], "control")])
        assisted = json.loads(arms[(case["case_id"], "assisted")])
        q = query_point(64, 8)
        assert control["fingerprint"] == assisted["fingerprint"]
        pre_c = [r for r in control["trace"] if r["step"] < q]
        pre_a = [r for r in assisted["trace"] if r["step"] < q]
        assert pre_c and pre_c == pre_a
        help_ = assisted["assistance"]
        assert help_["status"] == "applied" and help_["query_step"] == q
        # DESIGN §2: the applied instruction is exactly the injection of the subgoal.
        row_q = next(r for r in assisted["trace"] if r["step"] == q)
        task_instruction = "pick up the bbq sauce and place it in the basket"
        assert "bbq sauce" in help_["subgoal"]
        assert help_["instruction"] == inject(task_instruction, help_["subgoal"])
        assert row_q["instruction"] == digest_text(help_["instruction"])
        assert pre_a[-1]["instruction"] == digest_text(task_instruction)
    receipts = (study / "receipts" / "receipts.jsonl").read_text().splitlines()
    outcomes = [json.loads(line) for line in receipts if json.loads(line)["kind"] == "outcome"]
    assert sorted(o["case_ids"][0] for o in outcomes) == ["object-3-ep0", "object-3-ep1"]
    assert rescue_cli("verify", str(study)).returncode == 0


def test_sigkill_mid_study_then_resume_never_reruns_a_started_case(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 5)
    study = tmp_path / "study"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study), "--cases-in-flight", "1"],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            if (study / "journal.sqlite").exists():
                states = _states(study)
                if list(states.values()).count("finished") >= 1 and "claimed" in states.values():
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the study never reached a finished and an in-flight case")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before_states = _states(study)
    before_arms = _arms(study)
    finished = {c for c, s in before_states.items() if s == "finished"}
    in_flight = {c for c, s in before_states.items() if s == "claimed"}
    never = {c for c, s in before_states.items() if s == "pending"}
    assert finished and in_flight

    out = rescue_cli("resume", str(study))
    assert "interrupted" in out.stdout
    after_arms = _arms(study)
    export = _export(study)
    by_id = {c["case_id"]: c for c in export["cases"]}
    assert len(by_id) == 5
    for case_id in finished:
        # A finished case keeps its first result: the same arm records, byte for byte.
        assert by_id[case_id]["state"] == "finished"
        for arm in ("control", "assisted"):
            assert after_arms[(case_id, arm)] == before_arms[(case_id, arm)]
    for case_id in in_flight:
        assert by_id[case_id]["state"] == "interrupted"
        assert by_id[case_id]["label"] == "unknown"
        assert "interrupted" in by_id[case_id]["reason"]
        # Nothing of the interrupted case ran again after the kill.
        for arm in ("control", "assisted"):
            assert after_arms.get((case_id, arm)) == before_arms.get((case_id, arm))
    for case_id in never:
        assert by_id[case_id]["state"] == "finished"
    assert export["summary"]["n"] == 5
    assert rescue_cli("verify", str(study)).returncode == 0
