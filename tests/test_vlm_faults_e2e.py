"""VLM faults through a real study: the recorded assistance status, the receipt, and the DESIGN §3 label."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT, cli_env, rescue_cli, write_cases

pytestmark = [pytest.mark.sim, pytest.mark.e2e]


@pytest.fixture()
def faulty_endpoint(request):
    fault, count = request.param
    proc = subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", "0", "--fault", fault, "--fault-count", str(count)],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    url = re.search(r"(http://\S+/v1)", line).group(1)
    yield fault, url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.parametrize(
    "faulty_endpoint, status, error_kind, label, rule",
    [
        (("quota", 1), "broker_error", "quota", "unknown", 3),
        (("overlong_subgoal", 1), "invalid_response", "invalid_response", "unknown", 3),
        (("refusal", 1), "invalid_response", "refusal", "unknown", 3),  # an answer, recorded as a refusal
        (("server_error", 1), "applied", None, None, None),  # retried once, then answered
    ],
    indirect=["faulty_endpoint"],
)
def test_vlm_fault_is_recorded_and_classified(tmp_path, faulty_endpoint, status, error_kind, label, rule):
    fault, url = faulty_endpoint
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=48)
    study = tmp_path / "study"
    proc = rescue_cli("run", str(manifest), "--study", str(study), "--vlm-url", url, check=False)
    # Every case (the one) unknown: the run says so with exit code 4; otherwise it succeeded.
    assert proc.returncode == (4 if label == "unknown" else 0), proc.stdout + proc.stderr
    rescue_cli("export", str(study))
    case = json.loads((study / "export.json").read_text())["cases"][0]
    con_arms = __import__("sqlite3").connect(study / "journal.sqlite")
    assisted = json.loads(con_arms.execute("SELECT data FROM arms WHERE arm='assisted'").fetchone()[0])
    assert assisted["assistance"]["status"] == status
    assert assisted["assistance"]["error_kind"] == error_kind
    receipts = [json.loads(x) for x in (study / "receipts" / "receipts.jsonl").read_text().splitlines()]
    outcome = [r for r in receipts if r["kind"] == "outcome"]
    assert len(outcome) == 1 and outcome[0]["call_id"] == assisted["assistance"]["call_id"]
    assert [r["kind"] for r in receipts if r["kind"] != "outcome"][::2] == ["attempt_started"] * outcome[0]["attempt"]
    if label is not None:
        assert (case["label"], case["rule"]) == (label, rule)
        assert outcome[0]["error_kind"] == error_kind
        if fault == "refusal":
            assert outcome[0]["status"] == "refusal"
    else:
        attempts = [r for r in receipts if r["kind"] == "attempt"]
        assert len(attempts) == 2 and outcome[0]["status"] == "ok"
        assert case["label"] in {"rescued", "not_rescued"}
    assert rescue_cli("verify", str(study)).returncode == 0
