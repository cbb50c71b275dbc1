"""A small study to profile with a sampling profiler (py-spy), simulator processes included.

Run:
  .venv/bin/pip install py-spy
  MUJOCO_GL=egl .venv/bin/py-spy record --subprocesses --format raw -o /tmp/study.folded -- \\
      .venv/bin/python benchmarks/profile_study.py
  .venv/bin/python benchmarks/profile_study.py --top /tmp/study.folded
The second command prints the functions with the most samples at the top of the stack (self time)
and the project functions with the most samples anywhere in the stack (inclusive time).

Any study run under py-spy (e.g. `-- .venv/bin/python -m rescue.cli run M --study S --config C`) can be
split into phases: `profile_study.py --phases FOLDED RATE CASES` attributes every sample to the first
phase whose marker its stack holds (env builds, rendering, physics, policy, VLM, journal, start-up
imports; the rest is "other") and prints seconds per case (samples / RATE / CASES). py-spy sees Python
threads only and takes some blocked ones for busy; `profile_study.py --threads CASES ARGS...` runs
`rescue ARGS` and reports what the kernel charged each thread (the renderer's included).
"""

from __future__ import annotations

import sys
from collections import Counter

from common import cases, timed_study
from full_study import tree

from rescue.core.configuration.config import StudyConfig


def top(path: str, k: int = 15) -> None:
    """Summarise py-spy's folded stacks: self samples per frame and inclusive samples per project frame."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in open(path, encoding="utf-8"):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            if "rescue/" in frame or "wrappers/" in frame:
                inclusive[frame] += n
    print(f"{total} samples")
    print("self time:")
    for frame, n in own.most_common(k):
        print(f"  {100 * n / total:5.1f}%  {frame}")
    print("inclusive time, project frames:")
    for frame, n in inclusive.most_common(k):
        print(f"  {100 * n / total:5.1f}%  {frame}")


def threads(args: list[str], n_cases: int) -> None:
    """Run `rescue ARGS`, sample the CPU time of every thread of its process tree from /proc every 0.2 s,
    and print CPU-seconds per case by process (the command, its simulators) and thread name. py-spy sees
    Python threads only, and counts a thread blocked in a pipe read as busy; this counts what the kernel
    charged, including the renderer's own threads (llvmpipe-N) and the tensor library's."""
    import os
    import subprocess
    import time
    from pathlib import Path

    tick = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[int, int], tuple[str, str, float]] = {}
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", *args])
    while proc.poll() is None:
        for pid in tree(proc.pid):
            pid_dir = Path(f"/proc/{pid}")
            try:
                cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if "rescue.cli" not in cmd and "spawn_main" not in cmd:
                    continue
                kind = "simulators" if "spawn_main" in cmd else "the command"
                for task in (pid_dir / "task").iterdir():
                    fields = (task / "stat").read_text().rsplit(")", 1)
                    name = fields[0].split("(", 1)[1]
                    utime, stime = (int(x) for x in fields[1].split()[11:13])
                    seen[(pid, int(task.name))] = (kind, name, (utime + stime) / tick)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.2)
    total: Counter[tuple[str, str]] = Counter()
    for kind, name, cpu in seen.values():
        total[(kind, "llvmpipe-N" if name.startswith("llvmpipe") else name)] += cpu
    print(f"exit {proc.returncode}; {sum(total.values()):.1f} CPU-s in {len(seen)} threads, {n_cases} cases")
    for (kind, name), cpu in total.most_common(12):
        print(f"  {kind:12s} {name:16s} {cpu / n_cases:6.2f} CPU-s per case")


# (phase, markers): a sample belongs to the first phase any of whose markers is in one of its frames.
PHASES = (
    ("env builds", ("_env_for (rescue/env/libero.py", "_build (rescue/env/libero.py")),
    ("rendering", ("_take_frames (rescue/env/libero.py", "render (rescue/env/libero.py", "_view (rescue/env/libero.py",
                   "view (rescue/env/libero.py")),
    ("physics", ("run_chunk (rescue/env/libero.py", "reset (rescue/env/libero.py", "restore (rescue/env/libero.py",
                 "snapshot (rescue/env/libero.py")),
    ("policy", ("rescue/embedded/vision_language.py", "rescue/embedded/locator.py", "rescue/embedded/learned.py",
                "rescue/policy/", "sentence_transformers/")),
    ("VLM", ("rescue/vlm/", "rescue/embedded/endpoint.py", "rescue/embedded/subgoal_model.py", "openai/")),
    ("journal", ("rescue/study/",)),
    ("start-up imports", ("_find_and_load (<frozen importlib._bootstrap>",)),
)


def phases(path: str, rate: float, n_cases: int) -> None:
    """CPU-seconds per case in each phase of py-spy's folded stacks (see the module's docstring)."""
    seconds: Counter[str] = Counter()
    by_process: Counter[str] = Counter()
    for line in open(path, encoding="utf-8"):
        stack, _, count = line.rstrip().rpartition(" ")
        phase = next((name for name, markers in PHASES if any(m in stack for m in markers)), "other")
        seconds[phase] += int(count) / rate
        # py-spy --subprocesses starts each stack with the command's process, a child's stack with its own next.
        by_process["simulators" if "spawn_main" in ";".join(stack.split(";", 2)[:2]) else "the command"] += int(count) / rate
    total = sum(seconds.values())
    print(f"{total:.1f} CPU-s sampled, {n_cases} cases: {total / n_cases:.2f} CPU-s per case")
    for name in [p for p, _ in PHASES] + ["other"]:
        print(f"  {name:18s} {seconds[name] / n_cases:6.2f} CPU-s per case  {100 * seconds[name] / total:5.1f}%")
    for name, value in sorted(by_process.items()):
        print(f"  in {name}: {value / n_cases:.2f} CPU-s per case")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--top":
        top(sys.argv[2])
    elif len(sys.argv) > 3 and sys.argv[1] == "--threads":
        threads(sys.argv[3:], int(sys.argv[2]))
    elif len(sys.argv) > 4 and sys.argv[1] == "--phases":
        phases(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        print(f"{timed_study(cases(4, 160), StudyConfig()):.1f} s")
