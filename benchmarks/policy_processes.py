"""The command process's CPU per case with the in-process policy served in it, and from processes of its own.

The same rescue study (the embedded vision-language policy, the local VLM
endpoint, N cases of one libero_object task) runs through the real CLI twice:
`--policy-processes 0` (the policy in the command process's event loop) and
`--policy-processes P`. For each it prints the CPU-s per case of the command
process itself (its own threads, read by getrusage in that process) and of its
children (simulators and policy processes), and the wall time. With the policy
in its own processes the command's share should fall to what the engine,
journal and VLM client cost, so many simulators no longer wait on one core.
Run: MUJOCO_GL=egl .venv/bin/python benchmarks/policy_processes.py [CASES] [HORIZON] [SIMULATORS] [PROCESSES]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import write_cases  # noqa: E402

# The CLI in a process that writes its own CPU and its reaped children's, once the command is done.
_MEASURED = """
import json, resource, sys
from rescue.cli import main
if __name__ == "__main__":
    out, argv = sys.argv[1], sys.argv[2:]
    try:
        code = main(argv)
    finally:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(out, "w") as f:
            json.dump({"self": me.ru_utime + me.ru_stime, "children": kids.ru_utime + kids.ru_stime}, f)
    sys.exit(code)
"""


def run(manifest: Path, study: Path, extra: list[str]) -> tuple[dict, float]:
    """Run one study; its command's CPU-s (`self`, `children`) and its wall time."""
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "PYTHONPATH": str(ROOT)}
    cpu = study.with_suffix(".cpu.json")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", _MEASURED, str(cpu), "run", str(manifest), "--study", str(study), *extra],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(cpu.read_text()), time.perf_counter() - started


def main() -> None:
    cases = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    horizon = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    simulators = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    processes = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    with tempfile.TemporaryDirectory() as tmp:
        manifest = write_cases(Path(tmp) / "m.jsonl", cases, horizon=horizon)
        print(f"{cases} cases, horizon {horizon}, {simulators} simulators, {os.cpu_count()} CPUs")
        print(f"{'policy processes':>16} {'command CPU-s/case':>19} {'children CPU-s/case':>20} {'wall s':>8}")
        for n in (0, processes):
            extra = ["--simulators", str(simulators), "--cases-in-flight", str(simulators), "--policy-processes", str(n)]
            cpu, wall = run(manifest, Path(tmp) / f"study-{n}", extra)
            print(f"{n:>16} {cpu['self'] / cases:>19.2f} {cpu['children'] / cases:>20.2f} {wall:>8.1f}")


if __name__ == "__main__":
    main()
