"""`rescue status` on a 10,000-case study: the read side answers without loading the runtime.

Builds a real study folder (config, manifest, journal) of 10,000 cases, finishes
half of them with two arms and a verdict each, writes one receipt per finished
case, then times `rescue status` as a user runs it (a fresh process) and the
library call alone. Target: the command under 1 s.
Run: .venv/bin/python benchmarks/status_scale.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rescue.core.configuration.config import StudyConfig
from rescue.core.manifest import parse_manifest  # noqa: E402
from rescue.core.records import ArmResult, Assistance, Receipt
from rescue.core.verdicts import Verdict
from rescue.core.trace import TraceRow
from rescue.read.status import study_status  # noqa: E402
from rescue.study.folder import create_study  # noqa: E402
from rescue.study.journal import Journal  # noqa: E402
from rescue.study.layout import StudyLayout  # noqa: E402
from rescue.study.receipts import ReceiptLog  # noqa: E402

N = 10_000
FINISHED = N // 2


def _arm(case_id: str, arm: str) -> ArmResult:
    trace = [TraceRow(step=8 * i, state="a" * 64, instruction="b" * 64, actions="c" * 64) for i in range(35)]
    status = "control" if arm == "control" else "applied"
    return ArmResult(case_id=case_id, arm=arm, status="complete", success=False, steps=280, fingerprint="d" * 64,
                     trace=trace, assistance=Assistance(status=status))


def build(study: Path) -> None:
    lines = "".join(
        json.dumps({"case_id": f"case-{i}", "suite": "libero_object", "task_id": i % 10, "init_state_index": i % 50,
                    "env_seed": i, "horizon": 280, "group": "object"}) + "\n"
        for i in range(N)
    ).encode()
    config = StudyConfig()
    config = config.model_copy(update={"policy": config.policy.model_copy(update={"replan_interval": 8, "announced": {}})})
    create_study(study, parse_manifest(lines, "bench.jsonl"), config)
    log = ReceiptLog(StudyLayout.of(study).receipts)
    with Journal.open(study) as journal:
        for _ in range(FINISHED):
            case = journal.claim_next("bench")
            arms = [_arm(case.case_id, "control"), _arm(case.case_id, "assisted")]
            verdict = Verdict(case_id=case.case_id, label="not_rescued", rule=8, reason="bench")
            journal.finish_case(case.case_id, arms, verdict, None)
            log.write(Receipt(kind="outcome", call_id=f"call-{case.case_id}", attempt=1, request_ids=["r"],
                              case_ids=[case.case_id], model_requested="m", endpoint_kind="chat", prompt_template="t",
                              prompt_template_sha256="e" * 64, prompt_sha256="f" * 64, started_at=0.0,
                              finished_at=1.0, latency_s=1.0, status="ok"))
    log.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        study = Path(tmp) / "study"
        build(study)
        t0 = time.perf_counter()
        status = study_status(study)
        library = time.perf_counter() - t0
        assert status.cases == N and status.states["finished"] == FINISHED
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rescue.cli", "status", str(study)], cwd=ROOT, check=True,
                       capture_output=True)
        command = time.perf_counter() - t0
    print(f"rescue status, {N} cases ({FINISHED} finished, {FINISHED} receipts): "
          f"command {command:.2f} s (target < 1 s), library call {library:.2f} s")


if __name__ == "__main__":
    main()
