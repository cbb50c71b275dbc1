"""Overhead: a study of N cases vs a bare loop running the same 2N arms (no journal, traces, receipts, classification).

Same simulator processes, policy server, VLM endpoint and concurrency.
Each is run twice, alternating; the figure uses the faster of each.
Target: at most 1.03.
Run: MUJOCO_GL=egl .venv/bin/python benchmarks/overhead.py [N] [H]
"""

from __future__ import annotations

import sys

from common import POLICY, cases, study_config, timed_bare, timed_study


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    horizon = int(sys.argv[2]) if len(sys.argv) > 2 else 160
    items, config = cases(n, horizon), study_config()
    bare, study = [], []
    for _ in range(2):
        bare.append(timed_bare(items, config))
        study.append(timed_study(items, config))
    print(f"{POLICY} policy, {n} cases, H={horizon}, {config.env.simulators} simulators, {config.cases_in_flight} cases in flight")
    print(f"bare loop: {', '.join(f'{t:.1f}' for t in bare)} s; study: {', '.join(f'{t:.1f}' for t in study)} s")
    print(f"overhead ratio (study / bare, best of each): {min(study) / min(bare):.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
