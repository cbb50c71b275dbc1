"""A study with query points at 1/4, 1/2 (pre-registered) and 3/4 of the horizon, a stall trigger and its random
placebo, an advisor that may decline, two calls per arm and a sham, on real LIBERO through the CLI (DESIGN §14,
§18): killed with SIGKILL mid-run, resumed without re-running an arm, verified (each trigger's firing derived again
from the control arm's record), exported and reported; a forged row of any query point's arm, a forged firing or a
forged later call fails verify."""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest
from conftest import SCRIPTED_ARGS, arm_rows, case_states, export_of, kill_mid_study, rescue_cli, write_cases

from rescue.core.digest import digest_text

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

CONFIG = """
[vlm]
may_decline = true

[[query_point]]
name = "early"
fraction = 0.25

[[query_point]]
name = "late"
fraction = 0.75

[[trigger]]
name = "stall"
kind = "stall"
window = 2
distance = 0.02

[[trigger]]
name = "placebo"
kind = "random"
matches = "stall"
rate = 0.7

[asking]
max_calls = 2
every_queries = 2

[sham]
source = "fixed"
"""
HORIZON = 64  # C = 8 (the embedded policy's): early at 16, the pre-registered q at 32, late at 48
ASKS = {"assisted@early": 16, "assisted": 32, "assisted@late": 48, "sham": 32}
TRIGGERS = {"assisted@stall": "stall", "assisted@placebo": "placebo"}


def _outcomes(study) -> list[dict]:
    path = study / "receipts" / "receipts.jsonl"
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in lines if r.get("kind") == "outcome"]


def _called(study, claimed: list[str]) -> bool:
    return any(set(r["case_ids"]) & set(claimed) for r in _outcomes(study))


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("query-points")
    manifest = write_cases(tmp / "m.jsonl", 3, horizon=HORIZON)
    config = tmp / "study.toml"
    config.write_text(CONFIG)
    study = tmp / "study"
    # Killed once the case in flight has made a call: its interrupted case's calls must still be counted.
    kill_mid_study(["run", str(manifest), "--study", str(study), "--config", str(config), "--cases-in-flight", "1"], study,
                   also=lambda states: _called(study, [c for c, s in states.items() if s == "claimed"]))
    before, states = arm_rows(study), case_states(study)
    rescue_cli("resume", str(study))
    after = arm_rows(study)
    assert all(after[k] == v for k, v in before.items())  # nothing that ran before the kill ran again
    return study, states


def test_each_query_point_forks_from_the_one_prefix_and_asks_at_its_own_q(study):
    study, before = study
    assert rescue_cli("verify", str(study)).returncode == 0
    config = json.loads((study / "config.json").read_text())
    assert config["arms"] == ["control", "assisted", "assisted@early", "assisted@late", "assisted@stall",
                              "assisted@placebo", "sham"] and config["fork_at_q"]
    rows = {k: json.loads(v) for k, v in arm_rows(study).items()}
    export = export_of(study)
    assert export["schema_version"] == "rescue-export/8"
    finished = [c for c in export["cases"] if before.get(c["case_id"]) != "claimed"]
    assert finished
    for case in finished:
        control = rows[(case["case_id"], "control")]
        # The leader snapshotted at each declared q as it passed, and proved each follower's restore there.
        assert {16, 48} <= {int(q) for q in control["fork_states"]}
        for arm, q in ASKS.items():
            row = rows[(case["case_id"], arm)]
            # The advisor may keep the instruction: a declined call is a call, at its q, with its receipt.
            assert row["assistance"]["query_step"] == q and row["assistance"]["status"] in ("applied", "declined")
            assert [r for r in row["trace"] if r["step"] < q] == [r for r in control["trace"] if r["step"] < q]
            want = control["q_state"] if q == 32 else control["fork_states"][str(q)]
            assert row["q_state"] == want is not None
        # Each query point's own call: three calls of the VLM, the sham's fixed text.
        calls = {rows[(case["case_id"], a)]["assistance"]["call_id"] for a in ("assisted", "assisted@early", "assisted@late")}
        assert len(calls) == 3 and None not in calls
        assert set(case["verdicts"]) == {"assisted@early", "assisted@late", "assisted@stall", "assisted@placebo",
                                         "sham"}
    summary = export["summary"]
    assert [a["arm"] for a in summary["arms"]] == ["assisted@early", "assisted@late", "assisted@stall",
                                                   "assisted@placebo", "sham"]
    holm = {(c["first"], c["second"]) for c in summary["comparisons"] if c.get("holm_p") is not None}
    assert holm == {("assisted", "assisted@early"), ("assisted", "assisted@late"), ("assisted@early", "assisted@late")}
    assert set(export["usage_by_query_point"]) == {"assisted", "assisted@early", "assisted@late", "assisted@stall",
                                                   "assisted@placebo"}
    rescue_cli("report", str(study))
    page = (study / "report.html").read_text()
    assert 'id="sec-query-points"' in page and 'data-figure="main.advisor.assisted@early.r"' in page
    panel = (study / "report_files" / "case" / f"{finished[0]['case_id']}.js").read_text().replace('\\"', '"')  # JS string
    assert 'data-advisor="assisted@early"' in panel and 'data-advisor="assisted@late"' in panel


