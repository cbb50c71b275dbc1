"""`rescue report`: one self-contained HTML page a person can look at, built from the study folder alone.

The page is one file; its images, plots, videos and raw records go into one
folder beside it (`report.html` -> `report_files/`), linked by relative
paths, so the two travel together and open offline. Numbers come from the
export (the same document `rescue export` writes); the per-case panels read
the arms, receipts and kept VLM artifacts (DESIGN §9).

The page's weight does not grow with the study (DESIGN §12): it holds the
figures and the list's frame; the list's rows are one index file
(`report_files/cases.js`) and each case's panel its own file
(`report_files/case/<case id>.js`), loaded when the reader scrolls to it, with
its images `loading="lazy"` (see app.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rescue.core.figures.baseline import baseline_of
from rescue.core.images import VLM_VIEWS
from rescue.core.arms import arm_advisor, is_assisted, shown
from rescue.core.manifest import Case
from rescue.core.proofs import check_evidence, prefix_match
from rescue.core.figures.exact_stats import wilson_interval
from rescue.read.export import StudyExport, export_study
from rescue.read.harm_view import evaluation_name, net_sentence
from rescue.read.stopping_view import stop_sentence
from rescue.read.html import plots
from rescue.read.html.app import index_script, panel_script
from rescue.read.html.cases import AdvisorView, CaseView, case_index, case_panel, keyframe_order
from rescue.read.html.provenance import baseline_sentences, created_text, episode_protocol, provenance_rows
from rescue.read.html.render import render
from rescue.read.html.significance import answer_reading
from rescue.study.files import write_atomic
from rescue.study.folder import StudyRecords, open_journal, read_study
from rescue.study.layout import LayoutError, StudyLayout, arm_file, report_files, safe_part
from rescue.study.receipts import artifact_path

ARM_ORDER = {"control": 0, "assisted": 1, "sham": 2}
VIDEO_NOTE = (
    "Built from the keyframes the study stored (at q and at the end), one per second: "
    "the engine records no other frames, so this is a flip-book, not a recording."
)


def _arm_order(name: str) -> tuple[int, str]:
    return ARM_ORDER.get(name, 1 if is_assisted(name) else 9), name


class Assets:
    """The report's folder of files; hrefs are relative to the page."""

    def __init__(self, folder: Path, final: Path) -> None:
        self.folder, self.prefix = folder, final.name
        folder.mkdir(parents=True, exist_ok=True)

    def href(self, name: str) -> str:
        """The page's link to a file of the folder."""
        return f"{self.prefix}/{name}"

    def copy(self, src: Path, name: str) -> str | None:
        """Copy a file in (once); None when the source is missing.

        A copy, not a hard link: a link would let an edit of the report's file change the study's evidence."""
        if not src.is_file():
            return None
        dst = self.folder / name
        if not dst.exists():
            shutil.copyfile(src, dst)
        return self.href(name)

    def write(self, name: str, data: bytes) -> str:
        """Write a file into the folder (`name` may hold one subfolder)."""
        path = self.folder / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        return self.href(name)


def _display_name(study: Path, study_id: str | None, kind: str) -> str:
    # A study folder named after its kind ("rescue" inside a demo folder) says nothing alone.
    name = study_id or study.resolve().name
    if name in {kind, "rescue", "baseline", "evaluation"}:
        name = f"{study.resolve().parent.name}/{name}"
    return name


def _read_text(path: Path, limit: int = 20000) -> str | None:
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + f"\n… ({len(text) - limit} more characters in {path.name})"


def _receipt_line(layout: StudyLayout, ref, cache: dict[str, list[bytes]]) -> tuple[bytes | None, str | None]:
    """The exact bytes of a referenced receipt line and whether they still hash to the reference."""
    try:
        path = layout.receipts_file(ref.path)
    except LayoutError as exc:
        return None, str(exc)
    if ref.path not in cache:
        cache[ref.path] = path.read_bytes().split(b"\n") if path.is_file() else []
    lines = cache[ref.path]
    if not 1 <= ref.lineno <= len(lines):
        return None, f"{ref.path} has no line {ref.lineno}"
    raw = lines[ref.lineno - 1]
    if hashlib.sha256(raw).hexdigest() != ref.sha256:
        return raw, f"line {ref.lineno} of {ref.path} no longer hashes to the arm's reference"
    return raw, None


