"""Latency hiding: a study with a slow VLM vs the same study with an instant one.

The VLM latency is the seed's median call (46.16 s for arms of 1,800 steps)
scaled by the horizon: 46.16 s x H / 1800 per call. An arm waiting at q gives its simulator back (a snapshot), so the
simulators keep stepping other arms. Target: at most 1.05 with 4 or more arms in flight.
Run: MUJOCO_GL=egl .venv/bin/python benchmarks/latency_hiding.py [N] [H]
"""

from __future__ import annotations

import sys

from common import Endpoint, cases, timed_study

from rescue.core.configuration.config import StudyConfig

SEED_MEDIAN_S, SEED_HORIZON = 46.16, 1800


def _run(items, latency: float, in_flight: int) -> float:
    endpoint = Endpoint(latency)
    try:
        config = StudyConfig.model_validate({"cases_in_flight": in_flight, "vlm": {"base_url": endpoint.url}})
        return timed_study(items, config)
    finally:
        endpoint.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    horizon = int(sys.argv[2]) if len(sys.argv) > 2 else 160
    in_flight = 4  # cases, so up to 8 arms in flight on 2 simulators
    items = cases(n, horizon)
    latency = round(SEED_MEDIAN_S * horizon / SEED_HORIZON, 2)
    zero = _run(items, 0.0, in_flight)
    slow = _run(items, latency, in_flight)
    print(f"{n} cases, H={horizon}, {in_flight} cases ({2 * in_flight} arms) in flight, 2 simulators")
    print(f"zero latency: {zero:.1f} s; VLM latency {latency:.2f} s per call: {slow:.1f} s")
    print(f"latency hiding ratio: {slow / zero:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