def test_the_per_query_point_usage_counts_every_call_the_interrupted_case_made_too(study, tmp_path):
    study, before = study
    interrupted = [c for c, s in before.items() if s == "claimed"]
    calls = {r["call_id"]: r for r in _outcomes(study)}
    theirs = [r for r in calls.values() if set(r["case_ids"]) & set(interrupted)]
    assert theirs and all(r["arms"] for r in theirs)  # the receipt names the arm that asked
    by_point = export_of(study)["usage_by_query_point"]
    assert sum(u["calls"] for u in by_point.values()) == len(calls)  # one case per call: each counted once
    # verify holds the per-query-point usage to the receipts: a call no arm claims is a problem.
    copy = shutil.copytree(study, tmp_path / "stripped")
    path = copy / "receipts" / "receipts.jsonl"
    lines = path.read_text().splitlines()
    gone = theirs[0]["call_id"]
    stripped = []
    for line in lines:
        r = json.loads(line)
        if r.get("call_id") == gone and r.get("kind") == "outcome":
            r["arms"] = {}
            line = json.dumps(r)
        stripped.append(line)
    path.write_text("\n".join(stripped) + "\n")
    out = rescue_cli("verify", str(copy), check=False)
    assert out.returncode == 1 and f"call {gone} of the primary advisor is no query point's arm's" in out.stdout


@pytest.mark.parametrize("arm", ["assisted@early", "assisted@late"])
def test_a_forged_row_of_a_query_points_arm_fails_verify(study, tmp_path, arm):
    from rescue.core.records import ArmResult
    from rescue.study.journal import arm_digest

    study, before = study
    case_id = next(c for c, s in case_states(study).items() if s == "finished")
    for what in ("prefix row", "subgoal"):
        copy = shutil.copytree(study, tmp_path / f"{arm}-{what}".replace(" ", "-").replace("@", "-"))
        con = sqlite3.connect(copy / "journal.sqlite")
        data = json.loads(con.execute("SELECT data FROM arms WHERE case_id = ? AND arm = ?", (case_id, arm)).fetchone()[0])
        if what == "prefix row":
            data["trace"][1]["actions"] = digest_text("other actions")
        else:
            data["assistance"]["subgoal"] = "grasp the ketchup"
        forged = ArmResult.model_validate(data)
        # A consistent forgery: the record's digest is recomputed, only the re-derivation can tell.
        con.execute("UPDATE arms SET data = ?, digest = ? WHERE case_id = ? AND arm = ?",
                    (forged.model_dump_json(), arm_digest(forged), case_id, arm))
        con.commit()
        con.close()
        out = rescue_cli("verify", str(copy), check=False)
        assert out.returncode == 1 and arm in out.stdout, (what, out.stdout)


def test_each_trigger_forks_where_it_fires_on_the_control_arms_record_and_each_arm_asks_again(study):
    from rescue.core.asking import TriggerConfig
    from rescue.core.records import ArmResult
    from rescue.core.triggers import first_firing

    study, before = study
    config = json.loads((study / "config.json").read_text())
    triggers = [TriggerConfig.model_validate(t) for t in config["triggers"]]
    rows = {k: ArmResult.model_validate_json(v) for k, v in arm_rows(study).items()}
    export = export_of(study)
    finished = [c["case_id"] for c in export["cases"] if before.get(c["case_id"]) != "claimed"]
    fired_somewhere = later = declined = 0
    for case_id in finished:
        control = rows[(case_id, "control")]
        for arm, name in TRIGGERS.items():
            trigger = next(t for t in triggers if t.name == name)
            # The leader's decision is the one its record gives again, and the arm asked exactly there.
            step = first_firing(trigger, control.queries, case_id, HORIZON, 8, triggers=triggers)
            assert control.trigger_steps[name] == step
            row = rows[(case_id, arm)]
            if step is None:
                assert row.assistance.status == "not_asked" and row.trace == control.trace and not row.calls()
                continue
            fired_somewhere += 1
            assert row.assistance.query_step == step and row.assistance.status in ("applied", "declined")
            assert [r for r in row.trace if r.step < step] == [r for r in control.trace if r.step < step]
            assert row.q_state == (control.q_state if step == 32 else control.fork_states[step])
        for arm in ("assisted", "assisted@early", "assisted@late", "assisted@stall", "assisted@placebo"):
            row = rows[(case_id, arm)]
            calls = row.calls()
            assert len(calls) <= 2
            # Every two queries after the last call, while the episode runs.
            for first, second in zip(calls, calls[1:]):
                assert second.query_step == first.query_step + 2 * 8 and second.call_id != first.call_id
            later += len(row.again)
            declined += sum(c.status == "declined" for c in calls)
        assert rows[(case_id, "sham")].again == []  # the sham asks once
    assert fired_somewhere and later and declined  # the stall fired, arms asked again, the advisor kept some
    assert " trigger firings" in rescue_cli("verify", str(study)).stdout
    asking = export["summary"]["asking"]
    assert [w["kind"] for w in asking["ways"]] == ["fixed", "fixed", "fixed", "trigger", "placebo", "sham"]
    assert {(c["first"], c["second"]) for c in asking["comparisons"]} == {
        ("assisted@stall", "assisted@placebo"), ("assisted@stall", "assisted"), ("assisted@stall", "assisted@early"),
        ("assisted@stall", "assisted@late")}
    assert asking["budgets"][0]["placebo"] == "assisted@placebo" and asking["best"] is not None
    rescue_cli("report", str(study))
    page = (study / "report.html").read_text()
    # The first screen names the best way per call (or, none raising the benchmark, the one that cost it least).
    assert 'data-answer="asking"' in page and 'id="sec-asking"' in page
    assert f'data-value="&#34;{asking["best"]}&#34;"' in page or f'data-value="{json.dumps(asking["best"])}"' in page
    assert ("changes the benchmark most" in page) != ("No way of asking raised the benchmark" in page)


