"""A study with a declared `[stopping]` rule on real LIBERO through the CLI (DESIGN §20): it stops claiming once
the rule decides, the cases started before the decision still count, a kill -9 after the decision and a resume
keep that decision and claim nothing more, and `rescue verify` derives it again case by case.

The cohort: ten failures the scripted policy does not recover at a short horizon; the rule asks whether the VLM's
subgoal rescues 90 points or more of them, and stops for futility as soon as that is ruled out."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from conftest import SCRIPTED_ARGS, case_states, export_of, kill_mid_study, rescue_cli, write_cases

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

CONFIG = """
[stopping]
test = "rescue"
stop_for = "futility"
effect = 0.9
minimum = 3
seed = 5
"""


def _decision(study: Path) -> dict | None:
    if not (study / "journal.sqlite").exists():
        return None
    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'stopping_decision'").fetchone()
    finally:
        con.close()
    return None if row is None else json.loads(row[0])


def test_the_rule_stops_early_resumes_to_its_decision_after_kill_9_and_verifies(tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 10, horizon=48)
    config = tmp_path / "rule.toml"
    config.write_text(CONFIG)
    study = tmp_path / "study"
    args = ["run", str(manifest), "--study", str(study), "--config", str(config), *SCRIPTED_ARGS]
    # Killed (the whole process group, SIGKILL) once the rule has decided, its decision kept in the journal.
    kill_mid_study(args, study, also=lambda states: _decision(study) is not None)
    kept = _decision(study)
    assert kept["outcome"] == "futility" and kept["at"] >= 3
    before = case_states(study)
    resumed = rescue_cli("resume", str(study))
    assert "the [stopping] rule decided" in resumed.stdout
    after = case_states(study)
    # Nothing more was claimed: a case pending at the kill is pending still; none ran twice.
    assert {c for c, s in before.items() if s == "pending"} == {c for c, s in after.items() if s == "pending"}
    assert _decision(study) == kept
    assert rescue_cli("verify", str(study)).returncode == 0
    export = export_of(study)
    report = export["stopping"]
    assert report["stopped"] and report["decision"] == kept
    assert report["ran"] >= kept["at"] and report["main"] == 10 and report["ran"] < 10
    # The order the cases were claimed in is the rule's: every case that ran comes before every pending one.
    order = json.loads(sqlite3.connect(study / "journal.sqlite").execute(
        "SELECT value FROM meta WHERE key = 'stopping_order'").fetchone()[0])
    ran = [c for c in order if after[c] != "pending"]
    assert order[: len(ran)] == ran
    rescue_cli("report", str(study))
    page = (study / "report.html").read_text()
    assert page.index('data-answer="stopping"') < page.index('data-answer="main"')
    assert f"stopped at {kept['at']} of 10 by rule rescue" in " ".join(page.split())
