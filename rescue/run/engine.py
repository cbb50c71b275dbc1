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
import os
import signal
from pathlib import Path
from typing import Any, Awaitable, Callable

import structlog

from rescue.core.configuration.config import StudyConfig
from rescue.core.digest import digest_bytes
from rescue.core.failfast import FailFast, error_line, one_line, sampling_without_control
from rescue.core.manifest import Case
from rescue.core.observation import get_profile
from rescue.core.records import Answer, ArmResult, Assistance
from rescue.core.verdicts import Verdict
from rescue.core.arms import advisor_arm, answered_at_q, base_arm, is_assisted
from rescue.core.sham import donor_group
from rescue.env.backend import LOCAL, Backend
from rescue.env.pool import SimLease, SimulatorError
from rescue.run.arm import ArmSpec, run_arm
from rescue.run.fork import Follower, run_forked
from rescue.run.observer import RunObserver, as_observer
from rescue.run.peers import Peers, start_peers
from rescue.run.sham import ShamSource
from rescue.run.stopping import StopRule
from rescue.study.folder import SHAM_DONORS_KEY, classify_case, load_study_config, store_summary
from rescue.study.journal import STOP_REASON_KEY, STOPPED_NOW_KEY, Journal
from rescue.study.layout import StudyLayout
from rescue.study.ledger import BudgetReached, Hold
from rescue.study.receipts import OutcomeIndex
from rescue.vlm.answers import SubgoalRequest
from rescue.vlm.client import VLMClient
from wrappers.async_rules import AsyncRuleWrapper
from rescue.run.recovery import settle

log = structlog.get_logger()


