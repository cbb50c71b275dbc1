"""Train the object locator on rendered openpi-libero agentviews.

    python -m rescue.embedded.training.train_locator --out models/locator_libero_object.pt

Every training example is one frame, one object of its scene and an
instruction naming it, in one of three forms: the task instruction naming the
object; a task instruction naming any object of the scene followed by an
injected subgoal (DESIGN §2) naming this object in one of the phase
sub-instructions (the newest instruction names what to act on); the task
instruction naming the object followed by an injected subgoal that names no
object. Half the examples name the task's object (the one that is moved and
held). The label is the object's position and the task's target, from the
simulator. Frames of the `--val-inits` initial states are held out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from rescue.embedded.locator import INPUT_SIZE, build_network
from rescue.embedded.phases import PHASES, PickPlace, sub_instruction
from rescue.embedded.subgoal_model import OBJECTS
from wrappers.injection import inject

# Share of examples that name the task's object (the one that is moved, held and hidden by the fingers).
TASK_OBJECT_SHARE = 0.5
# Subgoals naming no object, for training; the study's fixed sham text is not among them.
CONTENT_FREE = ("keep going", "try again", "finish the task", "be careful now", "go on with what you were doing")


def instruction(obj: str) -> str:
    """The libero_object instruction naming one object."""
    return f"pick up the {obj} and place it in the basket"


def text_table() -> tuple[list[str], dict]:
    """Every training text, and for each (form, original object, subgoal) its index."""
    texts: list[str] = []
    index: dict = {}

    def add(key, text: str) -> None:
        index[key] = len(texts)
        texts.append(text)

    for o in OBJECTS:
        add(("plain", o, None), instruction(o))
        for p in PHASES:
            for s in OBJECTS:
                add(("subgoal", o, (p, s)), inject(instruction(o), sub_instruction(p, PickPlace(s, "basket", "in"))))
        for c in CONTENT_FREE:
            add(("free", o, c), inject(instruction(o), c))
    return texts, index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", default=[Path("data/scenes/expert.npz"), Path("data/scenes/expert8.npz")])
    parser.add_argument("--out", type=Path, default=Path("models/locator_libero_object.pt"))
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--val-inits", default="28,29")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from rescue.embedded.learned import text_features

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    parts = [dict(np.load(p)) for p in args.data]
    data = {k: np.concatenate([p[k] for p in parts]) for k in ("image", "objects", "target", "init", "object")}
    assert data["image"].shape[1] == INPUT_SIZE
    val_inits = {int(v) for v in args.val_inits.split(",")}
    is_val = np.isin(data["init"], list(val_inits))
    labels = np.concatenate([data["objects"].reshape(-1, 3)[~np.isnan(data["objects"].reshape(-1, 3)[:, 0])], data["target"]])
    mean, std = labels.mean(0), labels.std(0)

    start = time.time()
    texts, index = text_table()
    feats = torch.from_numpy(np.stack([text_features(t) for t in texts]).astype(np.float32))
    embed_s = time.time() - start

    images = torch.from_numpy(data["image"])
    present = ~np.isnan(data["objects"][:, :, 0])  # (N, objects)

    def sample(frames: np.ndarray) -> tuple:
        text_idx, targets = [], []
        for f in frames:
            choices = np.flatnonzero(present[f])
            o = OBJECTS[int(data["object"][f])] if rng.random() < TASK_OBJECT_SHARE else OBJECTS[int(rng.choice(choices))]
            form = rng.random()
            if form < 0.4:
                key = ("plain", o, None)
            elif form < 0.8:
                other = OBJECTS[int(rng.choice(choices))] if rng.random() < 0.5 else OBJECTS[int(data["object"][f])]
                key = ("subgoal", other, (PHASES[int(rng.integers(len(PHASES)))], o))
            else:
                key = ("free", o, CONTENT_FREE[int(rng.integers(len(CONTENT_FREE)))])
            text_idx.append(index[key])
            pos = data["objects"][f, OBJECTS.index(o)]
            targets.append(np.concatenate([(pos - mean) / std, (data["target"][f] - mean) / std]))
        return images[frames], feats[text_idx], torch.from_numpy(np.asarray(targets, np.float32))

    net = build_network(feats.shape[1])
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    train_frames = np.flatnonzero(~is_val)
    for step in range(args.steps):
        img, txt, tgt = sample(rng.choice(train_frames, args.batch))
        loss = torch.nn.functional.smooth_l1_loss(net(img, txt), tgt, beta=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "s": round(time.time() - start, 1)}), flush=True)
    train_s = time.time() - start - embed_s

    # Held-out error: every object of every held-out frame, named by the plain instruction;
    # the task's object (moved, held, half hidden by the fingers) apart from the others (at rest).
    net.eval()
    errs: dict[str, list[float]] = {"task_object_cm": [], "other_objects_cm": [], "target_cm": []}
    with torch.no_grad():
        for f in np.flatnonzero(is_val):
            for i in np.flatnonzero(present[f]):
                out = net(images[f : f + 1], feats[index[("plain", OBJECTS[i], None)]][None])[0].numpy()
                kind = "task_object_cm" if i == data["object"][f] else "other_objects_cm"
                errs[kind].append(100 * np.linalg.norm(out[:3] * std + mean - data["objects"][f, i]))
                errs["target_cm"].append(100 * np.linalg.norm(out[3:] * std + mean - data["target"][f]))
    summary = {k: {"median": round(float(np.median(v)), 2), "p90": round(float(np.percentile(v, 90)), 2), "n": len(v)}
               for k, v in errs.items()}
    meta = {
        "input_size": INPUT_SIZE, "text_dim": int(feats.shape[1]), "label_mean": mean.tolist(), "label_std": std.tolist(),
        "steps": args.steps, "batch": args.batch, "lr": args.lr, "seed": args.seed, "val_inits": sorted(val_inits),
        "train_frames": int(len(train_frames)), "val_frames": int(is_val.sum()), "held_out_error": summary,
        "train_seconds": round(train_s, 1), "threads": args.threads,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": net.state_dict(), "meta": meta}, args.out)
    print(json.dumps({"out": str(args.out), **meta}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
