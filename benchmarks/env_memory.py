"""What one LIBERO task env holds in a simulator process, and what closing it gives back.

One process builds the env of a libero_object task as the adapter does (`LiberoAdapter`, the
openpi-libero profile's views registered), steps and renders it, then closes it the way the memory
budget does (`close_env`: the GL context freed, the env's objects collected, free heap returned to the
system). Printed at each stage: the process's resident memory (VmRSS) and its rise; and the parts the
model and data account for: MjModel (`mj_sizeModel`), of which textures (`tex_rgb`) and meshes
(vertices, normals, faces), and MjData's arena (`nbuffer`). The rest of a build's rise is robosuite's
and LIBERO's Python objects, the compiler's scratch and the GL context with its buffers.
Then a second task's env is built beside and after the first's, to show the budget's arithmetic.

With --budget GB, a fresh adapter under that memory budget resets one episode of each of --tasks
libero_object tasks in turn, and prints after each: the envs it holds, its resident memory, what the
budget priced a first build and a later build at (MemoryBudget, each build's own peak), and the
builds and closes so far.

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/env_memory.py [--budget GB [--tasks N]]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

os.environ.setdefault("MUJOCO_GL", "egl")


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def gb(n: float) -> str:
    return f"{n / 1e9:6.3f} GB"


def main() -> None:
    import mujoco

    from rescue.env.libero import LiberoAdapter, close_env

    adapter = LiberoAdapter(max_rss_gb=None)
    start = rss()
    rows = [("process before any env (imports)", start, None)]
    case = {"suite": "libero_object", "task_id": 0, "init_state_index": 0, "env_seed": 0, "horizon": 40}
    adapter.reset(case, "openpi-libero")
    built = rss()
    rows.append(("task 0 env built and reset (views registered)", built, built - start))
    adapter.run_chunk(np.zeros((8, 7)), 8)
    adapter.render(["agentview", "frontview", "robot0_eye_in_hand"], 256)
    used = rss()
    rows.append(("after 8 steps and three 256x256 renders", used, used - built))
    env = adapter._envs[("libero_object", 0)]
    m = env.sim.model._model
    d = env.sim.data._data
    parts = {
        "MjModel (mj_sizeModel)": mujoco.mj_sizeModel(m),
        "  of which textures (tex_rgb)": m.tex_rgb.nbytes,
        "  of which meshes (vert, normal, face)": m.mesh_vert.nbytes + m.mesh_normal.nbytes + m.mesh_face.nbytes,
        "MjData arena (nbuffer)": d.nbuffer,
    }
    case1 = {**case, "task_id": 1}
    adapter.reset(case1, "openpi-libero")
    two = rss()
    rows.append(("task 1 env built beside it", two, two - used))
    first = adapter._envs.pop(("libero_object", 0))
    del env, m, d
    close_env(first)
    del first
    closed = rss()
    rows.append(("task 0 env closed (close_env)", closed, closed - two))
    for label, value, delta in rows:
        print(f"{label:52s} RSS {gb(value)}" + ("" if delta is None else f"  change {'+' if delta >= 0 else ''}{gb(delta)}"))
    print()
    for label, n in parts.items():
        print(f"{label:52s} {gb(n)}")
    adapter.close()


def under_budget(budget_gb: float, tasks: int) -> None:
    from rescue.env.libero import LiberoAdapter

    adapter = LiberoAdapter(max_rss_gb=budget_gb)
    memory = adapter._memory
    print(f"budget {budget_gb:g} GB, {tasks} libero_object tasks in turn on one simulator")
    for task in range(tasks):
        held_before = len(adapter._envs)
        adapter.reset({"suite": "libero_object", "task_id": task, "init_state_index": 0, "env_seed": 0, "horizon": 40})
        closed = held_before + 1 - len(adapter._envs)
        prices = {kind: costs.get("libero_object") for kind, costs in (("first", memory.first_cost),
                                                                        ("later", memory.cost))}
        print(f"task {task}: holds {len(adapter._envs)} envs, RSS {gb(rss())}, closed {closed} to build it; price "
              + ", ".join(f"{kind} {'-' if v is None else gb(v).strip()}" for kind, v in prices.items()))
    adapter.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, help="walk tasks under this budget (GB) instead")
    parser.add_argument("--tasks", type=int, default=10)
    args = parser.parse_args()
    if args.budget is None:
        main()
    else:
        under_budget(args.budget, args.tasks)
