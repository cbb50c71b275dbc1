"""`rescue report`: one HTML page a person can look at: figures, and per case both arms' keyframes, the subgoal, the verdict."""

from __future__ import annotations

import html
import os
from pathlib import Path

from rescue.export import StudyExport, export_study
from rescue.layout import LayoutError, StudyLayout

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
.case{border:1px solid #ddd;border-radius:6px;padding:.8em;margin:1em 0}
.rescued{background:#eaf7ea}.unknown{background:#fff6e0}.initial_state_deviation{background:#fdecec}
.frames{display:flex;gap:.6em;flex-wrap:wrap}.frames figure{margin:0}.frames figcaption{font-size:.8em;color:#555}
code{background:#f4f4f4;padding:0 .2em}
"""


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _table(rows: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows) + "</table>"


def _summary(export: StudyExport) -> str:
    s = export.summary
    if s is None:
        return "<p>An evaluation study: see <code>rescue export</code> for its episodes.</p>"
    p = s.pairs
    rows = [("cases (N, fixed)", str(s.n))] + [(k, str(v)) for k, v in s.counts.items()]
    rows += [
        ("M / E", f"{s.m} / {s.e}"),
        ("R/N, R/M, R/E", f"{_pct(s.r_over_n)}, {_pct(s.r_over_m)}, {_pct(s.r_over_e)}"),
        ("2x2 of M", f"assisted-only {p.assisted_only}, control-only {p.control_only}, both success {p.both_success}, both fail {p.both_fail}"),
        ("exact McNemar p", f"{s.mcnemar_p:.4f}"),
    ]
    if s.diff_ci is not None:
        rows.append(("paired difference (95% CI)", f"{_pct(s.diff)} [{_pct(s.diff_ci[0])}, {_pct(s.diff_ci[1])}]"))
    groups = "".join(
        f"<tr><td>{html.escape(g)}</td><td>{b.n}</td><td>{b.rescued}</td><td>{_pct(b.rate)}</td></tr>"
        for g, b in sorted(s.per_group.items())
    )
    u = export.usage
    usage = [("VLM calls", f"{u.calls} ({', '.join(f'{k} {v}' for k, v in sorted(u.by_status.items()))})")]
    usage += [(f"{k} tokens", str(t.total) if t.total is not None else f"unknown ({t.known_sum} known)") for k, t in u.tokens.items()]
    if u.latency.median_s is not None:
        usage.append(("latency median (range)", f"{u.latency.median_s:.2f} s ({u.latency.min_s:.2f}-{u.latency.max_s:.2f} s)"))
    return (
        _table(rows)
        + "<table><tr><th>group</th><th>cases</th><th>rescued</th><th>R/N</th></tr>" + groups + "</table>"
        + _table(usage)
    )


def _frames(study: Path, out_dir: Path, case_id: str) -> str:
    try:
        folder = StudyLayout.of(study).keyframe(case_id, "control", "end").parent
    except LayoutError:
        return ""
    if not folder.is_dir():
        return ""
    figures = []
    for png in sorted(folder.glob("*.png"), key=lambda p: (p.stem.split("-", 1)[1] != "end", p.stem)):
        rel = os.path.relpath(png, out_dir)
        figures.append(f'<figure><img src="{html.escape(rel)}" width="160"><figcaption>{html.escape(png.stem)}</figcaption></figure>')
    return '<div class="frames">' + "".join(figures) + "</div>"


def _case(study: Path, out_dir: Path, case) -> str:
    arms = []
    for name in ("control", "assisted"):
        arm = getattr(case, name)
        if arm is None:
            arms.append(f"<tr><td>{name}</td><td colspan=4>not recorded</td></tr>")
            continue
        arms.append(
            f"<tr><td>{name}</td><td>{html.escape(arm.status)}</td><td>{arm.success}</td>"
            f"<td>{arm.steps}</td><td>{html.escape(arm.assistance)}</td></tr>"
        )
    subgoal = case.assisted.subgoal if case.assisted is not None else None
    return (
        f'<div class="case {html.escape(case.label or "")}"><h3>{html.escape(case.case_id)}: '
        f"{html.escape(case.label or case.state)}</h3>"
        f"<p>{html.escape(case.task)} ({html.escape(case.group)}), query step {case.query_step}; "
        f"rule {case.rule}: {html.escape(case.reason or '')}</p>"
        + (f"<p>subgoal: <code>{html.escape(subgoal)}</code></p>" if subgoal else "")
        + "<table><tr><th>arm</th><th>status</th><th>success</th><th>steps</th><th>assistance</th></tr>"
        + "".join(arms) + "</table>" + _frames(study, out_dir, case.case_id) + "</div>"
    )


def write_report(study_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Write the study's HTML report (default `<study>/report.html`) and return its path."""
    study = Path(study_dir)
    out_path = Path(out) if out else StudyLayout.of(study).report
    export = export_study(study)
    info = export.study
    body = (
        f"<h1>Rescue study {html.escape(str(info.study_id))}</h1>"
        f"<p>config sha256 <code>{html.escape(str(info.config_sha256))}</code>, "
        f"manifest sha256 <code>{html.escape(str(info.manifest_sha256))}</code></p>"
        + _summary(export)
        + "<h2>Cases</h2>"
        + "".join(_case(study, out_path.parent, c) for c in export.cases)
    )
    out_path.write_text(f"<!doctype html><meta charset=utf-8><title>{html.escape(str(info.study_id))}</title><style>{_STYLE}</style>{body}", encoding="utf-8")
    return out_path