class Engine:
    """Runs the pending cases of one study until none is left or a drain is asked."""

    def __init__(
        self,
        study_dir: Path,
        config: StudyConfig,
        peers: Peers,
        on_case: RunObserver | Callable[[Verdict], None] | None = None,
    ):
        self.layout = StudyLayout.of(study_dir)
        self.config = config
        self.peers = peers
        self.journal = Journal.open(self.layout.root)
        self.observer = as_observer(on_case)
        self.profile = get_profile(config.policy.observation or "privileged")
        self.protocol = config.env.protocol()
        self.study_id = str(self.journal.meta().get("study_id") or "rescue")
        self._failfast = FailFast(config.fail_fast_arms)
        # The sham arm's declared donors, and where its subgoals come from: the fixed text, or the donor
        # advisor's answers (the declared donor advisor's, else the primary's).
        self.donors: dict[str, str] = dict(self.journal.meta().get(SHAM_DONORS_KEY) or {})
        self._donor_arm = advisor_arm(config.sham_donor_advisor) if config.advisors else "assisted"
        self.sham = ShamSource(config.sham, self.donors, self.journal, self._donor_arm, self._stopping)
        self._stop = asyncio.Event()
        # Signals so far (the first drains, the second stops now) and the workers a second one cancels.
        self._signals: list[str] = []
        self._workers: list[asyncio.Task] = []
        # The outcome lines the VLM client wrote, read back by the one receipts reader.
        self._outcomes = OutcomeIndex(self.layout.receipts)
        # A `[stopping]` rule: cases claimed in the order fixed at creation, the rule checked after each.
        self.rule = StopRule(self.journal, config) if config.stopping is not None else None

    def drain(self) -> None:
        """Stop claiming new cases; arms in flight finish."""
        self._stop.set()

    async def run(self) -> None:
        """Run workers until the queue is empty or drained.

        A first SIGINT or SIGTERM stops claiming and lets the arms in flight finish; a second
        stops them now: their cases are recorded `unknown` (interrupted), never run again."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            if self.rule is not None and (self.rule.decided() is not None or self.rule.check() is not None):
                self._decided()  # a resume of a study its rule stopped: nothing more to claim
            pending = set(self.journal.pending_ids())
            horizons = sum(c.horizon for c in self.journal.cases() if c.case_id in pending)
            arms = len(self.config.case_arms)
            self.observer.study_started(len(pending), arms, horizons * arms)
            self._workers = [
                asyncio.create_task(self._worker(f"w{i}-{os.getpid()}", self.peers))
                for i in range(max(1, self.config.cases_in_flight))
            ]
            await asyncio.wait(self._workers)
            if len(self._signals) > 1:
                self._stopped_now()
            else:
                for worker in self._workers:
                    worker.result()  # a worker's own failure is the run's
                if self._signals:
                    self.journal.set_meta(STOP_REASON_KEY, f"{self._signals[0]} stopped it claiming; the arms in flight finished")
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        self._signals.append(name)
        if len(self._signals) == 1:
            log.warning("study.draining", signal=name)
            self.journal.set_meta(STOP_REASON_KEY, f"{name} stopped it claiming; arms were in flight")
            self.observer.stopping(f"{name}: no new case is claimed; the arms in flight finish "
                                   f"(send it again to stop them now: their cases become unknown)")
            self.drain()
            return
        if len(self._signals) == 2:
            log.warning("study.stopping_now", signal=name)
            self.observer.stopping(f"{name} again: stopping the arms in flight now; their cases become unknown (interrupted)")
            self.drain()
            for worker in self._workers:
                worker.cancel()

    def _stopped_now(self) -> None:
        """After a second signal: the cases the cancelled arms held become unknown (interrupted)."""
        reason = f"interrupted: a second {self._signals[1]} stopped its arms"
        ids = settle(self.journal, self.config, self.layout.receipts, reason)
        listed = f": {', '.join(ids)}" if ids else ""
        self.journal.set_meta(
            STOP_REASON_KEY,
            f"a second {self._signals[1]} stopped it at once; {len(ids)} case(s) in flight were recorded unknown (interrupted){listed}",
        )
        self.journal.set_meta(STOPPED_NOW_KEY, ids)

    def _stopping(self) -> bool:
        return self._stop.is_set() or self.journal.draining()

    def stop_study(self, reason: str) -> None:
        """Stop claiming for a reason the user must act on; it is kept in the journal and printed."""
        if not self._stopping():
            log.error("study.stopped", reason=reason)
            self.journal.set_meta(STOP_REASON_KEY, reason)
            self.journal.request_drain()
        self.drain()

    async def _worker(self, name: str, peers: Peers) -> None:
        # A case is claimed only with a simulator and a policy connection in hand, immediately
        # before its first reset: a crash never leaves a case that had not begun marked started,
        # and an unreachable policy server stops the study instead of consuming its queue.
        while not self._stopping():
            try:
                lease = await self._unless_stopped(SimLease(peers.pool).acquire(urgent=False))
            except SimulatorError as exc:  # no simulator can be had any more (a Ray cluster without room)
                self.stop_study(f"{one_line(str(exc))}; then `rescue resume` runs the cases never started")
                return
            if lease is None:  # a signal came while it waited for a simulator (a Ray cluster still busy)
                return
            policy = hold = None
            try:
                if self._stopping():
                    return
                url = peers.next_policy_url()
                try:
                    policy = await self._connect(peers, url)
                except Exception as exc:
                    self.stop_study(
                        f"the policy server at {url} is unreachable ({type(exc).__name__}: "
                        f"{one_line(str(exc))}); start it (one that takes longer to start: raise [policy] "
                        f"connect_timeout_s, now {peers.policy_connect_s:g} s), then `rescue resume` runs the cases "
                        "never started"
                    )
                    return
                hold = await self._hold(peers)
                if self._stopping():
                    return
                # A case of a task this simulator loaded, when one is pending: its env is likely still built
                # (under a rule, the next in its fixed order: stopping never selects cases).
                case = (self.rule.claim(name) if self.rule is not None
                        else self.journal.claim_next(name, prefer=lease.sim.loaded_tasks() if lease.sim else ()))
                if case is None:
                    return
                if hold is not None:
                    hold.bind(case.case_id)
                log.info("case.claimed", case_id=case.case_id, worker=name)
                held, lease, policy = (lease, policy), None, None  # the case's first arm owns them now
                # A permuted sham arm waits for its donor's answer: the donor group starts together.
                partners = [
                    asyncio.create_task(self._run_partner(member, name, peers))
                    for member in donor_group(self.donors, case.case_id)[1:]
                    if self.config.sham.source == "permuted"
                ]
                await self._run_case(case, peers, held)
                await asyncio.gather(*partners)
            finally:
                if hold is not None:
                    hold.release()
                if policy is not None:
                    await policy.close()
                if lease is not None:
                    lease.release()

    async def _hold(self, peers: Peers) -> Hold | None:
        """Hold the next case's VLM calls on the lab budget (None: no budget, or the run stops claiming); when
        they would pass the cap the study stops claiming, with the reason."""
        if peers.budget is None:
            return None
        try:
            return await peers.budget.hold(self._stopping)
        except BudgetReached as exc:
            if self.journal.counts().get("pending", 0):
                self.stop_study(str(exc))  # else every case is claimed already: nothing was refused
            return None

    async def _unless_stopped(self, wait: Awaitable[Any]) -> Any:
        """What `wait` gives, or None when the run stops claiming first (a signal, a stop_study)."""
        task = asyncio.ensure_future(wait)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})  # let the given-up wait unwind
        if task.cancelled():
            return None
        return task.result()

    async def _run_partner(self, case_id: str, worker: str, peers: Peers) -> None:
        """Claim and run a donor-group member if nobody has: a simulator and a connection in hand first."""
        if self.journal.state(case_id) != "pending":
            return
        # Urgent: a sham arm of a started case waits for this donor's answer.
        member = self.journal.case(case_id)
        lease = await SimLease(peers.pool, task=(member.suite, member.task_id)).acquire()
        policy = hold = None
        try:
            policy = await self._connect(peers)
            hold = await self._hold(peers)
            if self._stopping() or not self.journal.claim(case_id, worker):
                return
            if hold is not None:
                hold.bind(case_id)
            log.info("case.claimed", case_id=case_id, worker=worker, with_donor_group=True)
            held, lease, policy = (lease, policy), None, None
            await self._run_case(member, peers, held)
        except Exception as exc:  # the member stays pending (never claimed); its waiters learn it when the study stops
            log.warning("case.partner_not_started", case_id=case_id, error=one_line(str(exc)))
        finally:
            if hold is not None:
                hold.release()
            if policy is not None:
                await policy.close()
            if lease is not None:
                lease.release()

    async def _run_case(self, case: Case, peers: Peers, held: tuple[SimLease, AsyncRuleWrapper]) -> None:
        if self.config.forked:
            arms = list(await self._run_forked(case, peers, held))
        else:
            arms = await asyncio.gather(
                *(self._run_one_arm(case, arm, peers, held if i == 0 else None) for i, arm in enumerate(self.config.arms))
            )
        by_arm = {r.arm: r for r in arms}
        idle = next((r.error for r in arms if r.error and r.error.startswith("RulesCannotFire")), None)
        if idle is not None:
            self.stop_study(f"an enabled rule cannot fire on this policy's replies ({idle.split(': ', 1)[-1]}); "
                            "fix [rules] (or set allow_idle_rules = true to run anyway)")
        if any(r.error and r.error.startswith("KeepaliveError") for r in arms):
            # The seed's rule: a policy whose connection or RNG moved during a wait cannot be
            # trusted for the next case either. This case stays (unknown); dispatch stops.
            self.stop_study(f"case {case.case_id}: the policy connection or its RNG changed during a VLM wait; "
                            "check the policy server (rescue preflight), then `rescue resume`")
        index, receipts = [], {}
        for name, arm in by_arm.items():
            if not answered_at_q(name):
                continue
            for call in arm.calls():
                ref = call.receipt_ref
                if ref is None:
                    continue
                # The outcome line this call's reference names, read back by the one receipts reader.
                line = self._outcomes.outcome(call.call_id or "")
                if line is not None and (line.lineno, line.sha256) == (ref.lineno, ref.sha256):
                    receipts[line.receipt.call_id] = line.receipt
                if is_assisted(name):
                    index.append((call.call_id, ref.path, ref.sha256))
        verdict = classify_case(self.config, case, by_arm, receipts, interrupted=False, donors=self.donors)
        # Each arm was recorded as it ended; the rest of them, the receipt index and the verdict land in one
        # transaction: a crash leaves the case claimed with the arms that ended (resume makes it unknown,
        # keeping them), never finished without its verdict.
        self.journal.finish_case(case.case_id, arms, verdict, index)
        log.info("case.classified", case_id=case.case_id, label=verdict.label, rule=verdict.rule, reason=verdict.reason)
        self.observer.case_finished(verdict)
        cause = self._failfast.observe(list(arms))
        if cause is None and not self.config.forked:
            # Every later case would end unknown alike (DESIGN §13): say why now.
            cause = sampling_without_control(list(arms))
        if cause is not None:
            self.stop_study(cause)
        if self.rule is not None and self.rule.check() is not None:
            self._decided()

    def _decided(self) -> None:
        """The rule decided: stop claiming; the cases in flight finish and count (DESIGN §20)."""
        decision = self.rule.decided() if self.rule is not None else None
        if decision is None or self._stop.is_set():
            self.drain()
            return
        log.info("study.stopped_by_rule", outcome=decision["outcome"], at=decision["at"])
        self.observer.stopping(f"the [stopping] rule decided at case {decision['at']} ({decision['outcome']}): no new "
                               "case is claimed; the cases in flight finish and count")
        self.drain()

    def _keep(self, result: ArmResult) -> ArmResult:
        """Record an arm in the journal as soon as it ends, so that a kill keeps its work (the case stays claimed
        until its verdict); a record that fails here is made again with the verdict, or the case is settled."""
        entries = [(c.call_id, c.receipt_ref.path, c.receipt_ref.sha256) for c in result.calls()
                   if c.receipt_ref is not None and is_assisted(result.arm)]
        try:
            self.journal.record_arm(result, entries)
        except Exception as exc:
            log.warning("arm.not_recorded_yet", case_id=result.case_id, arm=result.arm, error=one_line(str(exc)))
        return result

    def _spec(self, case: Case, arm: str, peers: Peers) -> ArmSpec:
        """How an arm of a case runs; its q is the one the configuration gives this arm and case (a trigger's arm:
        where its trigger fires, which the fork decides), and how often it may ask (DESIGN §18)."""
        trigger = self.config.trigger_of(arm)
        return ArmSpec(
            arm=arm,
            interval=peers.interval,
            query_step=None if trigger is not None else self.config.query_step(arm, case.horizon),
            trigger=trigger,
            triggers=tuple(self.config.triggers or ()),
            asking=self.config.asking if is_assisted(arm) else None,
            features=bool(self.config.triggers),
            probe_samples=self._probe_samples(arm, trigger),
            profile=self.profile,
            protocol=self.protocol,
            on_steps=self.observer.steps_done,
            experiment=self.study_id,
            stage_key=self.config.rules.stage_key,
            image_size=self.config.env.image_size,
            keepalive_s=self.config.keepalive_s,
            release_while_waiting=self.config.release_simulator_while_waiting,
            frame_sink=self._save_frame if self.config.keyframes else None,
        )

    def _probe_samples(self, arm: str, trigger) -> int:
        """The chunks an arm draws from a probe connection before each query: the leader, for the study's uncertainty
        triggers; an uncertainty trigger's arm that asks again when it fires again, for its own (DESIGN §18)."""
        if base_arm(arm) == "control":
            return max((t.samples or 0 for t in self.config.triggers or [] if t.kind == "uncertainty"), default=0)
        asking = self.config.asking
        if trigger is not None and trigger.kind == "uncertainty" and asking is not None and asking.again == "fires":
            return int(trigger.samples or 0)
        return 0

    def _save_frame(self, case_id: str, arm: str, name: str, pixels) -> str:
        """Store a keyframe as PNG in the study folder; return its sha256."""
        from rescue.core.images import encode_png

        data = encode_png(pixels)
        path = self.layout.keyframe(case_id, arm, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return digest_bytes(data)

    async def _connect(self, peers: Peers, url: str | None = None) -> AsyncRuleWrapper:
        # Each connection to the next policy URL (one per policy process), unless the caller chose it.
        client = await peers.connect_policy(url or peers.next_policy_url())
        # The configured correction rules sit between the policy and the simulator; firings go to the arm record.
        return AsyncRuleWrapper(client, self.config.rules, self.config.interval, strict=not self.config.allow_idle_rules)

    async def _run_one_arm(
        self, case: Case, arm: str, peers: Peers, held: tuple[SimLease, AsyncRuleWrapper] | None
    ) -> ArmResult:
        spec = self._spec(case, arm, peers)
        lease, policy = held if held is not None else (None, None)
        try:
            if lease is None:
                lease = await SimLease(peers.pool, task=(case.suite, case.task_id)).acquire()
            if policy is None:
                policy = await self._connect(peers)
            advisor = self._advisor_for(arm, peers, case)
            again = self._advisor_for(arm, peers, case, first=False)
            self.observer.arm_started(arm)
            try:
                return self._keep(await run_arm(case, spec, lease, policy, advisor, again))
            finally:
                self.observer.arm_finished(arm)
        except Exception as exc:
            return _infrastructure_error(case, arm, exc)
        finally:
            if policy is not None:
                await policy.close()
            if lease is not None:
                lease.release()

    async def _run_forked(
        self, case: Case, peers: Peers, held: tuple[SimLease, AsyncRuleWrapper]
    ) -> list[ArmResult]:
        leases: list[SimLease] = [held[0]]
        policies: list[AsyncRuleWrapper] = [held[1]]
        names = list(self.config.case_arms)

        async def sim_at_q() -> SimLease:
            leases.append(await SimLease(peers.pool, task=(case.suite, case.task_id)).acquire())
            return leases[-1]

        async def connect() -> AsyncRuleWrapper:
            policies.append(await self._connect(peers))
            return policies[-1]

        # One answer per arm at q, whatever the number of its continuations: they share the call (DESIGN §13); each
        # later call of an arm is its own (DESIGN §18).
        bases = list(dict.fromkeys(base_arm(name) for name in names if name != "control"))
        advisors = {base: _once(self._advisor_for(base, peers, case)) for base in bases}
        again = {base: self._advisor_for(base, peers, case, first=False) for base in bases}
        followers = [Follower(self._spec(case, name, peers), sim_at_q, connect, advisors.get(base_arm(name)),
                              again.get(base_arm(name)))
                     for name in names if name != "control"]
        for arm in names:
            self.observer.arm_started(arm)
        try:
            # Without RNG control nothing can put a fresh connection where the prefix left the policy's RNG:
            # a stateless policy's followers continue at once (a study made before this was recorded replays).
            return await run_forked(
                case, self._spec(case, "control", peers), (leases[0], policies[0]), followers,
                control_done=leases[0].release, replay=self.config.policy.rng_control is not False, on_result=self._keep,
                probe=connect,
            )
        except Exception as exc:
            return [_infrastructure_error(case, arm, exc) for arm in names]
        finally:
            for arm in names:
                self.observer.arm_finished(arm)
            for policy in policies:
                await policy.close()
            for lease in leases:
                lease.release()

    def _advisor_for(self, arm: str, peers: Peers, case: Case, first: bool = True):
        """Who answers an arm at q: its advisor's VLM (assisted, assisted:<name>), the sham's declared source
        (sham), nobody (control); every continuation of an arm is its arm's. `first=False`: who answers its later
        calls (DESIGN §18): its advisor's VLM, in calls no sham arm waits for."""
        arm = base_arm(arm)
        if is_assisted(arm):
            # A query point's arm asks its advisor (the primary's) at its own q, in a call of its own.
            return self._advisor(peers.advisors.get(base_arm(arm, query_point=False)), arm, first)
        if arm == "sham":
            return self.sham.advisor(case)
        return None

    def _advisor(self, vlm: VLMClient | None, arm: str, first: bool = True):
        # A sham arm waits for its donor's first answer, never for a later one.
        donor = first and arm == self._donor_arm

        async def ask(case_id: str, instruction: str, remaining: int, views: dict) -> Answer:
            self.observer.vlm_waiting(+1)
            try:
                answer = await vlm.ask(SubgoalRequest(case_id=case_id, instruction=instruction, remaining_steps=remaining,
                                                      views=views, arm=arm))
            finally:
                self.observer.vlm_waiting(-1)
            if donor:
                # A sham arm whose donor this case is may be waiting for exactly this answer (of the declared advisor).
                self.sham.heard(case_id, answer)
            return answer

        return ask if vlm is not None else None


def _infrastructure_error(case: Case, arm: str, exc: Exception) -> ArmResult:
    return ArmResult(
        case_id=case.case_id,
        arm=arm,
        status="error",
        error=error_line(exc),
        error_detail=str(exc),
        assistance=Assistance(status="control" if base_arm(arm) == "control" else "not_reached"),
    )


def _once(ask):
    """An advisor asked once, however many arms ask it: the continuations of one arm share its answer."""
    if ask is None:
        return None
    task: asyncio.Future | None = None

    async def shared(*args):
        nonlocal task
        if task is None:
            task = asyncio.ensure_future(ask(*args))
        # A waiter stopped (a second signal) leaves the call to the others.
        return await asyncio.shield(task)

    return shared


async def run_study(
    study_dir: Path,
    on_case: RunObserver | Callable[[Verdict], None] | None = None,
    vlm_api_key: Any = None,
    backend: Backend = LOCAL,
    lab_budget: float | None = None,
) -> None:
    """Run (or go on with) every never-claimed case of a study; then store its summary for verify.

    vlm_api_key: keys given in the configuration the study was created from (never stored), by advisor arm
    (`StudyConfig.given_keys`), or the primary advisor's one key.
    backend: where the simulators run (local processes, or Ray actors); the journal stays here.
    lab_budget: the lab budget's cap for this run instead of the study's `[vlm] lab_budget`.
    """
    layout = StudyLayout.of(study_dir)
    config = load_study_config(layout.root)
    if isinstance(vlm_api_key, dict):
        config = config.with_keys(vlm_api_key)
    elif vlm_api_key is not None:
        config = config.with_keys({config.primary_arm: vlm_api_key})
    log.info("study.backend", backend=backend.describe())
    async with start_peers(config, layout, backend, lab_budget) as peers:
        engine = Engine(layout.root, config, peers, on_case)
        try:
            await engine.run()
        finally:
            engine.journal.close()
    if not config.is_evaluation:
        store_summary(layout.root)