@pytest.mark.parametrize("what", ["firing", "later call"])
def test_a_forged_firing_or_later_call_fails_verify(study, tmp_path, what):
    from rescue.core.records import ArmResult
    from rescue.study.journal import arm_digest

    study, _ = study
    rows = {k: ArmResult.model_validate_json(v) for k, v in arm_rows(study).items()}
    case_id = next(c for c, s in case_states(study).items() if s == "finished"
                   and rows[(c, "control")].trigger_steps.get("stall") is not None)
    copy = shutil.copytree(study, tmp_path / what.replace(" ", "-"))
    con = sqlite3.connect(copy / "journal.sqlite")
    if what == "firing":
        # The leader's positions moved after the fact, so that the stall it recorded is no stall: consistent bytes.
        arm = rows[(case_id, "control")].model_copy(deep=True)
        arm.queries = [q.model_copy(update={"ee_pos": (0.01 * i, 0.0, 0.0)}) for i, q in enumerate(arm.queries)]
    else:
        arm = next(a for (c, n), a in rows.items() if c == case_id and a.again).model_copy(deep=True)
        arm.again[0] = arm.again[0].model_copy(update={"query_step": arm.again[0].query_step + 8})
    con.execute("UPDATE arms SET data = ?, digest = ? WHERE case_id = ? AND arm = ?",
                (arm.model_dump_json(), arm_digest(arm), case_id, arm.arm))
    con.commit()
    con.close()
    out = rescue_cli("verify", str(copy), check=False)
    assert out.returncode == 1 and "[trigger]" in out.stdout, out.stdout


def test_an_uncertainty_trigger_draws_from_a_probe_of_its_own_and_leaves_the_control_arm_as_it_was(tmp_path):
    # The scripted policy samples (seeded action noise, RNG control): chunks drawn for one observation disagree.
    from rescue.core.records import ArmResult

    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=48)
    unsure, plain = tmp_path / "unsure.toml", tmp_path / "plain.toml"
    unsure.write_text('[[trigger]]\nname = "unsure"\nkind = "uncertainty"\nsamples = 3\nthreshold = 0.05\n\n'
                      '[[trigger]]\nname = "sure"\nkind = "uncertainty"\nsamples = 2\nthreshold = 1000.0\n')
    plain.write_text("fork_at_q = true\n")
    for name, config in (("unsure", unsure), ("plain", plain)):
        rescue_cli("run", str(manifest), "--study", str(tmp_path / name), "--config", str(config), *SCRIPTED_ARGS)
    assert rescue_cli("verify", str(tmp_path / "unsure")).returncode == 0
    control = ArmResult.model_validate_json(arm_rows(tmp_path / "unsure")[("object-3-ep0", "control")])
    before = ArmResult.model_validate_json(arm_rows(tmp_path / "plain")[("object-3-ep0", "control")])
    assert all(q.dispersion is not None and q.dispersion > 0.05 for q in control.queries)
    # It fires at the first step a trigger may (8); the other never does; the control's own draws are untouched.
    assert control.trigger_steps == {"unsure": 8, "sure": None}
    assert control.trace == before.trace and control.success == before.success
    rows = arm_rows(tmp_path / "unsure")
    assert json.loads(rows[("object-3-ep0", "assisted@unsure")])["assistance"]["query_step"] == 8
    assert json.loads(rows[("object-3-ep0", "assisted@sure")])["assistance"]["status"] == "not_asked"
