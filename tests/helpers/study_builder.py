"""A study folder built as the engine builds one (claims, arms, receipts with their line sha256, verdicts), with
eight cases that cover the labels, a crashed case and a pilot; and the records it is built from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from conftest import resolved_config

from rescue.core.classify import classify
from rescue.core.digest import digest_array, digest_obs, digest_text
from rescue.core.manifest import parse_manifest
from rescue.core.querypoint import query_point
from rescue.core.records import ArmResult, Assistance, Receipt, Usage
from rescue.core.trace import TraceRow
from rescue.read.verify import outcome_line_sha256
from rescue.run.recovery import recover
from rescue.study.folder import case_record, create_study, outcome_receipts, store_summary
from rescue.study.journal import Journal
from rescue.study.layout import RECEIPTS as RECEIPTS_FILE
from rescue.study.receipts import ReceiptLog, read_receipts
from wrappers.injection import inject


H, C = 220, 16
Q = query_point(H, C)  # 112
FP = digest_text("initial state")
TASK_INSTRUCTION = "pick up the black bowl and place it on the plate"


# --- building a study like the engine does -------------------------------------


def manifest_lines() -> list[dict]:
    base = dict(suite="libero_spatial", env_seed=7, horizon=H)
    # Each case its own episode (a manifest refuses one episode under two ids).
    return [dict(line, init_state_index=i) for i, line in enumerate(_lines(base))]


def _lines(base: dict) -> list[dict]:
    return [
        # Given instructions and fingerprints for some cases, none for others:
        # verify must re-derive the original instruction either way.
        dict(base, case_id="rescued-1", task_id=0, group="spatial", instruction=TASK_INSTRUCTION, fingerprint=FP),
        dict(base, case_id="assisted-fails", task_id=0, group="spatial"),
        dict(base, case_id="control-wins", task_id=1, group="spatial", fingerprint=FP),
        dict(base, case_id="vlm-timeout", task_id=1, group="object"),
        dict(base, case_id="deviates", task_id=2, group="object", fingerprint=digest_text("another state")),
        dict(base, case_id="crashed", task_id=2, group="object"),
        dict(base, case_id="never-started", task_id=3, group="object"),
        dict(base, case_id="pilot-1", task_id=3, group="object", pilot=True),
    ]


def trace(case_id: str, arm: str, end: int, applied: str | None = None) -> list[TraceRow]:
    """One row per query at 0, C, 2C, ...; rows before Q are the same in both arms."""
    rows = []
    for step in range(0, end, C):
        tag = "shared" if step < Q else arm
        obs = {"state": np.full(8, step, np.float32), "tag": np.frombuffer(f"{case_id}{tag}".encode(), np.uint8)}
        instruction = applied if (applied is not None and step >= Q) else TASK_INSTRUCTION
        chunk = np.full((C, 7), step / 1000.0 + (0.5 if tag == "assisted" else 0.0), np.float32)
        rows.append(
            TraceRow(
                step=step,
                state=digest_obs(obs),
                images={"agentview": digest_array(np.full((4, 4, 3), step % 255, np.uint8))},
                instruction=digest_text(instruction),
                actions=digest_array(chunk),
            )
        )
    return rows


def receipt(kind: str, call_id: str, cases: list[str], status: str, subgoals: dict | None = None) -> Receipt:
    request_ids = [f"req-{c}" for c in cases]
    return Receipt(
        kind=kind,
        call_id=call_id,
        attempt=1,
        request_ids=request_ids,
        tokens={r: f"tok-{r}" for r in request_ids},
        case_ids=cases,
        model_requested="qwen2.5-vl-7b",
        model_reported="qwen2.5-vl-7b" if status == "ok" else None,
        endpoint_kind="chat",
        prompt_template="subgoal",
        prompt_template_sha256=digest_text("template"),
        prompt_sha256=digest_text(f"prompt {call_id}"),
        started_at=1000.0,
        finished_at=1001.5,
        latency_s=1.5,
        status=status,
        error_kind=None if status == "ok" else status,
        usage=Usage(input_tokens=900, output_tokens=40) if status == "ok" else Usage(),
        response_sha256=digest_text(f"response {call_id}") if status == "ok" else None,
        subgoals=subgoals or {},
        request_status={r: status for r in request_ids},
    )


def arm_result(case_id: str, arm: str, *, success: bool, steps: int, fingerprint: str = FP,
               assistance: Assistance | None = None, applied: str | None = None) -> ArmResult:
    return ArmResult(
        case_id=case_id,
        arm=arm,
        status="complete",
        success=success,
        steps=steps,
        fingerprint=fingerprint,
        trace=trace(case_id, arm, steps, applied),
        assistance=assistance or Assistance(status="control"),
        started_at=1000.0,
        finished_at=1100.0,
    )


def applied(case_id: str, call_id: str, subgoal: str) -> tuple[Assistance, str]:
    instruction = inject(TASK_INSTRUCTION, subgoal)
    return Assistance(
        status="applied", query_step=Q, subgoal=subgoal, instruction=instruction,
        instruction_digest=digest_text(instruction), call_id=call_id, request_id=f"req-{case_id}",
    ), instruction


class Driver:
    """Plays the engine: claim, record arms, index receipts with their line sha256, classify, finish."""

    def __init__(self, study: Path, journal: Journal):
        self.study, self.journal = study, journal

    def finish(self, case_id: str, *arms: ArmResult) -> None:
        journal = self.journal
        assert journal.claim(case_id, "w0")
        by_arm = {a.arm: a for a in arms}
        call_id = by_arm["assisted"].assistance.call_id if "assisted" in by_arm else None
        path = self.study / RECEIPTS_FILE
        index = (call_id, RECEIPTS_FILE, outcome_line_sha256(path, call_id)) if call_id else None
        rec = case_record(journal.case(case_id), by_arm, outcome_receipts(path), resolved_config(C), interrupted=False)
        # As the engine does: arms, receipt index and verdict in one transaction.
        journal.finish_case(case_id, arms, classify(rec), index)


def build_study(study: Path) -> Path:
    data = "".join(json.dumps(line) + "\n" for line in manifest_lines()).encode()
    manifest = parse_manifest(data, "manifest.jsonl", catalog=None)
    create_study(study, manifest, resolved_config(C))
    journal = Journal.open(study)
    log = ReceiptLog(study / RECEIPTS_FILE)
    drive = Driver(study, journal)

    # One batched call answers two cases, as the client does with a contact sheet.
    sub1, sub2 = "Grasp the bowl by its rim.", "Lift the bowl above the plate."
    log.write(receipt("attempt", "call-a", ["rescued-1", "assisted-fails"], "ok"))
    log.write(receipt("outcome", "call-a", ["rescued-1", "assisted-fails"], "ok",
                      {"req-rescued-1": sub1, "req-assisted-fails": sub2}))
    a1, i1 = applied("rescued-1", "call-a", sub1)
    drive.finish(
        "rescued-1",
        arm_result("rescued-1", "control", success=False, steps=H),
        arm_result("rescued-1", "assisted", success=True, steps=176, assistance=a1, applied=i1),
    )
    a2, i2 = applied("assisted-fails", "call-a", sub2)
    drive.finish(
        "assisted-fails",
        arm_result("assisted-fails", "control", success=False, steps=H),
        arm_result("assisted-fails", "assisted", success=False, steps=H, assistance=a2, applied=i2),
    )
    sub3 = "Open the gripper over the plate."
    log.write(receipt("outcome", "call-b", ["control-wins"], "ok", {"req-control-wins": sub3}))
    a3, i3 = applied("control-wins", "call-b", sub3)
    drive.finish(
        "control-wins",
        arm_result("control-wins", "control", success=True, steps=144),
        arm_result("control-wins", "assisted", success=False, steps=H, assistance=a3, applied=i3),
    )
    log.write(receipt("outcome", "call-c", ["vlm-timeout"], "timeout"))
    drive.finish(
        "vlm-timeout",
        arm_result("vlm-timeout", "control", success=False, steps=H),
        arm_result("vlm-timeout", "assisted", success=False, steps=H, assistance=Assistance(
            status="timeout", query_step=Q, call_id="call-c", request_id="req-vlm-timeout", error_kind="timeout")),
    )
    sub4 = "Push the bowl toward the plate."
    log.write(receipt("outcome", "call-d", ["deviates"], "ok", {"req-deviates": sub4}))
    a4, i4 = applied("deviates", "call-d", sub4)
    drive.finish(
        "deviates",
        arm_result("deviates", "control", success=False, steps=H),
        arm_result("deviates", "assisted", success=True, steps=200, assistance=a4, applied=i4),
    )
    sub5 = "Center the gripper over the bowl."
    log.write(receipt("outcome", "call-e", ["pilot-1"], "ok", {"req-pilot-1": sub5}))
    a5, i5 = applied("pilot-1", "call-e", sub5)
    drive.finish(
        "pilot-1",
        arm_result("pilot-1", "control", success=False, steps=H),
        arm_result("pilot-1", "assisted", success=True, steps=192, assistance=a5, applied=i5),
    )
    # A worker dies while its arms run (nothing of a case lands before its verdict): resume's
    # recovery makes it interrupted.
    assert journal.claim("crashed", "w1")
    log.close()
    # What each call saw and answered (DESIGN §9), kept as the client keeps it: named by sha256.
    for r in read_receipts(study / RECEIPTS_FILE):
        if r.kind == "outcome":
            for text in (f"prompt {r.call_id}", f"response {r.call_id}"):
                if digest_text(text) not in (r.prompt_sha256, r.response_sha256):
                    continue  # a call without a response keeps none (a timeout)
                (study / "vlm").mkdir(exist_ok=True)
                (study / "vlm" / f"{digest_text(text)}.txt").write_text(text, encoding="utf-8")
    journal.close()
    recover(study)
    store_summary(study)
    return study
