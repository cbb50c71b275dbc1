"""The sham arm (DESIGN §8): declared donors, its own verdict, and the assisted-vs-sham comparison."""

from __future__ import annotations

import pytest
from conftest import SCRIPTED_POLICY
from helpers.case_records import ORIGINAL, Q, injected, make_case, make_trace, sham_of, with_arms

from rescue.core.classify import classify
from rescue.core.digest import digest_text
from rescue.core.manifest import Case
from rescue.core.records import ArmResult, Assistance
from rescue.core.sham import DEFAULT_SHAM_TEXT, donor_group, sham_donors
from rescue.core.figures.stats import summarize

pytestmark = pytest.mark.fast

# The studies below test the sham arm's records, verify and resume, not what a policy sees: they run the scripted
# policy, which reads the simulator's state, so their arms render no camera.
SCRIPTED = f'[policy]\nfactory = "{SCRIPTED_POLICY}"\n'

H = 220


def _cases(n: int, tasks: int) -> list[Case]:
    return [
        Case(case_id=f"c{i}", suite="libero_object", task_id=i % tasks, init_state_index=i, env_seed=i, horizon=64, group="o")
        for i in range(n)
    ]


@pytest.mark.parametrize("n, tasks", [(2, 2), (7, 3), (10, 10), (9, 2), (12, 1), (5, 5)])
def test_donors_are_a_seeded_derangement_in_short_cycles_across_tasks(n, tasks):
    cases = _cases(n, tasks)
    task = {c.case_id: c.task for c in cases}
    donors = sham_donors(cases, seed=3)
    assert sorted(donors) == sorted(donors.values()) == sorted(task)  # a permutation of the cases
    assert all(case != donor for case, donor in donors.items())  # nobody is its own donor
    assert all(len(donor_group(donors, c)) in (2, 3) for c in donors)
    assert sum(len(donor_group(donors, c)) == 3 for c in donors) == (3 if n % 2 else 0)
    same_task = sum(task[c] == task[d] for c, d in donors.items())
    largest = max(sum(t == x for t in task.values()) for x in set(task.values()))
    if largest <= n - largest:
        assert same_task == 0  # the cohort allows every donor from another task
    assert sham_donors(cases, seed=3) == donors and sham_donors(cases, seed=4) != donors or n == 2


def _sham_arm(case: str, subgoal: str, *, source: str, success: bool, donor: str | None = None,
              call: str | None = None) -> ArmResult:
    instruction = injected(ORIGINAL, subgoal)
    return ArmResult(
        case_id=case, arm="sham", status="complete", success=success, steps=H,
        fingerprint=digest_text("initial state of the case"),
        trace=make_trace("sham", applied=instruction),
        assistance=Assistance(
            status="applied", query_step=Q, subgoal=subgoal, instruction=instruction,
            instruction_digest=digest_text(instruction), source=source,
            source_sha256=digest_text(subgoal) if source == "fixed" else None,
            donor_case_id=donor, call_id=call, request_id=f"req-{donor}" if donor else None,
        ),
    )


def _fixed(case_id: str, *, control=False, assisted=False, sham=False, text=DEFAULT_SHAM_TEXT):
    rec = make_case(case_id, control_success=control, assisted_success=assisted)
    return with_arms(rec, {"sham": _sham_arm(case_id, text, source="fixed", success=sham)},
                     sham_source="fixed", sham_text=DEFAULT_SHAM_TEXT)


def test_a_fixed_sham_arm_is_judged_against_control_by_the_same_rules():
    v = classify(_fixed("a", sham=True))
    assert v.label == "not_rescued" and v.arms["sham"].label == "rescued" and v.arms["sham"].in_e
    v = classify(_fixed("b", assisted=True))
    assert v.label == "rescued" and v.arms["sham"].label == "not_rescued" and v.arms["sham"].rule == 8
    # The headline is the assisted arm's, whatever the sham arm does.
    assert classify(_fixed("c", assisted=True, sham=True)).label == "rescued"


def test_a_sham_arm_that_applied_another_text_than_declared_has_no_evidence():
    v = classify(_fixed("a", sham=True, text="Pick up the ketchup.")).arms["sham"]
    assert v.label == "unknown" and v.rule == 6 and "fixed text" in v.reason
    v = classify(_fixed("a", sham=True, text="Pick up the ketchup."))
    assert v.label == "not_rescued"  # the headline does not move


