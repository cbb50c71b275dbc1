"""The study engine: claims cases from the journal and runs their arms.

The journal decides who runs what: a case is claimed (a committed
compare-and-set) before its first simulator reset, and a claimed case is
never handed out again. Workers are asyncio tasks behind a backend seam; a
case's two arms run concurrently on two simulator processes, each arm on its
own policy connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import structlog

from rescue.arm import ArmSpec, run_arm, run_forked
from rescue.classify import classify
from rescue.config import StudyConfig
from rescue.digest import digest_bytes
from rescue.env.pool import SimLease, SimPool
from rescue.evaluation import classify_episode
from rescue.journal import Journal
from rescue.manifest import Case, Manifest, write_manifest
from rescue.policy.ws_client import WebsocketPolicyClient
from rescue.querypoint import query_point
from rescue.records import ArmResult, Assistance, CaseRecord, Receipt, Verdict
from rescue.vlm.client import SubgoalRequest, VLMClient
from rescue.vlm.receipts import ReceiptLog, read_receipts
from wrappers.async_rules import AsyncRuleWrapper

log = structlog.get_logger()

CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.jsonl"
RECEIPTS_FILE = "receipts/receipts.jsonl"
FRAMES_DIR = "frames"


class StudyError(RuntimeError):
    """A study folder cannot be created, opened or resumed as asked."""


def new_study_dir(root: str | os.PathLike[str] = "queue") -> Path:
    """A fresh, unique study folder name under root."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(root) / f"study-{stamp}-{uuid.uuid4().hex[:6]}"


def create_study(study_dir: Path, manifest: Manifest, config: StudyConfig, extra_meta: dict | None = None) -> Journal:
    """Lay out a study folder: manifest copy, resolved config and its sha256, journal."""
    study_dir = Path(study_dir)
    if (study_dir / "journal.sqlite").exists():
        raise StudyError(f"{study_dir} already holds a study; use `rescue resume {study_dir}`")
    study_dir.mkdir(parents=True, exist_ok=True)
    (study_dir / "receipts").mkdir(exist_ok=True)
    write_manifest(manifest.cases, study_dir / MANIFEST_FILE)
    config_json = json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True)
    (study_dir / CONFIG_FILE).write_text(config_json + "\n", encoding="utf-8")
    meta = {
        "study_id": study_dir.name,
        "created_at": time.time(),
        "config_sha256": config.sha256(),
        "manifest_sha256": manifest.sha256,
        "manifest_source": str(manifest.source) if manifest.source else None,
        **(extra_meta or {}),
    }
    return Journal.create(study_dir, manifest.cases, meta)


def load_study_config(study_dir: Path) -> StudyConfig:
    """The configuration a study was created with."""
    return StudyConfig.model_validate_json((Path(study_dir) / CONFIG_FILE).read_text(encoding="utf-8"))


def case_record(case: Case, arms: dict[str, ArmResult], receipts: dict[str, Receipt], interval: int, interrupted: bool) -> CaseRecord:
    """Gather what classification needs for one case."""
    assisted = arms.get("assisted")
    receipt = None
    if assisted is not None and assisted.assistance.call_id:
        receipt = receipts.get(assisted.assistance.call_id)
    return CaseRecord(
        case_id=case.case_id,
        group=case.group,
        task=case.task,
        horizon=case.horizon,
        query_step=query_point(case.horizon, interval),
        historical_fingerprint=case.fingerprint,
        pilot=case.pilot,
        interrupted=interrupted,
        control=arms.get("control"),
        assisted=assisted,
        receipt=receipt,
    )


def is_evaluation(config: StudyConfig) -> bool:
    """An evaluation study runs the control arm only."""
    return tuple(config.arms) == ("control",)


def classify_any(
    config: StudyConfig, case: Case, arms: dict[str, ArmResult], receipts: dict[str, Receipt], interval: int, interrupted: bool
) -> Verdict:
    """Label a case: an episode label in an evaluation study, DESIGN §3 in a rescue study."""
    if is_evaluation(config):
        return classify_episode(case.case_id, arms.get("control"), interrupted)
    return classify(case_record(case, arms, receipts, interval, interrupted))


def receipt_line_sha256(receipt: Receipt) -> str:
    """The sha256 of the receipt's line as the receipt log wrote it (without the newline)."""
    return digest_bytes(receipt.model_dump_json().encode("utf-8"))


def outcome_receipts(path: Path) -> dict[str, Receipt]:
    """Outcome receipts of a study by call id."""
    if not path.exists():
        return {}
    return {r.call_id: r for r in read_receipts(path) if r.kind == "outcome"}


@dataclass
class Services:
    """The running peers of a study: policy URL, VLM client, simulator pool."""

    policy_url: str
    policy_api_key: str | None
    interval: int
    pool: SimPool
    vlm: VLMClient | None
    closers: list[Callable[[], Any]] = field(default_factory=list)


