"""The lab budget's ledger: one SQLite file several studies' processes share, never holding more than the cap.

Real processes race for holds on one real ledger file; a real study folder (tests/report_studies.py) stands
for a study whose process died between its receipts and the ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import HANG_S, ROOT, resolved_config
from report_studies import build_report_study

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import ConfigError, validate_config
from rescue.core.configuration.vlm_config import TokenPrice
from rescue.core.manifest import parse_manifest
from rescue.study.folder import create_study, load_study_config
from rescue.study import ledger as lab_ledger
from rescue.study.ledger import ArmCost, BudgetReached, Ledger, LedgerTotals, ledger_path, read_ledger
from rescue.study.usage import CallCost, call_costs

pytestmark = pytest.mark.fast

PRICE = TokenPrice(input=1000.0, output=0.0)  # a call of 1,000 input tokens costs 1.0
ARM = ArmCost(arm="assisted", model="m", endpoint="local", price=PRICE, max_output_tokens=None)


def _call(call_id: str, study: str = "/s", input_tokens: int | None = 1000, cost: float | None = 1.0) -> CallCost:
    return CallCost(call_id=call_id, study=study, model="m", endpoint="local", started_at=0.0, day="1970-01-01",
                    status="ok", cases=1, tokens={"input": input_tokens, "cached_input": 0, "output": 0, "reasoning": 0},
                    latency_s=1.0, cost=cost)


def test_the_first_call_of_a_model_holds_alone_and_its_cost_becomes_the_estimate(tmp_path):
    ledger = Ledger(ledger_path(tmp_path / "receipts"))
    assert (tmp_path / "receipts" / "ledger.sqlite").is_file()  # created on first use
    first = ledger.try_hold("/a", [ARM], cap=10.0)
    assert first is not None and ledger.totals().holds == 1
    assert ledger.try_hold("/b", [ARM], cap=10.0) is None  # its cost is unknown until the first call ends: wait
    ledger.bind(first, "case-1")
    ledger.record(_call("c1", "/a"), ["case-1"], "assisted")
    assert ledger.totals() == LedgerTotals(path=str(ledger.path), calls=1, cost=1.0, calls_without_cost=0, held=0.0, holds=0)
    ledger.record(_call("c1", "/a"), ["case-1"], "assisted")  # the same call again counts once
    assert ledger.totals().calls == 1
    # Now each case holds the dearest call so far, until the cap: 1 spent + 8 held + 1 fits 10, one more does not.
    held = [ledger.try_hold("/b", [ARM], cap=10.0) for _ in range(9)]
    assert all(h is not None for h in held) and ledger.totals().held == pytest.approx(9.0)
    with pytest.raises(BudgetReached, match="lab budget of 10 leaves no room"):
        ledger.try_hold("/b", [ARM], cap=10.0)
    ledger.release(held[0])
    assert ledger.try_hold("/b", [ARM], cap=10.0) is not None
    # An output cap bounds a call's output: the estimate prices max_output_tokens, not the output seen.
    capped = ArmCost(arm="assisted", model="m", endpoint="local", price=TokenPrice(input=1000.0, output=1000.0),
                     max_output_tokens=500)
    with pytest.raises(BudgetReached, match="estimated at 1.5000"):
        ledger.try_hold("/c", [capped], cap=10.0)


def test_a_call_answered_without_token_counts_cannot_be_kept_under_a_cap(tmp_path):
    ledger = Ledger(ledger_path(tmp_path))
    ledger.record(_call("c1", input_tokens=None, cost=None), [], "assisted")
    with pytest.raises(BudgetReached, match="call c1 of /s to m at local reported no token counts"):
        ledger.try_hold("/a", [ARM], cap=10.0)


RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from rescue.study.ledger import ArmCost, BudgetReached, Ledger
    from rescue.core.configuration.vlm_config import TokenPrice
    ledger = Ledger(sys.argv[1])
    arm = ArmCost(arm="assisted", model="m", endpoint="local", price=TokenPrice(input=1000.0, output=0.0),
                  max_output_tokens=None)
    mine, other = Path(sys.argv[4]), Path(sys.argv[5])

    def meet(stage):
        # Wait for the other racer to reach the same stage, however slowly it goes.
        Path(f"{mine}.{stage}").touch()
        deadline = time.monotonic() + float(sys.argv[6])
        while not Path(f"{other}.{stage}").exists() and time.monotonic() < deadline:
            time.sleep(0.001)

    won = 0
    while True:
        try:
            ids = ledger.try_hold(sys.argv[2], [arm], cap=float(sys.argv[3]))
        except BudgetReached:
            break
        won += ids is not None
        if won == 1:  # both hold one before either goes on: they race
            meet("started")
    # A racer that exited holding would be a dead study, whose holds the other may take back: both stay alive
    # until both have met the cap.
    meet("capped")
    print(won)
""")


