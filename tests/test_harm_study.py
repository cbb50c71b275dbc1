"""A study of failures and historical successes (DESIGN §17) through the read side: the stored verdicts, the
summary's harm section, export (rescue-export/8), the terminal and the report's first screen, and `rescue verify`
re-deriving every figure and catching a success's tampered label. Built by the library's own writers, as
tests/test_export_verify.py builds its study; no simulator runs."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from helpers.harm_study import FRAME, build
from rich.console import Console

from rescue.read.export import export_study, read_export, write_export
from rescue.read.terminal import render_summary
from rescue.read.verify import verify_study
from rescue.study.folder import store_summary

pytestmark = pytest.mark.fast



@pytest.fixture(scope="module")
def harm_study(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("harm") / "study-harm")


def test_labels_figures_and_net_change_of_a_mixed_study(harm_study):
    export = export_study(harm_study)
    assert export.schema_version == "rescue-export/8"
    labels = {c.case_id: (c.outcome, c.label) for c in export.cases}
    assert labels == {"f-rescued": ("failure", "rescued"), "f-both-fail": ("failure", "not_rescued"),
                      "s-broken": ("success", "broken"), "s-kept": ("success", "kept"), "s-early": ("success", "kept")}
    s = export.summary
    assert (s.n, s.r) == (2, 1)  # the failures' summary, as before
    harm = s.harm.of("assisted")
    # `kept` counts the one reached; the one that ended before q is said apart.
    assert (harm.n, harm.exposed, harm.unreached, harm.m) == (3, 2, 1, 2)
    assert (harm.counts["broken"], harm.counts["kept"]) == (1, 1)
    assert harm.harm.diff == pytest.approx(0.5) and harm.rescue.diff == pytest.approx(0.5)
    lo, hi = harm.harm.diff_ci
    assert lo < 0 < 0.5 < hi  # two exposed pairs say little, and the interval says so
    assert s.harm.frame == FRAME
    # (F * rescue - S * harm) / N, the successes' harm over all three sampled (the early one counts 0).
    net = harm.net
    assert net.change == pytest.approx((2 * 0.5 - 30 * (1 / 3)) / 32)
    assert net.successes.sampled == 3 and not net.successes.census and net.failures.census
    these, bench = net.these_episodes, net.benchmark
    assert these.low < net.change < these.high and not these.exact
    assert bench.low <= these.low and these.high <= bench.high
    assert s.harm.per_task["libero_spatial/0"][0].net.change == pytest.approx(net.change)
    # The breakdown carries the primary against control (the defect: only against the sham before).
    assert s.per_group["spatial"].versus_control.pairs.first_only == 1


def test_the_export_reads_back_and_the_terminal_and_report_open_with_the_net_change(harm_study, tmp_path):
    out = tmp_path / "export.json"
    write_export(export_study(harm_study), out, tmp_path / "export.csv")
    again = read_export(out)
    assert again.summary.harm == export_study(harm_study).summary.harm
    console = Console(record=True, width=200)
    console.print(render_summary(again))
    text = " ".join(console.export_text().split())  # the sentence as read, wrapped lines joined
    assert ("turning assisted on at the pre-registered q would change the success rate of the manifest's own 32 "
            "episodes (libero_spatial; no evaluation named) from 93.8% to 65.6%") in text
    assert "for these 32 episodes [" in text and "extrapolated from 3 of its 30 successes" in text
    assert "for the benchmark (the suite's initial states) [" in text
    assert "historical successes" in text and "p vs control" in text
    assert "of which have a verdict" not in text  # N is the failures': both have one
    from rescue.read.html.report import write_report

    page = write_report(harm_study).read_text()
    first = page.index('data-answer="net"')
    assert first < page.index('data-answer="main"') and "extrapolated from 3 of its 30 successes" in page
    assert 'data-harm="assisted"' in page and 'data-figure="harm.assisted.net.benchmark"' in page


def test_verify_rederives_the_harm_figures_and_catches_a_tampered_success_label(harm_study, tmp_path):
    assert verify_study(harm_study).ok
    copy = Path(shutil.copytree(harm_study, tmp_path / "tampered"))
    conn = sqlite3.connect(copy / "journal.sqlite")
    (data,) = conn.execute("SELECT data FROM verdicts WHERE case_id = 's-broken'").fetchone()
    obj = json.loads(data)
    obj["label"] = "kept"
    conn.execute("UPDATE verdicts SET data = ? WHERE case_id = 's-broken'", (json.dumps(obj),))
    conn.commit()
    conn.close()
    report = verify_study(copy)
    assert not report.ok
    assert any("stored verdict kept (rule 8) differs from the recomputed broken" in p.message for p in report.problems)
    # A stored harm figure edited is caught too.
    copy2 = Path(shutil.copytree(harm_study, tmp_path / "tampered-summary"))
    conn = sqlite3.connect(copy2 / "journal.sqlite")
    (meta,) = conn.execute("SELECT value FROM meta WHERE key = 'summary'").fetchone()
    summary = json.loads(meta)
    summary["harm"]["arms"][0]["counts"]["broken"] = 0
    conn.execute("UPDATE meta SET value = ? WHERE key = 'summary'", (json.dumps(summary),))
    conn.commit()
    conn.close()
    report = verify_study(copy2)
    assert any(p.check == "summary" and "harm.arms[0].counts.broken" in p.message for p in report.problems)


def test_an_export_of_the_previous_version_reads_unchanged(harm_study, tmp_path):
    write_export(export_study(harm_study), tmp_path / "e.json", tmp_path / "e.csv")
    data = json.loads((tmp_path / "e.json").read_text())
    data["schema_version"] = "rescue-export/5"
    del data["summary"]["harm"]
    for case in data["cases"]:
        case.pop("outcome", None)
    for b in data["summary"]["per_group"].values():
        b.pop("versus_control", None)
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = read_export(tmp_path / "old.json")
    assert old.schema_version == "rescue-export/5" and old.summary.harm is None and old.summary.r == 1


def test_verify_catches_a_frame_edited_consistently_in_manifest_journal_and_summary(harm_study, tmp_path):
    """S raised from 30 to 60 in every row of the manifest and of the journal, the summary stored again: every
    figure agrees with the edited records, but the manifest no longer hashes to what the study was created from."""
    copy = Path(shutil.copytree(harm_study, tmp_path / "edited-frame"))
    rows = [json.loads(line) for line in (copy / "manifest.jsonl").read_text().splitlines()]
    for row in rows:
        row["tags"]["frame_successes"] = row["tags"]["frame_task_successes"] = 60
        row["tags"]["frame_episodes"] = 62
    (copy / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    conn = sqlite3.connect(copy / "journal.sqlite")
    for (case_id, data) in conn.execute("SELECT case_id, data FROM cases").fetchall():
        obj = json.loads(data)
        obj["tags"].update(frame_successes=60, frame_task_successes=60, frame_episodes=62)
        conn.execute("UPDATE cases SET data = ? WHERE case_id = ?", (json.dumps(obj), case_id))
    conn.commit()
    conn.close()
    store_summary(copy)
    report = verify_study(copy)
    assert not report.ok
    assert [p.check for p in report.problems] == ["manifest"]
    assert "hashes to" in report.problems[0].message and "changed since" in report.problems[0].message
    # One row edited alone: the rows disagree on the frame, and verify names the tag.
    rows[0]["tags"]["frame_successes"] = 61
    (copy / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    messages = [p.message for p in verify_study(copy).problems]
    assert any("disagree on the sampling frame's 'frame_successes'" in m for m in messages)