def test_a_permuted_sham_arm_needs_its_declared_donors_receipt():
    donor = make_case("d", assisted_success=False)
    rec = with_arms(make_case("x"), {"sham": _sham_arm("x", donor.receipt.subgoals["req-d"], source="permuted",
                                                         success=True, donor="d", call=donor.receipt.call_id)},
                    {"sham": donor.receipt}, sham_source="permuted", sham_donor="d")
    assert classify(rec).arms["sham"].label == "rescued"
    # Another donor than declared, a receipt that does not name the donor, no receipt: no evidence.
    assert classify(rec.model_copy(update={"sham_donor": "e"})).arms["sham"].rule == 6
    other = make_case("e").receipt
    assert classify(with_arms(rec, receipts={"sham": other})).arms["sham"].rule == 6
    assert classify(with_arms(rec, receipts={"sham": None})).arms["sham"].rule == 6


def test_a_sham_arm_whose_donor_failed_is_unknown_and_the_headline_stands():
    rec = make_case("x", assisted_success=True)
    failed = rec.assisted.assistance.model_copy(update={
        "status": "broker_error", "subgoal": None, "instruction": None, "instruction_digest": None,
        "error_kind": "donor_failed", "source": "permuted", "donor_case_id": "d",
    })
    sham = ArmResult(case_id="x", arm="sham", status="complete", success=False, steps=H,
                     fingerprint=rec.control.fingerprint, trace=make_trace("sham"), assistance=failed)
    v = classify(with_arms(rec, {"sham": sham}, sham_source="permuted", sham_donor="d"))
    assert v.label == "rescued"
    assert v.arms["sham"].label == "unknown" and v.arms["sham"].rule == 3 and "donor_failed" in v.arms["sham"].reason


def test_assisted_vs_sham_reproduces_the_seeds_mcnemar_and_newcombes_interval():
    # 53 cases only the assisted arm succeeded, 47 only the sham arm, 500 neither: the seed's
    # confirmation counts, here as assisted against sham over K = 600.
    records, verdicts = [], []
    for i in range(600):
        assisted, sham = (True, False) if i < 53 else (False, True) if i < 100 else (False, False)
        rec = _fixed(f"k{i}", assisted=assisted, sham=sham)
        records.append(rec)
        verdicts.append(classify(rec))
    f, s = sham_of(summarize(records, verdicts))
    assert s.k == 600 and (s.pairs.first_only, s.pairs.second_only, s.pairs.both_fail) == (53, 47, 500)
    assert round(s.mcnemar_p, 4) == 0.6173
    assert (round(s.diff_ci[0], 4), round(s.diff_ci[1], 4)) == (-0.0229, 0.0430)
    assert s.diff == pytest.approx(6 / 600)
    assert f.counts["rescued"] == 47 and f.r == 47


def test_cases_without_both_subgoals_applied_stay_out_of_the_paired_comparison():
    ok = _fixed("ok", assisted=True)
    bad = _fixed("bad", sham=True, text="Pick up the ketchup.")  # sham not in E
    f, s = sham_of(summarize([ok, bad], [classify(ok), classify(bad)]))
    assert s.k == 1 and s.pairs.first_only == 1 and f.e == 1 and f.m == 2


def test_each_group_and_task_has_its_own_sham_comparison_not_the_studys():
    # Group "language": the sham rescues one of two cases; group "swap": it rescues none and the VLM one.
    rows = [("lan-1", "language", "t1", False, True), ("lan-2", "language", "t2", False, False),
            ("swap-1", "swap", "t1", True, False), ("swap-2", "swap", "t2", False, False)]
    records = []
    for case_id, group, task, assisted, sham in rows:
        rec = _fixed(case_id, assisted=assisted, sham=sham)
        records.append(rec.model_copy(update={"group": group, "task": task}))
    summary = summarize(records, [classify(r) for r in records])
    (wf, whole), (lf, lan), (sf, swap) = (sham_of(summary), sham_of(summary.per_group["language"]),
                                          sham_of(summary.per_group["swap"]))
    assert (wf.r, whole.k, whole.pairs.first_only, whole.pairs.second_only) == (1, 4, 1, 1)
    assert (lf.r, lan.k, lan.pairs.first_only, lan.pairs.second_only) == (1, 2, 0, 1)
    assert (sf.r, swap.k, swap.pairs.first_only, swap.pairs.second_only) == (0, 2, 1, 0)
    assert lan.diff == pytest.approx(-0.5) and swap.diff == pytest.approx(0.5) and whole.diff == pytest.approx(0.0)
    (t1f, t1), (t2f, t2) = sham_of(summary.per_task["t1"]), sham_of(summary.per_task["t2"])
    assert (t1f.r, t1.pairs.first_only) == (1, 1)
    assert (t2f.r, t2.k) == (0, 2)


