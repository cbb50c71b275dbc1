"""An arm's end-effector path as a small inline SVG (pure: records in, markup out).

Drawn from the per-query positions the diagnostics keep (`ArmResult.queries[*].ee_pos`,
world frame, metres): on the left the path seen from above (x, y), on the right x, y
and z over the env steps as displacements from the first recorded position (so the
three share one axis), with the query point q and the arm's end (its success, or
its last step) marked. The arms of one case share their axes, so they compare by eye.
An SVG costs no matplotlib call per arm and is loaded with the case's panel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from rescue.core.records import ArmResult

TOP, TIME, HEIGHT, PAD = 130, 250, 130, 16
AXIS_COLOURS = {"x": "#1565c0", "y": "#ef6c00", "z": "#6a1b9a"}


@dataclass(frozen=True)
class Bounds:
    """The shared axes of one case's plots."""

    x: tuple[float, float]
    y: tuple[float, float]
    value: tuple[float, float]
    steps: int


def points(arm: ArmResult) -> list[tuple[int, tuple[float, float, float]]]:
    """(step, position) of each query that recorded the end effector's position."""
    return [(q.step, tuple(q.ee_pos)) for q in arm.queries if q.ee_pos is not None]


def path_length(pts: Sequence[tuple[int, tuple[float, float, float]]], since: int = 0) -> float:
    """Metres travelled between consecutive recorded positions, from step `since` on."""
    kept = [p for s, p in pts if s >= since]
    return sum(math.dist(a, b) for a, b in pairwise(kept))


def _displacements(pts: Sequence[tuple[int, tuple[float, float, float]]]) -> list[float]:
    if not pts:
        return []
    first = pts[0][1]
    return [p[i] - first[i] for _, p in pts for i in range(3)]


def _span(lo: float, hi: float) -> tuple[float, float]:
    if hi - lo < 1e-6:
        return lo - 0.05, hi + 0.05
    pad = (hi - lo) * 0.08
    return lo - pad, hi + pad


def shared_bounds(arms: Sequence[ArmResult], horizon: int) -> Bounds | None:
    """Axes that hold every arm's path (None when no arm recorded a position)."""
    pts = [p for arm in arms for _, p in points(arm)]
    if not pts:
        return None
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    # The top view keeps the aspect: one metre is as long on both axes.
    (x0, x1), (y0, y1) = _span(min(xs), max(xs)), _span(min(ys), max(ys))
    side = max(x1 - x0, y1 - y0)
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    values = [v for arm in arms for v in _displacements(points(arm))]
    return Bounds((cx - side / 2, cx + side / 2), (cy - side / 2, cy + side / 2), _span(min(values), max(values)),
                  max(horizon, max(arm.steps for arm in arms), 1))


def _scale(v: float, lo: float, hi: float, a: float, b: float) -> float:
    return a + (v - lo) / (hi - lo) * (b - a)


