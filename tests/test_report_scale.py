"""The report at the size of a real study: 1,000 cases from real records, opened in a real headless Chromium.

The study is built as the engine leaves one (tests/report_studies.py: the library's own
journal, receipt log and classification; three arms with a permuted sham, keyframes, the
views each call saw, end-effector positions). The browser is driven over the DevTools
protocol on a pipe (tests/report_browser.py), so the test reads the page as a person sees
it: first paint from the Performance API, what was loaded, what the list and the panels
show after a filter, a search, a sort or a deep link, and every figure against the export.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from helpers.report_pages import check_figures, parse
from report_browser import Browser
from report_studies import build_report_study

from rescue.read.export import CaseEntry, StudyExport, export_study
from rescue.read.html.report import write_report
from rescue.study.layout import report_files

pytestmark = pytest.mark.e2e

N = 1000
PAGE = 50
FIRST_PAINT_MS = 2000


@pytest.fixture(scope="module")
def measured() -> dict:
    """What the tests measured, printed at the end (run with -s to see it)."""
    out: dict = {}
    yield out
    print("\nreport at scale: " + json.dumps(out, indent=1))


@pytest.fixture(scope="module")
def big(tmp_path_factory, measured) -> tuple[Path, StudyExport]:
    t = time.monotonic()
    study = build_report_study(tmp_path_factory.mktemp("scale") / "study-1000", N, sham="permuted", seed=5)
    measured["build_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    report = write_report(study)
    measured["write_report_s"] = round(time.monotonic() - t, 1)
    return report, export_study(study)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with Browser(tmp_path_factory.mktemp("chromium") / "profile", 1280, 900) as b:
        yield b


def _open(browser: Browser, report: Path, fragment: str = "") -> None:
    browser.open("about:blank")
    browser.open(report.resolve().as_uri() + fragment)
    browser.until("document.getElementById('shown').dataset.total")


def _rows(browser: Browser) -> list[dict[str, str]]:
    return browser.js("Array.from(document.querySelectorAll('#case-list tbody tr')).map(function(tr){var o={};"
                      "Array.from(tr.cells).forEach(function(td){o[td.dataset.col]=td.textContent;});return o;})")


def _shown(browser: Browser) -> dict[str, int]:
    d = browser.js("Object.assign({}, document.getElementById('shown').dataset)")
    return {k: int(v) for k, v in d.items()}


def _choose(browser: Browser, key: str, value: str) -> None:
    browser.js(f"(function(){{var s=document.getElementById('f-{key}');s.value={json.dumps(value)};"
               "s.dispatchEvent(new Event('change'));return 1;})()")


def _search(browser: Browser, text: str) -> None:
    browser.js(f"(function(){{var s=document.getElementById('search');s.value={json.dumps(text)};"
               "s.dispatchEvent(new Event('input'));return 1;})()")
    browser.until(f"(new URLSearchParams(location.hash.slice(1)).get('q')||'')==={json.dumps(text)}")


def _ok(success: bool | None) -> str:
    return "" if success is None else ("\u2714" if success else "\u2718")


def expected_row(c: CaseEntry) -> dict[str, str]:
    """What the list must show for a case, from the export alone."""
    return {
        "id": c.case_id + (" (pilot)" if c.pilot else ""), "label": c.label or c.state, "rule": "" if c.rule is None else str(c.rule),
        "reason": c.reason or "", "sham_label": c.verdicts["sham"].label if "sham" in c.verdicts else "", "group": c.group, "task": c.task,
        "control": _ok(c.control.success if c.control else None), "assisted": _ok(c.assisted.success if c.assisted else None),
        "sham": _ok(c.arms["sham"].success if c.arms.get("sham") else None), "steps": str(c.assisted.steps) if c.assisted else "",
        "subgoal": (c.assisted.subgoal or "") if c.assisted else "",
    }


def test_a_report_of_1000_cases_paints_fast_and_loads_cases_on_demand(big, browser, measured, tmp_path):
    report, export = big
    assert len(export.cases) == N
    _open(browser, report)
    # The paint entries are queued a frame after the paint itself.
    fcp = browser.until("performance.getEntriesByName('first-contentful-paint').map(function(e){return e.startTime;})")[0]
    measured["first_contentful_paint_ms"] = round(fcp)
    ready = browser.until("performance.getEntriesByName('rescue:list-ready').map(function(e){return e.startTime;})")
    measured["list_ready_ms"] = round(ready[0])
    assert fcp < FIRST_PAINT_MS, f"first contentful paint after {fcp:.0f} ms"
    assert _shown(browser) == {"shown": N, "total": N, "page": 1, "pages": N // PAGE}

    # Loaded with the page: itself, its plots and the case index; no case panel, no case image.
    loaded = browser.requests()
    files = report_files(report)
    assert loaded[0] == report.resolve().as_uri()
    names = sorted(Path(unquote(urlsplit(u).path)).relative_to(files.resolve()).as_posix() for u in loaded[1:])
    assert "cases.js" in names and all(n == "cases.js" or n.startswith("plot-") for n in names), names
    eager = report.stat().st_size + sum((files / n).stat().st_size for n in names)
    folder = sum(p.stat().st_size for p in files.rglob("*") if p.is_file())
    measured.update(page_bytes=report.stat().st_size, index_bytes=(files / "cases.js").stat().st_size,
                    eager_bytes=eager, report_folder_bytes=folder, panel_files=len(list((files / "case").iterdir())))
    assert eager < folder / 20 and eager < 3_000_000
    # The page's own weight does not grow with N: against 30 cases over the same 30 tasks.
    small = write_report(build_report_study(tmp_path / "study-30", 30, sham="permuted", seed=5))
    measured["page_bytes_at_30"] = small.stat().st_size
    assert report.stat().st_size < 1.1 * small.stat().st_size

    # The panels of the first page are placeholders until scrolled to; then the panel and its images load.
    sections = browser.js("Array.from(document.querySelectorAll('#panels section.case')).map(function(s){return [s.dataset.case, s.dataset.loaded];})")
    assert [s[0] for s in sections] == [c.case_id for c in export.cases[:PAGE]] and {s[1] for s in sections} == {"0"}
    first = export.cases[0].case_id
    browser.js(f"document.getElementById('case-{first}').scrollIntoView()")
    browser.until(f"document.getElementById('case-{first}').dataset.loaded==='1'")
    browser.until(f"Array.from(document.getElementById('case-{first}').querySelectorAll('img')).every(function(i){{return i.complete&&i.naturalWidth>0;}})")
    loaded = browser.requests()
    panels = [u for u in loaded if "/case/" in u]
    assert any(u.endswith(f"/case/{first}.js") for u in panels) and len(panels) <= 8, panels
    imgs = browser.js(f"Array.from(document.getElementById('case-{first}').querySelectorAll('img')).map(function(i){{return i.currentSrc;}})")
    assert len(imgs) >= 3 + 2 * 3 and all(u in loaded for u in imgs)
    assert browser.js(f"document.querySelector('#case-{first} .verdict').dataset.rule") == str(export.cases[0].rule)
    assert browser.js(f"document.querySelectorAll('#case-{first} svg.ee-path').length") == 3


def test_filters_search_sort_and_links_change_what_is_shown(big, browser):
    report, export = big
    cases = export.cases
    _open(browser, report)

    def check(want: list[CaseEntry]) -> None:
        assert _shown(browser)["shown"] == len(want)
        rows = _rows(browser)
        assert [r["id"] for r in rows] == [expected_row(c)["id"] for c in want[:PAGE]]
        # The panels follow the list.
        ids = browser.js("Array.from(document.querySelectorAll('#panels section.case')).map(function(s){return s.dataset.case;})")
        assert ids == [c.case_id for c in want[:PAGE]]

    _choose(browser, "label", "rescued")
    rescued = [c for c in cases if c.label == "rescued"]
    check(rescued)
    assert 40 < len(rescued) < PAGE * 3
    _choose(browser, "sham_label", "not_rescued")
    check([c for c in rescued if "sham" in c.verdicts and c.verdicts["sham"].label == "not_rescued"])
    _choose(browser, "cohort", "main")
    _choose(browser, "task", "libero_object/3")
    check([c for c in rescued if "sham" in c.verdicts and c.verdicts["sham"].label == "not_rescued" and not c.pilot and c.task == "libero_object/3"])
    assert "label=rescued" in browser.js("location.hash") and "task=libero_object%2F3" in browser.js("location.hash")
    for key in ("label", "sham_label", "cohort", "task"):
        _choose(browser, key, "")
    check(cases)
    _choose(browser, "reason_kind", "assisted arm failed")
    check([c for c in cases if c.reason == "assisted arm failed"])
    _choose(browser, "reason_kind", "")
    _choose(browser, "group", "goal")
    check([c for c in cases if c.group == "goal"])
    _choose(browser, "group", "")

    # Full-text search: every word, anywhere in case id, task, subgoals or reasons, any case.
    def hay(c: CaseEntry) -> str:
        parts = [c.case_id, c.task, c.assisted.subgoal if c.assisted else None, c.arms["sham"].subgoal if c.arms.get("sham") else None,
                 c.reason, c.verdicts["sham"].reason if "sham" in c.verdicts else None]
        return "\n".join(p or "" for p in parts).lower()

    for text in ("Ketchup near", "object-7", "timeout", "CONTROL ARM succeeded"):
        _search(browser, text)
        want = [c for c in cases if all(t in hay(c) for t in text.lower().split())]
        assert want, text
        check(want)
    _search(browser, "no such words anywhere")
    check([])
    _search(browser, "")
    check(cases)

    # Sort, from the hash as a shared link would give it: steps descending, blanks last, ties in manifest order.
    _open(browser, report, "#sort=-steps&group=spatial")
    spatial = [c for c in cases if c.group == "spatial"]
    want = sorted([c for c in spatial if c.assisted], key=lambda c: -c.assisted.steps) + [c for c in spatial if not c.assisted]
    check(want)
    browser.js("document.querySelector('#case-list th[data-sort=\"steps\"]').click()")  # descending -> unsorted
    check(spatial)
    browser.js("document.querySelector('#case-list th[data-sort=\"steps\"]').click()")  # ascending
    check(sorted([c for c in spatial if c.assisted], key=lambda c: c.assisted.steps) + [c for c in spatial if not c.assisted])

    # Pages, and a link to one case far down the list: its page opens and its panel loads.
    _open(browser, report)
    browser.js("document.getElementById('next').click()")
    assert _shown(browser)["page"] == 2 and _rows(browser)[0]["id"] == expected_row(cases[PAGE])["id"]
    far = cases[917]
    _open(browser, report, f"#case={far.case_id}")
    assert _shown(browser)["page"] == 917 // PAGE + 1
    browser.until(f"document.getElementById('case-{far.case_id}').dataset.loaded==='1'")
    top = browser.js(f"document.getElementById('case-{far.case_id}').getBoundingClientRect().top")
    assert abs(top) < 50
    # A donor link in a sham panel goes to the donor's panel, wherever it is in the list.
    donor = far.arms["sham"].donor_case_id
    browser.js(f"document.querySelector('#case-{far.case_id} .sham-donor a[data-go]').click()")
    browser.until(f"document.getElementById('case-{donor}') && document.getElementById('case-{donor}').dataset.loaded==='1'")


def test_every_figure_and_every_row_equals_the_export(big, browser):
    report, export = big
    _open(browser, report)
    dom = parse(browser.js("document.documentElement.outerHTML"))
    assert check_figures(dom, export) > 60
    seen = []
    for page in range(1, N // PAGE + 1):
        assert _shown(browser)["page"] == page
        seen += _rows(browser)
        browser.js("document.getElementById('next').click()")
    assert len(seen) == N
    for row, case in zip(seen, export.cases):
        assert row == expected_row(case), case.case_id
