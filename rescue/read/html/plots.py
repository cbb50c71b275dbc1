"""The report's figures as PNG bytes (matplotlib, Agg backend, imported only when a figure is drawn).

Each function takes plain numbers and returns PNG bytes, or None when there
is nothing to draw, so the page can say "no data" instead of an empty axis.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

# Colours of the four classes, the same in the plots and the page.
LABEL_COLOURS = {
    "rescued": "#2e7d32",
    "not_rescued": "#9e9e9e",
    "unknown": "#f9a825",
    "initial_state_deviation": "#c62828",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display: the report is written headless
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    # No date in the PNG metadata, so the same study gives the same bytes.
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def rate_plot(rows: Sequence[tuple[str, int, int, tuple[float, float]]], title: str) -> bytes | None:
    """Rescued / cases per row (name, rescued, n, (lo, hi) interval) as dots with interval bars."""
    rows = [r for r in rows if r[2] > 0]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(rows) + 1.2))
    ys = list(range(len(rows)))[::-1]
    for y, (name, r, n, (lo, hi)) in zip(ys, rows):
        ax.plot([lo, hi], [y, y], color="#555", lw=2)
        ax.plot([r / n], [y], "o", color=LABEL_COLOURS["rescued"], ms=7)
        ax.annotate(f"{r}/{n}", (max(hi, r / n), y), xytext=(6, -3), textcoords="offset points", fontsize=8)
    ax.set_yticks(ys, [name for name, *_ in rows], fontsize=8)
    ax.set_xlim(0, 1.08)
    ax.set_xlabel("rescued / cases (95% Wilson interval)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


MATRIX_COLUMNS = ("assisted only", "control only", "both success", "both fail", "outside M")


def outcome_matrix(rows: Sequence[tuple[str, Sequence[int]]]) -> bytes | None:
    """Per task: counts of the 2x2 of M and the cases outside M, as an annotated heat map."""
    if not rows:
        return None
    plt = _pyplot()
    import numpy as np

    data = np.array([list(counts) for _, counts in rows], dtype=float)
    fig, ax = plt.subplots(figsize=(7.2, 0.42 * len(rows) + 1.4))
    ax.imshow(data, cmap="Blues", aspect="auto", vmin=0, vmax=max(1.0, data.max()))
    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            value = int(data[i, j])
            ax.text(j, i, str(value), ha="center", va="center", fontsize=8, color="white" if value > data.max() / 2 else "black")
    ax.set_xticks(range(len(MATRIX_COLUMNS)), MATRIX_COLUMNS, fontsize=8)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.set_title("outcome matrix per task (pairs in M; cases outside M apart)", fontsize=10)
    return _png(fig)


def latency_plot(latencies: Sequence[float]) -> bytes | None:
    """Histogram of per-call VLM latency in seconds."""
    if not latencies:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 2.6))
    ax.hist(list(latencies), bins=min(30, max(5, len(latencies))), color="#1565c0")
    ax.set_xlabel("VLM call latency (s)")
    ax.set_ylabel("calls")
    ax.set_title(f"VLM latency over {len(latencies)} call(s)", fontsize=10)
    return _png(fig)


# Above this many rescued cases the steps plot is a histogram instead of a bar per case.
MAX_BARS = 40


def steps_plot(rows: Sequence[tuple[str, int, int, int]]) -> bytes | None:
    """Rescued cases (case id, query step, assisted steps, horizon): where in the episode success came."""
    if not rows:
        return None
    plt = _pyplot()
    if len(rows) > MAX_BARS:
        # One bar per case stops being readable (and the figure's height would grow with the study).
        fig, ax = plt.subplots(figsize=(6.4, 2.6))
        ax.hist([(steps - q) / max(1, horizon - q) for _, q, steps, horizon in rows], bins=20, range=(0, 1), color=LABEL_COLOURS["rescued"])
        ax.set_xlabel("steps from q to success, as a share of the steps left after q (H - q)")
        ax.set_ylabel("rescued cases")
        ax.set_title(f"when the {len(rows)} rescued cases succeeded", fontsize=10)
        return _png(fig)
    fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(rows) + 1.2))
    ys = list(range(len(rows)))[::-1]
    for y, (_, q, steps, horizon) in zip(ys, rows):
        ax.barh(y, horizon, color="#eeeeee", height=0.6)
        ax.barh(y, steps, color=LABEL_COLOURS["rescued"], height=0.6)
        ax.plot([q, q], [y - 0.35, y + 0.35], color="black", lw=1.5)
    ax.set_yticks(ys, [case for case, *_ in rows], fontsize=8)
    ax.set_xlabel("step (green: steps to success; black tick: query point q; grey: horizon)")
    ax.set_title("steps to success of the rescued cases", fontsize=10)
    return _png(fig)
