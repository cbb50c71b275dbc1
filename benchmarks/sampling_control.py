"""The positive control under sampling (DESIGN §13), through the CLI: the embedded vision-language policy served by
the real `openpi_server` package without RNG control (`python -m rescue.embedded.openpi_stand_in`, as pi0 is
served), evaluated on held-out initial states of the 10 `libero_object` tasks; then every failure rescued with
fork at q and K continuations per arm by the local advisor, a wrong-object advisor (a loopback `rescue serve-vlm
--answer wrong-object`: a subgoal naming another object of the scene) and a permuted sham drawing the local
advisor's answers. The declared case set: every failure of the evaluation (initial states FIRST..FIRST+EPISODES-1
of every task), decided before the study runs.

Printed: each arm's paired estimate against control, and the local advisor's against the wrong advisor and against
the sham (mean difference in success probability over K continuations, bootstrap 95% CI, exact sign-flip p).

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/sampling_control.py [OUT] [--episodes 4] [--first 30] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's rescue, not an installed one

from rescue.core.figures.stats import Summary

POLICY_PORT, VLM_PORT = "8031", "8032"
CONFIG = f"""\
continuations = {{k}}

[policy]
url = "ws://127.0.0.1:{POLICY_PORT}"
replan_interval = 8

[[advisor]]
name = "local"

[[advisor]]
name = "wrong"
base_url = "http://127.0.0.1:{VLM_PORT}/v1"
model = "wrong-object"

[sham]
source = "permuted"
advisor = "local"
"""


def env() -> dict:
    return {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_PROGRESS_EVERY_S": "300"}


def rescue(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=env(), check=True)


def serve(args: list[str], health: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(600):
        try:
            with urllib.request.urlopen(health, timeout=1):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{' '.join(args)} did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="studies/sampling-control")
    parser.add_argument("--episodes", type=int, default=4, help="held-out initial states per task")
    parser.add_argument("--first", type=int, default=30, help="the first held-out initial state")
    parser.add_argument("--k", type=int, default=3, help="continuations per arm")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = out / "study.toml"
    config.write_text(CONFIG.format(k=args.k))
    servers = [serve(["rescue.embedded.openpi_stand_in", "--port", POLICY_PORT], f"http://127.0.0.1:{POLICY_PORT}/healthz"),
               serve(["rescue.cli", "serve-vlm", "--port", VLM_PORT, "--answer", "wrong-object", "--model", "wrong-object"],
                     f"http://127.0.0.1:{VLM_PORT}/v1/models")]
    try:
        t0 = time.time()
        evaluation, manifest, study = out / "eval", out / "failures.jsonl", out / "study"
        if not evaluation.exists():
            rescue("eval", "--suite", "libero_object", "--episodes", str(args.episodes), "--first-init", str(args.first),
                   "--config", str(config), "--study", str(evaluation))
        rescue("manifest", "from-eval", str(evaluation), "--out", str(manifest))
        eval_s = time.time() - t0
        t0 = time.time()
        if not study.exists():
            rescue("run", str(manifest), "--config", str(config), "--study", str(study))
        run_s = time.time() - t0
        rescue("verify", str(study))
        rescue("export", str(study), "--out", str(out / "export.json"))
        rescue("report", str(study))
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait()
    export = json.loads((out / "export.json").read_text())
    s = Summary.model_validate(export["summary"])
    rows = [f.versus_control for f in s.figures()] + list(s.comparisons)
    print(f"\nevaluation {eval_s / 60:.1f} min, study {run_s / 60:.1f} min; {s.n} failures, K = {args.k}; "
          f"the control failed again in {s.reproduction.failed} of {s.reproduction.controls} runs\n")
    print("| first vs second | cases | first's rate | second's rate | difference, 95% CI | exact sign-flip p |")
    print("|---|---|---|---|---|---|")
    for c in rows:
        e = c.estimate
        if e is None:
            continue
        lo, hi = e.diff_ci or (float("nan"), float("nan"))
        print(f"| {c.first.removeprefix('assisted:')} vs {c.second.removeprefix('assisted:')} | {e.k} | "
              f"{100 * (e.first_rate or 0):.0f}% | {100 * (e.second_rate or 0):.0f}% | "
              f"{100 * (e.diff or 0):+.0f} pp [{100 * lo:+.0f}, {100 * hi:+.0f}] | {e.p:.2g} |")


if __name__ == "__main__":
    main()
