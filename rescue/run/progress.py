"""The live view of a running study: a `RunObserver` that shows progress.

On a terminal, a bar; elsewhere (nohup, Slurm, CI, `| tee`) a plain line now and then.
"""

from __future__ import annotations

import os
import time
from collections import Counter

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from rescue.run.observer import RunObserver


class LiveProgress(RunObserver):
    """A live view of a running study: cases (or episodes) done of the total, rate and ETA, arms in
    flight, arms waiting for the VLM, and the labels so far.

    On a terminal, a bar; elsewhere (nohup, Slurm, CI, `| tee`) a plain line every
    RESCUE_PROGRESS_EVERY_S seconds (default 30), as soon as there is something to say. Once a case
    has ended the ETA comes from the cases done; before, from the env steps done against the steps
    the cases may take (an upper bound: forked arms skip their prefix, successes end early)."""

    def __init__(self, title: str, console: Console):
        """`title` names what is counted ("cases", "episodes, then cases"); `console` is the one the command prints to."""
        self.title = title
        self.word = title.replace(",", " ").split()[0]  # "cases" or "episodes": what is counted
        self.counts: Counter[str] = Counter()
        self.arms = self.waiting = 0
        self.total: int | None = None
        self.steps_total = self.steps = 0
        self.plain = not console.is_terminal
        self.every_s = float(os.environ.get("RESCUE_PROGRESS_EVERY_S", "30"))
        self.printed_at = 0.0
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[rate]}"),
            TextColumn("{task.fields[flight]}"), TextColumn("{task.fields[labels]}"),
            console=console, transient=False,
        )
        self.task = self.progress.add_task(title, total=None, labels="", flight="", rate="")
        self.started = time.monotonic()
        self.shown = False

    def study_started(self, pending: int, arms_per_case: int, steps: int | None = None) -> None:
        # Shown from the first study start on: a command refused before it shows no empty bar.
        if not self.shown and not self.plain:
            self.progress.start()
        self.shown = True
        self.total, self.steps_total, self.steps = pending, steps or 0, 0
        self.counts.clear()
        self.started = time.monotonic()
        self.progress.update(self.task, total=pending, completed=0)
        self.per_case = arms_per_case
        self._refresh(force=True)

    def arm_started(self, arm: str) -> None:
        self.arms += 1
        self._refresh()

    def arm_finished(self, arm: str) -> None:
        self.arms -= 1
        self._refresh()

    def vlm_waiting(self, delta: int) -> None:
        self.waiting += delta
        self._refresh()

    def steps_done(self, steps: int) -> None:
        self.steps += steps
        self._refresh()

    def case_finished(self, verdict) -> None:
        self.counts[verdict.label] += 1
        self.progress.update(self.task, advance=1)
        self._refresh()

    __call__ = case_finished

    def stopping(self, message: str) -> None:
        # Printed above the bar, at once: the person who pressed Ctrl-C learns what it does.
        self.progress.console.print(f"rescue: {message}") if not self.plain else print(f"rescue: {message}", flush=True)

    def _eta_s(self, elapsed: float) -> float | None:
        done = sum(self.counts.values())
        if done and self.total:
            return elapsed * max(0, self.total - done) / done
        if self.steps and self.steps_total:
            return elapsed * max(0, self.steps_total - self.steps) / self.steps
        return None

    def _refresh(self, force: bool = False) -> None:
        done = sum(self.counts.values())
        elapsed = time.monotonic() - self.started
        hours = elapsed / 3600
        rate = f"{done / hours:.0f} {self.word}/h" if done and hours > 0 else ""
        flight = f"arms {self.arms} (VLM {self.waiting})"
        labels = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        if not self.plain:
            self.progress.update(self.task, rate=rate, flight=flight, labels=labels)
            return
        if not self.shown or (not force and elapsed - self.printed_at < self.every_s):
            return
        self.printed_at = elapsed
        eta = self._eta_s(elapsed)
        parts = [f"{done}/{self.total} {self.word}", flight, rate or f"0 {self.word} done",
                 f"eta {_clock(eta)}" if eta is not None else "eta unknown", f"elapsed {_clock(elapsed)}", labels]
        print("rescue: " + ", ".join(p for p in parts if p), flush=True)

    def __enter__(self) -> LiveProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.shown and not self.plain:
            self.progress.stop()
        elif self.shown:
            self._refresh(force=True)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
