"""A lab budget stops two studies running at once at its cap, with nothing lost.

Two real `rescue run` processes, started together from one lab folder, ask the bundled VLM endpoint
under a declared price; the ledger is created on first use under that folder's `receipts/`. The price
makes one call cost 1.165 (the endpoint counts 1,165 input tokens for this prompt and three views), the
cap is 2.6: the two studies together make exactly two calls, then each stops claiming (exit 3, one line),
its never-started cases still pending. `rescue usage` and the exports agree with the ledger, and a resume
with a higher cap runs the rest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SCRIPTED_POLICY, case_states, cli_env, write_cases

from rescue.study.ledger import read_ledger

pytestmark = pytest.mark.e2e

CAP = 2.6
# The subject is the ledger, not what a policy sees: its studies run the scripted policy.
CONFIG = f"""
cases_in_flight = 2
[env]
simulators = 1
[vlm]
price = {{ input = 1000.0, output = 0.0 }}
lab_budget = {CAP}
[policy]
factory = "{SCRIPTED_POLICY}"
"""


def _rescue(lab: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=lab, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_a_lab_budget_stops_two_concurrent_studies_at_its_cap_and_nothing_is_lost(tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "budget.toml").write_text(CONFIG)
    write_cases(lab / "a.jsonl", 4, horizon=48)
    write_cases(lab / "b.jsonl", 4, horizon=48, task_id=5)
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "rescue.cli", "run", f"{name}.jsonl", "--study", f"studies/{name}",
                                "--config", "budget.toml"], cwd=lab, env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        for name in ("a", "b")
    }
    outs = {name: p.communicate(timeout=900) for name, p in procs.items()}
    ledger = read_ledger(lab / "receipts")
    assert ledger is not None and ledger.path == str(lab / "receipts" / "ledger.sqlite")
    # Exactly two calls fit (about 1.165 each: a task's words change the input by a token or two, and which study
    # got the calls depends on how the two interleaved); nothing is held once both runs ended.
    assert (ledger.calls, ledger.holds, ledger.calls_without_cost) == (2, 0, 0)
    assert 2.32 < ledger.cost <= CAP
    for name, p in procs.items():
        err = outs[name][1].strip().splitlines()
        assert p.returncode == 3, (name, outs[name])
        assert err[-1].startswith("rescue: the study stopped with ") and "the lab budget of 2.6 leaves no room" in err[-1]
        # Nothing lost: a case either ran to its verdict or was never started; none interrupted, none in flight.
        states = case_states(lab / "studies" / name)
        assert set(states.values()) <= {"finished", "pending"} and "pending" in states.values(), states
        assert _rescue(lab, "verify", f"studies/{name}").returncode == 0
    finished = sum(list(case_states(lab / "studies" / n).values()).count("finished") for n in ("a", "b"))
    assert finished >= 2

    # The lab's view equals the ledger and the sum of the two exports.
    usage = json.loads(_rescue(lab, "usage", "--json").stdout)
    assert [s["path"] for s in usage["studies"]] == ["studies/a", "studies/b"]
    assert usage["total"]["calls"] == 2 and usage["total"]["cost"] == pytest.approx(ledger.cost)
    assert usage["ledgers"] == [ledger.model_dump(mode="json")]
    exports = []
    for name in ("a", "b"):
        assert _rescue(lab, "export", f"studies/{name}", "--partial").returncode == 0
        exports.append(json.loads((lab / "studies" / name / "export.json").read_text())["usage"])
    assert sum(e["calls"] for e in exports) == 2
    assert sum(e["cost"] for e in exports) == pytest.approx(ledger.cost)

    # A higher cap goes on where the study stopped: every case of it gets its verdict, from this folder or another.
    out = subprocess.run([sys.executable, "-m", "rescue.cli", "resume", str(lab / "studies" / "a"), "--lab-budget", "100"],
                         cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    assert set(case_states(lab / "studies" / "a").values()) == {"finished"}
    after = read_ledger(lab / "receipts")
    usage = json.loads(_rescue(lab, "usage", "--json").stdout)
    assert after.calls == usage["total"]["calls"] > 2 and after.cost == pytest.approx(usage["total"]["cost"])
    assert not (ROOT / "receipts").exists() or not (ROOT / "receipts" / "ledger.sqlite").exists()
