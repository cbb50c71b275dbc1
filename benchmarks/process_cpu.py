"""Where a test tier's (or any command's) CPU goes, by kind of process and by test module.

    PROCESS_CPU_LOG=/tmp/cpu.jsonl PYTHONPATH=benchmarks/process_cpu SKIP_SETUP=1 bash scripts/test.sh slow
    .venv/bin/python benchmarks/process_cpu.py /tmp/cpu.jsonl [TOP]

The first command runs the tier with `benchmarks/process_cpu/sitecustomize.py` loaded in every Python process
it starts; each writes its own CPU when it ends. Printed: CPU-seconds and process counts per kind (the
command a CLI process ran, a simulator, a test's reference loop, pytest's workers), how much of it went to
processes that loaded the sentence model, and the TOP test modules. Processes killed by a signal, and
processes that are not Python (Ray's raylet and GCS), are not counted: compare the total with the machine's.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def kind(record: dict) -> str:
    """What a process was: `rescue <command>`, a simulator, a policy process, a script, or pytest."""
    argv, name = record["argv"], record["mp"]
    if name != "MainProcess":
        return f"{name.rstrip('0123456789').rstrip('-')} process (of rescue {argv[1] if len(argv) > 1 else '?'})"
    if argv and argv[0].endswith(("rescue/cli.py", "rescue/cli/__main__.py")):
        return f"rescue {argv[1] if len(argv) > 1 else ''}".strip()
    if argv and argv[0].endswith(".py"):
        return argv[0].rsplit("/", 1)[-1]
    if argv and argv[0] == "-c":
        return "python -c"
    return argv[0].rsplit("/", 1)[-1] if argv else "?"


def main(path: str, top: int = 15) -> None:
    records = {}
    for line in open(path, encoding="utf-8"):
        record = json.loads(line)
        records[record["pid"]] = record
    total = sum(r["cpu"] for r in records.values())
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_module: dict[str, float] = defaultdict(float)
    for r in records.values():
        k = kind(r)
        if k.startswith(("sim process", "policy process")):
            k = k.split(" (")[0]
        by_kind[k].append(r["cpu"])
        by_module[r["test"].split("::")[0] or "(outside a test)"] += r["cpu"]
    print(f"{total:,.0f} CPU-s in {len(records)} processes")
    print(f"{'CPU-s':>8} {'share':>6} {'processes':>9} {'each':>6}  kind")
    for k, cpus in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(cpus):8,.0f} {sum(cpus) / total:6.1%} {len(cpus):9d} {sum(cpus) / len(cpus):6.2f}  {k}")
    model = [r["cpu"] for r in records.values() if r.get("sentence_model")]
    print(f"processes that loaded the sentence model: {len(model)}, {sum(model):,.0f} CPU-s")
    print("by test module:")
    for module, cpu in sorted(by_module.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{cpu:8,.0f} {cpu / total:6.1%}  {module}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