@pytest.mark.sim
@pytest.mark.e2e
def test_a_three_arm_study_killed_and_resumed_verifies_with_its_sham_table(tmp_path):
    import json
    import sqlite3

    from conftest import kill_mid_study, rescue_cli, write_cases

    manifest = write_cases(tmp_path / "m.jsonl", 6, horizon=64)
    config = tmp_path / "study.toml"
    config.write_text('[sham]\nsource = "permuted"\nseed = 7\n' + SCRIPTED)
    study = tmp_path / "study"
    kill_mid_study(["run", str(manifest), "--study", str(study), "--config", str(config), "--cases-in-flight", "1"], study)
    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True)
    before = dict(con.execute("SELECT case_id || '/' || arm, data FROM arms"))
    donors = json.loads(dict(con.execute("SELECT key, value FROM meta"))["sham_donors"])
    con.close()
    assert {k.split("/")[1] for k in before} == {"control", "assisted", "sham"}

    rescue_cli("resume", str(study))
    assert rescue_cli("verify", str(study)).returncode == 0
    rescue_cli("export", str(study))
    export = json.loads((study / "export.json").read_text())
    assert export["schema_version"] == "rescue-export/8"
    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True)
    after = dict(con.execute("SELECT case_id || '/' || arm, data FROM arms"))
    con.close()
    assert all(after[k] == v for k, v in before.items())  # nothing that ran before the kill ran again
    cases = {c["case_id"]: c for c in export["cases"]}
    sham_label = {cid: (c["verdicts"].get("sham") or {}).get("label") for cid, c in cases.items()}
    assert any(c["state"] == "interrupted" and sham_label[cid] == "unknown" for cid, c in cases.items())
    from rescue.study.receipts import outcomes_by_call, read_receipt_file

    outcomes = outcomes_by_call(read_receipt_file(study / "receipts" / "receipts.jsonl"))
    applied = 0
    for cid, c in cases.items():
        sham, donor = c["arms"]["sham"], cases[donors[cid]]
        if sham and sham["assistance"] == "applied":
            applied += 1
            # The sham arm applied its declared donor's answer, from the donor's own call's receipt
            # (the donor case itself may have been interrupted after its answer arrived).
            assert sham["source"] == "permuted" and sham["donor_case_id"] == donors[cid]
            receipt = outcomes[sham["call_id"]].receipt
            assert donors[cid] in receipt.case_ids and receipt.subgoals[sham["request_id"]] == sham["subgoal"]
            if donor["arms"]["assisted"] is not None:
                assert sham["call_id"] == donor["arms"]["assisted"]["call_id"]
    assert applied >= 2
    table = next(c for c in export["summary"]["comparisons"] if (c["first"], c["second"]) == ("assisted", "sham"))
    assert table["k"] == sum(
        1 for cid, c in cases.items()
        if c["state"] == "finished" and c["in_e"] and sham_label[cid] not in (None, "unknown", "initial_state_deviation")
        and c["arms"]["sham"]["assistance"] == "applied"
    )
    pairs = table["pairs"]
    assert pairs["first_only"] + pairs["second_only"] + pairs["both_success"] + pairs["both_fail"] == table["k"]
    # The report shows the same table, figure for figure.
    rescue_cli("report", str(study))
    page = (study / "report.html").read_text()
    assert "assisted vs sham" in page
    for name in ("k", "first_only", "second_only", "both_fail"):
        value = table[name] if name == "k" else pairs[name]
        assert f'.sham.{name}" data-value="{value}"' in page, name


