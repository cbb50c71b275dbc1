"""The seed's study at full size, measured: a rescue study over every failure of a full-suite evaluation.

Through the CLI, as a user runs it: `rescue eval` of the embedded vision-language policy over all 10
libero_object tasks (EPISODES official initial states each, the suite's horizon), `rescue manifest
from-eval` (every failure), then `rescue run` with three arms per case (control, assisted, a permuted
sham), fork at q, on 2 simulators. While the study runs, the resident memory of every process of its
tree (the command, its simulators) is sampled every second. Printed: wall time, CPU per case (the
study's whole process tree), peak RSS per process, study-folder bytes per case, cases per hour, and the
extrapolation to the seed's 1,004 cases on this machine.

Also printed: env builds and closes per case (the simulators' log lines), and each simulator's memory
budget with its source (the `env.memory_budget` event).

Run: MUJOCO_GL=egl .venv/bin/python benchmarks/full_study.py [EPISODES] [OUT_DIR] [--eval EXISTING_EVAL_STUDY]
     [--cases N] [--max-rss GB]
(EPISODES 50 gives the 500-episode baseline; an existing evaluation study is reused with --eval; --cases
keeps the first N failures in manifest order, for a shorter paired run; --max-rss sets each simulator's
memory budget, `[env] max_simulator_rss_gb`, instead of the default.)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's rescue, whatever is installed

from rescue.study.layout import SIMULATOR_LOG  # noqa: E402
SEED_CASES = 1004
CONFIG = """fork_at_q = true
cases_in_flight = 4
keyframes = true
[env]
simulators = 2
[sham]
source = "permuted"
"""


def rescue(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "RESCUE_PROGRESS_EVERY_S": "300"}
    return subprocess.run([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=env, check=True, **kw)


def tree(pid: int) -> list[int]:
    """pid and every descendant now alive."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss_gb(pid: int) -> tuple[str, float] | None:
    try:
        status = (Path(f"/proc/{pid}") / "status").read_text().splitlines()
        cmd = (Path(f"/proc/{pid}") / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    except OSError:
        return None
    kb = next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
    return cmd, kb / 1024 / 1024


def main() -> None:
    flags = {"--eval", "--cases", "--max-rss"}
    args = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--") and sys.argv[i - 1] not in flags]
    episodes = int(args[0]) if args else 50
    out = Path(args[1] if len(args) > 1 else "studies/full-study")
    out.mkdir(parents=True, exist_ok=True)
    eval_dir = Path(sys.argv[sys.argv.index("--eval") + 1]) if "--eval" in sys.argv else out / "eval"
    started = time.time()
    if not eval_dir.exists():
        rescue("eval", "--suite", "libero_object", "--tasks", "0-9", "--episodes", str(episodes), "--study", str(eval_dir))
    eval_s = time.time() - started
    manifest = out / "failures.jsonl"
    rescue("manifest", "from-eval", str(eval_dir), "--out", str(manifest))
    lines = [line for line in manifest.read_text().splitlines() if line.strip()]
    if "--cases" in sys.argv:
        lines = lines[: int(sys.argv[sys.argv.index("--cases") + 1])]
        manifest.write_text("".join(line + "\n" for line in lines))
    n = len(lines)
    budget = f"max_simulator_rss_gb = {sys.argv[sys.argv.index('--max-rss') + 1]}\n" if "--max-rss" in sys.argv else ""
    (out / "study.toml").write_text(CONFIG.replace("[env]\n", "[env]\n" + budget))
    study = out / "rescue"
    peak: dict[int, tuple[str, float]] = {}
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", "run", str(manifest), "--study", str(study),
                             "--config", str(out / "study.toml")], cwd=ROOT,
                            env={**os.environ, "RESCUE_PROGRESS_EVERY_S": "300"})
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid in tree(proc.pid):
                seen = rss_gb(pid)
                if seen and seen[1] > peak.get(pid, ("", 0.0))[1]:
                    peak[pid] = seen
            time.sleep(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = proc.wait()
    done.set()
    sampler.join()
    wall = time.time() - t0
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    folder = sum(p.stat().st_size for p in study.rglob("*") if p.is_file())
    rescue("export", str(study), "--partial", "--out", str(out / "export.json"), capture_output=True)
    export = json.loads((out / "export.json").read_text())
    summary = export["summary"]
    done = summary["n"]  # cases with a verdict: all of them unless the run was stopped (exit code 3)
    log = (study / SIMULATOR_LOG).read_text(errors="replace") if (study / SIMULATOR_LOG).exists() else ""
    events = [json.loads(line) for line in (study / "events.jsonl").read_text().splitlines() if line.strip()]
    budget = next((e for e in events if e.get("event") == "env.memory_budget"), {})
    result = {
        "exit_code": code, "episodes": 10 * episodes, "eval_wall_s": round(eval_s, 1), "cases": n, "cases_done": done,
        "wall_s": round(wall, 1), "cpu_s_per_case": round(cpu / done, 2), "cases_per_hour": round(3600 * done / wall, 1),
        "folder_mb_per_case": round(folder / done / 1e6, 3),
        "env_builds_per_case": round(log.count("rescue: built the env of") / done, 2),
        "env_closes_per_case": round(log.count("rescue: closed the env of") / done, 2),
        "memory_budget_gb": budget.get("gb"), "memory_budget_source": budget.get("source"),
        "peak_rss_gb": {f"{pid} {cmd}": round(gb, 2) for pid, (cmd, gb) in sorted(peak.items(), key=lambda kv: -kv[1][1])},
        "rescued": summary["counts"].get("rescued"), "n": summary["n"],
        "sham_rescued": next((a["r"] for a in summary.get("arms", []) if a["arm"] == "sham"), None),
        "extrapolated_1004_cases_h": round(SEED_CASES * wall / done / 3600, 2),
        "extrapolated_1004_cases_cpu_bound_h": round(SEED_CASES * cpu / done / os.cpu_count() / 3600, 2),
    }
    print(json.dumps(result, indent=2))
    (out / "full_study.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
