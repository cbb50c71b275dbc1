"""Three advisors and a sham arm on the same real failures, in one study (DESIGN §11), through the CLI.

The failures are every failure of held-out initial states (30-39 by default) of a full-suite evaluation
of the embedded vision-language policy (`rescue manifest from-eval EVAL --inits 30-39`). The study runs
`models/advisors/three_advisors.toml`: the local endpoint, a loopback `rescue serve-vlm` answering a
subgoal about another object of the scene, one answering "Continue with the task.", and a permuted sham
drawing the local advisor's answers; fork at q. It is killed with SIGKILL once a third of the cases are
finished, resumed, verified, exported and reported. Printed: the advisor table (ranked by R/E, each
against control and against the sham) and the pairwise table (exact McNemar, Holm-adjusted).

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/advisors_example.py EVAL_STUDY [OUT] [INITS]
(INITS: the held-out initial states whose failures are the cases, default 30-39.)
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from rescue.core.figures.stats import Summary, ranked

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "models" / "advisors" / "three_advisors.toml"
# Port, answer and the model each reports (the advisors' `model` in three_advisors.toml).
SERVERS = (("8011", "wrong-object", "wrong-object"), ("8012", "fixed:Continue with the task.", "content-free"))


def env() -> dict:
    return {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_PROGRESS_EVERY_S": "300"}


def rescue(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=env(), check=check)


def finished(study: Path) -> int:
    try:
        with sqlite3.connect(f"file:{study / 'journal.sqlite'}?mode=ro", uri=True) as con:
            return con.execute("SELECT count(*) FROM cases WHERE state = 'finished'").fetchone()[0]
    except sqlite3.Error:
        return 0


def main() -> None:
    eval_study = Path(sys.argv[1]).resolve()
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "studies/advisors").resolve()
    inits = sys.argv[3] if len(sys.argv) > 3 else "30-39"
    out.mkdir(parents=True, exist_ok=True)
    manifest, study = out / "held_out.jsonl", out / "study"
    rescue("manifest", "from-eval", str(eval_study), "--out", str(manifest), "--inits", inits)
    n = sum(1 for line in manifest.read_text().splitlines() if line.strip())
    servers = [subprocess.Popen([sys.executable, "-m", "rescue.cli", "serve-vlm", "--port", port, "--answer", answer,
                                 "--model", model], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True) for port, answer, model in SERVERS]
    try:
        time.sleep(5)
        t0 = time.time()
        if not study.exists():
            run = subprocess.Popen([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study),
                                    "--config", str(CONFIG)], cwd=ROOT, env=env(), start_new_session=True)
            while run.poll() is None and finished(study) < n // 3:
                time.sleep(2)
            killed_at = finished(study)
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)  # the run and its simulators, as a crash of the machine would
            run.wait()
            print(f"killed with SIGKILL after {killed_at} of {n} cases finished", flush=True)
        rescue("resume", str(study))
        wall = time.time() - t0
        rescue("verify", str(study))
        rescue("export", str(study), "--out", str(out / "export.json"))
        rescue("report", str(study))
    finally:
        for server in servers:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait()
    s = Summary.model_validate(json.loads((out / "export.json").read_text())["summary"])
    print(f"\n{n} cases, {wall / 60:.1f} min from the first run to the end of the resume\n")
    print("| advisor | R | E | R/E | vs control: advisor only / control only, p | vs sham: advisor only / sham only, p |")
    print("|---|---|---|---|---|---|")
    for a in ranked([f for f in s.figures() if f.arm != "sham"]):
        vc, sham = a.versus_control, s.comparison(a.arm, "sham")
        print(f"| {a.arm.removeprefix('assisted:')} | {a.r} | {a.e} | {100 * (a.r_over_e or 0):.0f}% | "
              f"{vc.pairs.first_only} / {vc.pairs.second_only}, {vc.mcnemar_p:.2g} | "
              f"{sham.pairs.first_only} / {sham.pairs.second_only}, {sham.mcnemar_p:.2g} |")
    sham = next(a for a in s.arms if a.arm == "sham")
    print(f"| (sham) | {sham.r} | {sham.e} | | | |")
    print("\n| pair | K | first only / second only | exact McNemar p | Holm-adjusted p |")
    print("|---|---|---|---|---|")
    for p in [c for c in s.comparisons if c.holm_p is not None]:
        print(f"| {p.first.removeprefix('assisted:')} vs {p.second.removeprefix('assisted:')} | {p.k} | "
              f"{p.pairs.first_only} / {p.pairs.second_only} | {p.mcnemar_p:.2g} | {p.holm_p:.2g} |")

if __name__ == "__main__":
    main()