def path_svg(arm: ArmResult, q: int | None, bounds: Bounds | None) -> str:
    """The arm's path plot, or a note when it recorded no end-effector position."""
    pts = points(arm)
    if not pts or bounds is None:
        return '<p class="note">no end-effector positions recorded for this arm</p>'
    b = bounds
    inner = TOP - 2 * PAD

    def top(p: tuple[float, float, float]) -> tuple[float, float]:
        return (_scale(p[0], *b.x, PAD, PAD + inner), _scale(p[1], *b.y, PAD + inner, PAD))

    left, right = TOP + 34, TOP + TIME - 6

    def sx(step: float) -> float:
        return _scale(step, 0, b.steps, left, right)

    def sy(v: float) -> float:
        return _scale(v, *b.value, HEIGHT - PAD, PAD)

    out = [(f'<svg class="ee-path" data-of="{arm.arm}" data-points="{len(pts)}" data-q="{"" if q is None else q}" '
           f'data-end="{arm.steps}" data-success="{str(bool(arm.success)).lower()}" width="{TOP + TIME}" height="{HEIGHT}" '
           f'viewBox="0 0 {TOP + TIME} {HEIGHT}" style="width:100%;max-width:{TOP + TIME}px;height:auto" role="img" '
           'font-size="9" font-family="system-ui,sans-serif">'),
           f"<title>{arm.arm}: end-effector path, {len(pts)} queries</title>",
           f'<rect x="{PAD}" y="{PAD}" width="{inner}" height="{inner}" fill="#fafafa" stroke="#ccc"/>',
           f'<text x="{PAD}" y="{PAD - 4}">top view (x, y)</text>']
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (top(p) for _, p in pts))
    out.append(f'<polyline points="{line}" fill="none" stroke="#455a64" stroke-width="1.2"/>')
    sx0, sy0 = top(pts[0][1])
    out.append(f'<circle cx="{sx0:.1f}" cy="{sy0:.1f}" r="3" fill="none" stroke="#455a64"><title>start</title></circle>')
    at_q = next((p for s, p in pts if q is not None and s >= q), None)
    if at_q is not None:
        x, y = top(at_q)
        out.append(f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6" fill="#000"><title>at q = {q}</title></rect>')
    end_colour = "#2e7d32" if arm.success else "#9e9e9e"
    x, y = top(pts[-1][1])
    out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{end_colour}"><title>last query (step {pts[-1][0]})</title></circle>')
    # x, y, z over the steps.
    out.append(f'<rect x="{left}" y="{PAD}" width="{right - left}" height="{HEIGHT - 2 * PAD}" fill="#fafafa" stroke="#ccc"/>')
    out.append(f'<text x="{left}" y="{PAD - 4}">x, y, z from the start (m) over env steps</text>')
    out.append(f'<text x="{left - 3}" y="{PAD + 7}" text-anchor="end">{b.value[1]:+.2f}</text>')
    out.append(f'<text x="{left - 3}" y="{HEIGHT - PAD}" text-anchor="end">{b.value[0]:+.2f}</text>')
    if b.value[0] < 0 < b.value[1]:
        out.append(f'<line x1="{left}" x2="{right}" y1="{sy(0):.1f}" y2="{sy(0):.1f}" stroke="#ddd"/>')
    first = pts[0][1]
    out.append(f'<text x="{left}" y="{HEIGHT - 4}">0</text><text x="{right}" y="{HEIGHT - 4}" text-anchor="end">{b.steps}</text>')
    for i, (name, colour) in enumerate(AXIS_COLOURS.items()):
        line = " ".join(f"{sx(s):.1f},{sy(p[i] - first[i]):.1f}" for s, p in pts)
        out.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="1.2"><title>{name}</title></polyline>')
        out.append(f'<text x="{left + 4 + 9 * i}" y="{PAD + 10}" fill="{colour}">{name}</text>')
    if q is not None:
        out.append(f'<line class="q" x1="{sx(q):.1f}" x2="{sx(q):.1f}" y1="{PAD}" y2="{HEIGHT - PAD}" stroke="#000" '
                   f'stroke-dasharray="3,2"/><text x="{sx(q) + 2:.1f}" y="{HEIGHT - PAD - 3}">q {q}</text>')
    what = f"success {arm.steps}" if arm.success else f"end {arm.steps}"
    out.append(f'<line class="end" x1="{sx(arm.steps):.1f}" x2="{sx(arm.steps):.1f}" y1="{PAD}" y2="{HEIGHT - PAD}" '
               f'stroke="{end_colour}" stroke-width="1.5"/><text x="{sx(arm.steps) - 2:.1f}" y="{PAD + 20}" '
               f'text-anchor="end" fill="{end_colour}">{what}</text>')
    out.append("</svg>")
    after = f", {path_length(pts, q):.2f} m from q" if q is not None else ""
    caption = f"end-effector path {path_length(pts):.2f} m over {len(pts)} queries{after}"
    return "".join(out) + f'<p class="note">{caption}</p>'
