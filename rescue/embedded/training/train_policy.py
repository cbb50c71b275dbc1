"""Train the learned chunk policy on expert demonstrations (CPU, one thread).

    python -m rescue.embedded.training.train_policy --data data/demos/libero_object.npz --out models/policy_libero_object.pt

Instruction augmentation: every sample is seen with the original instruction
alone, or with the exact injection (wrappers.injection.inject) carrying the
sub-instruction of the expert's current phase, or of an earlier phase (a
subgoal given at the query point stays in the prompt after it is done).
Initial states below `HELD_OUT` are never trained on, nor are the expert's
failed episodes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from rescue.embedded.learned import EMBED_DIM, build_network, embed_text, state_features, text_features
from rescue.embedded.phases import PHASES, parse_pick_place, sub_instruction
from rescue.embedded.training.make_demos import HELD_OUT
from wrappers.injection import inject

P_ORIGINAL, P_CURRENT = 0.4, 0.4  # the rest: an earlier phase's sub-instruction


def load_samples(path: Path, horizon: int) -> dict[str, np.ndarray]:
    """States, target chunks, phases and task indices of every training step."""
    d = dict(np.load(path))
    # Only successful expert episodes are imitated; held-out initial states never are.
    keep_ep = (d["episode_init_state_index"] >= HELD_OUT) & d["episode_success"].astype(bool)
    keep = keep_ep[d["episode"]]
    obs = {
        "robot0_eef_pos": d["robot0_eef_pos"],
        "robot0_gripper_qpos": d["robot0_gripper_qpos"],
        "task/object_pos": d["task_object_pos"],
        "task/target_pos": d["task_target_pos"],
    }
    states = np.stack([state_features({k: v[i] for k, v in obs.items()}) for i in range(len(d["action"]))])
    actions = np.concatenate([d["action"][:, :3], d["action"][:, 6:7]], axis=1)
    # Chunk targets: the next C actions of the same episode, the last one repeated past its end.
    ends = np.zeros(len(actions), dtype=np.int64)
    for ep in np.unique(d["episode"]):
        idx = np.flatnonzero(d["episode"] == ep)
        ends[idx] = idx[-1]
    offsets = np.arange(len(actions))[:, None] + np.arange(horizon)[None, :]
    chunks = actions[np.minimum(offsets, ends[:, None])]
    task_pos = {int(t): i for i, t in enumerate(d["tasks"])}
    task = np.array([task_pos[int(t)] for t in d["episode_task_id"]])[d["episode"]]
    return {
        "state": states[keep],
        "chunk": chunks[keep].astype(np.float32),
        "phase": d["phase"][keep].astype(np.int64),
        "task": task[keep],
        "instructions": d["instructions"],
        "episodes": int(keep_ep.sum()),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def text_tables(instructions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings of each task's original instruction and of each (task, phase) sub-instruction."""
    originals = torch.from_numpy(np.stack([embed_text(str(s)) for s in instructions]))
    subs = np.zeros((len(instructions), len(PHASES), EMBED_DIM), np.float32)
    for t, s in enumerate(instructions):
        goal = parse_pick_place(str(s))
        for p, phase in enumerate(PHASES):
            text = inject(str(s), sub_instruction(phase, goal))
            # Build through the policy's own parser, so training sees exactly what inference sees.
            subs[t, p] = text_features(text)[EMBED_DIM : 2 * EMBED_DIM]
    return originals, torch.from_numpy(subs)


def augmented_text(task, phase, originals, subs, gen: torch.Generator) -> torch.Tensor:
    """A batch of text features under the instruction augmentation."""
    n = len(task)
    u = torch.rand(n, generator=gen)
    earlier = (torch.rand(n, generator=gen) * phase.float()).long()  # uniform over phases before the current
    which = torch.where(u < P_ORIGINAL + P_CURRENT, phase, earlier)
    has = (u >= P_ORIGINAL).float()[:, None]
    sub = subs[task, which] * has
    return torch.cat([originals[task], sub, has], dim=1)


def train(data: Path, out: Path, steps: int, horizon: int, hidden: int, batch: int, seed: int, noise: float) -> dict:
    """Fit the network; save the checkpoint with its card facts; return them."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    s = load_samples(data, horizon)
    mean, std = s["state"].mean(0), s["state"].std(0) + 1e-3
    state = torch.from_numpy((s["state"] - mean) / std)
    chunk = torch.from_numpy(s["chunk"])
    phase = torch.from_numpy(s["phase"])
    task = torch.from_numpy(s["task"])
    originals, subs = text_tables(s["instructions"])
    net = build_network(horizon, hidden)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(seed)
    start, log = time.time(), []
    running = None
    for step in range(steps):
        idx = torch.randint(0, len(state), (batch,), generator=gen)
        text = augmented_text(task[idx], phase[idx], originals, subs, gen)
        pred, logits = net(state[idx], text)
        loss_a = torch.nn.functional.mse_loss(pred, chunk[idx])
        loss_p = torch.nn.functional.cross_entropy(logits, phase[idx])
        loss = loss_a + 0.1 * loss_p
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        running = loss_a.item() if running is None else 0.98 * running + 0.02 * loss_a.item()
        if step % 500 == 0 or step == steps - 1:
            log.append({"step": step, "action_mse": round(running, 5), "phase_ce": round(loss_p.item(), 4)})
            print(json.dumps(log[-1]), flush=True)
    meta = {
        "horizon": horizon,
        "hidden": hidden,
        "state_mean": mean.tolist(),
        "state_std": std.tolist(),
        "action_noise": noise,
        "train": {
            "data": data.name,
            "data_sha256": s["sha256"],
            "episodes": s["episodes"],
            "samples": int(len(state)),
            "steps": steps,
            "batch": batch,
            "seed": seed,
            "final_action_mse": log[-1]["action_mse"],
            "final_phase_ce": log[-1]["phase_ce"],
            "seconds": round(time.time() - start, 1),
            "instructions": [str(x) for x in s["instructions"]],
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": net.state_dict(), "meta": meta}, out)
    return meta["train"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/demos/libero_object.npz"))
    parser.add_argument("--out", type=Path, default=Path("models/policy_libero_object.pt"))
    parser.add_argument("--steps", type=int, default=12000)
    parser.add_argument("--horizon", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.15, help="sampling noise std at inference")
    args = parser.parse_args(argv)
    facts = train(args.data, args.out, args.steps, args.horizon, args.hidden, args.batch, args.seed, args.noise)
    print(json.dumps(facts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