@contextlib.asynccontextmanager
async def start_services(config: StudyConfig, study_dir: Path) -> AsyncIterator[Services]:
    """Start what the config asks for (bundled policy server, local VLM endpoint, simulators)."""
    closers: list[Callable[[], Any]] = []
    try:
        policy_url = config.policy.url
        api_key = os.environ.get(config.policy.api_key_env) if config.policy.api_key_env else None
        if policy_url is None:
            from rescue.policy.bundled import serve_factory

            server = await serve_factory(config.policy.factory)
            closers.append(server.stop)
            policy_url = server.url
        probe = await WebsocketPolicyClient.connect(policy_url, api_key=api_key)
        interval = config.policy.replan_interval or int(probe.metadata.get("action_horizon", 0))
        await probe.close()
        if interval <= 0:
            raise StudyError("the policy server announced no action_horizon; set policy.replan_interval")
        vlm = None
        if "assisted" in config.arms:
            vlm_config = config.vlm
            if vlm_config.base_url == "local":
                from rescue.vlm.endpoint import start_endpoint

                runner, base_url = await start_endpoint()
                closers.append(runner.cleanup)
                vlm_config = vlm_config.model_copy(update={"base_url": base_url})
            vlm = VLMClient(vlm_config, ReceiptLog(study_dir / RECEIPTS_FILE))
            closers.append(vlm.aclose)
        pool = SimPool(config.env.simulators, config.env.adapter, log_path=str(study_dir / "simulator.log"))
        closers.append(pool.close)
        yield Services(policy_url, api_key, interval, pool, vlm, closers)
    finally:
        for close in reversed(closers):
            result = close()
            if asyncio.iscoroutine(result):
                await result