def _case_view(study: Path, records: StudyRecords, case: Case, entry, assets: Assets, video: bool,
               cache: dict[str, list[bytes]]) -> CaseView:
    layout = StudyLayout.of(study)
    safe_part(case.case_id, "case id")  # it names files of the report's folder
    arms = records.arms.get(case.case_id, {})
    v = CaseView(entry=entry, horizon=case.horizon, arms=arms)
    for name, arm in arms.items():
        frames = []
        for key in sorted(arm.keyframes, key=keyframe_order):
            sha = arm.keyframes[key]
            try:
                src = layout.keyframe(case.case_id, name, key)
            except LayoutError:
                frames.append((key, None))
                continue
            frames.append((key, assets.copy(src, f"{sha}.png")))
        v.keyframes[name] = frames
        trace = [row.model_dump(mode="json") for row in arm.trace]
        v.traces[name] = assets.write(f"{case.case_id}.{arm_file(name)}.trace.json", (json.dumps(trace, indent=1) + "\n").encode())
        pngs = [assets.folder / href.rsplit("/", 1)[1] for _, href in frames if href]
        if video and pngs:
            from rescue.read.html.video import frames_video

            out = frames_video(pngs, assets.folder / f"{case.case_id}.{arm_file(name)}.mp4")
            v.videos[name] = assets.href(out.name)
    rec = records.record(case)
    if rec.control is not None and rec.assisted is not None:
        v.prefix = prefix_match(rec.control.trace, rec.assisted.trace, rec.query_step)
    v.sham_source, v.sham_text, v.sham_donor = rec.sham_source, rec.sham_text, rec.sham_donor
    sham = arms.get("sham")
    if sham is not None and sham.assistance.call_id:
        v.sham_receipt = records.receipts.get(sham.assistance.call_id)
    asking = [a for a in records.config.arms if is_assisted(a)]
    if len(asking) > 1:  # several advisors, or query points: what each asked and was told, side by side
        v.advisors = [_advisor_view(layout, records, rec, entry, arm, arm == rec.primary, assets) for arm in asking]
    assisted = rec.assisted
    if assisted is None or assisted.assistance.call_id is None:
        return v
    v.evidence = check_evidence(rec, rec.primary, arm_advisor(rec.primary))
    a = assisted.assistance
    if a.receipt_ref is not None:
        raw, v.receipt_check = _receipt_line(layout, a.receipt_ref, cache)
        if raw is not None:
            v.receipt_line = raw.decode("utf-8", "replace")
            v.receipt_href = assets.write(f"{case.case_id}.receipt.json", raw + b"\n")
    r = records.receipts.get(a.call_id)
    v.receipt = r
    if r is None:
        return v
    v.views, v.views_note, v.prompt, v.response = _call_view(layout, r, a.request_id, assets)
    return v


def _advisor_view(layout: StudyLayout, records: StudyRecords, rec, entry, name: str, primary: bool, assets: Assets) -> AdvisorView:
    """One advisor's arm (`name`): its verdict, subgoal and call (what it saw, its prompt and raw answer) for the panel."""
    arm = rec.arms.get(name)
    verdict = entry.verdict(name)
    view = AdvisorView(name=shown(name), arm=name, primary=primary)
    if verdict is not None:
        view.label, view.rule, view.reason = verdict.label, verdict.rule, verdict.reason
    if arm is None:
        return view
    a = arm.assistance
    view.subgoal, view.status = a.subgoal, a.status
    receipt = records.receipts.get(a.call_id) if a.call_id else None
    if a.status == "applied" or receipt is not None:
        view.evidence = check_evidence(rec, name, arm_advisor(name))
    if receipt is not None:
        view.receipt = receipt
        view.views, view.views_note, view.prompt, view.response = _call_view(layout, receipt, a.request_id, assets)
    return view


