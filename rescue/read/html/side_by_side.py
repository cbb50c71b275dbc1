"""Several studies of one manifest side by side, paired per case (`rescue report A B ...`).

Two VLMs, two prompts, or assisted-with-a-permuted-sham against a content-free
sham: when the studies ran the same manifest, each case is one pair across them.
The page shows what produced each study (and which of it differs), their
summaries figure for figure from their exports, for every pair of studies the
paired 2x2 of the assisted arm's success over the cases both have in E with the
exact McNemar p (Holm-adjusted across the pairs) and Newcombe's interval, how
the cases' classes moved, and every case with its class in each study. Studies
of different manifests are refused: their cases do not pair.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

from rescue.core.configuration.config import StudyConfig
from rescue.core.records import Receipt
from rescue.core.figures.stats import PairedComparison, PairedTable, compare
from rescue.core.figures.exact_stats import holm
from rescue.read.export import CaseEntry, StudyExport, export_study
from rescue.read.html.app import index_script
from rescue.read.html.render import ci_text, pct, render
from rescue.read.html.provenance import provenance_rows
from rescue.read.html.significance import significance_reading
from rescue.study.files import write_atomic
from rescue.study.folder import (
    StudyError,
    load_study_config,
    open_journal,
    study_receipts,
)
from rescue.study.layout import StudyLayout, report_files


class ComparisonError(StudyError):
    """Studies that cannot be compared case by case, said in one line."""


@dataclass
class Side:
    """One study of the comparison."""

    path: Path
    name: str
    export: StudyExport
    config: StudyConfig
    meta: dict[str, Any]
    receipts: list[Receipt]
    protocols: set[str | None]


def pair_studies(first: Sequence[CaseEntry], second: Sequence[CaseEntry], confidence: float = 0.95) -> PairedComparison:
    """Two studies' primary arms over the main cases in E in both (first: the first study's): the paired 2x2,
    McNemar's p, the Newcombe CI."""
    other = {e.case_id: e for e in second}
    outcomes = []
    for a in first:
        b = other.get(a.case_id)
        if b is None or a.pilot or not (a.in_e and b.in_e) or a.assisted is None or b.assisted is None:
            continue
        outcomes.append((bool(a.assisted.success), bool(b.assisted.success)))
    return compare("first", "second", outcomes, confidence)


def _side(path: Path) -> Side:
    export = export_study(path)  # refuses a folder that is no study, with one line
    with open_journal(path) as journal:
        meta = journal.meta()
        receipts = list(study_receipts(StudyLayout.of(path), journal).values())
        protocols = {getattr(arm, "episode_protocol", None) for arms in journal.all_arms().values() for arm in arms.values()}
    name = export.study.study_id or path.resolve().name
    return Side(path, name, export, load_study_config(path), meta, receipts, protocols)


def load_sides(studies: Sequence[str | os.PathLike[str]]) -> list[Side]:
    """The studies, read; ComparisonError when they are fewer than two, repeated, evaluations or of other manifests."""
    paths = [Path(s) for s in studies]
    if len(paths) < 2:
        raise ComparisonError("a comparison needs at least two study folders")
    seen: dict[Path, Path] = {}
    for p in paths:
        if p.resolve() in seen:
            raise ComparisonError(f"{p} is given twice (as {seen[p.resolve()]})")
        seen[p.resolve()] = p
    sides = [_side(p) for p in paths]
    for s in sides:
        if s.export.summary is None:
            raise ComparisonError(f"{s.path} is an evaluation study; a comparison pairs rescue studies "
                                  "(`rescue compare` compares two policies)")
    first = sides[0]
    for s in sides[1:]:
        a, b = first.export.study.manifest_sha256, s.export.study.manifest_sha256
        if not a or a != b:
            raise ComparisonError(
                f"{s.path} ran another manifest (sha256 {(b or 'unrecorded')[:12]}…) than {first.path} "
                f"({(a or 'unrecorded')[:12]}…): only studies of one manifest pair case by case")
    names = [s.name for s in sides]
    for s in sides:
        if names.count(s.name) > 1:
            s.name = str(s.path)  # two folders of one name: say which is which
    return sides


# --- the page -------------------------------------------------------------------

