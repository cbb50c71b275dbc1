"""`rescue report`: the plain reading of the statistics, a self-contained page whose figures equal the export's
(read back from a real headless Chromium), continuation partitions, and images from a real run.

The synthetic study is built with the library as the engine builds one (see
test_export_verify.build_study); the real one runs LIBERO through the CLI.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import rescue_cli, write_cases
from test_export_verify import build_study

from rescue.core.stats import mcnemar_exact, paired_diff_ci
from rescue.read.export import StudyExport, export_study
from rescue.read.html.page import pct
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


class Figures(HTMLParser):
    """Collects data-figure cells (name -> (JSON value, shown text)), image sources, links and the title."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, tuple[object, str]] = {}
        self.srcs: list[str] = []
        self.hrefs: list[str] = []
        self.shown: dict[str, str] = {}
        self.title = ""
        self._open: str | None = None
        self._text: list[str] = []
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "title":
            self._in_title = True
        if "data-figure" in a:
            assert a["data-figure"] not in self.figures, f"figure {a['data-figure']} twice"
            self._open, self._text = a["data-figure"], []
            self.figures[self._open] = (json.loads(a["data-value"]), "")
        for key in ("src",):
            if key in a and tag in ("img", "video"):
                self.srcs.append(a[key])
        if tag == "a" and "href" in a:
            self.hrefs.append(a["href"])
        if a.get("id") == "shown":
            self.shown = {k: a.get(f"data-{k}", "") for k in ("shown", "total")}

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        if self._open is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        if self._open is not None and tag in ("td", "div"):
            value, _ = self.figures[self._open]
            self.figures[self._open] = (value, "".join(self._text).strip())
            self._open = None


def parse(html: str) -> Figures:
    f = Figures()
    f.feed(html)
    return f


def expected_figure(name: str, export: StudyExport) -> object:
    """What the export says for a figure the page names (the page's names, resolved independently)."""
    head, _, rest = name.partition(".")
    if head == "usage":
        obj: object = export.usage.model_dump(mode="json")
        parts = rest.split(".")
        if parts[0] == "status":
            return export.usage.by_status[parts[1]]
        if parts[0] == "latency":
            return obj["latency"][f"{parts[1]}_s"]
        for part in parts:
            obj = obj[part]
        return obj
    summary = export.summary if head == "main" else export.summary.pilot
    s = summary.model_dump(mode="json")
    parts = rest.split(".")
    if parts[-1] == "card":
        parts = parts[:-1]
    if parts[0] in ("group", "task"):
        bucket = s[f"per_{parts[0]}"][".".join(parts[1:-1])]
        key = parts[-1]
        return bucket[key] if key in ("n", "rate") else bucket["counts"][key]
    key = parts[0]
    if key in s["counts"]:
        return s["counts"][key]
    if key in s["pairs"]:
        return s["pairs"][key]
    return s[key]


def shown_text(name: str, value: object) -> str:
    """How the page must print a figure's value."""
    if value is None:
        return "n/a" if not name.startswith("usage.tokens") else "unknown"
    if name.endswith(("r_over_n", "r_over_m", "r_over_e", ".rate", ".diff", ".diff.card", "r_over_n.card", "r_over_m.card", "r_over_e.card")):
        return pct(value)
    if name.endswith("diff_ci"):
        return f"[{pct(value[0])}, {pct(value[1])}]"
    if name.endswith("mcnemar_p"):
        return f"{value:.4f}"
    if name.startswith("usage.latency"):
        return f"{value:.2f} s"
    return str(value)


