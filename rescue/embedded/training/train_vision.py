"""Train the image-only subgoal model on rendered, expert-labelled frames (CPU, one thread).

    python -m rescue.embedded.training.train_vision --data data/frames/libero_object_expert.npz data/frames/libero_object_policy.npz

Frames of some initial states are kept aside (`--val-inits`) and the
phase and object accuracy on them go into the checkpoint's card facts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from rescue.embedded.phases import PHASES
from rescue.embedded.subgoal_model import OBJECTS, build_network, to_tensor


def _shift(x: torch.Tensor, gen: torch.Generator, pad: int = 3) -> torch.Tensor:
    """Random translation by up to `pad` pixels (one per batch) and brightness jitter per sample."""
    b = x.shape[0]
    padded = torch.nn.functional.pad(x.flatten(1, 2), (pad, pad, pad, pad), mode="replicate").view(
        b, x.shape[1], x.shape[2], x.shape[3] + 2 * pad, x.shape[4] + 2 * pad
    )
    dx, dy = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,), generator=gen))
    out = padded[:, :, :, dy : dy + x.shape[3], dx : dx + x.shape[4]]
    return out + (torch.rand(b, 1, 1, 1, 1, generator=gen) - 0.5) * 0.1


def accuracy(net, frames: np.ndarray, phase: np.ndarray, obj: np.ndarray) -> dict:
    """Phase and object accuracy, and phase accuracy per true phase."""
    net.eval()
    with torch.no_grad():
        logits = [net(to_tensor(frames[i : i + 256])) for i in range(0, len(frames), 256)]
    p = torch.cat([lp for lp, _ in logits]).argmax(-1).numpy()
    o = torch.cat([lo for _, lo in logits]).argmax(-1).numpy()
    net.train()
    per_phase = {PHASES[k]: round(float((p[phase == k] == k).mean()), 3) for k in np.unique(phase)}
    return {"phase": round(float((p == phase).mean()), 3), "object": round(float((o == obj).mean()), 3),
            "phase_by_class": per_phase, "n": int(len(frames))}


def load_frames(paths: list[Path]) -> dict[str, np.ndarray]:
    """Frames and labels of several files, concatenated."""
    parts = [dict(np.load(p)) for p in paths]
    keys = ("frames", "phase", "object", "task", "init", "source", "step")
    return {k: np.concatenate([p[k] for p in parts]) for k in keys}


def train(data: list[Path], out: Path, steps: int, batch: int, seed: int, val_inits: set[int]) -> dict:
    """Fit the network, report held-out accuracy, save the checkpoint."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    d = load_frames(data)
    val = np.isin(d["init"], sorted(val_inits))
    tr = ~val
    frames = to_tensor(d["frames"][tr])
    phase = torch.from_numpy(d["phase"][tr].astype(np.int64))
    obj = torch.from_numpy(d["object"][tr].astype(np.int64))
    # Rare phases (grasp, place) get more weight so the model does not ignore them.
    counts = np.bincount(d["phase"][tr], minlength=len(PHASES)).astype(np.float64)
    weight = torch.tensor(np.where(counts > 0, (counts.sum() / np.maximum(counts, 1)) ** 0.5, 0.0), dtype=torch.float32)
    net = build_network()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    start, log = time.time(), []
    for step in range(steps):
        idx = torch.randint(0, len(frames), (batch,), generator=gen)
        lp, lo = net(_shift(frames[idx], gen))
        loss_p = torch.nn.functional.cross_entropy(lp, phase[idx], weight=weight)
        loss_o = torch.nn.functional.cross_entropy(lo, obj[idx])
        loss = loss_p + loss_o
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            log.append({"step": step, "phase_ce": round(loss_p.item(), 4), "object_ce": round(loss_o.item(), 4)})
            print(json.dumps(log[-1]), flush=True)
    facts = {
        "data": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in data},
        "frames_by_source": {str(k): int(v) for k, v in zip(*np.unique(d["source"], return_counts=True))},
        "frames_train": int(tr.sum()),
        "frames_val": int(val.sum()),
        "val_inits": sorted(val_inits),
        "steps": steps,
        "batch": batch,
        "seed": seed,
        "final": log[-1],
        "seconds": round(time.time() - start, 1),
        "train_accuracy": accuracy(net, d["frames"][tr], d["phase"][tr], d["object"][tr]),
        "val_accuracy": accuracy(net, d["frames"][val], d["phase"][val], d["object"][val]) if val.any() else None,
        "phases": list(PHASES),
        "objects": list(OBJECTS),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": net.state_dict(), "meta": facts}, out)
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, nargs="+",
        default=[Path("data/frames/libero_object_expert.npz"), Path("data/frames/libero_object_policy.npz")],
    )
    parser.add_argument("--out", type=Path, default=Path("models/subgoal_vision.pt"))
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-inits", default="16,17", help="initial states whose frames are held out")
    args = parser.parse_args(argv)
    facts = train(args.data, args.out, args.steps, args.batch, args.seed, {int(x) for x in args.val_inits.split(",")})
    print(json.dumps(facts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
