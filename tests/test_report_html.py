"""`rescue report`: the plain reading of the statistics, a self-contained page whose figures equal the export's
(read back from a real headless Chromium), continuation partitions, and images from a real run.

The synthetic study is built with the library as the engine builds one (see
test_export_verify.build_study); the real one runs LIBERO through the CLI.
"""

from __future__ import annotations

import ast
from html import unescape
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import HANG_S, ROOT, rescue_cli, write_cases
from helpers.report_pages import check_figures, expected_figure, parse, shown_text
from helpers.study_builder import build_study

from rescue.core.figures.exact_stats import mcnemar_exact, paired_diff_ci, wilson_interval
from rescue.read.export import export_study
from rescue.read.html.app import read_index_script, read_panel_script
from rescue.read.html.report import write_report
from rescue.read.html.significance import significance_reading
from rescue.study.journal import Journal
from rescue.study.layout import report_files

pytestmark = pytest.mark.fast


# --- the reading of p and the CI together (pure) --------------------------------------


def test_reading_when_p_and_an_interval_excluding_zero_disagree():
    # The demo's shape: 3 assisted-only, 0 control-only out of 4 pairs.
    p, ci = mcnemar_exact(3, 0), paired_diff_ci(3, 0, 4)
    assert p == pytest.approx(0.25) and ci[0] > 0
    text = significance_reading(3, 0, p, ci)
    assert "disagree" in text and "3 pair(s) are discordant" in text
    assert "cannot reach p < 0.05" in text and "not yet established" in text and "helps" in text


def test_reading_when_both_agree_or_nothing_is_known():
    p, ci = mcnemar_exact(20, 2), paired_diff_ci(20, 2, 60)
    assert p < 0.05 and ci[0] > 0
    assert significance_reading(20, 2, p, ci).startswith("Both agree: the assisted arm helps")
    p, ci = mcnemar_exact(2, 20), paired_diff_ci(2, 20, 60)
    assert significance_reading(2, 20, p, ci).startswith("Both agree: the assisted arm hurts")
    p, ci = mcnemar_exact(4, 3), paired_diff_ci(4, 3, 40)
    assert "no clear effect" in significance_reading(4, 3, p, ci)
    assert "never disagreed" in significance_reading(0, 0, 1.0, paired_diff_ci(0, 0, 5))
    assert "No pair is in M" in significance_reading(0, 0, 1.0, None)
    assert "No pair is in M" in significance_reading(0, 0, 1.0, (math.nan, math.nan))


def test_reading_with_many_discordant_pairs_says_little_power_not_impossible():
    text = significance_reading(7, 1, 0.0703, (0.01, 0.3))
    assert "little power" in text and "cannot reach" not in text


def test_keyframes_are_shown_in_episode_order():
    from rescue.read.html.cases import keyframe_order

    assert sorted(["end", "q112", "s0016", "q48"], key=keyframe_order) == ["s0016", "q48", "q112", "end"]


def test_reading_when_p_is_small_but_the_interval_includes_zero():
    assert "borderline" in significance_reading(9, 1, 0.0215, (-0.01, 0.4))


# --- the page ---------------------------------------------------------------------


def panel_html(report: Path, case_id: str) -> str:
    """The markup of one case's panel, from its own file beside the page."""
    cid, html = read_panel_script((report_files(report) / "case" / f"{case_id}.js").read_text(encoding="utf-8"))
    assert cid == case_id
    return html


