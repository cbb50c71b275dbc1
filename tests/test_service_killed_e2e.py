"""A job's child killed by the kernel is recorded on the job, and its claimed case becomes `unknown` saying so.

A real `rescue serve` runs a real job; once the job's child has claimed a case it gets a real SIGKILL (what the
kernel's OOM killer sends). The job ends `stopped` with `killed_by` naming the signal, and the case it held is
`interrupted` (its verdict unknown) with that reason; the job is not left `running` nor its case `claimed`.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from conftest import HANG_S, ROOT, cli_env, ensure_stopped, free_port, rescue_cli, write_cases

pytestmark = pytest.mark.e2e


def test_a_job_child_killed_by_sigkill_is_recorded_and_its_claimed_case_becomes_unknown(tmp_path):
    queue = tmp_path / "queue"
    manifest = write_cases(tmp_path / "a.jsonl", 2, horizon=48)
    out = rescue_cli("submit", str(manifest), "--queue", str(queue), "--simulators", "1", "--cases-in-flight", "1")
    job_id = out.stdout.split()[1]
    job = queue / "jobs" / job_id
    study = job / f"study-{job_id.removeprefix('job-')}"
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", "serve", "--queue", str(queue), "--port",
                             str(free_port())], cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + HANG_S
        claimed = None
        while time.time() < deadline and claimed is None:
            assert proc.poll() is None
            if (study / "journal.sqlite").is_file():
                con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True, timeout=30)
                try:
                    claimed = con.execute("SELECT case_id FROM cases WHERE state = 'claimed'").fetchone()
                except sqlite3.OperationalError:
                    claimed = None
                finally:
                    con.close()
            time.sleep(0.1)
        assert claimed is not None, "the job never claimed a case"
        child = json.loads((job / "state.json").read_text())["pid"]
        os.kill(child, signal.SIGKILL)
        while time.time() < deadline:
            state = json.loads((job / "state.json").read_text())
            if state["state"] != "running":
                break
            time.sleep(0.2)
    finally:
        ensure_stopped(proc)
    assert state["state"] == "stopped" and state["exit_code"] == -signal.SIGKILL, state
    assert state["killed_by"] == "SIGKILL", state
    assert "killed by SIGKILL" in state["message"] and "1 claimed case(s) recorded as unknown" in state["message"]
    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        rows = dict(con.execute("SELECT case_id, state FROM cases"))
        reason = con.execute("SELECT reason FROM cases WHERE case_id = ?", (claimed[0],)).fetchone()[0]
    finally:
        con.close()
    assert rows[claimed[0]] == "interrupted" and "claimed" not in rows.values(), rows
    assert reason == "interrupted: the job's process was killed by SIGKILL"
