"""A study made before the package was laid out in floors verifies, resumes and reports with today's code.

`tests/data/study_before_floors/` was made by main at 3c57386 (the commit before the move):
five `libero_object` task-3 cases, horizon 48, the scripted policy named by its old factory
string `rescue.policy.scripted:make_policy`, a permuted sham arm, one simulator, one case in
flight, and SIGKILLed once two cases had finished (so it holds finished, claimed and pending
cases). Then its WAL was checkpointed into the journal, its `simulator.log` (a log, not
evidence) removed, and the journal's `manifest_source` shortened to the manifest's file name.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import case_states, export_of, rescue_cli

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

OLD = Path(__file__).resolve().parent / "data" / "study_before_floors"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_study_of_the_previous_layout_resumes_verifies_and_reports(tmp_path):
    study = tmp_path / "study"
    shutil.copytree(OLD, study)
    config_before = _sha(study / "config.json")
    assert json.loads((study / "config.json").read_text())["policy"]["factory"] == "rescue.policy.scripted:make_policy"
    before = case_states(study)
    assert sorted(before.values()) == ["claimed", "finished", "finished", "pending", "pending"]

    assert "rescue study" in rescue_cli("status", str(study)).stdout
    rescue_cli("resume", str(study))  # the bundled server serves the old factory string

    after = case_states(study)
    for case_id, state in before.items():
        assert after[case_id] == {"claimed": "interrupted", "finished": "finished", "pending": "finished"}[state]
    assert _sha(study / "config.json") == config_before  # its identity is what it was
    assert rescue_cli("verify", str(study)).returncode == 0
    export = export_of(study)
    by_id = {c["case_id"]: c for c in export["cases"]}
    for case_id, state in before.items():
        if state == "pending":
            # Run now, by today's code: both arms and the sham complete.
            assert by_id[case_id]["label"] in ("rescued", "not_rescued")
            assert by_id[case_id]["verdicts"]["sham"]["label"] in ("rescued", "not_rescued")
    rescue_cli("report", str(study))
    assert (study / "report.html").stat().st_size > 0