def index_of(report: Path) -> dict:
    """The case list's index: its layout and one row per case."""
    return read_index_script((report_files(report) / "cases.js").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    # Named as the demo names its study folder: the title must still say which study it is.
    return build_study(tmp_path_factory.mktemp("demo-20260101-000000") / "rescue")


@pytest.fixture(scope="module")
def report(synthetic) -> Path:
    return write_report(synthetic)


def test_the_page_is_self_contained_and_holds_every_part(synthetic, report):
    html = report.read_text(encoding="utf-8")
    page = parse(html)
    folder = report_files(report)
    assert folder.name == "report_files" and folder.is_dir()
    # Every image, video, script and link of the page and of every case panel resolves to a file in the
    # folder beside the page; nothing from a network.
    panels = [panel_html(report, c.case_id) for c in export_study(synthetic).cases]
    for text in (html, *panels):
        assert not re.search(r"(src|href)=\"(https?:|//|/)", text)
    assert re.findall(r'<script src="([^"]+)"', html) == ["report_files/cases.js"]
    srcs = page.srcs + [x for p in panels for x in parse(p).srcs]
    hrefs = page.hrefs + [x for p in panels for x in parse(p).hrefs]
    local = [x for x in srcs + hrefs if not x.startswith("#")]
    assert local and all((report.parent / x).is_file() for x in local), local
    assert all(x.startswith("report_files/") for x in local)
    for name in ("rate-group", "rate-task", "outcomes", "latency", "steps"):
        assert (folder / f"plot-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The title names the study and its kind, never "Rescue study rescue".
    assert page.title.startswith("demo-20260101-000000") and page.title.endswith("/rescue · rescue study report")
    assert "Rescue study rescue" not in html
    for section in ("Summary (main cohort)", "Per group", "Per task", "Pilot cases", "VLM usage", "Cases", "Case panels"):
        assert re.search(f"<h2[^>]*>{re.escape(section)}", html), section
    assert "Declared before the run: pilot-1" in html
    assert "cost" in html and "not configured" in html


def test_the_page_figures_equal_the_export(synthetic, report):
    export = export_study(synthetic)
    page = parse(report.read_text(encoding="utf-8"))
    assert check_figures(page, export) > 60
    s = export.summary
    for key in ("n", "m", "e", "r_over_n", "r_over_m", "r_over_e", "mcnemar_p", "diff", "diff_ci", "first_only", "both_fail"):
        assert f"main.{key}" in page.figures
    assert {f"main.task.{t}.n" for t in s.per_task} <= set(page.figures)
    assert "pilot.n" in page.figures and "usage.tokens.input.calls_without" in page.figures


def test_the_page_opens_on_its_answer_then_folds_what_produced_it(synthetic, report, tmp_path):
    html = report.read_text(encoding="utf-8")
    s = export_study(synthetic).summary
    # The first section is the answer: a plain reading, then N, R/N with its interval, the 2x2 and McNemar.
    first = html.index("<h2")
    assert html[first:].startswith('<h2 id="sec-summary">Summary (main cohort)</h2><p class="reading answer"')
    answer = unescape(re.search(r'<p class="reading answer"[^>]*>(.*?)</p>', html).group(1))
    lo, hi = wilson_interval(s.r, s.n)
    assert answer.startswith(f"The VLM's subgoal rescued {s.r} of {s.m} matched failures ({s.r} of all {s.n} cases, ")
    assert f"95% interval {100 * lo:.1f}% to {100 * hi:.1f}%" in answer
    t = s.versus_control.pairs
    assert f"the assisted arm alone succeeded {t.first_only} time(s) and the control alone {t.second_only}" in answer
    assert f"exact McNemar p = {s.versus_control.mcnemar_p:.4f}" in answer
    # Where the failures came from is said inside the answer; what produced the study is folded below it.
    assert html.index('data-answer="main"') < html.index('class="baseline"') < html.index('<details class="prov">')
    assert 'data-baseline="hand"' in html and "written by hand" in html
    assert '<details class="prov" open' not in html
    assert html.index('data-figure="main.first_only"') < html.index('<details class="prov">')
    # With a sham arm its comparison stands beside the one against control, and the reading names it.
    from report_studies import build_report_study

    sham_study = build_report_study(tmp_path / "sham", 30, sham="permuted", seed=3)
    page = write_report(sham_study).read_text(encoding="utf-8")
    versus = export_study(sham_study).summary
    sham = next(f for f in versus.arms if f.arm == "sham")
    said = unescape(re.search(r'<p class="reading answer"[^>]*>(.*?)</p>', page).group(1))
    assert f"A permuted sham (another case's subgoal, same pause and injection) rescued {sham.r} of {sham.m}." in said
    cols = page.split('<div class="cols">')[1].split("</section>")[0]
    assert "assisted vs control over M" in cols and "assisted vs sham: the effect of the VLM" in cols
    assert page.index('data-figure="main.sham.mcnemar_p"') < page.index('<details class="prov">')


def test_each_case_shows_the_verdict_the_prompt_the_answer_and_its_trace(synthetic, report):
    panel = panel_html(report, "rescued-1")
    assert "rule 9" in panel and "Grasp the bowl by its rim." in panel
    assert "prompt call-a" in panel and "response call-a" in panel  # the kept prompt and raw answer (DESIGN §9)
    assert "prefix match: ok" in panel and "evidence: ok" in panel
    trace = json.loads((report.parent / "report_files" / "rescued-1.assisted.trace.json").read_text())
    assert [row["step"] for row in trace][:2] == [0, 16]
    assert "initial_state_deviation" in panel_html(report, "deviates")


def test_continuation_partitions_are_reported_and_merged_by_case_id(synthetic, tmp_path):
    first = Path(shutil.copytree(synthetic, tmp_path / "part-1"))
    second = Path(shutil.copytree(synthetic, tmp_path / "part-2"))
    with Journal.open(first) as j:
        j.set_meta("continued_by", str(second))
    with Journal.open(second) as j:
        j.set_meta("continues", str(first))
    html = write_report(second).read_text(encoding="utf-8")
    section = html.split("<h2>Continuation partitions</h2>")[1].split("<h2>")[0]
    assert "earlier part" in section and "this study" in section
    # The copies classify the same case ids twice: the merge must say so rather than count them twice.
    assert "Merged by case id" in section and "6 case(s)" in section
    assert "Classified in more than one part" in section and "rescued-1" in section
    assert "Continuation partitions" in write_report(first).read_text(encoding="utf-8")


# --- at the size of a real study: provenance, sham, cameras, paths, the index ---------


@pytest.fixture(scope="module")
def sham_study(tmp_path_factory) -> Path:
    """30 cases with a permuted sham arm, batched calls, keyframes and end-effector positions."""
    from report_studies import build_report_study

    return build_report_study(tmp_path_factory.mktemp("sham") / "permuted", 30, sham="permuted", seed=1, batch_every=5)


@pytest.fixture(scope="module")
def fixed_study(tmp_path_factory) -> Path:
    """The same manifest as `sham_study`, another seed, a fixed content-free sham text."""
    from report_studies import build_report_study

    return build_report_study(tmp_path_factory.mktemp("sham") / "fixed", 30, sham="fixed", seed=2)


@pytest.fixture(scope="module")
def sham_report(sham_study) -> Path:
    return write_report(sham_study)


def provenance_of(html: str) -> dict[str, str]:
    from html import unescape

    return {k: unescape(v) for k, v in re.findall(r'<td data-prov="([^"]+)">([^<]*)</td>', html)}


def test_the_header_names_what_produced_the_study(sham_study, sham_report):
    from rescue.core.configuration.config import StudyConfig

    html = sham_report.read_text(encoding="utf-8")
    prov = provenance_of(html)
    export = export_study(sham_study)
    config = StudyConfig.model_validate_json((sham_study / "config.json").read_text())
    assert prov["policy"] == f"factory {config.policy.factory} (served on loopback)"
    assert prov["announced"].startswith("nothing")  # resolved_config records an empty announcement
    assert prov["episode_protocol"].startswith("rescue (")  # neither the config nor the arms name one
    assert prov["vlm_host"] == "vlm.example.org:8443"  # the host, not the URL
    assert "https://" not in html and "/v1" not in html
    assert prov["vlm_model"].startswith("qwen2.5-vl-7b requested; reported: qwen2.5-vl-7b (")
    assert prov["vlm_api"].startswith("chat (structured output), prompt template subgoal_v1")
    for setting in ("max_output_tokens = 256", "temperature = 0.0", "seed = 3", "reasoning_effort = not sent", "store = False"):
        assert setting in prov["generation"], setting
    assert prov["sham"].startswith("permuted")
    # The study recorded the tool that created it (rescue's version, and the checkout's commit when it has one).
    from rescue.study.journal import Journal

    with Journal.open(sham_study, readonly=True) as journal:
        meta = journal.meta()
    assert meta["rescue_version"] == "0.1.0"
    expected = "created by rescue 0.1.0" + (f" at commit {meta['git_commit']}" if meta["git_commit"] else " (no commit recorded)")
    assert prov["tool"].startswith(expected) and prov["tool"].endswith("; this page written by rescue 0.1.0")
    assert prov["created"].endswith("UTC") and prov["created"][:4].isdigit()
    assert prov["config_sha256"] == export.study.config_sha256
    assert prov["manifest_sha256"] == f"{export.study.manifest_sha256} (manifest.jsonl)"


def test_the_header_reads_what_a_study_records_and_hides_secrets():
    from types import SimpleNamespace

    from rescue.core.configuration.config import StudyConfig
    from rescue.read.html.provenance import (
        episode_protocol,
        tool_text,
        url_without_secrets,
        vlm_host,
    )

    config = StudyConfig()
    assert episode_protocol(SimpleNamespace(env=SimpleNamespace(episode_protocol="openpi"))) == "openpi"
    assert episode_protocol(SimpleNamespace(env=SimpleNamespace(episode_protocol=None))) == "rescue"
    assert episode_protocol(config) == "rescue"
    assert episode_protocol(config, ["openpi", "openpi", None]) == "openpi"  # what the arms recorded
    assert tool_text({"rescue_version": "0.2.0", "git_commit": "1d88f46"}, config).startswith(
        "created by rescue 0.2.0 at commit 1d88f46; this page written by rescue")
    assert "(no commit recorded)" in tool_text({"rescue_version": "0.2.0"}, config)
    assert url_without_secrets("ws://user:secret@policy.lab:8000/infer?key=abc") == "ws://policy.lab:8000/infer"
    assert vlm_host("https://user:k@api.openai.com/v1") == "api.openai.com" and vlm_host("local").startswith("local")


def test_the_sham_panel_shows_its_subgoal_and_for_permuted_its_donor_and_the_donors_call(sham_study, sham_report, fixed_study):
    from html import unescape

    export = export_study(sham_study)
    by_id = {c.case_id: c for c in export.cases}
    applied = [c for c in export.cases if c.arms.get("sham") is not None and c.arms["sham"].assistance == "applied"]
    assert len(applied) > 20
    for case in applied:
        panel = panel_html(sham_report, case.case_id)
        sham = panel.split('data-arm="sham"')[1]
        record = case.arms["sham"]
        assert unescape(re.search(r'class="sham-subgoal"><b>sham subgoal</b>: <code>([^<]*)</code>', sham).group(1)) == record.subgoal
        donor = record.donor_case_id
        assert f'from donor case <a href="#case={donor}" data-go="{donor}">{donor}</a>' in sham
        # The donor's call: the same call the donor's own assisted arm made.
        assert record.call_id == by_id[donor].assisted.call_id and f"the donor's call <code>{record.call_id}</code>" in sham
        assert f"<b>sham vs control</b>: <span class=\"{case.verdicts['sham'].label}\">" in sham
    failed = [c for c in export.cases if c.arms.get("sham") is not None and c.arms["sham"].assistance != "applied"
              and c.arms["sham"].donor_case_id]
    for case in failed:
        assert "the donor's call gave no answer" in panel_html(sham_report, case.case_id), case.case_id
    fixed = write_report(fixed_study)
    case = next(c for c in export_study(fixed_study).cases if c.arms.get("sham") is not None)
    panel = panel_html(fixed, case.case_id).split('data-arm="sham"')[1]
    assert "<code>Continue with the task.</code> (the study's declared fixed text)" in panel


def test_the_views_the_vlm_saw_are_named_by_camera(sham_study, sham_report):
    from rescue.core.images import VLM_VIEWS

    export = export_study(sham_study)
    seen_batched = 0
    for case in export.cases:
        if case.assisted is None or case.assisted.call_id is None:
            continue
        panel = panel_html(sham_report, case.case_id)
        views = panel.split('class="frames vlm-views"')[1].split("</div>")[0]
        assert re.findall(r"<figcaption>([^<]*)</figcaption>", views) == list(VLM_VIEWS), case.case_id
        assert "view 1" not in panel
        seen_batched += "on one contact sheet with 1 other case(s)" in panel
    assert seen_batched >= 2  # batch_every=5: some calls carried two cases


def test_each_arm_shows_its_end_effector_path_with_q_and_its_end(sham_study, sham_report):
    from rescue.read.html.paths import path_length, points
    from rescue.study.folder import open_journal, read_study

    with open_journal(sham_study) as journal:
        records = read_study(sham_study, journal)
    export = export_study(sham_study)
    for case in export.cases:
        arms = records.arms.get(case.case_id, {})
        panel = panel_html(sham_report, case.case_id)
        svgs = re.findall(r'<svg class="ee-path" data-of="(\w+)" data-points="(\d+)" data-q="(\d*)" data-end="(\d+)" '
                          r'data-success="(true|false)"', panel)
        assert sorted(s[0] for s in svgs) == sorted(arms), case.case_id
        for name, n, q, end, success in svgs:
            arm = arms[name]
            assert int(n) == len(points(arm)) == len(arm.queries) and int(q) == case.query_step
            assert int(end) == arm.steps and success == str(bool(arm.success)).lower()
        for name, arm in arms.items():
            assert f"end-effector path {path_length(points(arm)):.2f} m" in panel
        assert (len(svgs) == 0) == (not arms)
    assert path_length([(0, (0.0, 0.0, 0.0)), (16, (3.0, 4.0, 0.0)), (32, (3.0, 4.0, 1.0))]) == 6.0
    assert path_length([(0, (0.0, 0.0, 0.0)), (16, (3.0, 4.0, 0.0)), (32, (3.0, 4.0, 1.0))], since=16) == 1.0


def test_the_case_index_holds_every_case_as_the_export_does(sham_study, sham_report):
    export = export_study(sham_study)
    index = index_of(sham_report)
    rows = [dict(zip(index["fields"], row)) for row in index["rows"]]
    assert [r["id"] for r in rows] == [c.case_id for c in export.cases]
    for r, c in zip(rows, export.cases):
        assert (r["label"], r["rule"], r["reason"], r["sham_label"], r["sham_reason"]) == (
            c.label or c.state, c.rule, c.reason, *((c.verdicts["sham"].label, c.verdicts["sham"].reason)
                                                    if "sham" in c.verdicts else (None, None)))
        assert (r["group"], r["task"], r["q"], r["cohort"]) == (c.group, c.task, c.query_step, "pilot" if c.pilot else "main")
        for arm in ("control", "assisted", "sham"):
            assert r[arm] == (c.arms[arm].success if c.arms.get(arm) else None)
        assert r["subgoal"] == (c.assisted.subgoal if c.assisted else None)
        assert (report_files(sham_report) / "case" / f"{c.case_id}.js").is_file()
    assert {k for k, _ in index["filters"]} == {"label", "sham_label", "task", "group", "cohort", "reason_kind"}
    assert {"id", "task", "subgoal", "reason"} <= set(index["search"])


def test_the_page_weight_does_not_grow_with_the_cases(sham_report, tmp_path):
    from report_studies import build_report_study

    # Three times the cases over the same 30 tasks: the page is the same size (but for longer numbers in the
    # per-task figures); the index grows, the panels are files.
    big = write_report(build_report_study(tmp_path / "big", 90, sham="permuted", seed=1, batch_every=5))
    small_html, big_html = sham_report.read_text(encoding="utf-8"), big.read_text(encoding="utf-8")
    assert len(big_html) < 1.05 * len(small_html), (len(small_html), len(big_html))
    # No case panel and no case image on the page itself: only the plots.
    assert '<section class="case"' not in big_html and 'class="verdict"' not in big_html
    assert all(src.startswith("report_files/plot-") for src in re.findall(r'<img src="([^"]+)"', big_html))
    index = (report_files(big) / "cases.js").stat().st_size
    assert index > 2.5 * (report_files(sham_report) / "cases.js").stat().st_size
    assert len(list((report_files(big) / "case").glob("*.js"))) == 90


# --- several studies of one manifest -------------------------------------------------


def test_studies_of_one_manifest_compare_case_by_case(sham_study, fixed_study, sham_report, tmp_path):
    from rescue.read.html.side_by_side import holm, write_comparison_report

    out = write_comparison_report([sham_study, fixed_study], tmp_path / "cmp" / "compare.html")
    html = out.read_text(encoding="utf-8")
    page = parse(html)
    exports = [export_study(sham_study), export_study(fixed_study)]
    # Each study's summary, figure for figure from its own export.
    checked = 0
    for name, (value, text) in page.figures.items():
        side, _, rest = name.partition(".")
        if side.startswith("s") and side[1:].isdigit():
            want = expected_figure(rest, exports[int(side[1:])])
            assert value == (list(want) if isinstance(want, tuple) else want), name
            assert text == shown_text(rest, want), name
            checked += 1
    assert checked >= 2 * 15
    # The pairing, recomputed here from the two exports alone.
    a, b = ({c.case_id: c for c in e.cases} for e in exports)
    pairs = [(a[k].assisted.success, b[k].assisted.success) for k in a if not a[k].pilot and a[k].in_e and b[k].in_e]
    first_only = sum(x and not y for x, y in pairs)
    second_only = sum(y and not x for x, y in pairs)
    assert page.figures["pair.0-1.k"][0] == len(pairs) > 10
    assert page.figures["pair.0-1.first_only"][0] == first_only and page.figures["pair.0-1.second_only"][0] == second_only
    assert page.figures["pair.0-1.mcnemar_p"][0] == pytest.approx(mcnemar_exact(first_only, second_only))
    both = sum(x and y for x, y in pairs)
    assert page.figures["pair.0-1.diff_ci"][0] == pytest.approx(list(paired_diff_ci(first_only, second_only, len(pairs), both_success=both)))
    moved = sum(v for k, (v, _) in page.figures.items() if k.startswith("pair.0-1.moved."))
    assert moved == sum(1 for k in a if not a[k].pilot and a[k].label and b[k].label)
    # What produced each: the sham source differs and is marked; the same manifest is named once.
    assert re.search(r'<tr data-prov-row="sham" class="differs">', html)
    assert '<tr data-prov-row="episode_protocol">' in html
    assert exports[0].study.manifest_sha256 in html
    # The case list pairs every case, with a link to the first study's own panel.
    index = read_index_script((report_files(out) / "cases.js").read_text(encoding="utf-8"))
    rows = [dict(zip(index["fields"], r)) for r in index["rows"]]
    assert [r["id"] for r in rows] == list(a)
    assert all(r["label0"] == (a[r["id"]].label or a[r["id"]].state) and r["label1"] == (b[r["id"]].label or b[r["id"]].state) for r in rows)
    assert all(r["differs"] == ("yes" if a[r["id"]].label != b[r["id"]].label else "no") for r in rows)
    target, _, fragment = rows[0]["link0"].partition("#")
    assert (out.parent / target).resolve() == sham_report.resolve() and fragment == f"case={rows[0]['id']}"
    assert (rows[0]["link1"] is None) == (not (fixed_study / "report.html").exists())  # a link only to a report that exists
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_studies_of_different_manifests_are_refused_in_one_line(sham_study, synthetic, tmp_path):
    from rescue.read.html.side_by_side import ComparisonError, write_comparison_report

    out = tmp_path / "cmp" / "compare.html"
    with pytest.raises(ComparisonError) as err:
        write_comparison_report([sham_study, synthetic], out)
    message = str(err.value)
    assert "\n" not in message and "another manifest" in message and str(synthetic) in message
    assert not out.exists() and not report_files(out).exists()
    with pytest.raises(ComparisonError, match="at least two"):
        write_comparison_report([sham_study], out)
    with pytest.raises(ComparisonError, match="given twice"):
        write_comparison_report([sham_study, sham_study], out)


# --- in a real browser --------------------------------------------------------------


def chromium(*args: str, url: str, tmp: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("headless Chromium is required: install Debian's `chromium` (apt-get install -y chromium)")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
           *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, check=True)


@pytest.mark.e2e
def test_in_chromium_the_numbers_equal_the_export_and_the_filter_works(synthetic, report, tmp_path):
    export = export_study(synthetic)
    url = report.resolve().as_uri()
    dom = parse(chromium("--dump-dom", url=url, tmp=tmp_path).stdout)
    assert check_figures(dom, export) > 60
    # The inline script ran in the browser: it filled in the count of shown cases.
    assert dom.shown == {"shown": str(len(export.cases)), "total": str(len(export.cases))}
    rescued = [c for c in export.cases if c.label == "rescued"]
    dom = parse(chromium("--dump-dom", url=url + "#label=rescued&cohort=main", tmp=tmp_path).stdout)
    assert dom.shown["shown"] == str(sum(not c.pilot for c in rescued)) == "1"
    dom = parse(chromium("--dump-dom", url=url + "#group=object", tmp=tmp_path).stdout)
    assert dom.shown["shown"] == str(sum(c.group == "object" for c in export.cases))

    from PIL import Image

    shot = tmp_path / "report.png"
    chromium(f"--screenshot={shot}", "--window-size=1280,2000", url=url, tmp=tmp_path)
    with Image.open(shot) as img:
        assert img.size == (1280, 2000)
        lo, hi = img.convert("L").getextrema()
        assert hi - lo > 100  # a rendered page, not a blank one


# --- a real study with default settings ----------------------------------------------


@pytest.mark.sim
@pytest.mark.e2e
def test_a_study_run_with_default_settings_has_images_in_its_report(tmp_path):
    from PIL import Image

    manifest = write_cases(tmp_path / "cases.jsonl", 2, horizon=64)
    study = tmp_path / "study"
    rescue_cli("run", str(manifest), "--study", str(study))
    rescue_cli("report", str(study), "--video")
    report = study / "report.html"
    html = report.read_text(encoding="utf-8")
    export = export_study(study)
    assert check_figures(parse(html), export) > 30
    for case in export.cases:
        panel = panel_html(report, case.case_id)
        imgs = re.findall(r'<img src="([^"]+)"', panel)
        for src in imgs:
            with Image.open(report.parent / src) as img:
                assert img.size[0] >= 64
        # What the VLM saw at q, its prompt and its answer, and the receipt line it left.
        views = panel.split('class="frames vlm-views"')[1].split("</div>")[0]
        assert len(re.findall("<img ", views)) >= 1, case.case_id
        assert "agentview" in views and "view 1" not in views  # named by camera
        assert "rendered prompt" in panel and "raw answer" in panel and "raw receipt line" in panel
        assert "receipt line: matches the arm's reference" in unescape(panel)  # text, however it is escaped
        # Both arms at q and at the end (StudyConfig.keyframes is on by default), and an mp4 of each.
        for arm in ("control", "assisted"):
            frames = panel.split(f'data-arm="{arm}"')[1].split('class="arm"')[0]
            assert len(re.findall("<img ", frames)) == 2, f"{case.case_id} {arm}: keyframes at q and at the end"
            video = report.parent / "report_files" / f"{case.case_id}.{arm}.mp4"
            import imageio.v2 as imageio

            reader = imageio.get_reader(video)
            assert reader.count_frames() == 2
            reader.close()


MARKUP = re.compile(r"<(/?)(html|head|body|main|div|p|table|tr|td|th|span|h\d|svg|a|img|ul|li|details|summary|pre|code|"
                    r"figure|section|script|style|button|input|label|br|b|video)[\s>/]")


def _markup_in_python(path: Path) -> list[str]:
    """String constants of a module that spell HTML tags (docstrings aside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [f"{path.name}:{n.lineno}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings and MARKUP.search(n.value)]


def test_the_page_comes_from_autoescaped_templates_shipped_with_the_package():
    from rescue.read.html.render import environment

    env = environment()
    names = set(env.list_templates())
    assert {"page.html", "study.html", "panel.html", "path.html", "comparison.html", "summary.html", "list.js",
            "report.css"} <= names
    assert env.autoescape is True
    for name in sorted(n for n in names if n.endswith(".html")):
        source = env.loader.get_source(env, name)[0]
        assert "|safe" not in source and "autoescape" not in source and "Markup" not in source, name
    # The markup lives in the templates: no module of the report spells a tag in Python.
    found = [hit for path in sorted((ROOT / "rescue" / "read" / "html").glob("*.py")) for hit in _markup_in_python(path)]
    assert found == []
    assert _markup_in_python(Path(__file__)) != []  # the check sees a tag where there is one
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"read/html/templates/*"' in pyproject and '"jinja2>=3.1"' in pyproject
