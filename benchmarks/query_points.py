"""When to ask (DESIGN §14), through the CLI: the embedded vision-language policy (the bundled server, RNG control)
evaluated on held-out initial states of the 10 `libero_object` tasks; every failure then rescued with the VLM asked
at a quarter, half (the pre-registered q) and three quarters of the horizon, one study, one control arm, fork at q,
and a permuted sham at the pre-registered q.

Printed: each query point's arm against control (R/E, exact McNemar), every pair of query points (Holm-adjusted),
and the sham.

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/query_points.py [OUT] [--episodes 4] [--first 30]
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
sys.path.insert(0, str(ROOT))  # this checkout's rescue, not an installed one

from rescue.core.figures.stats import Summary

CONFIG = """\
[[query_point]]
name = "quarter"
fraction = 0.25

[[query_point]]
name = "three-quarters"
fraction = 0.75

[sham]
source = "permuted"
"""


def rescue(*args: str) -> None:
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_PROGRESS_EVERY_S": "300"}
    subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="studies/query-points")
    parser.add_argument("--episodes", type=int, default=4, help="held-out initial states per task")
    parser.add_argument("--first", type=int, default=30, help="the first held-out initial state")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = out / "study.toml"
    config.write_text(CONFIG)
    evaluation, manifest, study = out / "eval", out / "failures.jsonl", out / "study"
    t0 = time.time()
    if not evaluation.exists():
        rescue("eval", "--suite", "libero_object", "--episodes", str(args.episodes), "--first-init", str(args.first),
               "--study", str(evaluation))
    rescue("manifest", "from-eval", str(evaluation), "--out", str(manifest))
    eval_s, t0 = time.time() - t0, time.time()
    if not study.exists():
        rescue("run", str(manifest), "--config", str(config), "--study", str(study))
    run_s = time.time() - t0
    rescue("verify", str(study))
    rescue("export", str(study), "--out", str(out / "export.json"))
    rescue("report", str(study))
    export = json.loads((out / "export.json").read_text())
    s = Summary.model_validate(export["summary"])
    print(f"\nevaluation {eval_s / 60:.1f} min, study {run_s / 60:.1f} min; {s.n} failures\n")
    print("| arm (asks at) | rescued / E | R/N | vs control: only it / only control, exact McNemar p |")
    print("|---|---|---|---|")
    for f in s.figures():
        vc = f.versus_control
        print(f"| {f.arm} | {f.r}/{f.e} | {100 * (f.r_over_n or 0):.0f}% | "
              f"{vc.pairs.first_only} / {vc.pairs.second_only}, {vc.mcnemar_p:.2g} |")
    print("\n| first vs second | K | first only / second only | exact McNemar p | Holm-adjusted p |")
    print("|---|---|---|---|---|")
    for c in s.comparisons:
        holm = f"{c.holm_p:.2g}" if c.holm_p is not None else ""
        print(f"| {c.first} vs {c.second} | {c.k} | {c.pairs.first_only} / {c.pairs.second_only} | {c.mcnemar_p:.2g} | {holm} |")
    usage = export.get("usage_by_query_point") or {}
    print("\n" + ", ".join(f"{arm}: {u['calls']} calls" for arm, u in usage.items()))


if __name__ == "__main__":
    main()
