"""The shape the cache benchmarks share: rounds of three fresh processes (the cache off, empty, then warm), and
the verdict (the warm / off CPU ratio, and whether every process's result was the same)."""

from __future__ import annotations

import statistics
import sys
import tempfile
from typing import Callable


def cache_rounds(rounds: int, run: Callable[[str], dict], prefix: str, kept: Callable[[str], None] = lambda folder: None):
    """ROUNDS rounds of `run(cache)` with the cache `off`, empty and warm; `kept(folder)` sees the folder after each round."""
    runs: dict[str, list[dict]] = {"off": [], "cold": [], "warm": []}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix=prefix) as folder:
            runs["off"].append(run("off"))
            runs["cold"].append(run(folder))
            runs["warm"].append(run(folder))
            kept(folder)
    return runs


def verdict(runs: dict[str, list[dict]], key: str, what: str) -> None:
    """Print warm / off CPU and whether every run's `key` agrees; exit 1 if not."""
    same = len({r[key] for rs in runs.values() for r in rs}) == 1
    off, warm = (statistics.median(r["cpu_s"] for r in runs[name]) for name in ("off", "warm"))
    print(f"  warm / off CPU: {warm / off:.2f}; {what} identical: {same}")
    if not same:
        sys.exit(1)
