"""Cases per hour vs simulator actors on the Ray backend (one-machine cluster), and the local backend.

Each configuration runs the same rescue study (the embedded policy, the local
VLM endpoint, N cases of one libero_object task) through the real CLI:
`rescue run --backend ray --simulators K --cases-in-flight K` for K in 1, 2, 4
(each actor asks for 0.5 CPU so four fit on a 2-core machine), and the local
backend with 2 simulator processes for comparison. The rate counts from the
first claim to the last verdict (events.jsonl), so cluster start-up and the
simulators' first scene build before the first claim are left out; the wall
time of the whole command is printed beside it.
Run: MUJOCO_GL=egl .venv/bin/python benchmarks/ray_throughput.py [CASES] [HORIZON]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import write_cases  # noqa: E402


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def run(manifest: Path, study: Path, extra: list[str]) -> tuple[float, float, int]:
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study), *extra],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    events = [json.loads(line) for line in (study / "events.jsonl").read_text().splitlines() if line.strip()]
    claims = [_stamp(e["timestamp"]) for e in events if e["event"] == "case.claimed"]
    verdicts = [_stamp(e["timestamp"]) for e in events if e["event"] == "case.classified"]
    return max(verdicts) - min(claims), wall, len(verdicts)


def main() -> None:
    cases = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    horizon = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    with tempfile.TemporaryDirectory() as tmp:
        manifest = write_cases(Path(tmp) / "m.jsonl", cases, horizon=horizon)
        configs = [("local", 2, ["--simulators", "2", "--cases-in-flight", "2"])] + [
            ("ray", k, ["--backend", "ray", "--simulators", str(k), "--cases-in-flight", str(k), "--ray-actor-cpus", "0.5"])
            for k in (1, 2, 4)
        ]
        print(f"{cases} cases, horizon {horizon}, {os.cpu_count()} CPUs")
        print(f"{'backend':8} {'simulators':>10} {'cases/h':>8} {'run s':>7} {'wall s':>7}")
        base = None
        for name, k, extra in configs:
            span, wall, done = run(manifest, Path(tmp) / f"{name}-{k}", extra)
            rate = done / span * 3600
            if name == "ray" and k == 1:
                base = rate
            ratio = f"  x{rate / base:.2f} of ray/1" if base and name == "ray" and k > 1 else ""
            print(f"{name:8} {k:>10} {rate:>8.0f} {span:>7.1f} {wall:>7.1f}{ratio}")


if __name__ == "__main__":
    main()
