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


@dataclass(frozen=True)
class PathPlot:
    """What the template draws for one arm (rescue/read/html/templates/path.html): coordinates already in pixels
    and formatted, so the markup holds no arithmetic."""

    arm: str
    points: int
    q: int | None
    steps: int
    success: bool
    width: int
    inner: int
    left: float
    right: float
    top_line: str
    start: tuple[str, str]
    at_q: tuple[str, str] | None
    end: tuple[str, str]
    last_step: int
    end_colour: str
    value_hi: str
    value_lo: str
    zero: str | None
    steps_total: int
    axes: list[tuple[str, str, str, int]]  # name, colour, polyline points, label x
    q_x: str | None
    q_label_x: str | None
    end_x: str
    end_label_x: str
    caption: str


def path_plot(arm: ArmResult, q: int | None, bounds: Bounds | None) -> PathPlot | None:
    """The arm's path plot, or None when it recorded no end-effector position."""
    pts = points(arm)
    if not pts or bounds is None:
        return None
    b = bounds
    inner = TOP - 2 * PAD

    def top(p: tuple[float, float, float]) -> tuple[float, float]:
        return (_scale(p[0], *b.x, PAD, PAD + inner), _scale(p[1], *b.y, PAD + inner, PAD))

    left, right = TOP + 34, TOP + TIME - 6

    def sx(step: float) -> float:
        return _scale(step, 0, b.steps, left, right)

    def sy(v: float) -> float:
        return _scale(v, *b.value, HEIGHT - PAD, PAD)

    def xy(p: tuple[float, float]) -> tuple[str, str]:
        return f"{p[0]:.1f}", f"{p[1]:.1f}"

    at_q = next((p for s, p in pts if q is not None and s >= q), None)
    first = pts[0][1]
    after = f", {path_length(pts, q):.2f} m from q" if q is not None else ""
    return PathPlot(
        arm=arm.arm, points=len(pts), q=q, steps=arm.steps, success=bool(arm.success), width=TOP + TIME, inner=inner,
        left=left, right=right, top_line=" ".join(f"{x:.1f},{y:.1f}" for x, y in (top(p) for _, p in pts)),
        start=xy(top(pts[0][1])), at_q=None if at_q is None else (f"{top(at_q)[0] - 3:.1f}", f"{top(at_q)[1] - 3:.1f}"),
        end=xy(top(pts[-1][1])), last_step=pts[-1][0], end_colour="#2e7d32" if arm.success else "#9e9e9e",
        value_hi=f"{b.value[1]:+.2f}", value_lo=f"{b.value[0]:+.2f}",
        zero=f"{sy(0):.1f}" if b.value[0] < 0 < b.value[1] else None, steps_total=b.steps,
        axes=[(name, colour, " ".join(f"{sx(s):.1f},{sy(p[i] - first[i]):.1f}" for s, p in pts), left + 4 + 9 * i)
              for i, (name, colour) in enumerate(AXIS_COLOURS.items())],
        q_x=None if q is None else f"{sx(q):.1f}", q_label_x=None if q is None else f"{sx(q) + 2:.1f}",
        end_x=f"{sx(arm.steps):.1f}", end_label_x=f"{sx(arm.steps) - 2:.1f}",
        caption=f"end-effector path {path_length(pts):.2f} m over {len(pts)} queries{after}",
    )
