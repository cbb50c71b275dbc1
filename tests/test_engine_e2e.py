"""The whole path on real LIBERO: a study run by the CLI, killed with SIGKILL, resumed, exported, verified."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    SCRIPTED_ARGS,
    arm_rows,
    assert_resumed_without_rerun,
    case_states,
    cli_env,
    export_of,
    kill_mid_study,
    rescue_cli,
    states_before_resume,
    write_cases,
)

from rescue.core.digest import digest_text
from rescue.core.querypoint import query_point
from wrappers.injection import inject

pytestmark = [pytest.mark.sim, pytest.mark.e2e]


_export = export_of
_states = case_states


_arms = arm_rows


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
    kill_mid_study(["run", str(manifest), "--study", str(study), "--cases-in-flight", "1", *SCRIPTED_ARGS], study)
    before_arms, finished, in_flight, never = states_before_resume(study)
    assert finished and in_flight

    out = rescue_cli("resume", str(study))
    assert "interrupted" in out.stdout
    after_arms = _arms(study)
    export = _export(study)
    by_id = {c["case_id"]: c for c in export["cases"]}
    assert len(by_id) == 5
    assert_resumed_without_rerun(by_id, before_arms, after_arms, finished, in_flight, never)
    assert export["summary"]["n"] == 5
    assert rescue_cli("verify", str(study)).returncode == 0


def _tampered(study: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(study, dest)
    return dest


@pytest.fixture(scope="module")
def one_case_study(tmp_path_factory) -> Path:
    """A real study of one case (horizon 48) that records keyframes, run once for the module; a test that
    changes it works on a copy."""
    tmp = tmp_path_factory.mktemp("one-case")
    manifest = write_cases(tmp / "m.jsonl", 1, horizon=48)
    (tmp / "k.toml").write_text("keyframes = true\n")
    study = tmp / "study"
    rescue_cli("run", str(manifest), "--study", str(study), "--config", str(tmp / "k.toml"))
    return study


def test_verify_fails_on_each_tampered_copy_of_a_real_study(tmp_path, one_case_study):
    study = one_case_study
    assert rescue_cli("verify", str(study)).returncode == 0

    # A trace row after q (the label does not depend on it): caught by the arm record digest.
    trace_copy = _tampered(study, tmp_path / "trace")
    con = sqlite3.connect(trace_copy / "journal.sqlite")
    data = json.loads(con.execute("SELECT data FROM arms WHERE arm='control'").fetchone()[0])
    data["trace"][-1]["actions"] = "0" * 64
    con.execute("UPDATE arms SET data=? WHERE arm='control'", (json.dumps(data),))
    con.commit()
    con.close()

    # A receipt's subgoal: caught by the receipt line digest and the evidence check.
    receipt_copy = _tampered(study, tmp_path / "receipt")
    path = receipt_copy / "receipts" / "receipts.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for line in lines:
        line["subgoals"] = {k: "open the drawer" for k in line["subgoals"]}
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))

    # A result: the stored verdict's label.
    result_copy = _tampered(study, tmp_path / "result")
    con = sqlite3.connect(result_copy / "journal.sqlite")
    verdict = json.loads(con.execute("SELECT data FROM verdicts").fetchone()[0])
    verdict["label"] = "rescued" if verdict["label"] != "rescued" else "not_rescued"
    con.execute("UPDATE verdicts SET data=?", (json.dumps(verdict),))
    con.commit()
    con.close()

    for copy in (trace_copy, receipt_copy, result_copy):
        out = rescue_cli("verify", str(copy), check=False)
        assert out.returncode != 0, copy.name
        assert "object-3-ep0" in out.stdout, out.stdout

    from rescue.study.journal import stored_arm_digest

    # The same trace row edited with the record's digest recomputed: the rows' chain breaks there.
    rehashed = _tampered(study, tmp_path / "rehashed")
    con = sqlite3.connect(rehashed / "journal.sqlite")
    data = json.loads(con.execute("SELECT data FROM arms WHERE arm='control'").fetchone()[0])
    data["trace"][-1]["actions"] = "0" * 64
    text = json.dumps(data)
    con.execute("UPDATE arms SET data=?, digest=? WHERE arm='control'", (text, stored_arm_digest(text)))
    con.commit()
    con.close()
    # Half a JSON line appended to the receipts: evidence parses to the last byte.
    torn = _tampered(study, tmp_path / "torn")
    with open(torn / "receipts" / "receipts.jsonl", "a") as f:
        f.write('{"kind": "outcome", "call_id": "x')
    # A file in vlm/ that no receipt names.
    stray = _tampered(study, tmp_path / "stray")
    (stray / "vlm" / ("0" * 64 + ".png")).write_bytes(b"not sent")
    expected = {rehashed: f"control trace row {len(data['trace']) - 1}", torn: "does not parse",
                stray: "is not named by any receipt line"}
    for copy, says in expected.items():
        out = rescue_cli("verify", str(copy), check=False)
        assert out.returncode == 1 and says in out.stdout, out.stdout
    assert "logs (not evidence, not checked): events.jsonl" in rescue_cli("verify", str(study)).stdout


def test_sigterm_drains_then_resume_runs_the_rest(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 4, horizon=48)
    study = tmp_path / "study"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study), "--cases-in-flight", "1", *SCRIPTED_ARGS],
        cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        if (study / "journal.sqlite").exists() and "claimed" in _states(study).values():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 3  # stopped with cases never run: not a finished study
    states = _states(study)
    # The case in flight finished; nothing new was claimed after the signal.
    assert "claimed" not in states.values()
    assert list(states.values()).count("finished") >= 1 and "pending" in states.values()
    rescue_cli("resume", str(study))
    assert set(_states(study).values()) == {"finished"}
    assert rescue_cli("verify", str(study)).returncode == 0


def test_report_shows_keyframes_subgoal_and_verdict(tmp_path, one_case_study):
    import hashlib

    study = Path(shutil.copytree(one_case_study, tmp_path / "study"))  # the report writes into the study folder
    rescue_cli("report", str(study))
    from rescue.read.html.app import read_panel_script

    # The page lists the cases; each case's panel is a file of its own, loaded when it is shown.
    assert "object-3-ep0" in (study / "report_files" / "cases.js").read_text()
    page = read_panel_script((study / "report_files" / "case" / "object-3-ep0.js").read_text())[1]
    arms = _arms(study)
    assisted = json.loads(arms[("object-3-ep0", "assisted")])
    assert "object-3-ep0" in page and assisted["assistance"]["subgoal"] in page
    for arm in ("control", "assisted"):
        frames = json.loads(arms[("object-3-ep0", arm)])["keyframes"]
        assert set(frames) == {"q24", "end"}
        for name, sha in frames.items():
            png = study / "frames" / "object-3-ep0" / f"{arm}-{name}.png"
            assert hashlib.sha256(png.read_bytes()).hexdigest() == sha
            assert sha in page  # the report carries the very image the arm recorded (named by its sha256)
    assert rescue_cli("verify", str(study)).returncode == 0
    # A swapped keyframe is caught: the report shows only what the arm recorded.
    copy = _tampered(study, tmp_path / "frames-copy")
    (copy / "frames" / "object-3-ep0" / "control-end.png").write_bytes(
        (copy / "frames" / "object-3-ep0" / "assisted-end.png").read_bytes()
    )
    out = rescue_cli("verify", str(copy), check=False)
    assert out.returncode != 0 and "keyframe end" in out.stdout


def test_continue_from_runs_only_the_never_claimed_complement(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 4, horizon=48)
    old, new = tmp_path / "old", tmp_path / "new"
    kill_mid_study(["run", str(manifest), "--study", str(old), "--cases-in-flight", "1", *SCRIPTED_ARGS], old)
    claimed_before = {c for c, s in _states(old).items() if s != "pending"}

    out = rescue_cli("run", "--continue-from", str(old), str(new))
    assert "prior part" in out.stdout and "continuation" in out.stdout
    old_states, new_states = _states(old), _states(new)
    # Partition by claim: the new study holds exactly the cases the old one never started.
    assert set(new_states) == set(old_states) - claimed_before
    assert set(new_states.values()) == {"finished"}
    assert "pending" not in old_states.values() or set(old_states) - claimed_before == set(new_states)
    assert {s for c, s in old_states.items() if c in claimed_before} <= {"finished", "interrupted"}
    # The prior study is closed to dispatch: resuming it is refused.
    refused = rescue_cli("resume", str(old), check=False)
    assert refused.returncode != 0 and "continued by" in refused.stderr
    assert rescue_cli("verify", str(new)).returncode == 0