def check_figures(page: Figures, export: StudyExport) -> int:
    """Every figure on the page equals the export's, in value and as printed; returns how many were checked."""
    for name, (value, text) in page.figures.items():
        if name == "usage.cost":
            assert value is None and text.startswith("not configured"), (name, value, text)
            continue
        want = expected_figure(name, export)
        want = list(want) if isinstance(want, tuple) else want
        assert value == want, f"{name}: page {value!r}, export {want!r}"
        assert text == shown_text(name, want), f"{name}: page shows {text!r}"
    return len(page.figures)


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
    # Every image, video and link resolves to a file in the folder beside the page; nothing from a network.
    assert not re.search(r"(src|href)=\"(https?:|//|/)", html)
    local = [x for x in page.srcs + page.hrefs if not x.startswith("#")]
    assert local and all((report.parent / x).is_file() for x in local), local
    assert all(x.startswith("report_files/") for x in local)
    for name in ("rate-group", "rate-task", "outcomes", "latency", "steps"):
        assert (folder / f"plot-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The title names the study and its kind, never "Rescue study rescue".
    assert page.title.startswith("demo-20260101-000000") and page.title.endswith("/rescue · rescue study report")
    assert "Rescue study rescue" not in html
    for section in ("Summary (main cohort)", "Per group", "Per task", "Pilot cases", "VLM usage", "Cases"):
        assert f"<h2>{section}" in html, section
    assert "Declared before the run: pilot-1" in html
    assert "cost" in html and "not configured" in html


def test_the_page_figures_equal_the_export(synthetic, report):
    export = export_study(synthetic)
    page = parse(report.read_text(encoding="utf-8"))
    assert check_figures(page, export) > 60
    s = export.summary
    for key in ("n", "m", "e", "r_over_n", "r_over_m", "r_over_e", "mcnemar_p", "diff", "diff_ci", "assisted_only", "both_fail"):
        assert f"main.{key}" in page.figures
    assert {f"main.task.{t}.n" for t in s.per_task} <= set(page.figures)
    assert "pilot.n" in page.figures and "usage.tokens.input.calls_without" in page.figures


def test_each_case_shows_the_verdict_the_prompt_the_answer_and_its_trace(synthetic, report):
    html = report.read_text(encoding="utf-8")
    panel = html.split('id="case-rescued-1"')[1].split("</section>")[0]
    assert "rule 9" in panel and "Grasp the bowl by its rim." in panel
    assert "prompt call-a" in panel and "response call-a" in panel  # the kept prompt and raw answer (DESIGN §9)
    assert "prefix match: ok" in panel and "evidence: ok" in panel
    trace = json.loads((report.parent / "report_files" / "rescued-1.assisted.trace.json").read_text())
    assert [row["step"] for row in trace][:2] == [0, 16]
    deviates = html.split('id="case-deviates"')[1].split("</section>")[0]
    assert "initial_state_deviation" in deviates


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


# --- in a real browser --------------------------------------------------------------


def chromium(*args: str, url: str, tmp: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("headless Chromium is required: install Debian's `chromium` (apt-get install -y chromium)")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
           *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


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
        panel = html.split(f'id="case-{case.case_id}"')[1].split("</section>")[0]
        imgs = re.findall(r'<img src="([^"]+)"', panel)
        for src in imgs:
            with Image.open(report.parent / src) as img:
                assert img.size[0] >= 64
        # What the VLM saw at q, its prompt and its answer, and the receipt line it left.
        views = panel.split('class="frames vlm-views"')[1].split("</div>")[0]
        assert len(re.findall("<img ", views)) >= 1, case.case_id
        assert "rendered prompt" in panel and "raw answer" in panel and "raw receipt line" in panel
        assert "receipt line: matches the arm&#x27;s reference" in panel
        # Both arms at q and at the end (StudyConfig.keyframes is on by default), and an mp4 of each.
        for arm in ("control", "assisted"):
            frames = panel.split(f'data-arm="{arm}"')[1].split('class="arm"')[0]
            assert len(re.findall("<img ", frames)) == 2, f"{case.case_id} {arm}: keyframes at q and at the end"
            video = report.parent / "report_files" / f"{case.case_id}.{arm}.mp4"
            import imageio.v2 as imageio

            reader = imageio.get_reader(video)
            assert reader.count_frames() == 2
            reader.close()
