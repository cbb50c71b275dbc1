"""A link to a case opens its panel, loaded, in a real browser engine; the list's long cells read whole.

Debian's Chromium runs headless, driven over the DevTools protocol on a pipe (tests/report_browser.py), and
scrolls as a reader does. What a reader sees is asserted: the panel's verdict, subgoal and images as the export
gives them, where the viewport is, and a capture of it; never a placeholder. (Chromium's own `--screenshot`
flag captures a page at its load event and ignores scripted scrolling: a page that scrolls itself comes out
blank, and panels below the first screen as their placeholders. That is the capture, not the page.)
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from report_browser import Browser
from report_studies import build_report_study

from rescue.read.export import CaseEntry, export_study
from rescue.read.html.report import write_report

pytestmark = pytest.mark.e2e

N, PAGE = 120, 50


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, dict[str, CaseEntry]]:
    study = build_report_study(tmp_path_factory.mktemp("links") / "study", N, sham="permuted", seed=11)
    return write_report(study), {c.case_id: c for c in export_study(study).cases}


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with Browser(tmp_path_factory.mktemp("chromium") / "profile", 1280, 900) as b:
        yield b


def _panel(browser: Browser, case_id: str) -> dict:
    return browser.js(f"""(function(){{var s=document.getElementById('case-{case_id}');if(!s)return null;
      var r=s.getBoundingClientRect(),v=s.querySelector('.verdict'),g=s.querySelector('.subgoal code');
      return {{loaded:s.dataset.loaded,top:r.top,text:s.innerText,rule:v&&v.dataset.rule,verdict:v&&v.innerText,
               subgoal:g&&g.innerText,images:Array.from(s.querySelectorAll('img')).map(function(i){{
                 return [i.complete,i.naturalWidth];}})}};}})()""")


def _check_panel(browser: Browser, case: CaseEntry) -> None:
    """The panel shows the case as the export gives it, in view, every image of its first screen drawn."""
    browser.until(f"document.getElementById('case-{case.case_id}').dataset.loaded==='1'")
    time.sleep(1.0)  # the neighbours load too (they are near the viewport) and change the page's height above it
    p = _panel(browser, case.case_id)
    assert "loading\u2026" not in p["text"] and case.case_id in p["text"]
    assert p["rule"] == str(case.rule) and case.reason in p["verdict"]
    assert p["subgoal"] == case.assisted.subgoal
    assert abs(p["top"]) < 60, p["top"]  # still the panel in view, not a neighbour that grew above it
    visible = browser.js(f"""Array.from(document.getElementById('case-{case.case_id}').querySelectorAll('img'))
      .filter(function(i){{var r=i.getBoundingClientRect();return r.top<innerHeight&&r.bottom>0;}}).length""")
    assert visible >= 3
    browser.until(f"""Array.from(document.getElementById('case-{case.case_id}').querySelectorAll('img'))
      .filter(function(i){{var r=i.getBoundingClientRect();return r.top<innerHeight&&r.bottom>0;}})
      .every(function(i){{return i.complete&&i.naturalWidth>0;}})""")


def _not_blank(browser: Browser, path: Path) -> None:
    pixels = np.asarray(Image.open(io.BytesIO(browser.screenshot(path).read_bytes())).convert("L"), dtype=np.float32)
    # A blank capture is one colour; the panel has text, plots and images all over the viewport.
    rows = pixels.std(axis=1)
    assert pixels.std() > 20 and (rows > 5).mean() > 0.5, (pixels.std(), (rows > 5).mean())


def test_a_link_to_a_case_opens_its_panel_loaded_and_keeps_the_address(report, browser, tmp_path):
    page, cases = report
    ids = list(cases)
    # A case on page 3 of the list whose assisted arm got a subgoal.
    far = next(cases[i] for i in ids[2 * PAGE:] if cases[i].assisted and cases[i].assisted.subgoal)
    browser.open("about:blank")
    browser.open(page.resolve().as_uri() + f"#case={far.case_id}")
    _check_panel(browser, far)
    _not_blank(browser, tmp_path / "far.png")
    shown = browser.js("Object.assign({}, document.getElementById('shown').dataset)")
    assert shown["page"] == "3"
    # The address still names the case: copied, shared or reloaded, it opens the same panel.
    assert f"case={far.case_id}" in browser.js("location.hash")
    browser.page("Page.reload")
    browser.wait_event("Page.loadEventFired")
    _check_panel(browser, far)

    # A case link in the list, on another page of it: that case's panel, loaded, and the address follows.
    near = next(cases[i] for i in ids[1:PAGE] if cases[i].assisted and cases[i].assisted.subgoal)
    browser.js("document.getElementById('prev').click()")
    browser.js("document.getElementById('prev').click()")
    assert "case=" not in browser.js("location.hash")  # paging left the case: the address says the page
    browser.js(f"document.querySelector('#case-list a[data-go=\"{near.case_id}\"]').click()")
    _check_panel(browser, near)
    assert f"case={near.case_id}" in browser.js("location.hash")


def test_the_list_shows_reasons_and_subgoals_whole(report, browser):
    page, cases = report
    browser.open("about:blank")
    browser.open(page.resolve().as_uri())
    browser.until("document.getElementById('shown').dataset.total")
    cells = browser.js("""Array.from(document.querySelectorAll('#case-list tbody tr')).map(function(tr){
      var o={id:tr.dataset.case};['reason','subgoal','sham_reason'].forEach(function(k){
        var td=tr.querySelector('td[data-col="'+k+'"]');if(td)o[k]=[td.innerText,td.scrollWidth,td.clientWidth,
          td.getBoundingClientRect().height];});return o;})""")
    assert len(cells) == PAGE
    lines = []
    for row in cells:
        c = cases[row["id"]]
        want = {"reason": c.reason or "", "subgoal": (c.assisted.subgoal if c.assisted else None) or ""}
        for key, text in want.items():
            shown, scroll_w, client_w, height = row[key]
            assert shown == text, (row["id"], key)  # all of it, no ellipsis
            assert scroll_w <= client_w + 1, (row["id"], key)  # nothing cut off at the cell's edge
            lines.append(height)
    assert max(lines) > min(lines)  # a long one wraps onto more lines instead of being cut


def test_every_panel_of_a_page_loads_for_a_full_capture(report, browser, tmp_path):
    page, cases = report
    browser.open("about:blank")
    browser.open(page.resolve().as_uri())
    browser.until("document.getElementById('shown').dataset.total")
    assert browser.js("document.querySelectorAll('#panels section.case[data-loaded=\"0\"]').length") > 40
    browser.js("document.getElementById('load-all').click()")
    browser.until("document.querySelectorAll('#panels section.case[data-loaded=\"1\"]').length===50")
    texts = browser.js("Array.from(document.querySelectorAll('#panels section.case')).map(function(s){return s.innerText;})")
    assert not any("loading\u2026" in t for t in texts)
    ids = json.loads(json.dumps(list(cases)[:PAGE]))
    assert [t.split()[0] for t in texts] == ids


def test_the_first_screen_holds_the_answer(report, browser):
    page, cases = report
    browser.open("about:blank")
    browser.open(page.resolve().as_uri())
    browser.until("document.getElementById('shown').dataset.total")
    seen = browser.js("""(function(){function box(q){var e=document.querySelector(q);if(!e)return null;
      var r=e.getBoundingClientRect();return [r.top,r.bottom];}
      return {h:innerHeight, answer:box('p.reading.answer'), rn:box('[data-figure="main.r_over_n.card"]'),
              ci:box('[data-figure="main.r_over_n_ci"]'), table:box('[data-figure="main.first_only"]'),
              sham:box('[data-figure="main.sham.first_only"]'), baseline:box('p.baseline'),
              prov:document.querySelector('details.prov').open};})()""")
    for key in ("answer", "rn", "ci", "table", "sham", "baseline"):
        assert seen[key] is not None and 0 <= seen[key][0] and seen[key][1] <= seen["h"], (key, seen)
    assert seen["prov"] is False  # what produced it: one click away
