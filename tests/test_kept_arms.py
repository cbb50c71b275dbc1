"""Work done survives a kill (DESIGN §4): each arm is recorded the moment it ends, so a SIGKILL of the whole run
keeps every arm that had ended; resume keeps them byte for byte beside the interrupted case's verdict, and the
study verifies and exports them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, arm_rows, case_states, cli_env, ensure_stopped, export_of, free_port, rescue_cli, write_cases

pytestmark = [pytest.mark.sim, pytest.mark.e2e]


def _serve_slow_vlm(port: int) -> subprocess.Popen:
    # Every answer takes 8 s: the control arm ends long before the assisted arm's subgoal arrives.
    return subprocess.Popen([sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", str(port), "--latency", "8"],
                            cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def test_arms_that_ended_before_a_kill_are_kept_and_their_case_is_interrupted(tmp_path):
    port = free_port()
    vlm = _serve_slow_vlm(port)
    manifest = write_cases(tmp_path / "m.jsonl", 3, horizon=48)
    config = tmp_path / "study.toml"
    config.write_text(f'fork_at_q = true\n\n[vlm]\nbase_url = "http://127.0.0.1:{port}/v1"\nstartup_check = "none"\n')
    study = tmp_path / "study"
    run = subprocess.Popen([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study), "--config",
                            str(config), "--cases-in-flight", "2"], cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # Hangs are what is bounded here, not speed: the VLM waits 8 s per answer.
        deadline = time.monotonic() + 900
        while True:
            assert time.monotonic() < deadline and run.poll() is None, "no claimed case ever held an ended arm"
            if (study / "journal.sqlite").exists():
                states, rows = case_states(study), arm_rows(study)
                if any(states.get(case_id) == "claimed" for case_id, _ in rows):
                    break
            time.sleep(0.1)
        os.killpg(run.pid, signal.SIGKILL)  # the run and all it started, as a crash of the machine would
        run.wait()
    finally:
        ensure_stopped(run)
    try:
        before, states = arm_rows(study), case_states(study)
        kept = {(c, a) for c, a in before if states[c] == "claimed"}
        assert kept and all(a == "control" for _, a in kept)  # the assisted arms were still waiting for the VLM
        rescue_cli("resume", str(study), timeout=1800)
    finally:
        ensure_stopped(vlm)
    after = arm_rows(study)
    assert all(after[k] == v for k, v in before.items())  # nothing that ended ran again, nothing was lost
    assert rescue_cli("verify", str(study)).returncode == 0
    cases = {c["case_id"]: c for c in export_of(study)["cases"]}
    for case_id, arm in kept:
        case = cases[case_id]
        assert case["state"] == "interrupted" and case["label"] == "unknown" and "interrupted" in case["reason"]
        assert case["arms"][arm]["digest"] and json.loads(before[(case_id, arm)])["status"] == "complete"