SUMMARY_ROWS = (
    ("n", "cases (N, fixed)"), ("rescued", "rescued (R)"), ("not_rescued", "not_rescued"), ("unknown", "unknown"),
    ("initial_state_deviation", "initial_state_deviation"), ("m", "M"), ("e", "E"), ("r_over_n", "R/N"),
    ("r_over_m", "R/M"), ("r_over_e", "R/E"), ("first_only", "assisted-only (vs control)"),
    ("second_only", "control-only"), ("mcnemar_p", "exact McNemar p"), ("diff", "assisted - control"),
    ("diff_ci", "95% CI (Newcombe)"),
)
SHAM_ROWS = (("k", "K: both subgoals applied, three arms valid"), ("first_only", "assisted-only (vs sham)"),
             ("second_only", "sham-only"), ("mcnemar_p", "exact McNemar p"), ("diff", "assisted - sham"),
             ("diff_ci", "95% CI (Newcombe)"))


def _shown(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if key in ("r_over_n", "r_over_m", "r_over_e", "diff"):
        return pct(value)
    if key == "diff_ci":
        return f"[{pct(value[0])}, {pct(value[1])}]"
    if key == "mcnemar_p":
        return f"{value:.4f}"
    return str(value)


def _comparison_value(c: PairedComparison | None, key: str) -> Any:
    if c is None:
        return None
    value = getattr(c.pairs, key) if key in PairedTable.model_fields else getattr(c, key)
    return list(value) if isinstance(value, tuple) else value


def _summary_value(side: Side, key: str) -> Any:
    s = side.export.summary
    if key in s.counts:
        return s.counts[key]
    if key in ("first_only", "second_only", "mcnemar_p", "diff", "diff_ci"):
        return _comparison_value(s.versus_control, key)
    return getattr(s, key)


def _sham_value(side: Side, key: str) -> Any:
    s = side.export.summary
    return _comparison_value(s.comparison(s.arm, "sham"), key)


def _studies_rows(sides: list[Side]) -> list[tuple[str, str, list[str], bool]]:
    """What produced each study, row by row: (key, heading, each study's text, whether they differ)."""
    rows = [provenance_rows(s.config, s.meta, s.receipts, s.protocols) for s in sides]
    out = []
    for i, (key, heading, _) in enumerate(rows[0]):
        texts = [r[i][2] for r in rows]
        out.append((key, heading, texts, len(set(texts)) > 1))
    return out


def _summary_rows(sides: list[Side], rows: Sequence[tuple[str, str]], prefix: str, value) -> list[tuple[str, list]]:
    """(title, each study's (figure name, value, text)) of each summary row."""
    return [(title, [(f"s{i}.main.{prefix}{key}", v := value(s, key), _shown(key, v)) for i, s in enumerate(sides)])
            for key, title in rows]


@dataclass
class StudyPair:
    """Two studies of the comparison, paired over the main cases in E in both."""

    a: str
    b: str
    key: str
    rows: list[tuple[str, str, Any, str | None]]
    reading: str
    moved: Counter


def _pairs(sides: list[Side]) -> list[StudyPair]:
    pairs = list(combinations(range(len(sides)), 2))
    tables = {(i, j): pair_studies(sides[i].export.cases, sides[j].export.cases) for i, j in pairs}
    adjusted = dict(zip(pairs, holm([tables[p].mcnemar_p for p in pairs])))
    out = []
    for (i, j), t in tables.items():
        a, b = sides[i].name, sides[j].name
        rows = [
            (f"assisted succeeded in {a} only", "first_only", t.pairs.first_only, None),
            (f"assisted succeeded in {b} only", "second_only", t.pairs.second_only, None),
            ("succeeded in both", "both_success", t.pairs.both_success, None),
            ("failed in both", "both_fail", t.pairs.both_fail, None),
            ("K: cases in E in both (main cohort)", "k", t.k, None),
            ("exact McNemar p (discordant pairs)", "mcnemar_p", t.mcnemar_p, f"{t.mcnemar_p:.4f}"),
        ]
        if len(pairs) > 1:
            rows.append((f"Holm-adjusted p ({len(pairs)} pairs)", "holm_p", adjusted[(i, j)], f"{adjusted[(i, j)]:.4f}"))
        ci = t.diff_ci
        rows += [(f"paired difference, {a} - {b}", "diff", t.diff, pct(t.diff)),
                 ("95% CI (Newcombe)", "diff_ci", list(ci) if ci else None, ci_text(ci))]
        reading = significance_reading(t.pairs.first_only, t.pairs.second_only, t.mcnemar_p, t.diff_ci, other=b,
                                       subject=f"the assisted arm of {a} (against {b}'s)", first=a)
        out.append(StudyPair(a, b, f"pair.{i}-{j}", rows, reading, _moves(sides[i], sides[j])))
    return out


def _moves(first: Side, second: Side) -> Counter:
    """How the main cases' classes moved from one study to the other: (from, to) -> cases."""
    other = {e.case_id: e for e in second.export.cases}
    return Counter((e.label, other[e.case_id].label) for e in first.export.cases
                   if not e.pilot and e.label is not None and e.case_id in other and other[e.case_id].label is not None)


def _index(sides: list[Side], hrefs: list[str | None], files: str) -> dict[str, Any]:
    fields = ["id", "pilot", "cohort", "group", "task", "differs", "labels"]
    columns = [["id", "case", "case"], ["group", "group", "text"], ["task", "task", "text"], ["differs", "classes differ", "text"]]
    filters = [["differs", "classes differ"], ["task", "task"], ["group", "group"], ["cohort", "cohort"]]
    search = ["id", "task"]
    for i, s in enumerate(sides):
        fields += [f"label{i}", f"assisted{i}", f"sham{i}", f"subgoal{i}", f"reason{i}", f"link{i}"]
        columns += [[f"label{i}", f"class · {s.name}", "label"], [f"assisted{i}", f"assisted · {s.name}", "ok"],
                    [f"subgoal{i}", f"subgoal · {s.name}", "text"]]
        if _sham_value(s, "k") is not None:
            columns.append([f"sham{i}", f"sham class · {s.name}", "label"])
        if hrefs[i]:
            columns.append([f"link{i}", s.name, "href"])
        filters.append([f"label{i}", f"class in {s.name}"])
        search += [f"subgoal{i}", f"reason{i}"]
    by_side = [{e.case_id: e for e in s.export.cases} for s in sides]
    rows = []
    for e in sides[0].export.cases:
        entries = [b.get(e.case_id) for b in by_side]
        labels = [x.label if x else None for x in entries]
        row: dict[str, Any] = {"id": e.case_id, "pilot": e.pilot, "cohort": "pilot" if e.pilot else "main", "group": e.group,
                               "task": e.task, "differs": "yes" if len(set(labels)) > 1 else "no", "labels": " ".join(map(str, labels))}
        for i, x in enumerate(entries):
            row[f"label{i}"] = (x.label or x.state) if x else None
            row[f"assisted{i}"] = x.assisted.success if x and x.assisted else None
            sham = x.verdicts.get("sham") if x else None
            row[f"sham{i}"] = sham.label if sham else None
            row[f"subgoal{i}"] = x.assisted.subgoal if x and x.assisted else None
            row[f"reason{i}"] = x.reason if x else None
            row[f"link{i}"] = f"{hrefs[i]}#case={e.case_id}" if hrefs[i] else None
        rows.append([row[k] for k in fields])
    return {"fields": fields, "columns": columns, "filters": filters, "search": search, "panels": False,
            "prefix": files, "page_size": 100, "rows": rows}


def _report_href(side: Side, out: Path) -> str | None:
    report = StudyLayout.of(side.path).report
    if not report.is_file():
        return None
    return Path(os.path.relpath(report.resolve(), out.resolve().parent)).as_posix()


def write_comparison_report(studies: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Write one page comparing studies of one manifest case by case (files in `<out>_files/` beside it); its path.

    Raises ComparisonError, in one line, for fewer than two studies, an evaluation study, or another manifest."""
    sides = load_sides(studies)  # read (and refused) before anything is written
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    files = report_files(out_path)
    hrefs = [_report_href(s, out_path) for s in sides]
    building = files.with_name(f".{files.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir()
    try:
        (building / "cases.js").write_text(index_script(_index(sides, hrefs, files.name)), encoding="utf-8")
        if files.exists():
            shutil.rmtree(files)
        os.rename(building, files)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    manifest = sides[0].export.study.manifest_sha256 or ""
    shams = any(_sham_value(s, "k") is not None for s in sides)
    html = render(
        "comparison.html", title=f"{' vs '.join(s.name for s in sides)} · comparison", sides=sides, hrefs=hrefs,
        manifest=manifest, n=len(sides[0].export.cases), studies=_studies_rows(sides),
        summaries=_summary_rows(sides, SUMMARY_ROWS, "", _summary_value),
        sham_rows=_summary_rows(sides, SHAM_ROWS, "sham.", _sham_value) if shams else [],
        pairs=_pairs(sides), files=files.name,
    )
    write_atomic(out_path, html + "\n")
    return out_path
