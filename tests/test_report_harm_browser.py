"""The first screen of a study with historical successes (DESIGN §17), in a real browser engine: it names the
evaluation, gives both intervals of the net change each with the population it speaks for, says what was
extrapolated, counts only reached successes as kept, and shows one interval per comparison.

Debian's Chromium runs headless, driven over the DevTools protocol on a pipe (tests/report_browser.py); the
study is built by the library's own writers (tests/helpers/harm_study.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from report_browser import Browser
from helpers.harm_study import build

from rescue.read.html.report import write_report

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    return write_report(build(tmp_path_factory.mktemp("harm") / "study-harm"))


def test_the_first_screen_reads_the_net_change_with_its_two_populations(page, tmp_path):
    with Browser(tmp_path / "profile", 1280, 900) as browser:
        browser.open(page.resolve().as_uri())
        browser.until("document.querySelector('[data-answer=net]') !== null")
        first = browser.js("""(function(){var n=document.querySelector('[data-answer=net]'),r=n.getBoundingClientRect();
          return {text:n.innerText, top:r.top, bottom:r.bottom, height:window.innerHeight};})()""")
        # Above the fold, and in words: the evaluation, both populations, what was extrapolated.
        assert first["bottom"] < first["height"]
        text = " ".join(first["text"].split())
        assert "the manifest's own 32 episodes" in text and "from 93.8% to 65.6% (net -28.1 pp)" in text
        assert "for these 32 episodes [" in text and "extrapolated from 3 of its 30 successes" in text
        assert "for the benchmark (the suite's initial states) [" in text
        cells = browser.js("""(function(){var o={};document.querySelectorAll('[data-figure^="harm.assisted"]')
          .forEach(function(e){o[e.dataset.figure]=JSON.parse(e.dataset.value)});return o;})()""")
        assert cells["harm.assisted.kept"] == 1 and cells["harm.assisted.unreached"] == 1  # kept: reached only
        assert cells["harm.assisted.exposed"] == 2 and cells["harm.assisted.broken"] == 1
        these, bench = cells["harm.assisted.net.these"], cells["harm.assisted.net.benchmark"]
        assert these[0] < cells["harm.assisted.net"] < these[1] and not these[2]
        assert bench[0] <= these[0] and these[1] <= bench[1]
        # One interval per comparison in the harm table: the rescue's is the failures' paired one, below.
        headers = browser.js("Array.from(document.querySelectorAll('table.harm th')).map(function(t){return t.innerText})")
        assert "rescue" in headers and not any(h.startswith("rescue [") for h in headers)
        shot = browser.screenshot(tmp_path / "first-screen.png")
        assert shot.stat().st_size > 10_000
