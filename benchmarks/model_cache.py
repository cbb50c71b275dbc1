"""What the compiled-model cache saves: one env build in a fresh process, ROUNDS times each way.

    MUJOCO_GL=egl .venv/bin/python benchmarks/model_cache.py [ROUNDS] [SUITE] [TASK]

Per round, three fresh processes build the env of SUITE's TASK (default libero_object 3) and reset it once:
with the cache off (`RESCUE_MODEL_CACHE=off`: MuJoCo compiles the XML), with an empty cache (compile, then
keep the model) and with that cache warm (load the kept model). Each prints its build's CPU and wall, its
peak RSS and the reset's fingerprint, which digests the compiled model's binary form: the three must agree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from cache_rounds import cache_rounds, verdict

CHILD = r"""
import json, resource, sys, time
from rescue.env.libero import LiberoAdapter
adapter = LiberoAdapter()
case = {"suite": sys.argv[1], "task_id": int(sys.argv[2]), "init_state_index": 0, "env_seed": 0}
cpu, wall = time.process_time(), time.perf_counter()
fingerprint = adapter.reset(case).fingerprint
print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, "fingerprint": fingerprint}))
"""


def build(cache: str, suite: str, task: str) -> dict:
    """One build and reset in a fresh process with the cache set to `cache`."""
    env = {**os.environ, "RESCUE_MODEL_CACHE": cache, "PYTHONHASHSEED": "0", "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    out = subprocess.run([sys.executable, "-c", CHILD, suite, task], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    suite, task = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("libero_object", "3")
    sizes: list[float] = []

    def kept(folder: str) -> None:
        sizes.append(sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 1e6)

    runs = cache_rounds(rounds, lambda cache: build(cache, suite, task), "model-cache-", kept)
    print(f"{suite} task {task}, {rounds} rounds; the cache holds {sizes[-1]:.0f} MB for this env")
    for name, rs in runs.items():
        print(f"  {name:5s} build+reset CPU {statistics.median(r['cpu_s'] for r in rs):5.2f} s (median), "
              f"wall {statistics.median(r['wall_s'] for r in rs):5.2f} s, peak RSS {max(r['peak_rss_gb'] for r in rs):.2f} GB")
    verdict(runs, "fingerprint", "fingerprints")

if __name__ == "__main__":
    main()
