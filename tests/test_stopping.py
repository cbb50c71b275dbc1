"""Stopping when the answer is decided (DESIGN §20): the e-process and its decision (pure), the order fixed at
creation, and a study with a `[stopping]` rule built by the library's own writers as the engine builds one
(claims in the rule's order, the rule checked after each case): it stops at the first crossing, says so in its
export and terminal, and `rescue verify` derives the decision again case by case and catches an edited one. No
simulator runs; tests/test_stopping_e2e.py runs a study on LIBERO, kills it and resumes it."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from conftest import resolved_config
from helpers.case_records import make_case
from helpers.study_builder import FP, H, RECEIPTS_FILE, applied, arm_result, receipt

from rescue.core.classify import classify
from rescue.core.configuration.stopping import StoppingConfig
from rescue.core.figures.sequential import case_score, decide, fixed_order, study_order
from rescue.core.manifest import Case, parse_manifest
from rescue.read.export import export_study
from rescue.read.stopping_view import stop_sentence
from rescue.read.verify import verify_study
from rescue.run.stopping import StopRule, order_meta
from rescue.study.folder import STOPPING_DECISION_KEY, case_record, create_study, outcome_receipts, study_outcome
from rescue.study.journal import Journal
from rescue.study.receipts import ReceiptLog

pytestmark = pytest.mark.fast


# --- the e-process and its decision --------------------------------------------------------------------------


def _scores(values) -> list[tuple[str, float]]:
    return [(f"c{i}", float(v)) for i, v in enumerate(values)]


def test_a_clear_effect_stops_for_efficacy_and_none_for_futility():
    rescued = decide(_scores([1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]), 0.05, 5, "both", 0.1, False)
    assert rescued.outcome == "efficacy" and rescued.at < 20 and rescued.case_id == f"c{rescued.at - 1}"
    lo, hi = rescued.interval
    assert 0 < lo < rescued.mean < hi  # the confidence sequence at the stop excludes no effect
    assert [s.case_id for s in rescued.steps] == [f"c{i}" for i in range(rescued.at)]
    nothing = decide(_scores([0] * 60), 0.05, 5, "both", 0.1, False)
    assert nothing.outcome == "futility" and nothing.interval[1] <= 0.1 + 0.0025  # (rounded outwards one step)
    # Not before the minimum, and never from a boundary not declared.
    assert decide(_scores([1] * 8), 0.05, 10, "both", 0.1, False).outcome == "undecided"
    assert decide(_scores([0] * 60), 0.05, 5, "efficacy", 0.1, False).outcome == "undecided"
    assert decide(_scores([0] * 60), 0.05, 5, "efficacy", 0.1, True).outcome == "maximum"


@pytest.mark.parametrize(("k", "discordant"), [(1, 0.2), (3, 0.3)])
def test_under_no_effect_continuous_monitoring_keeps_the_error_rate(k, discordant):
    """Looked at after every case up to 200, the efficacy boundary is crossed in at most alpha of the studies."""
    rng = np.random.default_rng(20 + k)
    crossed, studies = 0, 300
    for _ in range(studies):
        u = rng.random((200, k))
        d = np.where(u < discordant / 2, 1.0, np.where(u < discordant, -1.0, 0.0)).mean(axis=1)
        crossed += decide(_scores(d), 0.05, 1, "efficacy", 0.1, True).outcome == "efficacy"
    assert crossed / studies <= 0.05 + 2 * (0.05 * 0.95 / studies) ** 0.5


def test_the_order_is_fixed_by_the_seed_and_stratified_by_task():
    ids = [f"t{t}-{i}" for t in range(4) for i in range(5)]
    tasks = [i.split("-")[0] for i in ids]
    order = fixed_order(ids, tasks, 3)
    assert order == fixed_order(ids, tasks, 3) and sorted(order) == sorted(ids) and order != fixed_order(ids, tasks, 4)
    # Every prefix holds each task in proportion, to within one case: stopping never ends on one task alone.
    for n in range(1, len(order) + 1):
        counts = [sum(o.startswith(f"t{t}-") for o in order[:n]) for t in range(4)]
        assert max(counts) - min(counts) <= 1, (n, counts)
    cases = [Case(case_id=i, suite="libero_object", task_id=int(i[1]), init_state_index=int(i[3:]), env_seed=7,
                  horizon=280, pilot=i == "t2-0") for i in ids]
    assert study_order(cases, 3)[0] == "t2-0"  # pilot cases first, outside the rule


def test_each_test_scores_its_own_stratum():
    rescued = make_case("f", assisted_success=True)
    success = make_case("s", control_success=True, assisted_success=False)
    success.historical_outcome = "success"
    vr, vs = classify(rescued), classify(success)
    assert case_score("rescue", "assisted", "control", rescued, vr) == 1.0
    assert case_score("rescue", "assisted", "control", success, vs) is None
    assert case_score("harm", "control", "assisted", success, vs) == 1.0
    assert case_score("harm", "control", "assisted", rescued, vr) is None
    assert case_score("net", "assisted", "control", success, vs) == -1.0


# --- a study with a rule, built as the engine builds it --------------------------------------------------------

RULE = dict(test="rescue", alpha=0.05, minimum=4, stop_for="efficacy", seed=1)


def _config(**rule):
    return resolved_config(16, stopping=StoppingConfig(**{**RULE, **rule}))


def run_ruled(study: Path, rescued: set[str], n: int = 30, **rule) -> Path:
    """A study of n failures under a rule; every case in `rescued` is rescued, the others not. Cases are claimed in
    the rule's order and the rule checked after each, until it decides (then the engine claims nothing more)."""
    config = _config(**rule)
    lines = [dict(case_id=f"c{i}", suite="libero_spatial", task_id=i % 3, init_state_index=i, env_seed=7, horizon=H,
                  group="spatial", fingerprint=FP) for i in range(n)]
    manifest = parse_manifest("".join(json.dumps(x) + "\n" for x in lines).encode(), "manifest.jsonl", catalog=None)
    create_study(study, manifest, config, order_meta(manifest.cases, config))
    journal = Journal.open(study)
    log = ReceiptLog(study / RECEIPTS_FILE)
    rule_ = StopRule(journal, config)
    while (case := rule_.claim("w0")) is not None:
        cid = case.case_id
        sub = f"Subgoal for {cid}."
        log.write(receipt("outcome", f"call-{cid}", [cid], "ok", {f"req-{cid}": sub}))
        a, i = applied(cid, f"call-{cid}", sub)
        arms = (arm_result(cid, "control", success=False, steps=H),
                arm_result(cid, "assisted", success=cid in rescued, steps=170 if cid in rescued else H, assistance=a,
                           applied=i))
        rec = case_record(case, {x.arm: x for x in arms}, outcome_receipts(study / RECEIPTS_FILE), config, False)
        index = (f"call-{cid}", RECEIPTS_FILE, log_line_sha(study, f"call-{cid}"))
        journal.finish_case(cid, arms, classify(rec), index)
        rule_.check()
    log.close()
    journal.close()
    return study


