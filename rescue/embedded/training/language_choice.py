"""Which object does the vision-language policy go to? Measured in the simulator, per instruction.

    python -m rescue.embedded.training.language_choice --init 0 --queries 6

For every libero_object task, from one held-out initial state and one seed,
the policy runs `--queries` chunks under the task's instruction (object A)
and under the same instruction naming another object of the scene (object B:
the first object of the scene, in task order, that is not A). After each run
the gripper's horizontal distance to A and to B is read from the simulator.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from rescue.core.observation import OPENPI_LIBERO
from rescue.embedded.subgoal_model import OBJECTS
from rescue.embedded.training.make_scenes import object_body
from rescue.embedded.vision_language import VisionLanguagePolicy
from rescue.env.libero import LiberoAdapter


def body(adapter: LiberoAdapter, name: str) -> np.ndarray:
    return adapter._body_pos(object_body(name))


def run(adapter, policy, case: dict, prompt: str, queries: int) -> np.ndarray:
    obs = adapter.reset(case, OPENPI_LIBERO).obs
    policy.reset_rng(case["env_seed"])
    for _ in range(queries):
        chunk = policy.infer({**obs, "prompt": prompt})["actions"]
        obs = adapter.run_chunk(chunk, len(chunk)).obs
    env = adapter._env.env
    return np.array(env.sim.data.site_xpos[env.robots[0].eef_site_id])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", type=int, default=0)
    parser.add_argument("--queries", type=int, default=6)
    args = parser.parse_args(argv)
    adapter = LiberoAdapter(cameras=("agentview", "robot0_eye_in_hand"))
    policy = VisionLanguagePolicy()
    rows = []
    for task in range(len(OBJECTS)):
        case = {"suite": "libero_object", "task_id": task, "init_state_index": args.init, "env_seed": args.init}
        adapter.reset(case, OPENPI_LIBERO)
        present = [o for o in OBJECTS if object_body(o) in adapter._env.env.obj_body_id]
        a = OBJECTS[task]
        b = next(o for o in present if o != a)
        pos = {o: body(adapter, o) for o in (a, b)}
        row = {"task": task, "A": a, "B": b, "A_to_B_cm": round(100 * float(np.linalg.norm(pos[a][:2] - pos[b][:2])), 1)}
        for named in (a, b):
            eef = run(adapter, policy, case, f"pick up the {named} and place it in the basket", args.queries)
            key = "named_A" if named == a else "named_B"
            row[key] = {
                "to_A_cm": round(100 * float(np.linalg.norm(eef[:2] - pos[a][:2])), 1),
                "to_B_cm": round(100 * float(np.linalg.norm(eef[:2] - pos[b][:2])), 1),
            }
        row["goes_to_named"] = row["named_A"]["to_A_cm"] < row["named_A"]["to_B_cm"] and (
            row["named_B"]["to_B_cm"] < row["named_B"]["to_A_cm"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"tasks": len(rows), "goes_to_named": sum(r["goes_to_named"] for r in rows)}), flush=True)
    adapter.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
