"""A study of failures and historical successes (DESIGN §17) built by the library's own writers, as the engine
builds one: two failures (one rescued), three sampled successes (one broken, one kept, one that ends before q);
no simulator runs. Shared by the read-side tests of harm (tests/test_harm_study.py) and the report in a browser."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import resolved_config
from helpers.study_builder import C, FP, H, Driver, applied, arm_result, receipt

from rescue.core.figures.success_sample import DESIGN, SamplingFrame, frame_tags
from rescue.core.manifest import parse_manifest
from rescue.core.records import Assistance
from rescue.run.recovery import recover
from rescue.study.folder import create_study, store_summary
from rescue.study.journal import Journal
from rescue.study.layout import RECEIPTS as RECEIPTS_FILE
from rescue.study.receipts import ReceiptLog

# Every failure of the evaluation (two), and an equal-probability sample of 3 of its 30 successes.
FRAME = SamplingFrame(failures=2, successes=30, sampled=3, seed=4, design=DESIGN)
TASK = SamplingFrame(failures=2, successes=30)
CASES = [("f-rescued", "failure"), ("f-both-fail", "failure"), ("s-broken", "success"), ("s-kept", "success"),
         ("s-early", "success")]


def build(study: Path) -> Path:
    lines = [dict(case_id=cid, suite="libero_spatial", task_id=0, init_state_index=i, env_seed=7, horizon=H,
                  group="spatial", fingerprint=FP, outcome=outcome, tags=frame_tags(FRAME, TASK))
             for i, (cid, outcome) in enumerate(CASES)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    create_study(study, parse_manifest(data, "manifest.jsonl", catalog=None), resolved_config(C))
    journal = Journal.open(study)
    log = ReceiptLog(study / RECEIPTS_FILE)
    drive = Driver(study, journal)
    plan = {"f-rescued": (False, True), "f-both-fail": (False, False), "s-broken": (True, False), "s-kept": (True, True)}
    for cid, (control_ok, assisted_ok) in plan.items():
        sub = f"Subgoal for {cid}."
        log.write(receipt("outcome", f"call-{cid}", [cid], "ok", {f"req-{cid}": sub}))
        a, i = applied(cid, f"call-{cid}", sub)
        drive.finish(cid, arm_result(cid, "control", success=control_ok, steps=150 if control_ok else H),
                     arm_result(cid, "assisted", success=assisted_ok, steps=170 if assisted_ok else H, assistance=a,
                                applied=i))
    # A success that ends before q: the assisted arm never asks (no call, no cost).
    drive.finish("s-early", arm_result("s-early", "control", success=True, steps=96),
                 arm_result("s-early", "assisted", success=True, steps=96, assistance=Assistance(status="not_reached")))
    log.close()
    journal.close()
    recover(study)
    store_summary(study)
    return study