def log_line_sha(study: Path, call_id: str) -> str:
    from rescue.read.verify import outcome_line_sha256

    return outcome_line_sha256(study / RECEIPTS_FILE, call_id)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    return run_ruled(tmp_path_factory.mktemp("rule") / "study", {f"c{i}" for i in range(30) if i % 5})


def test_the_rule_stops_claiming_at_its_decision_and_says_so(stopped):
    export = export_study(stopped)
    report = export.stopping
    assert report.stopped and report.decision.outcome == "efficacy"
    n = report.decision.at
    assert 4 <= n < 30 and report.ran == n  # one worker: nothing was in flight at the decision
    assert sum(c.state == "pending" for c in export.cases) == 30 - n
    assert study_outcome(stopped).ended == "decided"
    sentence = stop_sentence(report)
    assert sentence.startswith(f"stopped at {n} of 30 by rule rescue (assisted against control)")
    assert "never run" in sentence and "fixed-n descriptions" in sentence
    lo, hi = report.decision.interval
    assert 0 < lo < hi


def test_verify_derives_the_decision_again_and_catches_an_edited_one(stopped, tmp_path):
    assert verify_study(stopped).ok
    copy = Path(shutil.copytree(stopped, tmp_path / "edited"))
    con = sqlite3.connect(copy / "journal.sqlite")
    (value,) = con.execute("SELECT value FROM meta WHERE key = ?", (STOPPING_DECISION_KEY,)).fetchone()
    decision = json.loads(value)
    decision["at"] += 1  # a decision claimed later than the e-process reached it
    con.execute("UPDATE meta SET value = ? WHERE key = ?", (json.dumps(decision), STOPPING_DECISION_KEY))
    con.commit()
    con.close()
    problems = verify_study(copy).problems
    assert [p.check for p in problems] == ["stopping"] and "differs from the one derived again" in problems[0].message


def test_a_study_that_went_on_past_its_decision_fails_verify(tmp_path):
    study = run_ruled(tmp_path / "study", {f"c{i}" for i in range(30) if i % 5})
    con = sqlite3.connect(study / "journal.sqlite")
    con.execute("DELETE FROM meta WHERE key = ?", (STOPPING_DECISION_KEY,))
    con.commit()
    con.close()
    problems = verify_study(study).problems
    assert any(p.check == "stopping" and "went on without stopping" in p.message for p in problems)


def test_no_effect_runs_to_the_maximum_and_a_study_without_a_rule_has_no_report(tmp_path):
    capped = run_ruled(tmp_path / "capped", set(), maximum=12)
    report = export_study(capped).stopping
    assert report.stopped and report.decision.outcome == "maximum" and report.ran == 12
    assert verify_study(capped).ok
    from helpers.harm_study import build

    plain = build(tmp_path / "plain")
    assert export_study(plain).stopping is None
    assert "stopping" not in json.loads((plain / "config.json").read_text())  # byte for byte as before