def test_two_processes_racing_for_holds_never_pass_the_cap(tmp_path):
    path = ledger_path(tmp_path / "receipts")
    ledger = Ledger(path)
    ledger.record(_call("seed"), [], "assisted")  # the estimate: 1.0 per case
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    held = [str(tmp_path / f"held-{i}") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(path), f"/study-{i}", "1000", held[i], held[1 - i],
                               str(HANG_S)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True) for i in range(2)]
    won = [int(p.communicate(timeout=HANG_S)[0].strip()) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    # 1 spent: exactly 999 holds of 1.0 fit under 1000, however the two processes interleaved.
    assert sum(won) == 999 and min(won) > 0, won
    totals = ledger.totals()
    assert totals.holds == 999 and totals.cost + totals.held == pytest.approx(1000.0)


def test_a_dead_processes_holds_go_once_its_studys_receipts_are_counted(tmp_path):
    study = build_report_study(tmp_path / "study", 12, sham="off", seed=7, vlm={"price": {"input": 1000.0, "output": 0.0}})
    _, calls = call_costs(study)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ledger = Ledger(ledger_path(tmp_path / "receipts"))
    ledger.record(_call("seed", str(study.resolve())), [], "assisted")
    # A hold of a process that died after its calls reached the receipts, before they reached the ledger.
    with ledger._write() as conn:
        conn.execute("INSERT INTO holds (study, case_id, arm, model, endpoint, amount, host, pid, created_at) "
                     "VALUES (?, 'x', 'assisted', 'm', 'local', 5.0, ?, ?, 0)", (str(study), os.uname().nodename, dead.pid))
    assert ledger.totals().held == 5.0
    assert ledger.try_hold("/other", [ARM], cap=1000.0) is not None
    totals = ledger.totals()
    assert totals.held == pytest.approx(1.0)  # the dead hold went; the new one is here
    assert totals.calls == 1 + len(calls) and totals.cost == pytest.approx(1.0 + sum(c.cost or 0 for c in calls))
    # Counted once: reading the study again adds nothing.
    assert ledger.reconcile(str(study)) == 0
    assert read_ledger(tmp_path / "receipts") == ledger.totals()


def test_the_configuration_of_a_lab_budget(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"vlm.lab_budget needs a declared price for every call: \[vlm\]"):
        validate_config({"vlm": {"lab_budget": 5.0}}, "t.toml")
    with pytest.raises(ConfigError, match="advisor-b declares none"):
        validate_config({"vlm": {"lab_budget": 5.0}, "advisor": [
            {"name": "advisor-a", "price": {"input": 1.0, "output": 1.0}}, {"name": "advisor-b"}]}, "t.toml")
    with pytest.raises(ConfigError, match="set lab_budget"):
        validate_config({"advisor": [{"name": "a", "lab_budget": 5.0, "price": {"input": 1.0, "output": 1.0}}]}, "t.toml")
    with pytest.raises(ConfigError, match="set vlm.lab_budget too"):
        validate_config({"vlm": {"lab_ledger": "x"}}, "t.toml")
    # With advisors, [vlm] holds the lab budget and nothing else.
    both = validate_config({"vlm": {"lab_budget": 5.0}, "advisor": [
        {"name": "a", "price": {"input": 1.0, "output": 1.0}}]}, "t.toml")
    assert both.vlm.lab_budget == 5.0
    # An evaluation makes no call: nothing to price.
    assert validate_config({"vlm": {"lab_budget": 5.0}, "arms": ["control"]}, "t.toml").vlm.lab_budget == 5.0
    # The ledger's folder is fixed when the study is created: a resume from elsewhere uses the same ledger.
    monkeypatch.chdir(tmp_path)
    manifest = parse_manifest(b'{"case_id": "a", "suite": "s", "task_id": 0, "init_state_index": 0, "env_seed": 0, '
                              b'"horizon": 64}\n', "m.jsonl", catalog=None)
    config = resolved_config(16, vlm={"lab_budget": 5.0, "price": {"input": 1.0, "output": 1.0}})
    create_study(tmp_path / "study", manifest, config)
    stored = load_study_config(tmp_path / "study")
    assert stored.vlm.lab_ledger == str(tmp_path / "receipts")
    assert json.loads((tmp_path / "study" / "config.json").read_text())["vlm"]["lab_budget"] == 5.0
    assert StudyConfig().sha256() == StudyConfig(vlm={"lab_budget": None}).sha256()


def test_a_case_holds_every_call_it_can_make_and_each_call_releases_one_hold(tmp_path):
    price = {"input": 1000.0, "output": 0.0}
    config = StudyConfig.model_validate({
        "vlm": {"price": price, "lab_budget": 100.0}, "continuations": 3,
        "query_point": [{"name": "early", "fraction": 0.25}, {"name": "late", "fraction": 0.75}]})
    # One call per arm that asks at its own q: the advisor's and each query point's; the K continuations share them.
    assert [arm for arm, _ in lab_ledger.case_calls(config)] == ["assisted"] * 3
    advisors = StudyConfig.model_validate({
        "vlm": {"lab_budget": 100.0}, "query_point": [{"name": "early", "fraction": 0.25}],
        "advisor": [{"name": "a", "price": price}, {"name": "b", "price": price}]})
    # The query point is the primary advisor's: its call is that advisor's.
    assert [arm for arm, _ in lab_ledger.case_calls(advisors)] == ["assisted:a", "assisted:b", "assisted:a"]
    # Asking again (DESIGN §18): max_calls holds per arm that asks, a trigger's arm included; each call its own.
    again = StudyConfig.model_validate({
        "vlm": {"price": price, "lab_budget": 100.0}, "asking": {"max_calls": 2},
        "trigger": [{"name": "stall", "kind": "stall"}], "sham": {"source": "fixed"}})
    assert [arm for arm, _ in lab_ledger.case_calls(again)] == ["assisted"] * 4
    ledger = Ledger(ledger_path(tmp_path / "receipts"))
    ledger.record(_call("seed"), [], "assisted")  # the estimate: 1.0 per call
    arms = [ArmCost(arm=arm, model="m", endpoint="local", price=PRICE, max_output_tokens=None) for arm, _ in lab_ledger.case_calls(config)]
    ids = ledger.try_hold("/a", arms, cap=6.5)
    assert ids is not None and ledger.totals().held == pytest.approx(3.0)
    ledger.bind(ids, "case-1")
    # Its first call drops one hold: the two calls still to come stay held.
    ledger.record(_call("c1", "/a"), ["case-1"], "assisted")
    assert (ledger.totals().holds, ledger.totals().held) == (2, pytest.approx(2.0))
    # 2 spent + 2 held + 3 for the next case pass 6.5: refused, though a hold per case would have let it in.
    with pytest.raises(BudgetReached, match="leaves no room"):
        ledger.try_hold("/b", arms, cap=6.5)
    ledger.record(_call("c2", "/a"), ["case-1"], "assisted")
    ledger.record(_call("c2", "/a"), ["case-1"], "assisted")  # a call counted again releases nothing more
    assert (ledger.totals().holds, ledger.totals().cost) == (1, 3.0)


def test_the_unknown_holds_of_the_first_case_count_at_the_estimate_its_first_call_gives(tmp_path):
    ledger = Ledger(ledger_path(tmp_path / "receipts"))
    arms = [ARM, ARM, ARM]
    first = ledger.try_hold("/a", arms, cap=5.0)
    assert first is not None and ledger.totals().held == 0.0
    ledger.bind(first, "case-1")
    ledger.record(_call("c1", "/a"), ["case-1"], "assisted")
    # Its two calls still to come are held at 1.0 each: 1 spent + 2 held leave room for 2, not for a case of 3.
    assert ledger.totals().held == pytest.approx(2.0)
    with pytest.raises(BudgetReached):
        ledger.try_hold("/b", arms, cap=5.0)
    assert ledger.try_hold("/b", [ARM, ARM], cap=5.0) is not None


@pytest.mark.parametrize("cap", ["nan", "inf", "-1", "0", "1e16"])
def test_resume_refuses_a_cap_that_is_not_a_finite_positive_amount(tmp_path, cap):
    """The flag takes what [vlm] lab_budget takes (above 0, at most 1e15), in one line."""
    manifest = parse_manifest(b'{"case_id": "a", "suite": "s", "task_id": 0, "init_state_index": 0, "env_seed": 0, '
                              b'"horizon": 64}\n', "m.jsonl", catalog=None)
    config = resolved_config(16, vlm={"lab_budget": 5.0, "price": {"input": 1.0, "output": 1.0},
                                      "lab_ledger": str(tmp_path / "receipts")})
    study = tmp_path / "study"
    create_study(study, manifest, config)
    before = sorted((p.name, p.stat().st_size) for p in study.rglob("*"))
    out = subprocess.run([sys.executable, "-m", "rescue.cli", "resume", str(study), "--lab-budget", cap],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=HANG_S)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [f"rescue: --lab-budget {float(cap):g}: a cap is above 0 and at most "
                                               "1,000,000,000,000,000, as [vlm] lab_budget is"]
    assert sorted((p.name, p.stat().st_size) for p in study.rglob("*")) == before
    assert not (tmp_path / "receipts").exists()