def _call_view(layout: StudyLayout, r, request_id: str | None, assets: Assets):
    """What one call saw (by camera, or its contact sheet), its rendered prompt and raw answer, from the kept artifacts."""
    views_out: list = []
    views_note = ""
    folder = layout.vlm_artifacts
    views = r.image_sha256.get(request_id or "", [])
    # The client renders and sends the views in VLM_VIEWS order (rescue.vlm.client), so the order names the camera.
    cameras = list(VLM_VIEWS) if len(views) == len(VLM_VIEWS) else [f"view {i + 1}" for i in range(len(views))]
    if views and all(artifact_path(folder, sha, ".png").is_file() for sha in views):
        views_out = [(camera, assets.copy(artifact_path(folder, sha, ".png"), f"{sha}.png")) for camera, sha in zip(cameras, views)]
        if len(r.case_ids) > 1:
            views_note = f" (sent to it on one contact sheet with {len(r.case_ids) - 1} other case(s) of the call)"
    elif r.sent_image_sha256:
        # A batched call sends a contact sheet of several cases; that sheet is what the VLM saw.
        rows = ", ".join(r.case_ids)
        views_out = [(f"contact sheet {i + 1}: a row per case ({rows}), columns {', '.join(VLM_VIEWS)}",
                      assets.copy(artifact_path(folder, sha, ".png"), f"{sha}.png")) for i, sha in enumerate(r.sent_image_sha256)]
        views_note = f" (a contact sheet shared by {len(r.case_ids)} case(s))" if len(r.case_ids) > 1 else ""
    prompt = _read_text(artifact_path(folder, r.prompt_sha256, ".txt"))
    response = _read_text(artifact_path(folder, r.response_sha256, ".txt")) if r.response_sha256 else None
    return views_out, views_note, prompt, response


def _plots(export: StudyExport, records: StudyRecords, assets: Assets) -> list[tuple[str, str]]:
    """The plots as (href, name), each written into the report's folder."""
    s = export.summary
    figs: list[tuple[str, bytes | None]] = []
    if s is not None:
        for what, rows in (("group", s.per_group), ("task", s.per_task)):
            data = [(name, b.rescued, b.n, wilson_interval(b.rescued, b.n)) for name, b in rows.items() if b.n]
            figs.append((f"rate-{what}", plots.rate_plot(data, f"rescue rate per {what} (main cohort)")))
        matrix: dict[str, list[int]] = {}
        for e in export.cases:
            if e.pilot or e.label is None:
                continue
            counts = matrix.setdefault(e.task, [0] * len(plots.MATRIX_COLUMNS))
            if e.in_m and e.control is not None and e.assisted is not None:
                c_ok, a_ok = bool(e.control.success), bool(e.assisted.success)
                counts[0 if a_ok and not c_ok else 1 if c_ok and not a_ok else 2 if a_ok else 3] += 1
            else:
                counts[4] += 1
        figs.append(("outcomes", plots.outcome_matrix(sorted(matrix.items()))))
        horizons = {c.case_id: c.horizon for c in records.cases}
        steps = [(e.case_id, e.query_step or 0, e.assisted.steps, horizons[e.case_id])
                 for e in export.cases if e.label == "rescued" and e.assisted is not None]
        figs.append(("steps", plots.steps_plot(steps)))
    latencies = sorted(r.latency_s for r in records.receipts.values() if r.latency_s is not None)
    figs.append(("latency", plots.latency_plot(latencies)))
    return [(assets.write(f"plot-{name}.png", png), name) for name, png in figs if png is not None]


def _partition_dirs(study: Path, meta: dict) -> list[tuple[str, Path]]:
    """The studies this one continues and is continued by, as far as their folders are found."""
    parts: list[tuple[str, Path]] = []

    def find(name: str) -> Path | None:
        for cand in (Path(name), study.parent / Path(name).name):
            if StudyLayout.of(cand).is_study():
                return cand
        return None

    for key, role in (("continues", "earlier part"), ("continued_by", "later part")):
        seen, value = set(), meta.get(key)
        while value and value not in seen:
            seen.add(value)
            found = find(value)
            parts.append((role, found if found else Path(value)))
            if found is None:
                break
            with open_journal(found) as journal:
                value = journal.meta().get(key)
    return parts


@dataclass
class Part:
    """One part of a partitioned study: its role, its folder and its export (None: not found)."""

    role: str
    path: Path
    export: StudyExport | None


@dataclass
class Partitions:
    """The parts of a continued study, and their cases merged by case id."""

    rows: list[Part]
    merged: int
    counts: str
    conflicts: list[str]


def _partitions(study: Path, export: StudyExport, meta: dict) -> Partitions | None:
    others = _partition_dirs(study, meta)
    if not others:
        return None
    rows = [Part("this study", study, export)]
    for role, path in others:
        rows.append(Part(role, path, export_study(path) if StudyLayout.of(path).is_study() else None))
    merged: dict[str, list[str]] = {}
    for part in rows:
        if part.export is None or part.export.summary is None:
            part.export = None
            continue
        for e in part.export.cases:
            if e.label is not None and not e.pilot:
                merged.setdefault(e.case_id, []).append(e.label)
    counts: dict[str, int] = {}
    for labels in merged.values():
        counts[labels[0]] = counts.get(labels[0], 0) + 1
    return Partitions(rows, len(merged), ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                      sorted(k for k, labels in merged.items() if len(labels) > 1))


