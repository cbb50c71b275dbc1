"""What a running study prints about itself: the ETA of its progress line and its p-values."""

from __future__ import annotations

from io import StringIO
from types import SimpleNamespace

import pytest
from rich.console import Console

from rescue.read.terminal import _p
from rescue.run.progress import LiveProgress

pytestmark = pytest.mark.fast


def _live(pending: int, arms: int, horizon: int) -> LiveProgress:
    live = LiveProgress("cases", Console(file=StringIO()))
    live.study_started(pending, arms, pending * arms * horizon)
    return live


def test_the_eta_comes_from_cases_done_once_one_has_ended():
    # Forked arms skip their prefix and rescued arms stop early: far fewer steps than the bound.
    live = _live(pending=4, arms=3, horizon=280)
    for _ in range(2):
        live.steps_done(280 + 2 * 140)
        live.case_finished(SimpleNamespace(label="rescued"))
    assert live._eta_s(100.0) == pytest.approx(100.0)  # 2 of 4 cases in 100 s: 100 s to go
    live.case_finished(SimpleNamespace(label="not_rescued"))
    live.case_finished(SimpleNamespace(label="rescued"))
    assert live._eta_s(100.0) == 0.0


def test_before_any_case_ends_the_eta_comes_from_the_steps_bound():
    live = _live(pending=2, arms=2, horizon=100)
    assert live._eta_s(10.0) is None  # nothing to go by yet
    live.steps_done(100)
    assert live._eta_s(10.0) == pytest.approx(30.0)  # 100 of at most 400 steps in 10 s


def test_small_p_values_keep_their_magnitude():
    assert _p(8.6e-50) == "8.6e-50" and _p(0.00049) == "0.00049"
    assert _p(0.25) == "0.2500" and _p(1.0) == "1.0000"


def test_the_summary_tables_print_a_tiny_p_value_as_such():
    from helpers.case_records import make_case

    from rescue.core.classify import classify
    from rescue.core.figures.stats import summarize
    from rescue.read.terminal import group_table, summary_table

    records = [make_case(f"c{i}", assisted_success=True) for i in range(40)]
    summary = summarize(records, [classify(r) for r in records])
    assert summary.versus_control.mcnemar_p < 1e-11
    out = StringIO()
    console = Console(file=out, width=200)
    console.print(summary_table(summary, "rescue study"))
    console.print(group_table(summary))
    assert _p(summary.versus_control.mcnemar_p) in out.getvalue() and "0.0000" not in out.getvalue()
