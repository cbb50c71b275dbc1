"""The same LIBERO episodes through vla-eval and through rescue, in one run on one machine (DESIGN §19).

One deterministic model behind the harness's own `PredictModelServer` and serving code (tests/vla_eval_peers.py,
chunk_size 5, asking for the wrist image and the state), served once for both sides. Then, one after the other:
- the harness: `vla-eval run --no-docker` of its LIBERO benchmark, TASKS tasks x EPISODES episodes of SUITE at
  the suite's own horizon, unsharded, recording on (its default);
- rescue: `rescue eval` of the same episodes under the vla-eval protocol against the same server, with one
  simulator (the harness's run is one process).
Printed for each: wall, episodes per second, the CPU-seconds of its own process tree per episode (the command and,
for rescue, its simulator process; the model server apart, and its CPU per episode for each side too), whether
the two sides' episodes ended alike (outcome and length, episode by episode), and whether the two renderers
the harness offers (`render: gpu` leaves EGL, `render: cpu` picks OSMesa) draw LIBERO's frames alike here.

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/vla_eval_side_by_side.py [--suite libero_object] [--tasks 2] [--episodes 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's rescue, not an installed one

from rescue.study.journal import Journal

CHUNK = 5


def env() -> dict:
    return {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_WARM_SIMULATORS": "off",
            "RESCUE_PROGRESS_EVERY_S": "600"}


def timed(argv: list[str], cwd: Path) -> tuple[float, float]:
    """Run a command; its wall seconds and the CPU-seconds of it and every descendant it waited for."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    said = proc.stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} exited {proc.returncode}:\n{said[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def serve(port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "vla_eval_peers.py"), "--address", f"127.0.0.1:{port}",
                             f"--args.chunk_size={CHUNK}"], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                if reply.status == 200:
                    return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the model server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)


def cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def harness_outcomes(recording: Path) -> dict[tuple[int, int], tuple[str, int]]:
    con = sqlite3.connect(f"file:{recording}?mode=ro", uri=True)
    try:
        return {(json.loads(c)["task_id"], json.loads(c)["episode_idx"]): (status, steps)
                for status, steps, c in con.execute("SELECT status, steps, context FROM episode_results")}
    finally:
        con.close()


def rescue_outcomes(study: Path) -> dict[tuple[int, int], tuple[str, int]]:
    with Journal.open(study) as journal:
        cases = {c.case_id: c for c in journal.cases()}
        return {(cases[cid].task_id, cases[cid].init_state_index): ("success" if arms["control"].success else "fail",
                                                                     arms["control"].steps)
                for cid, arms in journal.all_arms().items()}


FRAMES = """
import hashlib, sys
from rescue.core.manifest import Case
from rescue.env.libero import LiberoAdapter
adapter = LiberoAdapter()
for suite in sys.argv[1:]:
    case = Case(case_id="r", suite=suite, task_id=0, init_state_index=0, env_seed=7, horizon=10)
    obs = adapter.reset(case, "vla-eval-libero+wrist", "vla-eval").obs
    print(suite, hashlib.sha256(obs["images/agentview"].tobytes() + obs["images/wrist"].tobytes()).hexdigest())
adapter.close()
"""


def renderers_agree(suites: list[str]) -> bool:
    """Whether EGL (rescue's default, the harness's `render: gpu` here) and OSMesa (its `render: cpu`) draw the
    agentview and wrist frames of each suite's task 0 at reset byte for byte alike."""
    digests = []
    for gl in ("egl", "osmesa"):
        out = subprocess.run([sys.executable, "-c", FRAMES, *suites], cwd=ROOT, capture_output=True, text=True, check=True,
                             env={**env(), "MUJOCO_GL": gl, "PYOPENGL_PLATFORM": gl})
        digests.append([line for line in out.stdout.splitlines() if line.startswith(tuple(suites))])
    return digests[0] == digests[1] and len(digests[0]) == len(suites)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="libero_object")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=4)
    args = parser.parse_args()
    n = args.tasks * args.episodes
    work = Path(tempfile.mkdtemp(prefix="vla-eval-side-by-side-"))
    port = 8041
    server = serve(port, work / "server.log")
    model = psutil.Process(server.pid)
    url = f"ws://127.0.0.1:{port}"
    try:
        config = {"server": {"url": url}, "output_dir": str(work / "harness"), "benchmarks": [{
            "benchmark": "vla_eval.benchmarks.libero.benchmark:LIBEROBenchmark",
            "params": {"suite": args.suite, "seed": 7}, "episodes_per_task": args.episodes, "max_tasks": args.tasks}]}
        (work / "run.yaml").write_text(json.dumps(config))
        eval_id = "side-by-side"
        before = cpu(model)
        harness = timed([str(Path(sys.executable).with_name("vla-eval")), "run", "--no-docker", "-c", str(work / "run.yaml"),
                         "--eval-id", eval_id], work)
        harness_model = cpu(model) - before
        study = work / "rescue"
        before = cpu(model)
        ours = timed([sys.executable, "-m", "rescue.cli", "eval", "--suite", args.suite, "--tasks",
                      ",".join(str(t) for t in range(args.tasks)), "--episodes", str(args.episodes),
                      "--episode-protocol", "vla-eval", "--policy-url", f"vla-eval+{url}", "--replan-interval", str(CHUNK),
                      "--simulators", "1", "--cases-in-flight", "1", "--study", str(study)], ROOT)
        ours_model = cpu(model) - before
    finally:
        server.terminate()
        server.wait()
    same = harness_outcomes(work / "harness" / f"recording-{eval_id}.sqlite") == rescue_outcomes(study)
    rows = [("vla-eval run --no-docker", *harness, harness_model), ("rescue eval (1 simulator)", *ours, ours_model)]
    print(f"{args.suite}, {args.tasks} tasks x {args.episodes} episodes ({n}), its own horizon, one deterministic "
          f"model (PredictModelServer, chunk_size {CHUNK}, wrist image and state)")
    print(f"{'side':28} {'wall s':>8} {'episodes/s':>11} {'CPU-s/episode':>14} {'model server CPU-s/episode':>27}")
    for name, wall, cpu_s, model_s in rows:
        print(f"{name:28} {wall:8.1f} {n / wall:11.4f} {cpu_s / n:14.2f} {model_s / n:27.2f}")
    print(f"rescue / vla-eval: CPU per episode {rows[1][2] / rows[0][2]:.2f}x, wall {rows[1][1] / rows[0][1]:.2f}x; "
          f"episodes ended alike (outcome and length, each of {n}): {'yes' if same else 'NO'}")
    suites = ["libero_spatial", args.suite] if args.suite != "libero_spatial" else ["libero_spatial"]
    print(f"EGL and OSMesa frames (agentview and wrist at the reset of task 0 of {', '.join(suites)}) byte for byte "
          f"alike: {'yes' if renderers_agree(suites) else 'NO'}")


if __name__ == "__main__":
    main()