def _episodes(export: StudyExport) -> list[tuple[str, dict]]:
    """An evaluation's rows: each task's counts and success rate, then overall."""
    ep = export.episodes.model_dump(mode="json") if export.episodes else {}
    return [*sorted((ep.get("per_task") or {}).items()), ("overall", ep.get("overall") or {})]


def write_report(study_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, video: bool = False) -> Path:
    """Write the study's HTML report (default `<study>/report.html`, files in `report_files/` beside it); return its path.

    `video`: also an mp4 per arm from the frames the study stored (needs imageio and imageio-ffmpeg).
    """
    study = Path(study_dir)
    out_path = Path(out) if out else StudyLayout.of(study).report
    # Read first: a path that is no study is refused before anything is created.
    export = export_study(study)
    with open_journal(study) as journal:
        records = read_study(study, journal)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    final = report_files(out_path)
    building = final.with_name(f".{final.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    assets = Assets(building, final)
    try:
        html = _render(study, export, records, assets, video)
        if final.exists():
            shutil.rmtree(final)
        os.rename(building, final)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    write_atomic(out_path, html + "\n")
    return out_path


def arm_protocols(records: StudyRecords) -> set[str | None]:
    """The episode protocols the study's arms recorded (None: an arm made before protocols)."""
    return {getattr(arm, "episode_protocol", None) for arms in records.arms.values() for arm in arms.values()}


def _render(study: Path, export: StudyExport, records: StudyRecords, assets: Assets, video: bool) -> str:
    """Write each case's panel file, then render the page (templates/study.html)."""
    info = export.study
    name = _display_name(study, info.study_id, info.kind)
    protocols = arm_protocols(records)
    cache: dict[str, list[bytes]] = {}
    by_id = {c.case_id: c for c in records.cases}
    declared = {arm: i for i, arm in enumerate(records.config.arms)}

    def arm_order(arm: str) -> tuple[int, int, str]:
        # control, the assisted arms in declared order, the sham
        return _arm_order(arm)[0], declared.get(arm, 99), arm

    any_video = False
    for e in export.cases:
        # One case at a time: its panel goes to its own file and is not kept.
        v = _case_view(study, records, by_id[e.case_id], e, assets, video, cache)
        any_video = any_video or bool(v.videos)
        assets.write(f"case/{e.case_id}.js", panel_script(e.case_id, case_panel(v, arm_order, VIDEO_NOTE)).encode())
    index = case_index(export.cases, records.config.arms, assets.prefix, [a.name for a in records.config.advisors or []])
    assets.write("cases.js", index_script(index).encode())
    baseline = None
    if info.kind == "rescue":
        found = baseline_of(records.cases)
        kind = "hand" if found.written_by_hand else ",".join(src.kind for src in found.sources)
        baseline = {"kind": kind, "sentences": baseline_sentences(found, len(records.cases))}
    s = export.summary
    answer = r_ci = None
    asking = 0
    net_lines = []
    stop_line = stop_sentence(export.stopping) if export.stopping is not None else None
    if s is not None and s.harm is not None:
        net_lines = [net_sentence(f, evaluation_name(info.baseline, s.harm)) for f in s.harm.arms]
    if s is not None:
        primary = records.config.advisors[0].name if records.config.advisors else None
        sham = records.config.sham.source if records.config.sham.on else None
        answer = answer_reading(s, sham, primary)
        r_ci = list(wilson_interval(s.r, s.n, s.confidence)) if s.n else None
        asking = sum(is_assisted(f.arm) for f in s.figures())
    return render(
        "study.html", title=f"{name} · {info.kind} study report", export=export, name=name, answer=answer, r_ci=r_ci,
        net_lines=net_lines, stop_line=stop_line,
        asking=asking,
        created=created_text(info.created_at), protocol=episode_protocol(records.config, protocols), baseline=baseline,
        provenance=provenance_rows(records.config, records.meta, records.receipts.values(), protocols),
        advisors=records.config.advisors or [], query_points=records.config.query_points, plots=_plots(export, records, assets),
        episodes=_episodes(export) if export.summary is None else [],
        partitions=_partitions(study, export, records.meta) if export.summary is not None else None,
        video=video, any_video=any_video, files=assets.prefix,
    )
