"""A lab budget holds when every case makes several calls: two and three studies race one ledger.

Real `rescue run` processes, started together from one lab folder, each with a `[[query_point]]` and K = 2
continuations, ask the bundled VLM endpoint under a declared price (a call costs about 1.165: the endpoint
counts 1,165 input tokens for the prompt and three views). A case makes two calls (its advisor's at q, its
query point's at its own q; its continuations share them), so a hold of one call per case let the last
room be taken twice. The bound the docs state (docs/reference.md, a lab's spending): spending passes the
cap by no more than the calls in flight at the moment of the refusal cost beyond their holds; here every
call's cost is known after the first one, so the ledger ends within a few tokens' worth of the cap.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_S, SCRIPTED_POLICY, case_states, cli_env, write_cases

from rescue.study.ledger import read_ledger

pytestmark = pytest.mark.e2e

CAP = 5.0
# What one call costs at most beyond its hold (a task's words change the input by a token or two).
SLACK_PER_CALL = 0.01
# The subject is the ledger, not what a policy sees: its studies run the scripted policy.
CONFIG = f"""
cases_in_flight = 2
continuations = 2
[env]
simulators = 1
[vlm]
price = {{ input = 1000.0, output = 0.0 }}
lab_budget = {CAP}
[[query_point]]
name = "early"
fraction = 0.25
[policy]
factory = "{SCRIPTED_POLICY}"
"""


def _rescue(lab: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=lab, env=cli_env(), capture_output=True,
                          text=True, timeout=HANG_S)


@pytest.mark.parametrize("studies", [2, 3])
def test_studies_with_query_points_and_continuations_racing_one_ledger_keep_the_cap(tmp_path, studies):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "budget.toml").write_text(CONFIG)
    names = [chr(ord("a") + i) for i in range(studies)]
    for i, name in enumerate(names):
        write_cases(lab / f"{name}.jsonl", 3, horizon=32, task_id=3 + i)
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "rescue.cli", "run", f"{name}.jsonl", "--study", f"studies/{name}",
                                "--config", "budget.toml"], cwd=lab, env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        for name in names
    }
    outs = {name: p.communicate(timeout=HANG_S * 2) for name, p in procs.items()}
    ledger = read_ledger(lab / "receipts")
    assert ledger is not None and (ledger.holds, ledger.calls_without_cost) == (0, 0)
    # Two calls a case: two cases fit under 5.0 (4 calls, about 4.66), a third case's two calls do not.
    assert ledger.calls == 4, (ledger, outs)
    assert ledger.cost <= CAP + SLACK_PER_CALL * ledger.calls, ledger
    stopped = 0
    for name, p in procs.items():
        assert p.returncode in (0, 3), (name, outs[name])
        if p.returncode == 3:
            stopped += 1
            assert "the lab budget of 5 leaves no room" in outs[name][1].strip().splitlines()[-1]
        states = case_states(lab / "studies" / name)
        assert set(states.values()) <= {"finished", "pending"}, states
        assert _rescue(lab, "verify", f"studies/{name}").returncode == 0
    assert stopped == studies  # every study has a case that never started: 3 x studies cases, 2 fit
    finished = sum(list(case_states(lab / "studies" / n).values()).count("finished") for n in names)
    assert finished == 2