@pytest.mark.sim
@pytest.mark.e2e
def test_tampering_with_a_sham_trace_row_or_its_source_fails_verify(tmp_path):
    import json
    import shutil
    import sqlite3

    from conftest import rescue_cli, write_cases

    from rescue.core.records import ArmResult
    from rescue.study.journal import arm_digest

    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=64)
    config = tmp_path / "study.toml"
    config.write_text('[sham]\nsource = "fixed"\n' + SCRIPTED)
    study = tmp_path / "study"
    rescue_cli("run", str(manifest), "--study", str(study), "--config", str(config), check=False)
    assert rescue_cli("verify", str(study)).returncode == 0

    def forged(name: str, change) -> int:
        copy = shutil.copytree(study, tmp_path / name)
        con = sqlite3.connect(copy / "journal.sqlite")
        case_id, data = con.execute("SELECT case_id, data FROM arms WHERE arm = 'sham' LIMIT 1").fetchone()
        obj = json.loads(data)
        change(obj)
        new = ArmResult.model_validate(obj)
        # A consistent forgery: the record's digest is recomputed, only the re-derivation can tell.
        con.execute("UPDATE arms SET data = ?, digest = ? WHERE case_id = ? AND arm = 'sham'",
                    (new.model_dump_json(), arm_digest(new), case_id))
        con.commit()
        con.close()
        return rescue_cli("verify", str(copy), check=False).returncode

    def row_before_q(obj):
        obj["trace"][0]["actions"] = digest_text("other actions")

    def another_source(obj):
        obj["assistance"]["subgoal"] = "Pick up the ketchup."

    assert forged("row", row_before_q) != 0
    assert forged("source", another_source) != 0
    # And the declaration itself: a config.json with another fixed text no longer hashes to the study's.
    copy = shutil.copytree(study, tmp_path / "text")
    cfg = json.loads((copy / "config.json").read_text())
    cfg["sham"]["text"] = "Pick up the ketchup."
    (copy / "config.json").write_text(json.dumps(cfg))
    assert rescue_cli("verify", str(copy), check=False).returncode != 0


def test_a_fixed_sham_text_can_be_declared_per_task_and_counts_in_the_digest_only_when_set():
    from pydantic import ValidationError

    from rescue.core.configuration.config import StudyConfig
    from rescue.core.sham import ShamConfig

    sham = ShamConfig(source="fixed", by_task={"libero_object/0": "grasp the butter"})
    assert sham.text_for("libero_object/0") == "grasp the butter"
    assert sham.text_for("libero_object/3") == DEFAULT_SHAM_TEXT  # tasks not listed get `text`
    with pytest.raises(ValidationError, match="libero_object/1"):
        ShamConfig(source="fixed", by_task={"libero_object/1": "  "})
    plain = StudyConfig(sham={"source": "fixed"})
    assert plain.sham.by_task is None
    declared = StudyConfig(sham={"source": "fixed", "by_task": {"libero_object/0": "grasp the butter"}})
    other = StudyConfig(sham={"source": "fixed", "by_task": {"libero_object/0": "grasp the milk"}})
    assert len({plain.sha256(), declared.sha256(), other.sha256()}) == 3
    # A config written before the setting existed hashes as before.
    data = plain.model_dump(mode="json")
    data["sham"].pop("by_task")
    assert StudyConfig.model_validate(data).sha256() == plain.sha256()


@pytest.mark.sim
@pytest.mark.e2e
def test_a_per_task_fixed_sham_applies_each_tasks_declared_text_and_verifies(tmp_path):
    import json

    from conftest import export_of, rescue_cli, write_cases

    one = write_cases(tmp_path / "a.jsonl", 2, horizon=48, task_id=3).read_text()
    two = write_cases(tmp_path / "b.jsonl", 2, horizon=48, task_id=4).read_text()
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(one + two)
    config = tmp_path / "study.toml"
    config.write_text('[sham]\nsource = "fixed"\n[sham.by_task]\n"libero_object/3" = "grasp the butter"\n' + SCRIPTED)
    study = tmp_path / "study"
    rescue_cli("run", str(manifest), "--study", str(study), "--config", str(config))
    assert rescue_cli("verify", str(study)).returncode == 0
    cases = {c["case_id"]: c for c in export_of(study)["cases"]}
    assert len(cases) == 4
    for cid, c in cases.items():
        want = "grasp the butter" if cid.startswith("object-3-") else DEFAULT_SHAM_TEXT
        assert c["arms"]["sham"]["assistance"] == "applied" and c["arms"]["sham"]["subgoal"] == want, cid
    # The declaration is part of the study's stored configuration (and of its digest).
    stored = json.loads((study / "config.json").read_text())
    assert stored["sham"]["by_task"] == {"libero_object/3": "grasp the butter"}
