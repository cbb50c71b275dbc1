"""Generate expert demonstrations on LIBERO with physics only (no rendering).

    python -m rescue.embedded.training.make_demos --suite libero_object --out data/demos/libero_object.npz

For every task and initial state it runs the privileged expert once without
noise (these runs give the expert's success rate) and, on a stride of the
training initial states, once more with Gaussian noise added to the executed
motion while the recorded label stays the expert's clean action, so the data
shows how to recover from small errors. The npz layout is described in
rescue/embedded/training/README.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from rescue.core.catalog import parse_ids
from rescue.embedded.expert import Expert
from rescue.env.libero import SUITE_HORIZON, LiberoAdapter

OBS_KEYS = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "task/object_pos", "task/target_pos")
NOISE = 0.3  # std of the executed-motion perturbation, in action units
HELD_OUT = 10  # initial states 0..9 of every task are never trained on


def rollout(adapter: LiberoAdapter, case: dict, noise: float, rng: np.random.Generator) -> dict:
    """One expert episode: per-step observations, clean actions, phases, and the outcome."""
    obs = adapter.reset(case).obs
    expert = Expert()
    rows: dict[str, list] = {k: [] for k in (*OBS_KEYS, "action", "phase")}
    success = False
    for _ in range(SUITE_HORIZON[case["suite"]]):
        action = expert.act(obs)
        for k in OBS_KEYS:
            rows[k].append(np.asarray(obs[k], dtype=np.float32))
        rows["action"].append(action.astype(np.float32))
        rows["phase"].append(expert.phase_index)
        executed = action.copy()
        if noise > 0:
            executed[:3] = np.clip(executed[:3] + rng.normal(0.0, noise, 3), -1, 1)
        result = adapter.run_chunk(executed[None], 1)
        obs = result.obs
        if result.success:
            success = True
            break
    return {"rows": rows, "success": success}


def generate(suite: str, tasks: list[int], inits: int, noisy_stride: int, seed: int) -> dict[str, np.ndarray]:
    """All episodes of a suite as flat arrays plus per-episode tables."""
    adapter = LiberoAdapter()
    rng = np.random.default_rng(seed)
    flat: dict[str, list] = {k: [] for k in (*OBS_KEYS, "action", "phase", "episode", "step")}
    episodes: dict[str, list] = {k: [] for k in ("task_id", "init_state_index", "noise", "success", "length")}
    instructions = []
    for task_id in tasks:
        instructions.append(adapter.task_instruction({"suite": suite, "task_id": task_id}))
        for idx in range(inits):
            runs = [0.0] + ([NOISE] if idx >= HELD_OUT and (idx - HELD_OUT) % noisy_stride == 0 else [])
            for noise in runs:
                case = {"suite": suite, "task_id": task_id, "init_state_index": idx, "env_seed": idx}
                out = rollout(adapter, case, noise, rng)
                n = len(out["rows"]["action"])
                ep = len(episodes["task_id"])
                for k, v in out["rows"].items():
                    flat[k].extend(v)
                flat["episode"].extend([ep] * n)
                flat["step"].extend(range(n))
                for k, v in zip(episodes, (task_id, idx, noise, out["success"], n)):
                    episodes[k].append(v)
            print(json.dumps({"task": task_id, "init": idx, "success": out["success"], "steps": n}), flush=True)
    adapter.close()
    arrays = {k.replace("/", "_"): np.asarray(v) for k, v in flat.items()}
    arrays["phase"] = arrays["phase"].astype(np.int8)
    arrays.update({f"episode_{k}": np.asarray(v) for k, v in episodes.items()})
    arrays["instructions"] = np.asarray(instructions)
    arrays["tasks"] = np.asarray(tasks)
    arrays["suite"] = np.asarray(suite)
    return arrays


def expert_success(data: dict[str, np.ndarray]) -> dict[int, float]:
    """Success rate of the noise-free expert per task over every initial state run."""
    clean = data["episode_noise"] == 0
    return {
        int(t): float(data["episode_success"][clean & (data["episode_task_id"] == t)].mean()) for t in data["tasks"]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="libero_object")
    parser.add_argument("--tasks", default="0-9", help="a range like 0-9 or a list like 0,3,5")
    parser.add_argument("--inits", type=int, default=50, help="initial states 0..N-1 of every task")
    parser.add_argument("--noisy-stride", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    tasks = parse_ids(args.tasks)
    start = time.time()
    data = generate(args.suite, tasks, args.inits, args.noisy_stride, args.seed)
    out = args.out or Path("data/demos") / f"{args.suite}.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **data)
    summary = {"out": str(out), "samples": int(len(data["action"])), "seconds": round(time.time() - start, 1),
               "expert_success": expert_success(data)}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
