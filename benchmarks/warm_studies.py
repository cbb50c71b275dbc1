"""What warm simulators save a machine that runs study after study: N studies each way, one after the other.

    MUJOCO_GL=egl .venv/bin/python benchmarks/warm_studies.py [N] [CASES] [HORIZON]

Each way runs N studies of the same CASES libero_object cases (task 3, HORIZON steps, the CLI's defaults: two
simulators, the embedded policy and VLM) with `rescue run`, one after the other: with simulators of each
study's own (`--warm-simulators off`), then leasing from one `rescue serve-simulators` started before the
first study (its start is counted). Both ways share one compiled-model cache, warmed before either, as a
machine that builds the same envs again has. Printed per way: wall and CPU (every process's, the warm pool's
included: each is a child this script waits for), and the median start-up of a study: from the command's start
to its first arm's start and to its first arm's end (the journal's `started_at`, `finished_at`; an arm starts
before its simulator is ready, so a simulator's boot shows in the second). Every study's arms must equal the first study's but for
when they ran; the script fails otherwise.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _manifest(path: Path, cases: int, horizon: int) -> Path:
    rows = [{"case_id": f"object-3-ep{i}", "suite": "libero_object", "task_id": 3, "init_state_index": i,
             "env_seed": i, "horizon": horizon, "group": "object"} for i in range(cases)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _arms(study: Path) -> dict:
    import sqlite3

    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True)
    try:
        arms = {}
        for case_id, arm, data in con.execute("SELECT case_id, arm, data FROM arms"):
            record = json.loads(data)
            for key in ("started_at", "finished_at", "restored_render"):  # when and where it ran
                record.pop(key, None)
            for key in ("receipt_ref", "call_id", "request_id"):
                (record.get("assistance") or {}).pop(key, None)
            arms[(case_id, arm)] = record
        return arms
    finally:
        con.close()


def _first_arm(study: Path) -> tuple[float, float]:
    """When the study's first arm started, and when its first arm finished (epoch s)."""
    import sqlite3

    con = sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True)
    try:
        records = [json.loads(data) for (data,) in con.execute("SELECT data FROM arms")]
        return min(r["started_at"] for r in records), min(r["finished_at"] for r in records)
    finally:
        con.close()


def _study(manifest: Path, study: Path, warm: str, env: dict) -> tuple[float, float]:
    """Run one study; its start-up: s from the command's start to its first arm's start, and to its first arm's
    end (an arm starts before its simulator is ready: a simulator's boot shows in the second)."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study),
                           "--warm-simulators", warm], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rescue run exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    started, finished = _first_arm(study)
    return started - start, finished - start


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 20
    cases = int(argv[1]) if len(argv) > 1 else 3
    horizon = int(argv[2]) if len(argv) > 2 else 48
    work = Path(tempfile.mkdtemp(prefix="warm-bench-"))
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_MODEL_CACHE": str(work / "models")}
    env.pop("RESCUE_WARM_SIMULATORS", None)
    manifest = _manifest(work / "m.jsonl", cases, horizon)
    try:
        _study(manifest, work / "warm-up", "off", env)  # fills the compiled-model cache
        reference = _arms(work / "warm-up")
        results = {}
        for way in ("own", "warm"):
            wall, cpu = time.perf_counter(), _cpu()
            server = None
            if way == "warm":
                folder = str(work / "pool")
                server = subprocess.Popen([sys.executable, "-m", "rescue.cli", "serve-simulators", folder, "--size", "2"],
                                          cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
                server.stdout.readline()
            startups = []
            for i in range(n):
                study = work / f"{way}-{i}"
                startups.append(_study(manifest, study, folder if server else "off", env))
                if _arms(study) != reference:
                    raise SystemExit(f"{study}: the arms differ from the first study's")
            if server is not None:
                server.send_signal(signal.SIGTERM)
                server.wait()
            results[way] = {"studies": n, "wall_s": round(time.perf_counter() - wall, 1),
                            "cpu_s": round(_cpu() - cpu, 1),
                            "first_arm_started_median_s": round(statistics.median(s for s, _ in startups), 2),
                            "first_arm_finished_median_s": round(statistics.median(f for _, f in startups), 2)}
            print(json.dumps({"way": way, **results[way]}), flush=True)
        own, warm = results["own"], results["warm"]
        print(json.dumps({"saved_wall_s": round(own["wall_s"] - warm["wall_s"], 1),
                          "saved_cpu_s": round(own["cpu_s"] - warm["cpu_s"], 1),
                          "wall_ratio": round(warm["wall_s"] / own["wall_s"], 3),
                          "cpu_ratio": round(warm["cpu_s"] / own["cpu_s"], 3)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
