"""A report page read as data: its figure cells (name -> value and the text shown), image sources, links and title,
and the check that every figure equals the export's, in value and as printed."""

from __future__ import annotations

import json
from html.parser import HTMLParser

from rescue.core.figures.exact_stats import wilson_interval
from rescue.read.export import StudyExport
from rescue.read.html.render import pct


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

    def sham_parts(bucket: dict) -> tuple[dict, dict]:
        figures = next(a for a in bucket["arms"] if a["arm"] == "sham")
        versus = next(c for c in bucket["comparisons"] if (c["first"], c["second"]) == (s["arm"], "sham"))
        return figures, versus

    if parts[0] == "sham":  # the assisted-vs-sham comparison (DESIGN §8)
        figures, versus = sham_parts(s)
        if parts[1] == "counts":
            return figures["counts"][parts[2]]
        return versus["pairs"][parts[1]] if parts[1] in versus["pairs"] else versus[parts[1]]
    if parts[0] in ("group", "task"):
        bucket = s[f"per_{parts[0]}"][".".join(parts[1:-1])]
        key = parts[-1]
        if key.startswith("sham_"):  # the group's own assisted-vs-sham comparison
            figures, versus = sham_parts(bucket)
            field = key.removeprefix("sham_")
            return figures["r"] if field == "r" else versus["pairs"][field] if field in versus["pairs"] else versus[field]
        return bucket[key] if key in ("n", "rate") else bucket["counts"][key]
    key = parts[0]
    if key == "r_over_n_ci":  # R/N's Wilson interval, from the export's R and N
        return list(wilson_interval(s["r"], s["n"], s["confidence"]))
    if key == "reproduction":
        return s["reproduction"][parts[1]]
    if key in s["counts"]:
        return s["counts"][key]
    versus = s["versus_control"]
    if key in versus["pairs"]:
        return versus["pairs"][key]
    if key in ("mcnemar_p", "diff", "diff_ci"):
        return versus[key]
    return s[key]


def shown_text(name: str, value: object) -> str:
    """How the page must print a figure's value."""
    if value is None:
        return "n/a" if not name.startswith("usage.tokens") else "unknown"
    if name.endswith(("r_over_n", "r_over_m", "r_over_e", ".rate", ".diff", ".diff.card", "r_over_n.card", "r_over_m.card", "r_over_e.card")):
        return pct(value)
    if name.endswith(("diff_ci", "r_over_n_ci")):
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
