"""Study folders for the report tests, built from real records as the engine leaves them.

No simulator runs: like `test_export_verify.build_study`, a driver plays the engine's part
with the library's own writers (create_study, the receipt log, the journal's claim and
finish, the one classification dispatch), so the folder holds exactly what a run leaves:
three arms per case (control, assisted, a `permuted` or `fixed` sham), their traces and
per-query end-effector positions, keyframes in `frames/`, the views each VLM call saw
and its prompt and raw answer in `vlm/`. It scales to thousands of cases.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path

import numpy as np
from conftest import resolved_config
from PIL import Image

from rescue.core.digest import digest_array, digest_obs, digest_text
from rescue.core.images import VLM_VIEWS
from rescue.core.manifest import parse_manifest
from rescue.core.querypoint import query_point
from rescue.core.records import ArmResult, Assistance, QueryRecord, Receipt, Usage
from rescue.core.trace import TraceRow
from rescue.core.sham import ShamConfig
from rescue.study.folder import (
    SHAM_DONORS_KEY,
    classify_case,
    create_study,
    store_summary,
)
from rescue.study.journal import Journal
from rescue.study.layout import RECEIPTS, StudyLayout
from rescue.study.receipts import ReceiptLog, artifact_path
from wrappers.injection import inject

H, C = 220, 16
Q = query_point(H, C)  # 112
SUITES = ("libero_spatial", "libero_object", "libero_goal")
OBJECTS = ("bowl", "plate", "mug", "drawer", "basket", "ketchup", "cream cheese", "stove")
VERBS = ("Grasp", "Lift", "Push", "Open", "Center the gripper over", "Place")
FIXED_TEXT = "Continue with the task."


def png(rgb: tuple[int, int, int], size: int, mark: int) -> bytes:
    """A small smooth PNG, distinct per (colour, mark)."""
    y, x = np.mgrid[0:size, 0:size]
    img = np.stack([(x * 255 // size + rgb[0]) % 256, (y * 255 // size + rgb[1]) % 256,
                    np.full_like(x, rgb[2])], axis=-1).astype(np.uint8)
    img[(mark % size), :, :] = 255
    buf = io.BytesIO()
    Image.fromarray(img, mode="RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def instruction_of(task: str) -> str:
    return f"pick up the {OBJECTS[hash_int(task) % len(OBJECTS)]} and place it in the basket"


def hash_int(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def manifest_lines(n: int, pilots: int = 2) -> list[dict]:
    """n cases over three suites and ten tasks each, one episode per case; the first `pilots` are pilots."""
    lines = []
    for i in range(n):
        suite = SUITES[i % 3]
        task_id = (i // 3) % 10
        lines.append(dict(
            case_id=f"{suite.split('_')[1]}-{task_id}-ep{i // 30}", suite=suite, task_id=task_id,
            init_state_index=i // 30, env_seed=7, horizon=H, group=suite.split("_")[1], pilot=i < pilots,
            fingerprint=digest_text("initial state"),
        ))
    return lines


def _trace(case_id: str, arm: str, end: int, original: str, applied: str | None) -> list[TraceRow]:
    rows = []
    for step in range(0, end, C):
        tag = "shared" if step < Q else arm
        obs = {"state": np.full(8, step, np.float32), "tag": np.frombuffer(f"{case_id}{tag}".encode(), np.uint8)}
        instruction = applied if (applied is not None and step >= Q) else original
        chunk = np.full((C, 7), step / 1000.0 + (0.5 if tag != "shared" else 0.0), np.float32)
        rows.append(TraceRow(
            step=step, state=digest_obs(obs),
            images={"agentview": digest_array(np.full((4, 4, 3), step % 255, np.uint8))},
            instruction=digest_text(instruction), actions=digest_array(chunk),
        ))
    return rows


def _queries(case_id: str, arm: str, end: int) -> list[QueryRecord]:
    """The end effector moves toward an object, the same way in every arm before q, its own way after."""
    shared = random.Random(case_id)
    own = random.Random(f"{case_id}/{arm}")
    target = np.array([shared.uniform(-0.2, 0.2), shared.uniform(-0.2, 0.2), 0.9])
    pos = np.array([0.0, 0.0, 1.15])
    out = []
    for step in range(0, end, C):
        rng = shared if step < Q else own
        pos = pos + 0.15 * (target - pos) + np.array([rng.gauss(0, 0.01), rng.gauss(0, 0.01), rng.gauss(0, 0.005)])
        if step >= Q and arm != "control":
            target = target + np.array([own.uniform(-0.01, 0.01), own.uniform(-0.01, 0.01), 0.0])
        out.append(QueryRecord(step=step, stage=0 if step < Q else 1, ee_pos=tuple(round(float(v), 5) for v in pos)))
    return out


class Builder:
    """Plays the engine over one study folder."""

    def __init__(self, study: Path, n: int, sham: str, seed: int, pilots: int, batch_every: int, vlm: dict | None = None,
                 call_every_s: float = 1.0):
        self.study, self.n, self.sham, self.batch_every = study, n, sham, batch_every
        self.call_every_s = call_every_s
        self.rng = random.Random(seed)
        lines = manifest_lines(n, pilots)
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        self.manifest = parse_manifest(data, "manifest.jsonl", catalog=None)
        fields = {} if sham == "off" else {"sham": ShamConfig(source=sham, text=FIXED_TEXT, seed=seed)}
        vlm = {"base_url": "https://vlm.example.org:8443/v1", "model": "qwen2.5-vl-7b", "temperature": 0.0,
               "max_output_tokens": 256, "seed": 3, **(vlm or {})}
        self.config = resolved_config(C, vlm=vlm, **fields)
        create_study(study, self.manifest, self.config)
        self.layout = StudyLayout.of(study)
        self.layout.vlm_artifacts.mkdir(exist_ok=True)
        self.journal = Journal.open(study)
        self.donors = dict(self.journal.meta().get(SHAM_DONORS_KEY) or {})

    def keep(self, data: bytes, suffix: str) -> str:
        sha = _sha(data)
        path = artifact_path(self.layout.vlm_artifacts, sha, suffix)
        if not path.exists():
            path.write_bytes(data)
        return sha

    def frame(self, case_id: str, arm: str, name: str, data: bytes) -> str:
        path = self.layout.keyframe(case_id, arm, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return _sha(data)

    def plan(self) -> dict[str, str]:
        """Each case's scenario, drawn once: what its arms will do."""
        kinds = {}
        for case in self.manifest.cases:
            r = self.rng.random()
            kinds[case.case_id] = (
                "rescued" if r < 0.07 else "control_wins" if r < 0.15 else "timeout" if r < 0.18
                else "deviates" if r < 0.20 else "not_reached" if r < 0.22 else "crashed" if r < 0.23 else "fails"
            )
        return kinds

    def calls(self, kinds: dict[str, str], log: ReceiptLog) -> dict[str, tuple[Receipt, object]]:
        """One VLM call per case that reached q (every `batch_every`-th pair batched on one contact sheet)."""
        asking = [c for c in self.manifest.cases if kinds[c.case_id] not in ("not_reached", "crashed")]
        groups: list[list] = []
        i = 0
        while i < len(asking):
            size = 2 if self.batch_every and (len(groups) % self.batch_every == 1) and i + 1 < len(asking) else 1
            groups.append(asking[i:i + size])
            i += size
        out = {}
        for g, cases in enumerate(groups):
            call_id = f"call-{g:05d}"
            status = "timeout" if kinds[cases[0].case_id] == "timeout" else "ok"
            rids = [f"req-{c.case_id}" for c in cases]
            views = {}
            for c in cases:
                tone = hash_int(c.case_id)
                views[f"req-{c.case_id}"] = [self.keep(png((tone % 256, v * 80, (tone >> 8) % 256), 96, v), ".png")
                                             for v in range(len(VLM_VIEWS))]
            sent = views[rids[0]] if len(cases) == 1 else [self.keep(png((g % 256, 40, 200), 192, g), ".png")]
            subgoals = {}
            if status == "ok":
                for c in cases:
                    rr = random.Random(c.case_id)
                    subgoals[f"req-{c.case_id}"] = f"{rr.choice(VERBS)} the {rr.choice(OBJECTS)} near the {rr.choice(OBJECTS)}."
            prompt = f"prompt {call_id}: you see {len(cases)} case(s); give one subgoal each.\n" + "\n".join(
                f"{c.case_id}: {instruction_of(c.task)}" for c in cases)
            response = json.dumps({"answers": [{"id": r, "subgoal": s} for r, s in subgoals.items()]})
            receipt = Receipt(
                kind="outcome", call_id=call_id, attempt=1 if status == "ok" else 3, request_ids=rids,
                tokens={r: f"tok-{r}" for r in rids}, case_ids=[c.case_id for c in cases],
                model_requested=self.config.vlm.model, model_reported=self.config.vlm.model if status == "ok" else None,
                endpoint_kind="chat", prompt_template="subgoal_v1", prompt_template_sha256=digest_text("template"),
                prompt_sha256=self.keep(prompt.encode(), ".txt"), image_sha256=views, sent_image_sha256=sent,
                started_at=1000.0 + g * self.call_every_s, latency_s=1.2 + (g % 7) * 0.3,
                finished_at=1000.0 + g * self.call_every_s + 1.2 + (g % 7) * 0.3,
                status=status, error_kind=None if status == "ok" else "timeout",
                usage=Usage(input_tokens=900 * len(cases), output_tokens=30 * len(cases)) if status == "ok" else Usage(),
                response_sha256=self.keep(response.encode(), ".txt") if status == "ok" else None,
                subgoals=subgoals, request_status={r: status for r in rids},
                generation=self.config.vlm.generation(),
            )
            ref = log.write(receipt)
            for c in cases:
                out[c.case_id] = (receipt, ref)
        return out

    def arm(self, case, arm: str, success: bool, steps: int, assistance: Assistance, fingerprint: str) -> ArmResult:
        original = instruction_of(case.task)
        applied = assistance.instruction if assistance.status == "applied" else None
        tone = hash_int(f"{case.case_id}/{arm}")
        keyframes = {}
        if steps > Q:
            keyframes[f"q{Q}"] = self.frame(case.case_id, arm, f"q{Q}", png((hash_int(case.case_id) % 256, 90, 60), 128, Q))
        keyframes["end"] = self.frame(case.case_id, arm, "end", png((tone % 256, 160, 30), 128, steps))
        return ArmResult(
            case_id=case.case_id, arm=arm, status="complete", success=success, steps=steps, fingerprint=fingerprint,
            trace=_trace(case.case_id, arm, steps, original, applied), assistance=assistance,
            keyframes=keyframes, queries=_queries(case.case_id, arm, steps), started_at=1000.0, finished_at=1100.0,
        )

    def assistance(self, case, arm: str, receipt: Receipt | None, ref, request_id: str | None, **source) -> Assistance:
        if receipt is None or receipt.status != "ok":
            return Assistance(status="timeout" if receipt is not None else "broker_error", query_step=Q,
                              call_id=receipt.call_id if receipt else None, request_id=request_id, receipt_ref=ref if receipt else None,
                              error_kind="timeout" if receipt is not None else "donor_failed", **source)
        subgoal = receipt.subgoals[request_id]
        instruction = inject(instruction_of(case.task), subgoal)
        return Assistance(status="applied", query_step=Q, subgoal=subgoal, instruction=instruction,
                          instruction_digest=digest_text(instruction), call_id=receipt.call_id, request_id=request_id,
                          receipt_ref=ref, **source)

    def run(self) -> Path:
        kinds = self.plan()
        log = ReceiptLog(self.study / RECEIPTS, name=RECEIPTS)
        calls = self.calls(kinds, log)
        log.close()
        by_call = {r.call_id: r for r, _ in calls.values()}
        fp = digest_text("initial state")
        for case in self.manifest.cases:
            cid, kind = case.case_id, kinds[case.case_id]
            assert self.journal.claim(cid, "w0")
            if kind == "crashed":
                continue  # claimed, never finished: the recovery below makes it interrupted
            if kind == "not_reached":
                # The episode ended (in success) before q in both arms: nothing was asked.
                arms = {name: self.arm(case, name, True, 96, Assistance(status="control" if name == "control" else "not_reached"), fp)
                        for name in self.config.arms}
            else:
                receipt, ref = calls[cid]
                control_ok = kind == "control_wins"
                assisted_ok = kind in ("rescued", "deviates") or (kind == "fails" and self.rng.random() < 0.02)
                a = self.assistance(case, "assisted", receipt, ref, f"req-{cid}", source="vlm")
                arms = {
                    "control": self.arm(case, "control", control_ok, 144 if control_ok else H, Assistance(status="control"), fp),
                    "assisted": self.arm(case, "assisted", assisted_ok and a.status == "applied",
                                         176 if assisted_ok and a.status == "applied" else H, a,
                                         digest_text("another state") if kind == "deviates" else fp),
                }
                if "sham" in self.config.arms:
                    sham_ok = self.rng.random() < 0.06
                    if self.sham == "fixed":
                        text = self.config.sham.text_for(case.task)
                        instruction = inject(instruction_of(case.task), text)
                        s = Assistance(status="applied", query_step=Q, subgoal=text, instruction=instruction,
                                       instruction_digest=digest_text(instruction), source="fixed", source_sha256=digest_text(text))
                    else:
                        donor = self.donors[cid]
                        d_receipt, d_ref = calls.get(donor, (None, None))
                        s = self.assistance(case, "sham", d_receipt, d_ref, f"req-{donor}", source="permuted", donor_case_id=donor)
                    arms["sham"] = self.arm(case, "sham", sham_ok and s.status == "applied", 160 if sham_ok else H, s, fp)
            receipts = {}
            for arm in arms.values():
                if arm.assistance.call_id and arm.assistance.receipt_ref is not None:
                    receipts[arm.assistance.call_id] = by_call[arm.assistance.call_id]
            verdict = classify_case(self.config, case, arms, receipts, interrupted=False, donors=self.donors)
            a = arms.get("assisted")
            index = (a.assistance.call_id, RECEIPTS, a.assistance.receipt_ref.sha256) if a and a.assistance.receipt_ref else None
            self.journal.finish_case(cid, list(arms.values()), verdict, index)
        self.journal.close()
        from rescue.run.recovery import recover

        recover(self.study)
        store_summary(self.study)
        return self.study


def build_report_study(study: Path, n: int, *, sham: str = "permuted", seed: int = 0, pilots: int = 2,
                       batch_every: int = 25, vlm: dict | None = None, call_every_s: float = 1.0) -> Path:
    """A finished study of n cases (three arms with a `permuted` or `fixed` sham, or two with `off`); `vlm`:
    settings over the study's default `[vlm]` (a price, another model or endpoint); calls start `call_every_s`
    apart."""
    return Builder(Path(study), n, sham, seed, pilots, batch_every, vlm, call_every_s).run()
