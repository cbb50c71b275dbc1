"""Where a test tier's CPU goes, by module, from the CPU report of a run.

    RESCUE_TEST_CPU=cpu.jsonl SKIP_SETUP=1 /usr/bin/time -f "%U %S" bash scripts/test.sh slow -q 2> time.txt
    .venv/bin/python benchmarks/tier_cpu.py cpu.jsonl [--total-cpu SECONDS] [--top N]

The report (tests/tiers_plugin.py, RESCUE_TEST_CPU) holds one line per test: the CPU seconds of the test's own
process (a pytest-xdist worker) and of the child processes it waited for (its commands, its servers, simulators
of its own). Wall time says little on a 2-core machine that both workers keep busy; CPU is what a change saves
for the other worker too. `--total-cpu` (user + sys of the whole run, from /usr/bin/time) adds the part no test
is charged with: the run's warm simulators, which serve most studies' arms, and daemons tests leave to others.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def by_module(lines: list[str]) -> dict[str, dict[str, float]]:
    """Per test module: its tests' own CPU, their children's, their wall time and their number."""
    modules: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"own": 0.0, "children": 0.0, "wall": 0.0,
                                                                           "tests": 0})
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        module = modules[row["test"].split("::", 1)[0]]
        for key in ("own", "children", "wall"):
            module[key] += row[key]
        module["tests"] += 1
    return dict(modules)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/tier_cpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="the RESCUE_TEST_CPU file of a run")
    parser.add_argument("--total-cpu", type=float, help="user + sys seconds of the whole run (/usr/bin/time)")
    parser.add_argument("--top", type=int, default=15, help="modules shown (default 15)")
    args = parser.parse_args(argv)
    try:
        modules = by_module(args.report.read_text(encoding="utf-8").splitlines())
    except (OSError, ValueError, KeyError) as exc:
        print(f"tier_cpu: {args.report}: not a CPU report ({exc})", file=sys.stderr)
        return 2
    if not modules:
        print(f"tier_cpu: {args.report}: no test in it", file=sys.stderr)
        return 2
    charged = sum(m["own"] + m["children"] for m in modules.values())
    print(f"{'CPU-s':>8} {'own':>7} {'children':>8} {'wall':>7} {'tests':>5}  module")
    ranked = sorted(modules.items(), key=lambda item: -(item[1]["own"] + item[1]["children"]))
    for name, m in ranked[:args.top]:
        print(f"{m['own'] + m['children']:8.1f} {m['own']:7.1f} {m['children']:8.1f} {m['wall']:7.1f} "
              f"{int(m['tests']):5d}  {name}")
    tests = sum(int(m["tests"]) for m in modules.values())
    print(f"{charged:8.1f} charged to {tests} tests in {len(modules)} modules")
    if args.total_cpu is not None:
        rest = args.total_cpu - charged
        print(f"{rest:8.1f} charged to no test ({rest / args.total_cpu:.0%} of the run's {args.total_cpu:.1f} CPU-s): "
              "the warm simulators, daemons left to others, pytest itself")
    return 0


if __name__ == "__main__":
    sys.exit(main())
