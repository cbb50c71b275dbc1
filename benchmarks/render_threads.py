"""The CPU renderer's thread count (`LP_NUM_THREADS`) against CPU per frame, PROCESSES simulators on the cores.

PROCESSES child processes at once (as simulators; default 2), each building `libero_object` task 0 and rendering
FRAMES frames of each of two cameras at 256x256, under `LP_NUM_THREADS=0` (llvmpipe renders in the calling
thread; tried as a simulator's setting and taken back: no CPU saved), `=1` (one worker thread) and `=2` (llvmpipe's
default on two cores), alternating ROUNDS times. Printed per setting: the processes' CPU seconds (the
children's whole processes, builds included; median over rounds), the CPU and wall time per frame inside the
renders, and whether every setting rendered byte-identical frames; then the ratios to `2` round by round.

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/render_threads.py [FRAMES] [ROUNDS] [PROCESSES]
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SETTINGS = ("0", "1", "2")


def child(frames: int) -> None:
    """Build the env, render, print CPU per frame and the frames' digest as JSON."""
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv

    suite = benchmark.get_benchmark_dict()["libero_object"]()
    task = suite.get_task(0)
    env = OffScreenRenderEnv(bddl_file_name=os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file),
                             camera_heights=256, camera_widths=256)
    env.seed(0)
    env.reset()
    env.set_init_state(suite.get_task_init_states(0)[0])
    sim, digest = env.env.sim, hashlib.sha256()
    for _ in range(3):
        sim.render(camera_name="agentview", width=256, height=256)
    t0, w0 = time.process_time(), time.perf_counter()
    for _ in range(frames):
        for cam in ("agentview", "robot0_eye_in_hand"):
            digest.update(sim.render(camera_name=cam, width=256, height=256).tobytes())
    per_frame, wall = (time.process_time() - t0) / (2 * frames), (time.perf_counter() - w0) / (2 * frames)
    print(json.dumps({"cpu_per_frame_s": per_frame, "wall_per_frame_s": wall, "digest": digest.hexdigest()}), flush=True)
    os._exit(0)  # robosuite's EGL contexts raise from __del__ at interpreter exit


def pair(threads: str, frames: int, processes: int = 2) -> tuple[float, list[dict]]:
    """`processes` children at once under LP_NUM_THREADS=threads: (their CPU seconds, their reports)."""
    env = {**os.environ, "LP_NUM_THREADS": threads, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(frames)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(processes)]
    outs = [p.communicate()[0] for p in procs]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return cpu, [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main(frames: int = 120, rounds: int = 5, processes: int = 2) -> None:
    cpu = {s: [] for s in SETTINGS}
    per_frame = {s: [] for s in SETTINGS}
    wall = {s: [] for s in SETTINGS}
    digests = set()
    for _ in range(rounds):
        for s in SETTINGS:
            seconds, reports = pair(s, frames, processes)
            cpu[s].append(seconds)
            per_frame[s] += [r["cpu_per_frame_s"] for r in reports]
            wall[s] += [r["wall_per_frame_s"] for r in reports]
            digests |= {r["digest"] for r in reports}
    print(f"{processes} process(es) at once, each: build libero_object task 0, {frames} frames x 2 cameras at 256x256; "
          f"{rounds} rounds, medians")
    for s in SETTINGS:
        print(f"LP_NUM_THREADS={s}: the processes' CPU {statistics.median(cpu[s]):.2f} s, "
              f"{statistics.median(per_frame[s]) * 1e3:.1f} ms CPU and {statistics.median(wall[s]) * 1e3:.1f} ms wall per frame")
    for s in SETTINGS[:-1]:
        ratios = [a / b for a, b in zip(cpu[s], cpu["2"])]
        print(f"CPU ratio {s} / 2, round by round: median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    print(f"frames byte-identical across settings and processes: {'yes' if len(digests) == 1 else 'NO'}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]))
    else:
        main(*(int(a) for a in sys.argv[1:4]))
