"""A terminal's Ctrl-C: the whole foreground process group gets SIGINT.

Each command starts the way an interactive shell starts a foreground job: a process group of
its own and SIGINT at its default disposition (checked, since a harness that ignores SIGINT
would pass it on to its children, and they would survive on broken code). The signal goes to
the whole group with `os.killpg`, so the simulators get it too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SCRIPTED_ARGS, arms_started, case_states, cli_env, ensure_stopped, rescue_cli, wait_until, write_cases
from helpers.foreground import claimed, ctrl_c, ctrl_c_mid_arm, group_members, start_foreground

pytestmark = [pytest.mark.sim, pytest.mark.e2e]


def _partial_export(study: Path, out: Path) -> dict:
    rescue_cli("export", str(study), "--partial", "--out", str(out))
    return json.loads(out.read_text())


def _row_reason(study: Path, case_id: str) -> str:
    import sqlite3

    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True)
    try:
        return con.execute("SELECT reason FROM cases WHERE case_id = ?", (case_id,)).fetchone()[0]
    finally:
        con.close()


def vlm_call_in_flight(study: Path) -> bool:
    """An assisted arm waits for the VLM: an attempt started whose call has no outcome yet."""
    path = study / "receipts" / "receipts.jsonl"
    if not path.exists():
        return False
    lines = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    started = {l["call_id"] for l in lines if l["kind"] == "attempt_started"}
    return bool(started - {l["call_id"] for l in lines if l["kind"] == "outcome"})


@pytest.fixture
def slow_vlm():
    """The local endpoint answering after 8 s: long enough to press Ctrl-C twice during the wait."""
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", "0", "--latency", "8"],
                            cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield re.search(r"(http://\S+/v1)", proc.stdout.readline()).group(1)
    finally:
        ensure_stopped(proc)


def test_ctrl_c_mid_arm_lets_the_arms_in_flight_finish_then_resume_runs_the_rest(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 4, horizon=64)
    study = tmp_path / "study"
    proc = start_foreground("run", str(manifest), "--study", str(study), "--cases-in-flight", "1")

    def grouped() -> None:
        assert len(group_members(proc.pid)) >= 3  # the command and its two simulators share the group

    in_flight = ctrl_c_mid_arm(proc, study, grouped)
    states = case_states(study)
    assert [states[c] for c in in_flight] == ["finished"]  # its arms finished: nothing was lost
    assert "pending" in states.values() and "claimed" not in states.values()
    partial = _partial_export(study, tmp_path / "e.json")
    case = next(c for c in partial["cases"] if c["case_id"] == in_flight[0])
    assert case["label"] in ("rescued", "not_rescued"), json.dumps(case)[:3000]  # what the case held, if not a verdict
    assert case["arms"]["control"]["status"] == case["arms"]["assisted"]["status"] == "complete"
    rescue_cli("resume", str(study))
    assert set(case_states(study).values()) == {"finished"}
    assert rescue_cli("verify", str(study)).returncode == 0


def test_a_second_ctrl_c_during_the_vlm_wait_stops_now_and_says_so(tmp_path, slow_vlm):
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=64)
    study = tmp_path / "study"
    # Its subject is the VLM wait, not what a policy sees: the scripted policy reads the simulator's state, no camera.
    proc = start_foreground("run", str(manifest), "--study", str(study), "--cases-in-flight", "1", "--vlm-url", slow_vlm,
                            *SCRIPTED_ARGS)
    try:
        wait_until(lambda: vlm_call_in_flight(study), "an assisted arm waiting for the VLM", proc=proc)
        in_flight = [c for c, s in case_states(study).items() if s == "claimed"]
        ctrl_c(proc)
        time.sleep(1.0)
        ctrl_c(proc)
        out, err = proc.communicate(timeout=120)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 3, err
    said = out + err
    assert "stopping the arms in flight now" in said and "recorded unknown (interrupted)" in said
    assert "arms in flight finished" not in said
    states = case_states(study)
    assert [states[c] for c in in_flight] == ["interrupted"]
    partial = _partial_export(study, tmp_path / "e.json")
    case = next(c for c in partial["cases"] if c["case_id"] == in_flight[0])
    assert case["label"] == "unknown" and case["reason"] == "case interrupted"
    assert "second SIGINT" in _row_reason(study, in_flight[0])
    # Resume never runs it again; the never-started cases run.
    rescue_cli("resume", str(study))
    after = case_states(study)
    assert after[in_flight[0]] == "interrupted" and set(after.values()) <= {"finished", "interrupted"}
    assert rescue_cli("verify", str(study)).returncode == 0


def test_ctrl_c_mid_episode_of_an_evaluation_finishes_the_episode(tmp_path):
    study = tmp_path / "eval"
    proc = start_foreground("eval", "--suite", "libero_object", "--tasks", "3", "--episodes", "4", "--horizon", "64",
                            "--study", str(study), "--cases-in-flight", "1")
    try:
        wait_until(lambda: claimed(study), "an episode in flight", proc=proc)
        in_flight = [c for c, s in case_states(study).items() if s == "claimed"]
        wait_until(lambda: arms_started(study, in_flight[0], ("control",)), "the episode started", proc=proc)
        ctrl_c(proc)
        out, err = proc.communicate(timeout=300)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 3, err
    assert [case_states(study)[c] for c in in_flight] == ["finished"]


def test_ctrl_c_during_a_resume_lets_its_arms_finish(tmp_path):
    from conftest import kill_mid_study

    manifest = write_cases(tmp_path / "m.jsonl", 5, horizon=64)
    study = tmp_path / "study"
    kill_mid_study(["run", str(manifest), "--study", str(study), "--cases-in-flight", "1"], study)
    before = case_states(study)
    proc = start_foreground("resume", str(study))
    try:
        wait_until(lambda: [c for c, s in case_states(study).items() if s == "claimed" and before[c] == "pending"],
                   "a never-started case in flight")
        in_flight = [c for c, s in case_states(study).items() if s == "claimed"]
        wait_until(lambda: arms_started(study, in_flight[0]), "both arms of the case in flight started", proc=proc)
        ctrl_c(proc)
        out, err = proc.communicate(timeout=300)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 3, err
    after = case_states(study)
    assert [after[c] for c in in_flight] == ["finished"]
    for case_id, state in before.items():
        if state == "claimed":
            assert after[case_id] == "interrupted"  # the kill's case, settled by the resume


def test_ctrl_c_on_the_service_drains_its_job_and_a_restart_resumes_it(tmp_path):
    queue = tmp_path / "queue"
    manifest = write_cases(tmp_path / "m.jsonl", 4, horizon=64)
    # The subject is the worker's drain, not what a policy sees: the scripted policy reads the simulator's state.
    rescue_cli("submit", str(manifest), "--queue", str(queue), "--cases-in-flight", "1", "--simulators", "1",
               "--policy", "scripted")
    (job,) = list((queue / "jobs").iterdir())
    study = job / ("study-" + job.name.removeprefix("job-"))
    proc = start_foreground("serve", "--queue", str(queue), "--port", "0")
    try:
        wait_until(lambda: claimed(study), "the job's first case in flight", proc=proc)
        in_flight = [c for c, s in case_states(study).items() if s == "claimed"]
        wait_until(lambda: arms_started(study, in_flight[0]), "both arms of the case in flight started", proc=proc)
        ctrl_c(proc)
        out, err = proc.communicate(timeout=300)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 0, err
    states = case_states(study)
    assert [states[c] for c in in_flight] == ["finished"]
    assert "pending" in states.values()
    assert json.loads((job / "state.json").read_text())["state"] == "queued"  # resumed at the next start
    again = start_foreground("serve", "--queue", str(queue), "--port", "0")
    try:
        wait_until(lambda: json.loads((job / "state.json").read_text())["state"] == "finished", "the job finished")
    finally:
        os.killpg(again.pid, signal.SIGTERM)
        again.communicate(timeout=120)
        ensure_stopped(again)
    assert set(case_states(study).values()) == {"finished"}
    assert rescue_cli("verify", str(study)).returncode == 0
