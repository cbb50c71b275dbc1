"""Coverage, width and bias of the net change's two intervals (DESIGN §17) by simulation, through the project's own
sampler and estimator (tests/harm_coverage.py), over the regimes of the fast test, with more studies: the table
docs/benchmarks.md records; beside it, how the one normal interval of `rescue-export/6` fared on the same kind of
draws. Pure computation, no simulator.

Run: .venv/bin/python benchmarks/harm_coverage.py [STUDIES] [DRAWS]   (defaults 2000 studies, 20000 draws for bias)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from harm_coverage import REGIMES, benchmark, bias, old_estimator, these_episodes  # noqa: E402


def main() -> None:
    studies = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    draws = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    start = time.time()
    print(f"{studies} studies a regime (benchmark: as many new evaluations), bias over {draws} draws; 95% intervals")
    print("| regime | truth | these episodes: coverage | mean width | zero-width | benchmark: coverage | mean width "
          "| zero-width | bias | rescue-export/6's interval: coverage, zero-width |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for regime in REGIMES:
        tally, _ = these_episodes(regime, studies)
        bench = benchmark(regime, studies)
        shift = bias(regime, draws)
        old = old_estimator(regime, studies)
        print(f"| {regime.name} | {100 * regime.truth:+.1f} pp | {tally.coverage:.3f} | {100 * tally.width / tally.studies:.1f} pp "
              f"| {tally.zero_width} | {bench.coverage:.3f} | {100 * bench.width / bench.studies:.1f} pp | {bench.zero_width} "
              f"| {shift:+.2f} pp | {old.coverage:.3f}, {old.zero_width / old.studies:.0%} |", flush=True)
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
