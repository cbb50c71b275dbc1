"""Journal scale: ingest a 100,000-case manifest, decide a resume, and per-case claim/finish bookkeeping.

Targets: ingest <= 5 s, resume decision <= 1 s, bookkeeping <= 5 ms per case.
Run: .venv/bin/python benchmarks/journal_scale.py
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from rescue.core.manifest import parse_manifest
from rescue.core.records import ArmResult, Assistance
from rescue.core.verdicts import Verdict
from rescue.core.trace import TraceRow
from rescue.study.journal import Journal

N = 100_000
BOOKKEEPING_CASES = 2_000
INTERRUPTED = 1_000


def _arm(case_id: str, arm: str, rows: int = 14) -> ArmResult:
    trace = [TraceRow(step=8 * i, state="a" * 64, instruction="b" * 64, actions="c" * 64) for i in range(rows)]
    status = "control" if arm == "control" else "applied"
    return ArmResult(case_id=case_id, arm=arm, status="complete", success=False, steps=112, fingerprint="d" * 64,
                     trace=trace, assistance=Assistance(status=status))


def main() -> None:
    lines = "".join(
        json.dumps({"case_id": f"case-{i}", "suite": "libero_object", "task_id": i % 10, "init_state_index": i % 50,
                    "env_seed": i, "horizon": 280, "group": "object"}) + "\n"
        for i in range(N)
    ).encode()
    with tempfile.TemporaryDirectory() as tmp:
        study = Path(tmp) / "study"
        t0 = time.perf_counter()
        manifest = parse_manifest(lines, "bench.jsonl")
        journal = Journal.create(study, manifest.cases, {"kind": "rescue"})
        ingest = time.perf_counter() - t0

        t0 = time.perf_counter()
        for _ in range(BOOKKEEPING_CASES):
            case = journal.claim_next("bench")
            arms = [_arm(case.case_id, "control"), _arm(case.case_id, "assisted")]
            verdict = Verdict(case_id=case.case_id, label="not_rescued", rule=8, reason="bench")
            journal.finish_case(case.case_id, arms, verdict, ("call", "receipts/receipts.jsonl", "e" * 64))
        per_case_ms = (time.perf_counter() - t0) / BOOKKEEPING_CASES * 1000

        for _ in range(INTERRUPTED):
            journal.claim_next("bench-crashed")
        journal.close()
        t0 = time.perf_counter()
        journal = Journal.open(study)
        interrupted = journal.unsettled_ids()  # what a resume settles (each, then, in a transaction of its own)
        pending = len(journal.pending_ids())
        resume = time.perf_counter() - t0
        journal.close()
    print(f"ingest {N} cases: {ingest:.2f} s (target <= 5 s)")
    print(f"claim, then 2 arm records + receipt index + verdict + finish: {per_case_ms:.2f} ms per case over {BOOKKEEPING_CASES} (target <= 5 ms)")
    print(f"resume decision ({len(interrupted)} interrupted, {pending} pending): {resume:.3f} s (target <= 1 s)")


if __name__ == "__main__":
    main()
