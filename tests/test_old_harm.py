"""A study and an export of `rescue-export/6` (historical successes, as DESIGN §17 first landed) read, verify,
export and report with today's code; the old figures are re-derived as that version computed them, and tampering
with them is still caught.

`tests/data/study_v6_harm/` was made by main at e6bd0b2 (the commit before this version), on real LIBERO: `rescue
eval --suite libero_object --tasks 0,1,2 --episodes 3` of the embedded vision-language policy (6 failures, 3
successes), `rescue manifest from-eval --limit 2 --successes 2 --seed 3` (the first two failures and a sample of
two successes drawn by that version's sampler), and `rescue run` with `[[query_point]] early = 0.25`, a fixed sham
and `keyframes = false`. It verified; then its WAL was checkpointed into the journal, its logs and export removed,
and the journal's `manifest_source` shortened to the manifest's file name. `tests/data/export_v6/export.json` is
its `rescue export` by that commit: a net change of +0.0 pp with the interval [0.0, 0.0], extrapolated from the
first two failures to all six, the defect this version refuses.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from rescue.read.export import EXPORT_SCHEMA, export_study, read_export
from rescue.read.verify import verify_study

pytestmark = pytest.mark.fast

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def study(tmp_path) -> Path:
    return Path(shutil.copytree(DATA / "study_v6_harm", tmp_path / "harm6"))


def _summary(study: Path) -> dict:
    con = sqlite3.connect(study / "journal.sqlite")
    try:
        return json.loads(dict(con.execute("SELECT key, value FROM meta"))["summary"])
    finally:
        con.close()


def _store(study: Path, summary: dict) -> None:
    con = sqlite3.connect(study / "journal.sqlite")
    con.execute("UPDATE meta SET value = ? WHERE key = 'summary'", (json.dumps(summary),))
    con.commit()
    con.close()


def test_an_export_of_the_version_before_reads_into_todays_shape_with_its_figures():
    old = json.loads((DATA / "export_v6" / "export.json").read_text())
    export = read_export(DATA / "export_v6" / "export.json")
    assert export.schema_version == "rescue-export/6"
    for stored, read in zip(old["summary"]["harm"]["arms"], export.summary.harm.arms):
        assert read.arm == stored["arm"] and read.net.change == stored["net"]["change"]
        # The one interval it had was about these episodes; it had none for the benchmark.
        assert [read.net.these_episodes.low, read.net.these_episodes.high] == stored["net"]["change_ci"]
        assert read.net.benchmark is None and read.net.method == stored["net"]["method"]
        # `kept` then counted the unreached successes; read today, they are said apart.
        assert read.unreached == stored["n"] - stored["exposed"]
        assert read.counts["kept"] + read.unreached == stored["counts"]["kept"]
        ci = stored["harm"]["diff_ci"]  # None where no pair was exposed
        assert read.harm.diff == stored["harm"]["diff"] and read.harm.diff_ci == (None if ci is None else tuple(ci))


def test_the_old_study_verifies_its_old_figures_and_catches_an_edited_one(study, tmp_path):
    report = verify_study(study)
    assert report.ok, [p.message for p in report.problems]
    summary = _summary(study)
    assert "change_ci" in summary["harm"]["arms"][0]["net"]  # stored in that version's shape
    summary["harm"]["arms"][0]["net"]["change_ci"] = [-0.1, 0.1]
    _store(study, summary)
    report = verify_study(study)
    assert any(p.check == "summary" and "harm.arms[0].net.change_ci" in p.message for p in report.problems)


def test_todays_export_of_the_old_study_refuses_to_extrapolate_its_first_failures(study):
    export = export_study(study)
    assert export.schema_version == EXPORT_SCHEMA
    for figures in export.summary.harm.arms:
        assert figures.net.change is None
        assert "first 2 of the evaluation's 6 (--limit 2)" in figures.net.refused
    early = export.summary.harm.of("assisted@early")
    assert early.exposed == 2 and early.counts["kept"] == 2 and early.harm.diff_ci[0] < 0 < early.harm.diff_ci[1]


def test_the_old_study_reports(study):
    from rescue.read.html.report import write_report

    page = write_report(study).read_text()
    assert 'data-figure="harm.assisted.net.refused"' in page and "--limit 2" in page
