"""The arm runner: one full replay of a case under one arm spec.

Both arms reset the case identically, query the policy every C steps and
record a query trace. The assisted arm, at the query point q, renders the
three views, asks the VLM once while the simulator waits, and from q on sends
the injected instruction. Keepalive probes hold the policy connection open
during the wait without inference and without touching the policy's RNG.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np
import structlog

from rescue.core.actions import checked_chunk
from rescue.core.asking import AskingConfig, TriggerConfig
from rescue.core.digest import digest_array, digest_obs, digest_text
from rescue.core.episode_protocol import RESCUE, EpisodeProtocol
from rescue.core.failfast import error_line, one_line
from rescue.core.images import VLM_VIEWS, view_digests
from rescue.core.manifest import Case
from rescue.core.observation import PRIVILEGED, ObservationProfile
from rescue.core.querypoint import query_point
from rescue.core.arms import ArmName, base_arm
from rescue.core.records import Answer, ArmResult, Assistance, QueryRecord
from rescue.core.trace import TraceRow, chained
from rescue.core.triggers import dispersion, fires
from rescue.env.pool import SimLease, Simulator
from rescue.policy.protocol import PolicyConnection
from rescue.policy.wires import is_stepwise
from rescue.run.diagnose import ee_position, query_record
from rescue.run.stepwise import run_stepwise
from wrappers.injection import inject

log = structlog.get_logger()

# ask(case_id, instruction, remaining_steps, views) -> the answer its arm applies (the VLM's, or a sham source's).
Advisor = Callable[[str, str, int, dict[str, np.ndarray]], Awaitable[Answer]]


class KeepaliveError(RuntimeError):
    """The policy connection or its RNG changed while the arm waited for the VLM."""


@dataclass
class ArmSpec:
    """How to run an arm: its name, the replan interval C and the query-point options."""

    arm: ArmName
    interval: int
    image_size: int = 256
    keepalive_s: float = 120.0
    release_while_waiting: bool = True
    # Keyframes for a person to look at: (case_id, arm, name, pixels) -> sha256 of the stored image.
    frame_sink: Callable[[str, str, str, np.ndarray], str] | None = None
    keyframe_view: str = "agentview"
    keyframe_size: int = 128
    # What the policy receives (DESIGN §7): cameras, keys, state layout, instruction key.
    profile: ObservationProfile = PRIVILEGED
    # How the episode starts (rescue/core/episode_protocol.py); recorded on the arm.
    protocol: EpisodeProtocol = RESCUE
    # Told the env steps of every chunk the arm ran (a live view's progress and ETA).
    on_steps: Callable[[int], None] | None = None
    # Named in openpi's episode-start message, for servers that accept it.
    experiment: str = "rescue"
    # The reply key under which the policy reports its stage (recorded per query; the rules read it too).
    stage_key: str = "phase"
    # q: the env step the arm asks at (and, forked, forks at), as the study's configuration gives it for this arm
    # and case (StudyConfig.query_step); None: the pre-registered q = ceil(H/2/C)*C (an arm run outside a study).
    query_step: int | None = None
    # A trigger's arm (DESIGN §18): its q is the step its trigger fires at on the shared prefix, which the fork
    # decides and sets; until then (and when it never fires) the arm asks nowhere.
    trigger: TriggerConfig | None = None
    # The study's triggers (a random placebo's first step is its matched trigger's).
    triggers: tuple[TriggerConfig, ...] = ()
    # How many calls the arm may make and when it asks again (None: once).
    asking: AskingConfig | None = None
    # Whether each query records what triggers read (the task's object, the gripper command): a study with triggers.
    features: bool = False
    # K chunks drawn before each query from a probe connection of the arm's own (an uncertainty trigger); 0: none.
    probe_samples: int = 0


async def query_policy(policy: PolicyConnection, obs: dict, step: int, firings: list | None) -> dict:
    """One policy query; a rule wrapper (it keeps `firings`) is told the step so each firing names it."""
    if firings is not None:
        return await policy.infer(obs, step=step)  # type: ignore[call-arg]
    return await policy.infer(obs)


async def wait_with_keepalive(policy: PolicyConnection, answer: Awaitable[Any], every_s: float, case_id: str) -> Any:
    """Await the VLM answer while probing the policy connection; assert its RNG is untouched."""
    before = await policy.keepalive()
    task = asyncio.ensure_future(answer)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                break
            probe = await policy.keepalive()
            _check_same(before, probe, case_id)
        after = await policy.keepalive()
        _check_same(before, after, case_id)
        return task.result()
    finally:
        if not task.done():
            task.cancel()


def _check_same(before: Any, after: Any, case_id: str) -> None:
    if before is None or after is None:
        return
    fields = ("digest", "requests", "connection_id", "server_instance")
    changed = [f for f in fields if getattr(before, f) != getattr(after, f)]
    if changed:
        raise KeepaliveError(f"case {case_id}: policy {', '.join(changed)} changed during the VLM wait")


class ArmRun:
    """One arm in progress: reset, run to a step, assist at q, finish. Both modes are built from it."""

    def __init__(self, case: Case, spec: ArmSpec, sim: Simulator | None, policy: PolicyConnection | None,
                 advisor: Advisor | None = None, again: Advisor | None = None):
        self.case, self.spec, self.sim, self.advisor = case, spec, sim, advisor
        # Who answers the arm's later calls (DESIGN §18): a call of its own each time.
        self.again_advisor = again or advisor
        self.horizon, self.interval = case.horizon, spec.interval
        if spec.trigger is not None:
            self.q = self.horizon  # asks nowhere until its trigger fires (the fork sets q then)
        else:
            self.q = query_point(self.horizon, self.interval) if spec.query_step is None else spec.query_step
        self.log = log.bind(case_id=case.case_id, arm=spec.arm)
        self.started = time.time()
        self.trace: list[TraceRow] = []
        self.is_control = base_arm(spec.arm, query_point=False) == "control"
        self.assistance = Assistance(status="control" if self.is_control else "not_reached")
        self.fingerprint: str | None = None
        self.fingerprint_parts: dict[str, str] = {}
        self.python_hash_seed: str | None = None
        self.image_keys = {c.key for c in spec.profile.cameras}
        self.step, self.success, self.done = 0, False, False
        self.q_state: str | None = None
        # The views rendered at q (digests), those rendered again after a restore, and (a fork's
        # follower) the views its first render after restoring the leader's snapshot gave.
        self.q_render: dict[str, str] | None = None
        self.restored_render: dict[str, str] | None = None
        self.q_views: dict | None = None
        self.episode_markers = False  # whether openpi's episode frames went to the server
        self.policy: PolicyConnection | None = None
        self.firings: list[dict] | None = None
        self.rng_control: bool | None = None
        if policy is not None:
            self.attach(policy)
        self.queries: list[tuple[int, dict]] = []  # (step, policy input) of the prefix, for a fork's replay
        # A fork's follower: whether it replayed the prefix through its own connection, and the seed its policy
        # RNG was reset to at q (a continuation after the first, under RNG control).
        self.prefix_replayed: bool | None = None
        self.continuation_seed: int | None = None
        # A fork's leader: its state digest and render at each declared extra query point (DESIGN §14).
        self.fork_points: dict[int, tuple[str | None, dict[str, str]]] = {}
        self.keyframes: dict[str, str] = {}
        self.query_records: list[QueryRecord] = []
        self.again: list[Assistance] = []  # the later calls (DESIGN §18)
        self.original = self.instruction = ""
        self.obs: dict = {}
        self.action_space = None  # the simulator's, from the reset: every chunk is checked against it
        # What triggers read (DESIGN §18): the task's object where the simulator names it, the probe connection
        # that draws K chunks before each query, and the features of the current step, measured once.
        self.object_pos: tuple[float, float, float] | None = None
        self.probe: PolicyConnection | None = None
        self._now: QueryRecord | None = None
        # A fork's leader in a study with triggers keeps every query's input (a follower may fork at any step).
        self.keep_all_queries = False
        self.trigger_steps: dict[str, int | None] = {}

    def attach(self, policy: PolicyConnection) -> None:
        """The policy connection the arm queries (a fork's follower gets its own at q)."""
        self.policy = policy
        # Rules between policy and simulator (wrappers/async_rules.py) log their firings here.
        self.firings = getattr(policy, "firings", None)
        self.rng_control = bool(policy.supports_rng)

    async def start(self) -> None:
        """Reset the case, check its instruction, reset the policy and its RNG."""
        self.log.info("arm.started", horizon=self.horizon, query_step=self.q)
        reset = await self.sim.reset(self.case, self.spec.profile, self.spec.protocol)
        self.fingerprint = reset.fingerprint
        self.fingerprint_parts = dict(reset.fingerprint_parts)
        self.python_hash_seed = reset.info.get("python_hash_seed")
        self.action_space = reset.action_space
        self.original = self.instruction = reset.instruction
        if self.case.instruction not in (None, self.original):
            raise ValueError(f"manifest instruction {self.case.instruction!r} differs from the task's {self.original!r}")
        await self.start_policy()
        self.obs = reset.obs
        self.object_pos = _object_pos(reset.info)

    async def start_policy(self) -> None:
        """Reset the policy and, with the RNG extension, its random stream to the case's policy seed."""
        await self.policy.reset()
        if self.rng_control:
            await self.policy.reset_rng(self.case.policy_seed)
        else:
            # Recorded on the arm (policy_rng_control); the study discloses its mode once (DESIGN §13).
            self.log.info("arm.no_rng_control", reason="no RNG extension: this arm is a fresh draw of the policy")
        if self.spec.protocol.episode_markers == "announced":
            marked = await self.policy.episode_start(
                self.spec.experiment, self.original, f"{self.case.case_id}/{self.spec.arm}",
                task_info={"suite": self.case.suite, "task_id": self.case.task_id,
                           "episode_idx": self.case.init_state_index})
            self.episode_markers = marked is not None

    async def end_policy(self, success: bool | None) -> None:
        """Tell a server that accepts it the episode ended; best effort (the record is already complete)."""
        if not self.episode_markers:
            return
        try:
            await self.policy.episode_end(success)
        except Exception as exc:
            self.log.warning("arm.episode_end_failed", error=one_line(str(exc)))

    async def run_until(self, limit: int) -> None:
        """Query and step until `limit` steps (or the horizon, or success)."""
        while not self.done and self.step < min(limit, self.horizon):
            if self.step >= self.q and self.q_state is None:
                self.q_state = await self._state_digest()
            if self.step >= self.q and not any(k.startswith("q") for k in self.keyframes):
                await self.keyframe(f"q{self.step}")
            now = await self.observe_now()
            if not self.is_control and self.step >= self.q and self.assistance.status == "not_reached":
                views = self.q_views if self.q_views is not None else await self.sim.render(list(VLM_VIEWS), self.spec.image_size)
                self.q_render = view_digests(views)
                self.assistance, self.restored_render = await _assist(
                    self.case, self.spec, self.sim, self.policy, self.advisor, self.original, self.horizon - self.step,
                    self.step, views,
                )
                if self.assistance.status == "applied":
                    self.instruction = self.assistance.instruction
            elif not self.is_control and self.asks_again(now):
                await self.ask_again()
            policy_input = self.spec.profile.policy_input(self.obs, self.instruction)
            if self.step < self.q or self.keep_all_queries:
                self.queries.append((self.step, policy_input))
            reply = await query_policy(self.policy, policy_input, self.step, self.firings)
            self.query_records.append(
                query_record(self.step, self.obs, reply, self.spec.stage_key, getattr(self.policy, "last_query", None))
            )
            # Only the first C actions run; the rest of a longer chunk is dropped,
            # so nothing planned under an old instruction survives the next query.
            # The chunk is the one after any rules: the trace digests what runs.
            # Checked before the simulator sees it (rescue/core/actions.py): refused or clipped there.
            due = min(self.interval, self.horizon - self.step)
            last = self.step + due >= self.horizon
            result = None
            if is_stepwise(self.policy):  # one observation per env step for one action each (vla-eval's wire)
                chunk, result = await run_stepwise(self, reply, due, last, query_policy)
            else:
                chunk = self.spec.protocol.executed(checked_chunk(
                    reply, interval=self.interval, due=due, space=self.action_space,
                    policy=getattr(self.policy, "url", type(self.policy).__name__), step=self.step))
            if now is not None:
                # What a trigger reads at this query, and the gripper command of the chunk that runs from it.
                self.query_records[-1] = self.query_records[-1].model_copy(update={
                    "object_pos": now.object_pos, "dispersion": now.dispersion,
                    "gripper": float(chunk[min(due, len(chunk)) - 1][-1])})
            row = TraceRow(
                step=self.step,
                state=digest_obs({k: v for k, v in self.obs.items() if k not in self.image_keys}),
                images=self.spec.profile.image_digests(self.obs),
                instruction=digest_text(self.instruction),
                actions=digest_array(chunk),
            )
            self.trace.append(chained(self.trace, row))
            # Images are rendered only for an observation a policy query will read.
            if result is None:
                result = await self.sim.run_chunk(chunk, due, "never" if last else "unless_success")
            self.step += result.steps
            if self.spec.on_steps is not None:
                self.spec.on_steps(result.steps)
            self.obs = result.obs
            self.object_pos = _object_pos(result.info)
            if result.success:
                self.success = self.done = True
        if self.step >= self.horizon:
            self.done = True
        if self.done and "end" not in self.keyframes:
            await self.keyframe("end")

    async def observe_now(self) -> QueryRecord | None:
        """What a trigger reads at the current step, before its query (DESIGN §18): the end effector's and the task
        object's positions, and, with a probe connection, how much K chunks drawn for this observation disagree.
        Measured once per step; None in a study without triggers."""
        if not self.spec.features:
            return None
        if self._now is not None and self._now.step == self.step:
            return self._now
        spread = None
        if self.probe is not None and self.spec.probe_samples > 1:
            policy_input = self.spec.profile.policy_input(self.obs, self.instruction)
            chunks = []
            for _ in range(self.spec.probe_samples):
                reply = await query_policy(self.probe, policy_input, self.step, getattr(self.probe, "firings", None))
                chunks.append(np.asarray(reply["actions"]))
            spread = dispersion(chunks, min(self.interval, self.horizon - self.step))
        self._now = QueryRecord(step=self.step, ee_pos=ee_position(self.obs), object_pos=self.object_pos,
                                dispersion=spread)
        return self._now

    async def start_probe(self, probe: PolicyConnection) -> None:
        """Take the probe connection an uncertainty trigger draws from: reset, its RNG seeded apart from the arm's."""
        self.probe = probe
        await probe.reset()
        if probe.supports_rng:
            await probe.reset_rng(probe_seed(self.case.policy_seed))

    def asks_again(self, now: QueryRecord | None) -> bool:
        """Whether the arm asks again at this step (DESIGN §18): below `max_calls`, its last call answered (applied
        or declined: a call that failed ends its asking), and the rule says so: `every_queries` after its last
        call, or its trigger firing again on its own queries since then."""
        asking = self.spec.asking
        made = [a for a in (self.assistance, *self.again) if a.query_step is not None]
        if asking is None or not made or len(made) >= asking.max_calls or made[-1].status not in ("applied", "declined"):
            return False
        last = made[-1].query_step
        if asking.again == "fires" and self.spec.trigger is not None:
            rows = [*self.query_records, *([now] if now is not None else [])]
            return fires(self.spec.trigger, rows, self.step, self.case.case_id, self.horizon, self.interval, last,
                         self.spec.triggers)
        return self.step == last + asking.every_queries * self.interval

    async def ask_again(self) -> None:
        """A later call (DESIGN §18): the views now, a call of its own; an applied subgoal replaces the last."""
        views = await self.sim.render(list(VLM_VIEWS), self.spec.image_size)
        call, _ = await _assist(self.case, self.spec, self.sim, self.policy, self.again_advisor, self.original,
                                self.horizon - self.step, self.step, views)
        self.again.append(call)
        if call.status == "applied":
            self.instruction = call.instruction

    async def keyframe(self, name: str) -> None:
        """Render and hand one view to the frame sink (only when keyframes are asked for)."""
        sink = self.spec.frame_sink
        if sink is None:
            return
        frames = await self.sim.render([self.spec.keyframe_view], self.spec.keyframe_size)
        self.keyframes[name] = sink(self.case.case_id, self.spec.arm, name, frames[self.spec.keyframe_view])

    async def _state_digest(self) -> str | None:
        try:
            return await self.sim.state_digest()
        except Exception:  # an adapter without state digests: the proof rests on the trace alone
            return None

    def result(self, error: Exception | None = None, mode: str = "independent") -> ArmResult:
        """The arm's record; an error makes it an infrastructure failure, never a policy failure."""
        if error is not None:
            self.log.warning("arm.error", error=error_line(error), step=self.step)
        else:
            self.log.info("arm.finished", success=self.success, steps=self.step, assistance=self.assistance.status)
        return ArmResult(
            case_id=self.case.case_id,
            arm=self.spec.arm,
            status="complete" if error is None else "error",
            error=None if error is None else error_line(error),
            error_detail=None if error is None else str(error),
            success=self.success if error is None else None,
            steps=self.step,
            fingerprint=self.fingerprint,
            fingerprint_parts=dict(self.fingerprint_parts),
            python_hash_seed=self.python_hash_seed,
            trace=self.trace,
            assistance=self.assistance,
            again=list(self.again),
            trigger_steps=dict(self.trigger_steps),
            rule_firings=list(self.firings or []),
            idle_rules=list(getattr(self.policy, "idle_rules", [])),
            policy_rng_control=self.rng_control,
            mode=mode,
            prefix_replayed=self.prefix_replayed,
            continuation_seed=self.continuation_seed,
            fork_states={q: state for q, (state, _) in self.fork_points.items()},
            fork_renders={q: render for q, (_, render) in self.fork_points.items()},
            episode_protocol=self.spec.protocol.name,
            episode_markers=self.episode_markers,
            q_state=self.q_state,
            q_render=self.q_render,
            restored_render=self.restored_render,
            keyframes=dict(self.keyframes),
            queries=list(self.query_records),
            started_at=self.started,
            finished_at=time.time(),
        )


def _object_pos(info: dict) -> tuple[float, float, float] | None:
    """The task object's position a simulator reported beside an observation (None: it names none)."""
    pos = (info or {}).get("object_pos")
    return None if pos is None else (float(pos[0]), float(pos[1]), float(pos[2]))


def probe_seed(policy_seed: int) -> int:
    """The seed an uncertainty trigger's probe connection starts from: its own stream, apart from every arm's."""
    return int.from_bytes(hashlib.sha256(f"probe:{int(policy_seed)}".encode()).digest()[:4], "big") >> 1


async def run_arm(
    case: Case,
    spec: ArmSpec,
    sim: Simulator,
    policy: PolicyConnection,
    advisor: Advisor | None = None,
    again: Advisor | None = None,
) -> ArmResult:
    """Replay one case under one arm; infrastructure failures become an `error` result, never an exception.
    `again`: who answers the arm's later calls (DESIGN §18; None: `advisor`)."""
    arm = ArmRun(case, spec, sim, policy, advisor, again)
    try:
        await arm.start()
        await arm.run_until(arm.horizon)
    except Exception as exc:  # the arm's record carries the failure; the case stays in the denominator
        await arm.end_policy(None)
        return arm.result(exc)
    await arm.end_policy(arm.success)
    return arm.result()


async def _assist(
    case: Case,
    spec: ArmSpec,
    sim: Simulator,
    policy: PolicyConnection,
    advisor: Advisor | None,
    original: str,
    remaining: int,
    step: int,
    views: dict,
) -> tuple[Assistance, dict[str, str] | None]:
    """Ask once with the views rendered at q (the simulator waits) and build the injected instruction.

    Returns the assistance and, when the arm came back on another simulator (restored from its
    snapshot), the digests of the views rendered there, which must equal those it left with."""
    if advisor is None:
        return Assistance(status="broker_error", query_step=step, error_kind="no_advisor", error="no VLM configured"), None
    # While the VLM thinks, the simulator is not ours to hold: a lease snapshots it and lets
    # another arm step it; the simulated clock does not move for this arm either way.
    # A sham arm may wait on its donor's VLM answer: it always gives its simulator back meanwhile,
    # so donors can never be starved of simulators by the arms waiting for them.
    release = (spec.release_while_waiting or base_arm(spec.arm, query_point=False) == "sham") and isinstance(sim, SimLease)
    restored_render = None
    if release:
        await sim.suspend()
    try:
        answer = await wait_with_keepalive(
            policy, advisor(case.case_id, original, remaining, views), spec.keepalive_s, case.case_id
        )
    finally:
        if release:
            await sim.resume()
    if release and sim.restored:
        restored_render = view_digests(await sim.render(list(VLM_VIEWS), spec.image_size))
        before = view_digests(views)
        differ = sorted(c for c in before if before[c] != restored_render.get(c))
        if differ:
            raise RuntimeError(f"after the VLM wait the restored simulator renders {', '.join(differ)} otherwise than "
                               "before it")
    common = dict(
        query_step=step, call_id=answer.call_id, request_id=answer.request_id, receipt_ref=answer.receipt_ref,
        source=answer.source, source_sha256=answer.source_sha256, donor_case_id=answer.donor_case_id,
    )
    if answer.status == "declined":
        return Assistance(status="declined", **common), restored_render
    if answer.status != "ok":
        return Assistance(status=answer.status, error_kind=answer.error_kind, error=answer.error, **common), restored_render
    applied = inject(original, answer.subgoal)
    return Assistance(
        status="applied",
        subgoal=answer.subgoal,
        instruction=applied,
        instruction_digest=digest_text(applied),
        **common,
    ), restored_render
