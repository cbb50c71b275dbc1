"""A robustness table like LIBERO-PRO's, and a rescue study on it, through the CLI as a user runs them.

1. `rescue eval` of the embedded vision-language policy on `libero_object` and on each of its LIBERO-PRO
   perturbation suites that build here (language, object, swap, task, a distractor), the same episodes in
   each: the 10 tasks, initial states FIRST..FIRST+EPISODES-1 (default 30-31: never trained on). An
   existing evaluation of `libero_object` that holds those episodes (the full-suite baseline) is reused
   with `--base EVAL_STUDY`.
2. `rescue manifest from-eval` of every perturbation suite's failures, one manifest, and `rescue run` of it
   with control, assisted and a permuted sham arm (fork at q).
3. Printed: the table (success per suite, with its perturbation kind), then the study's figures per kind
   from its export (rescued, sham-rescued, assisted against sham over the kind's K), and the whole
   study's. Everything lands under OUT (default studies/robustness).

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/robustness.py [OUT] [--episodes 2] [--first 30] [--base EVAL_STUDY]
     [--limit N]   (at most N failures of each perturbation suite in the rescue study)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = "libero_object"
PERTURBED = ["libero_object_lan", "libero_object_object", "libero_object_swap", "libero_object_task",
             "libero_object_with_mug"]
CONFIG = """fork_at_q = true
[sham]
source = "permuted"
seed = 0
"""


def rescue(*args: str) -> None:
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_PROGRESS_EVERY_S": "300"}
    subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=env, check=True)


def export(study: Path, out: Path) -> dict:
    rescue("export", str(study), "--out", str(out))
    return json.loads(out.read_text())


def success_of(data: dict, inits: range) -> tuple[int, int]:
    """(successes, episodes) over the export's cases whose initial state is in `inits`."""
    mine = [c for c in data["episode_rows"] if c["init_state_index"] in inits]
    return sum(c["label"] == "success" for c in mine), len(mine)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="studies/robustness")
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--first", type=int, default=30)
    ap.add_argument("--base", help="an existing evaluation study of libero_object holding these episodes")
    ap.add_argument("--limit", type=int, help="at most this many failures of each perturbation suite (manifest order)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    inits = range(args.first, args.first + args.episodes)
    rows, manifests = [], []
    started = time.time()
    for suite in [BASE, *PERTURBED]:
        study = Path(args.base).resolve() if suite == BASE and args.base else out / f"eval-{suite}"
        if not study.exists():
            rescue("eval", "--suite", suite, "--episodes", str(args.episodes), "--first-init", str(args.first),
                   "--study", str(study))
        data = export(study, out / f"eval-{suite}.json")
        kind = data["episode_rows"][0]["group"]
        rows.append((suite, kind, *success_of(data, inits)))
        if suite != BASE:
            manifest = out / f"failures-{suite}.jsonl"
            limit = ["--limit", str(args.limit)] if args.limit else []
            rescue("manifest", "from-eval", str(study), "--out", str(manifest), "--inits", f"{inits[0]}-{inits[-1]}", *limit)
            manifests.append(manifest)
    eval_s = time.time() - started
    failures = out / "failures.jsonl"
    failures.write_text("".join(m.read_text() for m in manifests))
    (out / "study.toml").write_text(CONFIG)
    study = out / "rescue"
    t0 = time.time()
    if not (study / "journal.sqlite").exists():
        rescue("run", str(failures), "--study", str(study), "--config", str(out / "study.toml"))
    rescue("verify", str(study))
    run_s = time.time() - t0
    result = export(study, out / "rescue.json")
    s = result["summary"]
    print(f"\nevaluations: {eval_s / 60:.1f} min; rescue study: {run_s / 60:.1f} min\n")
    print("| suite | perturbation | success |")
    print("|---|---|---|")
    for suite, kind, ok, n in rows:
        print(f"| `{suite}` | {kind} | {ok}/{n} ({100 * ok / n:.0f}%) |")
    print("\n| kind | failures (N) | rescued | sham rescued | K | assisted only / sham only | exact McNemar p |")
    print("|---|---|---|---|---|---|---|")
    for kind, b in sorted(s["per_group"].items()):
        sham = b["sham"]
        print(f"| {kind} | {b['n']} | {b['rescued']} | {sham['r']} | {sham['k']} | "
              f"{sham['pairs']['assisted_only']} / {sham['pairs']['sham_only']} | {sham['mcnemar_p']:.4f} |")
    sham = s["sham"]
    print(f"| all | {s['n']} | {s['r']} | {sham['r']} | {sham['k']} | "
          f"{sham['pairs']['assisted_only']} / {sham['pairs']['sham_only']} | {sham['mcnemar_p']:.4g} |")
    (out / "robustness.json").write_text(json.dumps({"rows": rows, "summary": s}, indent=2) + "\n")


if __name__ == "__main__":
    main()
