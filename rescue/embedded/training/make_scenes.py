"""Render the openpi-libero agentview with every object's position, for the object locator.

    python -m rescue.embedded.training.make_scenes --inits 10-29 --out data/scenes/libero_object.npz

Each episode runs the privileged expert with motion noise (or the privileged
learned policy, `--sources policy`, whose hovering states look like the
failures) and, every `--every` steps, renders the agentview camera exactly as
the `openpi-libero` profile prepares it (256x256 render, rotated 180 degrees,
resized with padding to 224x224), stored box-downsampled to the locator's
input size. Labels are the simulator's positions of every object in the
scene, the task's target and the gripper: the locator learns to read them
from pixels and language, the policy never receives them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from rescue.core.catalog import parse_ids
from rescue.core.observation import OPENPI_LIBERO, compose_state, prepare_image
from rescue.embedded.locator import INPUT_SIZE, shrink
from rescue.embedded.subgoal_model import OBJECTS
from rescue.embedded.training.make_frames import in_fresh_processes, sampled_states
from rescue.env.libero import LiberoAdapter

AGENTVIEW = OPENPI_LIBERO.cameras[0]
def object_body(name: str) -> str:
    """The body of an OBJECTS name in a libero_object scene: "alphabet soup" -> "alphabet_soup_1"."""
    return name.replace(" ", "_") + "_1"


def scene_positions(obs: dict) -> np.ndarray:
    """(len(OBJECTS), 3) positions of the scene's objects from the privileged observation; NaN if absent."""
    out = np.full((len(OBJECTS), 3), np.nan, np.float32)
    for i, name in enumerate(OBJECTS):
        key = f"object/{object_body(name)}"
        if key in obs:
            out[i] = np.asarray(obs[key], np.float32)
    return out


def agentview(adapter: LiberoAdapter) -> np.ndarray:
    """The agentview as openpi-libero sends it, shrunk to the locator's input."""
    sim = adapter._env.sim
    sim._render_context_offscreen.gl_ctx.make_current()
    raw = sim.render(camera_name=AGENTVIEW.camera, width=AGENTVIEW.size, height=AGENTVIEW.size)
    return shrink(prepare_image(AGENTVIEW, raw))


def collect(suite: str, tasks: list[int], inits: list[int], every: int, sources: list[str], seed: int) -> dict:
    """Frames and labels of every rendered state."""
    adapter = LiberoAdapter(cameras=(AGENTVIEW.camera,))
    keys = ("image", "state", "objects", "target", "task", "init", "step", "source", "object")
    out: dict[str, list] = {k: [] for k in keys}
    for at in sampled_states(adapter, suite, tasks, inits, sources, None, np.random.default_rng(seed), every):
        out["image"].append(agentview(adapter))
        out["state"].append(compose_state(OPENPI_LIBERO.state.parts, at.obs).astype(np.float32))
        out["objects"].append(scene_positions(at.obs))
        out["target"].append(np.asarray(at.obs["task/target_pos"], np.float32))
        for k, v in zip(("task", "init", "step", "source", "object"), (at.task, at.init, at.step, at.source, at.obj)):
            out[k].append(v)
    adapter.close()
    return {
        "image": np.asarray(out["image"], np.uint8),
        "state": np.asarray(out["state"], np.float32),
        "objects": np.asarray(out["objects"], np.float32),
        "target": np.asarray(out["target"], np.float32),
        "task": np.asarray(out["task"], np.int16),
        "init": np.asarray(out["init"], np.int16),
        "step": np.asarray(out["step"], np.int16),
        "source": np.asarray(out["source"]),
        "object": np.asarray(out["object"], np.int8),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="libero_object")
    parser.add_argument("--tasks", default="0-9")
    parser.add_argument("--inits", default="10-29", help="initial states to render (0-9 and 30-49 are held out)")
    parser.add_argument("--every", type=int, default=20, help="render one frame every this many steps")
    parser.add_argument("--sources", default="expert", help="expert, policy, or both: expert,policy")
    parser.add_argument("--workers", type=int, default=2, help="processes (one task per process at a time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("data/scenes/libero_object.npz"))
    args = parser.parse_args(argv)

    start = time.time()
    sources = args.sources.split(",")
    jobs = [(args.suite, [t], parse_ids(args.inits), args.every, sources, args.seed + t) for t in parse_ids(args.tasks)]
    data = in_fresh_processes(collect, jobs, args.workers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **data)
    print(json.dumps({"out": str(args.out), "frames": int(len(data["image"])), "seconds": round(time.time() - start, 1),
                      "input_size": INPUT_SIZE}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
