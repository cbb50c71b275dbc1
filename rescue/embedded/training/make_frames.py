"""Render labelled frames for the image-only subgoal model.

    python -m rescue.embedded.training.make_frames --out data/frames/libero_object_expert.npz
    python -m rescue.embedded.training.make_frames --sources policy --inits 10-13 --out data/frames/libero_object_policy.npz

Frames come from noisy expert episodes and from the learned policy's own
episodes (whose states look like the failures the subgoal model will see). Every `--every` steps the three views
are rendered at the size the study sends to the VLM and stored downsampled;
each frame is labelled with `situation_phase` of the state and the index of
the task's object in `OBJECTS`. Only the frames kept are rendered.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rescue.core.catalog import parse_ids
from rescue.embedded.expert import Expert, situation_phase
from rescue.embedded.phases import PHASES, parse_pick_place
from rescue.embedded.subgoal_model import INPUT_SIZE, OBJECTS, VIEWS, downsample
from rescue.embedded.training.make_demos import HELD_OUT, NOISE
from rescue.env.libero import SUITE_HORIZON, LiberoAdapter

STATE_KEYS = ("robot0_eef_pos", "robot0_gripper_qpos", "task/object_pos", "task/target_pos")
RENDER_SIZE = 256  # what the study sends; downsampled exactly as the advisor does


def _frame(adapter: LiberoAdapter) -> np.ndarray:
    views = adapter.render(list(VIEWS), RENDER_SIZE)
    return np.stack([downsample(views[v]) for v in VIEWS])


@dataclass(frozen=True)
class Sample:
    """One sampled state of one episode: where it comes from and the privileged observation."""

    task: int
    init: int
    source: str
    obj: int  # index of the task's object in OBJECTS
    step: int
    obs: dict


def sampled_states(
    adapter: LiberoAdapter, suite: str, tasks: list[int], inits: list[int], sources: list[str],
    checkpoint: Path | None, rng: np.random.Generator, every: int,
) -> Iterator[Sample]:
    """Run an episode per (task, initial state, source): the noisy expert, or the learned policy
    (source "policy"); yield a Sample every `every` steps from a random offset, before acting,
    so the caller renders the state the sample describes. Prints a progress line per initial state."""
    policy = None
    if "policy" in sources:
        from rescue.embedded.learned import LearnedPolicy

        policy = LearnedPolicy(checkpoint) if checkpoint is not None else LearnedPolicy()
    for task in tasks:
        for idx in inits:
            for source in sources:
                reset = adapter.reset({"suite": suite, "task_id": task, "init_state_index": idx, "env_seed": idx})
                obj = OBJECTS.index(parse_pick_place(reset.instruction).obj)
                if policy is not None:
                    policy.reset_rng(idx)
                obs, expert, chunk = reset.obs, Expert(), []
                offset = int(rng.integers(every))  # so frames are not always at the same steps
                for step in range(SUITE_HORIZON[suite]):
                    if step % every == offset:
                        yield Sample(task, idx, source, obj, step, obs)
                    if source == "expert":
                        action = expert.act(obs)
                        action[:3] = np.clip(action[:3] + rng.normal(0.0, NOISE, 3), -1, 1)
                    else:
                        if not chunk:
                            chunk = list(policy.infer({**obs, "prompt": reset.instruction})["actions"])
                        action = chunk.pop(0)
                    result = adapter.run_chunk(np.asarray(action)[None], 1)
                    obs = result.obs
                    if result.success:
                        break
            print(json.dumps({"task": task, "init": idx}), flush=True)


def collect(
    suite: str, tasks: list[int], inits: list[int], every: int, sources: list[str], checkpoint: Path | None, seed: int
) -> dict:
    """Frames, phase labels, object labels and provenance of every rendered state."""
    adapter = LiberoAdapter(cameras=VIEWS)
    keys = ("frames", "phase", "object", "task", "init", "source", "step", *STATE_KEYS)
    out: dict[str, list] = {k: [] for k in keys}
    for at in sampled_states(adapter, suite, tasks, inits, sources, checkpoint, np.random.default_rng(seed), every):
        out["frames"].append(_frame(adapter))
        for k, v in zip(("phase", "object", "task", "init", "source", "step"),
                        (PHASES.index(situation_phase(at.obs)), at.obj, at.task, at.init, at.source, at.step)):
            out[k].append(v)
        for k in STATE_KEYS:  # kept so the labels can be recomputed without rendering
            out[k].append(np.asarray(at.obs[k], dtype=np.float32))
    adapter.close()
    return {
        "frames": np.asarray(out["frames"], dtype=np.uint8),
        "phase": np.asarray(out["phase"], dtype=np.int8),
        "object": np.asarray(out["object"], dtype=np.int8),
        "task": np.asarray(out["task"], dtype=np.int16),
        "init": np.asarray(out["init"], dtype=np.int16),
        "source": np.asarray(out["source"]),
        "step": np.asarray(out["step"], dtype=np.int16),
        **{k.replace("/", "_"): np.asarray(out[k]) for k in STATE_KEYS},
        "views": np.asarray(VIEWS),
        "suite": np.asarray(suite),
    }


def in_fresh_processes(fn: Callable[..., dict], jobs: list[tuple], workers: int = 1) -> dict:
    """`fn(*job)` for every job, each in a fresh process (`workers` at a time); the arrays concatenated.

    Once an env is closed in a process (the adapter evicts old envs), later
    offscreen renders of the other envs come back stale; a process per job
    (one task each) never closes an env before its last render.
    """
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=1) as pool:
        parts = pool.starmap(fn, jobs, chunksize=1)
    return {k: (np.concatenate([p[k] for p in parts]) if parts[0][k].ndim else parts[0][k]) for k in parts[0]}


def collect_isolated(suite: str, tasks: list[int], *rest) -> dict:
    """`collect` with every task in a fresh process, one at a time."""
    return in_fresh_processes(collect, [(suite, [task], *rest) for task in tasks])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="libero_object")
    parser.add_argument("--tasks", default="0-9")
    parser.add_argument("--inits", default="10-17", help="training initial states (0-9 are held out)")
    parser.add_argument("--every", type=int, default=12, help="render one frame every this many steps")
    parser.add_argument("--sources", default="expert", help="expert, policy, or both: expert,policy")
    parser.add_argument("--policy", type=Path, default=Path("models/policy_libero_object.pt"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("data/frames/libero_object.npz"))
    args = parser.parse_args(argv)

    inits = parse_ids(args.inits)
    if any(i < HELD_OUT for i in inits):
        print(f"note: initial states below {HELD_OUT} are the policy's held-out states", flush=True)
    start = time.time()
    data = collect_isolated(args.suite, parse_ids(args.tasks), inits, args.every, args.sources.split(","), args.policy, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **data)
    print(json.dumps({"out": str(args.out), "frames": int(len(data["frames"])), "seconds": round(time.time() - start, 1),
                      "input_size": INPUT_SIZE}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
