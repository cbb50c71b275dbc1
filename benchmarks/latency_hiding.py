"""Latency hiding: a study with a slow VLM vs the same study with an instant one.

The VLM latency is scaled from the seed (a 46 s median per call) to this study's
size: it is set to half of the mean assisted-arm duration measured in the
zero-latency run, so every assisted arm waits a long time relative to its own
work. An arm waiting at q gives its simulator back (a snapshot), so the
simulators keep stepping other arms. Target: at most 1.05 with 4 or more arms in flight.
Run: MUJOCO_GL=egl .venv/bin/python benchmarks/latency_hiding.py [N] [H]
"""

from __future__ import annotations

import sys

from common import Endpoint, cases, timed_study
from rescue.config import StudyConfig


def _run(items, latency: float, in_flight: int) -> float:
    endpoint = Endpoint(latency)
    try:
        config = StudyConfig.model_validate({"cases_in_flight": in_flight, "vlm": {"base_url": endpoint.url}})
        return timed_study(items, config)
    finally:
        endpoint.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    horizon = int(sys.argv[2]) if len(sys.argv) > 2 else 160
    in_flight = 4  # cases, so up to 8 arms in flight on 2 simulators
    items = cases(n, horizon)
    zero = _run(items, 0.0, in_flight)
    # Each case's two arms share the simulators' time: one arm's share of the run.
    arm_time = zero * StudyConfig().env.simulators / (2 * n)
    latency = round(arm_time / 2, 2)
    slow = _run(items, latency, in_flight)
    print(f"{n} cases, H={horizon}, {in_flight} cases ({2 * in_flight} arms) in flight, 2 simulators")
    print(f"zero latency: {zero:.1f} s; VLM latency {latency:.2f} s per call: {slow:.1f} s")
    print(f"latency hiding ratio: {slow / zero:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