class Engine:
    """Runs the pending cases of one study until none is left or a drain is asked."""

    def __init__(self, study_dir: Path, config: StudyConfig, on_case: Callable[[Verdict], None] | None = None):
        self.study_dir = Path(study_dir)
        self.config = config
        self.journal = Journal.open(self.study_dir)
        self.on_case = on_case
        self._stop = asyncio.Event()
        self._receipts: dict[str, Receipt] = {}
        self._answers: dict[str, Receipt] = {}  # case id -> the outcome receipt its call returned

    def drain(self) -> None:
        """Stop claiming new cases; arms in flight finish."""
        self._stop.set()

    async def run(self) -> None:
        """Start services and workers; return when the queue is empty or drained."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            async with start_services(self.config, self.study_dir) as services:
                self.journal.set_meta("replan_interval", services.interval)
                workers = [
                    asyncio.create_task(self._worker(f"w{i}-{os.getpid()}", services))
                    for i in range(max(1, self.config.cases_in_flight))
                ]
                await asyncio.gather(*workers)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)

    def _classify(self, case: Case, arms: dict[str, ArmResult], interval: int, interrupted: bool) -> Verdict:
        return classify_any(self.config, case, arms, self._receipts, interval, interrupted)

    def _on_signal(self, sig: int) -> None:
        log.warning("study.draining", signal=signal.Signals(sig).name)
        self.drain()

    async def _worker(self, name: str, services: Services) -> None:
        while not self._stop.is_set() and not self.journal.draining():
            case = self.journal.claim_next(name)
            if case is None:
                return
            log.info("case.claimed", case_id=case.case_id, worker=name)
            await self._run_case(case, services)

    async def _run_case(self, case: Case, services: Services) -> None:
        if self.config.fork_at_q and not is_evaluation(self.config):
            arms = list(await self._run_forked(case, services))
        else:
            arms = await asyncio.gather(*(self._run_one_arm(case, arm, services) for arm in self.config.arms))
        by_arm = {r.arm: r for r in arms}
        if any(r.error and r.error.startswith("KeepaliveError") for r in arms):
            # The seed's rule: a policy whose connection or RNG moved during a wait cannot be
            # trusted for the next case either. This case stays (unknown); dispatch stops.
            log.error("study.draining", reason="keepalive failure", case_id=case.case_id)
            self.drain()
        index = None
        assisted = by_arm.get("assisted")
        call_id = assisted.assistance.call_id if assisted is not None else None
        if call_id:
            receipt = self._answers.pop(case.case_id, None)
            if receipt is None or receipt.call_id != call_id:
                self._receipts.update(outcome_receipts(self.study_dir / RECEIPTS_FILE))
                receipt = self._receipts.get(call_id)
            self._receipts[call_id] = receipt
            index = (call_id, RECEIPTS_FILE, receipt_line_sha256(receipt) if receipt is not None else None)
        verdict = self._classify(case, by_arm, services.interval, interrupted=False)
        # Arms, receipt index and verdict land in one transaction: a crash leaves the case
        # claimed with nothing recorded (resume makes it unknown), never half-finished.
        self.journal.finish_case(case.case_id, arms, verdict, index)
        log.info("case.classified", case_id=case.case_id, label=verdict.label, rule=verdict.rule, reason=verdict.reason)
        if self.on_case:
            self.on_case(verdict)

    def _spec_kwargs(self) -> dict:
        return dict(
            image_size=self.config.env.image_size,
            keepalive_s=self.config.keepalive_s,
            release_while_waiting=self.config.release_simulator_while_waiting,
            frame_sink=self._save_frame if self.config.keyframes else None,
        )

    def _save_frame(self, case_id: str, arm: str, name: str, pixels) -> str:
        """Store a keyframe as PNG in the study folder; return its sha256."""
        from rescue.vlm.client import encode_png

        data = encode_png(pixels)
        path = self.study_dir / FRAMES_DIR / case_id / f"{arm}-{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return digest_bytes(data)

    async def _connect(self, services: Services) -> AsyncRuleWrapper:
        client = await WebsocketPolicyClient.connect(services.policy_url, api_key=services.policy_api_key)
        # The configured correction rules sit between the policy and the simulator; firings go to the arm record.
        return AsyncRuleWrapper(client, self.config.rules)

    async def _run_one_arm(self, case: Case, arm: str, services: Services) -> ArmResult:
        spec = ArmSpec(arm=arm, interval=services.interval, **self._spec_kwargs())
        lease = await SimLease(services.pool).acquire()
        policy = None
        try:
            policy = await self._connect(services)
            advisor = self._advisor(services) if arm == "assisted" else None
            return await run_arm(case.model_dump(mode="json"), spec, lease, policy, advisor)
        except Exception as exc:
            return _infrastructure_error(case, arm, exc)
        finally:
            if policy is not None:
                await policy.close()
            lease.release()

    async def _run_forked(self, case: Case, services: Services) -> tuple[ArmResult, ArmResult]:
        leases: list[SimLease] = []
        policies: list[AsyncRuleWrapper] = []
        async def assisted_sim() -> SimLease:
            leases.append(await SimLease(services.pool).acquire())
            return leases[-1]

        try:
            policies.append(await self._connect(services))
            policies.append(await self._connect(services))
            leases.append(await SimLease(services.pool).acquire())
            return await run_forked(
                case.model_dump(mode="json"),
                services.interval,
                self._spec_kwargs(),
                (leases[0], policies[0]),
                (assisted_sim, policies[1]),
                self._advisor(services),
                control_done=leases[0].release,
            )
        except Exception as exc:
            return _infrastructure_error(case, "control", exc), _infrastructure_error(case, "assisted", exc)
        finally:
            for policy in policies:
                await policy.close()
            for lease in leases:
                lease.release()

    def _advisor(self, services: Services):
        vlm = services.vlm

        async def ask(case_id: str, instruction: str, remaining: int, views: dict) -> Any:
            answer = await vlm.ask(SubgoalRequest(case_id=case_id, instruction=instruction, remaining_steps=remaining, views=views))
            if answer.receipt is not None:
                self._answers[case_id] = answer.receipt
            return answer

        return ask if vlm is not None else None


def _infrastructure_error(case: Case, arm: str, exc: Exception) -> ArmResult:
    return ArmResult(
        case_id=case.case_id,
        arm=arm,
        status="error",
        error=f"{type(exc).__name__}: {exc}",
        assistance=Assistance(status="control" if arm == "control" else "not_reached"),
    )


def recover(study_dir: Path) -> list[str]:
    """Turn started-unfinished cases into `unknown` (reason: interrupted); return their ids."""
    study_dir = Path(study_dir)
    config = load_study_config(study_dir)
    journal = Journal.open(study_dir)
    try:
        interval = int(journal.meta().get("replan_interval") or 0) or None
        ids = journal.recover_interrupted()
        receipts = outcome_receipts(study_dir / RECEIPTS_FILE)
        for case_id in ids:
            case = journal.case(case_id)
            verdict = classify_any(config, case, journal.arms(case_id), receipts, interval or 1, interrupted=True)
            journal.set_verdict(case_id, verdict)
            log.info("case.classified", case_id=case_id, label=verdict.label, rule=verdict.rule, reason="interrupted")
        return ids
    finally:
        journal.close()


async def run_study(study_dir: Path, on_case: Callable[[Verdict], None] | None = None) -> None:
    """Run (or go on with) every never-claimed case of a study; then store its summary for verify."""
    from rescue.export import store_summary

    config = load_study_config(study_dir)
    engine = Engine(study_dir, config, on_case)
    try:
        await engine.run()
    finally:
        engine.journal.close()
    if not is_evaluation(config):
        store_summary(study_dir)


def complement_manifest(prior_study: Path) -> list[Case]:
    """The never-claimed cases of a prior study, in manifest order (a continuation's cohort)."""
    journal = Journal.open(prior_study)
    try:
        pending = set(journal.pending_ids())
        return [c for c in journal.cases() if c.case_id in pending]
    finally:
        journal.close()
