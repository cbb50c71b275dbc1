"""The harm positive control (DESIGN §17), through the CLI: the embedded vision-language policy (the bundled server,
RNG control) evaluated on held-out initial states of the 10 `libero_object` tasks; then every failure and every
success of that evaluation (`rescue manifest from-eval --successes all`), declared before anything runs, replayed in
two studies whose primary advisor also asks at a quarter of the horizon (`[[query_point]] fraction = 0.25`, a point
the successes reach; the pre-registered half does not):

- `wrong`: a loopback `rescue serve-vlm --answer wrong-object` (a subgoal naming another object of the scene), with
  a fixed sham ("Continue with the task.") at the pre-registered q;
- `continue`: a loopback `rescue serve-vlm --answer "fixed:Continue with the task."` (a content-free subgoal).

Printed: per arm the successes' labels and exposure, the harm over the exposed (paired, exact p), the rescue over
the failures and the net change of the evaluation's success rate with the arm on.

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/harm_control.py [OUT] [--episodes 4] [--first 40]
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
from rescue.read.harm_view import interval_text

PORTS = {"wrong": "8041", "continue": "8042"}
ANSWERS = {"wrong": ("wrong-object", "wrong-object"), "continue": ("fixed:Continue with the task.", "content-free")}
EARLY = """
[[query_point]]
name = "early"
fraction = 0.25
"""
CONFIGS = {
    "wrong": f"""\
[[advisor]]
name = "wrong"
base_url = "http://127.0.0.1:{PORTS['wrong']}/v1"
model = "wrong-object"
{EARLY}
[sham]
source = "fixed"
text = "Continue with the task."
""",
    "continue": f"""\
[[advisor]]
name = "continue"
base_url = "http://127.0.0.1:{PORTS['continue']}/v1"
model = "content-free"
{EARLY}""",
}


def env() -> dict:
    return {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_PROGRESS_EVERY_S": "300"}


def rescue(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=env(), check=True)


def serve(name: str) -> subprocess.Popen:
    answer, model = ANSWERS[name]
    port = PORTS[name]
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", port, "--answer", answer,
                             "--model", model], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"serve-vlm {name} did not come up")


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def table(summaries: dict[str, Summary]) -> None:
    print("| study | arm (asks at) | successes: reached / broken / kept (reached) / not reproduced / unreached "
          "| harm over the reached, 95% CI | paired exact p | rescue over the failures | net change: these episodes "
          "| net change: the benchmark |")
    print("|---|---|---|---|---|---|---|---|")
    for study, s in summaries.items():
        for f in s.harm.arms:
            c, h, net = f.counts, f.harm, f.net
            ci = "" if h.diff_ci is None else f" [{pct(h.diff_ci[0])}, {pct(h.diff_ci[1])}]"
            if net is None or net.change is None:
                these = bench = "n/a" if net is None else net.refused
            else:
                these = f"{100 * net.change:+.1f} pp {interval_text(net.these_episodes)}"
                bench = interval_text(net.benchmark)
            print(f"| {study} | {f.arm.removeprefix('assisted:')} | {f.n}: {f.exposed} / {c['broken']} / {c['kept']} / "
                  f"{c['not_reproduced']} / {f.unreached} | {pct(h.diff)}{ci} ({f.m} pairs) | {h.p:.2g} | "
                  f"{pct(f.rescue.diff)} | {these} | {bench} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="studies/harm-control")
    parser.add_argument("--episodes", type=int, default=4, help="held-out initial states per task")
    parser.add_argument("--first", type=int, default=40, help="the first held-out initial state")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    servers = [serve(name) for name in PORTS]
    times = {}
    summaries: dict[str, Summary] = {}
    try:
        t0 = time.time()
        evaluation, manifest = out / "eval", out / "cases.jsonl"
        if not evaluation.exists():
            rescue("eval", "--suite", "libero_object", "--episodes", str(args.episodes), "--first-init", str(args.first),
                   "--study", str(evaluation))
        rescue("manifest", "from-eval", str(evaluation), "--out", str(manifest), "--successes", "all")
        times["evaluation"] = time.time() - t0
        for name, text in CONFIGS.items():
            config, study = out / f"{name}.toml", out / name
            config.write_text(text)
            t0 = time.time()
            if not study.exists():
                rescue("run", str(manifest), "--config", str(config), "--study", str(study))
            times[name] = time.time() - t0
            rescue("verify", str(study))
            rescue("export", str(study), "--out", str(out / f"{name}.json"))
            summaries[name] = Summary.model_validate(json.loads((out / f"{name}.json").read_text())["summary"])
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait()
    frame = summaries["wrong"].harm.frame
    print("\n" + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items())
          + f"; {summaries['wrong'].n} failures and {summaries['wrong'].harm.successes} successes"
          + (f" (frame: F = {frame.failures}, S = {frame.successes})" if frame else "") + "\n")
    table(summaries)


if __name__ == "__main__":
    main()
