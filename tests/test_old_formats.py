"""Studies and exports made before the arm-against-arm record family (`rescue-export/4`) read, verify, export and
report with today's code, and tampering with their old-shaped records is still caught.

`tests/data/study_v4_advisors/` and `study_v4_plain/` were made by main at e2dc5e3 (the commit before the record
family): four `libero_object` task-3 cases at horizon 48 (the last a declared pilot) with the scripted policy, fork
at q, two advisors (the bundled endpoint, and a loopback `rescue serve-vlm --answer "fixed:Continue with the
task."` with a declared price) and a permuted sham; and three such cases with one `[vlm]` and no sham. Each ran to
the end and verified; then its WAL was checkpointed into the journal, its logs (not evidence) and export removed,
and the journal's `manifest_source` shortened to the manifest's file name. `tests/data/export_v4/export.json` is
the advisors study's `rescue export` by that commit.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from golden_outputs import GOLDEN, STUDIES, outputs

from rescue.core.figures.comparison import EXCLUDED, Episode, compare_episodes
from rescue.read.comparison import ComparisonError, read_comparison
from rescue.read.export import EXPORT_SCHEMA, export_study, read_export
from rescue.read.status import study_status
from rescue.read.verify import verify_study

pytestmark = pytest.mark.fast

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def advisors(tmp_path) -> Path:
    return Path(shutil.copytree(DATA / "study_v4_advisors", tmp_path / "advisors"))


@pytest.fixture
def plain(tmp_path) -> Path:
    return Path(shutil.copytree(DATA / "study_v4_plain", tmp_path / "plain"))


def _stored(study: Path) -> tuple[dict, dict]:
    con = sqlite3.connect(study / "journal.sqlite")
    try:
        verdicts = {c: json.loads(d) for c, d in con.execute("SELECT case_id, data FROM verdicts")}
        summary = json.loads(dict(con.execute("SELECT key, value FROM meta"))["summary"])
    finally:
        con.close()
    return verdicts, summary


def _edit(study: Path, sql: str, *args) -> None:
    con = sqlite3.connect(study / "journal.sqlite")
    con.execute(sql, args)
    con.commit()
    con.close()


def test_old_studies_hold_old_shaped_records_and_verify_as_they_are(advisors, plain):
    verdicts, summary = _stored(advisors)
    # What the journal holds is the shape of before: a sham verdict and every advisor's under their own keys.
    assert all("sham" in v and list(v["advisors"]) == ["local", "continue"] for v in verdicts.values())
    assert "advisor_pairs" in summary and "assisted_only" in summary["pairs"]
    for study in (advisors, plain):
        report = verify_study(study)
        assert report.ok, [p.message for p in report.problems]
        assert report.checked["summary"] == 1 and report.checked["verdicts"] == (4 if study == advisors else 3)


def test_an_old_study_exports_in_todays_shape_with_the_figures_it_stored(advisors):
    export = export_study(advisors)
    assert export.schema_version == EXPORT_SCHEMA == "rescue-export/8"
    verdicts, stored = _stored(advisors)
    s = export.summary
    assert s.arm == "assisted:local" and (s.n, s.r, s.m, s.e) == (stored["n"], stored["r"], stored["m"], stored["e"])
    assert s.versus_control.pairs.first_only == stored["pairs"]["assisted_only"]
    assert [f.arm for f in s.arms] == ["assisted:continue", "sham"]
    old_sham, sham = stored["sham"], s.comparison("assisted:local", "sham")
    assert (sham.k, sham.pairs.first_only, sham.pairs.second_only, sham.mcnemar_p) == (
        old_sham["k"], old_sham["pairs"]["assisted_only"], old_sham["pairs"]["sham_only"], old_sham["mcnemar_p"])
    pair = s.comparison("assisted:local", "assisted:continue")
    (old_pair,) = stored["advisor_pairs"]
    assert (pair.k, pair.holm_p, pair.diff_ci) == (old_pair["k"], old_pair["holm_p"], tuple(old_pair["diff_ci"]))
    for case in export.cases:
        old = verdicts.get(case.case_id)
        if old is None:
            continue
        assert list(case.arms) == ["control", "assisted:local", "assisted:continue", "sham"]
        assert case.verdicts["sham"].label == old["sham"]["label"]
        assert case.verdicts["assisted:continue"].rule == old["advisors"]["continue"]["rule"]
        assert case.verdict("assisted:local").label == old["advisors"]["local"]["label"] == case.label


def test_an_old_studys_status_counts_each_arms_old_shaped_labels(advisors):
    verdicts, _ = _stored(advisors)
    status = study_status(advisors)
    main = [v for c, v in verdicts.items() if c != "object-3-ep3"]  # the pilot is not in the main cohort
    assert list(status.arm_labels) == ["assisted:local", "assisted:continue", "sham"]
    for arm, key in (("assisted:continue", lambda v: v["advisors"]["continue"]), ("sham", lambda v: v["sham"])):
        assert sum(status.arm_labels[arm].values()) == len(main)
        assert status.arm_labels[arm][key(main[0])["label"]] == sum(key(v)["label"] == key(main[0])["label"] for v in main)


def test_editing_an_old_studys_stored_sham_verdict_or_summary_fails_verify_naming_it(advisors, plain):
    case_id = "object-3-ep0"
    _edit(advisors, "UPDATE verdicts SET data = json_set(data, '$.sham.label', 'rescued', '$.sham.rule', 9) "
                    "WHERE case_id = ?", case_id)
    problems = [p.message for p in verify_study(advisors).problems]
    assert any(p.startswith("stored verdict of the sham arm rescued (rule 9) differs") for p in problems), problems
    _edit(plain, "UPDATE meta SET value = json_set(value, '$.pairs.assisted_only', 3) WHERE key = 'summary'")
    problems = [p.message for p in verify_study(plain).problems]
    assert any("stored summary differs" in p and "pairs.assisted_only" in p for p in problems), problems


def test_editing_a_further_advisors_label_names_that_advisor(advisors):
    _edit(advisors, "UPDATE verdicts SET data = json_set(data, '$.advisors.continue.label', 'rescued') "
                    "WHERE case_id = 'object-3-ep1'")
    problems = [p for p in verify_study(advisors).problems if p.check == "verdict"]
    assert problems and all("assisted:continue" in p.message for p in problems), [p.message for p in problems]


def test_an_export_of_the_version_before_reads_into_todays_shape():
    old = json.loads((DATA / "export_v4" / "export.json").read_text())
    assert old["schema_version"] == "rescue-export/4"
    export = read_export(DATA / "export_v4" / "export.json")
    assert export.schema_version == "rescue-export/4"  # what the document is; its contents in today's shape
    s, o = export.summary, old["summary"]
    assert s.arm == "assisted:local" and (s.r, s.m, s.e) == (o["r"], o["m"], o["e"])
    assert [f.arm for f in s.arms] == ["assisted:continue", "sham"]
    assert s.arms[1].versus_control is None  # the old document kept no sham-vs-control comparison
    assert s.arms[0].versus_control.pairs.first_only == o["advisors"][1]["pairs"]["assisted_only"]
    pair = s.comparison("assisted:local", "assisted:continue")
    assert pair.holm_p == o["advisor_pairs"][0]["holm_p"]
    assert s.comparison("assisted:continue", "sham").k == o["advisors"][1]["sham"]["k"]
    for case, before in zip(export.cases, old["cases"]):
        assert case.primary == "assisted:local" and case.assisted == case.arms["assisted:local"]
        assert (case.arms["sham"] is None) == (before["sham"] is None)
        if before["sham_label"] is not None:
            assert case.verdicts["sham"].label == before["sham_label"]
            assert case.verdicts["assisted:continue"].label == before["advisors"]["continue"]["label"]


def test_an_old_study_reports_with_its_advisors_and_its_sham(advisors, plain):
    from rescue.read.html.report import write_report

    for study in (advisors, plain):
        page = write_report(study).read_text(encoding="utf-8")
        assert 'data-figure="main.n"' in page and "assisted vs control over M" in page
    page = (advisors / "report.html").read_text(encoding="utf-8")
    assert "assisted vs sham" in page and 'data-figure="main.pair.local.continue.k"' in page


def test_an_old_arm_records_receipt_reads_as_its_receipt_ref(advisors):
    # Arm records written before the field was named for what it holds call the reference `receipt`.
    con = sqlite3.connect(advisors / "journal.sqlite")
    try:
        stored = [json.loads(d)["assistance"] for (d,) in con.execute("SELECT data FROM arms")]
    finally:
        con.close()
    refs = [a["receipt"] for a in stored if a.get("receipt") is not None]
    assert refs and all("receipt_ref" not in a for a in stored)
    assert verify_study(advisors).checked["receipt references"] == len(refs)


# `tests/data/comparison_v1/comparison.json` is a `rescue-comparison/1` document written by `compare_episodes` at
# 7b91aca (the commit before the comparison spoke the record family): 13 pairs on two tasks and two groups, with
# one pair of each excluded kind, seed 3, 200 resamples.
COMPARISON_V1 = DATA / "comparison_v1" / "comparison.json"


def test_a_comparison_of_the_version_before_reads_into_todays_shape():
    old = json.loads(COMPARISON_V1.read_text())
    assert old["schema_version"] == "rescue-comparison/1"
    c = read_comparison(COMPARISON_V1)
    assert c.schema_version == "rescue-comparison/1"  # what the document is; its contents in today's shape
    k, v, o = c.counts, c.counts.versus, old["counts"]
    assert (v.first, v.second) == ("b", "a")
    assert (k.n, v.k, v.pairs.first_only, v.pairs.second_only) == (o["n"], o["paired"], o["wins"], o["losses"])
    assert (v.pairs.both_success, v.pairs.both_fail) == (o["both_success"], o["both_fail"])
    assert (v.mcnemar_p, v.diff, list(v.diff_ci)) == (old["mcnemar_p"], old["diff"], old["newcombe_ci"])
    assert [getattr(k, s) for s in EXCLUDED] == [o[s] for s in EXCLUDED]
    for key in ("per_task", "per_group"):
        for name, before in old[key].items():
            now = getattr(c, key)[name]
            assert (now.n, now.versus.k, now.versus.pairs.first_only, now.versus.pairs.second_only, now.unknown) == (
                before["n"], before["paired"], before["wins"], before["losses"], before["unknown"])
    assert (c.a_rate, c.b_rate, c.excluded, len(c.pairs)) == (old["a_rate"], old["b_rate"], old["excluded"], len(old["pairs"]))


def test_todays_comparison_reads_back_as_it_was_written_and_an_unknown_version_is_one_line(tmp_path):
    episodes = [Episode(case_id=f"e{i}", task="t", group="g", label=label, fingerprint="f")
                for i, label in enumerate(("success", "failure", "success"))]
    written = compare_episodes(episodes, list(reversed(episodes)), reps=50)
    path = tmp_path / "comparison.json"
    path.write_text(written.model_dump_json())
    assert read_comparison(path) == written and written.schema_version == "rescue-comparison/2"
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": "rescue-comparison/9"}))
    with pytest.raises(ComparisonError, match="comparison schema 'rescue-comparison/9'; this version reads"):
        read_comparison(path)


def test_failures_only_studies_without_triggers_keep_every_output_byte_for_byte(tmp_path):
    # Made by main at 44bd657 (tests/golden_outputs.py): the export (its version line aside), its CSV, the report
    # and its files, and the status, digest for digest.
    golden = json.loads(GOLDEN.read_text())
    for study in STUDIES:
        found = outputs(study, tmp_path)
        changed = sorted(k for k in set(found) | set(golden[study]) if found.get(k) != golden[study].get(k))
        assert not changed, f"{study}: {changed}"


def test_a_rescue_export_7_document_reads_as_it_was_written(plain):
    # `tests/data/export_v7/export.json`: the plain study's export by main at 44bd657 (rescue-export/7), the version
    # before triggers, declining and asking again.
    old = read_export(DATA / "export_v7" / "export.json")
    assert old.schema_version == "rescue-export/7"
    now = export_study(plain)
    assert now.schema_version == "rescue-export/8"
    assert old.model_dump(exclude={"schema_version"}) == now.model_dump(exclude={"schema_version"})
    assert old.summary.asking is None and all(not a.again for c in old.cases for a in c.arms.values() if a)
